"""Kernel throughput: attention, attention mass and confidence statistics at dLLM shapes.

Attention: batch 1, Lq = 32 active query rows over Lk = 1024 / 4096 keys, head dim 128, GQA 32:32 (LLaDA) and
28:4 (Dream), a key-padding mask with every key valid. Reported as achieved TFLOP/s (``4 * Hq * Lq * Lk * D``
flops) and GB/s (Q, K, V read once, O written once), for

* ``sdpa``: ``F.scaled_dot_product_attention`` (``enable_gqa``, no mask, so the flash backend is eligible on GPU);
* ``reference``: :func:`dllm.kernels.reference.attention` (SDPA with a mask) and ``reference+lse`` (its LSE path,
  which materialises the scores);
* ``triton``: :func:`dllm.kernels.triton_kernels.attention` (CUDA only; on CPU Triton runs only under the
  interpreter, which says nothing about speed, so it is reported as not measured).

Attention mass (Lq = 32 selected rows, LSE given): reference against Triton, in GB/s (Q and K read once).
Confidence statistics at V = 126,464 and 32 positions, in GB/s of logits read: PyTorch ``softmax + top-2 +
entropy`` (``torch``), :func:`~dllm.kernels.reference.confidence_stats` and the Triton kernel.

Each figure is the median of ``--repeats`` timed calls after warm-up (CUDA events on GPU). Speed-up columns read the
goals directly: ``vs sdpa`` = ``t_sdpa / t_method`` for attention (goal: Triton >= 1x) and ``vs torch`` =
``t_torch / t_method`` for confidence (goal: Triton >= 3x); a ratio above 1 means faster than the baseline. On a CUDA
machine without Triton the Triton rows are reported as unavailable and the rest still runs.

    python benchmarks/bench_kernels.py [--device cpu|cuda] [--dtype bf16|fp16|fp32] [--repeats 20] [--threads N]

Smallest run (a smoke test, timings meaningless): ``--device cpu --repeats 1 --threads 1``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from dllm.kernels import reference

ATTN_SHAPES = [(32, 32, 1024), (32, 32, 4096), (28, 4, 1024), (28, 4, 4096)]  # (Hq, Hkv, Lk)
LQ, D, V, POSITIONS = 32, 128, 126_464, 32
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _time(fn, repeats: int, device: torch.device) -> float:
    """Median seconds per call."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _torch_confidence(logits):
    p = torch.softmax(logits.float(), -1)
    top2 = torch.topk(p, 2, -1)
    entropy = -torch.special.xlogy(p, p).sum(-1)
    return top2.indices[..., 0], top2.values, entropy


def _load_triton(device: torch.device):
    """``(module or None, why not)``: the Triton kernels on CUDA when Triton imports; on CPU Triton runs only under
    the interpreter, which says nothing about speed."""
    if device.type != "cuda":
        return None, "CPU: interpreter only"
    try:
        from dllm.kernels import triton_kernels
    except ImportError as exc:
        return None, f"Triton unavailable: {exc}"
    return triton_kernels, ""


def _bench_attention(hq, hkv, lk, device, dtype, elem, repeats, tk, why) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, hq, LQ, D, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, hkv, lk, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, hkv, lk, D, device=device, dtype=dtype, generator=g)
    mask = torch.ones(1, lk, dtype=torch.bool, device=device)
    flops = 4 * hq * LQ * lk * D
    nbytes = (2 * hq * LQ * D + 2 * hkv * lk * D) * elem
    methods = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv),
        "reference": lambda: reference.attention(q, k, v, key_padding_mask=mask),
        "reference+lse": lambda: reference.attention(q, k, v, key_padding_mask=mask, return_lse=True),
    }
    if tk is not None:
        methods["triton"] = lambda: tk.attention(q, k, v, key_padding_mask=mask)
        methods["triton+lse"] = lambda: tk.attention(q, k, v, key_padding_mask=mask, return_lse=True)
    t_sdpa = None
    for name, fn in methods.items():
        s = _time(fn, repeats, device)
        t_sdpa = s if name == "sdpa" else t_sdpa
        print(f"{hq}:{hkv:<4} {lk:>5} {name:>14} {s * 1e3:9.3f} {flops / s / 1e12:8.3f} {nbytes / s / 1e9:7.1f} "
              f"{t_sdpa / s:8.2f}x")
    if tk is None:
        print(f"{hq}:{hkv:<4} {lk:>5} {'triton':>14}  not measured ({why})")
    _, lse = reference.attention(q, k, v, key_padding_mask=mask, return_lse=True)
    mass_bytes = (hq * LQ * D + hkv * lk * D) * elem
    mass = {"mass-reference": lambda: reference.attention_mass(q, k, key_padding_mask=mask, lse=lse)}
    if tk is not None:
        mass["mass-triton"] = lambda: tk.attention_mass(q, k, key_padding_mask=mask, lse=lse)
    for name, fn in mass.items():
        s = _time(fn, repeats, device)
        print(f"{hq}:{hkv:<4} {lk:>5} {name:>14} {s * 1e3:9.3f} {flops / 2 / s / 1e12:8.3f} {mass_bytes / s / 1e9:7.1f} "
              f"{'-':>9}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    tk, why = _load_triton(device)
    elem = torch.finfo(dtype).bits // 8
    print(f"device={device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}) dtype={dtype} "
          f"threads={torch.get_num_threads()} repeats={args.repeats}")
    print("\n## attention (B=1, Lq=32, D=128)")
    print("goal: triton >= 1x sdpa (mass rows have no SDPA counterpart)")
    print(f"{'Hq:Hkv':>7} {'Lk':>5} {'method':>14} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>7} {'vs sdpa':>9}")
    for hq, hkv, lk in ATTN_SHAPES:
        _bench_attention(hq, hkv, lk, device, dtype, elem, args.repeats, tk, why)

    print(f"\n## confidence_stats ({POSITIONS} positions, V={V})")
    print("goal: triton >= 3x torch (torch = softmax + top-2 + entropy)")
    print(f"{'method':>14} {'ms':>9} {'GB/s':>7} {'vs torch':>9}")
    logits = torch.randn(1, POSITIONS, V, device=device, dtype=dtype) * 3
    nbytes = logits.numel() * elem
    conf = {"torch": lambda: _torch_confidence(logits), "reference": lambda: reference.confidence_stats(logits)}
    if tk is not None:
        conf["triton"] = lambda: tk.confidence_stats(logits)
    t_torch = None
    for name, fn in conf.items():
        s = _time(fn, args.repeats, device)
        t_torch = s if name == "torch" else t_torch
        print(f"{name:>14} {s * 1e3:9.3f} {nbytes / s / 1e9:7.1f} {t_torch / s:8.2f}x")
    if tk is None:
        print(f"{'triton':>14}  not measured ({why})")


if __name__ == "__main__":
    main()
