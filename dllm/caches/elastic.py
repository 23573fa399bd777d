"""Elastic-Cache (arXiv 2510.14973): attention-aware, layer-aware refresh.

Per layer the cache keeps the layer inputs, the post-RoPE queries and the K/V of every row. Each step
computes only the tracked most-attended tokens, the tokens decoded at the previous step and the window
(the rows whose logits are read). At each layer still in reuse mode it compares the tracked tokens'
attention distribution over all keys under the old (cached) q/K against the new one: cosine similarity
over the head axis, averaged (as the reference does); the first layer where it drops below ``gamma``
makes every later layer recompute all rows, taking the stored inputs for the rows not computed (so a
refresh is approximate; only the first forward and forced refreshes are exact). The tracked tokens are,
per layer, the ``track_num`` decoded (or prompt) keys with the largest attention mass from the window
queries, unioned over layers. Everything is decided per row: each row has its own window, tracked tokens,
drift test and refresh layer, so a row's output is the same alone or in any batch (up to the float rounding
of a sum over a padded set of queries in a ragged batch).
"""

from __future__ import annotations

import math

import torch

from dllm import kernels
from dllm.caches.base import KVCache, logit_rows, rows_from_mask
from dllm.ops import check_int, check_range, moved_rows


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
    pipelined = False  # a plan keeps the tracked tokens and the drift test's state (after_plan)

    def __init__(self, gamma: float = 0.9, track_num: int = 1, refresh_every: int | None = None):
        super().__init__(refresh_every)
        check_range("gamma", gamma, 0, 1, fix="; the attention-drift threshold (Elastic-Cache uses 0.9)")
        check_int("track_num", track_num, 1, fix=" (tracked tokens per layer; Elastic-Cache uses 1)")
        self.gamma, self.track_num = float(gamma), int(track_num)

    def __repr__(self) -> str:
        return f"ElasticCache(gamma={self.gamma}, track_num={self.track_num}, refresh_every={self.refresh_every})"

    def on_reset(self):
        self.xc: list[torch.Tensor] = []
        self.qc: list[torch.Tensor] = []
        self.track = None  # [B, T] bool
        self._k_old = None
        self._switch = None  # [B] bool: rows whose drift test failed at the last layer (they refresh from the next)

    def refresh_rows(self, state):
        # a row's first forward computes all its rows (in generate: the first forward of all; a row joining a
        # filled cache); its drift test is skipped (after_plan)
        if state.row_nfe is None:
            return torch.zeros_like(state.active)
        return state.row_nfe == 0

    def move_rows(self, d: int, keep: torch.Tensor | None, n_new: int) -> None:
        """:meth:`KVCache.move_rows`, and its per-row state (the stored layer inputs and queries, the tracked
        tokens; a joining row's first forward computes all its rows: :meth:`refresh_rows`)."""
        super().move_rows(d, keep, n_new)
        B = self.batch

        def move(t: torch.Tensor, dim: int) -> torch.Tensor:
            r = t.shape[0] // B  # 2 under classifier-free guidance (the batch doubled)
            return torch.cat([moved_rows(t[j * B:(j + 1) * B], keep, n_new, d=d, dim=dim) for j in range(r)])

        self.xc = [move(t, 1) for t in self.xc]
        self.qc = [move(t, 2) for t in self.qc]
        if self.track is not None:
            self.track = move(self.track, 1)

    def select(self, state):
        mask = state.committed.clone()
        if self.track is not None and self.track.shape == mask.shape:
            mask |= self.track
        return mask

    def after_plan(self, state, rows):
        B, T = state.x.shape
        self._win = logit_rows(state)  # [B, T] bool, each row's own window
        self._masked = state.x == state.mask_id
        if state.valid is not None:
            self._masked = self._masked | ~state.valid  # padding is never tracked
        self._new_track = torch.zeros((B, T), dtype=torch.bool, device=state.x.device)
        self._row_refresh = torch.full((B,), -1, dtype=torch.long, device=state.x.device)
        self._testing = state.active.clone() if rows is not None and self.track is not None else None
        if self._testing is not None and state.row_nfe is not None:
            self._testing &= state.row_nfe > 0  # a row's first forward: nothing stored to test against
        self._switch = None
        if self._testing is not None:
            self._trk_rows = rows_from_mask(self.track)
            self._trk_ok = torch.arange(self._trk_rows.shape[1], device=rows.device)[None] < self.track.sum(-1, keepdim=True)
            self._positions(rows)
        else:
            self._trk_rows = None
        self._set_window(rows)

    def _positions(self, rows):
        """Where each tracked row sits in ``rows`` (first match)."""
        self._trk_pos = (rows[:, None, :] == self._trk_rows[:, :, None]).to(torch.int8).argmax(-1)

    def _set_window(self, rows):
        """``[B, Wm]`` positions of each row's window rows among the computed rows (``rows``; all ``T`` when
        None) and ``[B, Wm]`` bool, False on the padding of rows with fewer window rows."""
        win = self._win if rows is None else self._win.gather(1, rows)
        if rows is not None:  # a repeated row (padding) counts once
            first = torch.ones_like(win)
            first[:, 1:] = rows[:, 1:] != rows[:, :1]
            win = win & first
        n = win.sum(-1)
        wm = int(n.max())
        self._win_pos = torch.argsort(win.view(torch.uint8), dim=-1, descending=True, stable=True)[:, : max(wm, 1)]
        self._win_ok = torch.arange(self._win_pos.shape[1], device=win.device)[None] < n[:, None]
        self._win_ragged = bool((n != wm).any())

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
        r = xc.shape[0] // self._row_refresh.shape[0]  # 2 under classifier-free guidance
        xc.scatter_(1, rows[:, :, None].expand(-1, -1, h.shape[-1]), h)
        if self._switch is None or not bool(self._switch.any()):
            return None
        # Rows whose drift test failed at the previous layer compute every row from this layer on (the stored
        # inputs for the rows not computed); the others keep their rows (padded with their first row).
        sw = self._switch
        self._row_refresh = torch.where(sw, torch.full_like(self._row_refresh, layer), self._row_refresh)
        self._refresh_layer = layer if self._refresh_layer < 0 else self._refresh_layer
        self._switch = None
        if self._testing is not None:
            self._testing = self._testing & ~sw
        T = xc.shape[1]
        full_rows = self._row_refresh >= 0
        if bool(full_rows.all()):
            self._set_window(None)
            return xc.clone(), None
        Q = rows.shape[1]
        pad = rows[:, :1].expand(-1, T - Q)
        keep = torch.cat([rows, pad], 1)
        new_rows = torch.where(full_rows.repeat(r)[:, None], torch.arange(T, device=rows.device)[None], keep)
        new_h = xc.gather(1, new_rows[:, :, None].expand(-1, -1, h.shape[-1]))
        if self._testing is not None:
            self._positions(new_rows[: new_rows.shape[0] // r])
        self._set_window(new_rows[: new_rows.shape[0] // r])
        return new_h, new_rows

    def update(self, layer, k, v, rows=None):
        if rows is not None and self._trk_rows is not None and self._testing is not None:
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
        else:
            qc = self.qc[layer]
            idx = rows[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3])
            if self._trk_rows is not None and self._testing is not None and self._k_old is not None:
                tidx = self._trk_rows.repeat(r, 1)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3])
                q_old = qc.gather(2, tidx)
                pidx = self._trk_pos.repeat(r, 1)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3])
                q_new = q.gather(2, pidx)
                kidx, kvals = self._k_old
                k_old = k.clone().scatter_(2, kidx, kvals)
                a_old, a_new = _probs(q_old, k_old, key_mask), _probs(q_new, k, key_mask)
                cs = torch.nn.functional.cosine_similarity(a_old, a_new, dim=1)  # over heads: [rB, Lt, T]
                ok = self._trk_ok.repeat(r, 1)[..., None].to(cs.dtype)  # [rB, Lt, 1] real tracked rows
                if key_mask is not None:  # the mean over keys counts the row's own keys, not left padding
                    ok = ok * key_mask[:, None, :].to(cs.dtype)
                else:
                    ok = ok.expand_as(cs)
                sim = (cs * ok).sum((1, 2)) / ok.sum((1, 2)).clamp_min(1)  # per row
                sim = sim.view(r, B).mean(0)
                drift = self._testing & (sim < self.gamma)
                if layer + 1 < L:
                    self._switch = drift
            self._k_old = None
            qc.scatter_(2, idx, q)
        wpos = self._win_pos.repeat(r, 1)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3])
        q_win = q.gather(2, wpos)
        if self._win_ragged:  # rows with fewer window rows: their padded queries add no mass
            ok = self._win_ok.repeat(r, 1)[:, None, :, None]
            mass = (_probs(q_win, k, key_mask) * ok).sum((1, 2))
        else:
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
