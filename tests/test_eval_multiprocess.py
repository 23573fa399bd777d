"""`dllm eval` sharded over two processes (torchrun, gloo, CPU) gives the same results as one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO / "tests" / "fixtures" / "eval" / "gsm8k.jsonl"


def _lines(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def _cli(args, nproc=None, out=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    pre = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(29500 + os.getpid() % 1000), "-m", "dllm.cli"] if nproc else [sys.executable, "-m", "dllm.cli"]
    cmd = pre + ["eval", *args, "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_two_processes_match_one(tmp_path):
    args = ["gsm8k", "--model", "llada-tiny", "--data", str(GSM8K), "--shots", "1", "--limit", "5",
            "--gen-length", "16", "--block-length", "16"]
    one = _cli(args, out=tmp_path / "one")
    two = _cli(args, nproc=2, out=tmp_path / "two")
    a, b = _lines(tmp_path / "one" / "samples.jsonl"), _lines(tmp_path / "two" / "samples.jsonl")
    assert [r["id"] for r in b] == [r["id"] for r in a] == ["0", "1", "2", "3", "4"]
    assert {r["rank"] for r in b} == {0, 1}  # really sharded over two processes
    keys = ("output", "answer", "correct", "nfe", "tokens")
    assert [tuple(r[k] for k in keys) for r in a] == [tuple(r[k] for k in keys) for r in b]
    # the table is printed once, by the main process
    assert two.stdout.count("| gsm8k | 5 |") == 1 and one.stdout.count("| gsm8k | 5 |") == 1
    # the number of processes is reported at the start, once
    assert two.stderr.count("[dllm eval gsm8k: 2 processes]") == 1 and "[dllm eval gsm8k: 1 process]" in one.stderr
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert (sa["n"], sa["correct"], sa["answer_tokens"]) == (sb["n"], sb["correct"], sb["answer_tokens"])
    # a two-process directory resumes in one process (the content keys do not depend on the process count)
    again = _cli(args, out=tmp_path / "two")
    assert "0 samples scored, 5 already" in again.stderr
    assert _lines(tmp_path / "two" / "samples.jsonl") == b


@pytest.mark.slow  # six evaluation processes: the default run shards over two in test_two_processes_match_one
@pytest.mark.parametrize("t", ["0.8", "0"])
def test_answers_do_not_depend_on_batch_size_or_process_count(tmp_path, t):
    """A cached threshold sampler (fast-dllm: dual cache) seeded at temperature 0.8 and at temperature 0: every
    sample's output is the same at batch 1, at batch 4 and sharded over two processes at batch 2 (caches decide per
    row; random streams are keyed by the seed and the sample id)."""
    keys = ("id", "output", "nfe", "tokens")
    args = ["gsm8k", "--model", "llada-tiny", "--data", str(GSM8K), "--shots", "1", "--limit", "6",
            "--gen-length", "32", "--block-length", "8", "--sampler", "fast-dllm", "--param", f"temperature={t}",
            "--eos-early-stop", "--seed", "3"]
    runs = {}
    for name, nproc, bs in (("b1", None, "1"), ("b4", None, "4"), ("p2", 2, "2")):
        _cli(args + ["--batch-size", bs], nproc=nproc, out=tmp_path / f"{name}-{t}")
        runs[name] = sorted(tuple(r[k] for k in keys) for r in _lines(tmp_path / f"{name}-{t}" / "samples.jsonl"))
    assert runs["b1"] == runs["b4"] == runs["p2"], t
