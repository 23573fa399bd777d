"""Multi-block decoding (d3LLM's ``generate_multi_block``): the next block starts before the current one is done."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.blocks.fixed import BlockPolicyBase
from dllm.config import GenerateConfig
from dllm.ops import check_int, check_range


def block_states(masked: torch.Tensor, start: torch.Tensor, block: int, add_threshold: float,
                 activate_threshold: float):
    """The blocks of each row, from its canvas (d3LLM's block bookkeeping, derived instead of tracked).

    Blocks of ``block`` columns follow each row's generation start ``start`` ``[B]``; a block's progress is the
    share of its positions decoded. Block 0 exists from the start; block ``k + 1`` is added once block ``k``'s
    progress reaches ``add_threshold`` (or it has no mask left); block ``k`` is *fully activated* once block
    ``k - 1``'s progress reaches ``activate_threshold`` (block 0: when ``activate_threshold <= 1``, the prompt
    counting as done). Progress only grows and a block cannot progress before it is added, so these derived
    states are the reference's tracked ones, for ``add_threshold > 0``.

    Returns ``(block_of, created, activated, masks)``: the block index of every column (``-1`` before the
    start) ``[B, T]``; ``[B, NB]`` bool created / fully activated; ``[B, NB]`` masks left per block."""
    B, T = masked.shape
    cols = torch.arange(T, device=masked.device)[None]
    rel = cols - start[:, None]
    inside = rel >= 0
    block_of = torch.where(inside, rel // block, -1)
    nb = -(-T // block)
    idx = (block_of + 1).clamp_min(0)
    masks = torch.zeros(B, nb + 1, dtype=torch.long, device=masked.device).scatter_add_(
        1, idx, (masked & inside).long())[:, 1:]
    size = torch.zeros(B, nb + 1, dtype=torch.long, device=masked.device).scatter_add_(1, idx, inside.long())[:, 1:]
    exists = size > 0
    progress = 1 - masks / size.clamp_min(1)
    prev_progress = torch.cat([torch.ones_like(progress[:, :1]), progress[:, :-1]], 1)  # block -1: the prompt
    created = torch.cumprod((prev_progress >= add_threshold).long(), 1).bool() & exists  # (a done block: progress 1)
    activated = created & (prev_progress >= activate_threshold)
    return block_of, created, activated, masks


@dataclass(frozen=True)
class MultiBlock(BlockPolicyBase):
    """d3LLM's pipelined multi-block decoding (``generate_multi_block`` of hao-ai-lab/d3LLM): blocks of
    ``block_length`` after the prompt; the next block is added once the last one's progress (share decoded)
    reaches ``add_threshold``, so several blocks decode at once; a block is *fully activated* once the block
    before it reaches ``activate_threshold`` (the sampler then guarantees it progress, see
    :class:`dllm.samplers.presets.MultiBlockSampler`). Before every forward a row's region is ``[generation
    start, end of its last block that is fully activated or still holds masks)``; the row is one schedule
    region and is done when no mask is left. Any sampler decides within it; the ``multiblock`` preset is
    d3LLM's (its entropy threshold plus the activated block's progress)."""

    block_length: int = 32
    add_threshold: float = 0.5
    activate_threshold: float = 0.5
    name: str = "multiblock"

    def __post_init__(self):
        check_int("block_length", self.block_length, 1, what="a positive integer", fix=" (d3LLM uses 32)")
        check_range("add_threshold", self.add_threshold, 0, 1, lo_open=True,
                    fix="; the share of a block decoded before the next one starts (d3LLM: 0.5)")
        check_range("activate_threshold", self.activate_threshold, 0, 1,
                    fix="; the share of the previous block decoded before a block is fully activated (d3LLM: 0.5)")

    def validate(self, cfg: GenerateConfig) -> None:
        if cfg.gen_length % self.block_length:
            raise ValueError(f"gen_length ({cfg.gen_length}) must be a multiple of the multi-block block_length "
                             f"({self.block_length})")

    def next_region(self, lo, gen_hi, cfg):
        return torch.full_like(lo, gen_hi), torch.full_like(lo, cfg.total_steps)

    def states(self, masked: torch.Tensor, start: torch.Tensor):
        return block_states(masked, start, self.block_length, self.add_threshold, self.activate_threshold)

    def slide(self, masked: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)``: ``lo`` stays the generation start (the anchor of the blocks; ``T`` once the row is done),
        ``hi`` the end of the row's last block that is fully activated or still holds masks."""
        T = masked.shape[1]
        _, created, activated, masks = self.states(masked, lo)
        live = created & (activated | (masks > 0))
        nb = live.shape[1]
        last = torch.where(live, torch.arange(nb, device=lo.device)[None], -1).max(-1).values
        hi = (lo + (last + 1) * self.block_length).clamp_max(T)
        done = lo >= T
        return lo, torch.where(done, lo, hi)
