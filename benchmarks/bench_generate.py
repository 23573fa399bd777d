"""Decode-loop benchmark.

Part 1: NFE, tokens per forward, tokens/s and the model / sampler / cache time split on the bundled tiny
models (a few synthetic-task prompts). "steps requested" is the ``steps`` passed to ``generate``; a model or
sampler with its own schedule (block-diffusion models, threshold-style rules) may run another count: NFE is what ran.
Part 2: each baseline sampler's per-step cost against the floor of one softmax pass over the same logits,
on a random-weight model with LLaDA's vocabulary (126,464) and a 32-token block.

    python benchmarks/bench_generate.py [--batch 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import positive

import dllm
from dllm.assets import BUNDLED
from dllm.evals import tasks as T
from dllm.models import LLADA, Transformer, TransformerConfig
from dllm.models.weights import init_weights
from dllm.samplers import get_sampler


def part1(batch: int) -> None:
    print("## Tiny models (gen 32, one token per step and 4 tokens per step)")
    print("| model | sampler | steps requested | batch | NFE | tokens/forward | tokens/s | model s | sampler s | cache s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    convs = [ex.messages for ex in T.generate("waiting_line/reverse", batch, seed=7)]
    for name, path in BUNDLED.items():
        if not (path / "config.json").exists():
            print(f"| {name} | (not bundled) | | | | | | | | |")
            continue
        model = dllm.load_model(path, dtype=torch.float32)
        for sampler in ("llada", "dream-entropy"):
            for steps in (32, 8):
                dllm.generate(model, convs, gen_length=32, steps=steps, sampler=sampler)  # warm-up
                out = dllm.generate(model, convs, gen_length=32, steps=steps, sampler=sampler)
                s = out.stats
                tps = batch * 32 / s.time_total
                print(f"| {name} | {sampler} | {steps} | {batch} | {s.nfe} | {s.tokens_per_forward:.2f} | {tps:.0f} | "
                      f"{s.time_model:.3f} | {s.time_sampler:.3f} | {s.time_cache:.3f} |")


def _best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)  # the least disturbed run (the machine is shared)


def part2(batch: int, repeats: int) -> None:
    V, block = 126_464, 32
    print(f"\n## Sampler per-step cost at V = {V}, block {block}, batch {batch} (best of {repeats})")
    cfg = TransformerConfig(vocab_size=V, d_model=64, n_layers=1, n_heads=2, n_kv_heads=2, mlp_hidden=128)
    torch.manual_seed(0)
    model = Transformer(cfg, LLADA)
    init_weights(model, std=0.5)
    model.eval().requires_grad_(False)
    model.mask_id, model.eos_id, model.eot_id, model.pad_id = V - 1, 1, 2, 1
    prompts = [[5 + i, 6, 7, 8] for i in range(batch)]
    logits = torch.randn(batch, block, V)
    floor = _best_time(lambda: torch.softmax(logits, dim=-1), repeats)
    print(f"floor (one fp32 softmax over [{batch}, {block}, {V}]): {floor * 1e3:.2f} ms")
    print("| sampler | per-step ms | x floor |")
    print("|---|---|---|")
    for name in ("llada", "llada-random", "dream-maskgit-plus", "dream-topk-margin", "dream-entropy", "dream-origin"):
        sampler = get_sampler(name)
        per_step = []
        for _ in range(repeats):
            out = dllm.generate(model, prompts, gen_length=block, steps=block, sampler=sampler)
            per_step.append(out.stats.time_sampler / out.stats.nfe)
        ms = min(per_step)
        print(f"| {name} | {ms * 1e3:.2f} | {ms / floor:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=positive, default=1)
    ap.add_argument("--repeats", type=positive, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    part1(args.batch)
    part2(args.batch, args.repeats)


if __name__ == "__main__":
    main()
