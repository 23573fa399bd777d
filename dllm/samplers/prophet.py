"""Prophet early commit (pixeli99/Prophet ``generate_earlyexit.py``) as a wrapper over any sampler.

Each step, before the inner sampler's own commits count, the signal is the mean over a *span* of positions
of the top-1 minus top-2 **raw logit**. With ``progress = (global step + 1) / total steps`` (the reference's
1-based step count; ``total steps`` is ``GenerateConfig.steps``, default ``gen_length``), the threshold is
``early`` (7.5) while ``progress < 0.33``, ``mid`` (5.0) while ``< 0.67``, ``late`` (2.5) after. When the gap
reaches it the row "goes all-in": every remaining mask of its **whole generation** takes this step's
proposal and the row finishes.

Span (``span``):

* ``"region"`` (default): the still-masked positions of the row's current region;
* ``"masked"``: every still-masked position of the row's generation (all later blocks included; this and
  fixed spans cost a top-2 pass over every column right of the window start, ``"region"`` only over the
  regions);
* ``"OFFSET:LENGTH"`` (or a tuple): fixed generation-relative positions, decoded or not, like the reference's
  answer span (the window then always starts at the span, so its logits are computed at every step).

**Difference from the reference.** The reference is task-specific: its harness forces the tokens of
"The answer is" at fixed generation offsets (200-202 of 256), re-forces them after every step, and
monitors the 5 positions right after (offsets 204-208); without that prefix it never fires. Here nothing is
forced into the canvas, and by default the span is the current region's masked positions, so the signal
is "the model is already sure about what it is decoding now" rather than "the model already knows the
final answer". Use ``span="OFFSET:LENGTH"`` (plus a prompt that makes the model write the answer there) to
monitor an answer span as the reference does.

Filled tokens: the inner sampler's proposal at the region's candidates, the argmax of this step's logits
(Gumbel-max at ``temperature``, default the inner sampler's, with its own noise draw) everywhere else.
The wrapper's ``window_columns`` widens the decode loop's window to the canvas end (and left to a fixed
span's start): the loop computes the logits of those columns too (the LM head on the remaining
generation; without a cache the transformer computes those rows anyway) and the inner sampler gets only
the regions' columns. The argmax beyond the regions is only computed on a step where some row fires (one
host sync per step to find out).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any

import torch

from dllm import ops
from dllm.samplers.base import (
    SamplerBase,
    StepContext,
    StepResult,
    check_int,
    check_range,
    declares_graph_safe,
    gumbel_argmax,
    row_forwards,
    top2_values,
)

PROPHET_PROGRESS = ("steps", "decoded")
#: Largest gap threshold: logit gaps are float32 (a larger threshold never commits early, and one beyond float32's
#: range cannot be compared at all)
MAX_GAP = 1e6


def parse_span(span) -> str | tuple[int, int]:
    """``"region"`` | ``"masked"`` | ``(offset, length)`` from a string ``"OFFSET:LENGTH"`` or a pair."""
    if span in ("region", "masked"):
        return span
    if isinstance(span, str) and ":" in span:
        a, b = span.split(":", 1)
        try:
            span = (int(a), int(b))
        except ValueError:
            pass
    if isinstance(span, (tuple, list)) and len(span) == 2 and all(isinstance(v, int) for v in span):
        if span[0] < 0 or span[1] < 1:
            raise ValueError(f"span={span!r}: the offset must be >= 0 and the length >= 1")
        check_int("span offset", span[0], 0, fix=" (generation-relative)")
        check_int("span length", span[1], 1)
        return (span[0], span[1])
    raise ValueError(f"span={span!r} is not understood; use 'region', 'masked' or 'OFFSET:LENGTH' "
                     "(generation-relative, e.g. '204:5' for the reference's answer span)")


@dataclass(frozen=True)
class Prophet(SamplerBase):
    """Prophet early commit over ``inner`` (any sampler). See the module docstring.

    Args:
        inner: the sampler that decides the normal commits.
        early, mid, late: gap thresholds (raw-logit units) for the three progress phases.
        bounds: progress values where the phases change (the reference: 0.33, 0.67).
        span: ``"region"``, ``"masked"`` or ``"OFFSET:LENGTH"``.
        progress: ``"steps"`` (reference: global step / total steps) or ``"decoded"`` (fraction of the
            row's generation already decoded; useful with threshold samplers, which finish long before
            ``steps``).
        temperature: Gumbel-max temperature of the fill outside the inner proposals (``None``: the inner
            sampler's ``temperature``, else 0).
    """

    inner: Any
    early: float = 7.5
    mid: float = 5.0
    late: float = 2.5
    bounds: tuple[float, float] = (0.33, 0.67)
    span: Any = "region"
    progress: str = "steps"
    temperature: float | None = None
    name: str = "prophet"

    def __post_init__(self):
        if not hasattr(self.inner, "step"):
            raise TypeError(f"inner must be a sampler with step(logits, ctx), got {self.inner!r}")
        for k in ("early", "mid", "late"):
            check_range(k, getattr(self, k), 0, float("inf"), hi_open=True,
                        fix="; Prophet's thresholds are top-2 logit gaps (reference 7.5 / 5.0 / 2.5)")
            if getattr(self, k) > MAX_GAP:
                raise ValueError(f"{k}={getattr(self, k)!r} is out of range; a top-2 logit gap threshold is at most "
                                 f"{MAX_GAP:g} (a larger one never commits early; reference 7.5 / 5.0 / 2.5)")
        b = self.bounds
        if not (isinstance(b, (tuple, list)) and len(b) == 2 and 0 <= b[0] <= b[1] <= 1):
            raise ValueError(f"bounds={b!r} must be two progress values 0 <= a <= b <= 1 (reference (0.33, 0.67))")
        object.__setattr__(self, "span", parse_span(self.span))
        if self.progress not in PROPHET_PROGRESS:
            raise ValueError(f"unknown progress {self.progress!r}; known: {', '.join(PROPHET_PROGRESS)}")
        if self.temperature is not None:
            check_range("temperature", self.temperature, 0, float("inf"), hi_open=True)

    def bind_model(self, model) -> Prophet:
        """Bind the inner sampler to ``model`` (its hook: a guide, KLASS's family style)."""
        inner = self.inner.bind_model(model) if hasattr(self.inner, "bind_model") else self.inner
        return self if inner is self.inner else replace(self, inner=inner)

    def move_rows(self, state: dict, d: int, keep: torch.Tensor | None, n_new: int, **joining) -> None:
        """The inner sampler's :meth:`~dllm.samplers.base.SamplerBase.move_rows` (Prophet keeps no per-row state
        of its own)."""
        move = getattr(self.inner, "move_rows", None)
        if move is not None:
            move(state, d, keep, n_new, **joining)

    def graph_safe(self) -> bool:
        """Its inner sampler's: the early-commit test and proposal read the window's tensors alone (on a GPU at every
        step, :func:`dllm.ops.dense_window`; its noise each row's own), the window's ends are the graphs' key."""
        return declares_graph_safe(self.inner)

    def window_columns(self, win_lo: int, win_hi: int, gen_lo: int, canvas_len: int) -> tuple[int, int]:
        """Canvas columns whose logits the decode loop computes: to the canvas end (the fill), from the
        regions' start or a fixed span's start, whichever is further left. ``win_lo`` / ``win_hi`` are ints (the
        batch's window) or ``[B]`` tensors (each row's own window)."""
        if isinstance(self.span, tuple) and gen_lo + sum(self.span) > canvas_len:
            off, length = self.span
            raise ValueError(f"Prophet span={off}:{length} covers generation positions {off}..{off + length - 1}, "
                             f"beyond the output (gen_length {canvas_len - gen_lo}); use a span inside it (offset + "
                             "length <= gen_length) or a longer gen_length")
        if not isinstance(self.span, tuple):
            return win_lo, canvas_len
        start = gen_lo + self.span[0]
        return (win_lo.clamp_max(start) if torch.is_tensor(win_lo) else min(win_lo, start)), canvas_len

    def threshold(self, ctx: StepContext) -> torch.Tensor:
        """``[B]`` gap threshold for this step's progress."""
        if self.progress == "steps":
            done = row_forwards(ctx).to(torch.float64) + 1  # the row's own forwards: exact under serving
            prog = (done / max(ctx.total_steps, 1)).to(torch.get_default_dtype())
        else:
            G = max(ctx.canvas_len - ctx.gen_lo, 1)
            cols = ctx.win_lo + torch.arange(ctx.x.shape[1], device=ctx.x.device)
            left = ((ctx.x == ctx.mask_id) & (cols >= ctx.gen_lo)).sum(-1)
            prog = 1 - left.float() / G
        a, b = self.bounds
        return torch.where(prog < a, self.early, torch.where(prog < b, self.mid, self.late)).float()

    def gap(self, logits: torch.Tensor, ctx: StepContext, n_region: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean gap [B], has_span [B])`` over the span."""
        B, W, _ = logits.shape
        cols = ctx.win_lo + torch.arange(W, device=logits.device)
        if self.span == "region":
            span = ctx.cand[:, :n_region]
            logits = logits[:, :n_region]
        elif self.span == "masked":
            span = (ctx.x == ctx.mask_id) & (cols >= ctx.gen_lo)[None]
        else:
            off, length = self.span
            lo = ctx.gen_lo + off
            span = ((cols >= lo) & (cols < lo + length))[None].expand(B, W)
        n = span.sum(-1)
        if ops.dense_window(logits):  # every column: no host synchronisation
            g = self._gaps(logits)
        else:
            # the top-2 pass reads only the columns between the first and the last one some row's span covers
            # (a view, no copy; decoded columns leave a region's span); per-column values are unchanged
            used = span.any(0).nonzero().squeeze(-1)
            g = logits.new_zeros(span.shape, dtype=torch.float32)
            if used.numel():
                lo, hi = int(used[0]), int(used[-1]) + 1
                g[:, lo:hi] = self._gaps(logits[:, lo:hi])
        mean = (g * span).sum(-1) / n.clamp_min(1)
        return mean, n > 0

    @staticmethod
    def _gaps(logits: torch.Tensor) -> torch.Tensor:
        """``[B, W']`` top-2 logit gap per column (float32; an all ``-inf`` column gives 0)."""
        top2 = top2_values(logits).float()
        return (top2[..., 0] - top2[..., 1]).nan_to_num(nan=0.0, posinf=1e4)

    def step(self, logits: torch.Tensor, ctx: StepContext) -> StepResult:
        B, W, _ = logits.shape
        n_region = W if ctx.win_hi is None else min(ctx.win_hi - ctx.win_lo, W)  # columns of the regions' union
        if n_region < W:
            inner_ctx = dataclasses.replace(ctx, x=ctx.x[:, :n_region], cand=ctx.cand[:, :n_region])
            res = self.inner.step(logits[:, :n_region], inner_ctx)
        else:
            res = self.inner.step(logits, ctx)
        mean_gap, has = self.gap(logits, ctx, n_region)
        fire = has & ctx.cand.any(-1) & (mean_gap >= self.threshold(ctx))
        proposal, commit = res.proposal, res.commit
        if n_region < W:
            proposal = torch.cat([proposal, ctx.x[:, n_region:]], 1)
            commit = torch.cat([commit, torch.zeros_like(ctx.cand[:, n_region:])], 1)
        T = self.temperature if self.temperature is not None else getattr(self.inner, "temperature", 0.0)
        # the extra argmax over the window for the rows that fire: at every step where it draws no shared random
        # stream (greedy, or each row's own noise) and the window is dense (no host synchronisation), else only on
        # a step that fires (rare)
        always = ops.dense_window(logits) and (T == 0 or ctx.row_key is not None)
        if always or bool(fire.any()):
            x0 = gumbel_argmax(logits, T, ctx)
            masked = ctx.x == ctx.mask_id
            own = ctx.cand & (proposal != ctx.mask_id)  # the inner sampler's proposals for the region
            proposal = torch.where(fire[:, None] & masked & ~own, x0, proposal)
            commit = torch.where(fire[:, None], ctx.cand, commit)
        info = {**res.info, "early_commit": fire, "prophet_gap": torch.where(has, mean_gap, torch.nan)}
        return StepResult(proposal, commit, info, finish=fire)
