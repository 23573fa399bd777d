"""Per-task greedy accuracy of an AR checkpoint (the guide) on the synthetic tasks (held-out seed 12345).

    OMP_NUM_THREADS=1 python benchmarks/eval_ar_tasks.py dllm/assets/ar-tiny --n 20 [--template llada|dream]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from dllm.samplers.guided import guide_path
from dllm.tiny.train_ar import evaluate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", nargs="?", default="ar-tiny")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--template", choices=["llada", "dream"], default="llada")
    ap.add_argument("--tasks", default=None,
                    help="names, categories or fnmatch patterns, comma-separated (default: all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from dllm.evals import tasks as T

    names = T.task_names(args.tasks)
    if not names:
        ap.error(f"--tasks {args.tasks!r} matches no synthetic task; known tasks: {', '.join(T.task_names())}")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    res = evaluate(guide_path(args.path), names, n=args.n, seed=args.seed, template=args.template)
    fams: dict[str, list[float]] = {}
    print(f"| task | accuracy ({args.template} template, n={args.n}) | strict |")
    print("|---|---|---|")
    for name, r in res.items():
        fams.setdefault(r["family"], []).append(r["score"])
        print(f"| {name} | {r['score']:.2f} | {r['score_strict']:.2f} |")
    fam = {f: sum(v) / len(v) for f, v in fams.items()}
    print("| **family mean** | **" + f"{sum(fam.values()) / len(fam):.2f}" + "** | |")
    print(json.dumps(fam), f"[{time.perf_counter() - t0:.0f}s]", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tasks": res, "families": fam}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
