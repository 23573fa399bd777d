"""Compile every Triton kernel of dllm for a GPU target on a machine without a GPU (run as a script, without
``TRITON_INTERPRET``: the interpreter never compiles, so code that only the compiler rejects would pass the CPU
tests). Prints one line per kernel, ``ok NAME`` or ``FAIL NAME: error``; exit status 1 when one failed.

    python tests/compile_kernels.py [ARCH ...]      # default 90 (Hopper); e.g. 80 (Ampere)
    python tests/compile_kernels.py --spills        # the fp32 attention tiles on Hopper: registers and spills

``--spills`` compiles the attention kernels with the fixed float32 tiles they run on a GPU
(:func:`dllm.kernels.triton_kernels.fp32_tiles`) and prints ``ptxas -v``'s registers and spill stores per kernel
and head dimension, ``spills NAME D=d rows=r: R registers, S bytes`` (exit status 1 where one spills more than
``SPILL_LIMIT`` bytes): a kernel whose registers overflow into local memory still computes the right result, only
slowly, so no other test notices.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dllm.kernels import fused  # noqa: E402
from dllm.kernels import triton_kernels as T  # noqa: E402

FLOATS = {"eps", "temperature"}  # fp32 scalars; every other non-pointer argument is an int32


def signature(fn, pointers: dict, constexprs: dict, ints64=()) -> dict:
    """Triton signature of ``fn``: ``pointers`` maps pointer arguments to their element type."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + pointers[name]
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if name in ints64 else "i32"
    return sig


DRIFT = dict(LseO="fp32", LseN="fp32", Mask="u8", RowOk="u8", Part="fp32")


def cases(dt: str):
    """(name, jit function, pointer element types, constexprs) for the model dtype ``dt`` (bf16 or fp32)."""
    ieee = dt == "fp32"
    attn = dict(Q=dt, K=dt, V=dt, Out=dt, Lse="fp32", Mask="u8")
    common = dict(QK_SCALE=0.12, HAS_MASK=True, IEEE=ieee, BLOCK_M=32, BLOCK_N=64, BLOCK_D=128)
    yield "attention (flash)", T._attn_fwd, attn, dict(common, WRITE_OUT=True)
    yield "attention (flash, LSE only)", T._attn_fwd, attn, dict(common, HAS_MASK=False, WRITE_OUT=False)
    yield "attention (split-K)", T._attn_splitk, dict(attn, Out="fp32"), common
    yield "attention (split-K combine)", T._attn_combine, dict(Part="fp32", PLse="fp32", Out=dt, Lse="fp32"), \
        dict(BLOCK_S=16, BLOCK_D=128)
    yield "attention mass", T._attn_mass, dict(Q=dt, K=dt, Lse="fp32", Mask="u8", Part="fp32"), \
        dict(QK_SCALE=0.12, HAS_MASK=True, IEEE=ieee, BLOCK_M=32, BLOCK_N=64, BLOCK_D=128)
    yield "attention drift", T._attn_drift, DRIFT | dict(QO=dt, KO=dt, QN=dt, KN=dt), \
        dict(QK_SCALE=0.12, EPS=1e-8, HAS_MASK=True, IEEE=ieee, BLOCK_M=32, BLOCK_N=64, BLOCK_D=64)
    for gate in (False, True):
        yield f"attention drift finish (gate={gate})", T._drift_finish, \
            dict(Part="fp32", Sim="fp32", Gate="fp32", First="i64"), dict(HAS_GATE=gate, BLOCK=1024)
    conf = dict(L=dt, U="fp32", Stats="fp32", Idx="i32", Count="i32", Token="i64", Out="fp32")
    for noise in (False, True):
        for excl in (False, True):
            for last in (False, True):  # the row's last program merging: the one-launch form
                yield f"confidence (noise={noise}, exclude={excl}, last program merges={last})", T._conf_partial, \
                    conf, dict(HAS_NOISE=noise, HAS_EXCL=excl, TRACK=noise or excl, BLOCK_V=1024,
                               LAST_MERGES=last, BLOCK_S=64)
    yield "confidence merge", T._conf_merge, dict(Stats="fp32", Idx="i32", Token="i64", Out="fp32"), \
        dict(TRACK=True, BLOCK_S=64)
    k = fused._ops().kernels
    for has_y in (False, True):
        yield f"rms norm (add={has_y})", k["norm"], dict(X=dt, Y=dt, W=dt, RES=dt, OUT=dt), \
            dict(HAS_Y=has_y, BLOCK=4096)
    rope = dict(QKV=dt, COS="fp32", SIN="fp32", NW=dt, OUT=dt, KOUT=dt, VOUT=dt, ROWS="i64")
    for norm in (False, True):
        for write in (False, True):
            yield f"rope (qk norm={norm}, write K/V={write})", k["rope"], rope, \
                dict(HAS_NORM=norm, WRITE_KV=write, BLOCK_H=16, BLOCK=128)
    yield "silu mul", k["silu_mul"], dict(GU=dt, OUT=dt), dict(BLOCK=1024)


# program ids that index a batch, head or row and so multiply large strides: each must be widened to int64 before
# it does (an int32 product passes 2^31 at LLaDA-8B's size: a batch stride of a view of the fused QKV output,
# rows x a 126,464-word vocabulary)
WIDE = {T._attn_fwd: ("y",), T._attn_splitk: ("y", "z"), T._attn_combine: ("x",), T._attn_mass: ("y",),
        T._attn_drift: ("y",), T._drift_finish: ("x",), T._conf_partial: ("x",), T._conf_merge: ("x",)}


def narrow_program_ids(fn, ttir: str) -> list[str]:
    """The axes of ``WIDE[fn]`` whose program id the compiled kernel (its TTIR) never extends to int64."""
    import re

    ids = dict((axis, v) for v, axis in re.findall(r"(%\S+) = tt.get_program_id (\w+) : i32", ttir))
    return [axis for axis in WIDE.get(fn, ()) if axis not in ids or
            not re.search(rf"arith.extsi {re.escape(ids[axis])} : i32 to i64", ttir)]


def main(archs) -> int:
    failed = 0
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for dt in ("bf16", "fp32"):
            for name, fn, pointers, constexprs in cases(dt):
                label = f"sm_{arch} {dt} {name}"
                try:
                    k = triton.compile(ASTSource(fn=fn, signature=signature(fn, pointers, constexprs),
                                                 constexprs=constexprs), target=target)
                    narrow = narrow_program_ids(fn, k.asm["ttir"])
                    if narrow:
                        raise AssertionError(f"program ids {narrow} index with int32 offsets (widen them to int64)")
                    print(f"ok {label}", flush=True)
                except Exception as exc:  # report every kernel, then fail
                    failed += 1
                    print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    return 1 if failed else 0


UNIT_STRIDES = {"sqd", "skd", "svd", "sod", "slm", "smn", "spd", "spn"}
SPILL_LIMIT = 64  # bytes per thread; ptxas may keep a few words in local memory at no measurable cost


def fp32_tile_cases(D: int, rows: int):
    """(name, jit function, pointer types, constexprs, num_warps, num_stages) of the float32 attention launches."""
    block_m, block_n, warps, stages = T.fp32_tiles(rows, D)
    attn = dict(Q="fp32", K="fp32", V="fp32", Out="fp32", Lse="fp32", Mask="u8")
    common = dict(QK_SCALE=0.12, HAS_MASK=True, IEEE=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=D)
    yield "attention (flash)", T._attn_fwd, attn, dict(common, WRITE_OUT=True), warps, stages
    yield "attention (flash, LSE only)", T._attn_fwd, attn, dict(common, WRITE_OUT=False), warps, stages
    yield "attention (split-K)", T._attn_splitk, attn, common, warps, stages
    yield "attention mass", T._attn_mass, dict(Q="fp32", K="fp32", Lse="fp32", Mask="u8", Part="fp32"), \
        dict(QK_SCALE=0.12, HAS_MASK=True, IEEE=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=D), warps, stages
    dm, dn, dd, dw = T.drift_tiles(rows, torch.float32)
    yield "attention drift", T._attn_drift, DRIFT | dict(QO="fp32", KO="fp32", QN="fp32", KN="fp32"), \
        dict(QK_SCALE=0.12, EPS=1e-8, HAS_MASK=True, IEEE=True, BLOCK_M=dm, BLOCK_N=dn, BLOCK_D=dd), dw, 2


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill-store bytes) per thread that Triton's ``ptxas`` reports for ``ptx``."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={target}", src, "-o", src + ".cubin"],
                           capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spills = re.search(r"(\d+) bytes spill stores", r.stderr)
    if regs is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output: {r.stderr[-500:]}")
    return int(regs.group(1)), int(spills.group(1))


def spills(arch: int = 90, dims=(64, 128, 256)) -> int:
    over = 0
    target = GPUTarget("cuda", arch, 32)
    for D, rows in ((d, r) for d in dims for r in (16, 32)):
        for name, fn, pointers, constexprs, warps, stages in fp32_tile_cases(D, rows):
            # as a launch specialises them: unit strides (the head dimension's, the mask's, the LSE's rows) are
            # constants, pointers 16-byte aligned
            ones = {n: 1 for n in fn.arg_names if n in UNIT_STRIDES}
            consts = dict(constexprs, **ones)
            sig = signature(fn, pointers, consts)
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in pointers}
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                               target=target, options={"num_warps": warps, "num_stages": stages})
            regs, spilled = ptxas_usage(k.asm["ptx"], arch)
            over += spilled > SPILL_LIMIT
            print(f"spills sm_{arch} fp32 {name} D={D} rows={rows}: {regs} registers, {spilled} bytes", flush=True)
    return 1 if over else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--spills"]:
        sys.exit(spills())
    sys.exit(main([int(a) for a in sys.argv[1:]] or [90]))
