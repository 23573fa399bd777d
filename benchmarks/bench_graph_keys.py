"""How often the graph path's cached steps replay a captured graph, with the graph shapes bucketed and without.

A cached step is replayed from a CUDA graph only when its key (batch, canvas length, active width, packed rows,
logits columns, the K/V buffers) was seen before (:mod:`dllm.graphs`). Exact shapes change with every prompt length
(the canvas), with every step of a cache whose active width follows the masks left (dKV-Cache-Decode computes only
the rows the sampler reads), with every step of a batch whose rows are out of step (the packed rows), and every
``generate`` call allocates new K/V buffers. Bucketed and pooled (the default: ``GraphRunner.buckets`` and
``GraphRunner.buffers``), the canvas, the widths and the packed rows are rounded up to a few sizes
(``dllm.ops.shape_bucket``) and the caches of successive calls take the same buffers from the runner's pool; "exact,
own buffers" is the runner without either.

An evaluation's loop: ``--calls`` calls of ``--batch`` prompts each (synthetic task prompts of different lengths),
per sampler and cache, on one runner per configuration, bucketed and exact. Printed per configuration: forwards,
full forwards (the first of each call eager, the others from graphs of their own), first sights (eager, a key
seen once), captures, replays, the replayed share of the cached forwards (these four of the partial forwards),
the partial forwards' graphs kept at the end (the runner's entries holding a captured graph, on the CPU its
static-buffer stand-in: shape keys seen once and never captured are not counted; the JSON's ``full_graphs``: the
full forwards'), evictions, whether the tokens
are the eager path's, and seconds (on the CPU the runner's static-buffer path without capture: counts only, the
time is no GPU figure; on CUDA real graphs, the time of the whole loop with the card named).

    python benchmarks/bench_graph_keys.py [--model llada-tiny] [--calls 6] [--batch 1 4] [--gen 64] [--block 16]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _common import positive, print_table, task_prompts, write_json

import dllm
from dllm.caches import CACHES
from dllm.graphs import GraphRunner
from dllm.samplers import SAMPLERS

CONFIGS = [("llada", "dual"), ("llada", "prefix"), ("llada", "dkv-decode"), ("fast-dllm", "dual"),
           ("threshold", "freecache")]


def run(model, sampler: str, cache: str, batch: int, calls: int, gen: int, block: int, buckets: bool | None):
    """The loop on a fresh runner (``buckets`` None: the eager path). Returns (row, sequences)."""
    saved = model.__dict__.pop("_dllm_graphs", None)
    runner = None
    if buckets is not None:
        runner = GraphRunner(model, capture=model.device.type == "cuda", buckets=buckets)
        if not buckets:  # exact shapes and each call's cache its own buffers: the runner without either
            runner.buffers = None
        model.__dict__["_dllm_graphs"] = runner
    work = task_prompts(batch * calls, 4242)
    seqs, nfe = [], 0
    try:
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(calls):
            out = dllm.generate(model, work[i * batch:(i + 1) * batch], sampler=sampler, cache=cache, gen_length=gen,
                                block_length=block, seed=0, graphs="off" if buckets is None else "on")
            seqs.append(out.sequences.cpu())
            nfe += out.stats.nfe
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    finally:
        model.__dict__.pop("_dllm_graphs", None)
        if saved is not None:
            model.__dict__["_dllm_graphs"] = saved
    s = runner.stats if runner is not None else {}
    # full forwards, eager or from their own graphs (GraphRunner.full); the rest are the cached steps' partial forwards
    full = sum(v for k, v in s.items() if k.startswith(("eager:full forward", "full ")))
    cached = nfe - full
    row = {"sampler": sampler, "cache": cache, "batch": batch, "calls": calls,
           "shapes": "eager" if buckets is None else ("bucketed, pooled" if buckets else "exact, own buffers"),
           "forwards": nfe,
           "full": full, "first_sight": s.get("eager:first sight", 0), "captures": s.get("captures", 0),
           "replays": s.get("replays", 0), "replayed": round(s.get("replays", 0) / cached, 3) if cached else 0.0,
           # graphs kept: the runner's entries that hold a graph (captured; on the CPU the static-buffer path's
           # stand-in), not the shape keys seen once and never captured
           "graphs": sum(g.captured and not g.failed and g.query_idx is not None for g in runner.graphs.values())
           if runner is not None else 0,
           "full_graphs": sum(g.captured and not g.failed and g.query_idx is None for g in runner.graphs.values())
           if runner is not None else 0,  # the full forwards' own graphs
           "keys": len(runner.graphs) if runner is not None else 0, "evicted": s.get("evicted", 0),
           "other_eager": sum(v for k, v in s.items() if k.startswith("eager:")
                              and not k.startswith("eager:full forward") and k != "eager:first sight"),
           "s": round(dt, 3)}
    return row, seqs


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llada-tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 elsewhere")
    ap.add_argument("--calls", type=positive, default=6)
    ap.add_argument("--batch", type=positive, nargs="+", default=[1, 4])
    ap.add_argument("--gen", type=positive, default=64)
    ap.add_argument("--block", type=positive, default=16)
    ap.add_argument("--configs", nargs="+", default=[f"{s}:{c}" for s, c in CONFIGS],
                    help="sampler:cache pairs")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    pairs = []
    for pair in a.configs:
        sampler, sep, cache = pair.partition(":")
        if not sep or not sampler or not cache or ":" in cache:
            ap.error(f"--configs {pair!r}: give sampler:cache pairs, e.g. llada:dual or fast-dllm:prefix")
        if sampler not in SAMPLERS:
            ap.error(f"--configs {pair!r}: unknown sampler {sampler!r}; choose from {', '.join(sorted(SAMPLERS))}")
        if cache not in CACHES:
            ap.error(f"--configs {pair!r}: unknown cache {cache!r}; choose from {', '.join(CACHES)}")
        pairs.append((sampler, cache))
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    if a.device == "cpu":
        torch.set_num_threads(1)
    model = dllm.load_model(a.model, device=a.device, dtype=dtype)
    card = torch.cuda.get_device_name() if a.device == "cuda" else "CPU (static-buffer path, no capture)"
    print(f"model {a.model} ({dtype}) on {card}; {a.calls} calls per configuration, gen {a.gen}, block {a.block}")
    rows = []
    for sampler, cache in pairs:
        for B in a.batch:
            eager, want = run(model, sampler, cache, B, a.calls, a.gen, a.block, None)
            for buckets in (False, True):
                row, seqs = run(model, sampler, cache, B, a.calls, a.gen, a.block, buckets)
                row["same_tokens"] = all(torch.equal(x, y) for x, y in zip(seqs, want))
                row["eager_s"] = eager["s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    print_table(["sampler", "cache", "batch", "shapes", "forwards", "full", "first sight", "captures", "replays",
                 "replayed share of cached forwards", "graphs kept", "evicted", "s (eager s)", "same tokens"],
                [[r["sampler"], r["cache"], r["batch"], r["shapes"], r["forwards"], r["full"], r["first_sight"],
                  r["captures"], r["replays"], f"{r['replayed']:.0%}", r["graphs"], r["evicted"],
                  f"{r['s']} ({r['eager_s']})", r["same_tokens"]] for r in rows])
    write_json(a.json, rows)
    return rows


if __name__ == "__main__":
    main()
