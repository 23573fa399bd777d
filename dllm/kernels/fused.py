"""Fused elementwise kernels of the fast Transformer layer, each with its plain PyTorch twin.

The fast layer (:mod:`dllm.models.fast`) runs four kinds of small fused operations around its matrix products:

* :func:`rms_norm`: RMSNorm as ``RMSNorm.forward`` computes it (normalise in fp32, cast to the input dtype, then
  multiply by the weight in the model dtype);
* :func:`add_rms_norm`: the residual add (rounded to the model dtype, as ``h + y`` is) followed by RMSNorm of the
  sum; returns ``(sum, normed)``;
* :func:`rope_qk`: optional per-head RMSNorm of queries and keys (qk_norm), then rotate-half RoPE in fp32 (partial
  rotary: only the first ``cos.shape[-1]`` dims rotate), for queries and keys together, read straight from the
  fused QKV projection ``[B, T, (Hq + 2 Hkv) * D]``; returns ``q [B, Hq, T, D]``, ``k [B, Hkv, T, D]`` (views of
  one ``[B, Hq + Hkv, T, D]`` buffer) and ``v`` (a ``[B, Hkv, T, D]`` view of the projection);
* :func:`silu_mul`: ``silu(gate) * up`` from the fused gate/up projection ``[..., 2 H]`` (gate first).

Each public function dispatches like :mod:`dllm.kernels`: the Triton kernel where :func:`dllm.kernels.uses_triton`
says so (Triton backend and a CUDA tensor, or the interpreter), else the twin (``*_ref``). The twins are the
readable definitions and the test oracles; they perform the eager layer's operations in the same order, so on
the CPU they agree with it bit for bit. The Triton kernels round where the eager layer rounds (the normalised
value and the activation are cast to the model dtype before their multiplications); their reductions and
``exp`` differ from PyTorch's in the last fp32 bits.

The Triton launches are registered as custom operators (``torch.library.triton_op``, the launch wrapped in
``wrap_triton``), so ``torch.compile`` traces them with their shapes instead of breaking the graph. Triton is
imported, and the operators registered, when a Triton kernel is first needed (:func:`prepare`, called when the
fast path is enabled). Under ``torch.compile`` CPU tensors take the twins even with the interpreter, whose kernels
the compiler cannot trace. Under ``TRITON_INTERPRET=1`` (CPU tests) bf16 inputs are
computed in fp32 and cast back, as :mod:`dllm.kernels.triton_kernels` does (the interpreter has no bf16
arithmetic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dllm.kernels.device import on_device

# ------------------------------------------------------------------------------------------------ twins


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * (x / rms(x))``: normalised in fp32, cast to ``x.dtype``, scaled in the weight's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


def add_rms_norm_ref(h: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float):
    """``(h + y, rms_norm(h + y))``."""
    s = h + y
    return s, rms_norm_ref(s, w, eps)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE computed in fp32, returned in ``x.dtype``; with tables narrower than the head (partial
    rotary) only the first ``cos.shape[-1]`` dims rotate, the rest pass through."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([rope_ref(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def rope_qk_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
                norm_w: torch.Tensor | None = None, eps: float = 1e-6):
    """``(q, k, v)`` from the fused projection ``qkv`` ``[B, T, (Hq + 2 Hkv) * D]``: per-head RMSNorm of q and k
    with ``norm_w`` ``[2, D]`` (rows: the query and the key norm's weight) when given, then RoPE with the
    ``[B, 1, T, R]`` fp32 tables. Shapes ``[B, H, T, D]``."""
    B, T, _ = qkv.shape
    q, k, v = qkv.view(B, T, n_heads + 2 * n_kv_heads, -1).split([n_heads, n_kv_heads, n_kv_heads], dim=2)
    if norm_w is not None:
        q, k = rms_norm_ref(q, norm_w[0], eps), rms_norm_ref(k, norm_w[1], eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return rope_ref(q, cos, sin), rope_ref(k, cos, sin), v


def rope_qk_write_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
                      norm_w: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      rows: torch.Tensor) -> torch.Tensor:
    """:func:`rope_qk_ref`, then the keys and values written into ``k_cache`` / ``v_cache`` ``[B, Hkv, L, D]`` at
    the columns ``rows`` ``[B, T]`` (what :meth:`dllm.caches.base.KVCache.update` does in a partial forward);
    returns the queries."""
    q, k, v = rope_qk_ref(qkv, cos, sin, n_heads, n_kv_heads, norm_w, eps)
    idx = rows[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
    k_cache.scatter_(2, idx, k)
    v_cache.scatter_(2, idx, v)
    return q


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gu = [gate, up]`` on the last dim."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


# ------------------------------------------------------------------------------------------------ dispatch


def _use_triton(t: torch.Tensor) -> bool:
    from dllm import kernels

    if not kernels.uses_triton(t):
        return False
    # torch.compile traces the Triton operators on CUDA; the interpreter's kernels (CPU tensors) it cannot trace
    return t.is_cuda or not torch.compiler.is_compiling()


def prepare(t: torch.Tensor) -> None:
    """Build the Triton operators now if tensors like ``t`` will use them, so that a later ``torch.compile`` does
    not trace their construction."""
    if _use_triton(t):
        _ops()


def _check_norm(x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    if w.dim() != 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"{what}: the weight ({tuple(w.shape)}) must be 1-D with the last dim of x "
                         f"({tuple(x.shape)})")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; Triton kernel or :func:`rms_norm_ref`."""
    _check_norm(x, w, "rms_norm")
    if _use_triton(x):
        with on_device(x):
            return _ops().rms_norm(x, w, eps)
    return rms_norm_ref(x, w, eps)


def add_rms_norm(h: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float):
    """``(h + y, rms_norm(h + y, w))`` in one pass; Triton kernel or :func:`add_rms_norm_ref`."""
    _check_norm(h, w, "add_rms_norm")
    if h.shape != y.shape or h.dtype != y.dtype:
        raise ValueError(f"add_rms_norm: h {tuple(h.shape)} {h.dtype} and y {tuple(y.shape)} {y.dtype} must agree")
    if _use_triton(h):
        with on_device(h):
            return _ops().add_rms_norm(h, y, w, eps)
    return add_rms_norm_ref(h, y, w, eps)


def _check_rope(qkv, cos, sin, n_heads, n_kv_heads, norm_w, what="rope_qk") -> int:
    """Validate :func:`rope_qk`'s inputs; returns the head size."""
    if qkv.dim() != 3 or qkv.shape[-1] % (n_heads + 2 * n_kv_heads):
        raise ValueError(f"{what}: qkv must be [B, T, (Hq + 2 Hkv) * D] with Hq={n_heads}, Hkv={n_kv_heads}, got "
                         f"{tuple(qkv.shape)}")
    B, T, _ = qkv.shape
    D = qkv.shape[-1] // (n_heads + 2 * n_kv_heads)
    R = cos.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 4 or cos.shape[0] != B or cos.shape[2] != T or R > D or R % 2:
        raise ValueError(f"{what}: cos/sin must be [B, 1, T, R] with B={B}, T={T}, even R <= D={D}, got "
                         f"{tuple(cos.shape)} / {tuple(sin.shape)}")
    if norm_w is not None and tuple(norm_w.shape) != (2, D):
        raise ValueError(f"{what}: norm_w must be [2, {D}] (query and key norm weights), got {tuple(norm_w.shape)}")
    return D


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
            norm_w: torch.Tensor | None = None, eps: float = 1e-6):
    """Queries and keys rotated (after their per-head norm when ``norm_w`` is given) and the values, from the
    fused QKV output; see :func:`rope_qk_ref`."""
    D = _check_rope(qkv, cos, sin, n_heads, n_kv_heads, norm_w)
    B, T, _ = qkv.shape
    if _use_triton(qkv):
        with on_device(qkv):
            qk = _ops().rope_qk(qkv, cos, sin, n_heads, n_kv_heads, norm_w, eps)
        v = qkv.view(B, T, n_heads + 2 * n_kv_heads, D)[:, :, n_heads + n_kv_heads:].transpose(1, 2)
        return qk[:, :n_heads], qk[:, n_heads:], v
    return rope_qk_ref(qkv, cos, sin, n_heads, n_kv_heads, norm_w, eps)


def rope_qk_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
                  norm_w: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  rows: torch.Tensor) -> torch.Tensor:
    """:func:`rope_qk` for a partial forward over a K/V cache: the rotated keys and the values go straight into
    ``k_cache`` / ``v_cache`` (``[B, Hkv, L, D]``, written in place) at the columns ``rows`` (``[B, T]`` int64, each
    in ``[0, L)``; a repeated column must carry the same values, as padded active sets do); returns the queries
    ``[B, Hq, T, D]``. On the Triton path one kernel replaces the rotation and the two scatters; see
    :func:`rope_qk_write_ref`."""
    D = _check_rope(qkv, cos, sin, n_heads, n_kv_heads, norm_w, "rope_qk_write")
    B, T, _ = qkv.shape
    want = (B, n_kv_heads, D)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or (c.shape[0], c.shape[1], c.shape[3]) != want or c.dtype != qkv.dtype or \
                c.device != qkv.device:
            raise ValueError(f"rope_qk_write: {name} must be [B={B}, Hkv={n_kv_heads}, L, D={D}] {qkv.dtype} on "
                             f"{qkv.device}, got {tuple(c.shape)} {c.dtype} on {c.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"rope_qk_write: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if rows.shape != (B, T) or rows.dtype != torch.int64:
        raise ValueError(f"rope_qk_write: rows must be [B={B}, T={T}] int64, got {tuple(rows.shape)} {rows.dtype}")
    if _use_triton(qkv):
        with on_device(qkv):
            return _ops().rope_qk_write(qkv, cos, sin, n_heads, n_kv_heads, norm_w, eps, k_cache, v_cache, rows)
    return rope_qk_write_ref(qkv, cos, sin, n_heads, n_kv_heads, norm_w, eps, k_cache, v_cache, rows)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` from ``[..., 2 H]``; Triton kernel or :func:`silu_mul_ref`."""
    if gu.shape[-1] % 2:
        raise ValueError(f"silu_mul: the last dim ({gu.shape[-1]}) must hold gate and up halves (even)")
    if _use_triton(gu):
        with on_device(gu):
            return _ops().silu_mul(gu)
    return silu_mul_ref(gu)


_OPS = None


def _ops():
    """The Triton custom operators, built on first use (Triton is not imported before)."""
    global _OPS
    if _OPS is None:
        _OPS = _build_triton_ops()
    return _OPS


def _build_triton_ops():
    import types

    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    from dllm.kernels import triton_kernels

    interpreting = triton_kernels._interpreting()
    # host-side helpers (Triton's cdiv / next_power_of_2 are jit functions: microseconds per host call, per launch)
    cdiv, pow2 = triton_kernels._cdiv, triton_kernels._pow2

    def widen(*ts):
        """bf16 under the interpreter (no bf16 arithmetic there): compute in fp32, cast back."""
        if interpreting and not ts[0].is_cuda and ts[0].dtype == torch.bfloat16:
            return tuple(None if t is None else t.float() for t in ts), torch.bfloat16
        return ts, None

    @triton.jit
    def _norm_kernel(X, Y, W, RES, OUT, sx, sy, sr, so, N, eps, HAS_Y: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(X + row * sx + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_Y:  # the residual add, rounded to the model dtype like ``h + y``
            x = (x + tl.load(Y + row * sy + offs, mask=m, other=0.0).to(tl.float32)).to(RES.dtype.element_ty)
            tl.store(RES + row * sr + offs, x, mask=m)
            x = x.to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        xn = (x * r).to(X.dtype.element_ty).to(tl.float32)  # cast to the input dtype, then scale
        w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + row * so + offs, (w * xn).to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_kernel(QKV, COS, SIN, NW, OUT, KOUT, VOUT, ROWS, s_b, s_t, c_b, c_t, o_b, o_h, o_t, k_b, k_h, k_t,
                     v_b, v_h, v_t, r_b, r_t, T, Hq, Hkv, NH, D, R, eps, HAS_NORM: tl.constexpr,
                     WRITE_KV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
        # one program per (row, BLOCK_H heads): the row's cos/sin are read once for its heads. Heads 0..Hq-1 are
        # queries, then Hkv keys, then (WRITE_KV) Hkv values; NH heads in all
        bt = tl.program_id(0).to(tl.int64)
        b = bt // T
        t = bt % T
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        offs = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
        half = R // 2
        rot_d = offs < R
        m = (h < NH) & (offs < D)
        partner = tl.where(offs < half, offs + half, offs - half)
        pm = m & rot_d
        base = QKV + b * s_b + t * s_t + h * D
        x = tl.load(base + offs, mask=m, other=0.0).to(tl.float32)
        xp = tl.load(base + partner, mask=pm, other=0.0).to(tl.float32)
        x_in = x
        if HAS_NORM:  # per-head RMSNorm (row 0 of NW for queries, row 1 for keys), as RMSNorm rounds it
            wrow = tl.where(h < Hq, 0, 1)
            r = tl.math.rsqrt(tl.sum(x * x, axis=1)[:, None] / D + eps)
            w = tl.load(NW + wrow * D + offs, mask=m, other=0.0).to(tl.float32)
            wp = tl.load(NW + wrow * D + partner, mask=pm, other=0.0).to(tl.float32)
            x = (w * (x * r).to(OUT.dtype.element_ty).to(tl.float32)).to(OUT.dtype.element_ty).to(tl.float32)
            xp = (wp * (xp * r).to(OUT.dtype.element_ty).to(tl.float32)).to(OUT.dtype.element_ty).to(tl.float32)
        c = tl.load(COS + b * c_b + t * c_t + offs, mask=rot_d, other=1.0)
        s = tl.load(SIN + b * c_b + t * c_t + offs, mask=rot_d, other=0.0)
        rot = tl.where(offs < half, -xp, xp)
        y = tl.where(rot_d, x * c + rot * s, x)
        if WRITE_KV:  # queries to OUT [B, Hq, T, D]; keys and values into the caches at column ROWS[b, t]
            col = tl.load(ROWS + b * r_b + t * r_t).to(tl.int64)
            qh = tl.minimum(h, Hq - 1)
            kh = tl.minimum(tl.maximum(h - Hq, 0), Hkv - 1)
            vh = tl.minimum(tl.maximum(h - Hq - Hkv, 0), Hkv - 1)
            # each head stores to one of the three places (the clamped indices of the other two are masked off)
            tl.store(OUT + b * o_b + qh * o_h + t * o_t + offs, y.to(OUT.dtype.element_ty), mask=m & (h < Hq))
            tl.store(KOUT + b * k_b + kh * k_h + col * k_t + offs, y.to(KOUT.dtype.element_ty),
                     mask=m & (h >= Hq) & (h < Hq + Hkv))
            tl.store(VOUT + b * v_b + vh * v_h + col * v_t + offs, x_in.to(VOUT.dtype.element_ty),
                     mask=m & (h >= Hq + Hkv))
        else:
            tl.store(OUT + b * o_b + h * o_h + t * o_t + offs, y.to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_mul_kernel(GU, OUT, s_in, s_out, H, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < H
        g = tl.load(GU + row * s_in + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + row * s_in + H + offs, mask=m, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)  # silu in the model dtype
        tl.store(OUT + row * s_out + offs, (a * u).to(OUT.dtype.element_ty), mask=m)

    def _rope_blocks(D: int, heads: int) -> tuple[int, int]:
        """(head tile, heads per program): about 2,048 elements per program, so a row's cos/sin are read once for
        many heads and a long prompt is not tens of thousands of tiny programs."""
        block = pow2(D)
        return block, min(pow2(heads), max(1, 2048 // block))

    def rows(x):
        x2 = x.reshape(-1, x.shape[-1])
        return x2 if x2.stride(-1) == 1 else x2.contiguous()

    @triton_op("dllm::fused_rms_norm", mutates_args={})
    def rms_norm_op(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        out_dtype = torch.promote_types(w.dtype, x.dtype)
        (x, w), back = widen(x, w)
        x2 = rows(x)
        N = x2.shape[1]
        out = torch.empty(x.shape, dtype=torch.float32 if back else out_dtype, device=x.device)  # rows of N
        if x2.shape[0]:
            wrap_triton(_norm_kernel)[(x2.shape[0],)](x2, x2, w, out, out, x2.stride(0), 0, 0, N, N,
                                                      eps, HAS_Y=False, BLOCK=pow2(N))
        return out.to(out_dtype) if back else out

    @triton_op("dllm::fused_add_rms_norm", mutates_args={})
    def add_rms_norm_op(h: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
        dt, out_dtype = h.dtype, torch.promote_types(w.dtype, h.dtype)
        (h, y, w), back = widen(h, y, w)
        h2, y2 = rows(h), rows(y)
        N = h2.shape[1]
        res = torch.empty(h.shape, dtype=h.dtype, device=h.device)  # contiguous: rows of N
        out = torch.empty(h.shape, dtype=torch.float32 if back else out_dtype, device=h.device)
        if h2.shape[0]:
            wrap_triton(_norm_kernel)[(h2.shape[0],)](h2, y2, w, res, out, h2.stride(0), y2.stride(0), N, N, N, eps,
                                                      HAS_Y=True, BLOCK=pow2(N))
        return (res.to(dt), out.to(out_dtype)) if back else (res, out)

    def rope_launch(qkv, cos, sin, n_heads, n_kv_heads, norm_w, eps, kc=None, vc=None, rows=None):
        """The RoPE kernel on ``qkv`` (already widened): queries and keys into a new ``[B, Hq + Hkv, T, D]`` buffer,
        or, given the caches ``kc`` / ``vc`` and ``rows``, queries into a new ``[B, Hq, T, D]`` buffer and the keys
        and values into the caches at ``rows``."""
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        B, T, F_ = qkv.shape
        D = F_ // (n_heads + 2 * n_kv_heads)
        R = cos.shape[-1]
        cos, sin = cos.float(), sin.float()
        if cos.stride(-1) != 1 or sin.stride() != cos.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        write = kc is not None
        if write and (kc.stride(-1) != 1 or vc.stride(-1) != 1):
            raise ValueError("rope_qk_write: the K and V caches need unit stride on the last dim")
        nh = n_heads + (2 if write else 1) * n_kv_heads  # heads the kernel handles
        out = torch.empty((B, n_heads if write else nh, T, D), dtype=qkv.dtype, device=qkv.device)
        if B * T:
            nw = norm_w if norm_w is not None else qkv
            kv_args = (*kc.stride()[:3], *vc.stride()[:3], *rows.stride()) if write else (0,) * 8
            block, block_h = _rope_blocks(D, nh)
            wrap_triton(_rope_kernel)[(B * T, cdiv(nh, block_h))](
                qkv, cos, sin, nw, out, kc if write else out, vc if write else out, rows if write else cos,
                qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(2), out.stride(0), out.stride(1),
                out.stride(2), *kv_args, T, n_heads, n_kv_heads, nh, D, R, eps,
                HAS_NORM=norm_w is not None, WRITE_KV=write, BLOCK_H=block_h, BLOCK=block)
        return out

    @triton_op("dllm::fused_rope_qk", mutates_args={})
    def rope_qk_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
                   norm_w: torch.Tensor | None, eps: float) -> torch.Tensor:
        dt = qkv.dtype
        (qkv, norm_w), back = widen(qkv, norm_w)
        out = rope_launch(qkv, cos, sin, n_heads, n_kv_heads, norm_w, eps)
        return out.to(dt) if back else out

    @triton_op("dllm::fused_rope_qk_write", mutates_args={"k_cache", "v_cache"})
    def rope_qk_write_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
                         norm_w: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         rows: torch.Tensor) -> torch.Tensor:
        dt = qkv.dtype
        (qkv, norm_w), back = widen(qkv, norm_w)
        kc, vc = (k_cache.float(), v_cache.float()) if back else (k_cache, v_cache)
        out = rope_launch(qkv, cos, sin, n_heads, n_kv_heads, norm_w, eps, kc, vc, rows)
        if back:  # the interpreter's fp32 copies: untouched entries round-trip exactly
            k_cache.copy_(kc)
            v_cache.copy_(vc)
            return out.to(dt)
        return out

    @triton_op("dllm::fused_silu_mul", mutates_args={})
    def silu_mul_op(gu: torch.Tensor) -> torch.Tensor:
        dt = gu.dtype
        (gu,), back = widen(gu)
        g2 = rows(gu)
        H = g2.shape[1] // 2
        out = torch.empty((*gu.shape[:-1], H), dtype=g2.dtype, device=gu.device)  # contiguous: rows of H
        BLOCK = min(1024, pow2(H))
        if g2.shape[0]:
            wrap_triton(_silu_mul_kernel)[(g2.shape[0], cdiv(H, BLOCK))](g2, out, g2.stride(0), H, H,
                                                                               BLOCK=BLOCK)
        return out.to(dt) if back else out

    def rope_qk_call(qkv, cos, sin, n_heads, n_kv_heads, norm_w, eps):
        return rope_qk_op(qkv, cos, sin, n_heads, n_kv_heads, norm_w, float(eps))

    def rope_qk_write_call(qkv, cos, sin, n_heads, n_kv_heads, norm_w, eps, k_cache, v_cache, rows):
        return rope_qk_write_op(qkv, cos, sin, n_heads, n_kv_heads, norm_w, float(eps), k_cache, v_cache, rows)

    return types.SimpleNamespace(rms_norm=lambda x, w, eps: rms_norm_op(x, w, float(eps)),
                                 add_rms_norm=lambda h, y, w, eps: add_rms_norm_op(h, y, w, float(eps)),
                                 rope_qk=rope_qk_call, rope_qk_write=rope_qk_write_call, silu_mul=silu_mul_op,
                                 # the jit functions themselves (tests compile them for GPU targets)
                                 kernels={"norm": _norm_kernel, "rope": _rope_kernel, "silu_mul": _silu_mul_kernel})


__all__ = ["add_rms_norm", "add_rms_norm_ref", "rms_norm", "rms_norm_ref", "rope_qk", "rope_qk_ref", "rope_qk_write",
           "rope_qk_write_ref", "rope_ref", "silu_mul", "silu_mul_ref"]
