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

On the graph path (:attr:`ElasticCache.speculative`, set by the decode loop where the cached steps replay CUDA
graphs) a partial forward does not decide inside itself: it runs its layers on its planned rows with no host
synchronisation, each layer's drift test writing into a device buffer, and the per-step state its hooks read lives
in buffers that keep their addresses. It runs up to the layer after the one where the last step's first test failed
(:meth:`ElasticCache.speculate_until`, ``Transformer.forward(stop_layer=...)``; every layer where none failed), then
one synchronisation reads the first failing layer of each row (:meth:`ElasticCache.redo_plan`). Where a row's tests
have not all run yet the forward is resumed there (``start_layer``) and read again; where a test failed, the forward
is redone from the layer after the first failure on the layer inputs stored for it, each row switching to every row
at the layer the eager forward would have switched it at (known now; no test runs again). What the speculative
layers after the failure wrote is overwritten by the redo: a refreshing row's later layers rewrite every row, the
others write the same values again. The same decisions and tokens as the eager forward, up to the float rounding
of the drift test's mean (over a fixed width of tracked tokens, padding masked out).
"""

from __future__ import annotations

import torch

from dllm import kernels
from dllm.caches.base import KVCache, logit_rows, moved_batch, padded_rows, rows_from_mask
from dllm.ops import cached_arange, check_int, check_range


def _rows(t: torch.Tensor, r: int) -> torch.Tensor:
    """A per-row tensor for the ``r`` copies of the batch a forward runs (classifier-free guidance: 2), itself for
    one (no copy kernel)."""
    return t if r == 1 else t.repeat(r, 1)


class ElasticCache(KVCache):
    """Elastic-Cache policy (see the module docstring). ``gamma``: drift threshold (0.9); ``track_num``:
    tracked tokens per layer (1); ``refresh_every``: also force a full forward every N forwards (None)."""

    name = "elastic"
    #: its plan (the tracked tokens, the window, the drift tests' buffers: :meth:`after_plan`) is a function of the
    #: decode state and of the numbers read with the last plan (:attr:`plan_numbers`): the decode loop may make the
    #: next step's ready before the synchronisation (made again where the synchronisation's numbers differ)
    pipelined = True
    #: its hooks can run a partial forward without host synchronisation (:attr:`speculative`, :meth:`redo_plan`)
    can_speculate = True
    #: the graph path's mode (the module docstring): partial forwards never switch inside, the drift tests go to a
    #: device buffer and :meth:`redo_plan` says where to redo the forward from; the per-step state lives in
    #: buffers that keep their addresses (from :attr:`pool` where it is set)
    speculative = False

    @property
    def batch_buckets(self) -> bool:
        """Always False: the per-row state (stored inputs and queries, tracked tokens) is sized to the batch, so the
        K/V buffers are too (a batch bucket's spare rows would have none)."""
        return False

    @batch_buckets.setter
    def batch_buckets(self, value) -> None:
        pass

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
        # speculative mode: the per-step tensors the hooks read, in buffers that keep their addresses (by name, in
        # the order first taken); whether the planned forward runs speculatively; the redo's (start layer, each
        # row's switch layer) or None
        if not hasattr(self, "_kept"):
            self._kept: dict[str, torch.Tensor] = {}
        self._spec = False
        self._pending = False  # a speculative plan's device part left to the first part's forward (_begin)
        self._stop = None  # the layer the planned first part stops at (speculate_until)
        self._redo = None
        self._last_drift = None  # the first failing layer of the last partial forward (None: none failed)

    def _buffer_like(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer of ``t``'s shape for a stored layer input or query: from :attr:`pool` in speculative mode."""
        if self.speculative:
            return self._buffer(t.shape, t.dtype, t.device)
        return torch.empty_like(t)

    def _kept_buffer(self, name: str, shape, dtype, device) -> torch.Tensor:
        """The speculative mode's buffer kept under ``name`` (the graphs read it by address), of that shape: a buffer
        of another shape is given back to the pool and replaced. Written in place (``out=``, ``copy_``)."""
        buf = self._kept.get(name)
        if buf is not None and tuple(buf.shape) == tuple(shape) and buf.dtype == dtype and buf.device == device:
            return buf
        if buf is not None and self.pool is not None:
            self.pool.give([buf])
        buf = self._kept[name] = self._buffer(tuple(shape), dtype, device)
        return buf

    def graph_key(self) -> tuple:
        """What a graph of this cache's partial forward reads besides the K/V buffers and the forward's inputs: the
        window's width and raggedness, whether the plan's device part runs in the forward (:meth:`_begin`), the
        addresses of the stored inputs and queries and of the kept per-step buffers (:meth:`_kept_buffer`)."""
        return (self._win_pos.shape[1], self._win_ragged, self._pending, *(t.data_ptr() for t in self.xc + self.qc),
                *(t.data_ptr() for t in self._kept.values()))

    def release(self) -> None:
        """:meth:`KVCache.release`, and the stored inputs and queries and the kept buffers, given back in the order
        taken (a layer's input, its K and V, its queries; then the kept buffers), so that the next cache takes the
        same buffers for the same roles and the graphs captured on them replay."""
        if self.pool is None:
            return
        n = len(self.k)
        order = [t for i in range(n) for t in (self.xc[i] if i < len(self.xc) else None, self.k[i], self.v[i],
                                               self.qc[i] if i < len(self.qc) else None)]
        order += list(self._kept.values())
        self.k, self.v, self.xc, self.qc, self.filled, self._kept = [], [], [], [], False, {}
        self.pool.give([t for t in order if t is not None])

    def speculate_until(self) -> int | None:
        """Where the planned speculative forward stops for its first read of the drift tests: the layer after the
        one where the last partial forward's first test failed (drift tends to fail at the same layer from step to
        step: stopping there spares the cached layers a redo would rewrite), or None: every layer (none failed, or
        it failed at one of the last two layers). The forward resumes there where no test failed."""
        L = len(self.xc)
        p = self._last_drift
        stop = None if p is None or p + 2 >= L else p + 1
        self._ran = L if stop is None else stop  # layers run at the active width (step_stats)
        self._stop = stop  # where the first part hands its drift tests over (_settle)
        return stop

    def redo_plan(self, stop: int | None = None) -> int | None:
        """After a speculative partial forward: the layer to redo it from, or None where no drift test failed (one
        host synchronisation). Each row whose test failed at layer ``l`` computes every row from ``l + 1``, the
        others keep their rows; the redo's statistics are set here (the hooks do not run on a graph's replay).
        ``stop``: the forward ran up to that layer only; None (resume it) unless every row still testing failed
        before it (a row that did not has tests left to run, and where they fail decides where it switches)."""
        if not self._spec:
            return None
        L, B = len(self.xc), self._drift_at.shape[0]
        read = self._read.tolist()  # what the part settled (_settle)
        first, testing = read[:B], read[B:]
        if stop is not None and any(t and f >= L for f, t in zip(first, testing)):
            self._ran = L  # resumed: every layer at the active width
            return None
        start = min(first) + 1
        self._last_drift = start - 1 if start < L else None
        if start >= L:
            return None
        sched = tuple(min(f + 1, L) for f in first)  # each row's switch layer (refresh_at and _row_refresh: settled)
        self._refresh_layer = start
        self._redo = (start, sched)
        self._testing = None  # the redo runs no drift test
        return start

    def redo_key(self) -> tuple | None:
        """The redo's schedule (each row's switch layer; part of its graph's key), None outside a redo."""
        return None if self._redo is None else self._redo[1]

    def plan_mask(self, state):
        """:meth:`KVCache.plan_mask`, and the window's numbers among the rows to compute: the most window rows of a
        row, and whether the rows' counts differ (:meth:`_set_window` reads them from :attr:`plan_numbers`, where the
        plan's synchronisation carried them)."""
        mask, counts = super().plan_mask(state)
        n = (logit_rows(state) & mask).sum(-1)
        top = n.max()
        return mask, [*counts, top, (n != top).any().long()]

    def refresh_rows(self, state):
        # a row's first forward computes all its rows (in generate: the first forward of all; a row joining a
        # filled cache); its drift test is skipped (after_plan)
        if state.row_nfe is None:
            return torch.zeros_like(state.active)
        return state.row_nfe == 0

    def refreshes_at(self, step_in, row_nfe):
        return row_nfe == 0 or super().refreshes_at(step_in, row_nfe)

    def move_rows(self, d: int, keep: torch.Tensor | None, n_new: int) -> None:
        """:meth:`KVCache.move_rows`, and its per-row state (the stored layer inputs and queries, the tracked
        tokens; a joining row's first forward computes all its rows: :meth:`refresh_rows`)."""
        super().move_rows(d, keep, n_new)
        B = self.batch
        self.xc = [moved_batch(t, B, keep, n_new, d=d, dim=1) for t in self.xc]
        self.qc = [moved_batch(t, B, keep, n_new, d=d, dim=2) for t in self.qc]
        if self.track is not None:
            self.track = moved_batch(self.track, B, keep, n_new, d=d, dim=1)

    def select(self, state):
        mask = state.committed.clone()
        if self.track is not None and self.track.shape == mask.shape:
            mask |= self.track
        return mask

    def after_plan(self, state, rows):
        B, T = state.x.shape
        dev = state.x.device
        self._spec = self.speculative and rows is not None
        self._redo = None
        self._ran = len(self.xc)
        self._switch = None
        testing = rows is not None and self.track is not None
        known = None
        if rows is not None and len(self.plan_numbers) == 2:  # the window's numbers, read with the plan's
            wm, ragged = self.plan_numbers
            known = (max(wm, 1), bool(ragged))
        self._pending = False
        if self._spec:
            self._plan_speculative(state, rows, testing, known)
            if known is None:  # the window's numbers were not read with the plan: its device part runs now
                self._win.copy_(logit_rows(state))
                self._begin(rows, None)  # (one host synchronisation: the window's numbers)
            return
        self._row_refresh = torch.full((B,), -1, dtype=torch.long, device=dev)
        self._win = logit_rows(state)  # [B, T] bool, each row's own window
        masked = state.x == state.mask_id
        if state.valid is not None:
            masked = masked | ~state.valid  # padding is never tracked
        self._masked = masked
        self._new_track = torch.zeros((B, T), dtype=torch.bool, device=dev)
        if testing:
            self._testing = state.active.clone()
            if state.row_nfe is not None:
                self._testing &= state.row_nfe > 0  # a row's first forward: nothing stored to test against
            self._trk_rows = rows_from_mask(self.track)
            self._trk_ok = torch.arange(self._trk_rows.shape[1], device=rows.device)[None] < self.track.sum(-1, keepdim=True)
            self._positions(rows)
        else:
            self._testing, self._trk_rows = None, None
        self._set_window(rows, known)
        self._win_known = (self._win_pos.shape[1], self._win_ragged)  # the same among any rows holding the windows

    def _plan_speculative(self, state, rows, testing: bool, known: tuple[int, bool] | None) -> None:
        """A speculative plan: the kept buffers the graphs read by address, taken (from the pool where new) at
        their shapes, and the host's part of their content (the masks, the rows testing, the tracked set); the rest,
        a function of the forward's static inputs (the window and tracked rows, their positions among the active
        rows, the drift tests' reset), is computed by the forward itself at its first layer (:meth:`_begin`, in the
        first part's graph: device work, not the host's), where ``known`` (the window's numbers) is given."""
        B, T = state.x.shape
        dev = state.x.device
        L = len(self.xc)
        n = min(L * self.track_num, T)  # the most tokens a row tracks: track_num per layer
        kept = self._kept_buffer  # taken in this order at every plan (the graphs' keys list them in it)
        self._masked = torch.eq(state.x, state.mask_id, out=kept("masked", (B, T), torch.bool, dev))
        if state.valid is not None:
            self._masked.logical_or_(~state.valid)  # padding is never tracked
        self._testing = kept("testing", (B,), torch.bool, dev)
        if not testing:  # a test in every partial forward: rows not testing fail none
            self._testing.zero_()
        elif state.row_nfe is not None:  # a row's first forward: nothing stored to test against
            torch.logical_and(state.active, state.row_nfe > 0, out=self._testing)
        else:
            self._testing.copy_(state.active)
        track = kept("track", (B, T), torch.bool, dev)
        if self.track is None:
            track.zero_()
        elif self.track is not track:  # the last full forward's, or moved with the rows (the serving engine)
            track.copy_(self.track)
        self.track = track
        self._drift_at = kept("drift_at", (B,), torch.long, dev)
        # gamma for the rows testing, -inf once a row failed (and for the others): the drift tests record each row's
        # first failure into drift_at through it (kernels.reference.record_below)
        self._gate = kept("gate", (B,), torch.float32, dev)
        kept("refresh_at", (B,), torch.long, dev)  # each row's switch layer (_settle): the redo's graph reads it
        # each layer's top-attended tokens: every layer of every forward writes its own (no reset needed)
        self._tops = kept("tops", (L, B, min(self.track_num, T)), torch.long, dev)
        self._top_mass = kept("top_mass", (B, min(self.track_num, T)), torch.float32, dev)  # topk's values (unread)
        self._trk_rows = kept("trk_rows", (B, n), torch.long, dev)
        self._trk_ok = kept("trk_ok", (B, n), torch.bool, dev)
        self._trk_pos = kept("trk_pos", (B, n), torch.long, dev)
        self._shift = state.shift
        self._win = kept("win", (B, T), torch.bool, dev)
        # the drift tests as the host reads them, and each row's switch layer or -1 (step_stats): _settle
        self._read = kept("read", (2 * B,), torch.long, dev)
        self._row_refresh = kept("row_refresh", (B,), torch.long, dev)
        # the active rows' counts (this plan's, read by the graph) and the share of token-layers computed (_settle)
        kept("counts", (B,), self._counts.dtype, dev).copy_(self._counts)
        self._frac = kept("frac", (B,), torch.float32, dev)
        if known is None:  # the window's positions are taken once its numbers are read (_begin)
            return
        self._win_pos = kept("win_pos", (B, known[0]), torch.long, dev)
        self._win_ok = kept("win_ok", (B, known[0]), torch.bool, dev)
        self._win_ragged = known[1]
        self._win_known = known
        self._pending = True  # _begin runs at the forward's first layer

    def _begin(self, rows, known: tuple[int, bool] | None) -> None:
        """The speculative plan's device part, run by the first part's forward at its first layer (so inside its
        graph) or, where the window's numbers were not known at plan time, by the plan: each row's window (from the
        forward's ``read_cols``), the drift tests reset, the tracked rows at a fixed width and where they sit among
        the active ``rows``, the window's positions among them."""
        if known is not None:  # inside the forward: the window from the columns it reads
            c = self.read_cols
            if self._shift:  # column c from row c - 1 (column 0 from row 0), as logit_rows
                self._win.zero_()
                self._win[:, :-1] = c[:, 1:]
                self._win[:, :1].logical_or_(c[:, :1])
            else:
                self._win.copy_(c)
        self._drift_at.fill_(len(self.xc))
        self._gate.fill_(float("-inf")).masked_fill_(self._testing, self.gamma)
        count = self.track.sum(-1)
        n = self._trk_rows.shape[1]
        self._trk_rows.copy_(padded_rows(self.track, count)[:, :n])
        torch.lt(cached_arange(n, rows.device)[None], count[:, None], out=self._trk_ok)
        self._positions(rows, out=self._trk_pos)
        self._set_window(rows, known, keep=True)
        self._win_known = (self._win_pos.shape[1], self._win_ragged)

    def _settle(self) -> None:
        """At the end of a speculative part that ran drift tests (its stop layer, or the last layer), inside its graph:
        each row's switch layer (``refresh_at``: the layer after its first failing test, ``L`` where none failed; the
        redo's graph reads it), the same as the statistics count it (-1: none), and what :meth:`redo_plan` reads on the
        host (the first failing layers, the rows testing) in one buffer."""
        L, B = len(self.xc), self._drift_at.shape[0]
        refresh = torch.clamp_max(self._drift_at + 1, L, out=self._kept["refresh_at"])
        self._row_refresh.copy_(refresh).masked_fill_(refresh >= L, -1)
        self._frac.copy_(super().computed_fraction(self._kept["counts"], self._row_refresh, L))
        self._read[:B].copy_(self._drift_at)
        self._read[B:].copy_(self._testing)

    def _positions(self, rows, out: torch.Tensor | None = None):
        """Where each tracked row sits in ``rows`` (first match); ``out``: into that buffer."""
        hit = (rows[:, None, :] == self._trk_rows[:, :, None]).view(torch.uint8)
        self._trk_pos = hit.argmax(-1) if out is None else torch.argmax(hit, -1, out=out)

    def _set_window(self, rows, known: tuple[int, bool] | None = None, keep: bool = False):
        """``[B, Wm]`` positions of each row's window rows among the computed rows (``rows``; all ``T`` when
        None) and ``[B, Wm]`` bool, False on the padding of rows with fewer window rows. ``known``: ``(Wm, whether
        the rows' window counts differ)`` from an earlier call of this forward (each row's count is the same among
        any rows that hold its window: no host synchronisation), else read here. ``keep``: into the buffers kept
        under ``win_pos`` and ``win_ok`` (a speculative plan's)."""
        win = self._win if rows is None else self._win.gather(1, rows)
        if rows is not None:  # a repeated row (padding) counts once
            first = torch.ones_like(win)
            first[:, 1:] = rows[:, 1:] != rows[:, :1]
            win = win & first
        n = win.sum(-1)
        if known is None:  # one host synchronisation
            top = n.max()
            wm, ragged = torch.stack([top, (n != top).any().long()]).tolist()
            known = (max(wm, 1), bool(ragged))
        pos = torch.argsort(win.view(torch.uint8), dim=-1, descending=True, stable=True)[:, : known[0]]
        ar = cached_arange(pos.shape[1], win.device)[None]
        if keep:
            self._win_pos = self._kept_buffer("win_pos", pos.shape, pos.dtype, win.device).copy_(pos)
            self._win_ok = torch.lt(ar, n[:, None], out=self._kept_buffer("win_ok", pos.shape, torch.bool, win.device))
        else:
            self._win_pos, self._win_ok = pos, ar < n[:, None]
        self._win_ragged = known[1]

    # -- model hooks ---------------------------------------------------------------------------------------
    def layer_input(self, layer, h, rows):
        if rows is None:
            if len(self.xc) <= layer:
                self.xc.append(self._buffer_like(h))
            if self.xc[layer].shape != h.shape:
                self.xc[layer] = self._buffer_like(h)
            self.xc[layer].copy_(h)
            return None
        if self._spec and self._pending and layer == 0 and h is not None:  # a speculative first part's first layer
            self._begin(rows, self._win_known)
        xc = self.xc[layer]
        r = xc.shape[0] // self._row_refresh.shape[0]  # 2 under classifier-free guidance
        if h is not None:  # None: the first layer of a redo or a resumed forward, its input stored before
            xc.scatter_(1, rows[:, :, None].expand(-1, -1, xc.shape[-1]), h)
        elif self._redo is None:  # a speculative forward resumed where its first part stopped
            return xc.gather(1, rows[:, :, None].expand(-1, -1, xc.shape[-1])), rows
        if self._redo is not None:  # the switches are known (redo_plan): no host synchronisation
            start, sched = self._redo
            if layer not in sched:
                return None
            sw = self._kept["refresh_at"] == layer
            all_full = all(s <= layer for s in sched)
        else:
            if self._spec and h is not None and layer == self._stop:  # the first part hands its tests over here
                self._settle()
            if self._spec or self._switch is None or not bool(self._switch.any()):
                return None
            # Rows whose drift test failed at the previous layer compute every row from this layer on (the stored
            # inputs for the rows not computed); the others keep their rows (padded with their first row).
            sw = self._switch
            self._row_refresh = torch.where(sw, torch.full_like(self._row_refresh, layer), self._row_refresh)
            self._refresh_layer = layer if self._refresh_layer < 0 else self._refresh_layer
            self._switch = None
            if self._testing is not None:
                self._testing = self._testing & ~sw
            all_full = bool((self._row_refresh >= 0).all())
        T = xc.shape[1]
        known = self._win_known  # each row's window count is the same among every row (no host synchronisation)
        if all_full:
            self._set_window(None, known)
            return xc.clone(), None
        full_rows = self._row_refresh >= 0 if self._redo is None else self._kept["refresh_at"] <= layer
        Q = rows.shape[1]
        pad = rows[:, :1].expand(-1, T - Q)
        keep = torch.cat([rows, pad], 1) if Q < T else rows
        new_rows = torch.where(full_rows.repeat(r)[:, None], torch.arange(T, device=rows.device)[None], keep)
        new_h = xc.gather(1, new_rows[:, :, None].expand(-1, -1, xc.shape[-1]))
        if self._testing is not None:
            self._positions(new_rows[: new_rows.shape[0] // r])
        self._set_window(new_rows[: new_rows.shape[0] // r], known)
        return new_h, new_rows

    def update(self, layer, k, v, rows=None):
        # the drift test's old keys, where one runs: a partial forward's layers but the last (a failure there would
        # switch no layer)
        if rows is not None and self._trk_rows is not None and self._testing is not None and layer + 1 < len(self.xc):
            idx = rows[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            self._k_old = (idx, self.k[layer].gather(2, idx))  # what this step overwrites
        return super().update(layer, k, v, rows)

    def observe(self, layer, q, k, key_mask, rows):
        L = len(self.xc)
        B = self._masked.shape[0]
        r = q.shape[0] // B  # 2 under classifier-free guidance (the batch is doubled)
        if rows is None:
            if len(self.qc) <= layer:
                self.qc.append(self._buffer_like(q))
            if self.qc[layer].shape != q.shape:
                self.qc[layer] = self._buffer_like(q)
            self.qc[layer].copy_(q)
        else:
            qc = self.qc[layer]
            idx = rows[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3])
            if self._k_old is not None:  # a drift test (update kept the keys this step overwrote)
                tidx = _rows(self._trk_rows, r)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3])
                q_old = qc.gather(2, tidx)
                pidx = _rows(self._trk_pos, r)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3])
                q_new = q.gather(2, pidx)
                kidx, kvals = self._k_old
                k_old = k.clone().scatter_(2, kidx, kvals)
                # per row: the mean over its real tracked rows and its keys of the cosine similarity, over the
                # heads, of their attention before and after (one kernel pass on the Triton backend); on the graph
                # path each row's first failing layer recorded on the device, through the gate (_begin)
                gated = self._spec and r == 1
                record = (self._gate, self._drift_at, layer) if gated else ()
                sim = kernels.attention_drift(q_old, k_old, q_new, k, key_mask, _rows(self._trk_ok, r), *record)
                if not gated:
                    sim = sim if r == 1 else sim.view(r, B).mean(0)
                    if self._spec:
                        kernels.reference.record_below(sim, self._gate, self._drift_at, layer)
                    else:
                        self._switch = self._testing & (sim < self.gamma)
            if self._spec and layer == L - 1 and self._redo is None:  # the last layer of a part that tested
                self._settle()
            self._k_old = None
            qc.scatter_(2, idx, q)
        wpos = _rows(self._win_pos, r)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3])
        q_win = q.gather(2, wpos)
        if self._win_ragged:  # rows with fewer window rows: their padded queries add no mass
            ok = _rows(self._win_ok, r)[:, None, :, None]
            mass = (kernels.reference.attention_probs(q_win, k, key_mask) * ok).sum((1, 2))
        else:
            mass = kernels.attention_mass(q_win, k, key_mask)
        mass = mass if r == 1 else mass.view(r, B, -1).sum(0)
        mass = mass.masked_fill(self._masked, -1.0)
        n = min(self.track_num, mass.shape[1])
        if self._spec:  # per layer (a redo rewrites the layers it runs), into the kept buffer
            torch.topk(mass, n, dim=-1, out=(self._top_mass, self._tops[layer]))
        else:
            self._new_track.scatter_(1, mass.topk(n, dim=-1).indices, True)

    def computed_fraction(self, counts, row_refresh, n_layers):
        """:meth:`KVCache.computed_fraction`; after a speculative forward the one its graph computed (:meth:`_settle`),
        copied (the step's statistics keep it)."""
        if self._spec:
            return self._frac.clone()
        return super().computed_fraction(counts, row_refresh, n_layers)

    def step_stats(self, n_layers):
        """:meth:`KVCache.step_stats`; a speculative forward's ``run`` also counts the layers it ran at the active
        width that the eager forward would have run at every row (those a redo rewrote)."""
        if self._spec:  # into the kept buffer, which the next plan's first part reads by address
            B = self._tops.shape[1]
            new = torch.zeros_like(self._masked).scatter_(1, self._tops.transpose(0, 1).reshape(B, -1), True)
            self.track = torch.logical_and(new, ~self._masked, out=self._kept["track"])
        else:
            self.track = self._new_track & ~self._masked
        stats = super().step_stats(n_layers)
        if self._spec:
            r = self._refresh_layer if self._refresh_layer >= 0 else n_layers
            extra = (self._ran - r) * self._rows.shape[1] / (n_layers * self.canvas_len)
            stats["run"] = stats["run"] + extra
        return stats

    @property
    def nbytes(self) -> int:
        """K/V plus the stored layer inputs and queries (and the speculative mode's kept buffers)."""
        extra = sum(t.numel() * t.element_size() for t in self.xc + self.qc + list(self._kept.values()))
        return super().nbytes + extra
