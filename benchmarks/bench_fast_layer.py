"""The fast layer path on CUDA against the eager layer: device operations per forward, time per forward, agreement.

A random bf16 model with LLaDA-8B's layer shape (d 4096, 32 heads, MLP 12288), 4 layers, vocabulary 32000, one
forward of 32 positions. Prints the number of device operations (kernels and copies seen by the profiler) and the
mean time of a forward for the eager and the fast layer, the largest logit difference and the argmax agreement,
whether the fast forward synchronises with the host (``torch.cuda.set_sync_debug_mode("error")``), the compiled
fast model (inductor, the fused kernels as custom operators) and a CUDA graph of the fast forward.

    PYTHONPATH=. python benchmarks/bench_fast_layer.py
"""

import argparse
import sys
import time

import torch


def count(f):
    from torch.profiler import ProfilerActivity, profile

    f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as pr:
        f()
        torch.cuda.synchronize()
    return sum(1 for e in pr.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def tm(f):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / 20 * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fast_layer.py: needs a CUDA device (the fast layer path is CUDA-only); none is available",
              file=sys.stderr)
        return 1
    from dllm.models import Transformer, TransformerConfig
    from dllm.models.fast import enable_fast_path
    from dllm.models.spec import LLADA

    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=32000, d_model=4096, n_layers=4, n_heads=32, n_kv_heads=32, mlp_hidden=12288)
    with torch.device("cuda"):
        m = Transformer(cfg, LLADA).to(torch.bfloat16)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.fill_(1.0) if n.endswith("norm.weight") else p.normal_(0, 0.02)
    m.eval().requires_grad_(False)
    tok = torch.randint(0, 32000, (1, 32), device="cuda")

    e = m(tok)
    ke, te = count(lambda: m(tok)), tm(lambda: m(tok))
    enable_fast_path(m)
    f = m(tok)
    kf, tf = count(lambda: m(tok)), tm(lambda: m(tok))
    print(f"4 layers + head, [1, 32]: device ops per forward eager {ke} fast {kf}; ms eager {te:.2f} fast {tf:.2f}; "
          f"max |diff| {(e.float() - f.float()).abs().max().item():.4f}; argmax agree "
          f"{(e.argmax(-1) == f.argmax(-1)).float().mean().item():.3f}", flush=True)
    try:
        torch.cuda.set_sync_debug_mode("error")
        m(tok)
        torch.cuda.set_sync_debug_mode(0)
        print("fast forward: no host synchronisation", flush=True)
    except Exception as ex:
        torch.cuda.set_sync_debug_mode(0)
        print("fast forward synchronises:", type(ex).__name__, str(ex)[:300], flush=True)
    try:
        c = torch.compile(m)
        out = c(tok)
        print(f"compiled fast (inductor, triton ops) max |diff| vs fast eager {(out.float() - f.float()).abs().max().item():.4f};"
              f" ms {tm(lambda: c(tok)):.2f}", flush=True)
    except Exception as ex:
        print("compile failed:", type(ex).__name__, str(ex)[:1500], flush=True)
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            m(tok)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            go = m(tok)
        g.replay()
        torch.cuda.synchronize()
        print(f"CUDA graph of the fast forward: replay max |diff| {(go.float() - f.float()).abs().max().item():.4f}; "
              f"ms {tm(g.replay):.2f}", flush=True)
    except Exception as ex:
        print("graph capture failed:", type(ex).__name__, str(ex)[:600], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
