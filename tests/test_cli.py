"""CLI smoke tests on the bundled tiny models."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dllm.assets import BUNDLED
from dllm.cli import main
from dllm.evals.tasks import parse_list

PROMPT = 'Please reverse the order of the list:\n["Alice Adams", "Brian Baker", "Carol Carter"]'


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dllm.cli", *args], capture_output=True, text=True, timeout=300)


def test_bundled_models_exist():
    for name, path in BUNDLED.items():
        assert (path / "config.json").is_file(), f"bundled model {name} is missing"
        assert (path / "model.safetensors").is_file()
        assert (path / "tokenizer.json").is_file()
        assert (path / "model.safetensors").stat().st_size < 25 * 2**20


def test_help_lists_commands():
    res = run_cli("--help")
    assert res.returncode == 0
    for cmd in ("generate", "samplers", "train-tiny", "eval-tasks"):
        assert cmd in res.stdout


def test_samplers_lists_names_and_defaults(capsys):
    assert main(["samplers"]) == 0
    out = capsys.readouterr().out
    assert "llada:" in out and "dream:" in out
    assert "remasking = 'low_confidence'" in out and "alg = 'entropy'" in out


def test_generate_default_model_json(capsys):
    assert main(["generate", PROMPT, "--gen-length", "32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["sequences"]) == 1 and len(data["sequences"][0]) == 32
    assert data["nfe"] == 32 and data["texts"][0]
    assert set(data["time"]) == {"model", "sampler", "cache", "total"}


@pytest.mark.parametrize("model", ["llada-tiny", "dream-tiny"])
def test_generate_answers_in_the_task_format(model, capsys):
    """The bundled models answer a list prompt with a list of three full names (the format they learned;
    docs/tiny-models.md gives their task accuracy)."""
    assert main(["generate", PROMPT, "--model", model, "--gen-length", "32"]) == 0
    names = parse_list(capsys.readouterr().out.strip(), strict=True)
    assert names is not None and len(names) == 3
    assert all(len(n.split()) == 2 for n in names)


def test_generate_with_sampler_params_and_batch_file(tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text(json.dumps(PROMPT) + "\n" + json.dumps({"prompt": "What is 12 + 30?"}) + "\n")
    code = main(["generate", "--batch-file", str(f), "--sampler", "dream", "--param", "alg=maskgit_plus",
                 "--gen-length", "32", "--steps", "16", "--model", "dream-tiny", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["texts"]) == 2
    assert data["texts"][1].isdigit()  # an addition prompt gets a number


def test_generate_max_rows_gives_the_batchs_outputs(tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(json.dumps(p) for p in (PROMPT, "What is 12 + 30?", "Hi", "What is 3 + 4?")) + "\n")
    outs = []
    for extra in ([], ["--max-rows", "2"]):
        assert main(["generate", "--batch-file", str(f), "--sampler", "fast-dllm", "--gen-length", "32", "--json",
                     *extra]) == 0
        outs.append(json.loads(capsys.readouterr().out)["texts"])
    assert outs[0] == outs[1] and len(outs[0]) == 4
    assert main(["generate", PROMPT, "--max-rows", "0"]) == 2
    assert "--max-rows must be >= 1" in capsys.readouterr().err
    assert main(["generate", PROMPT, "--max-rows", "2", "--sampler", "llada", "--param", "noise_scope=canvas", "--param",
                 "temperature=1"]) == 2
    assert "noise_scope must be 'row'" in capsys.readouterr().err


def test_generate_errors_are_clear(capsys):
    assert main(["generate", PROMPT, "--sampler", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown sampler 'nope'" in err and "llada" in err
    assert main(["generate", PROMPT, "--gen-length", "30", "--block-length", "8"]) == 2
    assert "not a multiple of block_length" in capsys.readouterr().err
    assert main(["generate", PROMPT, "--model", "/nonexistent/dir"]) == 2
    assert "does not exist" in capsys.readouterr().err
