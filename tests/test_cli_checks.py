"""Bad command-line input: one ``error: ...`` line naming the problem, a non-zero exit, no traceback, and the
model never loaded (every check runs before it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import dllm.models
from dllm.cli import main


class ModelLoaded(AssertionError):
    pass


@pytest.fixture
def no_model(monkeypatch):
    """Loading any model fails the test (the CLI imports the loader from ``dllm.models`` at call time)."""

    def refuse(*args, **kwargs):
        raise ModelLoaded("the model was loaded before the bad argument was refused")

    monkeypatch.setattr(dllm.models, "load_model", refuse)


def refused(capsys, argv: list[str], *needles: str) -> str:
    """Run the CLI in-process: exit code 2, one ``error:`` line on stderr containing every needle, no traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


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
    (["--sampler", "llada", "--param", "temperature=abc"], ["temperature", "not a number"]),
    (["--sampler", "llada", "--param", "remasking=bogus"], ["remasking", "bogus"]),
    (["--sampler", "nope"], ["unknown sampler 'nope'"]),
    (["--gen-length", "-5"], ["gen_length", "-5"]),
    (["--steps", "0"], ["steps", "0"]),
    (["--cache", "nope"], ["--cache", "known caches"]),
    (["--dtype", "float8"], ["--dtype", "float8", "bfloat16"]),
    (["--model", "/nonexistent/dir"], ["does not exist"]),
])
def test_generate_decode_options_checked_before_loading(argv, needles, capsys, no_model):
    refused(capsys, ["generate", "hi", *argv], *needles)


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
