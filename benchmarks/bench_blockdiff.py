"""The exact block cache of block-diffusion decoding against recomputing the canvas, at SDAR-1.7B's layer shape.

A random-weight SDAR-format model with SDAR-1.7B-Chat's per-layer shape (hidden 2048, 16 query / 8 key-value
heads of 128, MLP 6144, vocabulary 151,936, blocks of 4) and ``--layers`` layers (default 2 of its 28, to fit
this CPU's time; the LM head over the block's 4 positions costs the same in both modes, so with all 28 layers the
ratio is larger than printed here). Both modes make
the same forwards of ``dllm.blockdiff`` decoding, one block after another (``denoising_steps`` forwards per
block plus the storing one); the cached mode runs each forward over the block alone with the stored keys and
values of the earlier blocks, the recomputing mode over the whole canvas so far (what a loop without the cache
computes for the same tokens). Printed: seconds per generated token of each mode and their ratio, at growing
context lengths (prompt + generated so far), measured in one run.

    OMP_NUM_THREADS=2 python benchmarks/bench_blockdiff.py --contexts 64 256 1024 --layers 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import positive

from dllm.blockdiff import _BlockKV
from dllm.models import Transformer, TransformerConfig
from dllm.models.spec import SDAR


def model(layers: int) -> Transformer:
    cfg = TransformerConfig(vocab_size=151936, d_model=2048, n_layers=layers, n_heads=16, n_kv_heads=8,
                            mlp_hidden=6144, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, head_size=128,
                            qk_norm=True, block_size=4)
    torch.manual_seed(0)
    m = Transformer(cfg, SDAR)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    return m.eval().requires_grad_(False)


@torch.no_grad()
def time_block(m: Transformer, context: int, steps: int, reps: int) -> tuple[float, float]:
    """Seconds to decode one block of 4 after ``context`` tokens: (cached, recomputed), median of ``reps``."""
    B = m.config.block_size
    x = torch.randint(0, m.config.vocab_size, (1, context + B))
    pos = torch.arange(context + B)[None]
    cache = _BlockKV(len(m.layers))
    cache.store = True
    m(x[:, :context], positions=pos[:, :context], cache=cache, key_positions=pos[:, :context])
    stored_k, stored_v = list(cache.k), list(cache.v)
    cached, full = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(steps + 1):  # denoising forwards, then the storing one
            cache.k, cache.v, cache.store = list(stored_k), list(stored_v), i == steps
            m(x[:, context:], positions=pos[:, context:], cache=cache, key_positions=pos)
        cached.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        want = torch.arange(context, context + B)[None]
        for _ in range(steps):  # no cache: every forward over the whole canvas (no storing forward needed)
            m(x, positions=pos, logits_idx=want)  # the head only on the block, as a loop without cache needs
        full.append(time.perf_counter() - t0)
    return statistics.median(cached), statistics.median(full)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=positive, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--layers", type=positive, default=2)
    ap.add_argument("--steps", type=positive, default=4, help="denoising forwards per block (SDAR: 4)")
    ap.add_argument("--reps", type=positive, default=3, help="timed runs per context (at least 1)")
    a = ap.parse_args()
    m = model(a.layers)
    n = sum(p.numel() for p in m.parameters())
    print(f"SDAR-1.7B layer shape, {a.layers} layers ({n / 1e6:.0f}M parameters), block 4, {a.steps} denoising "
          f"forwards per block, float32, torch threads {torch.get_num_threads()}")
    print("| context | cached s/token | recomputed s/token | recomputed / cached |")
    print("|---|---|---|---|")
    for c in a.contexts:
        cached, full = time_block(m, c, a.steps, a.reps)
        print(f"| {c} | {cached / 4:.4f} | {full / 4:.4f} | {full / cached:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
