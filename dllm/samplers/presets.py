"""Named sampler configurations (the papers' settings) built from the composable pieces.

Each factory takes flat keyword parameters (what ``dllm samplers`` lists and ``--param k=v`` sets) and
returns a :class:`~dllm.recipes.Recipe`: the sampler (a :class:`~dllm.samplers.composed.ComposedSampler`, a
:class:`~dllm.samplers.prophet.Prophet` wrapper, ...), the block layout and the cache of the published setting,
which ``generate`` uses where the caller chooses none (:func:`dllm.recipes.resolve`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from dllm import ops
from dllm.blocks import AdaBlock, MultiBlock, SlidingWindow
from dllm.blocks.multiblock import block_states
from dllm.caches import check_cache_name, get_cache
from dllm.samplers.base import StepContext, StepResult, check_choice
from dllm.samplers.composed import ComposedSampler
from dllm.samplers.guided import guided
from dllm.samplers.recipe import Recipe
from dllm.samplers.rules import (
    Ascending,
    EntropyBound,
    EntropyThreshold,
    Factor,
    KLStable,
    LocalLeap,
    Quota,
    Threshold,
    d3llm_entropy,
)
from dllm.samplers.transforms import CreditFusion, EOSRejection


def _common(temperature, confidence, softmax_dtype, name, fused="auto", noise_scope="row"):
    return {"temperature": temperature, "confidence": confidence, "softmax_dtype": softmax_dtype,
            "name": name, "fused": fused, "noise_scope": noise_scope}


def threshold_sampler(tau: float = 0.9, temperature: float = 0.0, confidence: str = "prob",
                      softmax_dtype: str = "float32", noise_scope: str = "row", max_slack: float = 0.0, block_length: int | None = None,
                      fused: str = "auto", name: str = "threshold") -> ComposedSampler:
    """Fast-dLLM threshold rule: commit every candidate with ``conf >= tau`` plus the best one."""
    return Recipe(ComposedSampler(Threshold(tau, max_slack),
                                  **_common(temperature, confidence, softmax_dtype, name, fused, noise_scope)),
                  block_length=block_length, name=name)


def eb(gamma: float = 0.01, temperature: float = 0.0, noise_scope: str = "row", block_length: int | None = None,
       name: str = "eb") -> ComposedSampler:
    """EB-Sampler: the lowest-entropy candidates while their summed entropy, less the largest, stays within
    ``gamma`` (the reference decodes the whole generation as one region: ``block_length`` None)."""
    return Recipe(ComposedSampler(EntropyBound(gamma), **_common(temperature, "neg_entropy", "float32", name,
                                                                 "off", noise_scope)),
                  block_length=block_length, name=name)


def entropy_threshold(threshold: float = 0.5, temperature: float = 0.0, noise_scope: str = "row",
                      block_length: int | None = None, name: str = "entropy-threshold") -> ComposedSampler:
    """d3LLM's entropy threshold: every candidate with entropy <= ``threshold`` plus the lowest-entropy one."""
    return Recipe(ComposedSampler(EntropyThreshold(threshold), **_common(temperature, "neg_entropy", "float32",
                                                                         name, "off", noise_scope)),
                  block_length=block_length, name=name)


@dataclass(frozen=True)
class MultiBlockSampler(ComposedSampler):
    """d3LLM's multi-block step (``generate_multi_block``): the entropy threshold over every candidate of the
    region (all added blocks), and progress for the first fully activated block that holds masks: when the rule
    commits nothing there, its lowest-entropy masked position is committed with the plain argmax token (the
    reference's re-sample, without noise). The block layout comes from :class:`dllm.blocks.MultiBlock` with the
    same ``block_length`` and thresholds (the ``multiblock`` preset builds both)."""

    block_length: int = 32
    add_threshold: float = 0.5
    activate_threshold: float = 0.5

    def step(self, logits: torch.Tensor, ctx) -> StepResult:
        res = super().step(logits, ctx)
        W = logits.shape[1]
        if ctx.canvas is not None:  # the blocks from the whole canvas (the region starts at the generation)
            masked, start, off = ctx.canvas == ctx.mask_id, ctx.region_lo, ctx.win_lo
        else:  # a window alone: its columns, the region start inside it (win_lo: an int, or per row [B, 1])
            lo = ctx.win_lo[:, 0] if torch.is_tensor(ctx.win_lo) else ctx.win_lo
            masked, start, off = ctx.x == ctx.mask_id, (ctx.region_lo - lo).clamp_min(0), 0
        block_of, _, activated, masks = block_states(masked, start, self.block_length, self.add_threshold,
                                                     self.activate_threshold)
        nb = masks.shape[1]
        first = torch.where(activated & (masks > 0), torch.arange(nb, device=masks.device)[None], nb).min(-1).values
        if torch.is_tensor(off):  # each row's window columns of the canvas's blocks
            win_blocks = block_of.gather(1, off + ops.cached_arange(W, logits.device)[None])
        else:
            win_blocks = block_of[:, off:off + W]
        in_first = (win_blocks == first[:, None]) & ctx.cand
        need = in_first.any(-1) & ~(res.commit & in_first).any(-1)
        ent = d3llm_entropy(logits).masked_fill(~in_first, math.inf)
        # the lowest-entropy column as a mask (one_hot would check its indices on the host, on the CPU)
        force = (ops.cached_arange(W, logits.device)[None] == ent.argmin(-1)[:, None]) & need[:, None]
        proposal = torch.where(force, logits.argmax(-1), res.proposal)
        return StepResult(proposal, res.commit | force, res.info)


def multiblock(threshold: float = 0.5, block_length: int = 32, add_threshold: float = 0.5,
               activate_threshold: float = 0.5, temperature: float = 0.0, noise_scope: str = "row",
               name: str = "multiblock") -> ComposedSampler:
    """d3LLM's multi-block decoding: the entropy threshold over several blocks at once, a block added when the
    last one is ``add_threshold`` decoded and fully activated when the one before it is ``activate_threshold``
    decoded (:class:`dllm.blocks.MultiBlock`)."""
    sampler = MultiBlockSampler(EntropyThreshold(threshold), block_length=block_length, add_threshold=add_threshold,
                                activate_threshold=activate_threshold,
                                **_common(temperature, "neg_entropy", "float32", name, "off", noise_scope))
    return MultiBlockRecipe(sampler, block_policy=MultiBlock(block_length, add_threshold, activate_threshold),
                            name=name)


@dataclass(frozen=True)
class MultiBlockRecipe(Recipe):
    """The ``multiblock`` recipe: a ``block_length`` from the caller sets the block size of both its policy and its
    sampler (the preset's own, 32, otherwise)."""

    def for_config(self, config) -> Recipe:
        bl = config.block_length
        if not bl or bl == self.block_policy.block_length:
            return self
        return replace(self, sampler=replace(self.sampler, block_length=bl),
                       block_policy=replace(self.block_policy, block_length=bl))


def _cache(cache):
    """A recipe's ``cache`` parameter: a registered cache name (checked now, not at the first generate) or
    None / "none" / "" for no cache of its own."""
    if cache in (None, "none", ""):
        return None
    check_cache_name(cache)
    return cache


def _cache_spec(name: str, **params) -> tuple:
    """``(name, params)`` of a cache the recipe builds at each generate, built once now as well: its constructor
    checks the values when the sampler is made (``get_sampler`` refuses them, not the first forward)."""
    get_cache(name, **params)
    return name, tuple(params.items())


def fast_dllm(tau: float = 0.9, temperature: float = 0.0, confidence: str = "prob",
              softmax_dtype: str = "float32", noise_scope: str = "row", block_length: int | None = 32, cache: str | None = "dual",
              name: str = "fast-dllm") -> ComposedSampler:
    """Fast-dLLM parallel decoding: threshold 0.9, block 32, dual cache (when the caller passes none)."""
    return Recipe(ComposedSampler(Threshold(tau), **_common(temperature, confidence, softmax_dtype, name, noise_scope=noise_scope)),
                  block_length=block_length, cache=_cache(cache), name=name)


def elastic(tau: float = 0.9, window: int | None = None, gamma: float = 0.9, track_num: int = 1,
            temperature: float = 0.0, confidence: str = "prob", softmax_dtype: str = "float32", noise_scope: str = "row",
            name: str = "elastic") -> ComposedSampler:
    """Elastic-Cache: threshold 0.9 over a window sliding over the first ``window`` remaining masks
    (:class:`~dllm.blocks.SlidingWindow`; None: 16 on LLaDA, 32 on Dream, the reference's), elastic cache (gamma
    0.9, one tracked token per layer)."""
    return Recipe(ComposedSampler(Threshold(tau), **_common(temperature, confidence, softmax_dtype, name, noise_scope=noise_scope)),
                  block_policy=SlidingWindow(window), cache=_cache_spec("elastic", gamma=gamma, track_num=track_num),
                  name=name)


def dkv(refresh_every: int = 8, temperature: float = 0.0, confidence: str = "prob", softmax_dtype: str = "float32", noise_scope: str = "row",
        block_length: int | None = None, name: str = "dkv") -> ComposedSampler:
    """dKV-Cache-Decode over LLaDA's low-confidence even quota (cache_reloading_step 8). The softmax is float32
    like every preset's; ``softmax_dtype="float64"`` is the reference's (older LLaDA code), at about 10x the
    per-step sampler cost at a 126k vocabulary on CPU."""
    return Recipe(ComposedSampler(Quota(), **_common(temperature, confidence, softmax_dtype, name, noise_scope=noise_scope)),
                  block_length=block_length, cache=_cache_spec("dkv-decode", refresh_every=refresh_every), name=name)


def factor_sampler(factor: float = 1.0, quirk: bool = False, temperature: float = 0.0, confidence: str = "prob",
                   softmax_dtype: str = "float32", noise_scope: str = "row", block_length: int | None = None, fused: str = "auto",
                   name: str = "factor") -> ComposedSampler:
    """Fast-dLLM factor rule: longest sorted prefix with ``c_n >= 1 - factor / (n + 1)``."""
    return Recipe(ComposedSampler(Factor(factor, quirk), **_common(temperature, confidence, softmax_dtype, name, fused, noise_scope)),
                  block_length=block_length, name=name)


def localleap(kappa: float = 0.9, tau: float | None = 0.75, radius: int = 4, temperature: float = 0.0,
              confidence: str = "prob", softmax_dtype: str = "float32", noise_scope: str = "row", block_length: int | None = 32,
              name: str = "localleap") -> ComposedSampler:
    """LocalLeap: anchors ``conf >= kappa``, relaxed ``tau`` within ``radius`` of an anchor; block 32."""
    return Recipe(ComposedSampler(LocalLeap(kappa, tau, radius), **_common(temperature, confidence, softmax_dtype, name, noise_scope=noise_scope)),
                  block_length=block_length, name=name)


def credit(alpha: float = 0.7, beta: float = 0.8, gamma: float = 0.2, tau: float = 0.9, slots: int = 8,
           temperature: float = 0.0, confidence: str = "prob", softmax_dtype: str = "float32", noise_scope: str = "row",
           block_length: int | None = 32, name: str = "credit") -> ComposedSampler:
    """CreditDecoding (dInfer): trace credits fused into the logits, then the threshold rule; block 32."""
    return Recipe(ComposedSampler(Threshold(tau), credit=CreditFusion(alpha, beta, gamma, slots),
                                  **_common(temperature, confidence, softmax_dtype, name, noise_scope=noise_scope)),
                  block_length=block_length, name=name)


def credit_localleap(alpha: float = 0.7, beta: float = 0.8, gamma: float = 0.2, slots: int = 8, kappa: float = 0.9,
                     tau: float | None = 0.75, radius: int = 4, temperature: float = 0.0, confidence: str = "prob",
                     softmax_dtype: str = "float32", noise_scope: str = "row", block_length: int | None = 32,
                     name: str = "credit-localleap") -> ComposedSampler:
    """CreditDecoding's fused logits with the LocalLeap rule (a composition, not a paper preset)."""
    return Recipe(ComposedSampler(LocalLeap(kappa, tau, radius), credit=CreditFusion(alpha, beta, gamma, slots),
                                  **_common(temperature, confidence, softmax_dtype, name, noise_scope=noise_scope)),
                  block_length=block_length, name=name)


def adablock(tau: float = 0.9, block_length: int | None = None, delimiter_threshold: float | None = None,
             delimiters="newline", window: float = 0.25, temperature: float = 0.0, confidence: str = "prob",
             softmax_dtype: str = "float32", noise_scope: str = "row", name: str = "adablock") -> ComposedSampler:
    """AdaBlock-dLLM: delimiter-aligned blocks (fallback ``block_length``, default 32) with threshold 0.9."""
    policy = AdaBlock(block_length, delimiter_threshold, delimiters, window)
    return Recipe(ComposedSampler(Threshold(tau), **_common(temperature, confidence, softmax_dtype, name, noise_scope=noise_scope)),
                  block_policy=policy, name=name)


def eoser(gamma_min: float = 0.4, progress: str = "step", temperature: float = 0.0, confidence: str = "prob",
          softmax_dtype: str = "float32", noise_scope: str = "row", block_length: int | None = None, name: str = "eoser") -> ComposedSampler:
    """EOS early rejection over LLaDA's even quota (full diffusion: one block)."""
    return Recipe(ComposedSampler(Quota(), eos_rejection=EOSRejection(gamma_min, progress),
                                  **_common(temperature, confidence, softmax_dtype, name, noise_scope=noise_scope)),
                  block_length=block_length, name=name)


def ascending(steps: int | None = None, per_region: bool = False, temperature: float = 0.0, confidence: str = "prob",
              softmax_dtype: str = "float32", noise_scope: str = "row", block_length: int | None = None, name: str = "ascending") -> ComposedSampler:
    """Ascending step size: ``2**i`` tokens at step ``i`` (one block of 256: 8 steps)."""
    return Recipe(ComposedSampler(Ascending(steps, per_region), **_common(temperature, confidence, softmax_dtype, name, noise_scope=noise_scope)),
                  block_length=block_length, name=name)


def eoser_ass(gamma_min: float = 0.01, steps: int | None = None, per_region: bool = False, temperature: float = 0.0,
              confidence: str = "prob", softmax_dtype: str = "float32", noise_scope: str = "row", block_length: int | None = None,
              name: str = "eoser-ass") -> ComposedSampler:
    """EOSER + ASS (paper configuration: one block, ``gamma_min = 0.01``, EOSER progress of the ascending schedule)."""
    return Recipe(ComposedSampler(Ascending(steps, per_region), eos_rejection=EOSRejection(gamma_min, "ass"),
                                  **_common(temperature, confidence, softmax_dtype, name, noise_scope=noise_scope)),
                  block_length=block_length, name=name)


@dataclass(frozen=True)
class KLASSSampler(ComposedSampler):
    """``ComposedSampler(KLStable(...))`` (the ``klass`` preset) with a faster CPU path for its greedy case.

    At temperature 0 with the ``prob`` score, no credit fusion or EOS rejection, on CPU, the proposal, the
    softmax and (where a chunk holds a confident candidate) the KL run together per cache-sized chunk of
    window rows (:meth:`KLStable.fused_step`) instead of separate passes over the whole ``[B, W, V]`` window:
    the same tokens, confidences, commits and KL values, bit for bit (tested); every other case is
    :meth:`ComposedSampler.step`."""

    style: str = "llada"

    def styled(self, style: str) -> KLASSSampler:
        """This sampler with the rule of a reference style."""
        dream = style == "dream"
        rule = replace(self.rule, inclusive=dream, fallback=None if dream else Quota())
        return replace(self, rule=rule, style=style)

    def bind_model(self, model) -> KLASSSampler:
        """Resolve ``style="auto"`` from the model family (Dream-format: ``"dream"``, else ``"llada"``)."""
        if self.style != "auto":
            return self
        family = getattr(getattr(model, "spec", None), "family", "llada")
        return self.styled("dream" if family == "dream" else "llada")

    def _chunked(self, logits: torch.Tensor, ctx: StepContext) -> bool:
        rule = self.rule
        return (isinstance(rule, KLStable) and not ops.dense_window(logits) and not rule.rows_own(ctx)
                and self.temperature == 0
                and self.confidence == "prob" and self.credit is None and self.eos_rejection is None
                and not getattr(rule.fallback, "needs_probs", False))

    def step(self, logits: torch.Tensor, ctx: StepContext) -> StepResult:
        if not self._chunked(logits, ctx):
            return super().step(logits, ctx)
        x0, conf, stable = self.rule.fused_step(logits, ctx, self.softmax_dtype)
        # decide's commit is within the candidates and has progressed already (ComposedSampler.step's
        # ensure_progress(commit & cand, ...) would return it unchanged: two fewer small passes)
        commit, info = self.rule.decide(conf, ctx, stable, logits=logits)
        return StepResult(torch.where(ctx.cand, x0, ctx.x), commit, info)


KLASS_STYLES = ("auto", "llada", "dream")


def klass(conf_threshold: float = 0.6, kl_threshold: float = 0.015, history: int = 2, style: str = "auto",
          temperature: float = 0.0, confidence: str = "prob", softmax_dtype: str = "float32", noise_scope: str = "row",
          block_length: int | str | None = "auto", name: str = "klass") -> ComposedSampler:
    """KLASS: KL-stable and confident tokens, else a fallback. ``style`` follows the reference of the model
    family (``"auto"``: chosen when the sampler is bound to the model): ``"llada"`` is KLASS's LLaDA script
    (``conf > conf_threshold``, else the even quota; block 64), ``"dream"`` its Dream code
    (``conf >= conf_threshold``, else the most confident candidate alone; the whole canvas as one region).
    ``block_length="auto"`` takes the style's."""
    check_choice("style", style, KLASS_STYLES)
    sampler = KLASSSampler(KLStable(conf_threshold, kl_threshold, history),
                           **_common(temperature, confidence, softmax_dtype, name, noise_scope=noise_scope), style="auto")
    if style != "auto":
        sampler = sampler.styled(style)
    return KLASSRecipe(sampler, block_length=_klass_block(style) if block_length == "auto" else block_length,
                       name=name, auto_block=block_length == "auto")


def _klass_block(style: str) -> int | None:
    """The reference's layout: block 64 in the LLaDA script, the whole canvas in the Dream code."""
    return None if style == "dream" else 64


@dataclass(frozen=True)
class KLASSRecipe(Recipe):
    """The ``klass`` recipe: with ``auto_block`` its block length follows the style the sampler takes when it is
    bound to the model (LLaDA: 64, Dream: the whole canvas)."""

    auto_block: bool = False

    def bind_model(self, model) -> Recipe:
        bound = super().bind_model(model)
        if self.auto_block:
            bound = replace(bound, block_length=_klass_block(bound.sampler.style))
        return bound


#: name -> (factory, description); registered by :mod:`dllm.samplers`.
PRESETS = {
    "threshold": (threshold_sampler, "Fast-dLLM threshold rule: conf >= tau plus the best candidate (tau 0.9)"),
    "entropy-threshold": (entropy_threshold, "d3LLM: every token with entropy <= threshold (0.5) plus the lowest-entropy one"),
    "multiblock": (multiblock, "d3LLM multi-block: entropy threshold 0.5 over blocks of 32 added at 50 % of the last "
                               "one, fully activated at 50 % of the previous"),
    "eb": (eb, "EB-Sampler: lowest-entropy tokens while their summed entropy minus the largest is <= gamma (0.01)"),
    "factor": (factor_sampler, "Fast-dLLM factor rule: longest prefix with c_n >= 1 - f/(n+1) (f 1.0)"),
    "fast-dllm": (fast_dllm, "Fast-dLLM parallel decoding: threshold 0.9, block 32, dual cache"),
    "elastic": (elastic, "Elastic-Cache: threshold 0.9, window 16, elastic cache gamma 0.9"),
    "dkv": (dkv, "dKV-Cache-Decode (refresh every 8) over LLaDA's low-confidence even quota"),
    "localleap": (localleap, "LocalLeap: anchors kappa 0.9, relaxed tau 0.75 within radius 4, block 32"),
    "credit": (credit, "CreditDecoding: trace credits (alpha 0.7, beta 0.8, gamma 0.2) + threshold 0.9, block 32"),
    "credit-localleap": (credit_localleap, "CreditDecoding's fused logits with the LocalLeap rule"),
    "adablock": (adablock, "AdaBlock: newline-aligned adaptive blocks (fallback 32) + threshold 0.9"),
    "eoser": (eoser, "EOS early rejection (g 0.4 -> 1) over LLaDA's even quota"),
    "ascending": (ascending, "Ascending step size: 2**i tokens at step i"),
    "eoser-ass": (eoser_ass, "EOSER (g 0.01 -> 1) + ascending step size, one block"),
    "guided": (guided, "AR-guided unmasking: dLLM drafts, a causal LM guide (default ar-tiny) verifies left to right"),
    "klass": (klass, "KLASS: KL-stable (0.015, 2 steps) and confident (0.6) tokens, else the family reference's "
                     "fallback (LLaDA: even quota, block 64; Dream: the most confident token, whole canvas)"),
}
