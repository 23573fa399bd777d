"""Block policies: which region of the canvas is being decoded.

Regions are contiguous and advance left to right per row: when a row's region has no masks left, the
policy is asked for the next one, starting where the last ended. Rows advance independently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from dllm.config import GenerateConfig


@runtime_checkable
class BlockPolicy(Protocol):
    """Optional hooks the decode loop also honours: ``bind(model) -> policy`` (resolve model-dependent
    settings, once per ``generate``) and ``refine(logits, win_lo, lo, hi, steps, fresh, cfg) -> (hi, steps,
    info)``, called after each forward with the window's logits to fix the end of the regions that start at
    this step (``fresh`` rows; AdaBlock)."""

    def validate(self, cfg: GenerateConfig) -> None:  # pragma: no cover - protocol
        """Raise ValueError for settings this policy cannot honour."""

    def next_region(self, lo: torch.Tensor, gen_hi: int, cfg: GenerateConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """Given each row's region start ``lo`` ``[B]`` (canvas columns) return ``(hi, steps)``: the
        exclusive end of the region and the schedule length (steps) assigned to it."""


@dataclass(frozen=True)
class FixedBlocks:
    """Semi-autoregressive blocks of ``block_length`` (default: ``GenerateConfig.block_length``; the whole
    canvas when that is ``None``). ``steps`` is split evenly over the blocks, as in LLaDA."""

    block_length: int | None = None
    whole: bool = False
    name: str = "fixed"

    def size(self, cfg: GenerateConfig) -> int:
        return cfg.gen_length if self.whole else (self.block_length or cfg.block)

    def validate(self, cfg: GenerateConfig) -> None:
        bl, G, S = self.size(cfg), cfg.gen_length, cfg.total_steps
        if bl > G:
            raise ValueError(f"block_length ({bl}) is larger than gen_length ({G}); use block_length <= gen_length")
        if G % bl:
            raise ValueError(
                f"gen_length ({G}) is not a multiple of block_length ({bl}); choose e.g. gen_length="
                f"{(G // bl + 1) * bl} or a block_length that divides {G}"
            )
        n_blocks = G // bl
        if S % n_blocks:
            raise ValueError(
                f"steps ({S}) must divide evenly over the {n_blocks} blocks (gen_length {G} / block_length {bl}); "
                f"use a multiple of {n_blocks}, e.g. steps={max(n_blocks, S // n_blocks * n_blocks)}"
            )
        if S > G:
            raise ValueError(
                f"steps ({S}) exceeds gen_length ({G}): some steps would commit nothing; use steps <= gen_length"
            )

    def next_region(self, lo, gen_hi, cfg):
        bl = self.size(cfg)
        hi = (lo + bl).clamp_max(gen_hi)
        steps = torch.full_like(lo, cfg.total_steps // (cfg.gen_length // bl))
        return hi, steps


def WholeCanvas() -> FixedBlocks:
    """One region covering the whole generation (Dream's default; LLaDA with block_length = gen_length)."""
    return FixedBlocks(whole=True, name="canvas")


@dataclass(frozen=True)
class SlidingWindow:
    """Elastic-Cache's decoding window: at every step a row's candidates are its first ``window`` remaining
    masks, so the window slides forward as soon as its leftmost masks are decoded (instead of a fixed block
    that advances only when it is finished). The region is ``[first mask, column after the window-th mask)``
    (masked columns only are candidates); the whole generation is one schedule region (``steps`` spread over
    ``gen_length``). The decode loop calls :meth:`slide` before every forward."""

    window: int = 16
    name: str = "sliding"

    def validate(self, cfg: GenerateConfig) -> None:
        if int(self.window) != self.window or self.window < 1:
            raise ValueError(f"sliding window must be a positive integer, got {self.window!r}")
        if cfg.total_steps > cfg.gen_length:
            raise ValueError(f"steps ({cfg.total_steps}) exceeds gen_length ({cfg.gen_length}): some steps "
                             "would commit nothing; use steps <= gen_length")

    def next_region(self, lo, gen_hi, cfg):
        return torch.full_like(lo, gen_hi), torch.full_like(lo, cfg.total_steps)

    def slide(self, masked: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)`` per row from the mask map ``masked`` ``[B, T]`` and the current starts ``lo``: the first
        masked column at or after ``lo`` and the column after the ``window``-th one (``T`` when fewer remain;
        ``lo = hi = T`` for a row without masks)."""
        T = masked.shape[1]
        cols = torch.arange(T, device=masked.device)
        m = masked & (cols[None] >= lo[:, None])
        csum = m.long().cumsum(-1)
        new_lo = (csum == 0).sum(-1)  # columns before the first remaining mask
        hi = torch.where(csum[:, -1] >= self.window, (csum < self.window).sum(-1) + 1, torch.full_like(lo, T))
        hi = torch.where(new_lo >= T, new_lo, hi)
        return new_lo, hi


def _preferred_block_length(sampler) -> int | None:
    get = getattr(sampler, "preferred_block_length", None)
    return get() if callable(get) else getattr(sampler, "block_length", None)


def resolve_blocks(model, sampler, config: GenerateConfig, block_policy=None):
    """``(config, policy)`` for ``generate``: the caller's ``block_policy``; else the sampler's preferred one
    (its ``block_policy`` attribute, e.g. AdaBlock presets); else fixed blocks of ``config.block_length``,
    or of the sampler's preferred ``block_length`` (presets: ``fast-dllm`` 32, ...) when the caller left
    ``block_length`` unset and it is shorter than ``gen_length``. The policy is bound to the model (if it
    has ``bind``) and validated."""
    policy, preset_bl = block_policy, None
    if policy is None:
        policy = getattr(sampler, "block_policy", None)
    if policy is None:
        bl = _preferred_block_length(sampler)
        if bl and config.block_length is None and bl < config.gen_length:
            preset_bl = bl
            config = dataclasses.replace(config, block_length=bl)
        policy = FixedBlocks()
    if hasattr(policy, "bind"):
        policy = policy.bind(model)
    try:
        policy.validate(config)
    except ValueError as e:
        if preset_bl is None:
            raise
        raise ValueError(f"{e} (block_length={preset_bl} is the preferred block length of sampler "
                         f"{getattr(sampler, 'name', sampler)!r}; pass block_length=... to choose another)") from None
    return config, policy
