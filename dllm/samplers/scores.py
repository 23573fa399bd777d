"""Confidence scores: how sure the model is of each position's proposal, on a common ``[0, 1]`` scale.

Every score lies in ``[0, 1]`` so that thresholds (``tau``) and multiplicative modifiers (EOS early rejection)
mean the same thing whichever score is chosen; the order of positions is that of the reference scores.

* ``prob``: ``softmax(logits)[x0]``, the probability of the proposal (LLaDA ``low_confidence``, Fast-dLLM).
* ``margin``: top-1 minus top-2 probability (Dream ``topk_margin``, ParallelBench ``topk_margin``).
* ``neg_entropy``: ``exp(sum p log p) = exp(-H)``; the same order as Dream's ``entropy`` score
  ``sum p log(p + 1e-10)`` (ParallelBench ``entropy``), mapped into ``(0, 1]``.
* ``random``: uniform noise (LLaDA ``random`` remasking).
"""

from __future__ import annotations

import torch

from dllm import kernels
from dllm.samplers.base import (
    SOFTMAX_DTYPES,
    StepContext,
    canvas_rand,
    token_prob,
    top2_values,
)

CONFIDENCES = ("prob", "margin", "neg_entropy", "random")


def probabilities(logits: torch.Tensor, softmax_dtype: str = "float32") -> torch.Tensor:
    """``softmax(logits)`` in ``softmax_dtype`` (a key of :data:`SOFTMAX_DTYPES`)."""
    return torch.softmax(logits.to(SOFTMAX_DTYPES[softmax_dtype] or logits.dtype), dim=-1)


def confidence_score(logits: torch.Tensor, x0: torch.Tensor, kind: str, ctx: StepContext,
                     softmax_dtype: str = "float32", noise_scope: str = "region",
                     probs: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, W]`` score in ``[0, 1]`` for ``[B, W, V]`` logits and ``[B, W]`` proposals ``x0``
    (``probs``: :func:`probabilities` of the logits when already computed)."""
    if kind == "random":
        B, W = x0.shape
        return canvas_rand((), ctx, W, B, torch.float32, x0.device, noise_scope)
    if kind not in CONFIDENCES:
        raise ValueError(f"unknown confidence {kind!r}; known: {', '.join(CONFIDENCES)}")
    if kind == "prob" and probs is None:
        return token_prob(logits, x0, softmax_dtype)
    p = probabilities(logits, softmax_dtype) if probs is None else probs
    if kind == "prob":
        return p.gather(-1, x0[..., None]).squeeze(-1)
    if kind == "margin":
        top2 = top2_values(p) if p.shape[-1] > 1 else torch.cat([p, torch.zeros_like(p)], -1)
        return top2[..., 0] - top2[..., 1]
    return torch.exp((p * torch.log(p + 1e-10)).sum(-1))


def unmasked_confidence_stats(logits: torch.Tensor, mask_id: int | None) -> kernels.ConfidenceStats:
    """:func:`dllm.kernels.confidence_stats` at temperature 0 with ``mask_id`` never the proposal but kept in the
    probabilities (the references' full-vocabulary softmax): ``exclude=mask_id``, one kernel pass on the Triton
    path, the reference's corrections elsewhere (:func:`dllm.kernels.reference.confidence_stats`)."""
    return kernels.confidence_stats(logits, exclude=mask_id)


def fused_proposal(logits: torch.Tensor, kind: str, mask_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy proposal ``x0`` (never ``mask_id``) and its ``[0, 1]`` score from one
    :func:`dllm.kernels.confidence_stats` pass over the vocabulary through the kernel dispatcher
    (:func:`unmasked_confidence_stats`; ``kind`` is ``prob``, ``margin`` or ``neg_entropy``)."""
    stats = unmasked_confidence_stats(logits, mask_id)
    if kind == "prob":
        conf = stats.p_token
    elif kind == "margin":
        conf = stats.p_max - stats.p_second
    elif kind == "neg_entropy":
        conf = torch.exp(-stats.entropy)
    else:
        raise ValueError(f"confidence {kind!r} has no fused form; fused scores: prob, margin, neg_entropy")
    return stats.token, conf
