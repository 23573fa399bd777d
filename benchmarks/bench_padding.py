"""What a cached batch computes beyond what its rows need: rows out of step widen every row's forward.

A partial forward computes the same number of canvas positions for every row of the batch (the largest active
set; the other rows are padded with repeats of a position), and a row that starts a block refreshes its whole
canvas. When the rows of a batch move in step (LLaDA's even quota: every row commits one token per step, every
row starts its blocks together) the padding is nil. With a confidence threshold (Fast-dLLM) each row finishes its
blocks at its own step, so one row's refresh makes the whole batch compute every position of every row.

Printed per sampler, cache and batch size, on the bundled tiny models (trained, so their confidences cross the
thresholds as a real model's do), from ``generate``'s per-step statistics: forwards, the rows' mean share of
token-layers computed (what each row's cache selected), the share the batch's forwards ran (padding included),
their ratio, and the forwards that computed every position of every row. Counts, valid on any device; the time
they cost is the device's (on a GPU a forward that computes every position of 16 rows is compute-bound, about 16
times a cached step of one row).

    python benchmarks/bench_padding.py [--model llada-tiny] [--batch 1 4 16] [--samplers llada fast-dllm]
                                       [--caches dual prefix] [--gen 128] [--block 32]
"""

from __future__ import annotations

import argparse
import json

import torch

import dllm
from dllm.evals import tasks as T


def prompts(n: int, seed: int = 777) -> list:
    """``n`` chat prompts of the synthetic list tasks (held-out seed, prompts of different lengths)."""
    names = T.task_names("waiting_line")
    out = []
    for i in range(n):
        ex = T.get_task(names[i % len(names)]).generate(1, seed + i)[0]
        out.append(ex.messages[-1:])
    return out


def measure(model, convs, sampler: str, cache: str, gen: int, block: int) -> dict:
    out = dllm.generate(model, convs, gen_length=gen, block_length=block, sampler=sampler, cache=cache)
    tr = out.stats.trace
    computed = sum(sum(r["computed"]) / len(r["computed"]) for r in tr) / len(tr)
    run = sum(r["run"] for r in tr) / len(tr)
    return {"sampler": sampler, "cache": cache, "batch": len(convs), "forwards": out.stats.nfe,
            "computed": round(computed, 3), "run": round(run, 3), "run_per_computed": round(run / computed, 2),
            "full_width": sum(1 for r in tr if r["run"] >= 1.0)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llada-tiny")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--samplers", nargs="+", default=["llada", "fast-dllm"])
    ap.add_argument("--caches", nargs="+", default=["dual", "prefix"])
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = dllm.load_model(a.model, dtype="float32")
    print(f"model {a.model}, gen {a.gen}, block {a.block}")
    rows = []
    for sampler in a.samplers:
        for cache in a.caches:
            for B in a.batch:
                rows.append(measure(model, prompts(B), sampler, cache, a.gen, a.block))
                print(json.dumps(rows[-1]), flush=True)
    print()
    print("| sampler | cache | batch | forwards | token-layers computed (rows' mean) | run (padding included) | "
          "run / computed | forwards of every position |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sampler']} | {r['cache']} | {r['batch']} | {r['forwards']} | {r['computed']:.1%} | "
              f"{r['run']:.1%} | {r['run_per_computed']}x | {r['full_width']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
