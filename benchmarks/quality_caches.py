"""Cache quality on the ParallelBench-compatible suite (waiting line + puzzles, the tiny models' prompts).

For each cache policy with its default refresh, one sampler (threshold 0.9 over blocks of 32 by default) runs
the same samples as without a cache; the table gives the fraction of outputs identical to the no-cache run,
the task score, NFE and wall time. The ``fast-dllm`` (threshold 0.9 + dual cache) and ``elastic`` presets
run against threshold decoding without cache. Results go to ``--out`` (one resumable sweep per cache); the
table covers the tasks and samples asked for (results of other tasks or samples stored in ``--out`` by earlier
runs are kept there, not reported).

    python benchmarks/quality_caches.py --model llada-tiny --n 10 --out runs/cache-quality
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from _suite import load_suite_model, requested, suite_parser

from dllm.evals.parallelbench.sweep import load_samples, run_sweep
from dllm.evals.stats import fmt_ci, mean_ci, paired_test

CACHES = ("none", "prefix", "dual", "dkv-decode", "dkv-greedy", "freecache", "elastic")


def _run(model, out: Path, method: str, cache: str | None, args) -> list[dict]:
    result = run_sweep(model, out, [method], tasks=args.tasks, n=args.n, style="short", cache=cache,
                       gen_length=args.gen_length, batch_size=args.batch_size, model_name=args.model)
    return requested(load_samples(out), result, args.n)


def _key(line: dict) -> tuple:
    return line["task"], int(line["index"])


def main() -> None:
    ap = suite_parser("runs/cache-quality")
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--method", default=None, help="method spec (default: threshold:tau=0.9:block_length=B)")
    ap.description, ap.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    args = ap.parse_args()
    model = load_suite_model(args)
    method = args.method or f"threshold:tau=0.9:block_length={args.block_length}"
    root = Path(args.out)
    rows = []
    base = None
    runs = [(c, method, None if c == "none" else c) for c in CACHES]
    runs += [("preset fast-dllm", "fast-dllm", None), ("preset elastic", "elastic", None)]
    for label, meth, cache in runs:
        lines = _run(model, root / label.replace(" ", "-"), meth, cache, args)
        by_key = {_key(x): x for x in lines}
        if base is None:
            base = by_key
        same = statistics.mean(float(by_key[k]["prediction"] == base[k]["prediction"]) for k in base if k in by_key)
        keys = [k for k in base if k in by_key]
        t = paired_test([by_key[k]["score"] for k in keys], [base[k]["score"] for k in keys])
        scores = [x["score"] for x in lines]
        rows.append((label, meth, same, statistics.mean(scores), mean_ci(scores), t,
                     statistics.mean(x["nfe"] for x in lines), sum(x["time_s"] for x in lines)))
    print(f"model {args.model}, tasks {args.tasks}, {args.n} samples per task, gen {args.gen_length}, "
          f"torch threads {torch.get_num_threads()}")
    print("score: percent, 95% CI (Wilson); vs none: the paired difference on the same examples and its p-value "
          "(sign-flip permutation test)")
    print("| cache | method | identical to no cache | score | 95% CI | vs none | p | NFE | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, meth, same, score, ci, t, nfe, secs in rows:
        print(f"| {label} | `{meth}` | {same:.2f} | {100 * score:.1f} | {fmt_ci(*ci, scale=100)} | "
              f"{100 * t['diff']:+.1f} | {t['p']:.3f} | {nfe:.1f} | {secs:.1f} |")


if __name__ == "__main__":
    main()
