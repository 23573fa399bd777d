"""Cache policies: each chooses the active rows of a partial forward and when to refresh in full.

Every policy also computes the rows whose logits the decode loop reads this step (the window, shifted one
row left for Dream-style models) - see :func:`dllm.caches.base.logit_rows`; ``select`` returns the rows
it recomputes on top of that, or ``None`` for a full forward. ``refresh_every=N`` forces a full forward
every N forwards (1: every step, which reproduces the no-cache run exactly).
"""

from __future__ import annotations

import torch

from dllm.caches.base import CacheState, KVCache, region_start


def _cols(state: CacheState) -> torch.Tensor:
    return torch.arange(state.x.shape[1], device=state.x.device)[None]


class PrefixCache(KVCache):
    """Fast-dLLM prefix cache: reuse the prompt and finished blocks; recompute the current block and every
    position right of it; full forward at each block start (and every ``refresh_every`` forwards)."""

    name = "prefix"

    def select(self, state):
        if region_start(state):
            return None
        return _cols(state) >= (state.lo - state.shift)[:, None]


class DualCache(KVCache):
    """Fast-dLLM dual cache: recompute the current block only (prefix and suffix reused); full forward at
    each block start (and every ``refresh_every`` forwards)."""

    name = "dual"

    def select(self, state):
        if region_start(state):
            return None
        c = _cols(state)
        return (c >= (state.lo - state.shift)[:, None]) & (c < state.hi[:, None])


class DKVDecode(KVCache):
    """dKV-Cache-Decode: recompute every still-masked position and the tokens decoded at the previous step
    (the delayed rule: a token decoded at step t is recomputed at t + 1 and read from the cache from t + 2);
    full forward at the first ``full_steps`` steps of each block and every ``refresh_every`` forwards
    (the reference's ``cache_reloading_step``; default 8)."""

    name = "dkv-decode"

    def __init__(self, refresh_every: int | None = 8, full_steps: int = 2):
        super().__init__(refresh_every)
        self.full_steps = int(full_steps)

    def select(self, state):
        if bool((state.active & (state.step_in < self.full_steps)).any()):
            return None
        return (state.x == state.mask_id) | state.committed


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

    def on_reset(self):
        self.cur_lo = None

    def after_plan(self, state, rows):
        self.cur_lo = state.lo.clone()

    def select(self, state):
        start = torch.where(state.step_in == 0, self.cur_lo, state.lo)
        c = _cols(state)
        return (c >= (start - state.shift)[:, None]) & (c < state.hi[:, None])
