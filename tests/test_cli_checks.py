"""Bad command-line input: one ``error: ...`` line naming the problem, a non-zero exit, no traceback, and the
model never loaded (every check runs before it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import refused

import dllm.models
from dllm.cli import main


class ModelLoaded(AssertionError):
    pass


def refuse_loading(*args, **kwargs):
    raise ModelLoaded("the model was loaded before the bad argument was refused")


@pytest.fixture
def no_model(monkeypatch):
    """Loading any model fails the test (the CLI imports the loader from ``dllm.models`` at call time)."""
    monkeypatch.setattr(dllm.models, "load_model", refuse_loading)




# ------------------------------------------------------------------------------------------------ generate


def test_generate_batch_file_problems(tmp_path, capsys, no_model):
    refused(capsys, ["generate", "--batch-file", str(tmp_path)], "--batch-file", "is a directory")
    refused(capsys, ["generate", "--batch-file", str(tmp_path / "none.txt")], "--batch-file", "no such file")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    refused(capsys, ["generate", "--batch-file", str(empty)], "has no prompts")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"ok\n\xff\xfe\x00\n")
    refused(capsys, ["generate", "--batch-file", str(binary)], "not UTF-8")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "fine"}\n{"prompt": oops}\n')
    refused(capsys, ["generate", "--batch-file", str(bad_json)], f"{bad_json}:2", "JSON object")
    bad_prompt = tmp_path / "bad_prompt.jsonl"
    bad_prompt.write_text('{"prompt": 5}\n')
    refused(capsys, ["generate", "--batch-file", str(bad_prompt)], f"{bad_prompt}:1", '"prompt" must be')


def test_generate_bad_escape(capsys, no_model):
    refused(capsys, ["generate", r"caf\x", "--escapes"], "--escapes", "bad escape")


def test_generate_trace_out_checked_first(tmp_path, capsys, no_model):
    refused(capsys, ["generate", "hi", "--trace-out", str(tmp_path / "t.txt")], "--trace-out", ".png, .gif or .html")
    refused(capsys, ["generate", "hi", "--trace-out", str(tmp_path / "t")], "--trace-out", "no extension")
    refused(capsys, ["generate", "hi", "--trace-out", str(tmp_path / "missing" / "t.png")], "does not exist")
    refused(capsys, ["generate", "hi", "--trace-out", str(tmp_path)], "--trace-out", "is a directory")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="needs file permissions that bind")
def test_generate_trace_out_unwritable_directory(tmp_path, capsys, no_model):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        refused(capsys, ["generate", "hi", "--trace-out", str(ro / "t.html")], "--trace-out", "permission denied")
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("argv, needles", [
    (["--sampler", "llada", "--param", "bogus=1"], ["no parameter", "bogus", "temperature"]),
    (["--sampler", "llada", "--param", "temperature=abc"], ["temperature='abc' is not a number", "0.0"]),
    (["--sampler", "llada", "--param", "remasking=bogus"], ["remasking", "bogus"]),
    (["--sampler", "nope"], ["unknown sampler 'nope'"]),
    (["--gen-length", "-5"], ["gen_length", "-5"]),
    (["--steps", "0"], ["steps", "0"]),
    (["--gen-length", "30", "--block-length", "8"], ["not a multiple of block_length"]),
    (["--gen-length", "32", "--block-length", "8", "--steps", "6"], ["steps (6) must divide evenly"]),
    (["--sampler", "fast-dllm", "--gen-length", "30", "--block-length", "8"], ["not a multiple of block_length"]),
    (["--sampler", "fast-dllm", "--gen-length", "48"], ["not a multiple of block_length (32)",
                                                         "preferred block length of sampler 'fast-dllm'"]),
    (["--sampler", "multiblock", "--gen-length", "64", "--block-length", "24"], ["multi-block block_length (24)"]),
    (["--model", "sdar-tiny", "--gen-length", "64", "--steps", "5"], ["aligned blocks of 4", "steps (5)"]),
    (["--model", "sdar-tiny", "--sampler", "fast-dllm", "--gen-length", "48", "--steps", "6"],
     ["aligned blocks of 4"]),
    (["--model", "sdar-tiny", "--gen-length", "64", "--block-length", "5"], ["not a multiple of block_length (5)"]),
    (["--model", "fastdllm2-tiny", "--gen-length", "64", "--steps", "5"], ["aligned blocks of 32"]),
    (["--cache", "nope"], ["--cache", "known caches"]),
    (["--dtype", "float8"], ["--dtype", "float8", "bfloat16"]),
    (["--model", "/nonexistent/dir"], ["does not exist"]),
])
def test_generate_decode_options_checked_before_loading(argv, needles, capsys, no_model):
    refused(capsys, ["generate", "hi", *argv], *needles)


def test_generate_guide_checked_before_loading(tmp_path, capsys, no_model):
    refused(capsys, ["generate", "hi", "--guide", str(tmp_path)], "--guide", "no config.json", "ar-tiny")
    refused(capsys, ["generate", "hi", "--guide", str(tmp_path / "none")], "not a directory", "ar-tiny")


def test_generate_model_file_instead_of_directory(tmp_path, capsys, no_model):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    refused(capsys, ["generate", "hi", "--model", str(f)], str(f))


def test_cli_subprocess_prints_no_traceback(tmp_path):
    """The installed entry point (a real process): a directory as --batch-file is one line and exit code 2."""
    res = subprocess.run([sys.executable, "-m", "dllm.cli", "generate", "--batch-file", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [f"error: --batch-file {tmp_path} is a directory; give a file"]


# ------------------------------------------------------------------------------------------------ eval

GSM8K = Path(__file__).resolve().parent / "fixtures" / "eval" / "gsm8k.jsonl"
EVAL = ["eval", "gsm8k", "--model", "llada-tiny", "--data", str(GSM8K), "--shots", "0", "--limit", "1",
        "--gen-length", "8", "--block-length", "8", "--no-progress"]


def test_eval_out_is_an_existing_file(tmp_path, capsys, no_model):
    f = tmp_path / "results.txt"
    f.write_text("x")
    refused(capsys, [*EVAL, "--out", str(f)], f"--out {f} is a file", "results directory", "resume")
    assert f.read_text() == "x"


@pytest.mark.parametrize("argv, needles", [
    (["--batch-size", "0"], ["--batch-size must be >= 1"]),
    (["--limit", "0"], ["--limit must be >= 1"]),
    (["--timeout", "0"], ["--timeout must be > 0"]),
    (["--memory-mb", "-1"], ["--memory-mb must be >= 1"]),
    (["--shots", "-1"], ["--shots must be >= 0"]),
    (["--sampler", "llada", "--param", "tau=0.5"], ["no parameter", "tau"]),
    (["--sampler", "dream", "--param", "eps=small"], ["eps='small' is not a number"]),
    (["--cache", "nope"], ["--cache", "known caches"]),
    (["--gen-length", "0"], ["gen_length"]),
])
def test_eval_arguments_checked_before_loading(argv, needles, tmp_path, capsys, no_model):
    refused(capsys, [*EVAL, "--out", str(tmp_path / "out"), *argv], *needles)
    assert not (tmp_path / "out").exists()  # nothing written either


def test_eval_data_is_a_directory(tmp_path, capsys, no_model):
    refused(capsys, ["eval", "gsm8k", "--data", str(tmp_path), "--out", str(tmp_path / "o")], "--data", "is a directory")


def test_eval_log_level_is_a_choice(tmp_path, capsys, no_model):
    with pytest.raises(SystemExit) as exc:
        main([*EVAL, "--out", str(tmp_path / "o"), "--log-level", "loud"])
    assert exc.value.code == 2
    assert "invalid choice: 'loud'" in capsys.readouterr().err


def test_eval_out_resumes_or_refuses_before_loading(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main([*EVAL, "--out", str(out)]) == 0
    assert "resuming" not in capsys.readouterr().err
    assert main([*EVAL, "--out", str(out)]) == 0  # the same settings: resumed, said so
    assert "resuming an earlier run with these settings" in capsys.readouterr().err
    with monkeypatch.context() as m:
        m.setattr(dllm.models, "load_model", refuse_loading)
        line = refused(capsys, [*EVAL, "--out", str(out), "--steps", "4"], "steps: None there, 4 now", "--overwrite")
        assert line.count("steps: None there, 4 now") == 1, line  # one difference, named once
        # the scoring limits, sampler and cache the runner pins are checked here too, not after loading
        refused(capsys, [*EVAL, "--out", str(out), "--timeout", "5"], "timeout: 10.0 there, 5.0 now", "--overwrite")
        refused(capsys, [*EVAL, "--out", str(out), "--memory-mb", "512"], "memory_mb: 1024 there, 512 now")
        run_json = out / "run.json"
        good = run_json.read_text()
        run_json.write_text("{not json")
        refused(capsys, [*EVAL, "--out", str(out)], "run.json is not valid JSON")
        run_json.write_text(good)
    assert main([*EVAL, "--out", str(out), "--steps", "4", "--overwrite"]) == 0
    assert "discarded (--overwrite)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ eval-tasks


@pytest.mark.parametrize("argv, needles", [
    (["--batch-size", "0"], ["--batch-size must be >= 1"]),
    (["--sampler", "llada", "--param", "bogus=1"], ["no parameter", "bogus"]),
    (["--dtype", "int3"], ["--dtype", "int3"]),
])
def test_eval_tasks_arguments_checked_before_loading(argv, needles, capsys, no_model):
    refused(capsys, ["eval-tasks", "--n", "1", *argv], *needles)


def test_eval_tasks_unknown_pattern_before_loading(capsys, no_model):
    refused(capsys, ["eval-tasks", "--tasks", "nothing-like-this"], "no task matches 'nothing-like-this'")


# ------------------------------------------------------------------------------------------------ parallelbench

RUN = ["parallelbench", "run", "--method", "topk:k=1", "--tasks", "waiting_line/reverse", "--n", "1"]


@pytest.mark.parametrize("argv, needles", [
    (["--tasks", "nothing-like-this"], ["--tasks nothing-like-this", "known tasks"]),
    (["--n", "-1"], ["--n must be >= 1"]),
    (["--batch-size", "0"], ["--batch-size must be >= 1"]),
    (["--gen-length", "-4"], ["--gen-length must be >= 1"]),
    (["--cache", "nope"], ["--cache nope", "known caches"]),
    (["--dtype", "f8"], ["--dtype", "f8"]),
    (["--data-dir", "/nonexistent/pb"], ["--data-dir /nonexistent/pb", "no such directory"]),
    (["--samsum", "/nonexistent/samsum.jsonl"], ["--samsum", "no such file"]),
    (["--method", "llada:bogus=1,2"], ["bogus"]),
])
def test_parallelbench_run_checked_before_loading(argv, needles, tmp_path, capsys, no_model):
    refused(capsys, [*RUN, "--out", str(tmp_path / "sweep"), *argv], *needles)
    assert not (tmp_path / "sweep").exists()


def test_parallelbench_out_is_a_file(tmp_path, capsys, no_model):
    f = tmp_path / "f.txt"
    f.write_text("x")
    refused(capsys, [*RUN, "--out", str(f)], f"--out {f} is a file", "resume")
    refused(capsys, ["parallelbench", "generate", "--out", str(f), "--n", "1"], f"--out {f} is a file")


def test_parallelbench_score_and_show_paths(tmp_path, capsys, no_model):
    refused(capsys, ["parallelbench", "score", str(tmp_path)], "is a directory")
    refused(capsys, ["parallelbench", "show", str(tmp_path), "--id", "0", "--out", str(tmp_path / "t.png")],
            "not a sweep directory", "run.json")
    (tmp_path / "run.json").write_text("{broken")
    refused(capsys, ["parallelbench", "show", str(tmp_path), "--id", "0", "--out", str(tmp_path / "t.svg")],
            "--out", ".png, .gif or .html")
    refused(capsys, ["parallelbench", "show", str(tmp_path), "--id", "-2", "--out", str(tmp_path / "t.png")],
            "--id must be >= 0")
    refused(capsys, ["parallelbench", "show", str(tmp_path), "--id", "0", "--out", str(tmp_path / "t.png")],
            "run.json is not a sweep's run file", "--model")


# ------------------------------------------------------------------------------------------------ --param types


@pytest.mark.parametrize("argv, needles", [
    (["--sampler", "ascending", "--param", "per_region=yes"], ["per_region", "true or false"]),
    (["--sampler", "llada", "--param", "temperature=none"], ["--param temperature=none", "wrong type"]),
    (["--sampler", "dream", "--param", "top_p=high"], ["top_p"]),
])
def test_param_types_checked_before_loading(argv, needles, capsys, no_model):
    refused(capsys, ["generate", "hi", *argv], *needles)


def test_param_without_value_before_loading(capsys, no_model):
    refused(capsys, ["generate", "hi", "--sampler", "threshold", "--param", "tau"], "--param expects key=value, got 'tau'")


def test_text_parameter_keeps_its_text(capsys, no_model):
    from dllm.cli.common import parse_params

    assert parse_params(["delimiters=5", "tau=0.5"], "adablock") == {"delimiters": "5", "tau": 0.5}
    assert parse_params(["block_length=none"], "credit") == {"block_length": None}


def test_serve_sampler_and_params_before_loading(capsys, no_model):
    refused(capsys, ["serve", "--sampler", "nope", "--port", "8123"], "unknown sampler 'nope'")
    refused(capsys, ["serve", "--sampler", "llada", "--param", "temperature=hot", "--port", "8123"],
            "temperature='hot' is not a number")
    refused(capsys, ["serve", "--sampler", "ascending", "--param", "per_region=yes", "--port", "8123"],
            pattern="^error: ascending: per_region='yes' is not true or false")  # named once
    refused(capsys, ["serve", "--sampler", "llada", "--param", "tau=0.5", "--port", "8123"], "has no parameter")


# ------------------------------------------------------------------------------------------------ train-tiny


@pytest.mark.parametrize("family", ["llada", "ar"])
@pytest.mark.parametrize("argv, needles", [
    (["--steps", "0"], ["--steps must be >= 1"]),
    (["--batch-size", "-2"], ["--batch-size must be >= 1"]),
    (["--lr", "0"], ["--lr must be > 0"]),
    (["--d-model", "15", "--heads", "2"], ["--d-model 15", "--heads 2"]),
    (["--time-budget", "-1"], ["--time-budget must be > 0"]),
    (["--examples-per-task", "-1"], ["--examples-per-task must be >= 0"]),
])
def test_train_tiny_arguments_checked_before_training(family, argv, needles, tmp_path, capsys, monkeypatch):
    import dllm.tiny.train
    import dllm.tiny.train_ar

    def no_training(*a, **k):
        raise AssertionError("training started before the bad argument was refused")

    monkeypatch.setattr(dllm.tiny.train, "train", no_training)
    monkeypatch.setattr(dllm.tiny.train_ar, "train", no_training)
    refused(capsys, ["train-tiny", "--family", family, "--out", str(tmp_path / "ckpt"), *argv], *needles)
    assert not (tmp_path / "ckpt").exists()


def test_train_tiny_out_is_a_file(tmp_path, capsys):
    f = tmp_path / "ckpt.bin"
    f.write_text("x")
    refused(capsys, ["train-tiny", "--family", "llada", "--out", str(f)], f"--out {f} is a file")


# ------------------------------------------------------------------------------------------------ main


@pytest.mark.parametrize("exc, line", [
    (PermissionError(13, "Permission denied", "/data/out.png"), "error: /data/out.png: Permission denied"),
    (IsADirectoryError(21, "Is a directory", "/data"), "error: /data: Is a directory"),
    (ImportError('trajectory pictures need matplotlib and Pillow: pip install "dllm[viz]"'),
     'error: trajectory pictures need matplotlib and Pillow: pip install "dllm[viz]"'),
    (KeyError("no run named 'x'"), "error: no run named 'x'"),
    (ValueError("first line\n  second line"), "error: first line second line"),
])
def test_main_prints_user_errors_as_one_line(exc, line, capsys, monkeypatch):
    import dllm.cli.generate

    def command(args):
        raise exc

    monkeypatch.setattr(dllm.cli.generate, "cmd_generate", command)
    assert main(["generate", "hi"]) == 2
    assert capsys.readouterr().err == line + "\n"


def test_parallelbench_run_refuses_other_settings_before_loading(tmp_path, capsys, monkeypatch):
    out = tmp_path / "sweep"
    args = [*RUN, "--out", str(out), "--style", "short", "--gen-length", "16", "--no-report"]
    assert main(args) == 0
    assert main(args) == 0  # the same settings resume (the check lets them through)
    assert "[0 samples written, 1 already there" in capsys.readouterr().err
    with monkeypatch.context() as m:
        m.setattr(dllm.models, "load_model", refuse_loading)
        refused(capsys, [*args, "--gen-seed", "3"], "different sweep settings", "gen_seed: 0 there, 3 now",
                "--overwrite")
        refused(capsys, [*args[:-3], "--gen-length", "8", "--no-report"], "gen_length: 16 there, 8 now")
        refused(capsys, [*args, "--style", "full"], "data.style: 'short' there, 'full' now")
        (out / "run.json").write_text("[1, 2]")
        refused(capsys, args, "not a sweep's run file")
        (out / "run.json").write_text("{broken")
        refused(capsys, args, "not a sweep's run file", "--overwrite")
    # what the refusal says to do works: --overwrite discards the results there and writes a new run file
    assert main([*args, "--overwrite"]) == 0
    assert "[1 samples written, 0 already there" in capsys.readouterr().err
    assert json.loads((out / "run.json").read_text())["pinned"]["gen_seed"] == 0
    assert main(args) == 0  # and the next run resumes it
    assert "[0 samples written, 1 already there" in capsys.readouterr().err


def test_generate_guide_options_and_params_must_agree(capsys, no_model):
    """``--guide-mode`` and ``--param mode=...`` (or ``--guide`` and ``--param guide=...``) naming different values
    are refused before loading; the option used to win silently."""
    refused(capsys, ["generate", "hi", "--guide-mode", "deterministic", "--param", "mode=topk"],
            "--guide-mode deterministic and --param mode=topk disagree")
    refused(capsys, ["generate", "hi", "--guide", "ar-tiny", "--param", "guide=other"],
            "--guide ar-tiny and --param guide=other disagree")


# ------------------------------------------------------------------------------------------------ found by the audit


@pytest.mark.parametrize("argv, needles", [
    (["--seed", str(2**70)], ["seed=1180591620717411303424 is out of range", "2**64 - 1"]),
    (["--device", "meta"], ["--device 'meta' holds no data", "'cpu'"]),
    (["--device", "gpu"], ["--device 'gpu' is not a device torch knows"]),
    (["--model", ""], ["--model '' is empty", "llada-tiny"]),
])
def test_generate_seed_device_and_empty_model_checked_before_loading(argv, needles, capsys, no_model):
    """A seed past torch.Generator's range failed after loading ("Overflow when unpacking long long"), --device
    was first checked inside the loader (meta was called a corrupt weights file) and --model '' loaded the
    default model."""
    refused(capsys, ["generate", "hi", "--gen-length", "4", *argv], *needles)


def test_generate_empty_prompts_are_refused(tmp_path, capsys, no_model):
    """An empty PROMPT (an unset shell variable) or {"prompt": ""} line decoded an empty user turn."""
    refused(capsys, ["generate", ""], "PROMPT 1 is empty ('')")
    refused(capsys, ["generate", "ok", "  "], "PROMPT 2 is empty")
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n{"prompt": " "}\n', encoding="utf-8")
    refused(capsys, ["generate", "--batch-file", str(f)], f'{f}:2: "prompt" is empty')


@pytest.mark.parametrize("argv, needles", [
    (["--host", "not a host!"], ["--host 'not a host!' is not an IP address or a host name", "127.0.0.1"]),
    (["--device", "meta"], ["--device 'meta' holds no data"]),
    (["--model", ""], ["--model '' is empty"]),
])
def test_serve_host_device_and_model_before_loading(argv, needles, capsys, no_model):
    """A bad --host loaded the model, then uvicorn failed to bind (exit 3)."""
    refused(capsys, ["serve", "--port", "8123", *argv], *needles)


def test_eval_tasks_and_parallelbench_device_before_loading(tmp_path, capsys, no_model):
    refused(capsys, ["eval-tasks", "--n", "1", "--device", "meta"], "--device 'meta' holds no data")
    refused(capsys, [*RUN, "--out", str(tmp_path / "sweep"), "--device", "meta"], "--device 'meta' holds no data")
    assert not (tmp_path / "sweep").exists()


def test_param_given_twice_and_preset_cache_before_loading(tmp_path, capsys, no_model):
    """A repeated --param silently kept the last value; --param cache=bogus of fast-dllm failed only at generate
    and cache=block on a LLaDA checkpoint after loading; --gen-seed past the generator's range failed after
    loading."""
    refused(capsys, ["generate", "hi", "--sampler", "threshold", "--param", "tau=0.5", "--param", "tau=0.7"],
            "--param tau is given twice (tau=0.5, then 'tau=0.7')")
    refused(capsys, ["serve", "--sampler", "threshold", "--param", "tau=0.5", "--param", "tau=0.5", "--port", "8123"],
            "--param tau is given twice")
    refused(capsys, ["generate", "hi", "--sampler", "fast-dllm", "--param", "cache=bogus"],
            "unknown cache 'bogus'; known caches:")
    refused(capsys, ["generate", "hi", "--sampler", "fast-dllm", "--param", "cache=block"],
            "cache 'block' is the exact cache of block-diffusion checkpoints")
    refused(capsys, [*RUN, "--out", str(tmp_path / "sweep"), "--gen-seed", str(2**70)],
            "--gen-seed: seed=1180591620717411303424 is out of range")
    assert not (tmp_path / "sweep").exists()
