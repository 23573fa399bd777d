"""Every Triton kernel compiles for Ampere (sm_80) and Hopper (sm_90) GPUs, checked on the CPU.

The other CPU tests run the kernels under ``TRITON_INTERPRET=1``, which never compiles them: code that only the
compiler rejects (a mask of the wrong type, a constexpr expression it cannot fold, a block shape it cannot lay out)
would pass them and fail on the first GPU. ``tests/compile_kernels.py`` compiles each kernel (to PTX and a cubin,
with the ``ptxas`` that Triton ships) in a process without the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "compile_kernels.py"


def test_every_triton_kernel_compiles_for_ampere_and_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's current default, set to keep its warning out of the log
    r = subprocess.run([sys.executable, str(SCRIPT), "80", "90"], env=env, capture_output=True, text=True,
                       timeout=900)
    out = r.stdout
    assert r.returncode == 0 and "FAIL" not in out, out + r.stderr[-3000:]
    for arch in ("sm_80", "sm_90"):
        for dt in ("bf16", "fp32"):
            for name in ("attention (flash)", "attention (split-K)", "attention (split-K combine)", "attention mass",
                         "attention drift", "attention drift finish (gate=True)",
                         "confidence (noise=True, exclude=True, last program merges=False)",
                         "confidence (noise=True, exclude=True, last program merges=True)", "confidence merge",
                         "rms norm (add=True)",
                         "rope (qk norm=True, write K/V=True)", "rope (qk norm=False, write K/V=False)", "silu mul"):
                assert f"ok {arch} {dt} {name}\n" in out, (arch, dt, name)
    # 24 kernels x 2 dtypes x 2 architectures (confidence: with and without the merge; the drift's finish: with and
    # without a gate)
    assert out.count("ok ") == 96


def test_fp32_attention_tiles_fit_hoppers_registers():
    """The float32 attention launches (fixed tiles, FMA products held in registers) spill at most a few words to local
    memory on sm_90 at head dimensions 64, 128 and 256 (32-64 x 64 tiles over 4 warps spilled 6-20 KB per thread; the
    drift kernel with the whole head dimension in one tile, 0.3-0.4 KB: it reads it in chunks)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, str(SCRIPT), "--spills"], env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in r.stdout.splitlines() if line.startswith("spills ")]
    assert r.returncode == 0 and len(lines) == 30, r.stdout + r.stderr[-3000:]
    for line in lines:
        spilled = int(line.rsplit(", ", 1)[1].split()[0])
        assert spilled <= 64, line
