"""Every sampler preset on the ParallelBench-compatible suite (waiting line + puzzles, the tiny models' prompts).

Part 1: each registered preset with its defaults: score, tokens per forward, NFE and wall time per sample.
Part 2: score-vs-tokens-per-step curves and their AUP: Fast-dLLM's threshold rule over tau (the reference
curve) against our other rules swept over their main parameter. All runs go to ``--out`` (resumable); the
markdown report with the plot is written to ``<out>/report.md``.

    python benchmarks/quality_samplers.py --model llada-tiny --n 10 --out runs/sampler-quality
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

import torch
from _suite import load_suite_model, suite_parser

from dllm.evals.parallelbench.report import write_report
from dllm.evals.parallelbench.sweep import load_samples, run_sweep
from dllm.samplers import SAMPLERS

SKIP = {"guided"}  # needs a guide model: benchmarks/bench_guided.py
CURVES = (
    "threshold:tau=0.5,0.6,0.7,0.8,0.9,1.0",
    "factor:factor=0.7,1.0,1.3,1.6,1.9",
    "localleap:tau=0.5,0.6,0.7,0.8,0.9",  # relaxed threshold near anchors; kappa 0.9 (tau <= kappa)
    "credit:tau=0.5,0.6,0.7,0.8,0.9,1.0",
    "topk:k=1,2,4,8",
)


def main() -> None:
    ap = suite_parser("runs/sampler-quality")
    ap.add_argument("--curves", nargs="*", default=list(CURVES))
    args = ap.parse_args()
    model = load_suite_model(args)
    family = getattr(model.spec, "family", "llada")
    presets = [n for n in sorted(SAMPLERS) if n not in SKIP
               and not (family == "llada" and n.startswith("dream")) and not (family != "llada" and n.startswith("llada"))]
    root = Path(args.out)
    kw = dict(tasks=args.tasks, n=args.n, style="short", gen_length=args.gen_length, batch_size=args.batch_size,
              model_name=args.model)
    run_sweep(model, root / "presets", presets, **kw)
    by = defaultdict(list)
    for line in load_samples(root / "presets"):
        by[line["setting"]].append(line)
    print(f"model {args.model}, tasks {args.tasks}, {args.n} samples per task, gen {args.gen_length}, "
          f"torch threads {torch.get_num_threads()}")
    print("| preset | score | tokens/forward | NFE | wall s/sample |")
    print("|---|---|---|---|---|")
    for name, lines in sorted(by.items()):
        print(f"| {name} | {100 * statistics.mean(x['score'] for x in lines):.1f} | "
              f"{statistics.mean(x['tokens_per_step'] for x in lines):.2f} | "
              f"{statistics.mean(x['nfe'] for x in lines):.1f} | {statistics.mean(x['time_s'] for x in lines):.3f} |")
    run_sweep(model, root / "curves", args.curves, **kw)
    report = write_report([root / "curves"], root / "report.md")
    print()
    print("| curve | AUP | PB90 | PB80 | PB70 |")
    print("|---|---|---|---|---|")
    for name, c in report.curves.items():
        def f(v):
            return "-" if v is None else f"{v:.2f}"

        print(f"| {name} | {f(c.get('AUP'))} | {f(c.get('PB90'))} | {f(c.get('PB80'))} | {f(c.get('PB70'))} |")
    print(f"\nreport: {root / 'report.md'}")


if __name__ == "__main__":
    main()
