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
* :class:`EntropyBound`: EB-Sampler, the lowest-entropy candidates while their entropies, less the largest
  of them, sum to at most ``gamma``.
* :class:`EntropyThreshold`: d3LLM, every candidate with entropy at most ``threshold`` plus the lowest-entropy one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from dllm import ops
from dllm.ops import moved_rows
from dllm.samplers.base import (
    SOFTMAX_DTYPES,
    StepContext,
    argmax_unmasked,
    check_int,
    check_range,
    ensure_progress,
    even_quota,
    row_forwards,
    select_topk,
)

NEG_INF = float("-inf")
#: Most steps of KL history KLASS may ask for: each kept step holds a ``[batch, window, vocabulary]`` logits tensor
MAX_KL_HISTORY = 16


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

    graph_safe = True  # stateless, no host reads: its select may run inside a CUDA graph
    row_windows = True  # reads each row's window relative to itself: per-row windows (SamplerBase.row_windows)

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

    graph_safe = True  # stateless, no host reads: its select may run inside a CUDA graph
    row_windows = True  # reads each row's window relative to itself: per-row windows (SamplerBase.row_windows)

    steps: int | None = None
    per_region: bool = False

    def __post_init__(self):
        if self.steps is not None:
            check_int("steps", self.steps, 1, what="a positive integer or None",
                      fix=" (None: commit everything once the remainder is below the next power of two)")

    def quota(self, ctx: StepContext) -> torch.Tensor:
        i = ctx.step if self.per_region else row_forwards(ctx)
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

    graph_safe = True  # stateless, no host reads: its select may run inside a CUDA graph
    row_windows = True  # reads each row's window relative to itself: per-row windows (SamplerBase.row_windows)

    tau: float = 0.9
    max_slack: float = 0.0
    #: ``select`` returns a commit within ``ctx.cand`` that already holds each row's most confident candidate:
    #: :class:`~dllm.samplers.composed.ComposedSampler` skips its own ``ensure_progress`` (an identity here)
    ensures_progress = True

    def __post_init__(self):
        _check_tau("tau", self.tau)
        check_range("max_slack", self.max_slack, 0, 1, hi_open=True, fix="; dInfer's rule uses 1e-5, 0 disables it")

    def select(self, conf, ctx, *, logits=None, probs=None):
        commit = (conf >= self.tau) & ctx.cand  # the candidates' own confidences: no -inf fill needed
        if self.max_slack > 0:
            c = torch.where(ctx.cand, conf, NEG_INF)
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

    graph_safe = True  # stateless, no host reads: its select may run inside a CUDA graph
    row_windows = True  # reads each row's window relative to itself: per-row windows (SamplerBase.row_windows)

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
        thr[0].fill_(NEG_INF)  # a number baked into the kernel (thr[0] = number lifts a host tensor)
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

    graph_safe = True  # stateless, no host reads: its select may run inside a CUDA graph
    row_windows = True  # reads each row's window relative to itself: per-row windows (SamplerBase.row_windows)

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
        check_int("radius", self.radius, 0, fix=" (canvas positions around an anchor; the paper uses 4)")

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
    kl_threshold`` at each of the last ``history`` steps, and confident, ``conf > conf_threshold``
    (``conf >= conf_threshold`` with ``inclusive``); a row with none falls back to ``fallback`` (the quota
    schedule, as KLASS's LLaDA script; ``None``: the most confident candidate alone, as its Dream code).

    The KL history is kept per region (:attr:`StepContext.state`): a position becomes eligible at the
    region's step ``history`` at the earliest. The reference (one full-canvas forward per step) also has the
    distributions of a block's positions from the previous block's last step, so from its second block on it
    can accept one step earlier. Distributions come from the clean logits (the reference takes them from the
    Gumbel-noised logits at temperature > 0), in the sampler's softmax dtype (the reference: float64), and
    the KL is exact, ``sum p (l - l') - lse + lse'`` from the logits (the reference adds 1e-12 inside its
    logs, which caps the terms where the previous probability underflowed).

    The KL is evaluated lazily (:class:`_KLHistory`): only at the confident candidates, the only positions
    where it can change a commit, from the last ``history`` steps' logits, which the rule keeps by reference
    in :attr:`StepContext.state` (``history`` ``[B, W, V]`` tensors alive at a time). The commits are the
    eager per-step history's and each value computed is the eager one, bit for bit (tested).
    """

    conf_threshold: float = 0.6  # KLASS's GSM8K setting, as the klass preset
    kl_threshold: float = 0.015
    history: int = 2
    fallback: Any = field(default_factory=Quota)
    inclusive: bool = False
    needs_probs: ClassVar[bool] = True
    # per-row windows (SamplerBase.row_windows): a kept step's window start is then a [B, 1] tensor, and its KL values
    # are taken at each row's columns (_KLHistory.dense)
    row_windows: ClassVar[bool] = True

    @property
    def graph_safe(self) -> bool:
        """With a graph-safe fallback (or none): its kept steps are a list of dicts of tensors in the scratch state
        (:class:`_KLStep`), which the step graphs' bank copies (their logits too) and rebuilds after a replay; on a
        GPU every KL is computed at every step (:meth:`_KLHistory.dense`), without a host read."""
        return self.fallback is None or bool(getattr(self.fallback, "graph_safe", False))

    def __post_init__(self):
        check_range("conf_threshold", self.conf_threshold, 0, 1, hi_open=True,
                    fix="; KLASS commits conf > conf_threshold (the GSM8K script uses 0.6)")
        check_range("kl_threshold", self.kl_threshold, 0, math.inf, lo_open=True, hi_open=True,
                    fix="; the GSM8K script uses 0.015")
        check_int("history", self.history, 1, MAX_KL_HISTORY,
                  fix=" (KLASS uses 2; each step of history keeps a step's logits alive)")
        if self.fallback is not None and not hasattr(self.fallback, "select"):
            raise TypeError(f"fallback must be a commit rule or None (the most confident candidate), got "
                            f"{self.fallback!r}")

    @staticmethod
    def rows_own(ctx: StepContext) -> bool:
        """Whether this step's window or a kept step's is per row (its start a ``[B, 1]`` tensor, per-row windows):
        then every KL is computed at every step, at each row's columns (:meth:`_KLHistory.dense`)."""
        steps = ctx.state.get("klass", {}).get("steps", ())
        return torch.is_tensor(ctx.win_lo) or any(torch.is_tensor(s.lo) for s in steps)

    def confident(self, conf: torch.Tensor, thr) -> torch.Tensor:
        """``conf >= thr`` (``inclusive``, KLASS's Dream code) or ``conf > thr`` (its LLaDA script)."""
        return conf >= thr if self.inclusive else conf > thr

    def kl_step(self, logits: torch.Tensor, probs: torch.Tensor, ctx: StepContext,
                conf: torch.Tensor) -> torch.Tensor:
        """Record this step and return the ``[B, W]`` stable mask, evaluated only where it can matter: at the
        candidates with ``conf > conf_threshold`` (``False`` everywhere else: not evaluated; see
        :class:`_KLHistory`). ``probs`` must be ``softmax(logits.to(probs.dtype))`` (what the composed
        sampler passes). This step's KL is computed only for the chunks of window rows
        (:meth:`_chunk_rows`) holding such a candidate."""
        W = logits.shape[1]
        dt = probs.dtype
        hist = _KLHistory(self, logits, ctx, dt)
        hot = ctx.cand & self.confident(conf, self.conf_threshold)
        if ops.dense_window(logits):  # every window row at every step: no host synchronisation (CUDA)
            return hist.dense(logits.to(dt), probs, hot)
        if self.rows_own(ctx):  # per-row windows on the CPU: the dense form, after the lazy steps' gaps are filled
            hist.complete()
            return hist.dense(logits.to(dt), probs, hot)
        R = self._chunk_rows(logits, dt)
        rows = hot.any(0)
        if R < W:  # (one host sync) the chunks holding a confident candidate
            rows = torch.nn.functional.pad(rows, (0, -W % R)).view(-1, R).any(-1)
            for a in (rows.nonzero().squeeze(-1) * R).tolist():
                b = min(a + R, W)
                hist.rows(a, b, logits[:, a:b].to(dt), probs[:, a:b])
        elif bool(rows.any()):
            hist.rows(0, W, logits.to(dt), probs)
        return hist.finish(hot)

    def fused_step(self, logits: torch.Tensor, ctx: StepContext,
                   softmax_dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy proposal, its ``prob`` confidence and the stable mask in one pass over cache-sized chunks of
        window rows (``(x0, conf, stable)``, each ``[B, W]``): per chunk the argmax and the softmax (never
        materialised for the whole window), the log-normaliser from the two (``l[x0] - log conf``: the
        largest probability is the one at the argmax) and, for a chunk holding a confident candidate, this
        step's KL while its probabilities are in cache. Bit-identical to ``argmax_unmasked``,
        ``softmax(logits)[x0]`` and :meth:`kl_step` (the ``klass`` preset's CPU path; tested); ``stable`` as
        in :meth:`kl_step`."""
        B, W, _ = logits.shape
        dt = SOFTMAX_DTYPES[softmax_dtype] or logits.dtype
        R = self._chunk_rows(logits, dt)
        hist = _KLHistory(self, logits, ctx, dt)
        thr = torch.full(ctx.cand.shape, self.conf_threshold, dtype=dt, device=logits.device)
        thr.masked_fill_(~ctx.cand, math.inf)  # conf > thr: a confident candidate
        x0 = torch.empty((B, W), dtype=torch.long, device=logits.device)
        conf = torch.empty((B, W), dtype=dt, device=logits.device)
        lmax = torch.empty((B, W), dtype=dt, device=logits.device)
        for a in range(0, W, R):
            b = min(a + R, W)
            la = logits[:, a:b]
            xa = argmax_unmasked(la, ctx.mask_id)
            ld = la.to(dt)
            pa = torch.softmax(ld, dim=-1)
            x0[:, a:b] = xa
            ca = conf[:, a:b] = pa.gather(-1, xa[..., None]).squeeze(-1)
            lmax[:, a:b] = ld.gather(-1, xa[..., None]).squeeze(-1)
            if self.confident(ca, thr[:, a:b]).any():  # a confident candidate (on CPU: no device sync)
                hist.rows(a, b, ld, pa, lse=False)
        hist.cur.lse = lmax - torch.log(conf)
        return x0, conf, hist.finish(self.confident(conf, thr))

    #: bytes of logits per chunk on CPU: a few rows, so that a chunk's logits and probabilities stay cached
    #: between its ops (8 rows at LLaDA's vocabulary and batch 1: with the lazy KL, 4 MiB measured at or
    #: near the best of 2-16 MiB and one pass, with no, some or all rows confident)
    chunk_bytes: ClassVar[int] = 1 << 22

    def _chunk_rows(self, logits: torch.Tensor, dt: torch.dtype) -> int:
        """Window rows per KL chunk: the whole window on GPU (one vectorised pass); on CPU the rows whose
        ``[B, rows, V]`` slice fits :attr:`chunk_bytes` (at least one row)."""
        B, W, V = logits.shape
        if logits.device.type != "cpu":
            return W
        return max(1, self.chunk_bytes // max(1, B * V * torch.finfo(dt).bits // 8))

    def decide(self, conf: torch.Tensor, ctx: StepContext, stable: torch.Tensor, *, logits=None,
               probs=None) -> tuple[torch.Tensor, dict[str, Any]]:
        """The commit from the stable mask: stable and confident candidates, else the fallback's (within the
        candidates, at least each row's best one). ``stable`` is read only at the confident candidates."""
        ready = ctx.cand & stable & self.confident(conf, self.conf_threshold)
        has = ready.any(-1)
        if self.fallback is None:  # ensure_progress adds each row's most confident candidate
            fb = torch.zeros_like(ready)
        else:
            fb, _ = self.fallback.select(conf, ctx, logits=logits, probs=probs)
        commit = torch.where(has[:, None], ready, fb & ctx.cand)
        return ensure_progress(commit, conf, ctx.cand, only_empty=True), {"klass_ready": ready.sum(-1)}

    def select(self, conf, ctx, *, logits, probs=None):
        if probs is None:
            probs = torch.softmax(logits.float(), dim=-1)
        return self.decide(conf, ctx, self.kl_step(logits, probs, ctx, conf), logits=logits, probs=probs)

    def move_rows(self, state: dict, d: int, keep: torch.Tensor | None, n_new: int) -> None:
        """Move the kept history (``state["klass"]``, :class:`_KLHistory`) with the rows of its batch (the
        serving engine, :meth:`~dllm.samplers.base.SamplerBase.move_rows` of the sampler holding this rule):
        ``keep`` rows selected, canvas columns shifted by ``d`` (left padding added, or cropped when ``d < 0``),
        ``n_new`` rows appended that have no history: their region at the kept steps is ``-1`` (left of the
        generation start, where it stays as the columns move: never a region start), so every KL they would
        read there is ``inf``, as for a row with fewer than ``history`` earlier steps."""
        st = state.get("klass")
        if not st or not st.get("steps"):
            return
        st["steps"] = [_KLStep(moved_rows(s.logits, keep, n_new),
                               moved_rows(s.lo + d, keep, n_new) if torch.is_tensor(s.lo) else s.lo + d,
                               moved_rows(s.region, keep, n_new, d=d, shift=True, fill=-1),
                               moved_rows(s.lse, keep, n_new), moved_rows(s.kl, keep, n_new, fill=math.inf))
                       for s in st["steps"]]


class _KLStep(dict):
    """One decode step as :class:`_KLHistory` keeps it (window row ``w`` is canvas column ``lo + w``), its fields
    read and written as attributes: ``logits`` ``[B, W, V]`` (the step's logits: a reference to the sampler's input,
    not a copy; on the step graphs' path the bank keeps a copy), ``lo`` (canvas column of window row 0), ``region``
    ``[B]`` (the rows' region starts), ``lse`` ``[B, W]`` (log-normalisers, softmax dtype; nan: not computed yet) and
    ``kl`` ``[B, W]`` (float32 ``KL(p_this step || p_step before)``; nan: not computed yet). A dict, so that the
    step graphs' bank (``dllm.generate._StepBank``) keeps copies of its tensors and rebuilds it after a replay."""

    __slots__ = ()

    def __init__(self, logits: torch.Tensor, lo: int, region: torch.Tensor, lse: torch.Tensor, kl: torch.Tensor):
        super().__init__(logits=logits, lo=lo, region=region, lse=lse, kl=kl)

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value) -> None:
        self[name] = value


class _KLHistory:
    """:class:`KLStable`'s bookkeeping for one step, lazy on the CPU (on CUDA every value at every step:
    :meth:`dense`). Instead of the KL of every still-masked position at
    every step, ``ctx.state["klass"]["steps"]`` keeps the last ``history`` steps (:class:`_KLStep`: their
    logits by reference, so ``history`` ``[B, W, V]`` logits tensors stay alive, plus ``[B, W]`` caches of
    the log-normalisers and KL values computed so far). A position's KL values are needed only when it is a
    confident candidate: then this step's (computed by the caller with the chunk's probabilities at hand,
    :meth:`rows`) and, newest first while all stay below the threshold, the earlier steps' from the cache, or
    recomputed from the kept logits (``softmax(l.to(dt))``: bit for bit the probabilities the step had).
    KL values are computed per range of window rows for all batch rows at once (the eager form's
    arithmetic and layout), and all are cached: a position confident at consecutive steps costs one KL row
    per step, with its probabilities in cache, as in the eager form.

    The verdict is the eager rule's: ``KL(p_s || p_{s-1}) < kl_threshold`` at each of the last ``history``
    steps ``s``, where the KL is ``inf`` when the position was not in step ``s - 1``'s window (the eager
    per-column history then holds that ``inf`` among its last ``history`` values), when the row's region
    changed between the two steps (the eager per-region reset), or when fewer than ``history`` earlier steps
    exist. Each value is the eager one, bit for bit: ``nansum((l - l') * p) - lse + lse'`` clamped at 0,
    cast to float32 (tested against an eager restatement)."""

    def __init__(self, rule: KLStable, logits: torch.Tensor, ctx: StepContext, dt: torch.dtype):
        B, W, _ = logits.shape
        self.rule, self.dt, self.R = rule, dt, rule._chunk_rows(logits, dt)
        st = self.st = ctx.state.setdefault("klass", {})
        self.past: list[_KLStep] = st.get("steps", [])  # oldest first
        nan, dev = math.nan, logits.device
        self.cur = _KLStep(logits, ctx.win_lo, ctx.region_lo.clone(), torch.full((B, W), nan, dtype=dt, device=dev),
                           torch.full((B, W), nan, device=dev))
        st["steps"] = [*self.past, self.cur][-rule.history:]
        self.spans: list[tuple[int, int]] = []  # this step's rows passed to rows(), for the KL in finish()
        self.dots: list[torch.Tensor] = []

    def rows(self, a: int, b: int, l: torch.Tensor, p: torch.Tensor, lse: bool = True) -> None:
        """This step's KL at window rows ``[a, b)``, from their logits ``l`` (softmax dtype) and probabilities
        ``p`` (``[B, b - a, V]``): the dot ``sum p (l - l')`` now, while they are at hand; the rest, once for
        all rows, in :meth:`finish`. ``lse=False``: the caller sets ``self.cur.lse`` before :meth:`finish`
        (else the rows' log-normalisers are taken from ``l`` and ``p`` now)."""
        q = self.past[-1] if self.past else None
        self.cur.kl[:, a:b] = math.inf  # rows not in the previous window
        c0, c1 = self._overlap(self.cur, q, a, b)
        if c0 < c1:
            cur = slice(c0 - a, c1 - a)
            if lse:
                self._lse(self.cur, c0, c1, l[:, cur], p[:, cur])
            self.spans.append((c0, c1))
            self.dots.append(self._dot(l[:, cur], p[:, cur], q.logits[:, c0 + self.cur.lo - q.lo : c1 + self.cur.lo - q.lo]))

    def dense(self, l: torch.Tensor, p: torch.Tensor, hot: torch.Tensor) -> torch.Tensor:
        """The ``[B, W]`` stable mask at the ``hot`` positions with every value computed at every window row and
        step (the eager form's work, with no data-dependent shape or branch: no host synchronisation; on CUDA):
        this step's log-normalisers and KL at every row (``inf`` outside the last step's window), then the rule
        over the last ``history`` steps, each step's KL taken at the rows of this window (``inf`` outside its own).
        ``l``, ``p``: the window's logits in the softmax dtype and its probabilities. The values are the lazy
        form's (:meth:`rows`, :meth:`finish`): the same arithmetic per row."""
        cur, q = self.cur, (self.past[-1] if self.past else None)
        W = l.shape[1]
        cur.lse.copy_(self._log_normaliser(l, p))
        cur.kl.fill_(math.inf)  # rows not in the last step's window
        shift = None if q is None else cur.lo - q.lo  # window row w of this step is row w + shift of step q
        if torch.is_tensor(shift):  # per-row windows ([B, 1]): each row's columns of step q
            idx, inside = self._rows_of(q, shift, W, hot.shape[0])
            old = q.logits.gather(1, idx[..., None].expand(-1, -1, q.logits.shape[-1]))
            self._set_kl(cur, q, slice(None), self._dot(l, p, old), q.lse.gather(1, idx))
            cur.kl.masked_fill_(~inside, math.inf)
        else:
            c0, c1 = self._overlap(cur, q, 0, W)
            if c0 < c1:
                lo_q = c0 + cur.lo - q.lo
                dots = self._dot(l[:, c0:c1], p[:, c0:c1], q.logits[:, lo_q:lo_q + c1 - c0])
                self._set_kl(cur, q, slice(c0, c1), dots, q.lse[:, lo_q:lo_q + c1 - c0])
        stable = hot.clone()
        for j in range(self.rule.history):  # this step (j = 0) and the earlier ones, newest first
            if j > len(self.past):  # fewer steps than the history: never stable (the eager history's inf)
                return torch.zeros_like(hot)
            s = cur if j == 0 else self.past[-j]
            shift = cur.lo - s.lo  # window row w of this step is row w + shift of step s
            if torch.is_tensor(shift):  # per row ([B, 1])
                idx, inside = self._rows_of(s, shift, W, hot.shape[0])
                stable &= inside & (s.kl.gather(1, idx) < self.rule.kl_threshold)
                continue
            a, b = max(0, -shift), min(W, s.kl.shape[1] - shift)
            below = torch.zeros_like(hot)
            if a < b:
                below[:, a:b] = s.kl[:, a + shift:b + shift] < self.rule.kl_threshold
            stable &= below
        return stable

    def complete(self) -> None:
        """Compute what the dense form reads of the kept steps and the lazy form left out (``nan``): the last step's
        log-normalisers and the KL values of the kept steps the rule looks back on. A batch switches forms where its
        windows become per row (the serving engine: rows join a row decoded alone on the CPU); the values are those
        the lazy form computes on demand."""
        past = self.past
        for j in range(1, min(self.rule.history, len(past) + 1)):
            s, q = past[-j], (past[-j - 1] if j < len(past) else None)
            if torch.isnan(s.kl).any():
                self._kl_rows(s, q, 0, s.kl.shape[1])
        if past:
            self._lse(past[-1], 0, past[-1].kl.shape[1])

    @staticmethod
    def _rows_of(s: _KLStep, shift: torch.Tensor, W: int, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, W]`` window rows of step ``s`` holding this step's window rows (``shift``: ``[B, 1]``, row ``w`` is
        row ``w + shift`` of step ``s``), clamped into its window, and whether each is inside it."""
        idx = ops.cached_arange(W, s.kl.device)[None] + shift
        inside = (idx >= 0) & (idx < s.kl.shape[1])
        return idx.clamp(0, s.kl.shape[1] - 1).expand(B, -1), inside.expand(B, -1)

    def finish(self, hot: torch.Tensor) -> torch.Tensor:
        """The ``[B, W]`` stable mask at the ``hot`` positions (``False`` elsewhere)."""
        cur, thr = self.cur, self.rule.kl_threshold
        stable = torch.zeros_like(hot)
        if self.spans:  # this step's KL at the rows passed to rows()
            q = self.past[-1]
            idx = torch.tensor([i for a, e in self.spans for i in range(a, e)], device=cur.kl.device)
            self._set_kl(cur, q, idx, torch.cat(self.dots, -1), self._lse(q, idx + (cur.lo - q.lo)))
        b, w = hot.nonzero(as_tuple=True)
        if not b.numel():
            return stable
        self._fill(cur, self.past[-1] if self.past else None, b, w)  # rows the caller did not pass
        keep = cur.kl[b, w] < thr
        for j in range(1, self.rule.history):  # the earlier steps' KL, newest first, while all stay below
            b, w = b[keep], w[keep]
            if not b.numel():
                return stable
            if j > len(self.past):  # not enough steps yet: the eager history still holds its initial inf
                return stable
            s, q = self.past[-j], (self.past[-j - 1] if j < len(self.past) else None)
            v = w + (cur.lo - s.lo)  # the position's window row at step s
            inw = (v >= 0) & (v < s.kl.shape[1])  # else inf (see above)
            b, w, v = b[inw], w[inw], v[inw]
            self._fill(s, q, b, v)
            keep = s.kl[b, v] < thr
        stable[b[keep], w[keep]] = True
        return stable

    def _fill(self, s: _KLStep, q: _KLStep | None, b: torch.Tensor, w: torch.Tensor) -> None:
        """Compute step ``s``'s KL where it is not known at ``(b, w)``, by runs of at most ``R`` window rows."""
        todo = torch.isnan(s.kl[b, w])
        if not todo.any():
            return
        runs: list[list[int]] = []
        for r in sorted(set(w[todo].tolist())):
            if runs and runs[-1][1] == r and r - runs[-1][0] < self.R:
                runs[-1][1] = r + 1
            else:
                runs.append([r, r + 1])
        for a, e in runs:
            self._kl_rows(s, q, a, e)

    @staticmethod
    def _overlap(s: _KLStep, q: _KLStep | None, a: int, b: int) -> tuple[int, int]:
        """The part ``[c0, c1)`` of step ``s``'s window rows ``[a, b)`` that was in step ``q``'s window."""
        if q is None:
            return 0, 0
        shift = s.lo - q.lo  # row w of step s is row w + shift of step q
        return max(a, -shift), min(b, q.kl.shape[1] - shift)

    def _dot(self, l: torch.Tensor, p: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """``sum p (l - old)`` over the vocabulary (``[B, n, V]`` each; ``old`` converted to the softmax dtype)."""
        old = old.to(self.dt)
        buf = self.st.get("scratch")
        if buf is None or buf.numel() < old.numel() or buf.dtype != self.dt or buf.device != old.device:
            buf = self.st["scratch"] = torch.empty(old.numel(), dtype=self.dt, device=old.device)  # reused
        d = torch.sub(l, old, out=buf[: old.numel()].view(old.shape))
        return d.mul_(p).nansum(-1)  # 0 * (-inf - -inf) = nan where p = 0: dropped

    def _set_kl(self, s: _KLStep, q: _KLStep, idx, dots: torch.Tensor, lse_q: torch.Tensor) -> None:
        """``s.kl[:, idx] = KL`` from the dots and the log-normalisers (``inf`` where the row's region changed)."""
        v = (dots - s.lse[:, idx] + lse_q).clamp_min(0)
        same = (s.region == q.region)[:, None]
        s.kl[:, idx] = torch.where(same, v, torch.full_like(v, math.inf)).float()

    def _kl_rows(self, s: _KLStep, q: _KLStep | None, a: int, b: int) -> None:
        """``s.kl[:, a:b]``: float32 ``KL(p_s || p_q)`` at step ``s``'s window rows ``[a, b)`` (``q``: the step
        before, or None), recomputed from the kept logits; ``inf`` where the position was not in ``q``'s
        window or the row's region changed."""
        s.kl[:, a:b] = math.inf
        c0, c1 = self._overlap(s, q, a, b)
        if c0 < c1:
            l = s.logits[:, c0:c1].to(self.dt)
            p = torch.softmax(l, dim=-1)
            lo_q = c0 + s.lo - q.lo
            self._lse(s, c0, c1, l, p)
            self._set_kl(s, q, slice(c0, c1), self._dot(l, p, q.logits[:, lo_q : lo_q + c1 - c0]),
                         self._lse(q, torch.arange(lo_q, lo_q + c1 - c0, device=s.kl.device)))

    @staticmethod
    def _log_normaliser(l: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """``[B, n]`` log-normalisers of rows with logits ``l`` and probabilities ``p`` (``[B, n, V]``), from the two
        maxima (``p_max = exp(l_max - lse)``): the one formula of the lazy and the dense forms."""
        return l.amax(-1) - torch.log(p.amax(-1))

    def _lse(self, s: _KLStep, a, b: int | None = None, l: torch.Tensor | None = None,
             p: torch.Tensor | None = None) -> torch.Tensor:
        """Step ``s``'s log-normalisers at window rows ``[a, b)`` (or at the index tensor ``a``) from the two
        maxima (``p_max = exp(l_max - lse)``), computed (and cached) where not known yet (``l`` / ``p``: the
        rows' logits and probabilities when at hand, for a range)."""
        if b is not None:
            val = s.lse[:, a:b]
            if torch.isnan(val).any():
                if l is None:
                    l = s.logits[:, a:b].to(self.dt)
                    p = torch.softmax(l, dim=-1)
                val.copy_(self._log_normaliser(l, p))
            return val
        rows = torch.isnan(s.lse[:, a]).any(0)
        if rows.any():
            for r in a[rows].tolist():
                self._lse(s, r, r + 1)
        return s.lse[:, a]


@dataclass(frozen=True)
class EntropyBound:
    """EB-Sampler (Ben-Hamu et al., 2025, "Accelerated Sampling from Masked Diffusion Models via Entropy
    Bounded Unmasking"): with the candidates sorted by the entropy of their distribution, ``H_1 <= H_2 <= ...``,
    commit the longest prefix whose entropies less the largest of them sum to at most ``gamma``
    (``sum_{j<=k} H_j - max_{j<=k} H_j <= gamma``), at least one candidate.

    The entropy is the full-vocabulary softmax's (mask column included), computed from the logits in float32
    as ``torch.distributions.Categorical(logits=...).entropy()`` computes it, independently of the sampler's
    ``confidence`` score; ties in entropy are ordered by column.
    """

    graph_safe = True  # stateless, no host reads: its select may run inside a CUDA graph
    row_windows = True  # reads each row's window relative to itself: per-row windows (SamplerBase.row_windows)

    gamma: float = 0.01

    def __post_init__(self):
        check_range("gamma", self.gamma, 0, math.inf, hi_open=True,
                    fix="; gamma bounds the summed entropy (nats) of the tokens committed together, e.g. 0.01-1")

    def select(self, conf, ctx, *, logits, probs=None):
        cand = ctx.cand
        logp = torch.log_softmax(logits.float(), dim=-1)
        ent = -(logp.clamp(min=torch.finfo(logp.dtype).min) * logp.exp()).sum(-1)
        ent = ent.masked_fill(~cand, math.inf)
        vals, order = torch.sort(ent, dim=-1, stable=True)
        before = torch.cumsum(vals.masked_fill(~torch.isfinite(vals), 0.0), dim=-1) - vals.masked_fill(
            ~torch.isfinite(vals), 0.0)  # the summed entropy of the candidates sorted before each one
        take = (before <= self.gamma) & torch.isfinite(vals)
        k = take.long().cumprod(-1).sum(-1)
        k = torch.maximum(k, cand.any(-1).long())  # at least one candidate
        ranks = torch.arange(ent.shape[-1], device=ent.device).expand_as(ent)
        commit = torch.zeros_like(cand).scatter(-1, order, ranks < k[:, None])
        return commit & cand, {"accepted": k}


def d3llm_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` logits -> ``[...]`` entropies as d3LLM computes them: ``-sum p log(p + 1e-12)`` of the
    full-vocabulary softmax in float64."""
    p = torch.softmax(logits.to(torch.float64), dim=-1)
    return -(p * torch.log(p + 1e-12)).sum(-1)


@dataclass(frozen=True)
class EntropyThreshold:
    """d3LLM's entropy threshold (``get_transfer_index_entropy`` of hao-ai-lab/d3LLM): commit every candidate
    whose entropy is at most ``threshold`` (nats) and always the lowest-entropy candidate (ties: lower column).
    The entropy is ``-sum p log(p + 1e-12)`` of the full-vocabulary softmax in float64, as the reference
    computes it."""

    graph_safe = True  # stateless, no host reads: its select may run inside a CUDA graph
    row_windows = True  # reads each row's window relative to itself: per-row windows (SamplerBase.row_windows)

    threshold: float = 0.5

    def __post_init__(self):
        check_range("threshold", self.threshold, 0, math.inf, hi_open=True,
                    fix="; an entropy in nats, e.g. 0.5 (d3LLM's default)")

    def select(self, conf, ctx, *, logits, probs=None):
        cand = ctx.cand
        ent = d3llm_entropy(logits).masked_fill(~cand, math.inf)
        best = ent.argmin(-1)  # the first of equal minima: the lower column
        commit = (ent <= self.threshold) & cand
        # the one-hot of best as a comparison (one_hot checks its indices on the host)
        commit = commit | ((ops.cached_arange(ent.shape[-1], ent.device) == best[:, None]) & cand.any(-1, keepdim=True))
        return commit & cand, {}
