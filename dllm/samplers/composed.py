"""One sampler built from stages: logits transform -> proposal + confidence -> confidence modifier -> rule.

Per step, on the window's ``[B, W, V]`` logits (the whole vocabulary; the mask id is never proposed):

1. ``credit`` (optional, :class:`~dllm.samplers.transforms.CreditFusion`): fused logits
   ``l + alpha * log(1 + C)``; proposal and confidence come from them (at temperature 0 with the ``prob``
   score the fused logits are never materialised: only the credited entries differ from the raw ones);
2. proposal ``x0``: argmax at ``temperature = 0``, else LLaDA's float64 Gumbel-max
   ``argmax(exp(l) / (-log u) ** T)`` (a draw from ``softmax(l / T)``);
3. confidence (``prob`` | ``margin`` | ``neg_entropy`` | ``random``, see :mod:`dllm.samplers.scores`) from the
   clean logits, not the noised ones (as LLaDA and Fast-dLLM do);
4. ``eos_rejection`` (optional, :class:`~dllm.samplers.transforms.EOSRejection`): EOS confidence attenuation;
5. ``rule`` (:mod:`dllm.samplers.rules`): which candidates to commit (at least one per row with candidates).

A sampler decides what to commit inside a region; the region layout (block length or block policy) and the
cache are the other two axes of a decoding recipe (:mod:`dllm.recipes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dllm.samplers.base import (
    NOISE_SCOPES,
    SOFTMAX_DTYPES,
    SamplerBase,
    StepContext,
    StepResult,
    check_choice,
    check_range,
    ensure_progress,
    fused_enabled,
    gumbel_argmax,
)
from dllm.samplers.rules import CommitRule, Threshold
from dllm.samplers.scores import CONFIDENCES, confidence_score, fused_proposal, probabilities
from dllm.samplers.transforms import CreditFusion, EOSRejection

FUSED_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class ComposedSampler(SamplerBase):
    """A commit rule plus optional stages (see the module docstring).

    Args:
        rule: a commit rule (default ``Threshold(0.9)``).
        temperature: Gumbel-max temperature (0: argmax).
        confidence: ``"prob"``, ``"margin"``, ``"neg_entropy"`` or ``"random"``.
        softmax_dtype: ``"float32"`` (default), ``"float64"`` (Fast-dLLM, LocalLeap, AdaBlock) or ``"model"``.
        noise_scope: ``"row"`` (per-row counter-based noise: a row's draws do not depend on its batch),
            ``"region"`` (the run's generator, over the window) or ``"canvas"`` (the run's generator over the
            whole canvas: the references' random stream; batch-dependent, as theirs is).
        credit: CreditDecoding stage or ``None``.
        eos_rejection: EOS early rejection stage or ``None``.
        fused: ``"auto"`` (default), ``"on"`` or ``"off"``: compute the greedy proposal and its score with
            :func:`dllm.kernels.confidence_stats` (one pass over the vocabulary, no softmax tensor) through the
            kernel dispatcher. ``"auto"`` uses it where the dispatcher runs the Triton kernel (CUDA) and the
            stage allows it (temperature 0, float32 softmax, a ``prob``/``margin``/``neg_entropy`` score, a
            rule that does not read the probabilities); elsewhere the plain PyTorch path runs, whose
            ``prob`` scores are bit-identical to LLaDA's reference. ``"on"`` forces the dispatcher wherever the
            stage allows it (on CPU that is the kernel's PyTorch twin, equal up to float rounding).
    """

    rule: CommitRule = field(default_factory=Threshold)
    temperature: float = 0.0
    confidence: str = "prob"
    softmax_dtype: str = "float32"
    noise_scope: str = "row"
    credit: CreditFusion | None = None
    eos_rejection: EOSRejection | None = None
    fused: str = "auto"
    name: str = "composed"

    def __post_init__(self):
        check_range("temperature", self.temperature, 0, float("inf"), hi_open=True, fix="; use 0 for greedy decoding")
        check_choice("confidence", self.confidence, CONFIDENCES)
        check_choice("softmax_dtype", self.softmax_dtype, SOFTMAX_DTYPES)
        check_choice("noise_scope", self.noise_scope, NOISE_SCOPES)
        check_choice("fused", self.fused, FUSED_CHOICES)
        if not hasattr(self.rule, "select"):
            raise TypeError(f"rule must be a commit rule with select(conf, ctx, logits=...), got {self.rule!r}")

    def step(self, logits: torch.Tensor, ctx: StepContext) -> StepResult:
        info: dict[str, Any] = {}
        probs = None
        raw_top = None
        if self.credit is not None and self._sparse_credit():
            x0, conf, raw_top = self.credit.propose(logits, ctx, self.softmax_dtype)
        elif self.credit is None and self._fused(logits):
            x0, conf = fused_proposal(logits, self.confidence, ctx.mask_id)
        else:
            if self.credit is not None:
                logits, raw_top = self.credit.apply(logits, ctx)
            x0 = gumbel_argmax(logits, self.temperature, ctx, self.noise_scope)
            if self.confidence != "random" and (self.confidence != "prob" or self._rule_wants_probs()):
                probs = probabilities(logits, self.softmax_dtype)  # shared by the score and the rule (KLASS)
            conf = confidence_score(logits, x0, self.confidence, ctx, self.softmax_dtype, self.noise_scope, probs)
        if raw_top is not None:
            info["credit_flips"] = (ctx.cand & (x0 != raw_top)).sum(-1)
        if self.eos_rejection is not None:
            conf, g = self.eos_rejection.apply(conf, x0, ctx)
            info["eos_factor"] = g
        commit, rinfo = self.rule.select(conf, ctx, logits=logits, probs=probs)
        info.update(rinfo)
        if not getattr(self.rule, "ensures_progress", False):  # else the rule's commit is already that
            commit = ensure_progress(commit & ctx.cand, conf, ctx.cand, only_empty=True)
        return StepResult(torch.where(ctx.cand, x0, ctx.x), commit, info)

    def move_rows(self, state: dict, d: int, keep: torch.Tensor | None, n_new: int, **joining) -> None:
        """Move the per-row state of its stages (:meth:`~dllm.samplers.base.SamplerBase.move_rows`): the credit
        tables (:meth:`CreditFusion.move_rows`) and the rule's own (KLASS's kept steps,
        :meth:`~dllm.samplers.rules.KLStable.move_rows`); joining rows start with none, so ``joining`` (their
        canvas) is not read."""
        for stage in (self.credit, self.rule):
            move = getattr(stage, "move_rows", None)
            if move is not None:
                move(state, d, keep, n_new)

    def graph_safe(self) -> bool:
        """With a rule that declares itself ``graph_safe``; its noise is each row's counter-based stream or none
        (greedy, a score that draws none). CreditDecoding's tables, kept across steps in the scratch state as tensors
        of fixed shapes and updated there, are read and written in the step graphs' bank (``generate._StepBank``)."""
        noise_free = self.temperature == 0 and self.confidence != "random"
        return bool(getattr(self.rule, "graph_safe", False)) and (self.noise_scope == "row" or noise_free)

    def row_windows(self) -> bool:
        """With a rule that declares ``row_windows`` (the stateless rules: each reads its row's window relative to
        itself) and :meth:`graph_safe`'s noise; CreditDecoding's canvas-indexed tables are read and written at each
        row's columns."""
        return bool(getattr(self.rule, "row_windows", False)) and self.graph_safe()

    def _rule_wants_probs(self) -> bool:
        return bool(getattr(self.rule, "needs_probs", False))

    def _fused(self, logits: torch.Tensor) -> bool:
        """Whether this step's proposal and score come from :func:`dllm.kernels.confidence_stats`."""
        eligible = (self.temperature == 0 and self.confidence != "random" and self.softmax_dtype == "float32"
                    and not self._rule_wants_probs())
        return fused_enabled(self.fused, logits, eligible)

    def _sparse_credit(self) -> bool:
        """Greedy proposals with the ``prob`` score need only the credited entries of the fused logits."""
        return self.temperature == 0 and self.confidence == "prob" and not self._rule_wants_probs()
