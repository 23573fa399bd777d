"""Options and model loading shared by the quality benchmarks (``quality_samplers.py``, ``quality_caches.py``),
so both tables are measured on the same suite settings."""

from __future__ import annotations

import argparse

import torch
from _common import positive

from dllm.assets import model_path
from dllm.evals import parallelbench as PB
from dllm.evals.parallelbench.sweep import subset_indices
from dllm.models.loading import load_model


def suite_parser(out: str) -> argparse.ArgumentParser:
    """A parser with the suite options (model, tasks, samples per task, lengths, batch, threads, output)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llada-tiny")
    ap.add_argument("--tasks", default="waiting_line,puzzle")
    ap.add_argument("--n", type=positive, default=10, help="samples per task")
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=out)
    return ap


def load_suite_model(args: argparse.Namespace):
    """Set the thread count and load ``args.model`` (a bundled name or a path) in fp32."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return load_model(model_path(args.model), dtype=torch.float32)


def requested(lines: list[dict], result, n: int | None) -> list[dict]:
    """The stored ``lines`` of the request ``result`` (a :class:`SweepResult`) with ``n`` samples per task: its
    settings, its tasks and, per task, the samples ``run_sweep`` decodes for ``n`` (an earlier run into the same
    directory may hold other tasks, settings or samples)."""
    want = {(s, t, i) for t in result.tasks for i in subset_indices(PB.get_task(t).num_samples, n)
            for s in result.settings}
    return [x for x in lines if (x["setting"], x["task"], int(x["index"])) in want]
