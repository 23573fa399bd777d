"""Pure-PyTorch reference kernels.

Each function here is the CPU path and the test oracle for the Triton kernel of the same name; signatures
are identical. Shapes use B = batch, Hq = query heads, Hkv = key/value heads (Hq % Hkv == 0),
Lq = query rows, Lk = key rows, D = head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Non-causal attention of a few query rows over a full key set.

    Args:
        q: ``[B, Hq, Lq, D]`` float16/bfloat16/float32.
        k: ``[B, Hkv, Lk, D]`` same dtype as ``q``.
        v: ``[B, Hkv, Lk, D]`` same dtype as ``q``.
        key_padding_mask: optional ``[B, Lk]`` bool, True where a key may be attended to.
        return_lse: also return the natural-log log-sum-exp of the scaled scores, ``[B, Hq, Lq]`` float32.

    Returns:
        ``out`` ``[B, Hq, Lq, D]`` in ``q.dtype`` (and ``lse`` when asked). Query rows whose keys are all
        masked get zeros (and ``lse = -inf``), never NaN.
    """
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if not return_lse:
        mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq != hkv)
        if key_padding_mask is not None:
            any_key = key_padding_mask.any(-1)[:, None, None, None]
            out = torch.where(any_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out
    vf = v.float().repeat_interleave(hq // hkv, dim=1)
    scores = _scores(q, k, key_padding_mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(torch.float32).min))
    probs = torch.nan_to_num(probs, nan=0.0)
    out = (probs @ vf).to(q.dtype)
    return out, lse


def _scores(q: torch.Tensor, k: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    scores = q.float() @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
    return scores


def attention_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probability mass each key receives, summed over all query rows and heads of ``q``.

    Args:
        q: ``[B, Hq, Lq, D]`` (only the selected query rows), float16/bfloat16/float32.
        k: ``[B, Hkv, Lk, D]``, same dtype.
        key_padding_mask: optional ``[B, Lk]`` bool, True where a key may be attended to.
        lse: optional ``[B, Hq, Lq]`` float32 log-sum-exp from :func:`attention` (recomputed when None).

    Returns:
        ``[B, Lk]`` float32. Over all keys it sums to ``Hq * Lq`` per batch row (minus fully masked rows).
    """
    scores = _scores(q, k, key_padding_mask)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]), nan=0.0)
    return probs.sum(dim=(1, 2))
