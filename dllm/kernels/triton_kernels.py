"""Triton kernels: the GPU twins of :mod:`dllm.kernels.reference` (same signatures, same semantics).

Imported lazily by :mod:`dllm.kernels` (never at ``import dllm``). The kernels run on CUDA tensors, and on CPU
tensors under ``TRITON_INTERPRET=1`` (the interpreter, used by the tests; it must be set before this module is
imported). CPU tensors without the interpreter fall back to the reference functions.

Shapes use B = batch, Hq = query heads, Hkv = key/value heads (Hq % Hkv == 0), Lq = query rows, Lk = key rows,
D = head dim, V = vocabulary.

Design notes:

* ``attention``: FlashAttention-2 forward, one program per (BLOCK_M query rows, batch x query head); the K/V
  head is ``h // (Hq // Hkv)`` (GQA by indexing, K/V never repeated); scores, running max, normaliser and the
  accumulator are fp32; the softmax uses ``exp2`` with ``log2(e) / sqrt(D)`` folded into the scale; ``P`` is cast to
  V's dtype before ``P @ V``; a key-padding mask ``[B, Lk]`` is read per tile; rows whose keys are all masked give
  zeros and ``lse = -inf`` (the running max is replaced by 0 while it is still ``-inf``, so no ``-inf - -inf``).
  Any strides are accepted (e.g. ``[B, L, H, D]`` storage viewed as ``[B, H, L, D]``).
* ``attention_mass``: second pass, grid (Lk tiles, B x Hq); each program loops over all query rows of its head,
  recomputes ``p = exp2(s * scale - lse * log2(e))`` and column-sums it into ``partial[b, h, n]``; the host sums
  over heads. Deterministic, no atomics.
* ``confidence_stats``: grid (rows, vocabulary splits); each program runs an online softmax over its vocabulary
  tiles, keeping (max, normaliser, sum of ``e^(l - m) (l - m)``, top-1 value and index, top-2 value, best noised
  score with its index and logit); the host merges the splits (a few ``[N, S]`` tensors). The softmax is never
  materialised.
* bf16 under the interpreter is computed in fp32 (the interpreter has no bf16 arithmetic) and cast back.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from dllm.kernels import reference
from dllm.kernels.reference import ConfidenceStats

_LOG2E = 1.4426950408889634


# Triton's @jit picks the interpreter when it decorates, so the mode is fixed when this module is imported.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if _INTERPRET and type(tl.max).__name__ != "InterpretedFunction":
    raise RuntimeError(
        "TRITON_INTERPRET=1 was set after triton had been imported (triton.language was compiled for the GPU); "
        "set it before anything imports triton"
    )


def _interpreting() -> bool:
    return _INTERPRET


def _usable(t: torch.Tensor) -> bool:
    return t.is_cuda or _interpreting()


def _widen(*ts):
    """bf16 has no arithmetic under the interpreter: compute in fp32 there."""
    if _interpreting() and not ts[0].is_cuda and ts[0].dtype == torch.bfloat16:
        return tuple(t.float() for t in ts), torch.bfloat16
    return ts, None


# --------------------------------------------------------------------------------------------- attention


@triton.jit
def _attn_fwd(
    Q, K, V, Out, Lse, Mask,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sob, soh, som, sod,
    slb, slh, slm,
    smb, smn,
    Hq, Lq, Lk, D, GROUP, qk_scale,
    HAS_MASK: tl.constexpr, WRITE_OUT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Lq
    d_ok = offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    for start in range(0, Lk, BLOCK_N):
        n = start + offs_n
        n_ok = n < Lk
        if HAS_MASK:
            keep = tl.load(Mask + b * smb + n * smn, mask=n_ok, other=0) != 0
            n_ok = n_ok & keep
        kt = tl.load(k_base + n[None, :] * skn + offs_d[:, None] * skd,
                     mask=(n < Lk)[None, :] & d_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if WRITE_OUT:
            v = tl.load(v_base + n[:, None] * svn + offs_d[None, :] * svd,
                        mask=(n < Lk)[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(Lse + b * slb + h * slh + offs_m * slm, lse, mask=m_ok)
    if WRITE_OUT:
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        tl.store(Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
                 out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _check(q, k, v=None, key_padding_mask=None):
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError("q and k must be [B, H, L, D]")
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must have k's shape {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim")
    if any(t.dtype != q.dtype or t.device != q.device for t in (k, v) if t is not None):
        raise ValueError("q, k and v must share dtype and device")
    reference.check_key_padding_mask(key_padding_mask, q, k)


def _mask_arg(key_padding_mask, q):
    """Kernel arguments for a ``[B, Lk]`` bool mask already checked by :func:`_check` (read as uint8)."""
    if key_padding_mask is None:
        return q, 0, 0, False  # dummy pointer, never read
    m = key_padding_mask.view(torch.uint8)
    return m, m.stride(0), m.stride(1), True


def _blocks(D: int, Lq: int):
    block_d = max(16, triton.next_power_of_2(D))
    block_m = 16 if Lq <= 16 else (32 if Lq <= 32 or _interpreting() else 64)
    block_n = 32 if _interpreting() else (64 if block_d > 64 else 128)
    return block_m, block_n, block_d


def _attention_lse(q, k, v, key_padding_mask, write_out: bool):
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if write_out else q
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return out, lse
    if Lk == 0:
        return out.zero_() if write_out else out, lse.fill_(float("-inf"))
    vv = v if write_out else k
    mask, smb, smn, has_mask = _mask_arg(key_padding_mask, q)
    block_m, block_n, block_d = _blocks(D, Lq)
    grid = (triton.cdiv(Lq, block_m), B * Hq)
    _attn_fwd[grid](
        q, k, vv, out, lse, mask,
        *q.stride(), *k.stride(), *vv.stride(), *out.stride(), *lse.stride(), smb, smn,
        Hq, Lq, Lk, D, Hq // k.shape[1], _LOG2E / math.sqrt(D),
        HAS_MASK=has_mask, WRITE_OUT=write_out, IEEE=q.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4 if block_d <= 64 else 8, num_stages=2,
    )
    return out, lse


def attention(q, k, v, key_padding_mask=None, return_lse=False):
    """Triton twin of :func:`dllm.kernels.reference.attention` (same shapes, dtypes and semantics).

    Args:
        q: ``[B, Hq, Lq, D]`` float16/bfloat16/float32, any strides.
        k: ``[B, Hkv, Lk, D]`` same dtype, any strides.
        v: ``[B, Hkv, Lk, D]`` same dtype, any strides.
        key_padding_mask: optional ``[B, Lk]`` bool, True where a key may be attended to; any strides (a
            ``[1, Lk]`` mask must be expanded by the caller, ``mask.expand(B, Lk)``: other shapes raise ValueError).
        return_lse: also return the natural-log LSE of the scaled scores, ``[B, Hq, Lq]`` float32.

    Returns:
        ``out`` ``[B, Hq, Lq, D]`` in ``q.dtype`` (contiguous), and ``lse`` when asked. Fully masked query rows give
        zeros and ``lse = -inf``.
    """
    if not _usable(q):
        return reference.attention(q, k, v, key_padding_mask=key_padding_mask, return_lse=return_lse)
    _check(q, k, v, key_padding_mask)
    (q, k, v), back = _widen(q, k, v)
    out, lse = _attention_lse(q, k, v, key_padding_mask, write_out=True)
    if back is not None:
        out = out.to(back)
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------------------------ attention mass


@triton.jit
def _attn_mass(
    Q, K, Lse, Mask, Part,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    slb, slh, slm,
    smb, smn,
    spb, sph, spn,
    Hq, Lq, Lk, D, GROUP, qk_scale,
    HAS_MASK: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    n_ok = n < Lk
    if HAS_MASK:
        keep = tl.load(Mask + b * smb + n * smn, mask=n_ok, other=0) != 0
        n_ok = n_ok & keep
    kt = tl.load(K + b * skb + hk * skh + n[None, :] * skn + offs_d[:, None] * skd,
                 mask=(n < Lk)[None, :] & d_ok[:, None], other=0.0)
    mass = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, Lq, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < Lq
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        lse = tl.load(Lse + b * slb + h * slh + offs_m * slm, mask=m_ok, other=float("-inf"))
        row_ok = m_ok & (lse != float("-inf"))
        lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        p = tl.where(row_ok[:, None] & n_ok[None, :], p, 0.0)
        mass += tl.sum(p, 0)
    tl.store(Part + b * spb + h * sph + n * spn, mass, mask=n < Lk)


def attention_mass(q, k, key_padding_mask=None, lse=None):
    """Triton twin of :func:`dllm.kernels.reference.attention_mass`.

    Args:
        q: ``[B, Hq, Lq, D]`` (only the selected query rows), float16/bfloat16/float32, any strides.
        k: ``[B, Hkv, Lk, D]``, same dtype, any strides.
        key_padding_mask: optional ``[B, Lk]`` bool, True where a key may be attended to; any strides (a
            ``[1, Lk]`` mask must be expanded by the caller, ``mask.expand(B, Lk)``: other shapes raise ValueError).
        lse: optional ``[B, Hq, Lq]`` float32 natural-log LSE from :func:`attention` (recomputed when None by an
            LSE-only pass of the attention kernel).

    Returns:
        ``[B, Lk]`` float32: attention probability summed over all query rows and heads (per-head partials
        ``[B, Hq, Lk]`` are reduced on the host; deterministic, no atomics).
    """
    if not _usable(q):
        return reference.attention_mass(q, k, key_padding_mask=key_padding_mask, lse=lse)
    _check(q, k, key_padding_mask=key_padding_mask)
    (q, k), _ = _widen(q, k)
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    if lse is None:
        _, lse = _attention_lse(q, k, None, key_padding_mask, write_out=False)
    lse = lse.float()
    part = torch.zeros((B, Hq, Lk), dtype=torch.float32, device=q.device)
    if q.numel() == 0 or Lk == 0:
        return part.sum(1)
    mask, smb, smn, has_mask = _mask_arg(key_padding_mask, q)
    block_m, block_n, block_d = _blocks(D, Lq)
    grid = (triton.cdiv(Lk, block_n), B * Hq)
    _attn_mass[grid](
        q, k, lse, mask, part,
        *q.stride(), *k.stride(), *lse.stride(), smb, smn, *part.stride(),
        Hq, Lq, Lk, D, Hq // k.shape[1], _LOG2E / math.sqrt(D),
        HAS_MASK=has_mask, IEEE=q.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4, num_stages=2,
    )
    return part.sum(1)


# ---------------------------------------------------------------------------------------- confidence stats


@triton.jit
def _conf_partial(
    L, U, Stats, Idx,
    slr, slv, sur, suv,
    V, CHUNK, temperature,
    HAS_NOISE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    offs = tl.arange(0, BLOCK_V)
    NEG = float("-inf")
    m = tl.full([1], NEG, tl.float32)
    z = tl.zeros([1], tl.float32)
    s = tl.zeros([1], tl.float32)
    t1 = tl.full([1], NEG, tl.float32)
    t2 = tl.full([1], NEG, tl.float32)
    i1 = tl.zeros([1], tl.int32)
    best = tl.full([1], NEG, tl.float32)
    bidx = tl.zeros([1], tl.int32)
    blog = tl.full([1], NEG, tl.float32)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK_V):
        v = start + offs
        ok = v < hi
        x = tl.load(L + row * slr + v * slv, mask=ok, other=NEG).to(tl.float32)
        # online softmax with the entropy accumulator s = sum e^(x - m) (x - m)
        cm = tl.max(x, 0)
        m_new = tl.maximum(m, cm)
        m_safe = tl.where(m_new == NEG, 0.0, m_new)
        alpha = tl.exp2((m - m_safe) * 1.4426950408889634)
        shift = tl.where(m == NEG, 0.0, m_safe - m)
        e = tl.exp2((x - m_safe) * 1.4426950408889634)
        xs = tl.where(x == NEG, 0.0, x - m_safe)
        s = alpha * (s - shift * z) + tl.sum(e * xs, 0)
        z = alpha * z + tl.sum(e, 0)
        m = m_new
        # top-2 of the clean logits (first index wins ties)
        ci = tl.argmax(x, 0, tie_break_left=True)
        c2 = tl.max(tl.where(v == start + ci, NEG, x), 0)
        take = cm > t1
        t2 = tl.where(take, tl.maximum(t1, c2), tl.maximum(t2, cm))
        i1 = tl.where(take, start + ci, i1)
        t1 = tl.where(take, cm, t1)
        # proposal: Gumbel-perturbed argmax l - T log(-log u)
        if HAS_NOISE:
            u = tl.load(U + row * sur + v * suv, mask=ok, other=0.5).to(tl.float32)
            g = x - temperature * tl.log(-tl.log(u))
            g = tl.where(ok, g, NEG)
            gi = tl.argmax(g, 0, tie_break_left=True)
            gm = tl.max(g, 0)
            gl = tl.max(tl.where(v == start + gi, x, NEG), 0)
            tk = gm > best
            bidx = tl.where(tk, start + gi, bidx)
            blog = tl.where(tk, gl, blog)
            best = tl.where(tk, gm, best)
    base = Stats + (row * nsplit + split) * 7
    tl.store(base + 0, tl.max(m, 0))  # the accumulators are [1] tensors: store them as scalars
    tl.store(base + 1, tl.max(z, 0))
    tl.store(base + 2, tl.max(s, 0))
    tl.store(base + 3, tl.max(t1, 0))
    tl.store(base + 4, tl.max(t2, 0))
    tl.store(base + 5, tl.max(best, 0))
    tl.store(base + 6, tl.max(blog, 0))
    ib = Idx + (row * nsplit + split) * 2
    tl.store(ib + 0, tl.max(i1, 0))
    tl.store(ib + 1, tl.max(bidx, 0))


def _merge_splits(stats: torch.Tensor, idx: torch.Tensor, noised: bool):
    """Merge per-split partials ``stats [N, S, 7]`` / ``idx [N, S, 2]`` (splits in vocabulary order)."""
    m, z, s, t1, t2, best, blog = stats.unbind(-1)
    i1, bidx = idx.long().unbind(-1)
    M = m.amax(-1, keepdim=True)
    Ms = torch.where(M == float("-inf"), torch.zeros_like(M), M)
    alpha = torch.exp(m - Ms)
    shift = torch.where(m == float("-inf"), torch.zeros_like(m), Ms - m)
    Z = (alpha * z).sum(-1)
    S = (alpha * (s - shift * z)).sum(-1)
    lse = torch.log(Z) + Ms.squeeze(-1)
    entropy = torch.log(Z) - S / Z
    # top-1: first split holding the maximum (argmax returns the first maximal index)
    j = t1.argmax(-1, keepdim=True)
    top1 = t1.gather(-1, j).squeeze(-1)
    tok1 = i1.gather(-1, j).squeeze(-1)
    others = t1.scatter(-1, j, float("-inf"))
    top2 = torch.maximum(others.amax(-1), t2.amax(-1))
    if noised:
        jb = best.argmax(-1, keepdim=True)
        token = bidx.gather(-1, jb).squeeze(-1)
        tok_logit = blog.gather(-1, jb).squeeze(-1)
    else:
        token, tok_logit = tok1, top1
    return ConfidenceStats(
        token=token,
        p_token=torch.exp(tok_logit - lse),
        p_max=torch.exp(top1 - lse),
        p_second=torch.exp(top2 - lse),
        entropy=entropy,
    )


def confidence_stats(logits, temperature=0.0, noise=None):
    """Triton twin of :func:`dllm.kernels.reference.confidence_stats` (same arguments, outputs and semantics).

    Args:
        logits: ``[..., V]`` float16/bfloat16/float32, any strides (flattened to ``[N, V]``; the last dim is
            strided, not copied, when the leading dims can be viewed).
        temperature: Gumbel-max temperature ``T >= 0`` for the proposal.
        noise: uniform ``(0, 1)`` noise broadcastable to ``logits`` (any float dtype, read in fp32); drawn with
            ``torch.rand`` when ``T > 0`` and None; ignored at ``T = 0``.

    Returns:
        :class:`~dllm.kernels.reference.ConfidenceStats` with ``token`` ``[...]`` int64 and ``p_token``,
        ``p_max``, ``p_second``, ``entropy`` ``[...]`` float32.
    """
    if not _usable(logits):
        return reference.confidence_stats(logits, temperature=temperature, noise=noise)
    noise = reference.confidence_noise(logits, temperature, noise)
    (logits,), _ = _widen(logits)
    V, N = logits.shape[-1], logits.numel() // max(logits.shape[-1], 1)
    block_v = 256 if _interpreting() else 2048
    # enough programs to fill the GPU at a few rows: split the vocabulary, merge on the host
    splits = 1 if _interpreting() else max(1, min(triton.cdiv(V, 8 * block_v), triton.cdiv(264, max(N, 1))))
    return _confidence_stats(logits, temperature, noise, block_v, splits)


def _confidence_stats(logits, temperature, noise, block_v: int, splits: int):
    noised = noise is not None
    lead, V = logits.shape[:-1], logits.shape[-1]
    x = logits.reshape(-1, V)
    N = x.shape[0]
    u = noise.expand(logits.shape).reshape(-1, V) if noised else x
    want = splits
    chunk = triton.cdiv(triton.cdiv(V, want), block_v) * block_v
    nsplit = triton.cdiv(V, chunk)
    stats = torch.empty((N, nsplit, 7), dtype=torch.float32, device=x.device)
    idx = torch.empty((N, nsplit, 2), dtype=torch.int32, device=x.device)
    if N:
        _conf_partial[(N, nsplit)](
            x, u, stats, idx, x.stride(0), x.stride(1), u.stride(0), u.stride(1),
            V, chunk, float(temperature),
            HAS_NOISE=noised, BLOCK_V=block_v, num_warps=8,
        )
    out = _merge_splits(stats, idx, noised)
    return ConfidenceStats(*(t.reshape(lead) for t in out))
