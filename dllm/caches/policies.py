"""Cache policies: each chooses the active rows of a partial forward and when to refresh in full.

Every policy also computes the rows whose logits the decode loop reads this step (the window, shifted one
row left for Dream-style models) - see :func:`dllm.caches.base.logit_rows`; ``select`` returns the rows
it recomputes on top of that, or ``None`` for a full forward. ``refresh_every=N`` forces a full forward
every N forwards of the row (1: every step, which reproduces the no-cache run exactly). Every decision is
per row (``refresh_rows``: rows recomputed in full this step; ``select``: the rows of a partial forward), so
a row's output does not depend on the rows beside it.
"""

from __future__ import annotations

import torch

from dllm.caches.base import CacheState, KVCache, check_refresh_every, logit_rows, read_cols, region_start
from dllm.ops import cached_arange, check_choice, check_int, moved_rows


def _cols(state: CacheState) -> torch.Tensor:
    return cached_arange(state.x.shape[1], state.x.device)[None]


class PrefixCache(KVCache):
    """Fast-dLLM prefix cache: reuse the prompt and finished blocks; recompute the current block and every
    position right of it; full forward at each block start (and every ``refresh_every`` forwards)."""

    name = "prefix"

    def refresh_rows(self, state):
        return region_start(state)

    def refreshes_at(self, step_in, row_nfe):
        return step_in == 0 or super().refreshes_at(step_in, row_nfe)

    def select(self, state):
        return _cols(state) >= (state.lo - state.shift)[:, None]


class DualCache(KVCache):
    """Fast-dLLM dual cache: recompute the current block only (prefix and suffix reused); full forward at
    each block start (and every ``refresh_every`` forwards)."""

    name = "dual"

    def refresh_rows(self, state):
        return region_start(state)

    def refreshes_at(self, step_in, row_nfe):
        return step_in == 0 or super().refreshes_at(step_in, row_nfe)

    def select(self, state):
        c = _cols(state)
        return (c >= (state.lo - state.shift)[:, None]) & (c < state.hi[:, None])


class DKVDecode(KVCache):
    """dKV-Cache-Decode (``horseee/dKV-Cache``, ``generation_utils/llada_dkv_cache_decode.py``): recompute every
    still-masked position and the tokens decoded at the previous step (the delayed rule: a token decoded at
    step t is recomputed at t + 1 and read from the cache from t + 2), nothing else: tokens of the current
    block decoded two or more steps ago keep their cached K/V and get no logits (no sampler reads them). Full
    forward at the block-local steps ``i < full_steps`` and ``i % refresh_every == 0`` (the reference's
    ``cache_reloading_step``, default 8; 1: every step, the no-cache run).

    ``refresh="global"`` is the earlier variant of this policy: the whole current block is recomputed at every
    step and full forwards come every ``refresh_every`` forwards counted over the whole generation (as the
    other caches count them) plus the first ``full_steps`` steps of each block."""

    name = "dkv-decode"
    REFRESH = ("block", "global")

    def __init__(self, refresh_every: int | None = 8, full_steps: int = 2, refresh: str = "block"):
        check_choice("dkv-decode refresh", refresh, self.REFRESH)
        check_refresh_every(refresh_every)
        check_int("full_steps", full_steps, 0,
                  fix=" (full forwards at the start of each block; dKV-Cache-Decode uses 2, 0: none)")
        super().__init__(refresh_every if refresh == "global" else None)
        self.reload = None if refresh_every is None else int(refresh_every)
        self.full_steps, self.refresh = int(full_steps), refresh
        self.sparse_logits = refresh == "block"

    def __repr__(self) -> str:
        return f"DKVDecode(refresh_every={self.reload}, full_steps={self.full_steps}, refresh={self.refresh!r})"

    def refresh_rows(self, state):
        full = state.step_in < self.full_steps
        if self.refresh == "block" and self.reload is not None:
            full = full | (state.step_in % self.reload == 0)
        return full

    def refreshes_at(self, step_in, row_nfe):
        full = step_in < self.full_steps or (self.refresh == "block" and self.reload is not None
                                             and step_in % self.reload == 0)
        return full or super().refreshes_at(step_in, row_nfe)

    def select(self, state):
        return (state.x == state.mask_id) | state.committed

    def read_rows(self, state):
        if self.refresh == "global":
            return logit_rows(state)
        # the rows whose logits give the still-masked columns of the row's window (column c from row c - shift)
        masked = (state.x == state.mask_id) & read_cols(state)
        if not state.shift:
            return masked
        rows = torch.zeros_like(masked)
        rows[:, :-1] = masked[:, 1:]
        return rows


class DKVGreedy(KVCache):
    """dKV-Cache-Greedy, adapted: masks are cached too. Recomputed each step: the tokens decoded at the
    previous step and the rows whose logits are read (the current region: in dllm every column the sampler
    reads is computed, so the reference's "to decode next + masked neighbours" window is the region);
    everything else, masks included, comes from the cache. Full forward only every ``refresh_every``
    forwards (default 4), not at block starts."""

    name = "dkv-greedy"

    def __init__(self, refresh_every: int | None = 4):
        super().__init__(refresh_every)

    def select(self, state):
        c = _cols(state)
        return state.committed | ((c >= (state.lo - state.shift)[:, None]) & (c < state.hi[:, None]))


class FreeCache(KVCache):
    """FreeCache-style (FlashDLM, no public code): one full forward at the start; afterwards the prompt and
    finished blocks' K/V are reused and never recomputed in full. At a block start the just-finished block
    is recomputed once with its final tokens (its clean K/V), together with the new block; within a block
    only the block is recomputed (later masks keep their first K/V)."""

    name = "freecache"
    pipelined = False  # a plan keeps the region start the next one reads (after_plan)

    def on_reset(self):
        self.cur_lo = None

    def refresh_rows(self, state):
        # a row's first forward is full (in generate: the first forward of all; a row joining a filled cache)
        if state.row_nfe is None:
            return torch.zeros_like(state.active)
        return state.row_nfe == 0

    def refreshes_at(self, step_in, row_nfe):
        return row_nfe == 0 or super().refreshes_at(step_in, row_nfe)

    def after_plan(self, state, rows):
        self.cur_lo = state.lo.clone()

    def move_rows(self, d: int, keep: torch.Tensor | None, n_new: int) -> None:
        """:meth:`KVCache.move_rows`, and its per-row state: each row's region start at the last plan (a canvas
        column, shifted by ``d``; a joining row's first forward is full: :meth:`refresh_rows`)."""
        super().move_rows(d, keep, n_new)
        if self.cur_lo is not None:
            self.cur_lo = moved_rows(self.cur_lo, keep, n_new, d=d, shift=True)

    def select(self, state):
        start = torch.where(state.step_in == 0, self.cur_lo, state.lo)
        c = _cols(state)
        return (c >= (start - state.shift)[:, None]) & (c < state.hi[:, None])


class BlockExact(KVCache):
    """The exact cache of block-diffusion checkpoints (attention bidirectional inside a block of the model's
    ``block_size``, causal across blocks; SDAR). A block's keys and values depend only on the tokens of that block
    and earlier ones, so once a block holds no mask they are final: each forward recomputes a row from the start
    of its first block whose stored K/V are not final yet (a block that finished at the previous step is
    recomputed once, with its final tokens) to the end of the block holding the region's last column; earlier
    blocks come from the cache, never refreshed, and later blocks are not attended to. The logits equal those
    of no cache (up to float rounding of the smaller matrix products), whatever the block layout of the
    decoding. Needs a block-diffusion model (``generate`` gives it the model's block size)."""

    name = "block"
    pipelined = False  # a plan keeps the final columns the next one reads (after_plan)

    def __init__(self, block_size: int | None = None):
        super().__init__(None)
        if block_size is not None:
            check_int("block_size", block_size, 1, what="a positive integer or None",
                      fix=" (the model's attention block size; None: the model's, set by generate)")
        self.block_size = block_size
        #: the model's block size, set by ``generate`` for each model it decodes (``block_size=None``); else a size of
        #: the caller's, which must be a multiple of the model's
        self.model_grid = block_size is None

    def __repr__(self) -> str:
        return f"BlockExact(block_size={self.block_size})"

    def on_reset(self):
        self.final = None  # [B] canvas column up to which each row's stored K/V are final

    def _grid(self, state):
        """Each row's offset (the canvas column of its position 0) and the block start of every column."""
        if not self.block_size:
            raise ValueError("cache 'block' is the exact cache of block-diffusion checkpoints (config block_size, "
                             "e.g. SDAR); for LLaDA / Dream use 'prefix', 'dual' or another cache")
        B, T = state.x.shape
        off = (~state.valid).sum(-1) if state.valid is not None else torch.zeros(B, dtype=torch.long,
                                                                                   device=state.x.device)
        c = _cols(state)
        start = off[:, None] + (c - off[:, None]).clamp_min(0) // self.block_size * self.block_size
        return off, start

    def _first_open_block(self, state, start):
        """[B] start column of each row's first block that still holds a mask (the canvas length if none)."""
        masked = state.x == state.mask_id
        T = state.x.shape[1]
        return torch.where(masked, start, T).min(-1).values

    def after_plan(self, state, rows):
        _, start = self._grid(state)
        self.final = self._first_open_block(state, start)  # every block before it is computed now, mask-free

    def move_rows(self, d: int, keep: torch.Tensor | None, n_new: int) -> None:
        """:meth:`KVCache.move_rows`, and each row's column up to which its K/V are final (shifted by ``d``, at
        least 0; a joining row has none)."""
        super().move_rows(d, keep, n_new)
        if self.final is not None:
            self.final = moved_rows(self.final, keep, n_new, d=d, shift=True).clamp_min(0)

    def select(self, state):
        _, start = self._grid(state)
        c = _cols(state)
        last = (state.hi - 1).clamp_min(0)
        end = start.gather(1, last[:, None]) + self.block_size  # end of the block holding the region's last column
        return (c >= self.final[:, None]) & (c < end)
