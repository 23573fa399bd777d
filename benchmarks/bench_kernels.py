"""Kernel throughput: attention (SDPA, flash, split-K and the dispatcher's choice), attention mass, the attention
drift test and confidence statistics at dLLM shapes.

Attention on a GPU: Lq = 32 active query rows over Lk = 1024 / 2048 / 4096 keys, head dim 128, heads 32:32 (LLaDA)
and 28:4 (Dream), batch 1 and 4, no key mask (so SDPA's flash / cuDNN backends are eligible). Columns, in ms, and
each one's ratio ``t_sdpa / t`` (above 1: faster than SDPA):

* ``sdpa``: ``F.scaled_dot_product_attention(q, k, v, enable_gqa=...)``;
* ``triton``: :func:`dllm.kernels.triton_kernels.attention` (FlashAttention-2 forward);
* ``splitk``: :func:`dllm.kernels.triton_kernels.attention_splitk` (flash-decoding, packed GQA groups);
* ``splitk-2x`` and ``splitk-wide``: the same with about twice its split count and with the most splits in four
  waves of programs (:func:`~dllm.kernels.triton_kernels.splitk_candidates`, the dispatch's candidates of those
  names; ``-`` where the count is split-K's own);
* ``auto``: :func:`dllm.kernels.attention` on the Triton backend (the per-bucket measured choice, shown).

Attention mass (batch 1, LSE given): reference against Triton. Elastic-Cache's drift test (``attention_drift``,
batch 1, 32 tracked rows over a 768- and a 4,096-key canvas, heads 32:32): its reference twin (the PyTorch
composition it replaces: two softmaxes, the cosine over heads, the masked mean) against the Triton kernel, eagerly
and, on CUDA, from a CUDA graph (where Elastic-Cache runs it), with ``t_reference / t``. Confidence statistics at
32 positions x V = 126,464 in bf16 and fp32: the PyTorch composition ``softmax + top-2 + entropy`` (``torch``), the
reference twin and the Triton kernel, with ``t_torch / t``.

GPU timings use ``triton.testing.do_bench`` (median ms, CUDA events). On a machine without CUDA the script runs tiny
shapes with the Triton kernels under the interpreter (it sets ``TRITON_INTERPRET=1`` before Triton is imported): a
smoke test whose timings and ratios say nothing about speed.

    python benchmarks/bench_kernels.py [--device cpu|cuda] [--repeats 20] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from _common import positive

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch.nn.functional as F  # noqa: E402

import dllm.kernels as kernels  # noqa: E402
from dllm.kernels import reference  # noqa: E402

# the goal shapes first (batch 1, 4,096 keys): a run cut short by its time limit still has them
GPU = dict(lq=32, d=128, lks=(4096, 2048, 1024), heads=((32, 32), (28, 4)), batches=(1, 4), positions=32, vocab=126_464)
CPU = dict(lq=4, d=16, lks=(64, 128), heads=((4, 4), (4, 1)), batches=(1,), positions=4, vocab=2048)


def _time_ms(fn, repeats: int, device: torch.device) -> float:
    """Median milliseconds per call."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=max(repeats, 20), return_mode="median")
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _graphed(fn):
    """``fn`` captured in a CUDA graph (after two eager warm-up calls): the replay measures GPU time without the
    host's launch overhead, as a graph-captured decode step would see it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _torch_confidence(logits):
    p = torch.softmax(logits.float(), -1)
    top2 = torch.topk(p, 2, -1)
    entropy = -torch.special.xlogy(p, p).sum(-1)
    return top2.indices[..., 0], top2.values, entropy


def _load_triton(device: torch.device):
    """``(module or None, why not)``."""
    try:
        from dllm.kernels import triton_kernels
    except ImportError as exc:
        return None, f"Triton unavailable: {exc}"
    if device.type != "cuda" and not triton_kernels._interpreting():
        return None, "CPU without the Triton interpreter"
    return triton_kernels, ""


def _attention_methods(tk, q, k, v):
    gqa = q.shape[1] != k.shape[1]
    methods = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)}
    if tk is not None:
        methods["triton"] = lambda: tk.attention(q, k, v)
        splits = tk.splitk_candidates(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.dtype)
        for name, n in splits.items():
            methods[name] = lambda n=n: tk.attention_splitk(q, k, v, num_splits=n)
        methods["auto"] = lambda: kernels.attention(q, k, v)
    return methods


COLUMNS = ("sdpa", "triton", "splitk", "splitk-2x", "splitk-wide", "auto")


def _copy_rate(device: torch.device) -> float | None:
    """Bytes per millisecond a device-to-device copy of 256 MiB moves, reads and writes counted (None off a GPU)."""
    if device.type != "cuda":
        return None
    src = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / _time_ms(lambda: dst.copy_(src), 20, device)


def _tuned_configs(tk, methods) -> dict[str, str]:
    """The autotuner's configuration of each Triton attention method for these inputs (``BLOCK_M x BLOCK_N, warps,
    stages``): its last call sets the kernel's ``best_config``."""
    out = {}
    for name, fn in methods.items():
        kern = tk._attn_fwd_tuned if name == "triton" else tk._attn_splitk_tuned if name.startswith("splitk") else None
        if kern is None:
            continue
        fn()
        c = getattr(kern, "best_config", None)
        if c is not None:
            out[name] = f"{c.kwargs.get('BLOCK_M')}x{c.kwargs.get('BLOCK_N')} w{c.num_warps} s{c.num_stages}"
    return out


def bench_attention(cfg, device, dtype, repeats, tk, rows):
    from dllm.kernels import dispatch

    print(f"\n## attention (Lq={cfg['lq']}, D={cfg['d']}, {dtype}): ms, and t_sdpa / t")
    head = f"{'B':>2} {'Hq:Hkv':>7} {'Lk':>5} " + " ".join(f"{c:>15}" for c in COLUMNS)
    print(head + "  auto's choice" + ("  (second line: the same call replayed from a CUDA graph, against the K/V "
                                      "read floor; third: the autotuned tiles)" if device.type == "cuda" else ""))
    rate = _copy_rate(device)
    if rate is not None:
        print(f"device-to-device copy: {rate / 1e9:.2f} TB/s, reads and writes counted; the K/V read floor is K and "
              f"V's bytes at that rate")
    for B in cfg["batches"]:
        for hq, hkv in cfg["heads"]:
            for lk in cfg["lks"]:
                g = torch.Generator(device=device).manual_seed(0)
                q = torch.randn(B, hq, cfg["lq"], cfg["d"], device=device, dtype=dtype, generator=g)
                k = torch.randn(B, hkv, lk, cfg["d"], device=device, dtype=dtype, generator=g)
                v = torch.randn(B, hkv, lk, cfg["d"], device=device, dtype=dtype, generator=g)
                methods = _attention_methods(tk, q, k, v)
                ms = {name: _time_ms(fn, repeats, device) for name, fn in methods.items()}
                choice = dispatch.choose(tk, q, k, v) if tk is not None else "-"
                cells = " ".join(f"{ms[c]:8.4f} {ms['sdpa'] / ms[c]:5.2f}x" if c in ms else f"{'-':>15}"
                                 for c in COLUMNS)
                print(f"{B:>2} {hq:>3}:{hkv:<3} {lk:>5} {cells}  {choice}")
                row = {"kernel": "attention", "B": B, "Hq": hq, "Hkv": hkv, "Lq": cfg["lq"], "Lk": lk, "D": cfg["d"],
                       "dtype": str(dtype), "ms": ms, "auto_choice": choice}
                if device.type == "cuda":
                    g = {name: _time_ms(_graphed(fn), repeats, device) for name, fn in methods.items()}
                    cells = " ".join(f"{g[c]:8.4f} {g['sdpa'] / g[c]:5.2f}x" if c in g else f"{'-':>15}"
                                     for c in COLUMNS)
                    floor = (k.numel() * k.element_size() + v.numel() * v.element_size()) / rate
                    print(f"{'':>2} {'graph':>7} {lk:>5} {cells}  floor {floor:.4f} ms")
                    row["graph_ms"], row["kv_floor_ms"] = g, floor
                if tk is not None:
                    row["splits"] = tk.splitk_candidates(B, hq, hkv, cfg["lq"], lk, dtype)
                    row["tuned"] = _tuned_configs(tk, methods)
                    if device.type == "cuda":
                        print(f"{'':>2} {'tiles':>7} {lk:>5} " + ", ".join(
                            f"{n} {c}" + (f" ({row['splits'][n]} splits)" if n in row["splits"] else "")
                            for n, c in row["tuned"].items()))
                rows.append(row)


def bench_mass(cfg, device, dtype, repeats, tk, rows):
    print(f"\n## attention mass (B=1, Lq={cfg['lq']}, LSE given, {dtype}): ms")
    for hq, hkv in cfg["heads"]:
        for lk in cfg["lks"]:
            q = torch.randn(1, hq, cfg["lq"], cfg["d"], device=device, dtype=dtype)
            k = torch.randn(1, hkv, lk, cfg["d"], device=device, dtype=dtype)
            _, lse = reference.attention(q, k, k, return_lse=True)
            ms = {"reference": _time_ms(lambda: reference.attention_mass(q, k, lse=lse), repeats, device)}  # noqa: B023
            if tk is not None:
                ms["triton"] = _time_ms(lambda: tk.attention_mass(q, k, lse=lse), repeats, device)  # noqa: B023
            print(f"{hq:>3}:{hkv:<3} {lk:>5} " + " ".join(f"{n} {t:8.4f}" for n, t in ms.items()))
            rows.append({"kernel": "attention_mass", "Hq": hq, "Hkv": hkv, "Lq": cfg["lq"], "Lk": lk, "D": cfg["d"],
                         "dtype": str(dtype), "ms": ms})


def bench_drift(cfg, device, dtype, repeats, tk, rows):
    lq, lks = cfg["lq"], ((768, 4096) if device.type == "cuda" else cfg["lks"])
    hq = hkv = cfg["heads"][0][0]
    print(f"\n## attention drift (B=1, Lq={lq} tracked rows, {hq}:{hkv} heads, {dtype}): ms, and t_reference / t")
    for lk in lks:
        g = torch.Generator(device=device).manual_seed(lk)
        q_old, q_new = (torch.randn(1, hq, lq, cfg["d"], device=device, dtype=dtype, generator=g) for _ in "on")
        k_old = torch.randn(1, hkv, lk, cfg["d"], device=device, dtype=dtype, generator=g)
        k_new = k_old.clone()
        mask = torch.ones(1, lk, dtype=torch.bool, device=device)
        ok = torch.ones(1, lq, dtype=torch.bool, device=device)
        args = (q_old, k_old, q_new, k_new, mask, ok)
        methods = {"reference": lambda: reference.attention_drift(*args)}  # noqa: B023
        if tk is not None:
            methods["triton"] = lambda: tk.attention_drift(*args)  # noqa: B023
        ms = {n: _time_ms(f, repeats, device) for n, f in methods.items()}
        print(f"{'eager':>6} {lk:>5} " + " ".join(f"{n} {t:8.4f} {ms['reference'] / t:5.2f}x" for n, t in ms.items()))
        row = {"kernel": "attention_drift", "Hq": hq, "Hkv": hkv, "Lq": lq, "Lk": lk, "D": cfg["d"],
               "dtype": str(dtype), "ms": ms}
        if device.type == "cuda":
            gr = {n: _time_ms(_graphed(f), repeats, device) for n, f in methods.items()}
            print(f"{'graph':>6} {lk:>5} " + " ".join(f"{n} {t:8.4f} {gr['reference'] / t:5.2f}x"
                                                     for n, t in gr.items()))
            row["graph_ms"] = gr
        rows.append(row)


def bench_confidence(cfg, device, dtypes, repeats, tk, rows):
    n, vocab = cfg["positions"], cfg["vocab"]
    print(f"\n## confidence_stats ({n} positions, V={vocab}): ms, and t_torch / t (torch = softmax + top-2 + entropy)")
    for dtype in dtypes:
        logits = torch.randn(n, vocab, device=device, dtype=dtype) * 3
        methods = {"torch": lambda: _torch_confidence(logits),  # noqa: B023
                   "reference": lambda: reference.confidence_stats(logits)}  # noqa: B023
        modes = {}
        if tk is not None:
            methods["triton"] = lambda: tk.confidence_stats(logits)  # noqa: B023
            # the default, one launch (the row's last program merges), and the merge as a second launch
            # (set_confidence_merge)
            methods["triton-2launch"] = methods["triton"]
            modes = {"triton": "last-program", "triton-2launch": "kernel"}

        def timed(name, fn, time_it, modes=modes):
            prev = tk.set_confidence_merge(modes[name]) if name in modes else None
            try:
                return time_it(fn)
            finally:
                if prev is not None:
                    tk.set_confidence_merge(prev)

        ms = {name: timed(name, fn, lambda f: _time_ms(f, repeats, device)) for name, fn in methods.items()}
        print(f"{str(dtype):>15} " + " ".join(f"{c} {t:8.4f} {ms['torch'] / t:5.2f}x" for c, t in ms.items()))
        row = {"kernel": "confidence_stats", "N": n, "V": vocab, "dtype": str(dtype), "ms": ms}
        if device.type == "cuda":
            g = {name: timed(name, fn, lambda f: _time_ms(_graphed(f), repeats, device)) for name, fn in methods.items()}
            print(f"{'graph':>15} " + " ".join(f"{c} {t:8.4f} {g['torch'] / t:5.2f}x" for c, t in g.items()))
            row["graph_ms"] = g
        rows.append(row)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=positive, default=20, help="timed runs per figure (at least 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    cfg = GPU if on_gpu else CPU
    dtype = torch.bfloat16 if on_gpu else torch.float32
    tk, why = _load_triton(device)
    kernels.set_backend("triton" if tk is not None else "reference")
    name = torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter: timings say nothing about speed)"
    print(f"device={device} ({name}) torch={torch.__version__} threads={torch.get_num_threads()} "
          f"repeats={args.repeats}" + (f"; Triton rows not measured: {why}" if tk is None else ""))
    rows = _Rows(args.json, {"device": name, "torch": torch.__version__})
    first, rest = dict(cfg, batches=cfg["batches"][:1]), dict(cfg, batches=cfg["batches"][1:])
    bench_attention(first, device, dtype, args.repeats, tk, rows)
    bench_confidence(cfg, device, (torch.bfloat16, torch.float32) if on_gpu else (torch.float32,), args.repeats,
                     tk, rows)
    if rest["batches"]:
        bench_attention(rest, device, dtype, args.repeats, tk, rows)
    bench_mass(cfg, device, dtype, args.repeats, tk, rows)
    bench_drift(cfg, device, dtype, args.repeats, tk, rows)
    if args.json:
        print(f"\nwrote {args.json}")


class _Rows(list):
    """The figures' rows, written to ``path`` (JSON, with ``head`` and the dispatch's choices) after every row: a
    run stopped by a time limit keeps what it measured."""

    def __init__(self, path, head: dict):
        super().__init__()
        self.path, self.head = path, head

    def append(self, row: dict) -> None:
        super().append(row)
        if self.path:
            with open(self.path, "w") as f:
                json.dump({**self.head, "rows": list(self),
                           "attention_choices": {str(k): v for k, v in kernels.attention_choices().items()}}, f,
                          indent=1)


if __name__ == "__main__":
    main()
