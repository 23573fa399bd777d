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
* ``attention_splitk``: flash-decoding for few query rows over many keys: grid (packed query tile, B x Hkv, key
  split). The query rows of the ``Hq // Hkv`` heads sharing a KV head are packed into one tile's M dimension, so K/V
  are read once per GQA group; each program writes a partial output and its LSE in fp32, and ``_attn_combine`` (one
  program per output row) merges the splits. The split count fills the GPU's SMs once; in fp32 it ignores the batch
  size (a row's fp32 output does not depend on its batch).
* ``attention_mass``: second pass, grid (Lk tiles, B x Hq); each program loops over all query rows of its head,
  recomputes ``p = exp2(s * scale - lse * log2(e))`` and column-sums it into ``partial[b, h, n]``; the host sums
  over heads. Deterministic, no atomics.
* ``attention_drift``: after an LSE-only pass per softmax, grid (Lk tiles, batch); each program loops over the query
  tiles and the heads, recomputing both distributions' probabilities and accumulating their dot product and norms,
  so the cosine over heads is formed in registers; per key it writes the cosines' sum over the counted rows and
  their count, and the host sums over keys. Deterministic, no atomics.
* ``confidence_stats``: grid (rows, vocabulary splits); each program keeps every statistic per lane of its tile
  (max, normaliser, sum of ``e^(l - m) (l - m)``, top-1 value and index, top-2 value, best noised score with its
  index and logit) with elementwise updates, one ``exp2`` per element, and merges its lanes at the end; a second
  kernel (``_conf_merge``, one program per row) merges the splits on the device and writes the outputs. The softmax
  is never materialised; ties go to the smallest index.
* Loop-carried values start as explicit fp32 and the softmax scale is a ``tl.constexpr``, so nothing turns fp64 when
  ``torch.compile`` traces the kernels (through the custom ops at the end of this module).
* bf16/fp16 attention on a GPU is autotuned (Hopper configs); fp32 and the interpreter use one fixed config.
* bf16 under the interpreter is computed in fp32 (the interpreter has no bf16 arithmetic) and cast back.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

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


def _cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a jit function: a few microseconds per host call)."""
    return -(-a // b)


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), on the host without a jit call."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


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
def _attend_keys(q, k_base, v_base, mask_row, lo, hi, offs_n, offs_d, d_ok, skn, skd, svn, svd, smn, m_i, l_i, acc,
                 QK_SCALE: tl.constexpr, HAS_MASK: tl.constexpr, WRITE_OUT: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The online softmax of query tile ``q`` over keys ``lo..hi`` (tiles of BLOCK_N), shared by the flash and the
    split-K kernels: returns the running max ``m_i`` (log2 units), normaliser ``l_i`` and, with WRITE_OUT, the output
    accumulator ``acc`` (all fp32). Masked and out-of-range keys score -inf; a row whose keys are all masked keeps
    ``m_i = -inf`` and ``l_i = 0`` (its max is taken as 0 for the exponentials, so no ``-inf - -inf``)."""
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        in_range = n < hi
        n_ok = in_range
        if HAS_MASK:
            keep = tl.load(mask_row + n * smn, mask=in_range, other=0) != 0
            n_ok = n_ok & keep
        kt = tl.load(k_base + n[None, :] * skn + offs_d[:, None] * skd,
                     mask=in_range[None, :] & d_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = tl.where(n_ok[None, :], s.to(tl.float32) * QK_SCALE, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1)).to(tl.float32)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = (l_i * alpha + tl.sum(p, 1)).to(tl.float32)
        if WRITE_OUT:
            v = tl.load(v_base + n[:, None] * svn + offs_d[None, :] * svd,
                        mask=in_range[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attn_fwd(
    Q, K, V, Out, Lse, Mask,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sob, soh, som, sod,
    slb, slh, slm,
    smb, smn,
    Hq, Lq, Lk, D, GROUP, LK_BUCKET, LQ_BUCKET,
    QK_SCALE: tl.constexpr, HAS_MASK: tl.constexpr, WRITE_OUT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # LK_BUCKET and LQ_BUCKET (Lk and Lq rounded up to powers of two) are only autotune keys: a new query count
    # in the same bucket (the prefix cache's shrinking active set) reuses the tuned configuration
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # int64 offsets: b * stride passes 2^31 at LLaDA-8B's size
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
    m_i, l_i, acc = _attend_keys(q, k_base, v_base, Mask + b * smb, 0, Lk, offs_n, offs_d, d_ok, skn, skd, svn, svd,
                                 smn, m_i, l_i, acc, QK_SCALE, HAS_MASK, WRITE_OUT, IEEE, BLOCK_N)
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


def _mask_arg(key_padding_mask, q, traced: bool = False):
    """Kernel arguments for a ``[B, Lk]`` bool mask already checked by :func:`_check` (read as uint8: a view in eager
    calls, a small copy when traced, as Inductor cannot lower a bool-to-uint8 view)."""
    if key_padding_mask is None:
        return q, 0, 0, False  # dummy pointer, never read
    m = key_padding_mask.to(torch.uint8) if traced else key_padding_mask.view(torch.uint8)
    return m, m.stride(0), m.stride(1), True


def _blocks(D: int, Lq: int):
    block_d = max(16, _pow2(D))
    block_m = 16 if Lq <= 16 else (32 if Lq <= 32 or _interpreting() else 64)
    block_n = 32 if _interpreting() else (64 if block_d > 64 else 128)
    return block_m, block_n, block_d


def fp32_tiles(rows: int, block_d: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the attention kernels in float32 on a GPU (one fixed config:
    a row's fp32 result must not depend on an autotuner's timing). The fp32 products run as FMA loops, not tensor-core
    MMAs, and hold their operands in registers: tiles of at most 32 x 32 (32 x 16 at head dimension 256) over 8 warps
    fit Hopper's register file, where the earlier tiles (32-64 x 64, 4 warps) spilled 6-20 KB per thread to local
    memory (``python tests/compile_kernels.py --spills``)."""
    return (16 if rows <= 16 else 32), (32 if block_d <= 128 else 16), 8, 2


def _configs(shapes):
    """Autotune configs ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; one config under the interpreter."""
    if _interpreting():
        shapes = shapes[:1]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in shapes]


# Hopper (H100) candidates: 64-row tiles feed a warpgroup MMA, 16/32-row tiles suit a few packed query rows,
# 2-4 stages of K/V prefetch; split-K also tries 128-key tiles and a deeper prefetch for 32 rows, where it reads
# K/V at a fraction of the memory's bandwidth. The first entry is the interpreter's single config.
_FLASH_CONFIGS = _configs([(32, 32, 4, 2), (32, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3),
                           (16, 128, 4, 3)])
_SPLITK_CONFIGS = _configs([(32, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3),
                            (16, 64, 4, 2), (128, 64, 8, 3), (32, 128, 4, 3), (32, 64, 4, 4)])
_attn_fwd_tuned = triton.autotune(_FLASH_CONFIGS, key=["LQ_BUCKET", "GROUP", "LK_BUCKET", "D"])(_attn_fwd)


def _launch(kernel, traced: bool):
    """``kernel`` itself for eager calls; wrapped with ``torch.library.wrap_triton`` inside the custom ops that
    ``torch.compile`` traces (the wrapper costs host time on every eager launch)."""
    return torch.library.wrap_triton(kernel) if traced else kernel


def _out_like(q: torch.Tensor) -> torch.Tensor:
    """The attention output ``[B, Hq, Lq, D]`` stored as ``[B, Lq, Hq, D]``: the layer's ``transpose(1, 2).reshape``
    into ``[B, Lq, Hq * D]`` for the output product is then a view, not a copy kernel."""
    B, Hq, Lq, D = q.shape
    return q.new_empty((B, Lq, Hq, D)).transpose(1, 2)


def _attention_lse(q, k, v, key_padding_mask, write_out: bool, traced: bool = False):
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    out = _out_like(q) if write_out else q
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return out, lse
    if Lk == 0:
        return out.zero_() if write_out else out, lse.fill_(float("-inf"))
    vv = v if write_out else k
    mask, smb, smn, has_mask = _mask_arg(key_padding_mask, q, traced)
    block_m, block_n, block_d = _blocks(D, Lq)
    args = (q, k, vv, out, lse, mask,
            *q.stride(), *k.stride(), *vv.stride(), *out.stride(), *lse.stride(), smb, smn,
            Hq, Lq, Lk, D, Hq // k.shape[1], _pow2(Lk), _pow2(Lq))
    meta = dict(QK_SCALE=_LOG2E / math.sqrt(D), HAS_MASK=has_mask, WRITE_OUT=write_out,
                IEEE=q.dtype == torch.float32, BLOCK_D=block_d)
    if q.dtype == torch.float32 or not write_out or _interpreting():
        # fixed tiles: fp32 results must not depend on an autotuner's timing
        warps, stages = (4 if block_d <= 64 else 8), 2
        if q.dtype == torch.float32 and not _interpreting():
            block_m, block_n, warps, stages = fp32_tiles(Lq, block_d)
        grid = (_cdiv(Lq, block_m), B * Hq)
        _launch(_attn_fwd, traced)[grid](*args, **meta, BLOCK_M=block_m, BLOCK_N=block_n,
                                 num_warps=warps, num_stages=stages)
    else:
        grid = lambda META: (_cdiv(Lq, META["BLOCK_M"]), B * Hq)  # noqa: E731
        _launch(_attn_fwd_tuned, traced)[grid](*args, **meta)
    return out, lse


def _flash_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
                traced: bool = False):
    return _attention_lse(q, k, v, key_padding_mask, write_out=True, traced=traced)


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
    if torch.compiler.is_compiling() and not _interpreting():
        out, lse = torch.ops.dllm.flash_attention(q, k, v, key_padding_mask)
    else:
        out, lse = _flash_impl(q, k, v, key_padding_mask)
    if back is not None:
        out = out.to(back)
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------------- split-K (flash-decoding)


@triton.jit
def _attn_splitk(
    Q, K, V, Out, Lse, Mask,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sos, sob, soh, som, sod,
    sls, slb, slh, slm,
    smb, smn,
    Hkv, Lq, Lk, D, GROUP, CHUNK, LK_BUCKET, NSPLIT, LQ_BUCKET,
    QK_SCALE: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per (tile of GROUP x Lq packed query rows, batch x KV head, key split); the rows of all query
    # heads sharing a KV head share one tile, so each K/V tile is read once per group. LK_BUCKET, LQ_BUCKET and
    # NSPLIT are autotune keys only. Out/Lse are the fp32 partials [S, B, Hq, Lq, (D)] (or the final output when S == 1).
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # int64 offsets (as in _attn_fwd)
    split32 = tl.program_id(2)
    split = split32.to(tl.int64)  # the partials' offsets; the key range in int32 (its loop's index arithmetic)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < GROUP * Lq
    head = hk * GROUP + r // Lq
    row = r % Lq
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(Q + b * sqb + head[:, None] * sqh + row[:, None] * sqm + offs_d[None, :] * sqd,
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    lo = split32 * CHUNK
    hi = tl.minimum(lo + CHUNK, Lk)
    m_i, l_i, acc = _attend_keys(q, k_base, v_base, Mask + b * smb, lo, hi, offs_n, offs_d, d_ok, skn, skd, svn, svd,
                                 smn, m_i, l_i, acc, QK_SCALE, HAS_MASK, True, IEEE, BLOCK_N)
    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(Lse + split * sls + b * slb + head * slh + row * slm, lse, mask=r_ok)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(Out + split * sos + b * sob + head[:, None] * soh + row[:, None] * som + offs_d[None, :] * sod,
             out.to(Out.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


_attn_splitk_tuned = triton.autotune(_SPLITK_CONFIGS, key=["LQ_BUCKET", "GROUP", "LK_BUCKET", "NSPLIT", "D"])(
    _attn_splitk)


@triton.jit
def _attn_combine(
    Part, PLse, Out, Lse,
    sps, spb, sph, spm, spd,
    sls, slb, slh, slm,
    sob, soh, som, sod,
    sob2, soh2, som2,
    S, Hq, Lq, D,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per (batch, head, query row): out = sum_s exp(lse_s - lse) o_s, lse = logsumexp_s lse_s
    pid = tl.program_id(0).to(tl.int64)  # int64 offsets (as in _attn_fwd)
    b = pid // (Hq * Lq)
    h = (pid // Lq) % Hq
    m = pid % Lq
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < S
    d_ok = offs_d < D
    ls = tl.load(PLse + offs_s.to(tl.int64) * sls + b * slb + h * slh + m * slm, mask=s_ok, other=float("-inf"))
    mx = tl.max(ls, 0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2((ls - mx_safe) * 1.4426950408889634)
    total = tl.sum(w, 0)
    o = tl.load(Part + offs_s.to(tl.int64)[:, None] * sps + b * spb + h * sph + m * spm + offs_d[None, :] * spd,
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    empty = total == 0.0
    out = tl.sum(w[:, None] * o, 0) / tl.where(empty, 1.0, total)
    lse = tl.where(empty, float("-inf"), mx_safe + tl.log(tl.where(empty, 1.0, total)))
    tl.store(Out + b * sob + h * soh + m * som + offs_d * sod, out.to(Out.dtype.element_ty), mask=d_ok)
    tl.store(Lse + b * sob2 + h * soh2 + m * som2, lse)


_MAX_SPLITS = 64
SPLIT_OVERHEAD_KEYS = 128  # a split's fixed cost in keys read: its query tile, pipeline fill, partial write and merge


def _num_sms() -> int:
    """SMs of the current CUDA device (the tensors' own during a launch: :mod:`dllm.kernels.device`)."""
    if torch.cuda.is_available():
        return _sms_of(torch.cuda.current_device())
    return 132  # an H100 SXM


@functools.cache
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=1024)
def _split_chunks(Lk: int, interpreting: bool) -> dict[int, int]:
    """``{split count that runs: keys per split}`` for every key split of ``Lk`` keys: at least 128 keys per split
    (whole 128-key tiles on a GPU, ``interpreting``: any), at most 64 splits. Cached (with :func:`_num_splits`): an
    eager attention call asks for its split count every time, and the answer is a few loops of Python over up to 64
    candidates. Read only (a cached dict)."""
    align = 1 if interpreting else 128
    chunks = {}
    for n in range(1, min(_cdiv(Lk, 128), _MAX_SPLITS) + 1):
        chunk = _cdiv(_cdiv(Lk, n), align) * align
        chunks[_cdiv(Lk, chunk)] = min(chunk, Lk)
    return chunks


def _split_base(B: int, Hq: int, Hkv: int, Lq: int, dtype: torch.dtype) -> int:
    """Programs of one key split: batch x KV head x 64-row packed query tile (the batch left out in float32)."""
    rows = Lq * (Hq // max(Hkv, 1))
    return _cdiv(max(rows, 1), 64) * Hkv * (1 if dtype == torch.float32 else max(B, 1))


def splitk_num_splits(B: int, Hq: int, Hkv: int, Lq: int, Lk: int, dtype: torch.dtype, waves: int = 1) -> int:
    """Key splits for :func:`attention_splitk`: the count whose longest pass over the SMs is shortest.

    ``base`` programs (batch x KV head x 64-row packed query tile) times ``n`` key ranges of ``chunk`` keys each run
    in ``ceil(base * n / SMs)`` waves. Split-K is memory-bound, so an SM's time is the keys its programs read plus a
    split's fixed cost (``SPLIT_OVERHEAD_KEYS``: its query tile, the pipeline's fill, its partial output written and
    merged again), and the step's time is ``ceil(base * n / SMs) * (chunk + overhead)``: a partial last wave costs a
    whole one (at 32:32 heads, batch 1, 4,096 keys, 5 splits are 160 programs on 132 SMs, two passes of 896 keys; 4
    splits one pass of 1,024), and many short splits pay the fixed cost many times (without it, 4,097 keys took 33
    splits of 128 keys in 8 waves over 4 of 1,152 in one). Candidates are the split counts that run: at least 128 keys
    per split (whole 128-key tiles on a GPU), at most 64 splits. Of the counts within 10% of the shortest time (more
    splits must save more than that to pay for their partials and the combine) it returns the fewest (1 where the
    base programs already fill the SMs).

    ``waves=w > 1`` (the dispatch's ``"splitk-wide"`` candidate, ``w = 4``) returns instead the most splits whose
    programs fit in ``w`` waves: shorter key ranges, more programs in flight to hide memory latency, which the cost
    model does not see (the dispatch times it).

    In float32 the batch size is left out of ``base`` (a row's fp32 output then never depends on the batch it
    was computed in)."""
    return _num_splits(_split_base(B, Hq, Hkv, Lq, dtype), max(Lk, 1), waves, _num_sms(), _interpreting())


@functools.lru_cache(maxsize=4096)
def _num_splits(base: int, Lk: int, waves: int, sms: int, interpreting: bool) -> int:
    """:func:`splitk_num_splits` of ``base`` programs per split on ``sms`` SMs (every input in the cache's key)."""
    chunks = _split_chunks(Lk, interpreting)
    if waves > 1:
        return max([n for n in chunks if base * n <= waves * sms], default=1)
    cost = {n: _cdiv(base * n, sms) * (chunk + SPLIT_OVERHEAD_KEYS) for n, chunk in chunks.items()}
    return min(n for n in cost if 10 * cost[n] <= 11 * min(cost.values()))


def splitk_candidates(B: int, Hq: int, Hkv: int, Lq: int, Lk: int, dtype: torch.dtype,
                      distinct: bool = True) -> dict[str, int]:
    """The split counts worth timing for one shape, by the dispatch's candidate names: ``"splitk"`` (the cost model's
    count, :func:`splitk_num_splits`), ``"splitk-2x"`` (the count that runs nearest twice that: two programs per SM
    where one fills it) and ``"splitk-wide"`` (the most within four waves). ``distinct``: each only where its count
    differs from the ones before it."""
    one = splitk_num_splits(B, Hq, Hkv, Lq, Lk, dtype)
    double = min((n for n in _split_chunks(max(Lk, 1), _interpreting()) if n >= 2 * one), default=one)
    every = {"splitk": one, "splitk-2x": double, "splitk-wide": splitk_num_splits(B, Hq, Hkv, Lq, Lk, dtype, waves=4)}
    if not distinct:
        return every
    out = {}
    for name, n in every.items():
        if n not in out.values():
            out[name] = n
    return out


def _splitk_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
                 num_splits: int, traced: bool = False):
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    out = _out_like(q)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return out, lse
    if Lk == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    align = 1 if _interpreting() else 128  # GPU splits hold whole 128-key tiles
    chunk = _cdiv(_cdiv(Lk, num_splits), align) * align
    nsplit = _cdiv(Lk, chunk)
    if nsplit == 1:
        part, plse = out, lse
        po, pl = (0, *out.stride()), (0, *lse.stride())
    else:
        part = torch.empty((nsplit, B, Hq, Lq, D), dtype=torch.float32, device=q.device)
        plse = torch.empty((nsplit, B, Hq, Lq), dtype=torch.float32, device=q.device)
        po, pl = part.stride(), plse.stride()
    mask, smb, smn, has_mask = _mask_arg(key_padding_mask, q, traced)
    group = Hq // Hkv
    block_d = max(16, _pow2(D))
    args = (q, k, v, part, plse, mask, *q.stride(), *k.stride(), *v.stride(), *po, *pl, smb, smn,
            Hkv, Lq, Lk, D, group, chunk, _pow2(Lk), nsplit, _pow2(Lq))
    meta = dict(QK_SCALE=_LOG2E / math.sqrt(D), HAS_MASK=has_mask, IEEE=q.dtype == torch.float32, BLOCK_D=block_d)
    rows = group * Lq
    if q.dtype == torch.float32 or _interpreting():
        # fixed tiles: fp32 results must not depend on an autotuner's timing
        if _interpreting():
            block_m, block_n, warps, stages = (16 if rows <= 16 else 32), 32, 4, 2
        else:
            block_m, block_n, warps, stages = fp32_tiles(rows, block_d)
        grid = (_cdiv(rows, block_m), B * Hkv, nsplit)
        _launch(_attn_splitk, traced)[grid](*args, **meta, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                                            num_stages=stages)
    else:
        grid = lambda META: (_cdiv(rows, META["BLOCK_M"]), B * Hkv, nsplit)  # noqa: E731
        _launch(_attn_splitk_tuned, traced)[grid](*args, **meta)
    if nsplit > 1:
        _launch(_attn_combine, traced)[(B * Hq * Lq,)](
            part, plse, out, lse, *part.stride(), *plse.stride(), *out.stride(), *lse.stride(),
            nsplit, Hq, Lq, D, BLOCK_S=max(2, _pow2(nsplit)), BLOCK_D=block_d,
            num_warps=4 if block_d <= 64 else 8,
        )
    return out, lse


def attention_splitk(q, k, v, key_padding_mask=None, return_lse=False, num_splits=None):
    """Split-K (flash-decoding) attention: the same contract as :func:`attention`, for few query rows over many keys.

    The keys are cut into ``num_splits`` contiguous ranges; one program per (packed query tile, batch x KV head,
    key range) writes a partial output and its LSE in float32, and a second kernel merges the ranges
    (``lse = logsumexp_s lse_s``, ``out = sum_s exp(lse_s - lse) out_s``). The query rows of all heads that share a
    KV head are packed into one tile, so K/V are read once per GQA group.

    Args:
        q, k, v, key_padding_mask, return_lse: as :func:`attention`.
        num_splits: key ranges (at most ``Lk`` and 64; on a GPU each range holds whole 128-key tiles, so fewer may
            run); None: :func:`splitk_num_splits` of the shape.

    Returns:
        ``out`` ``[B, Hq, Lq, D]`` in ``q.dtype``, and ``lse`` ``[B, Hq, Lq]`` float32 when asked.
    """
    if not _usable(q):
        return reference.attention(q, k, v, key_padding_mask=key_padding_mask, return_lse=return_lse)
    _check(q, k, v, key_padding_mask)
    if num_splits is None:
        num_splits = splitk_num_splits(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.dtype)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [1, {_MAX_SPLITS}], got {num_splits!r}")
    (q, k, v), back = _widen(q, k, v)
    if torch.compiler.is_compiling() and not _interpreting():
        out, lse = torch.ops.dllm.splitk_attention(q, k, v, key_padding_mask, num_splits)
    else:
        out, lse = _splitk_impl(q, k, v, key_padding_mask, num_splits)
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
    Hq, Lq, Lk, D, GROUP,
    QK_SCALE: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # int64 offsets (as in _attn_fwd)
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
        p = tl.exp2(s.to(tl.float32) * QK_SCALE - lse2[:, None])
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
    if q.numel() == 0 or Lk == 0:
        return torch.zeros((B, Lk), dtype=torch.float32, device=q.device)
    part = torch.empty((B, Hq, Lk), dtype=torch.float32, device=q.device)  # every element written below
    mask, smb, smn, has_mask = _mask_arg(key_padding_mask, q)
    block_m, block_n, block_d = _blocks(D, Lq)
    warps, stages = 4, 2
    if q.dtype == torch.float32 and not _interpreting():
        block_m, block_n, warps, stages = fp32_tiles(Lq, block_d)
    grid = (_cdiv(Lk, block_n), B * Hq)
    _attn_mass[grid](
        q, k, lse, mask, part,
        *q.stride(), *k.stride(), *lse.stride(), smb, smn, *part.stride(),
        Hq, Lq, Lk, D, Hq // k.shape[1],
        QK_SCALE=_LOG2E / math.sqrt(D), HAS_MASK=has_mask, IEEE=q.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=warps, num_stages=stages,
    )
    return part.sum(1)


# ------------------------------------------------------------------------------------------ attention drift


@triton.jit
def _drift_probs(Q, K, Lse, b, h, hk, offs_m, m_ok, n, keep, D,
                 sqb, sqh, sqm, sqd, skb, skh, skn, skd, slb, slh, slm,
                 QK_SCALE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """One head's attention probabilities ``[BLOCK_M, BLOCK_N]`` (fp32) of query rows ``offs_m`` over keys ``n``
    from their natural-log LSE; 0 where a key is masked or a row has no key (LSE -inf). The scores are summed over
    chunks of BLOCK_D of the head dimension (the operand tiles stay small: fp32 FMA products hold them in
    registers)."""
    s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        kt = tl.load(K + b * skb + hk * skh + n[None, :] * skn + offs_d[:, None] * skd,
                     mask=keep[None, :] & d_ok[:, None], other=0.0)
        if IEEE:
            s += tl.dot(q, kt, input_precision="ieee")
        else:
            s += tl.dot(q, kt).to(tl.float32)
    lse = tl.load(Lse + b * slb + h * slh + offs_m * slm, mask=m_ok, other=float("-inf"))
    row_ok = m_ok & (lse != float("-inf"))
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
    p = tl.exp2(s * QK_SCALE - lse2[:, None])
    return tl.where(row_ok[:, None] & keep[None, :], p, 0.0)


@triton.jit
def _attn_drift(
    QO, KO, LseO, QN, KN, LseN, Mask, RowOk, Part,
    sqob, sqoh, sqom, sqod,
    skob, skoh, skon, skod,
    slob, sloh, slom,
    sqnb, sqnh, sqnm, sqnd,
    sknb, sknh, sknn, sknd,
    slnb, slnh, slnm,
    smb, smn,
    srb, srm,
    spb, sps, spn,
    Hq, Lq, Lk, D, GROUP,
    QK_SCALE: tl.constexpr, EPS: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)  # int64 offsets (as in _attn_fwd)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = n < Lk
    if HAS_MASK:
        keep = keep & (tl.load(Mask + b * smb + n * smn, mask=keep, other=0) != 0)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    count = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, Lq, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < Lq
        counted = m_ok & (tl.load(RowOk + b * srb + offs_m * srm, mask=m_ok, other=0) != 0)
        dot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sq_old = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sq_new = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for h in range(0, Hq):  # the cosine runs over the heads: every head of this tile of keys in one program
            hk = h // GROUP
            p_old = _drift_probs(QO, KO, LseO, b, h, hk, offs_m, m_ok, n, keep, D,
                                 sqob, sqoh, sqom, sqod, skob, skoh, skon, skod, slob, sloh, slom,
                                 QK_SCALE=QK_SCALE, IEEE=IEEE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
            p_new = _drift_probs(QN, KN, LseN, b, h, hk, offs_m, m_ok, n, keep, D,
                                 sqnb, sqnh, sqnm, sqnd, sknb, sknh, sknn, sknd, slnb, slnh, slnm,
                                 QK_SCALE=QK_SCALE, IEEE=IEEE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
            dot += p_old * p_new
            sq_old += p_old * p_old
            sq_new += p_new * p_new
        cos = dot / (tl.maximum(tl.sqrt(sq_old), EPS) * tl.maximum(tl.sqrt(sq_new), EPS))
        w = counted[:, None] & keep[None, :]
        total += tl.sum(tl.where(w, cos, 0.0), 0)
        count += tl.sum(w.to(tl.float32), 0)
    tl.store(Part + b * spb + n * spn, total, mask=n < Lk)
    tl.store(Part + b * spb + sps + n * spn, count, mask=n < Lk)


@triton.jit(do_not_specialize=["index"])
def _drift_finish(Part, Sim, Gate, First, index, Lk, spb, sps, spn, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per batch row: the mean of :func:`_attn_drift`'s per-key sums (``Sim``) and, with a gate, the row's
    first fall below it (:func:`dllm.kernels.reference.record_below`)."""
    b = tl.program_id(0).to(tl.int64)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    count = tl.zeros([BLOCK], dtype=tl.float32)
    for n0 in range(0, Lk, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        ok = n < Lk
        total += tl.load(Part + b * spb + n * spn, mask=ok, other=0.0)
        count += tl.load(Part + b * spb + sps + n * spn, mask=ok, other=0.0)
    sim = tl.sum(total, 0) / tl.maximum(tl.sum(count, 0), 1.0)
    tl.store(Sim + b, sim)
    if HAS_GATE:
        g = tl.load(Gate + b)
        below = sim < g
        tl.store(First + b, tl.where(below, index, tl.load(First + b)))
        tl.store(Gate + b, tl.where(below, float("-inf"), g))


def drift_tiles(rows: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_D, num_warps)`` of :func:`attention_drift` (one fixed config: its fp32 result must
    not depend on an autotuner's timing). Its programs hold two heads' probabilities and three accumulators per tile,
    so the head dimension is read in chunks of BLOCK_D: at 32 x 64 keys, chunks of 64 over 4 warps (bf16/fp16
    products) and 32 x 32, chunks of 32 over 8 warps (fp32 FMA products) fit Hopper's registers at every head
    dimension (``python tests/compile_kernels.py --spills``)."""
    block_m = 16 if rows <= 16 else 32
    if _interpreting():
        return block_m, 32, 32, 4
    return (block_m, 32, 32, 8) if dtype == torch.float32 else (block_m, 64, 64, 4)


def attention_drift(q_old, k_old, q_new, k_new, key_padding_mask, rows_ok, gate=None, first=None, index=0):
    """Triton twin of :func:`dllm.kernels.reference.attention_drift`: each softmax's LSE by an LSE-only pass of the
    attention kernel, then one program per (tile of keys, batch row) recomputes both distributions head by head and
    writes, per key, the sum of the cosines over the counted rows and their count, and one program per batch row sums
    those over the keys and records where the row falls below its gate (deterministic, no atomics: four kernels).
    Arguments as the reference's."""
    if not _usable(q_old):
        return reference.attention_drift(q_old, k_old, q_new, k_new, key_padding_mask, rows_ok, gate, first, index)
    _check(q_old, k_old, key_padding_mask=key_padding_mask)
    _check(q_new, k_new, key_padding_mask=key_padding_mask)
    reference.check_gate(gate, first, q_old)
    if q_old.shape != q_new.shape or k_old.shape != k_new.shape:
        raise ValueError(f"the old and new queries {tuple(q_old.shape)} / {tuple(q_new.shape)} and keys "
                         f"{tuple(k_old.shape)} / {tuple(k_new.shape)} must have the same shapes")
    B, Hq, Lq, D = q_old.shape
    Lk = k_old.shape[2]
    if tuple(rows_ok.shape) != (B, Lq) or rows_ok.dtype != torch.bool:
        raise ValueError(f"rows_ok must be a [B, Lq] = [{B}, {Lq}] bool tensor, got {list(rows_ok.shape)} "
                         f"{rows_ok.dtype}")
    (q_old, k_old, q_new, k_new), _ = _widen(q_old, k_old, q_new, k_new)
    block_m, block_n, block_d, warps = drift_tiles(Lq, q_old.dtype)
    if q_old.numel() == 0 or Lk == 0:
        sim = torch.zeros(B, dtype=torch.float32, device=q_old.device)
        if gate is not None:
            reference.record_below(sim, gate, first, index)
        return sim
    part = torch.empty((B, 2, Lk), dtype=torch.float32, device=q_old.device)  # per key: the cosines' sum, count
    _, lse_old = _attention_lse(q_old, k_old, None, key_padding_mask, write_out=False)
    _, lse_new = _attention_lse(q_new, k_new, None, key_padding_mask, write_out=False)
    mask, smb, smn, has_mask = _mask_arg(key_padding_mask, q_old)
    rows = rows_ok.view(torch.uint8)
    grid = (_cdiv(Lk, block_n), B)
    _attn_drift[grid](
        q_old, k_old, lse_old, q_new, k_new, lse_new, mask, rows, part,
        *q_old.stride(), *k_old.stride(), *lse_old.stride(), *q_new.stride(), *k_new.stride(), *lse_new.stride(),
        smb, smn, *rows.stride(), *part.stride(),
        Hq, Lq, Lk, D, Hq // k_old.shape[1],
        QK_SCALE=_LOG2E / math.sqrt(D), EPS=1e-8, HAS_MASK=has_mask, IEEE=q_old.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=warps, num_stages=2,
    )
    sim = torch.empty(B, dtype=torch.float32, device=q_old.device)
    has_gate = gate is not None
    _drift_finish[(B,)](
        part, sim, gate if has_gate else sim, first if has_gate else sim, index, Lk, *part.stride(),
        HAS_GATE=has_gate, BLOCK=max(16, min(1024, _pow2(Lk))), num_warps=4,
    )
    return sim


# ---------------------------------------------------------------------------------------- confidence stats


@triton.jit
def _conf_lanes(m, z, s, t1, i1, t2, best, bidx, blog, TRACK: tl.constexpr):
    """Merge per-lane (or per-split) partial statistics along axis 0 into scalars; ties go to the smallest index."""
    NEG = float("-inf")
    mx = tl.max(m, 0)
    mx_safe = tl.where(mx == NEG, 0.0, mx)
    dead = m == NEG
    alpha = tl.where(dead, 0.0, tl.exp2((m - mx_safe) * 1.4426950408889634))
    zt = tl.sum(alpha * z, 0)
    st = tl.sum(alpha * (s - tl.where(dead, 0.0, mx_safe - m) * z), 0)
    top1 = tl.max(t1, 0)
    big = 2147483647
    tok1 = tl.min(tl.where(t1 == top1, i1, big), 0)
    top2 = tl.maximum(tl.max(t2, 0), tl.max(tl.where(i1 == tok1, NEG, t1), 0))
    if TRACK:  # a proposal of its own (noise, an excluded column); else the argmax
        bmax = tl.max(best, 0)
        btok = tl.min(tl.where(best == bmax, bidx, big), 0)
        blg = tl.max(tl.where(bidx == btok, blog, NEG), 0)
    else:
        bmax = top1
        btok = tok1
        blg = top1
    return mx, zt, st, top1, tok1, top2, bmax, btok, blg


@triton.jit
def _conf_partial(
    L, U, Stats, Idx,
    slr, slv, sur, suv,
    V, CHUNK, temperature, EXCL,
    Count, Token, Out, N,
    HAS_NOISE: tl.constexpr, HAS_EXCL: tl.constexpr, TRACK: tl.constexpr, BLOCK_V: tl.constexpr,
    LAST_MERGES: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # LAST_MERGES: the row's last program to finish (an atomic count per row, Count zeroed by the caller) merges the
    # row's partials and writes the outputs (_conf_finish), so that one launch does both stages; else _conf_merge does
    # TRACK (HAS_NOISE or HAS_EXCL): the proposal is tracked apart from the top-2
    # grid (rows, vocabulary splits). Every statistic is kept per lane (BLOCK_V lanes, lane j sees the indices
    # = j mod BLOCK_V of the split) with elementwise updates only; the lanes are merged once at the end.
    # int64: a row's offset row * slr passes 2^31 once rows x vocabulary does (LLaDA's 126,464 columns: 16,981 rows, a
    # batch of 64 with a window of 266); program ids and arguments are int32, and so are their products
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    offs = tl.arange(0, BLOCK_V)
    NEG = float("-inf")
    LOG2E = 1.4426950408889634
    m = tl.full([BLOCK_V], NEG, tl.float32)  # running max
    z = tl.zeros([BLOCK_V], tl.float32)  # sum e^(x - m)
    s = tl.zeros([BLOCK_V], tl.float32)  # sum e^(x - m) (x - m)
    t1 = tl.full([BLOCK_V], NEG, tl.float32)
    i1 = tl.full([BLOCK_V], 2147483647, tl.int32)
    t2 = tl.full([BLOCK_V], NEG, tl.float32)
    best = tl.full([BLOCK_V], NEG, tl.float32)
    bidx = tl.full([BLOCK_V], 2147483647, tl.int32)
    blog = tl.full([BLOCK_V], NEG, tl.float32)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK_V):
        v = start + offs
        ok = v < hi
        x = tl.load(L + row * slr + v * slv, mask=ok, other=NEG).to(tl.float32)
        # online softmax, one exp per element: d = e^(min(x, m) - max(x, m))
        gt = x > m
        m_new = tl.where(gt, x, m)
        low = tl.where(gt, m, x)
        dead = low == NEG
        diff = tl.where(dead, 0.0, low - m_new)
        d = tl.where(dead, 0.0, tl.exp2(diff * LOG2E))
        t = d * diff
        s = tl.where(gt, d * s + t * z, s + t).to(tl.float32)
        z = tl.where(gt, z * d + 1.0, z + d).to(tl.float32)
        m = m_new
        # top-2 of the clean logits (strictly greater: the first index of a lane wins its ties)
        t2 = tl.where(gt, tl.maximum(t1, t2), tl.where(x > t1, t1, tl.maximum(t2, x)))
        up = x > t1
        i1 = tl.where(up, v, i1)
        t1 = tl.where(up, x, t1)
        # proposal: Gumbel-perturbed argmax x - T log(-log u); never the excluded column (which stays in the
        # softmax, the top-2 and the entropy above)
        if TRACK:
            if HAS_NOISE:
                u = tl.load(U + row * sur + v * suv, mask=ok, other=0.5).to(tl.float32)
                g = (x - temperature * tl.log(-tl.log(u))).to(tl.float32)
            else:
                g = x
            g = tl.where(ok & (v != EXCL), g, NEG)
            tk = g > best
            bidx = tl.where(tk, v, bidx)
            blog = tl.where(tk, x, blog)
            best = tl.where(tk, g, best)
    mx, zt, st, top1, tok1, top2, bmax, btok, blg = _conf_lanes(m, z, s, t1, i1, t2, best, bidx, blog, TRACK)
    base = Stats + (row * nsplit + split) * 7
    tl.store(base + 0, mx)
    tl.store(base + 1, zt)
    tl.store(base + 2, st)
    tl.store(base + 3, top1)
    tl.store(base + 4, top2)
    tl.store(base + 5, bmax)
    tl.store(base + 6, blg)
    ib = Idx + (row * nsplit + split) * 2
    tl.store(ib + 0, tok1)
    tl.store(ib + 1, btok)
    if LAST_MERGES:
        # every thread's stores issued before the count (the barrier), the count's release and acquire order them
        # before the last program's loads, which bypass L1 (.cg: another SM wrote them)
        tl.debug_barrier()
        done = tl.atomic_add(Count + row, 1, sem="acq_rel", scope="gpu")
        if done == nsplit - 1:
            tl.debug_barrier()
            _conf_finish(Stats, Idx, Token, Out, row, N, nsplit, TRACK, BLOCK_S, ".cg")


@triton.jit
def _conf_merge(
    Stats, Idx, Token, Out, N, S,
    TRACK: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # second stage, one program per row: merge the S split partials and write the outputs
    # (Token [N] int64; Out [4, N] float32: p_token, p_max, p_second, entropy)
    row = tl.program_id(0).to(tl.int64)
    _conf_finish(Stats, Idx, Token, Out, row, N, S, TRACK, BLOCK_S, "")


@triton.jit
def _conf_finish(Stats, Idx, Token, Out, row, N, S, TRACK: tl.constexpr, BLOCK_S: tl.constexpr, CACHE: tl.constexpr):
    """Merge row ``row``'s ``S`` split partials (in split order, whichever program runs it) and write its outputs."""
    sp = tl.arange(0, BLOCK_S)
    ok = sp < S
    NEG = float("-inf")
    base = Stats + (row * S + sp) * 7
    m = tl.load(base + 0, mask=ok, other=NEG, cache_modifier=CACHE)
    z = tl.load(base + 1, mask=ok, other=0.0, cache_modifier=CACHE)
    s = tl.load(base + 2, mask=ok, other=0.0, cache_modifier=CACHE)
    t1 = tl.load(base + 3, mask=ok, other=NEG, cache_modifier=CACHE)
    t2 = tl.load(base + 4, mask=ok, other=NEG, cache_modifier=CACHE)
    best = tl.load(base + 5, mask=ok, other=NEG, cache_modifier=CACHE)
    blog = tl.load(base + 6, mask=ok, other=NEG, cache_modifier=CACHE)
    i1 = tl.load(Idx + (row * S + sp) * 2, mask=ok, other=2147483647, cache_modifier=CACHE)
    bidx = tl.load(Idx + (row * S + sp) * 2 + 1, mask=ok, other=2147483647, cache_modifier=CACHE)
    mx, zt, st, top1, tok1, top2, bmax, btok, blg = _conf_lanes(m, z, s, t1, i1, t2, best, bidx, blog, TRACK)
    lz = tl.log(zt)
    lse = mx + lz
    token = tl.where(btok == 2147483647, 0, btok)  # a row without a finite logit: index 0, as torch.argmax
    tl.store(Token + row, token.to(tl.int64))
    tl.store(Out + row, tl.exp(blg - lse))
    tl.store(Out + N + row, tl.exp(top1 - lse))
    tl.store(Out + 2 * N + row, tl.exp(top2 - lse))
    tl.store(Out + 3 * N + row, lz - st / zt)


_CONF_MAX_SPLITS = 64


def confidence_stats(logits, temperature=0.0, noise=None, exclude=None):
    """Triton twin of :func:`dllm.kernels.reference.confidence_stats` (same arguments, outputs and semantics;
    an excluded column is skipped by the proposal inside the one pass, where the reference corrects a second
    statistic).

    Args:
        logits: ``[..., V]`` float16/bfloat16/float32, any strides (flattened to ``[N, V]``; the last dim is
            strided, not copied, when the leading dims can be viewed).
        temperature: Gumbel-max temperature ``T >= 0`` for the proposal.
        noise: uniform ``(0, 1)`` noise broadcastable to ``logits`` (any float dtype, read in fp32); drawn with
            ``torch.rand`` when ``T > 0`` and None; ignored at ``T = 0``.
        exclude: a column never proposed but kept in the probabilities (the mask token), or None.

    Returns:
        :class:`~dllm.kernels.reference.ConfidenceStats` with ``token`` ``[...]`` int64 and ``p_token``,
        ``p_max``, ``p_second``, ``entropy`` ``[...]`` float32.
    """
    if not _usable(logits):
        return reference.confidence_stats(logits, temperature=temperature, noise=noise, exclude=exclude)
    noise = reference.confidence_noise(logits, temperature, noise)
    dtype = logits.dtype
    (logits,), _ = _widen(logits)
    V, N = logits.shape[-1], logits.numel() // max(logits.shape[-1], 1)
    block_v = 256 if _interpreting() else 1024
    splits = 1 if _interpreting() else confidence_splits(V, N, dtype, block_v)
    excl = exclude if exclude is not None and 0 <= exclude < V else -1
    return _confidence_stats(logits, temperature, noise, block_v, splits, excl)


def confidence_splits(V: int, N: int, dtype: torch.dtype, block_v: int = 1024) -> int:
    """Vocabulary splits of :func:`confidence_stats` for ``N`` rows of ``V`` logits: enough programs to fill the GPU a
    few times over at a few rows, each with at least 4 tiles of ``block_v`` columns. In float32 the row count is left
    out: the split count sets the order of the merge's sums, so a row's fp32 statistics then never depend on the
    batch they were computed in (as :func:`splitk_num_splits` does for attention)."""
    per_rows = _CONF_MAX_SPLITS if dtype == torch.float32 else _cdiv(4 * _num_sms(), max(N, 1))
    return max(1, min(_cdiv(V, 4 * block_v), per_rows, _CONF_MAX_SPLITS))


#: how :func:`confidence_stats` merges a row's split partials: ``"last-program"`` (default), inside the one launch,
#: by the row's last program to finish (an atomic count per row); ``"kernel"``, a second kernel launch. The same
#: merge in the same order: the same bits in the interpreter; compiled for a GPU the two kernels' multiply-adds may
#: be contracted differently, a rounding apart (the token is the same). The one launch halves an eager call's
#: launches, which bound its time (docs/performance.md). See :func:`set_confidence_merge`.
CONFIDENCE_MERGES = ("kernel", "last-program")
_conf_merge_mode = "last-program"


def set_confidence_merge(mode: str) -> str:
    """Set how eager :func:`confidence_stats` calls merge the split partials (:data:`CONFIDENCE_MERGES`); returns the
    previous mode. ``torch.compile`` always traces the two-launch form."""
    global _conf_merge_mode
    if mode not in CONFIDENCE_MERGES:
        raise ValueError(f"confidence merge must be one of {', '.join(map(repr, CONFIDENCE_MERGES))}, got {mode!r}")
    prev, _conf_merge_mode = _conf_merge_mode, mode
    return prev


def _confidence_impl(x: torch.Tensor, u: torch.Tensor | None, temperature: float, block_v: int, splits: int,
                     exclude: int = -1, traced: bool = False, lead: tuple | None = None):
    """Token ``[N]`` and statistics ``[4, N]`` of the ``N`` rows of ``x``; ``lead``: allocated as ``lead`` and
    ``[4, *lead]`` instead (contiguous: the kernels' flat row index is the same), so an eager caller needs no
    reshape of the outputs (each a host-side call on every step)."""
    N, V = x.shape
    noised = u is not None
    chunk = _cdiv(_cdiv(V, splits), block_v) * block_v
    nsplit = _cdiv(V, chunk)
    shape = (N,) if lead is None else tuple(lead)
    token = torch.empty(shape, dtype=torch.int64, device=x.device)
    out = torch.empty((4, *shape), dtype=torch.float32, device=x.device)
    if N == 0:
        return token, out
    stats = torch.empty((N, nsplit, 7), dtype=torch.float32, device=x.device)
    idx = torch.empty((N, nsplit, 2), dtype=torch.int32, device=x.device)
    uu = u if noised else x
    last = _conf_merge_mode == "last-program" and not traced
    count = torch.zeros((N,), dtype=torch.int32, device=x.device) if last else idx
    block_s = max(2, _pow2(nsplit))
    _launch(_conf_partial, traced)[(N, nsplit)](
        x, uu, stats, idx, x.stride(0), x.stride(1), uu.stride(0), uu.stride(1),
        V, chunk, float(temperature), exclude, count, token, out, N,
        HAS_NOISE=noised, HAS_EXCL=exclude >= 0, TRACK=noised or exclude >= 0, BLOCK_V=block_v,
        LAST_MERGES=last, BLOCK_S=block_s, num_warps=4,
    )
    if not last:
        _launch(_conf_merge, traced)[(N,)](stats, idx, token, out, N, nsplit, TRACK=noised or exclude >= 0,
                                   BLOCK_S=block_s, num_warps=1)
    return token, out


def _confidence_stats(logits, temperature, noise, block_v: int, splits: int, exclude: int = -1):
    noised = noise is not None
    lead, V = logits.shape[:-1], logits.shape[-1]
    if not 1 <= splits <= _CONF_MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {_CONF_MAX_SPLITS}], got {splits}")
    x = logits if logits.dim() == 2 else logits.reshape(-1, V)
    u = noise.expand(logits.shape).reshape(-1, V) if noised else None
    if torch.compiler.is_compiling() and not _interpreting():
        token, out = torch.ops.dllm.confidence_stats(x, u, float(temperature), block_v, splits, exclude)
        return ConfidenceStats(token.reshape(lead), *(t.reshape(lead) for t in out.unbind(0)))
    token, out = _confidence_impl(x, u, float(temperature), block_v, splits, exclude, lead=lead)
    return ConfidenceStats(token, *out.unbind(0))


# ------------------------------------------------------------------------------------------ custom ops
# torch.compile traces through these (the kernels inside are wrapped with torch.library.wrap_triton); eager calls
# skip the op dispatch and run the same implementations directly. The schemas are inferred from the annotations,
# spelled with typing.Optional for the torch versions whose inference does not read ``X | None`` strings.


@torch.library.triton_op("dllm::flash_attention", mutates_args=())
def _flash_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              key_padding_mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: UP045
    return _flash_impl(q, k, v, key_padding_mask, traced=True)


@_flash_op.register_fake
def _flash_fake(q, k, v, key_padding_mask):
    return _out_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.triton_op("dllm::splitk_attention", mutates_args=())
def _splitk_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],  # noqa: UP045
               num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _splitk_impl(q, k, v, key_padding_mask, num_splits, traced=True)


@_splitk_op.register_fake
def _splitk_fake(q, k, v, key_padding_mask, num_splits):
    return _out_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.triton_op("dllm::confidence_stats", mutates_args=())
def _confidence_op(logits: torch.Tensor, noise: Optional[torch.Tensor], temperature: float, block_v: int,  # noqa: UP045
                   splits: int, exclude: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _confidence_impl(logits, noise, temperature, block_v, splits, exclude, traced=True)


@_confidence_op.register_fake
def _confidence_fake(logits, noise, temperature, block_v, splits, exclude):
    n = logits.shape[0]
    return logits.new_empty((n,), dtype=torch.int64), logits.new_empty((4, n), dtype=torch.float32)
