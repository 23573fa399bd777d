"""A short run of the soak benchmark (``benchmarks/soak_serve.py``): hostile clients for a few seconds against the
server on a loopback port; it exits non-zero on any 5xx, malformed error, unreproducible or non-solo answer, slow or
failing ``/health``, dead engine or leaked row."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")


def _soak():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "soak_serve.py"
    spec = importlib.util.spec_from_file_location("soak_serve", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("graphs", ["auto", "on"])
def test_a_short_soak_finds_no_problem(capsys, graphs):
    """``on``: the graph path's static buffers on the CPU (bucketed batches and canvases, K/V buffers moved within
    their bucket and through the pool) under the same hostile clients."""
    rc = _soak().main(["--seconds", "6", "--clients", "3", "--health-limit", "5", "--graphs", graphs])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report["problems"]
    assert report["n_problems"] == 0 and report["engine_errors"] == 0
    counts = report["requests"]
    assert counts.get("valid", 0) > 0 and counts.get("bad", 0) + counts.get("garbage", 0) > 0
    assert counts.get("exact_vs_solo", 0) > 0  # some greedy answers were checked against generate alone
    if graphs == "on":
        assert report["graphs"].get("replays", 0) + report["graphs"].get("eager:first sight", 0) > 0
