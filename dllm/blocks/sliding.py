"""Elastic-Cache's sliding decoding window as a block policy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dllm.blocks.fixed import BlockPolicyBase
from dllm.config import GenerateConfig
from dllm.ops import check_int

#: Elastic-Cache's decoding window per model family (``SlidingWindow(None)`` takes the model's)
FAMILY_WINDOWS = {"llada": 16, "dream": 32}


@dataclass(frozen=True)
class SlidingWindow(BlockPolicyBase):
    """Elastic-Cache's decoding window: at every step a row's candidates are its first ``window`` remaining
    masks, so the window slides forward as soon as its leftmost masks are decoded (instead of a fixed block
    that advances only when it is finished). The region is ``[first mask, column after the window-th mask)``
    (masked columns only are candidates); the whole generation is one schedule region (``steps`` spread over
    ``gen_length``). The decode loop calls :meth:`slide` before every forward."""

    window: int | None = 16
    name: str = "sliding"

    def __post_init__(self):
        if self.window is not None:
            check_int("window", self.window, 1, fix=" (masks decoded at once; Elastic-Cache uses 16, 32 on Dream; "
                      "None: the model family's)")

    def bind(self, model) -> SlidingWindow:
        """``window=None``: Elastic-Cache's default for ``model``'s family, 16 (LLaDA) or 32 (Dream)."""
        if self.window is not None:
            return self
        family = getattr(getattr(model, "spec", None), "family", "llada")
        return dataclasses.replace(self, window=FAMILY_WINDOWS.get(family, FAMILY_WINDOWS["llada"]))

    def validate(self, cfg: GenerateConfig) -> None:
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
        window = self.window or FAMILY_WINDOWS["llada"]  # None outside generate (which binds it to the model)
        hi = torch.where(csum[:, -1] >= window, (csum < window).sum(-1) + 1, torch.full_like(lo, T))
        hi = torch.where(new_lo >= T, new_lo, hi)
        return new_lo, hi
