"""Offline continuous batching (``dllm.generate(..., max_rows=B)``) against static batches of ``B`` prompts, in one
run, on the same prompts.

Static: the prompts decoded ``B`` at a time, the way a batched evaluation runs them; a batch's finished rows stay in
it until its last row finishes, and the next batch starts after that. Continuous: one ``generate`` call over every
prompt with ``max_rows=B``: a row leaves the batch at the step it finishes and the next prompt takes its place.
Printed per batch size and mode: the batch's forwards, the rows they computed (summed over forwards,
``GenerateStats.row_forwards``) against the rows that were still decoding (``sum(row_nfe)``, the same in both
modes), the logits columns in each row's own window, wall time, answer tokens per second, whether each row's
tokens are the static run's, and (in the JSON lines) how the forwards and the steps' work ran on the graph path. On
a GPU a forward of up to 16 rows at LLaDA-8B's shape costs about what reading the weights costs, so the forwards are
the figure that follows time there; on a CPU the rows computed are (counts; the seconds a ratio within one run).

    OMP_NUM_THREADS=1 python benchmarks/bench_continuous.py [--model llada-tiny] [--prompts 64] [--batch 4 16]
                                                            [--sampler fast-dllm] [--cache dual] [--gen-length 128]
                                                            [--block-length 32] [--eos-early-stop]
    python benchmarks/bench_continuous.py --device cuda --json continuous.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch
from _common import positive, print_table, task_prompts, write_json

import dllm
from dllm.generate import answer_lengths


def run(model, prompts: list, B: int, continuous: bool, kw: dict) -> tuple[dict, torch.Tensor]:
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if continuous:
        outs = [dllm.generate(model, prompts, max_rows=B, **kw)]
    else:
        outs = [dllm.generate(model, prompts[i:i + B], **kw) for i in range(0, len(prompts), B)]
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    seqs = torch.cat([o.sequences for o in outs])
    st = [o.stats for o in outs]
    decoding = sum(sum(s.row_nfe) for s in st)
    row = {"batch": B, "mode": "continuous" if continuous else "static", "prompts": len(prompts),
           "forwards": sum(s.nfe for s in st), "row_forwards": sum(s.row_forwards for s in st),
           "decoding_rows": decoding,
           "own_logits": round(sum(s.own_logits_columns for s in st) / max(sum(s.logits_columns for s in st), 1), 3),
           "s": round(dt, 3), "tokens_per_s": round(sum(answer_lengths(model, seqs)) / dt, 1),
           # how the forwards and the steps' work after them ran (graph path: replays, captures, eager first sights)
           "graphs": dict(sum((Counter(s.graphs) for s in st), Counter())),
           "step_graphs": dict(sum((Counter(s.step_graphs) for s in st), Counter()))}
    return row, seqs


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llada-tiny")
    ap.add_argument("--prompts", type=positive, default=64)
    ap.add_argument("--batch", type=positive, nargs="+", default=[4, 16])
    ap.add_argument("--sampler", default="fast-dllm")
    ap.add_argument("--cache", default=None, help="default: the preset's own (fast-dllm: dual)")
    ap.add_argument("--gen-length", type=positive, default=128)
    ap.add_argument("--block-length", type=positive, default=32)
    ap.add_argument("--eos-early-stop", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--graphs", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.device == "cpu":
        torch.set_num_threads(1)
    model = dllm.load_model(a.model, dtype="float32", device=a.device)  # fp32: each row's tokens in any batch
    prompts = task_prompts(a.prompts, 4242)
    kw = dict(sampler=a.sampler, cache=a.cache, gen_length=a.gen_length, block_length=a.block_length,
              eos_early_stop=a.eos_early_stop, graphs=a.graphs)
    print(f"model {a.model} on {a.device}, {a.prompts} prompts, sampler {a.sampler}, cache {a.cache or 'preset'}, "
          f"gen {a.gen_length}, block {a.block_length}, eos_early_stop {a.eos_early_stop}")
    rows = []
    for B in a.batch:
        run(model, prompts[:B], B, True, kw)  # warm-up: kernels, graphs
        static, seqs = run(model, prompts, B, False, kw)
        cont, seqs2 = run(model, prompts, B, True, kw)
        cont["same_tokens"] = static["same_tokens"] = bool(torch.equal(seqs, seqs2))
        cont["time_vs_static"] = round(cont["s"] / static["s"], 3)
        for r in (static, cont):
            rows.append(r)
            print(json.dumps(r), flush=True)
    print()
    print_table(["batch", "mode", "forwards", "rows computed", "rows decoding", "logits columns in rows' own windows",
                 "s", "answer tokens/s", "same tokens"],
                [[r["batch"], r["mode"], r["forwards"], r["row_forwards"], r["decoding_rows"], f"{r['own_logits']:.1%}",
                  r["s"], r["tokens_per_s"], r["same_tokens"]] for r in rows])
    write_json(a.json, rows)
    return rows


if __name__ == "__main__":
    main()
