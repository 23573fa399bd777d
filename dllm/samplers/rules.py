"""Commit rules: given each position's confidence, which still-masked candidates a step commits.

A rule is a small frozen dataclass with ``select(conf, ctx, *, logits) -> (commit [B, W] bool, info)``.
``conf`` is ``[B, W]`` in ``[0, 1]`` (see :mod:`dllm.samplers.scores`), ``ctx.cand`` the candidates. Every
rule commits at least each row's most confident candidate (ties: lower column), except that a quota rule
commits exactly its quota. ``info`` holds ``[B]`` tensors for the decode loop's per-step trace.

* :class:`Quota`: LLaDA's even schedule (``n // S`` per step, the first ``n % S`` steps one more).
* :class:`Ascending`: ASS, ``2**i`` tokens at step ``i``; the last step takes the rest.
* :class:`Threshold`: Fast-dLLM, every candidate with ``conf >= tau`` plus the best one.
* :class:`Factor`: Fast-dLLM, the longest confidence-sorted prefix with ``c_n >= 1 - f / (n + 1)``.
* :class:`LocalLeap`: anchors ``conf >= kappa``; within ``radius`` of an anchor ``tau`` suffices.
* :class:`KLStable`: KLASS, candidates whose distribution stayed put (KL below ``kl_threshold`` for
  ``history`` steps) and ``conf > conf_threshold``; otherwise the quota schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from dllm.samplers.base import (
    StepContext,
    check_range,
    ensure_progress,
    even_quota,
    select_topk,
)

NEG_INF = float("-inf")


@runtime_checkable
class CommitRule(Protocol):
    def select(self, conf: torch.Tensor, ctx: StepContext, *, logits: torch.Tensor,
               probs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """``logits`` ``[B, W, V]`` (after logits transforms); ``probs`` their softmax when the sampler
        computed it (rules with ``needs_probs = True`` always get it)."""
        ...  # pragma: no cover - protocol


def _check_tau(name: str, value) -> None:
    check_range(name, value, 0, 1, lo_open=True,
                fix=f"; {name} is a confidence threshold (e.g. {name}=0.9; 1.0 commits one token per step)")


@dataclass(frozen=True)
class Quota:
    """LLaDA's even schedule: the ``n // S (+1)`` most confident candidates (``S``: the region's steps)."""

    def select(self, conf, ctx, *, logits=None, probs=None):
        return select_topk(conf, ctx.cand, even_quota(ctx)), {}


@dataclass(frozen=True)
class Ascending:
    """Ascending step size (ASS, EOSER-ASS-RL): step ``i`` commits ``2**i`` candidates; a step whose
    remainder would be smaller than the next step's size commits everything left.

    With the default ``per_region=False`` the power ``i`` is the global step index, so with several blocks
    the later blocks are decoded in one step each, as in the reference's multi-block schedule (L = 128,
    blocks 15 / 16 / 32 / 65: steps 1, 2, 4, 8 | 16 | 32 | 65). ``per_region=True`` restarts at 1 in every
    region. One block of L tokens takes ``floor(log2(L + 1))`` steps (L = 256: 1, 2, ..., 64, 129, the
    reference's 8 steps); ``steps`` caps it (the reference's ``steps`` argument: everything left is committed
    at step ``steps - 1``; L = 255 with ``steps=7`` gives the reference's 1, ..., 32, 192).
    """

    steps: int | None = None
    per_region: bool = False

    def __post_init__(self):
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise ValueError(f"steps={self.steps!r} is out of range; it must be a positive integer or None "
                             "(None: commit everything once the remainder is below the next power of two)")

    def quota(self, ctx: StepContext) -> torch.Tensor:
        i = ctx.step if self.per_region else torch.full_like(ctx.step, ctx.global_step)
        k = torch.ones_like(i) << i.clamp(0, 40)
        left = ctx.cand.sum(-1)
        last = left - k < 2 * k
        if self.steps is not None:
            last = last | (i >= self.steps - 1)
        return torch.where(last, left, k)

    def select(self, conf, ctx, *, logits=None, probs=None):
        k = self.quota(ctx)
        return select_topk(conf, ctx.cand, k), {"quota": k}


@dataclass(frozen=True)
class Threshold:
    """Fast-dLLM: commit every candidate with ``conf >= tau`` and always the most confident one.

    ``max_slack > 0`` also commits candidates within ``max_slack`` of the row's best confidence (dInfer's
    vectorised form ``conf >= min(tau, max_conf - 1e-5)`` is ``max_slack=1e-5``).
    """

    tau: float = 0.9
    max_slack: float = 0.0

    def __post_init__(self):
        _check_tau("tau", self.tau)
        check_range("max_slack", self.max_slack, 0, 1, hi_open=True, fix="; dInfer's rule uses 1e-5, 0 disables it")

    def select(self, conf, ctx, *, logits=None, probs=None):
        c = conf.masked_fill(~ctx.cand, NEG_INF)
        commit = (c >= self.tau) & ctx.cand
        if self.max_slack > 0:
            best = c.max(-1, keepdim=True).values
            commit = commit | ((c >= best - self.max_slack) & ctx.cand)
        return ensure_progress(commit, conf, ctx.cand), {}


@dataclass(frozen=True)
class Factor:
    """Fast-dLLM's factor rule: with candidate confidences sorted ``c_1 >= c_2 >= ...``, commit the longest
    prefix with ``c_n >= 1 - factor / (n + 1)`` for every ``n >= 2`` (``c_1`` always).

    ``quirk=True`` reproduces the reference (dInfer ``get_transfer_index_dynamic``, used by ParallelBench):
    when the first failing position is the last candidate, it is accepted too.
    """

    factor: float = 1.0
    quirk: bool = False

    def __post_init__(self):
        check_range("factor", self.factor, 0, math.inf, lo_open=True, hi_open=True,
                    fix="; ParallelBench sweeps factor in {0.7, 1.0, 1.3, 1.6, 1.9}")

    def select(self, conf, ctx, *, logits=None, probs=None):
        cand = ctx.cand
        B, W = conf.shape
        vals = torch.sort(conf.masked_fill(~cand, NEG_INF), dim=-1, descending=True, stable=True).values
        n = torch.arange(1, W + 1, device=conf.device, dtype=vals.dtype)
        thr = 1 - self.factor / (n + 1)
        thr[0] = NEG_INF
        k = (vals >= thr).long().cumprod(-1).sum(-1)  # longest accepted prefix (non-candidates sort last: -inf)
        if self.quirk:
            n_cand = cand.sum(-1)
            k = torch.where(k == n_cand - 1, n_cand, k)
        return ensure_progress(select_topk(conf, cand, k), conf, cand), {"accepted": k}


@dataclass(frozen=True)
class LocalLeap:
    """LocalLeap (local determinism propagation): anchors are this step's candidates with ``conf >= kappa``;
    a candidate within ``radius`` canvas positions of an anchor is committed when ``conf >= tau``, any other
    when ``conf >= kappa``; the most confident candidate always. Distances count decoded positions in
    between; the neighbourhood may reach outside the region but only candidates are committed.
    ``tau=None`` is Fast-dLLM's threshold rule at ``kappa``.
    """

    kappa: float = 0.9
    tau: float | None = 0.75
    radius: int = 4

    def __post_init__(self):
        _check_tau("kappa", self.kappa)
        if self.tau is not None:
            _check_tau("tau", self.tau)
            if self.tau > self.kappa:
                raise ValueError(f"tau={self.tau} is larger than kappa={self.kappa}; tau is the relaxed threshold "
                                 "near anchors and must be <= kappa (or None for the plain threshold rule)")
        if not isinstance(self.radius, int) or isinstance(self.radius, bool) or self.radius < 0:
            raise ValueError(f"radius={self.radius!r} is out of range; it must be an integer >= 0 "
                             "(canvas positions around an anchor; the paper uses 4)")

    def select(self, conf, ctx, *, logits=None, probs=None):
        cand = ctx.cand
        c = conf.masked_fill(~cand, NEG_INF)
        anchors = cand & (c >= self.kappa)
        commit = anchors
        if self.tau is not None:
            W, r = conf.shape[1], self.radius
            # number of anchors in [i - r, i + r] from a prefix sum over the window
            cs = torch.nn.functional.pad(anchors.long().cumsum(-1), (1, 0))
            idx = torch.arange(W, device=conf.device)
            hi_i = (idx + r + 1).clamp_max(W)
            lo_i = (idx - r).clamp_min(0)
            near = (cs[:, hi_i] - cs[:, lo_i]) > 0
            commit = commit | (near & cand & (c >= self.tau))
        return ensure_progress(commit, conf, cand), {"anchors": anchors.sum(-1)}


@dataclass(frozen=True)
class KLStable:
    """KLASS: commit the candidates whose predictive distribution is stable, ``KL(p_t || p_{t-1}) <
    kl_threshold`` at each of the last ``history`` steps, and confident, ``conf > conf_threshold``; a row
    with none falls back to ``fallback`` (the quota schedule).

    The KL history is kept per region (:attr:`StepContext.state`): a position becomes eligible at the
    region's step ``history`` at the earliest. The reference (one full-canvas forward per step) also has the
    distributions of a block's positions from the previous block's last step, so from its second block on it
    can accept one step earlier. Distributions come from the clean logits (the reference takes them from the
    Gumbel-noised logits at temperature > 0), in the sampler's softmax dtype (the reference: float64), and
    the KL is exact, ``sum p (l - l') - lse + lse'`` from the logits (the reference adds 1e-12 inside its
    logs, which caps the terms where the previous probability underflowed).
    """

    conf_threshold: float = 0.9
    kl_threshold: float = 0.01
    history: int = 2
    fallback: Any = field(default_factory=Quota)
    needs_probs: ClassVar[bool] = True

    def __post_init__(self):
        check_range("conf_threshold", self.conf_threshold, 0, 1, hi_open=True,
                    fix="; KLASS commits conf > conf_threshold (the GSM8K script uses 0.6)")
        check_range("kl_threshold", self.kl_threshold, 0, math.inf, lo_open=True, hi_open=True,
                    fix="; the GSM8K script uses 0.015")
        if not isinstance(self.history, int) or isinstance(self.history, bool) or self.history < 1:
            raise ValueError(f"history={self.history!r} is out of range; it must be an integer >= 1 (KLASS uses 2)")
        if not hasattr(self.fallback, "select"):
            raise TypeError(f"fallback must be a commit rule, got {self.fallback!r}")

    def kl_step(self, logits: torch.Tensor, probs: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Record this step's KL to the previous step per window position; ``[B, W]`` stable mask."""
        B, W, _ = logits.shape
        st = ctx.state.setdefault("klass", {})
        dt = probs.dtype
        # log-normaliser from the two maxima: p_max = exp(l_max - lse)
        lse = logits.amax(-1).to(dt) - torch.log(probs.amax(-1))
        if "hist" not in st:
            st["hist"] = torch.full((B, ctx.canvas_len, self.history), math.inf, device=logits.device)
            st["region"] = ctx.region_lo.clone()
        same_region = st["region"] == ctx.region_lo
        st["hist"].masked_fill_(~same_region[:, None, None], math.inf)
        kl = torch.full((B, W), math.inf, dtype=dt, device=logits.device)
        if "logits" in st:
            plo, prev, prev_lse = st["lo"], st["logits"], st["lse"]
            a, b = max(plo, ctx.win_lo), min(plo + prev.shape[1], ctx.win_lo + W)
            if a < b:
                cur = slice(a - ctx.win_lo, b - ctx.win_lo)
                old = slice(a - plo, b - plo)
                a_, b_ = logits[:, cur].to(dt), prev[:, old].to(dt)
                buf = st.get("scratch")
                if buf is None or buf.shape != a_.shape or buf.dtype != dt:
                    buf = st["scratch"] = torch.empty_like(a_)  # reused: no fresh 16 MB page faults per step
                d = torch.sub(a_, b_, out=buf)
                dot = d.mul_(probs[:, cur]).nansum(-1)  # 0 * (-inf - -inf) = nan where p = 0: dropped
                kl[:, cur] = (dot - lse[:, cur] + prev_lse[:, old]).clamp_min(0)
        kl = torch.where(same_region[:, None], kl, torch.full_like(kl, math.inf))
        hw = st["hist"][:, ctx.win_lo : ctx.win_lo + W]
        hw.copy_(torch.cat([hw[..., 1:], kl.float()[..., None]], -1))
        st["logits"], st["lse"], st["lo"], st["region"] = logits, lse, ctx.win_lo, ctx.region_lo.clone()
        return (hw < self.kl_threshold).all(-1)

    def select(self, conf, ctx, *, logits, probs=None):
        if probs is None:
            probs = torch.softmax(logits.float(), dim=-1)
        stable = self.kl_step(logits, probs, ctx)
        ready = ctx.cand & stable & (conf > self.conf_threshold)
        has = ready.any(-1)
        fb, _ = self.fallback.select(conf, ctx, logits=logits, probs=probs)
        commit = torch.where(has[:, None], ready, fb)
        return ensure_progress(commit, conf, ctx.cand, only_empty=True), {"klass_ready": ready.sum(-1)}


RULES = {"quota": Quota, "ascending": Ascending, "threshold": Threshold, "factor": Factor,
         "localleap": LocalLeap, "klass": KLStable}
