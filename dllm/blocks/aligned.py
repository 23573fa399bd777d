"""Blocks on the model's block grid, for block-diffusion checkpoints (SDAR)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.blocks.fixed import BlockPolicyBase
from dllm.config import GenerateConfig
from dllm.ops import check_int


@dataclass(frozen=True)
class AlignedBlocks(BlockPolicyBase):
    """Regions that end at multiples of ``block_length`` counted from each row's first prompt token (its position
    0), as a block-diffusion model's attention blocks are laid out: the first region holds the rest of the
    prompt's last block (SDAR's ``block_diffusion_generate`` layout), each later region one whole block; the last
    region ends with the generation. ``block_length`` default: the model's ``block_size``. Every region gets the
    same number of steps, ``steps * block_length / gen_length`` (SDAR's ``denoising_steps`` per block)."""

    block_length: int | None = None
    name: str = "aligned"
    row_offsets = True  # next_region gets each row's offset (the canvas column of its position 0)

    def __post_init__(self):
        if self.block_length is not None:
            check_int("block_length", self.block_length, 1, what="a positive integer or None",
                      fix=" (the model's attention block size; None: its config block_size)")

    def bind(self, model) -> AlignedBlocks:
        bl = self.block_length or getattr(getattr(model, "config", None), "block_size", None)
        if not bl:
            raise ValueError("aligned blocks need a block length: pass block_length, or use a block-diffusion "
                             "checkpoint (config block_size, e.g. SDAR)")
        return AlignedBlocks(bl, self.name)

    def steps_per_block(self, cfg: GenerateConfig) -> int:
        return cfg.total_steps * self.block_length // cfg.gen_length

    def validate(self, cfg: GenerateConfig) -> None:
        bl, G, S = self.block_length, cfg.gen_length, cfg.total_steps
        if (S * bl) % G or S * bl < G:
            raise ValueError(f"aligned blocks of {bl} take steps * {bl} / gen_length steps each, which must be a whole "
                             f"number >= 1: steps ({S}) * {bl} is not a multiple of gen_length ({G}); e.g. steps={G} "
                             f"({bl} steps per block)")

    def next_region(self, lo, gen_hi, cfg, offsets=None):
        if offsets is None:
            offsets = torch.zeros_like(lo)
        bl = self.block_length
        hi = (offsets + ((lo - offsets) // bl + 1) * bl).clamp_max(gen_hi)
        return hi, torch.full_like(lo, self.steps_per_block(cfg))
