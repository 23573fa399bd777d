"""Elastic-Cache (arXiv 2510.14973): attention-aware, layer-aware refresh.

Per layer the cache keeps the layer inputs, the post-RoPE queries and the K/V of every row. Each step
computes only the tracked most-attended tokens, the tokens decoded at the previous step and the window
(the rows whose logits are read). At each layer still in reuse mode it compares the tracked tokens'
attention distribution over all keys under the old (cached) q/K against the new one: cosine similarity
over the head axis, averaged (as the reference does); the first layer where it drops below ``gamma``
makes every later layer recompute all rows, taking the stored inputs for the rows not computed (so a
refresh is approximate; only the first forward and forced refreshes are exact). The tracked tokens are,
per layer, the ``track_num`` decoded (or prompt) keys with the largest attention mass from the window
queries, unioned over layers. In a batch the refresh is decided for all rows together when any row
drifts (more computation, never row mixing).
"""

from __future__ import annotations

import math

import torch

from dllm import kernels
from dllm.caches.base import KVCache, logit_rows, rows_from_mask


def _probs(q: torch.Tensor, k: torch.Tensor, key_mask) -> torch.Tensor:
    """Softmax attention ``[B, Hq, Lq, T]`` in float32."""
    kf = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q.float() @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1)


class ElasticCache(KVCache):
    """Elastic-Cache policy (see the module docstring). ``gamma``: drift threshold (0.9); ``track_num``:
    tracked tokens per layer (1); ``refresh_every``: also force a full forward every N forwards (None)."""

    name = "elastic"

    def __init__(self, gamma: float = 0.9, track_num: int = 1, refresh_every: int | None = None):
        super().__init__(refresh_every)
        if not 0 <= gamma <= 1:
            raise ValueError(f"gamma={gamma!r} must be in [0, 1] (the reference uses 0.9)")
        if track_num < 1:
            raise ValueError(f"track_num={track_num!r} must be >= 1")
        self.gamma, self.track_num = float(gamma), int(track_num)

    def __repr__(self) -> str:
        return f"ElasticCache(gamma={self.gamma}, track_num={self.track_num}, refresh_every={self.refresh_every})"

    def on_reset(self):
        self.xc: list[torch.Tensor] = []
        self.qc: list[torch.Tensor] = []
        self.track = None  # [B, T] bool
        self._k_old = None
        self.refresh_from = None

    def select(self, state):
        mask = state.committed.clone()
        if self.track is not None and self.track.shape == mask.shape:
            mask |= self.track
        return mask

    def after_plan(self, state, rows):
        B, T = state.x.shape
        self._win = logit_rows(state)[0]  # [T] bool, the same columns for every row
        self._masked = state.x == state.mask_id
        if state.valid is not None:
            self._masked = self._masked | ~state.valid  # padding is never tracked
        self._new_track = torch.zeros((B, T), dtype=torch.bool, device=state.x.device)
        self.refresh_from = None
        if rows is not None and self.track is not None:
            self._trk_rows = rows_from_mask(self.track)
            self._trk_pos = (rows[:, None, :] == self._trk_rows[:, :, None]).to(torch.int8).argmax(-1)
            self._win_pos = torch.argsort((~self._win[rows]).to(torch.int8), dim=-1, stable=True)[
                :, : int(self._win.sum())]
        else:
            self._trk_rows = None

    # -- model hooks ---------------------------------------------------------------------------------------
    def layer_input(self, layer, h, rows):
        if rows is None:
            if len(self.xc) <= layer:
                self.xc.append(torch.empty_like(h))
            if self.xc[layer].shape != h.shape:
                self.xc[layer] = torch.empty_like(h)
            self.xc[layer].copy_(h)
            return None
        xc = self.xc[layer]
        xc.scatter_(1, rows[:, :, None].expand(-1, -1, h.shape[-1]), h)
        if self.refresh_from == layer:
            self._refresh_layer = layer
            return xc.clone()
        return None

    def update(self, layer, k, v, rows=None):
        if rows is not None and self._trk_rows is not None and self.refresh_from is None:
            idx = rows[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            self._k_old = (idx, self.k[layer].gather(2, idx))  # what this step overwrites
        return super().update(layer, k, v, rows)

    def observe(self, layer, q, k, key_mask, rows):
        L = len(self.xc)
        B = self._new_track.shape[0]
        r = q.shape[0] // B  # 2 under classifier-free guidance (the batch is doubled)
        if rows is None:
            if len(self.qc) <= layer:
                self.qc.append(torch.empty_like(q))
            if self.qc[layer].shape != q.shape:
                self.qc[layer] = torch.empty_like(q)
            self.qc[layer].copy_(q)
            q_win = q[:, :, self._win]
        else:
            qc = self.qc[layer]
            idx = rows[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3])
            if self._trk_rows is not None and self.refresh_from is None and self._k_old is not None:
                tidx = self._trk_rows.repeat(r, 1)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3])
                q_old = qc.gather(2, tidx)
                pidx = self._trk_pos.repeat(r, 1)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3])
                q_new = q.gather(2, pidx)
                kidx, kvals = self._k_old
                k_old = k.clone().scatter_(2, kidx, kvals)
                a_old, a_new = _probs(q_old, k_old, key_mask), _probs(q_new, k, key_mask)
                sim = torch.nn.functional.cosine_similarity(a_old, a_new, dim=1).mean()  # over heads
                if float(sim) < self.gamma and layer + 1 < L:
                    self.refresh_from = layer + 1
            self._k_old = None
            qc.scatter_(2, idx, q)
            wpos = self._win_pos.repeat(r, 1)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3])
            q_win = q.gather(2, wpos)
        mass = kernels.attention_mass(q_win, k, key_mask)
        mass = mass.view(r, B, -1).sum(0)
        mass = mass.masked_fill(self._masked, -1.0)
        top = mass.topk(min(self.track_num, mass.shape[1]), dim=-1).indices
        self._new_track.scatter_(1, top, True)

    def step_stats(self, n_layers):
        self.track = self._new_track & ~self._masked
        return super().step_stats(n_layers)

    @property
    def nbytes(self) -> int:
        """K/V plus the stored layer inputs and queries."""
        extra = sum(t.numel() * t.element_size() for t in self.xc + self.qc)
        return super().nbytes + extra
