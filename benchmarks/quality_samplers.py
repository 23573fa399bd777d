"""Every sampler preset on the ParallelBench-compatible suite (waiting line + puzzles, the tiny models' prompts).

Part 1: each registered preset with its defaults: score, tokens per forward, NFE and wall time per sample.
Part 2: score-vs-tokens-per-step curves and their AUP: Fast-dLLM's threshold rule over tau (the reference
curve) against our other rules swept over their main parameter. All runs go to ``--out`` (resumable); the
markdown report with the plot is written to ``<out>/report.md``. The tables cover the tasks and samples asked
for (results of other tasks or samples stored in ``--out`` by earlier runs are kept there, not reported). A
preset or curve whose block layout cannot decode ``--gen-length`` (e.g. multi-block's blocks of 32 at a length
of 16) is skipped, and the skip is printed.

    python benchmarks/quality_samplers.py --model llada-tiny --n 10 --out runs/sampler-quality
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from _suite import load_suite_model, requested, suite_parser

from dllm.evals.parallelbench.report import build_report
from dllm.evals.parallelbench.sweep import load_samples, parse_methods, run_sweep
from dllm.evals.stats import fmt_ci, mean_ci, paired_test
from dllm.recipes import resolve
from dllm.samplers import SAMPLERS

SKIP = {"guided"}  # needs a guide model: benchmarks/bench_guided.py
CURVES = (
    "threshold:tau=0.5,0.6,0.7,0.8,0.9,1.0",
    "factor:factor=0.7,1.0,1.3,1.6,1.9",
    "localleap:tau=0.5,0.6,0.7,0.8,0.9",  # relaxed threshold near anchors; kappa 0.9 (tau <= kappa)
    "credit:tau=0.5,0.6,0.7,0.8,0.9,1.0",
    "topk:k=1,2,4,8",
    "eb:gamma=0.001,0.01,0.1,1,10",  # EB-Sampler: entropy budget per step
    "entropy-threshold:threshold=0.01,0.1,0.5,1,2",  # d3LLM's entropy threshold
)


def layout_problem(model, setting, gen_length: int | None) -> str | None:
    """Why ``setting`` (a :class:`Setting`) cannot decode ``gen_length`` tokens on ``model`` (its block layout
    refuses the length), or None (also when no single length is given: each task's own budget)."""
    if gen_length is None:
        return None
    try:
        sampler, config = setting.resolve(model, gen_length)
        resolve(model, sampler, None, None, config)
    except ValueError as exc:
        return str(exc)
    return None


def runnable(model, specs, gen_length: int | None, what: str) -> list:
    """``specs`` less the settings whose block layout refuses ``gen_length`` (each skip printed): a spec all of whose
    settings run stays as it is, one with some refused settings gives the others."""
    out: list = []
    for spec in specs:
        settings = parse_methods([spec])
        ok = []
        for st in settings:
            why = layout_problem(model, st, gen_length)
            if why is None:
                ok.append(st)
            else:
                print(f"skipping {what} setting {st.label!r} at gen length {gen_length}: {why}")
        out += [spec] if len(ok) == len(settings) else ok
    return out


def main() -> None:
    ap = suite_parser("runs/sampler-quality")
    ap.description, ap.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    ap.add_argument("--curves", nargs="+", default=list(CURVES), help="method specs of the curves (part 2)")
    ap.add_argument("--curves-only", action="store_true", help="skip part 1 (every preset with its defaults)")
    args = ap.parse_args()
    try:
        parse_methods(args.curves)
    except ValueError as exc:
        ap.error(f"--curves: {exc}")
    model = load_suite_model(args)
    root = Path(args.out)
    kw = dict(tasks=args.tasks, n=args.n, style="short", gen_length=args.gen_length, batch_size=args.batch_size,
              model_name=args.model)
    print(f"model {args.model}, tasks {args.tasks}, {args.n} samples per task, gen {args.gen_length}, "
          f"torch threads {torch.get_num_threads()}")
    if not args.curves_only:
        presets_table(model, root, kw)
    curves = runnable(model, args.curves, args.gen_length, "curve")
    if not curves:
        print(f"\nno curve can decode gen length {args.gen_length}: no part 2")
        return
    result = run_sweep(model, root / "curves", curves, **kw)
    lines = requested(load_samples(root / "curves"), result, args.n)
    report = build_report(lines, plot_dir=root, sources=[str(root / "curves")], needs_data=result.needs_data)
    root.mkdir(parents=True, exist_ok=True)
    (root / "report.md").write_text(report.markdown, encoding="utf-8")
    print()
    print("| curve | AUP | 95% CI | PB90 | PB80 | PB70 |")
    print("|---|---|---|---|---|---|")
    for name, c in report.curves.items():
        def f(v):
            return "-" if v is None else f"{v:.2f}"

        ci = fmt_ci(*c.get("AUP_ci", (float("nan"),) * 2), digits=2)
        print(f"| {name} | {f(c.get('AUP'))} | {ci} | {f(c.get('PB90'))} | {f(c.get('PB80'))} | {f(c.get('PB70'))} |")
    print("(differences between the curves, with p-values: the report's \"Differences between methods\")")
    print(f"\nreport: {root / 'report.md'}")


def presets_table(model, root: Path, kw: dict) -> None:
    """Part 1: every registered preset with its defaults, against the family baseline on the same examples."""
    family = getattr(model.spec, "family", "llada")
    presets = [n for n in sorted(SAMPLERS) if n not in SKIP
               and not (family == "llada" and n.startswith("dream")) and not (family != "llada" and n.startswith("llada"))]
    presets = runnable(model, presets, kw["gen_length"], "preset")
    result = run_sweep(model, root / "presets", presets, **kw)
    by = defaultdict(list)
    for line in requested(load_samples(root / "presets"), result, kw["n"]):
        by[line["setting"]].append(line)
    base = "dream" if family == "dream" else "llada"
    base_scores = {(x["task"], x["index"]): x["score"] for x in by[base]}
    print(f"score: percent, 95% CI (Wilson); vs {base}: the paired difference on the same examples and its p-value "
          "(sign-flip permutation test)")
    print(f"| preset | score | 95% CI | vs {base} | p | tokens/forward | NFE | wall s/sample |")
    print("|---|---|---|---|---|---|---|---|")
    for name, lines in sorted(by.items()):
        scores = [x["score"] for x in lines]
        keys = [(x["task"], x["index"]) for x in lines if (x["task"], x["index"]) in base_scores]
        mine = {(x["task"], x["index"]): x["score"] for x in lines}
        t = paired_test([mine[k] for k in keys], [base_scores[k] for k in keys])
        print(f"| {name} | {100 * statistics.mean(scores):.1f} | {fmt_ci(*mean_ci(scores), scale=100)} | "
              f"{100 * t['diff']:+.1f} | {t['p']:.3f} | {statistics.mean(x['tokens_per_step'] for x in lines):.2f} | "
              f"{statistics.mean(x['nfe'] for x in lines):.1f} | {statistics.mean(x['time_s'] for x in lines):.3f} |")


if __name__ == "__main__":
    main()
