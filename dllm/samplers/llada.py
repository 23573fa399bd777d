"""LLaDA's reference sampler: Gumbel-max proposals, low-confidence or random remasking, even quota.

Per region (block) with ``S`` steps and ``n`` masked positions at its start, step ``i`` commits
``n // S + (i < n % S)`` tokens: the most confident candidates (``low_confidence``: softmax probability of
the proposal) or uniformly random ones (``random``).

At temperature 0 with ``low_confidence`` remasking and a float32 confidence softmax, the proposal and its
probability can come from :func:`dllm.kernels.confidence_stats` (one pass over the vocabulary, no softmax
tensor; see ``fused``). By default that happens only where the kernel dispatcher runs the Triton kernel (CUDA);
the CPU / reference backend keeps the plain PyTorch path, bit-identical to LLaDA's ``generate.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.samplers.base import (
    NOISE_SCOPES,
    SOFTMAX_DTYPES,
    SamplerBase,
    StepContext,
    StepResult,
    canvas_rand,
    check_choice,
    check_temperature,
    even_quota,
    fused_enabled,
    gumbel_argmax,
    select_topk,
    token_prob,
)
from dllm.samplers.composed import FUSED_CHOICES
from dllm.samplers.scores import unmasked_confidence_stats

REMASKING = ("low_confidence", "random")
__all__ = ["REMASKING", "SOFTMAX_DTYPES", "LLaDASampler", "even_quota"]


@dataclass(frozen=True)
class LLaDASampler(SamplerBase):
    """LLaDA ``generate.py`` as a sampler.

    Args:
        temperature: Gumbel-max temperature (0: argmax).
        remasking: ``"low_confidence"`` or ``"random"``.
        logits_eos_inf: EOS logit set to -inf before the proposal.
        confidence_eos_eot_inf: EOS and EOT excluded from the confidence softmax (a position proposing
            either gets confidence 0). ``eos_eot_quirk=True`` reproduces the reference, which at
            temperature > 0 only excludes EOT.
        softmax_dtype: dtype of the confidence softmax: ``"float32"`` (default), ``"float64"`` (Fast-dLLM
            and older LLaDA) or ``"model"`` (current LLaDA: the logits' own dtype).
        noise_scope: ``"row"`` (default) draws per-row counter-based noise, the same for a row in any batch;
            ``"region"`` draws from the run's generator for the window only; ``"canvas"`` draws it for every
            canvas position as the reference does (same distribution, the reference's random stream, which
            depends on the batch).
        fused: ``"auto"`` (default), ``"on"`` or ``"off"``: take the greedy proposal and its probability from
            :func:`dllm.kernels.confidence_stats` (token = argmax, score = ``p_token``, computed in float32 from
            the logits) through the kernel dispatcher. Only possible at ``temperature = 0`` with
            ``low_confidence`` remasking, a float32 softmax (``softmax_dtype="float32"``, or ``"model"`` with
            float32 logits) and no EOS/EOT exclusion (``confidence_eos_eot_inf`` needs the proposal of the
            unexcluded logits); otherwise the plain path runs whatever ``fused`` says. ``"auto"`` uses it where
            :func:`dllm.kernels.uses_triton` is true (Triton backend on CUDA); elsewhere the bit-exact PyTorch
            path runs. ``"on"`` forces the dispatcher (on CPU, the kernel's PyTorch twin: the same tokens up to
            float rounding of the scores).
    """

    temperature: float = 0.0
    remasking: str = "low_confidence"
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    eos_eot_quirk: bool = False
    softmax_dtype: str = "float32"
    noise_scope: str = "row"
    fused: str = "auto"
    name: str = "llada"

    def __post_init__(self):
        check_temperature("temperature", self.temperature)
        check_choice("remasking", self.remasking, REMASKING)
        check_choice("softmax_dtype", self.softmax_dtype, SOFTMAX_DTYPES)
        check_choice("noise_scope", self.noise_scope, NOISE_SCOPES)
        check_choice("fused", self.fused, FUSED_CHOICES)

    def step(self, logits: torch.Tensor, ctx: StepContext) -> StepResult:
        """``logits``: ``[B, W, V]`` float (the whole vocabulary); returns ``[B, W]`` int64 proposals and a
        ``[B, W]`` bool commit mask."""
        if self.logits_eos_inf and ctx.eos_id is not None:
            logits = logits.clone()
            logits[..., ctx.eos_id] = float("-inf")
        if self._fused(logits, ctx):
            stats = unmasked_confidence_stats(logits, ctx.mask_id)  # one pass: argmax and its probability
            x0, conf = stats.token, stats.p_token
        else:
            x0 = gumbel_argmax(logits, self.temperature, ctx, self.noise_scope)
            if self.remasking == "low_confidence":
                conf = self._confidence(logits, x0, ctx)
            else:
                B, W = x0.shape
                conf = canvas_rand((), ctx, W, B, torch.float32, x0.device, self.noise_scope)
        commit = select_topk(conf, ctx.cand, even_quota(ctx))
        return StepResult(torch.where(ctx.cand, x0, ctx.x), commit)

    def graph_safe(self) -> bool:
        """Stateless; its noise is each row's counter-based stream (``noise_scope="row"``) or none at all (greedy
        low-confidence decoding)."""
        return self.noise_scope == "row" or (self.temperature == 0 and self.remasking == "low_confidence")

    def row_windows(self) -> bool:
        """Its even quota and top-k are per row; its noise each row's counter-based stream of generation columns or
        none (:meth:`graph_safe`'s condition)."""
        return self.graph_safe()

    def _fused(self, logits: torch.Tensor, ctx: StepContext) -> bool:
        """Whether this step's proposal and score come from :func:`dllm.kernels.confidence_stats`."""
        eligible = (self.temperature == 0 and self.remasking == "low_confidence"
                    and (SOFTMAX_DTYPES[self.softmax_dtype] or logits.dtype) == torch.float32
                    and not (self.confidence_eos_eot_inf and (ctx.eos_id is not None or ctx.eot_id is not None)))
        return fused_enabled(self.fused, logits, eligible)

    def _confidence(self, logits, x0, ctx: StepContext) -> torch.Tensor:
        if self.confidence_eos_eot_inf:
            excluded = [ctx.eot_id] if (self.eos_eot_quirk and self.temperature > 0) else [ctx.eos_id, ctx.eot_id]
            excluded = [i for i in excluded if i is not None]
            if excluded:
                logits = logits.clone()
                logits[..., excluded] = float("-inf")
        return token_prob(logits, x0, self.softmax_dtype)
