"""Pure-PyTorch reference kernels.

Each function here is the CPU path and the test oracle for the Triton kernel of the same name; signatures
are identical. Shapes use B = batch, Hq = query heads, Hkv = key/value heads (Hq % Hkv == 0),
Lq = query rows, Lk = key rows, D = head dim.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dllm.ops import mask_column_excluded


def check_key_padding_mask(key_padding_mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> None:
    """Raise a ValueError unless ``key_padding_mask`` is None or a ``[B, Lk]`` bool tensor on ``q``'s device.

    Both twins call this: a broadcastable mask (e.g. ``[1, Lk]`` with ``B = 2``) is refused rather than silently
    read with the wrong batch stride; the caller expands it (``mask.expand(B, Lk)``, a view, no copy).

    Args:
        key_padding_mask: ``[B, Lk]`` bool, True where a key may be attended to, or None.
        q: ``[B, Hq, Lq, D]`` queries (batch size and device are read from it).
        k: ``[B, Hkv, Lk, D]`` keys (key length is read from it).
    """
    if key_padding_mask is None:
        return
    B, Lk = q.shape[0], k.shape[2]
    m = key_padding_mask
    if m.dtype != torch.bool:
        raise ValueError(f"key_padding_mask must be a bool tensor (True = attend), got {m.dtype}; "
                         "convert it with mask.bool() (or mask != 0)")
    if tuple(m.shape) != (B, Lk):
        raise ValueError(f"key_padding_mask must have shape [B, Lk] = [{B}, {Lk}], got {list(m.shape)}; "
                         f"expand a broadcastable mask explicitly with mask.expand({B}, {Lk})")
    if m.device != q.device:
        raise ValueError(f"key_padding_mask is on {m.device} but q is on {q.device}; move it with mask.to(q.device)")


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
        key_padding_mask: optional ``[B, Lk]`` bool, True where a key may be attended to; any strides (a
            ``[1, Lk]`` mask must be expanded by the caller, ``mask.expand(B, Lk)``: other shapes raise ValueError).
        return_lse: also return the natural-log log-sum-exp of the scaled scores, ``[B, Hq, Lq]`` float32.

    Returns:
        ``out`` ``[B, Hq, Lq, D]`` in ``q.dtype`` (and ``lse`` when asked). Query rows whose keys are all
        masked get zeros (and ``lse = -inf``), never NaN.

    Raises:
        ValueError: ``Hq`` is not a multiple of ``Hkv``, or ``key_padding_mask`` is not a ``[B, Lk]`` bool tensor
            on ``q``'s device (a broadcastable ``[1, Lk]`` mask is refused: expand it first).
    """
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    check_key_padding_mask(key_padding_mask, q, k)
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


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_blocks: torch.Tensor,
                           k_blocks: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Block-diffusion attention: a query attends to the keys of its own block and of earlier blocks
    (bidirectional inside a block, causal across blocks), as SDAR-style models are trained.

    Args:
        q, k, v: as :func:`attention`.
        q_blocks: ``[B, Lq]`` int64 block index of each query row (``position // block_size``).
        k_blocks: ``[B, Lk]`` int64 block index of each key.
        key_padding_mask: optional ``[B, Lk]`` bool, True where a key may be attended to.

    Returns:
        ``[B, Hq, Lq, D]`` in ``q.dtype``; query rows with no key to attend to get zeros. No Triton twin: every
        backend runs this (``scaled_dot_product_attention`` with a boolean mask).
    """
    return pattern_attention(q, k, v, k_blocks[:, None, :] <= q_blocks[:, :, None], key_padding_mask)


def pattern_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                      key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention under an explicit pattern: query ``i`` attends to key ``j`` where ``allowed[b, i, j]``
    (``[B, Lq, Lk]`` bool) and the key is not padding. Block-diffusion attention is one such pattern; the
    block-diffusion training objective (a noisy and a clean copy of the sequence in one forward) is another.
    Query rows with no key to attend to get zeros."""
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    check_key_padding_mask(key_padding_mask, q, k)
    if allowed.shape != (q.shape[0], q.shape[2], k.shape[2]) or allowed.dtype != torch.bool:
        raise ValueError(f"allowed must be a [B, Lq, Lk] = {[q.shape[0], q.shape[2], k.shape[2]]} bool tensor, got "
                         f"{list(allowed.shape)} {allowed.dtype}")
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=hq != hkv)
    return torch.where(allowed.any(-1)[:, None, :, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


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
        key_padding_mask: optional ``[B, Lk]`` bool, True where a key may be attended to; any strides (a
            ``[1, Lk]`` mask must be expanded by the caller, ``mask.expand(B, Lk)``: other shapes raise ValueError).
        lse: optional ``[B, Hq, Lq]`` float32 log-sum-exp from :func:`attention` (recomputed when None).

    Returns:
        ``[B, Lk]`` float32. Over all keys it sums to ``Hq * Lq`` per batch row (minus fully masked rows).

    Raises:
        ValueError: ``key_padding_mask`` is not a ``[B, Lk]`` bool tensor on ``q``'s device.
    """
    check_key_padding_mask(key_padding_mask, q, k)
    scores = _scores(q, k, key_padding_mask)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]), nan=0.0)
    return probs.sum(dim=(1, 2))


def attention_probs(q: torch.Tensor, k: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention ``[B, Hq, Lq, Lk]`` in float32 (``q``, ``k`` as :func:`attention_mass`; masked keys get 0)."""
    return torch.softmax(_scores(q, k, key_padding_mask), dim=-1)


def attention_drift(
    q_old: torch.Tensor,
    k_old: torch.Tensor,
    q_new: torch.Tensor,
    k_new: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    rows_ok: torch.Tensor,
    gate: torch.Tensor | None = None,
    first: torch.Tensor | None = None,
    index: int = 0,
) -> torch.Tensor:
    """How alike two attention distributions of the same query rows are (Elastic-Cache's drift test): per batch
    row, the mean over the valid query rows (``rows_ok``) and keys (``key_padding_mask``) of the cosine similarity,
    over the heads, of the old rows' attention over the old keys and the new rows' over the new keys. With ``gate``
    and ``first``, also where it falls below a per-row threshold (:func:`record_below`), with no host
    synchronisation.

    Args:
        q_old, q_new: ``[B, Hq, Lq, D]``, float16/bfloat16/float32.
        k_old, k_new: ``[B, Hkv, Lk, D]``, the same dtype.
        key_padding_mask: optional ``[B, Lk]`` bool, True where a key may be attended to (see :func:`attention`).
        rows_ok: ``[B, Lq]`` bool, the query rows that count (the others are padding).
        gate, first, index: optional, both or neither: see :func:`record_below` (written in place).

    Returns:
        ``[B]`` float32 in [-1, 1] (0 where no row or key counts). The cosine similarity is
        ``torch.nn.functional.cosine_similarity``'s (norms clamped at 1e-8).
    """
    check_key_padding_mask(key_padding_mask, q_old, k_old)
    check_gate(gate, first, q_old)
    a_old = attention_probs(q_old, k_old, key_padding_mask)
    a_new = attention_probs(q_new, k_new, key_padding_mask)
    cs = F.cosine_similarity(a_old, a_new, dim=1)  # over heads: [B, Lq, Lk]
    ok = rows_ok[..., None].to(cs.dtype)  # [B, Lq, 1] the rows that count
    if key_padding_mask is not None:  # the mean over keys counts the row's own keys, not left padding
        ok = ok * key_padding_mask[:, None, :].to(cs.dtype)
    else:
        ok = ok.expand_as(cs)
    sim = (cs * ok).sum((1, 2)) / ok.sum((1, 2)).clamp_min(1)
    if gate is not None:
        record_below(sim, gate, first, index)
    return sim


def record_below(value: torch.Tensor, gate: torch.Tensor, first: torch.Tensor, index: int) -> None:
    """In place, for each row whose ``value`` is below its ``gate``: ``first = index`` and ``gate = -inf``, so that a
    row records only the first of a sequence of calls (rising ``index``) where it falls below, and a row whose gate is
    ``-inf`` never does. Elastic-Cache's first failing layer per row: the gate holds ``gamma`` for the rows testing.

    Args:
        value: ``[B]`` float32.
        gate: ``[B]`` float32, the threshold per row (compared in float32).
        first: ``[B]`` int64.
        index: what ``first`` records.
    """
    below = value < gate
    first.masked_fill_(below, index)
    gate.masked_fill_(below, float("-inf"))


def check_gate(gate: torch.Tensor | None, first: torch.Tensor | None, q: torch.Tensor) -> None:
    """Raise a ValueError unless ``gate`` and ``first`` are both None or :func:`record_below`'s ``[B]`` float32 and
    int64 tensors on ``q``'s device (``B`` from ``q``), each contiguous."""
    if gate is None and first is None:
        return
    B = q.shape[0]
    for name, t, dtype in (("gate", gate, torch.float32), ("first", first, torch.int64)):
        if t is None:
            raise ValueError("gate and first go together: give both (each row's threshold and where it first fell "
                             "below) or neither")
        if tuple(t.shape) != (B,) or t.dtype != dtype or t.device != q.device or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [B] = [{B}] {dtype} tensor on {q.device}, got "
                             f"{list(t.shape)} {t.dtype} on {t.device}")


class ConfidenceStats(NamedTuple):
    """Per-position statistics of ``softmax(logits)`` (see :func:`confidence_stats`); every field has the logits'
    leading shape ``[...]``."""

    token: torch.Tensor  # int64: the proposal (clean argmax at T = 0, Gumbel-max draw at T > 0)
    p_token: torch.Tensor  # float32: softmax(logits)[token] (clean logits)
    p_max: torch.Tensor  # float32: the largest clean probability (== p_token at T = 0)
    p_second: torch.Tensor  # float32: the second-largest clean probability (0 when V == 1)
    entropy: torch.Tensor  # float32: -sum p log p in nats (0 log 0 = 0, so -inf logits are fine)


def confidence_noise(logits: torch.Tensor, temperature: float, noise: torch.Tensor | None) -> torch.Tensor | None:
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError("logits must be [..., V] with V >= 1")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if temperature == 0:
        return None
    if noise is None:
        return torch.rand(logits.shape, dtype=torch.float32, device=logits.device)
    try:
        torch.broadcast_shapes(noise.shape, logits.shape)
    except RuntimeError as exc:
        raise ValueError(f"noise {tuple(noise.shape)} does not broadcast to logits {tuple(logits.shape)}") from exc
    return noise


def confidence_stats(logits: torch.Tensor, temperature: float = 0.0, noise: torch.Tensor | None = None,
                     exclude: int | None = None):
    """Proposal and confidence statistics of each position, in one pass over the vocabulary (Triton twin).

    The probabilities are always those of the *clean* logits, ``p = softmax(logits)`` in float32 (as LLaDA and
    Fast-dLLM score confidence); the temperature only affects the proposal. At ``temperature = 0`` the proposal
    is the argmax (first maximal index). At ``T > 0`` it is the Gumbel-max draw from ``softmax(logits / T)``:
    ``argmax(logits - T * log(-log u))`` computed in float32, which is LLaDA's ``argmax(exp(l) / (-log u) ** T)``
    in log space (LLaDA evaluates it in float64, so near-ties may resolve differently).

    Args:
        logits: ``[..., V]`` float16/bfloat16/float32 (``-inf`` entries allowed; each row needs a finite one).
        temperature: ``T >= 0``.
        noise: uniform ``(0, 1)`` noise broadcastable to ``[..., V]`` (any float dtype, used in float32); when
            ``T > 0`` and ``noise`` is None it is drawn with ``torch.rand`` (the global generator); ignored at
            ``T = 0``.
        exclude: a column never proposed (the mask token) that stays in the probabilities: ``p_token``,
            ``p_max``, ``p_second`` and ``entropy`` are those of the full softmax, ``p_max`` may be the excluded
            column's (:func:`_confidence_stats_excluding`). None (or out of range): no column excluded.

    Returns:
        :class:`ConfidenceStats`: ``token`` ``[...]`` int64, ``p_token``/``p_max``/``p_second``/``entropy``
        ``[...]`` float32. Margin confidence is ``p_max - p_second``.
    """
    if exclude is not None and 0 <= exclude < logits.shape[-1]:
        return _confidence_stats_excluding(logits, temperature, noise, exclude)
    return _confidence_stats(logits, temperature, noise)


def _confidence_stats(logits: torch.Tensor, temperature: float, noise: torch.Tensor | None):
    noise = confidence_noise(logits, temperature, noise)
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    logp = x - lse
    p = logp.exp()
    entropy = -torch.special.xlogy(p, p).sum(-1)
    if x.shape[-1] > 1:
        top2 = torch.topk(x, 2, dim=-1).values
    else:
        top2 = torch.cat([x, torch.full_like(x, float("-inf"))], -1)
    if noise is None:
        token = x.argmax(-1)
    else:
        token = (x - temperature * torch.log(-torch.log(noise.float()))).argmax(-1)
    p_token = logp.gather(-1, token[..., None]).squeeze(-1).exp()
    lse = lse.squeeze(-1)
    return ConfidenceStats(token, p_token, (top2[..., 0] - lse).exp(), (top2[..., 1] - lse).exp(), entropy)


def _confidence_stats_excluding(logits: torch.Tensor, temperature: float, noise: torch.Tensor | None, exclude: int):
    """:func:`confidence_stats` with column ``exclude`` never the proposal but kept in the probabilities (the
    references' full-vocabulary softmax), from one pass with that column at ``-inf`` (in place, restored after)
    and ``[...]``-sized corrections: with ``q`` the statistics without the column and ``k = 1 - p(exclude)``,
    ``p = k q`` for every other token, ``H = k (H_q - log k) - p(exclude) log p(exclude)``, and the two largest
    probabilities are taken among ``k q_max``, ``k q_second`` and ``p(exclude)``."""
    with mask_column_excluded(logits, exclude):
        q = _confidence_stats(logits, temperature, noise)
    l_mask = logits[..., exclude].float()
    lse_q = logits.gather(-1, q.token[..., None]).squeeze(-1).float() - torch.log(q.p_token)
    lse = torch.logaddexp(lse_q, l_mask)
    keep, p_mask = torch.exp(lse_q - lse), torch.exp(l_mask - lse)
    p1, p2 = q.p_max * keep, q.p_second * keep
    top1, top2 = torch.maximum(p1, p_mask), torch.maximum(torch.minimum(p1, p_mask), p2)
    entropy = keep * (q.entropy - torch.log(keep)) - torch.special.xlogy(p_mask, p_mask)
    return ConfidenceStats(q.token, q.p_token * keep, top1, top2, entropy)
