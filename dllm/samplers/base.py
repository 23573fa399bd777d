"""Sampler protocol and the shared pieces every commit rule is built from.

A sampler sees the logits of a *window* of canvas columns (the union of the rows' current regions) and
returns a proposal for every window position plus the subset to commit. Contract of ``step``:

* ``commit`` is a subset of ``ctx.cand`` (still-masked positions inside the row's current region);
* every unfinished row commits at least one token, unless the sampler's own schedule assigns zero tokens to
  this step (Dream's exact ``1 - s/t`` schedule does; it still finishes within its ``steps``);
* the proposal at committed positions is never the mask id;
* no Python loop over batch rows; inputs are not mutated; all randomness comes from ``ctx.generator``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

NOISE_SCOPES = ("region", "canvas")


@dataclass
class StepContext:
    """Everything a sampler may read at one step. Window tensors are ``[B, W]``; per-row ones ``[B]``."""

    x: torch.Tensor  # [B, W] int64 current tokens in the window
    cand: torch.Tensor  # [B, W] bool still-masked positions of the row's current region (active rows only)
    step: torch.Tensor  # [B] int64 step index inside the row's current region
    steps: torch.Tensor  # [B] int64 schedule length of the row's current region
    n_region_start: torch.Tensor  # [B] int64 masked positions in the region when it started
    region_lo: torch.Tensor  # [B] int64 canvas column where the row's region starts
    region_hi: torch.Tensor  # [B] int64 canvas column where the row's region ends (exclusive)
    win_lo: int  # canvas column of window position 0
    canvas_len: int  # T, canvas width (prompt + padding + gen)
    gen_lo: int  # canvas column where generation starts
    global_step: int
    total_steps: int
    generator: torch.Generator | None
    mask_id: int
    eos_id: int | None
    eot_id: int | None
    state: dict = field(default_factory=dict)  # sampler scratch space for one generate() call


@dataclass
class StepResult:
    proposal: torch.Tensor  # [B, W] int64
    commit: torch.Tensor  # [B, W] bool
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Sampler(Protocol):
    name: str

    def step(self, logits: torch.Tensor, ctx: StepContext) -> StepResult:  # pragma: no cover - protocol
        ...


def check_range(name: str, value, lo, hi, *, lo_open=False, hi_open=False, fix: str = "") -> None:
    """Raise a ValueError naming the parameter, its range and the fix."""
    bad = value is None or value < lo or value > hi or (lo_open and value == lo) or (hi_open and value == hi)
    if bad:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        raise ValueError(f"{name}={value!r} is out of range; it must lie in {lb}{lo}, {hi}{rb}{fix}")


def canvas_rand(shape_tail: tuple[int, ...], ctx: StepContext, W: int, B: int, dtype, device, scope: str):
    """Uniform noise for the window, drawn over the window (``region``) or over the whole canvas and sliced
    (``canvas``: the random stream of reference implementations that draw noise for every position)."""
    if scope == "canvas":
        u = torch.rand((B, ctx.canvas_len, *shape_tail), generator=ctx.generator, dtype=dtype, device=device)
        return u[:, ctx.win_lo : ctx.win_lo + W]
    return torch.rand((B, W, *shape_tail), generator=ctx.generator, dtype=dtype, device=device)


def gumbel_argmax(logits: torch.Tensor, temperature: float, ctx: StepContext, scope: str = "region"):
    """LLaDA's Gumbel-max in float64: ``argmax(exp(l) / (-log u) ** T)``; plain argmax at ``T = 0``."""
    if temperature == 0:
        return logits.argmax(-1)
    B, W, V = logits.shape
    u = canvas_rand((V,), ctx, W, B, torch.float64, logits.device, scope)
    return (logits.to(torch.float64).exp() / (-torch.log(u)) ** temperature).argmax(-1)


def exclude_mask(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """The mask token is never a valid output: its logit becomes -inf, in place (``B x W`` writes, no copy).

    The decode loop applies this to the logits it owns before every ``sampler.step``, so no sampler can
    propose the mask id; every other token's score, and the random stream, are unchanged."""
    logits[..., mask_id] = float("-inf")
    return logits


def select_topk(conf: torch.Tensor, cand: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Commit mask of the ``k[b]`` most confident candidates of each row (ties: lower column first)."""
    conf = conf.masked_fill(~cand, float("-inf"))
    order = torch.sort(conf, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(conf.shape[-1], device=conf.device).expand_as(order))
    return (ranks < k[:, None]) & cand


def ensure_progress(commit: torch.Tensor, conf: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Add each row's most confident candidate (rows with candidates always commit at least one)."""
    best = conf.masked_fill(~cand, float("-inf")).argmax(-1, keepdim=True)
    top1 = torch.zeros_like(commit).scatter_(-1, best, True) & cand
    return commit | top1
