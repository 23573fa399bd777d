"""dKV-Cache-Decode variants against the no-cache run on the bundled llada-tiny (CPU, fp32).

``refresh="block"`` is the reference's cache (masked + decoded-last-step rows, block-local refresh);
``refresh="global"`` recomputes the whole current block and refreshes every N forwards of the generation.
Prints, per variant and refresh interval, the share of rows and tokens equal to the no-cache output (LLaDA
low-confidence remasking, float64 softmax, gen 32 = block 32 = steps 32, three prompts of every synthetic
task, validation seed) and the mean fraction of token-layers computed per forward.

    OMP_NUM_THREADS=1 python benchmarks/dkv_variants.py [--tasks waiting_line] [--n 3] [--every 2 8]
"""

from __future__ import annotations

import argparse

import torch
from _common import positive

import dllm
from dllm.assets import model_path
from dllm.caches import get_cache
from dllm.evals import tasks as T
from dllm.samplers import get_sampler


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llada-tiny")
    ap.add_argument("--tasks", default=None,
                    help="synthetic tasks (names, categories or fnmatch patterns, comma-separated; default: all)")
    ap.add_argument("--n", type=positive, default=3, help="prompts per task")
    ap.add_argument("--seed", type=int, default=777, help="the tasks' example seed (validation)")
    ap.add_argument("--every", type=positive, nargs="+", default=[2, 8], help="refresh intervals (forwards)")
    ap.add_argument("--threads", type=positive, default=1)
    args = ap.parse_args(argv)
    names = sorted(T.task_names(args.tasks))  # the synthetic suite: the tasks with chat examples
    if not names:
        ap.error(f"--tasks {args.tasks!r} matches no synthetic task; known: {', '.join(T.task_names())}")
    torch.set_num_threads(args.threads)
    model = dllm.load_model(str(model_path(args.model)), dtype="float32")
    prompts = [e.messages for name in names for e in T.get_task(name).generate(args.n, args.seed)]
    kw = dict(gen_length=32, block_length=32, steps=32, sampler=get_sampler("llada", softmax_dtype="float64"))
    base = dllm.generate(model, prompts, **kw).sequences
    print(f"{len(prompts)} prompts; variant, refresh_every: rows / tokens equal to no cache, computed fraction")
    for every in args.every:
        for refresh in ("block", "global"):
            out = dllm.generate(model, prompts, cache=get_cache("dkv-decode", refresh_every=every, refresh=refresh), **kw)
            eq = out.sequences == base
            computed = sum(sum(r["computed"]) / len(r["computed"]) for r in out.stats.trace) / len(out.stats.trace)
            print(f"{refresh:6s} {every}: rows {eq.all(-1).float().mean():.3f}  tokens {eq.float().mean():.3f}  "
                  f"computed {computed:.3f}")

if __name__ == "__main__":
    main()
