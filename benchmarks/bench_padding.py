"""What a cached batch computes beyond what its rows need, with its partial forwards padded and packed.

A partial forward's active rows are ``[B, Q]``: the largest active set, shorter sets padded with repeats, and a
row that starts a block refreshes its whole canvas. When the rows of a batch move in step (LLaDA's even quota:
every row commits one token per step, every row starts its blocks together) the padding is nil. With a confidence
threshold (Fast-dLLM) each row finishes its blocks at its own step, so one row's refresh pads every other row to
the whole canvas. Packed (the default: ``KVCache.pack_rows``), the model's per-token work runs on the rows' own
active sets and only attention on the padded rows; padded (``pack_rows = False``) it runs on every slot.

Printed per sampler, cache, batch size and path, on the bundled tiny models (trained, so their confidences cross
the thresholds as a real model's do), from ``generate``'s per-step statistics: forwards, the rows' mean share of
token-layers computed (what each row's cache selected), the share the batch's forwards ran, their ratio, the
forwards that ran every position of every row, the share of the logits columns computed (every row at its own
window where the sampler takes per-row windows, else over the union of the rows' windows; finished rows of a batch
still computed) that lie in each row's own window (``GenerateStats.own_logits_columns``: the output head's and
the sampler's work the rows read), wall time (CPU: a ratio within one run) and whether the tokens are those of the
padded run. Counts, valid on any device; on a GPU a forward that computes every position of 16 rows
is compute-bound, many times a cached step.

    python benchmarks/bench_padding.py [--model llada-tiny] [--batch 1 4 16] [--samplers llada fast-dllm]
                                       [--caches dual prefix] [--gen 128] [--block 32]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _common import print_table, task_prompts, write_json

import dllm
from dllm.caches import get_cache


def measure(model, convs, sampler: str, cache: str, gen: int, block: int, packed: bool) -> tuple[dict, torch.Tensor]:
    c = get_cache(cache)
    c.pack_rows = packed
    t0 = time.perf_counter()
    out = dllm.generate(model, convs, gen_length=gen, block_length=block, sampler=sampler, cache=c)
    dt = time.perf_counter() - t0
    tr = out.stats.trace
    computed = sum(sum(r["computed"]) / len(r["computed"]) for r in tr) / len(tr)
    run = sum(r["run"] for r in tr) / len(tr)
    return {"sampler": sampler, "cache": cache, "batch": len(convs), "path": "packed" if packed else "padded",
            "forwards": out.stats.nfe, "computed": round(computed, 3), "run": round(run, 3),
            "run_per_computed": round(run / computed, 2), "full_width": sum(1 for r in tr if r["run"] >= 1.0),
            "own_logits": round(out.stats.own_logits_columns / out.stats.logits_columns, 3),
            "s": round(dt, 3)}, out.sequences


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
                convs = task_prompts(B, 777)
                measure(model, convs, sampler, cache, a.gen, a.block, True)  # warm-up
                padded, seq = measure(model, convs, sampler, cache, a.gen, a.block, False)
                packed, seq2 = measure(model, convs, sampler, cache, a.gen, a.block, True)
                for r in (padded, packed):
                    r["same_tokens"] = bool(torch.equal(seq, seq2))
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    print()
    print_table(["sampler", "cache", "batch", "path", "forwards", "token-layers computed (rows' mean)", "run",
                 "run / computed", "forwards of every position", "logits columns in rows' own windows", "s",
                 "same tokens"],
                [[r["sampler"], r["cache"], r["batch"], r["path"], r["forwards"], f"{r['computed']:.1%}",
                  f"{r['run']:.1%}", f"{r['run_per_computed']}x", r["full_width"], f"{r['own_logits']:.1%}", r["s"],
                  r["same_tokens"]]
                 for r in rows])
    write_json(a.json, rows)
    return rows


if __name__ == "__main__":
    main()
