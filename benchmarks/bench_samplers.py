"""Per-step cost of every sampler and preset against one softmax pass over the same logits.

A random-weight one-layer model with LLaDA's vocabulary (126,464) decodes ``--gen`` tokens in blocks of 32
(prompts of 4 tokens, ``--batch`` rows); the sampler's share of each step (``stats.time_sampler / nfe``:
the sampler's ``step``, the block policy's ``refine`` and the loop's commit bookkeeping) is compared with
the floor: the same loop with a sampler that does one float32 softmax over the window's ``[batch, 32,
126464]`` logits and commits one token (so the floor includes the loop's own per-step bookkeeping and
fresh, uncached logits, exactly like the samplers measured). The random model's confidences are low, so
threshold-style rules commit about one token per step and each block takes ~32 steps (the expensive end).
Each figure is the minimum over ``--repeats`` runs (the per-step mean within a run), to damp the noise of a
shared machine.

``--confident F`` makes a share ``F`` of the canvas columns confident: their logits get +40 at one fixed
token, so those positions are near-certain and stable from step to step (the columns are picked by a fixed
hash of the column index). The random model alone is never confident, so without it the rules that only do
work at confident candidates (KLASS's KL, Prophet's early commit) are measured on their cheap path; e.g.
``--samplers llada,klass --confident 0.125`` (4 of 32 rows) and ``--confident 1``.

The ``guided`` preset is left out: its guide is a causal LM with the dLLM's tokenizer, which the random
126,464-token model has not (``benchmarks/bench_guided.py`` measures it on the bundled tiny models).

    python benchmarks/bench_samplers.py [--batch 1] [--repeats 5] [--threads N] [--device cpu|cuda]
                                        [--samplers klass,llada] [--confident 0.125]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from _common import positive

import dllm
from dllm.models import LLADA, Transformer, TransformerConfig
from dllm.models.weights import init_weights
from dllm.samplers import StepResult, get_sampler
from dllm.samplers.presets import PRESETS

V, BLOCK = 126_464, 32
BASELINES = ("llada", "dream-maskgit-plus")
SKIPPED = ("guided",)  # needs a guide LM with the dLLM's tokenizer (benchmarks/bench_guided.py)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _min_time(fn, repeats: int, device) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def per_step(model, prompts, sampler, gen: int, repeats: int) -> tuple[float, int]:
    """(min over runs of the sampler seconds per step, steps)."""
    kw = dict(gen_length=gen, block_length=BLOCK, sampler=sampler)  # AdaBlock: its fallback B0
    dllm.generate(model, prompts, **kw)  # warm-up
    best, nfe = float("inf"), 0
    for _ in range(repeats):
        out = dllm.generate(model, prompts, **kw)
        best, nfe = min(best, out.stats.time_sampler / out.stats.nfe), out.stats.nfe
    return best, nfe


class ConfidentModel(Transformer):
    """The random model with a share ``confident`` of its columns made certain (+40 at one token per column)."""

    confident = 0.0

    def forward(self, tokens, *, logits_idx=None, **kw):
        logits = super().forward(tokens, logits_idx=logits_idx, **kw)
        if self.confident > 0:
            B, T = tokens.shape
            cols = torch.arange(T, device=tokens.device).expand(B, T) if logits_idx is None else logits_idx
            hot = (cols * 2654435761 % 1000) < self.confident * 1000  # a fixed pseudo-random choice of columns
            token = 1000 + cols % 97  # not the mask, EOS or EOT id
            boost = torch.zeros_like(logits).scatter_(-1, token[..., None], 40.0)
            logits = logits + boost * hot[..., None]
        return logits


def build_model(device, confident: float = 0.0) -> Transformer:
    cfg = TransformerConfig(vocab_size=V, d_model=64, n_layers=1, n_heads=2, n_kv_heads=2, mlp_hidden=128,
                            max_seq_len=512)
    torch.manual_seed(0)
    model = ConfidentModel(cfg, LLADA)
    model.confident = confident
    init_weights(model, std=0.5)
    model.eval().requires_grad_(False).to(device)
    model.mask_id, model.eos_id, model.eot_id, model.pad_id = V - 1, 1, 2, 1
    return model


@dataclass(frozen=True)
class SoftmaxFloor:
    """The floor: one float32 softmax over the window's logits, then the first candidate of each row."""

    name: str = "softmax-floor"

    def step(self, logits, ctx):
        p = torch.softmax(logits.float(), dim=-1)
        first = ctx.cand & (ctx.cand.long().cumsum(-1) == 1)
        return StepResult(torch.where(ctx.cand, p[..., 0].long(), ctx.x), first)


def sampler_for(name: str):
    if name == "adablock":  # the random model has no tokenizer: newline ids given directly
        return get_sampler(name, delimiters=(198, 271))
    return get_sampler(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=positive, default=1)
    ap.add_argument("--repeats", type=positive, default=5)
    ap.add_argument("--gen", type=positive, default=64, help=f"generation length (blocks of {BLOCK}: a multiple of {BLOCK})")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--samplers", default=None,
                    help="comma-separated names to measure, any registered sampler but guided (default: the baselines and "
                         "every preset but guided)")
    ap.add_argument("--confident", type=float, default=0.0,
                    help="share of the columns made confident and stable (0: the random model alone)")
    args = ap.parse_args()
    if args.gen % BLOCK:
        ap.error(f"--gen {args.gen}: the samplers decode blocks of {BLOCK}, so give a multiple of {BLOCK}, e.g. --gen "
                 f"{max(BLOCK, args.gen // BLOCK * BLOCK)}")
    if not 0 <= args.confident <= 1:
        ap.error(f"--confident {args.confident} is out of range; give a share in [0, 1]")
    names = [n for n in (*BASELINES, *PRESETS) if n not in SKIPPED]
    if args.samplers:
        known = [e.name for e in dllm.list_samplers() if e.name not in SKIPPED]  # any registered sampler by name
        names = args.samplers.split(",")
        bad = sorted(set(names) - set(known))
        if bad:
            ap.error(f"--samplers: cannot measure {bad}; choose from {', '.join(known)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    B = args.batch
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, batch {B}, "
          f"gen {args.gen}, block {BLOCK}, V {V}, confident share {args.confident}")
    model = build_model(device, args.confident)
    prompts = [[5 + i, 6, 7, 8] for i in range(B)]
    logits = torch.randn(B, BLOCK, V, device=device)
    bare = _min_time(lambda: torch.softmax(logits, dim=-1), max(args.repeats, 5) * 4, device)
    floor, _ = per_step(model, prompts, SoftmaxFloor(), args.gen, args.repeats)
    print(f"one fp32 softmax over [{B}, {BLOCK}, {V}] (warm, bare): {bare * 1e3:.2f} ms; "
          f"floor in the loop (fresh logits + loop bookkeeping): {floor * 1e3:.2f} ms\n")
    print("| sampler | steps | tokens/step | per-step ms | x floor | x bare softmax |")
    print("|---|---|---|---|---|---|")
    for name in names:
        sec, nfe = per_step(model, prompts, sampler_for(name), args.gen, args.repeats)
        print(f"| {name} | {nfe} | {args.gen / nfe:.2f} | {sec * 1e3:.2f} | {sec / floor:.2f} | {sec / bare:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
