"""Cache protocol: a policy over the model's partial forward.

Once per forward ``plan(state)`` returns ``(query_idx, refresh_from_layer)``: the active rows to compute
(``[B, Q]`` int64, or ``None``: all rows) and the first layer that recomputes every row (``0`` for a full
forward, ``None``: none planned; Elastic-Cache decides inside the forward). Inside the forward the model
calls ``update(layer, k, v[, rows])`` per layer with the fresh post-RoPE K/V of the computed rows and attends
over what it returns: the full ``[B, Hkv, T, D]`` K/V, fresh for the computed rows and stored for the rest.

:class:`KVCache` holds the per-layer buffers (allocated at the first full forward, then written in place) and
the bookkeeping every policy shares; a policy only implements :meth:`KVCache.select`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from dllm.ops import cached_arange, check_int, moved_rows, shape_bucket


def check_refresh_every(value) -> None:
    """``refresh_every``: ``None`` (never) or a positive integer (a full forward every that many forwards)."""
    if value is not None:
        check_int("refresh_every", value, 1, what="a positive integer or None",
                  fix=" (forwards between full refreshes, None: never; 1: every step, the no-cache run)")


def moved_batch(t: torch.Tensor, batch: int, keep: torch.Tensor | None, n_new: int, *, d: int = 0,
                dim: int | None = None) -> torch.Tensor:
    """:func:`~dllm.ops.moved_rows` for a cache tensor whose rows are the batch's ``batch`` rows, or, under
    classifier-free guidance, two copies of them (conditional, then unconditional): each copy moved alike."""
    copies = t.shape[0] // batch if batch and t.shape[0] > batch else 1
    if copies == 1:
        return moved_rows(t, keep, n_new, d=d, dim=dim)
    return torch.cat([moved_rows(t[j * batch:(j + 1) * batch], keep, n_new, d=d, dim=dim) for j in range(copies)])


@runtime_checkable
class Cache(Protocol):
    """What the decode loop and the model call. Required: ``reset``, ``plan``, ``update``; the optional hooks
    are declared here with their no-op defaults (:class:`CacheBase`) and called directly."""

    name: str
    #: ``layer_input(layer, h, rows)`` or None: sees each layer's input of a forward; in a partial forward may
    #: return ``[B, T, d]`` hidden states (every row from this layer on) or ``(h, rows)`` (other rows)
    layer_input: Any
    #: ``observe(layer, q, k, key_mask, rows)`` or None: sees the queries and the full keys of each layer
    observe: Any
    #: ``[B, T]`` bool columns whose logits each row reads in the current partial forward (None: all)
    read_cols: Any
    #: True: a partial forward computes only the rows the sampler reads; other columns get zero logits
    sparse_logits: bool
    #: int or None: the active rows over the batch of the planned partial forward (its padding excluded)
    query_tokens: Any

    def reset(self, batch: int, canvas_len: int) -> None:  # pragma: no cover - protocol
        """Start a new generate() call."""

    def plan(self, state: Any) -> tuple[torch.Tensor | None, int | None]:  # pragma: no cover - protocol
        ...

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None):
        ...  # pragma: no cover - protocol

    def step_stats(self, n_layers: int) -> dict[str, Any]:  # pragma: no cover - protocol
        """Statistics of the forward just run, for the trace."""


class CacheBase:
    """No-op defaults of the optional :class:`Cache` hooks."""

    layer_input = None
    observe = None
    read_cols = None
    sparse_logits = False
    #: the active rows over the batch of the planned partial forward (the model's ``query_tokens``: its per-token
    #: work runs on these rows packed, without the padding of shorter active sets), or None
    query_tokens = None

    def step_stats(self, n_layers: int) -> dict[str, Any]:
        return {}


@dataclass
class CacheState:
    """What the decode loop tells a cache before each forward (all tensors ``[B]`` or ``[B, T]``).

    ``x``: the canvas; ``lo``/``hi``: each row's region; ``active``: unfinished rows; ``step_in``: steps
    already taken in the current region (0: the region starts now); ``cols``: ``(c0, c1)`` canvas columns
    whose logits are read this step; ``shift``: 1 for shifted-logit families (column c from row c - 1);
    ``committed``: ``[B, T]`` positions decoded at the previous step; ``nfe``: forwards so far;
    ``row_nfe``: ``[B]`` forwards each row has taken (``None``: ``nfe`` for every row); ``read_lo`` /
    ``read_hi``: ``[B]`` each row's own columns whose logits it reads (``None``: ``cols`` for every row).
    Every decision of a policy is per row and depends only on that row's fields, so a row's cached forwards
    are the same alone or in any batch."""

    x: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    active: torch.Tensor
    step_in: torch.Tensor
    cols: tuple[int, int]
    prompt_len: int
    mask_id: int
    shift: int
    committed: torch.Tensor
    nfe: int
    valid: torch.Tensor | None = None
    row_nfe: torch.Tensor | None = None
    read_lo: torch.Tensor | None = None
    read_hi: torch.Tensor | None = None
    # read_cols(state), computed once per state (the plan's mask and its rows both need it)
    read_cols_memo: torch.Tensor | None = field(default=None, repr=False, compare=False)


def rows_from_mask(mask: torch.Tensor, Q: int | None = None) -> torch.Tensor:
    """``[B, T]`` bool -> ``[B, Q]`` int64 active rows, ascending, ``Q`` the largest count; shorter rows are
    padded with their own first active row (a duplicate: recomputed twice, written identically). One host
    sync (``Q``) unless the caller passes ``Q`` (then every row must have at least one active position)."""
    if Q is None:
        mask = mask.clone()
        mask[:, 0] |= ~mask.any(-1)  # a row needs at least one active position
        Q = int(mask.sum(-1).max())
    return padded_rows(mask, mask.sum(-1))[:, :Q]


def padded_rows(mask: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int64: each row's active positions ascending, then its first active position repeated
    (``counts``: ``mask.sum(-1)``); :func:`rows_from_mask` is its first ``Q`` columns. No host number needed, so
    the decode loop builds it before the step's synchronisation."""
    order = torch.argsort(mask.view(torch.uint8), dim=-1, descending=True, stable=True)
    pad = cached_arange(mask.shape[1], mask.device)[None] >= counts[:, None]
    return torch.where(pad, order[:, :1].expand_as(order), order)


def read_cols(state: CacheState) -> torch.Tensor:
    """``[B, T]`` bool: the canvas columns whose logits each row reads this step (its own window)."""
    if state.read_cols_memo is not None:
        return state.read_cols_memo
    B, T = state.x.shape
    cols = cached_arange(T, state.x.device)[None]
    if state.read_lo is None:
        c0, c1 = state.cols
        out = ((cols >= c0) & (cols < c1)).expand(B, T)
    else:
        out = (cols >= state.read_lo[:, None]) & (cols < state.read_hi[:, None])
    state.read_cols_memo = out
    return out


def logit_rows(state: CacheState) -> torch.Tensor:
    """``[B, T]`` bool: the rows whose hidden states give each row's logits this step (its window shifted left
    for shifted-logit families, e.g. Dream: the window includes the row before the region)."""
    c = read_cols(state)
    if not state.shift:
        return c
    rows = torch.zeros_like(c)
    rows[:, :-1] = c[:, 1:]  # column c from row c - 1
    rows[:, 0] |= c[:, 0]  # column 0 from row 0 (clamped, as the model does)
    return rows


@dataclass
class NoCache(CacheBase):
    """Recompute everything at every step (the exact baseline every cache is tested against)."""

    name: str = "none"

    def reset(self, batch: int, canvas_len: int) -> None:
        self.batch, self.canvas_len = batch, canvas_len

    def step_stats(self, n_layers: int) -> dict[str, Any]:
        return {"active": [self.canvas_len] * self.batch, "refresh_layer": 0, "computed": [1.0] * self.batch,
                "run": 1.0}

    def plan(self, state: Any) -> tuple[None, int]:
        return None, 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


class KVCache(CacheBase):
    """Per-layer post-RoPE K/V buffers plus the shared bookkeeping of a cache policy.

    Subclasses implement ``select(state) -> [B, T] bool | None`` (the active rows; ``None``: a full forward)
    and may read ``self.refresh_every`` (force a full forward every N forwards; 1: every step, the exact
    mode). ``last_stats`` holds the last forward's statistics for the decode loop's trace: ``active``
    (``[B]`` rows computed), ``refresh_layer`` (first layer that computed every row, -1: none) and
    ``computed`` (fraction of token-layers computed, per row).
    """

    name = "kv"
    #: True for a policy whose partial forwards compute only the rows of the columns the sampler reads (the
    #: candidates), not every window column: the model then returns zero logits for the other columns.
    sparse_logits = False
    #: False: partial forwards run their per-token work on the padded rows too (``query_tokens`` stays None), the
    #: readable path and the oracle of the packed one (same logits); set on an instance
    pack_rows = True
    #: True: a partial forward's active width (``Q``) and packed rows (``query_tokens``) are rounded up to
    #: :func:`~dllm.ops.shape_bucket` sizes, more repeats of each row's first active row (the graph path: a few
    #: graphs serve the widths a generation goes through; the decode loop sets it where a graph runner is used)
    buckets = False
    #: where the K/V buffers come from: None (allocated here) or a :class:`~dllm.graphs.BufferPool` (the graph
    #: path's: the next cache takes the same buffers, so that graphs captured on them replay); see :meth:`release`
    pool = None
    #: True: the K/V buffers are views of the first rows of buffers whose batch is rounded up to a
    #: :func:`~dllm.ops.shape_bucket` size (:meth:`capacity`), and rows that join or leave move within them while
    #: the bucket holds: the graph runner then runs a batch of that bucket, its extra rows copies of row 0, and a
    #: served batch whose size changes keeps its graphs (the serving engine sets it on the graph path)
    batch_buckets = False
    #: True: a plan leaves nothing that the next plan reads (:meth:`after_plan` keeps no state for :meth:`select`), so
    #: the decode loop may plan the next step before its host synchronisation, with the shapes it expects, and plan
    #: again from the same state where the synchronisation's numbers differ (the graph path's
    #: ``Decoder._prepare_next``); False: never; None (default): True unless the policy overrides
    #: :meth:`after_plan` (:attr:`plans_ahead`)
    pipelined: bool | None = None
    #: the numbers :meth:`plan_mask` adds after its three (a policy's own), on the host, for :meth:`after_plan`
    plan_numbers: list = []

    #: True for a policy with per-layer hooks that can run a partial forward without host synchronisation once the
    #: decode loop sets its ``speculative`` mode (Elastic-Cache): its cached steps then go through graphs, and after
    #: each the decode loop asks ``redo_plan()`` whether to redo it from a layer (``Transformer.forward(start_layer=)``)
    can_speculate = False
    #: set by the decode loop on every call: True where such a policy's cached steps go through graphs
    speculative = False

    def __init__(self, refresh_every: int | None = None):
        check_refresh_every(refresh_every)
        self.refresh_every = None if refresh_every is None else int(refresh_every)
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self.filled = False
        self.last_stats: dict[str, Any] = {}
        self._rows: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._refresh_layer = -1
        #: [B, T] bool columns whose logits each row reads in the current partial forward (the model checks that
        #: their rows were computed; other rows' window columns get zero logits); None after a full forward
        self.read_cols: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(refresh_every={self.refresh_every})"

    @property
    def plans_ahead(self) -> bool:
        """Whether the decode loop may plan this cache's next step ahead (:attr:`pipelined`)."""
        if self.pipelined is not None:
            return bool(self.pipelined)
        return type(self).after_plan is KVCache.after_plan

    # -- protocol -----------------------------------------------------------------------------------------
    def reset(self, batch: int, canvas_len: int) -> None:
        # the K/V buffers are kept (not cleared): the next first full forward writes them in place when the shapes
        # agree, so their addresses (and the CUDA graphs captured on them) stay valid from one generate to the next
        self.filled = False
        self.batch, self.canvas_len = batch, canvas_len
        self.last_stats = {}
        self.on_reset()

    def on_reset(self) -> None:
        pass

    def plan(self, state: CacheState, hint=None) -> tuple[torch.Tensor | None, int | None]:
        """The active rows of this step's forward (``[B, Q]``) or a full forward. ``hint``: ``(mask, partial, Q, N,
        rows, extra numbers)`` from :meth:`plan_mask` and :meth:`plan_rows` on this same state, its numbers already
        on the host (the decode loop reads them in the previous step's synchronisation, after building ``rows``);
        without it, one host sync here. The numbers after the first three (a policy's own, :meth:`plan_mask`) are
        :attr:`plan_numbers` for :meth:`after_plan`."""
        if not self.filled:
            return self._full(state)
        if hint is None:
            mask, counts = self.plan_mask(state)
            # one host sync: whether some unfinished row keeps a partial forward (else a full forward: the cheaper
            # shape for the same rows), the size of the largest active set and the active rows over the batch
            partial, Q, N, *extra = torch.stack(counts).tolist()
            prepared = None
        else:
            mask, partial, Q, N, prepared, extra = hint
        self.plan_numbers = extra
        if not partial:
            return self._full(state)
        rows, self._counts, self.read_cols = prepared if prepared is not None else self.plan_rows(state, mask)
        Q, self.query_tokens = self.forward_shape(Q, N, *rows.shape)
        self._rows = rows[:, :Q]
        self._refresh_layer = -1
        self.after_plan(state, self._rows)
        return self._rows, None

    def forward_shape(self, Q: int, N: int, B: int, T: int) -> tuple[int, int | None]:
        """``(active width, packed rows or None)`` a partial forward runs at, for a largest active set ``Q`` and ``N``
        active rows over a batch of ``B`` rows of ``T`` columns: rounded up with :attr:`buckets` (rows beyond a row's
        own count repeat its first active row: padding, written identically), the packed rows None without
        :attr:`pack_rows`."""
        if self.buckets:
            Q = shape_bucket(Q, T)
            N = shape_bucket(N, B * Q)
        return Q, (N if self.pack_rows else None)

    def plan_rows(self, state: CacheState, mask: torch.Tensor):
        """``(rows [B, T], counts [B], read_cols [B, T])`` of a partial forward on ``state`` with active ``mask``
        (:meth:`plan_mask`): :func:`padded_rows` (the forward's ``query_idx`` is its first ``Q`` columns), the rows'
        counts and the columns each row reads. Device work only: the decode loop does it before the host sync."""
        counts = mask.sum(-1)
        return padded_rows(mask, counts), counts, read_cols(state)

    def plan_mask(self, state: CacheState) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(mask [B, T] bool, counts)`` of a partial forward on ``state``: the rows to compute and, on the device as
        three 0-d tensors (bool, int64, int64), whether some unfinished row keeps a partial forward, the largest active
        set and the active rows over the batch (the forward's ``query_tokens``: its per-token work skips the padding),
        then any numbers of the policy's own (0-d int64; Elastic-Cache's window; :attr:`plan_numbers` on the host);
        the decode loop stacks them with its own numbers in one kernel. No host synchronisation and no side effect
        (``select`` / ``refresh_rows`` / ``read_rows`` read only the state and what the previous plan and forward
        left): the decode loop calls it one step ahead."""
        B, T = state.x.shape
        full_rows = self.refresh_rows(state)  # [B] bool: rows recomputed in full this step
        if self.refresh_every is not None:
            n = state.row_nfe if state.row_nfe is not None else torch.full((B,), state.nfe, device=state.x.device)
            full_rows = full_rows | (n % self.refresh_every == 0)
        mask = self.select(state) | self.read_rows(state) | full_rows[:, None]
        mask = mask & state.active[:, None]  # finished rows compute nothing they need (row 0 as a placeholder)
        if state.valid is not None:
            mask = mask & state.valid
        torch.logical_or(mask[:, 0], ~mask.any(-1), out=mask[:, 0])  # a row needs at least one active position
        per_row = mask.sum(-1)
        return mask, [(state.active > full_rows).any(), per_row.max(), per_row.sum()]  # bools: active and not full

    def _full(self, state: CacheState):
        B, T = state.x.shape
        self._rows, self._counts, self._refresh_layer = None, torch.full((B,), T, device=state.x.device), 0
        self.read_cols, self.query_tokens = None, None
        self.after_plan(state, None)
        return None, 0

    def refresh_rows(self, state: CacheState) -> torch.Tensor:
        """``[B]`` bool: rows this policy recomputes in full at this step (default: none; ``refresh_every``
        adds each row's every N-th forward)."""
        return torch.zeros_like(state.active)

    def refreshes_at(self, step_in: int, row_nfe: int) -> bool:
        """Whether :meth:`plan_mask` recomputes in full a row at step ``step_in`` of its region that has taken
        ``row_nfe`` forwards: the host's twin of :meth:`refresh_rows` and ``refresh_every`` (a policy overriding the
        one overrides the other), with which the decode loop tells before a step's synchronisation whether the next
        forward will be a refresh (``Decoder._launch_early``)."""
        return self.refresh_every is not None and row_nfe % self.refresh_every == 0

    def after_plan(self, state: CacheState, rows) -> None:
        pass

    def read_rows(self, state: CacheState) -> torch.Tensor:
        """``[B, T]`` bool rows computed in every partial forward on top of :meth:`select`'s: by default those
        of every column the sampler may read (:func:`logit_rows`)."""
        return logit_rows(state)

    def select(self, state: CacheState) -> torch.Tensor:  # pragma: no cover - abstract
        """``[B, T]`` bool rows to recompute in a partial forward, decided per row."""
        raise NotImplementedError

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None):
        if rows is None:
            while len(self.k) <= layer:
                self.k.append(None)
                self.v.append(None)
            self._hold(layer, k.shape, v.shape, k.dtype, k.device)
            self.k[layer].copy_(k)
            self.v[layer].copy_(v)
            if layer == 0:
                self.filled = True
            return k, v
        if not self.filled or layer >= len(self.k) or self.k[layer] is None:
            raise RuntimeError(f"cache {self.name!r}: a partial forward before the cache was filled")
        kb, vb = self.k[layer], self.v[layer]
        if kb.shape[0] != k.shape[0]:
            raise RuntimeError(f"cache {self.name!r} holds batch {kb.shape[0]}, the forward has {k.shape[0]}")
        idx = rows[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        kb.scatter_(2, idx, k)
        vb.scatter_(2, idx, v)
        return kb, vb

    def graph_key(self) -> tuple:
        """What a graph of a partial forward with this cache reads by address or branches on besides the K/V buffers
        and the forward's static inputs (part of the graph's key; here nothing)."""
        return ()

    def release(self) -> None:
        """Give the K/V buffers back to :attr:`pool` (the decode loop does at the end of a generation on the graph
        path, the serving engine when a batch ends): the cache holds none after, and its next first forward takes
        buffers from the pool again (those it gave back, if no other cache took them). Without a pool, nothing."""
        if self.pool is None:
            return
        pairs = [storage_of(t) for kv in zip(self.k, self.v) for t in kv]  # layer order: taken again in that order
        self.k, self.v, self.filled = [], [], False
        self.pool.give(pairs)

    def take_buffers(self, n_layers: int, shape, dtype, device) -> None:
        """Hold every layer's K/V buffers of ``shape`` (``[B, Hkv, T, D]``) before a full forward, as :meth:`update`
        takes them layer by layer (from :attr:`pool`, a layer's K then its V; buffers of another shape given back
        first): the forward then writes them in place, so that a generation's first forward, like its refreshes,
        can replay a graph captured on the buffers an earlier call held."""
        for buf in (self.k, self.v):
            buf.extend([None] * (n_layers - len(buf)))
        for layer in range(n_layers):
            self._hold(layer, shape, shape, dtype, device)

    def _hold(self, layer: int, k_shape, v_shape, dtype, device) -> None:
        """Make layer ``layer``'s K/V buffers those of a full forward's keys and values (``k_shape``, ``v_shape``):
        kept where the K buffer already has that shape, dtype and device, else the old pair given back to
        :attr:`pool` and new ones taken, contiguous ``[B, Hkv, T, D]`` whatever the producer's layout (attention
        reads rows of D)."""
        kb = self.k[layer]
        if kb is None or kb.shape != k_shape or kb.dtype != dtype or kb.device != device:
            if self.pool is not None:
                self.pool.give([storage_of(kb), storage_of(self.v[layer])])
            self.k[layer] = self._buffer(k_shape, dtype, device)
            self.v[layer] = self._buffer(v_shape, dtype, device)

    def _buffer(self, shape, dtype, device, reuse: torch.Tensor | None = None) -> torch.Tensor:
        """A contiguous ``[B, Hkv, T, D]`` K/V buffer: from :attr:`pool` (or new), with :attr:`batch_buckets` the first
        ``B`` rows of one whose batch is rounded up; ``reuse``: a buffer already of that storage shape, used again."""
        rows = shape[0]
        cap = shape_bucket(rows) if self.batch_buckets else rows
        full = (cap, *shape[1:])
        if reuse is not None and tuple(reuse.shape) == full and reuse.dtype == dtype and reuse.device == device:
            t = reuse
        elif self.pool is not None:
            t = self.pool.take(full, dtype, device)
        else:
            t = torch.empty(full, dtype=dtype, device=device)
        return t if cap == rows else t[:rows]

    def capacity(self) -> int:
        """The rows of the storage behind the K/V buffers (the batch, or with :attr:`batch_buckets` its bucket); 0
        before the first full forward."""
        first = next((t for t in self.k if t is not None), None)  # every layer's buffers are sized alike
        return 0 if first is None else storage_of(first).shape[0]

    def write_buffers(self, layer: int, batch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The ``(k, v)`` buffers (``[B, Hkv, T, D]``) into which a partial forward of ``batch`` rows may write its
        active rows' keys and values itself, in place of :meth:`update` (the fast layer's one kernel for RoPE and
        both writes, :func:`dllm.kernels.fused.rope_qk_write`), or None where :meth:`update` must run: a policy
        with its own ``update``, a layer not yet filled, another batch (``update`` then names the problem), buffers
        whose last dimension is strided."""
        if type(self).update is not KVCache.update or not self.filled or layer >= len(self.k):
            return None
        kb, vb = self.k[layer], self.v[layer]
        if kb is None or kb.shape[0] != batch or kb.stride(-1) != 1 or vb.stride(-1) != 1:
            return None
        return kb, vb

    def move_rows(self, d: int, keep: torch.Tensor | None, n_new: int) -> None:
        """Move a filled cache with the rows of its batch (the serving engine, as requests leave and join): the
        ``keep`` rows selected (``None``: all), ``d`` columns of left padding added (``d < 0``: cropped), ``n_new``
        empty rows appended for joining rows (their first forward recomputes them in full: every served cache
        refreshes a row at its first step). Here the K/V buffers; a policy with per-row state of its own moves it
        too (and calls this)."""
        for buf in (self.k, self.v):
            for layer, t in enumerate(buf):
                if t is None:
                    continue
                moved = moved_batch(t, self.batch, keep, n_new, d=d, dim=2)  # a new tensor where anything moved
                if moved is t:
                    continue
                # into the same storage while its shape holds (a batch bucket's rows: the graphs captured on it
                # replay), else the pool's buffer of the new shape (a batch back at a size it had keeps its graphs)
                old = storage_of(t)
                dst = self._buffer(moved.shape, moved.dtype, moved.device, reuse=old)
                if self.pool is not None and storage_of(dst) is not old:
                    self.pool.give([old])
                buf[layer] = dst.copy_(moved)

    # -- statistics ----------------------------------------------------------------------------------------
    def step_stats(self, n_layers: int) -> dict[str, Any]:
        """Statistics of the forward just run (called by the decode loop). ``refresh_layer``: 0 for a full
        forward, else the first layer from which some row computed every row (Elastic-Cache), else -1;
        ``computed``: per row, the fraction of its token-layers computed (a row refreshed from layer ``r`` of a
        partial forward counts ``T`` rows from there on); ``run``: the fraction of each row's token-layers the
        batch's forward ran, padding included, as a mean over the batch's rows (a partial forward whose model packs
        its per-token work, ``query_tokens``, runs the rows' active sets; with per-layer hooks it runs the largest
        active set for every row, and from a refresh layer every row of every row)."""
        T = self.canvas_len
        if self._refresh_layer == 0:
            frac = torch.ones_like(self._counts, dtype=torch.float32)
        elif getattr(self, "_row_refresh", None) is None:  # no row refreshed in full: the computed rows' share
            frac = torch.div(self._counts, T,  # float32 whatever the default dtype, in one kernel
                             out=torch.empty(self._counts.shape, dtype=torch.float32, device=self._counts.device))
        else:
            frac = self.computed_fraction(self._counts, self._row_refresh, n_layers)
        # what the batch's forward ran per row, padding included: a partial forward computes Q rows of every row
        # (the largest active set; the others padded with repeats) unless the model packs its per-token work into
        # the N active rows (query_tokens; not with per-layer hooks), from a refresh layer on all T of every row
        Q = T if self._rows is None else self._rows.shape[1]
        if self._rows is not None and self.query_tokens is not None and self.layer_input is None \
                and self.observe is None:
            Q = self.query_tokens / self._rows.shape[0]
        r = self._refresh_layer
        run = 1.0 if r == 0 else (Q / T if r < 0 else (r * Q + (n_layers - r) * T) / (n_layers * T))
        # the counts are kept, not copied: each plan makes new ones and nothing writes into them
        self.last_stats = {"active": self._counts, "refresh_layer": self._refresh_layer, "computed": frac,
                           "run": run}
        return self.last_stats

    def computed_fraction(self, counts: torch.Tensor, row_refresh: torch.Tensor, n_layers: int) -> torch.Tensor:
        """``[B]`` float32: each row's share of its token-layers computed, ``counts`` rows per layer up to its refresh
        layer (``row_refresh``; -1: none) and all ``T`` from there on."""
        T = self.canvas_len
        counts, r = counts.float(), row_refresh.float()
        full = torch.where(r < 0, torch.zeros_like(r), n_layers - r)
        return ((n_layers - full) * counts + full * T) / (n_layers * T)

    @property
    def nbytes(self) -> int:
        """Bytes held by the K/V buffers (their storage: with :attr:`batch_buckets` the bucket's rows)."""
        return sum(storage_of(t).numel() * t.element_size() for t in self.k + self.v if t is not None)


def storage_of(t: torch.Tensor | None) -> torch.Tensor | None:
    """The buffer a K/V view was cut from (the tensor itself when it is no view)."""
    return t if t is None or t._base is None else t._base


def region_start(state: CacheState) -> torch.Tensor:
    """``[B]`` bool: rows that start a new region at this step."""
    return state.step_in == 0
