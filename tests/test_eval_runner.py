"""`dllm eval`: resume after a killed run, throughput counting, settings checks, errors."""

import json
from pathlib import Path

import pytest

from dllm.cli import main as cli_main
from dllm.config import GenerateConfig
from dllm.evals.standard import build_prompts, get_standard_task, load_samples
from dllm.evals.standard.runner import read_done, run_standard_eval

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "eval"
GSM8K = FIXTURES / "gsm8k.jsonl"
CONFIG = GenerateConfig(gen_length=16, block_length=16)


@pytest.fixture(scope="module")
def tiny():
    from dllm.assets import model_path
    from dllm.models import load_model

    return load_model(model_path("llada-tiny"))


@pytest.fixture(scope="module")
def gsm8k():
    task = get_standard_task("gsm8k")
    samples, pool = load_samples(task, str(GSM8K), shots=1)
    samples = samples[:6]
    return task, samples, build_prompts(task, samples, pool, 1)


def _run(model, gsm8k, out, **kw):
    task, samples, prompts = gsm8k
    return run_standard_eval(model, task, samples, CONFIG, out, prompts=prompts, settings={"k": 1}, **kw)


def _lines(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


class _Killed(Exception):
    pass


def test_resume_after_kill_loses_and_duplicates_nothing(tiny, gsm8k, tmp_path):
    ref = _run(tiny, gsm8k, tmp_path / "ref", batch_size=2)
    ref_lines = {r["id"]: r for r in _lines(tmp_path / "ref" / "samples.jsonl")}
    assert ref.n == 6 and len(ref_lines) == 6 and ref.written == 6

    out = tmp_path / "run"
    seen = []

    def die_after_three(line):
        seen.append(line["id"])
        if len(seen) == 3:
            raise _Killed

    with pytest.raises(_Killed):
        _run(tiny, gsm8k, out, batch_size=2, on_sample=die_after_three)
    # the three scored samples are on disk already (written and flushed one by one)
    assert len(read_done(out)) == 3 and not (out / "samples.jsonl").exists()
    # simulate a kill in the middle of writing a line: a half line at the end of the shard
    shard = out / "samples.rank0.jsonl"
    shard.write_text(shard.read_text() + '{"id": "5", "output": "tru')

    starts = []
    res = _run(tiny, gsm8k, out, batch_size=2, on_start=lambda todo, done: starts.append((todo, done)))
    assert starts == [(3, 3)] and res.written == 3 and res.already_done == 3
    lines = _lines(out / "samples.jsonl")
    assert [r["id"] for r in lines] == [s.id for s in gsm8k[1]]  # all six, once each, in data order
    assert not list(out.glob("samples.rank*.jsonl"))
    for r in lines:  # the same outputs and scores as an uninterrupted run
        assert (r["output"], r["answer"], r["correct"], r["nfe"], r["tokens"]) == tuple(
            ref_lines[r["id"]][k] for k in ("output", "answer", "correct", "nfe", "tokens"))

    # a third run finds everything done and writes nothing
    again = _run(tiny, gsm8k, out, batch_size=2)
    assert again.written == 0 and again.already_done == 6 and len(_lines(out / "samples.jsonl")) == 6
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 6 and summary["answer_tokens"] == sum(r["tokens"] for r in lines)
    assert "| gsm8k | 6 |" in (out / "summary.md").read_text()


def test_throughput_counts_answer_tokens_only(tiny, gsm8k, tmp_path):
    res = _run(tiny, gsm8k, tmp_path)
    lines = _lines(tmp_path / "samples.jsonl")
    for r in lines:
        assert 0 <= r["tokens"] <= CONFIG.gen_length and r["nfe"] >= 1 and r["time"] > 0
        n = len(tiny.tokenizer(r["output"], add_special_tokens=False)["input_ids"])
        assert abs(r["tokens"] - n) <= 2  # the answer text, not the prompt nor the EOS padding
    assert res.tokens_per_second == pytest.approx(sum(r["tokens"] for r in lines) / sum(r["time"] for r in lines))


def test_rerun_with_other_settings_is_refused(tiny, gsm8k, tmp_path):
    task, samples, prompts = gsm8k
    run_standard_eval(tiny, task, samples[:1], CONFIG, tmp_path, prompts=prompts[:1], settings={"seed": 0})
    with pytest.raises(ValueError, match="different settings"):
        run_standard_eval(tiny, task, samples[:1], CONFIG, tmp_path, prompts=prompts[:1], settings={"seed": 1})


def test_cli_errors(tmp_path, capsys):
    assert cli_main(["eval", "gsm9k", "--out", str(tmp_path)]) == 2
    assert "known tasks: gsm8k, math, humaneval, mbpp" in capsys.readouterr().err
    assert cli_main(["eval", "gsm8k", "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)]) == 2
    assert "data file not found" in capsys.readouterr().err
    # the tiny model's context (512) cannot hold 5-shot prompts plus 256 answer tokens
    assert cli_main(["eval", "gsm8k", "--data", str(GSM8K), "--out", str(tmp_path), "--model", "llada-tiny"]) == 2
    assert "lower --shots or --gen-length" in capsys.readouterr().err


def test_datasets_path_fails_clearly_offline(tmp_path, capsys, monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*a, **k):  # what load_dataset does on a machine without network (fast and deterministic here)
        raise ConnectionError("Couldn't reach 'google-research-datasets/mbpp' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert cli_main(["eval", "mbpp", "--out", str(tmp_path), "--limit", "1"]) == 2
    assert "pass --data PATH" in capsys.readouterr().err


def _data(tmp_path, rows):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run_file(model, data, out, config=CONFIG, **kw):
    task = get_standard_task("gsm8k")
    samples, pool = load_samples(task, str(data), shots=0)
    prompts = build_prompts(task, samples, pool, 0)
    return run_standard_eval(model, task, samples, config, out, prompts=prompts, settings={"k": 1}, **kw)


def test_rewritten_record_is_recomputed_under_the_same_out(tiny, tmp_path):
    rows = [json.loads(x) for x in GSM8K.read_text().splitlines()[:3]]
    data = _data(tmp_path, rows)
    first = _run_file(tiny, data, tmp_path / "out")
    assert first.written == 3
    old = {r["id"]: r for r in _lines(tmp_path / "out" / "samples.jsonl")}
    # the same file path, one record rewritten (another question and answer)
    rows[1] = {**rows[1], "question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
               "answer": "3 + 4 = 7\n#### 7"}
    _data(tmp_path, rows)
    starts = []
    again = _run_file(tiny, data, tmp_path / "out", on_start=lambda todo, done: starts.append((todo, done)))
    assert starts == [(1, 2)] and again.written == 1 and again.already_done == 2
    lines = _lines(tmp_path / "out" / "samples.jsonl")
    assert [r["id"] for r in lines] == ["0", "1", "2"]  # the stale line of sample 1 is gone, nothing doubled
    assert lines[1]["reference"] == "7" and lines[1]["key"] != old["1"]["key"]
    assert lines[0] == old["0"] and lines[2] == old["2"]
    # unchanged data: nothing to do
    assert _run_file(tiny, data, tmp_path / "out").written == 0


def test_changed_decode_options_are_refused_or_overwritten(tiny, tmp_path):
    data = _data(tmp_path, [json.loads(x) for x in GSM8K.read_text().splitlines()[:2]])
    _run_file(tiny, data, tmp_path / "out")
    other = GenerateConfig(gen_length=16, block_length=8)
    with pytest.raises(ValueError, match=r"different settings \(generate_config.*--overwrite"):
        _run_file(tiny, data, tmp_path / "out", config=other)
    assert len(_lines(tmp_path / "out" / "samples.jsonl")) == 2  # nothing touched
    res = _run_file(tiny, data, tmp_path / "out", config=other, overwrite=True)
    assert res.written == 2 and res.already_done == 0
    assert len(_lines(tmp_path / "out" / "samples.jsonl")) == 2
    assert json.loads((tmp_path / "out" / "run.json").read_text())["generate_config"]["block_length"] == 8
    # a malformed run.json: refused naming it, with or without overwrite, nothing touched
    (tmp_path / "out" / "run.json").write_text("{not json")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"run.json is not valid JSON .*another --out directory"):
            _run_file(tiny, data, tmp_path / "out", config=other, overwrite=overwrite)
    assert len(_lines(tmp_path / "out" / "samples.jsonl")) == 2


def test_cli_refuses_changed_decode_options(tmp_path, capsys):
    args = ["eval", "gsm8k", "--model", "llada-tiny", "--data", str(GSM8K), "--shots", "0", "--limit", "1",
            "--gen-length", "8", "--block-length", "8", "--no-progress", "--out", str(tmp_path)]
    assert cli_main(args) == 0
    capsys.readouterr()
    assert cli_main([*args, "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert "steps: None there, 4 now" in err and "--overwrite" in err and "Traceback" not in err
    assert cli_main([*args, "--steps", "4", "--overwrite"]) == 0


def test_cli_notes_a_single_process_under_accelerate_launch_without_gpus(tmp_path, capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the note is for machines without GPUs")
    # what `accelerate launch --num_processes 2` (no --multi_gpu) leaves on a CPU machine: one process, no WORLD_SIZE
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")
    args = ["eval", "gsm8k", "--model", "llada-tiny", "--data", str(GSM8K), "--shots", "0", "--limit", "1",
            "--gen-length", "8", "--block-length", "8", "--no-progress", "--out", str(tmp_path)]
    assert cli_main(args) == 0
    err = capsys.readouterr().err
    assert "[dllm eval gsm8k: 1 process]" in err and "accelerate launch --multi_gpu --num_processes N" in err
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    assert cli_main(args) == 0
    assert "--multi_gpu" not in capsys.readouterr().err  # a plain run: no note
