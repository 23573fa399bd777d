"""Block policies: which region of the canvas is being decoded; fixed blocks.

Regions are contiguous and advance left to right per row: when a row's region has no masks left, the
policy is asked for the next one, starting where the last ended. Rows advance independently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from dllm.config import GenerateConfig
from dllm.ops import check_int


@runtime_checkable
class BlockPolicy(Protocol):
    """Which region of the canvas each row decodes. Required: ``next_region``; every other hook is declared
    here with its no-op default (:class:`BlockPolicyBase`); the decode loop calls them directly."""

    name: str
    #: ``refine(logits, win_lo, lo, hi, steps, fresh, cfg) -> (hi, steps, info)`` or None: called after each
    #: forward with the window's logits to fix the end of the regions that start at this step (``fresh`` rows;
    #: AdaBlock)
    refine: Callable | None
    #: ``slide(masked, lo) -> (lo, hi)`` or None: recompute every row's region before each forward (a sliding
    #: window; such a row is one schedule region and is done when no mask is left)
    slide: Callable | None
    #: True: ``next_region`` also gets ``offsets`` ``[B]``, each row's canvas column of its position 0 (aligned blocks)
    row_offsets: bool
    #: True: ``refine`` takes per-row windows (``win_lo`` a ``[B, 1]`` tensor of each row's canvas column of its window
    #: position 0, where the decode loop gives each row its own window: ``SamplerBase.row_windows``); False: a policy
    #: with ``refine`` keeps every row over the union window
    refine_rows: bool

    def bind(self, model) -> BlockPolicy:  # pragma: no cover - protocol
        """This policy with model-dependent settings resolved (once per ``generate``)."""

    def validate(self, cfg: GenerateConfig) -> None:  # pragma: no cover - protocol
        """Raise ValueError for settings this policy cannot honour."""

    def next_region(self, lo: torch.Tensor, gen_hi: int, cfg: GenerateConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """Given each row's region start ``lo`` ``[B]`` (canvas columns) return ``(hi, steps)``: the
        exclusive end of the region and the schedule length (steps) assigned to it."""


class BlockPolicyBase:
    """No-op defaults of the optional :class:`BlockPolicy` hooks."""

    refine = None
    slide = None
    row_offsets = False
    refine_rows = False

    def bind(self, model):
        return self

    def validate(self, cfg: GenerateConfig) -> None:
        return None


@dataclass(frozen=True)
class FixedBlocks(BlockPolicyBase):
    """Semi-autoregressive blocks of ``block_length`` (default: ``GenerateConfig.block_length``; the whole
    canvas when that is ``None``). ``steps`` is split evenly over the blocks, as in LLaDA."""

    block_length: int | None = None
    whole: bool = False
    name: str = "fixed"

    def __post_init__(self):
        if self.block_length is not None:
            check_int("block_length", self.block_length, 1, what="a positive integer or None",
                      fix=" (tokens per block; None: GenerateConfig.block_length)")
        if not isinstance(self.whole, bool):
            raise ValueError(f"whole={self.whole!r} must be True or False (True: one region over the whole generation)")

    def size(self, cfg: GenerateConfig) -> int:
        return cfg.gen_length if self.whole else (self.block_length or cfg.block)

    def validate(self, cfg: GenerateConfig) -> None:
        own = cfg.gen_length if self.whole else self.block_length
        if own is not None and cfg.block_length is not None and cfg.block_length != own:
            what = "one block over the whole generation" if self.whole else f"FixedBlocks(block_length={own})"
            raise ValueError(f"block_length={cfg.block_length} disagrees with the block policy ({what}), which would "
                             "ignore it; give the block length once: in the policy or as block_length")
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
