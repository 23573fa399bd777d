"""dKV-Cache-Decode variants against the no-cache run on the bundled llada-tiny (CPU, fp32).

``refresh="block"`` is the reference's cache (masked + decoded-last-step rows, block-local refresh);
``refresh="global"`` recomputes the whole current block and refreshes every N forwards of the generation.
Prints, per variant and refresh interval, the share of rows and tokens equal to the no-cache output (LLaDA
low-confidence remasking, float64 softmax, gen 32 = block 32 = steps 32, three prompts of every synthetic
task, validation seed) and the mean fraction of token-layers computed per forward.

    OMP_NUM_THREADS=1 python benchmarks/dkv_variants.py
"""

from __future__ import annotations

import torch

import dllm
from dllm.assets import model_path
from dllm.caches import get_cache
from dllm.evals.tasks import TASKS
from dllm.samplers import get_sampler


def main() -> None:
    torch.set_num_threads(1)
    model = dllm.load_model(str(model_path("llada-tiny")), dtype="float32")
    prompts = [e.messages for name in sorted(TASKS) for e in TASKS[name].generate(3, 777)]
    kw = dict(gen_length=32, block_length=32, steps=32, sampler=get_sampler("llada", softmax_dtype="float64"))
    base = dllm.generate(model, prompts, **kw).sequences
    print(f"{len(prompts)} prompts; variant, refresh_every: rows / tokens equal to no cache, computed fraction")
    for every in (2, 8):
        for refresh in ("block", "global"):
            out = dllm.generate(model, prompts, cache=get_cache("dkv-decode", refresh_every=every, refresh=refresh), **kw)
            eq = out.sequences == base
            computed = sum(sum(r["computed"]) / len(r["computed"]) for r in out.stats.trace) / len(out.stats.trace)
            print(f"{refresh:6s} {every}: rows {eq.all(-1).float().mean():.3f}  tokens {eq.float().mean():.3f}  "
                  f"computed {computed:.3f}")


if __name__ == "__main__":
    main()
