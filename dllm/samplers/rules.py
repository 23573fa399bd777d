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
    SOFTMAX_DTYPES,
    StepContext,
    check_range,
    ensure_progress,
    even_quota,
    fast_argmax,
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
        """Record this step's KL to the previous step per window position; ``[B, W]`` stable mask.

        Cost: the KL is computed only for window rows still masked in some batch row (a decoded position
        never becomes a candidate again, so the others keep ``inf``), in chunks of rows small enough to stay
        in the CPU's cache (:meth:`_chunk_rows`; on GPU one chunk, the whole window). Within a chunk the
        arithmetic is the plain vectorised form, so each computed value is the same whatever the chunking.
        """
        B, W, _ = logits.shape
        dt = probs.dtype
        R = self._chunk_rows(logits, dt)
        acc = _KLChunks(self, logits, ctx, dt)
        if R >= W:
            spans = [(0, W)]
        else:  # chunks holding a row still masked somewhere (one host sync), last first: the rows the
            # sampler's softmax wrote last are the likeliest to be still cached
            live = torch.nn.functional.pad((ctx.x == ctx.mask_id).any(0), (0, -W % R)).view(-1, R).any(-1)
            spans = [(a, min(a + R, W)) for a in (live.nonzero().squeeze(-1) * R).flip(0).tolist()]
        for a, b in spans:
            acc.add(a, b, logits[:, a:b].to(dt), probs[:, a:b])
        return acc.finish()

    def fused_step(self, logits: torch.Tensor, ctx: StepContext,
                   softmax_dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy proposal, its ``prob`` confidence and the stable mask in one pass over cache-sized chunks of
        window rows (``(x0, conf, stable)``, each ``[B, W]``): per chunk the argmax, the softmax (never
        materialised for the whole window) and, for rows still masked somewhere, the KL, while the chunk's
        rows are in cache. Bit-identical to ``fast_argmax``, ``softmax(logits)[x0]`` and :meth:`kl_step` over
        the whole window (the ``klass`` preset's CPU path; tested)."""
        B, W, _ = logits.shape
        dt = SOFTMAX_DTYPES[softmax_dtype] or logits.dtype
        R = self._chunk_rows(logits, dt)
        acc = _KLChunks(self, logits, ctx, dt)
        live = (ctx.x == ctx.mask_id).any(0).tolist()  # one host sync
        x0 = torch.empty((B, W), dtype=torch.long, device=logits.device)
        conf = torch.empty((B, W), dtype=dt, device=logits.device)
        for a in range(0, W, R):
            b = min(a + R, W)
            la = logits[:, a:b]
            xa = fast_argmax(la)
            ld = la.to(dt)
            pa = torch.softmax(ld, dim=-1)
            x0[:, a:b] = xa
            conf[:, a:b] = pa.gather(-1, xa[..., None]).squeeze(-1)
            if any(live[a:b]):
                acc.add(a, b, ld, pa, xa)
        return x0, conf, acc.finish()

    #: bytes of logits per chunk on CPU: a few rows, so that a chunk's logits and probabilities stay cached
    #: between its ops (4 rows at LLaDA's vocabulary and batch 1: 1-8 rows measured within noise)
    chunk_bytes: ClassVar[int] = 1 << 21

    def _chunk_rows(self, logits: torch.Tensor, dt: torch.dtype) -> int:
        """Window rows per KL chunk: the whole window on GPU (one vectorised pass); on CPU the rows whose
        ``[B, rows, V]`` slice fits :attr:`chunk_bytes` (at least one row)."""
        B, W, V = logits.shape
        if logits.device.type != "cpu":
            return W
        return max(1, self.chunk_bytes // max(1, B * V * torch.finfo(dt).bits // 8))

    def decide(self, conf: torch.Tensor, ctx: StepContext, stable: torch.Tensor, *, logits=None,
               probs=None) -> tuple[torch.Tensor, dict[str, Any]]:
        """The commit from the stable mask: stable and confident candidates, else the fallback's."""
        ready = ctx.cand & stable & (conf > self.conf_threshold)
        has = ready.any(-1)
        fb, _ = self.fallback.select(conf, ctx, logits=logits, probs=probs)
        commit = torch.where(has[:, None], ready, fb)
        return ensure_progress(commit, conf, ctx.cand, only_empty=True), {"klass_ready": ready.sum(-1)}

    def select(self, conf, ctx, *, logits, probs=None):
        if probs is None:
            probs = torch.softmax(logits.float(), dim=-1)
        return self.decide(conf, ctx, self.kl_step(logits, probs, ctx), logits=logits, probs=probs)


class _KLChunks:
    """One step of :class:`KLStable`'s KL bookkeeping, fed chunk by chunk (``add``), then ``finish``: the
    per-region history in ``ctx.state["klass"]`` and the stable mask. Rows never added keep KL ``inf`` and no
    log-normaliser (so their KL at the next step is ``inf`` too)."""

    def __init__(self, rule: KLStable, logits: torch.Tensor, ctx: StepContext, dt: torch.dtype):
        B, W, _ = logits.shape
        self.rule, self.ctx, self.dt, self.W = rule, ctx, dt, W
        st = self.st = ctx.state.setdefault("klass", {})
        if "hist" not in st:
            st["hist"] = torch.full((B, ctx.canvas_len, rule.history), math.inf, device=logits.device)
            st["region"] = ctx.region_lo.clone()
        self.same_region = st["region"] == ctx.region_lo
        st["hist"].masked_fill_(~self.same_region[:, None, None], math.inf)
        self.logits = logits
        self.prev = st.get("logits")
        self.shift = 0 if self.prev is None else ctx.win_lo - st["lo"]  # window row w = previous window's w + shift
        self.lmax, self.pmax, self.dots, self.rows, self.krows = [], [], [], [], []

    def add(self, a: int, b: int, la: torch.Tensor, pa: torch.Tensor, top: torch.Tensor | None = None) -> None:
        """Window rows ``[a, b)``: their logits (in the softmax dtype), probabilities and optionally the
        logits' argmax ``top`` (then the largest logit is read there instead of searched for)."""
        # log-normaliser from the two maxima: p_max = exp(l_max - lse)
        self.lmax.append(la.amax(-1) if top is None else la.gather(-1, top[..., None]).squeeze(-1))
        self.pmax.append(pa.amax(-1))
        self.rows.append((a, b))
        prev, shift = self.prev, self.shift
        c0, c1 = (0, 0) if prev is None else (max(a, -shift), min(b, prev.shape[1] - shift))
        if c0 >= c1:  # none of these rows was in the previous window
            return
        cur = slice(c0 - a, c1 - a)
        old = prev[:, c0 + shift : c1 + shift].to(self.dt)
        buf = self.st.get("scratch")
        if buf is None or buf.numel() < old.numel() or buf.dtype != self.dt or buf.device != old.device:
            buf = self.st["scratch"] = torch.empty(old.numel(), dtype=self.dt, device=old.device)  # reused
        d = torch.sub(la[:, cur], old, out=buf[: old.numel()].view(old.shape))
        self.dots.append(d.mul_(pa[:, cur]).nansum(-1))  # 0 * (-inf - -inf) = nan where p = 0: dropped
        self.krows.append((c0, c1))

    def finish(self) -> torch.Tensor:
        st, ctx, W, dev = self.st, self.ctx, self.W, self.logits.device
        B = self.logits.shape[0]
        kl = torch.full((B, W), math.inf, dtype=self.dt, device=dev)
        lse = torch.full((B, W), math.inf, dtype=self.dt, device=dev)  # inf: not computed (KL inf next step)
        if self.rows:
            idx = torch.tensor([i for a, b in self.rows for i in range(a, b)], device=dev)
            lse[:, idx] = torch.cat(self.lmax, -1) - torch.log(torch.cat(self.pmax, -1))
        if self.krows:
            idx = torch.tensor([i for a, b in self.krows for i in range(a, b)], device=dev)
            kl[:, idx] = (torch.cat(self.dots, -1) - lse[:, idx] + st["lse"][:, idx + self.shift]).clamp_min(0)
        kl = torch.where(self.same_region[:, None], kl, torch.full_like(kl, math.inf))
        hw = st["hist"][:, ctx.win_lo : ctx.win_lo + W]
        hw.copy_(torch.cat([hw[..., 1:], kl.float()[..., None]], -1))
        st["logits"], st["lse"], st["lo"], st["region"] = self.logits, lse, ctx.win_lo, ctx.region_lo.clone()
        return (hw < self.rule.kl_threshold).all(-1)


RULES = {"quota": Quota, "ascending": Ascending, "threshold": Threshold, "factor": Factor,
         "localleap": LocalLeap, "klass": KLStable}
