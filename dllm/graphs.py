"""CUDA graphs for the decode step: the cached partial forwards and the full forwards.

A cached step is a *partial forward*: the active rows of the canvas (``query_idx``) are recomputed against the
K/V buffers of a :class:`~dllm.caches.base.KVCache`. Its shapes repeat from step to step (the dual cache's
window has the block's width for a whole generation; the prefix cache's for a whole block), so the step can run
the way vLLM and SGLang run decode: capture the forward once per shape into a CUDA graph that reads static
input buffers and writes the cache's K/V buffers in place, then replay it, paying one graph launch instead of a
few hundred kernel launches.

:class:`GraphRunner` does this for one model:

* a graph is keyed by ``(B, T, Q, W, dtype, key mask present, sparse logits, the addresses of the cache's
  K/V buffers, N)``: batch, canvas length, active rows, logits columns, and the active rows over the batch without
  padding where the rows' active sets differ (``query_tokens``: the per-token work runs on those rows packed). A key
  is captured the second time it is seen (a shape seen once runs eagerly), at most ``max_graphs`` graphs are kept
  (least recently used dropped); a graph reads the weights by address, so each generation first checks that the
  model's tensors and layer path are those the graphs captured (:meth:`GraphRunner.check_model`; else they are
  dropped);
* shapes are bucketed (``buckets``, default on): the decode loop rounds the canvas up to a
  :func:`~dllm.ops.shape_bucket` length (more left padding, masked out like any shorter prompt's), the cache rounds
  ``Q`` and ``N`` up (more repeats of each row's first active row, computed and dropped), and the runner the logits
  columns (the last one repeated, its logits dropped); so a few graphs serve every prompt length, a width that
  falls step by step (dKV-Cache-Decode) and rows out of step. Each size is at most 12.5% above the exact one past
  64 (below it the next power of two: a GPU step of that few rows costs what one row costs);
* the K/V buffers are lent by the runner's :class:`BufferPool` (the decode loop gives them back at the end of a
  generation, the serving engine when a batch ends): the fresh cache of the next call takes the same buffers, so a
  graph captured in one call replays in the next. A cache whose writes are ``KVCache.update``'s touches only those
  buffers inside the forward, so its graphs are keyed by the buffers, not by the cache object;
* the static inputs are the canvas, RoPE positions, key mask, active rows, logits columns and the cache's
  ``read_cols``; each step copies the live tensors into them (device-to-device, no host synchronisation; an input
  that is the same tensor, unmodified, as the last copy's is not copied again), replays, and returns a copy of the
  static logits;
* the decode loop makes the next partial forward ready before its step's host synchronisation (:meth:`GraphRunner.prepare`:
  the graph looked up and its inputs filled, on the plan the loop expects) and, where the synchronisation confirms
  that plan, only launches it after (:meth:`GraphRunner.replay`): the host's work between the synchronisation and
  the launch, while the device waits, is a graph launch. Where the regions go on it launches it before the
  synchronisation, its inputs filled under a guard computed on the device (``prepare(guard=...)``: an invalid plan
  keeps the last forward's inputs), so that the device does not wait for the host at all (``Decoder._sync``);
* a full forward (every step without a cache, a cache's refreshes) is a graph of its own (:meth:`GraphRunner.full`):
  keyed by its shapes (its logits columns rounded up) and, with a cache, the K/V buffers it writes in place,
  captured the second time it is seen. Without a cache a generation's canvas is not rounded up (each of its steps has
  one shape; padding would cost every step of a full forward), a served batch's is (``Decoder.buckets``: its canvas
  changes as rows join and leave), and at most ``max_full_graphs`` (4) full-forward graphs are kept, the least
  recently used dropped. Before a cache's first forward of a call it takes its buffers from the pool
  (:meth:`KVCache.take_buffers`, outside the graph), so that forward replays a graph too;
* a cache with per-layer hooks that can speculate (Elastic-Cache: ``KVCache.can_speculate``) runs its partial forwards
  without host synchronisation, in parts (:meth:`GraphRunner.segment`): up to a layer (``stop``), then resumed or
  redone from a layer once its drift tests are read (``Decoder._speculate``); each part a graph keyed by its layers,
  the redo's schedule and the addresses of the state the cache keeps (``KVCache.graph_key``);
* other caches with per-layer hooks, caches with writes of their own (their full forwards too), classifier-free
  guidance, mixtures of experts and models other than dllm's own Transformer run eagerly; :attr:`GraphRunner.stats`
  counts replays, captures (``full ...`` for full forwards, ``resume ...`` / ``redo ...`` for the parts of a
  speculative forward) and each eager reason (``eager:full forward`` for the full forwards run eagerly), and the
  decode loop's trace records what each step did;
* a step's work after its forward (the sampler, the commits, the regions' bookkeeping: ``Decoder._commit``) is a
  graph of its own where the sampler allows it (:meth:`GraphRunner.tail`, keyed by the window; counted apart,
  :attr:`GraphRunner.tail_stats`), on static copies of the decode state kept here (``banks``).

The eager forward is the readable path and the oracle: with ``capture=False`` the runner keeps the same static
buffers and key bookkeeping but "replays" by running the forward on them (what the CPU tests exercise); on CUDA
the captured graph gives the same logits as that forward (the same kernels, replayed).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from dllm.caches.base import KVCache, NoCache, storage_of
from dllm.config import GRAPH_MODES, check_graphs
from dllm.kernels.device import on_device
from dllm.kernels.dispatch import capture_graph
from dllm.models.transformer import Transformer
from dllm.ops import pinned, shape_bucket

log = logging.getLogger(__name__)


_INPUTS = ("x", "positions", "key_mask", "logits_idx", "query_idx", "read_cols")  # a graph's static inputs


class BufferPool:
    """K/V buffers lent to the caches of a model's graph path, so that the caches of successive ``generate`` calls
    (a fresh cache object per call) write into the same memory: the graphs captured on one call's buffers replay on
    the next call's. A cache takes a buffer of a shape (:meth:`take`) and gives its buffers back when its generation
    ends (:meth:`give`); a buffer is lent to one cache at a time. The buffers given back last are lent first, in the
    order they were given: a cache that gives its buffers back in the order it took them takes the same ones again
    in that order, even where another cache left more buffers of that shape behind (Elastic-Cache's stored queries
    have the K/V buffers' shape; taking the oldest first would hand the next cache a rotating set, and its graphs,
    keyed by the addresses, would be captured again at every call). Free buffers are
    kept for the ``max_shapes`` shapes given back last (the others are freed), and small ones (under ``small``
    bytes: a policy's per-step state, e.g. Elastic-Cache's) for the ``max_small`` small shapes given back last."""

    def __init__(self, max_shapes: int = 4, max_small: int = 64, small: int = 1 << 20):
        self.max_shapes, self.max_small, self.small = max_shapes, max_small, small
        self.free: OrderedDict[tuple, deque] = OrderedDict()
        self.lock = threading.Lock()

    def take(self, shape, dtype, device) -> torch.Tensor:
        key = (tuple(shape), dtype, torch.device(device))
        with self.lock:
            q = self.free.get(key)
            if q:
                t = q.popleft()
                if not q:
                    del self.free[key]
                return t
        return torch.empty(key[0], dtype=dtype, device=device)

    def give(self, tensors) -> None:
        given: dict[tuple, list] = {}
        for t in tensors:
            if t is None or not t.is_contiguous() or t._base is not None:
                continue
            key = (tuple(t.shape), t.dtype, t.device)
            given[key] = given.pop(key, []) + [t]  # the shapes in the order of their last buffer given
        with self.lock:
            for key, ts in given.items():  # ahead of the older free buffers of their shape, in the order given
                self.free.setdefault(key, deque()).extendleft(reversed(ts))
                self.free.move_to_end(key)
            for small, most in ((False, self.max_shapes), (True, self.max_small)):
                keys = [k for k in self.free if self._small(k) == small]  # the least recently given first
                for k in keys[:max(len(keys) - most, 0)]:
                    del self.free[k]

    def _small(self, key) -> bool:
        shape, dtype = key[0], key[1]
        return math.prod(shape) * dtype.itemsize < self.small

    def clear(self) -> None:
        """Free the free buffers."""
        with self.lock:
            self.free.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held by the free buffers (read under the lock: a server's metrics thread asks while the engine's
        thread takes and gives)."""
        with self.lock:
            return sum(t.numel() * t.element_size() for q in self.free.values() for t in q)


@dataclass
class _Graph:
    x: torch.Tensor
    positions: torch.Tensor
    key_mask: torch.Tensor | None
    logits_idx: torch.Tensor
    query_idx: torch.Tensor | None  # None: a full forward (GraphRunner.full)
    read_cols: torch.Tensor | None
    captured: bool = False  # replays from now on (capture=False: the forward on the static buffers)
    out: torch.Tensor | None = None  # the captured graph's static logits
    graph: Any = None  # torch.cuda.CUDAGraph, or None (not captured: replay runs the forward)
    # per static input, what was copied into it last: (the live tensor's storage owner, kept alive so its memory is
    # not reused, its address, shape, strides, version); the same again needs no copy
    copied: dict = field(default_factory=dict)
    seen: int = 0
    failed: bool = False  # the capture raised: this shape stays eager
    query_tokens: int | None = None  # the active rows without padding (part of the key: it sets shapes)
    start: int = 0  # a partial forward run from this layer (a speculative cache's resumed forward or redo) ...
    stop: int | None = None  # ... or up to this one (its first part: no logits), GraphRunner.segment


@dataclass
class _Tail:
    """A decode step's work after its forward as a graph (:meth:`GraphRunner.tail`)."""

    keep: Any = None  # the memory it runs on, alive as long as the graph
    seen: int = 0
    captured: bool = False
    failed: bool = False
    graph: Any = None  # torch.cuda.CUDAGraph, or None (capture=False: each replay runs the work)
    out: Any = None  # the captured graph's outputs


@dataclass
class Prepared:
    """A partial forward made ready for :meth:`GraphRunner.replay` (:meth:`GraphRunner.prepare`)."""

    g: _Graph
    B: int
    W: int
    cache: Any
    key: tuple


class GraphRunner:
    """Runs a model's cached partial forwards through CUDA graphs (see the module docstring).

    ``capture``: capture CUDA graphs (default: whether the model is on a CUDA device); ``False`` runs the same
    static-buffer path without capturing (the CPU twin). ``capture_after``: how many times a shape must be seen
    before it is captured (2: the second time). ``max_graphs``: graphs kept per runner; ``max_full_graphs``: of
    those, full forwards' (their canvases are not rounded up, so an evaluation's prompts of many lengths would
    otherwise keep a graph, and its ``[B, W, V]`` logits, per canvas length)."""

    def __init__(self, model, capture: bool | None = None, capture_after: int = 2, max_graphs: int = 32,
                 buckets: bool = True, max_full_graphs: int = 4):
        if capture_after < 1 or max_graphs < 1 or max_full_graphs < 1:
            raise ValueError(f"capture_after ({capture_after}), max_graphs ({max_graphs}) and max_full_graphs "
                             f"({max_full_graphs}) must be >= 1")
        self.max_full_graphs = max_full_graphs
        self.model = model
        self.capture = (model.device.type == "cuda") if capture is None else bool(capture)
        if self.capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on a CUDA device, this one is on {model.device}; "
                             "use capture=False (the static-buffer path without capture) or graphs='off'")
        self.capture_after, self.max_graphs = capture_after, max_graphs
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        #: ``(id(cache), graph)`` of the last call: the graph a cache's last cached step ran (benchmarks profile it)
        self.last: tuple[int, _Graph] | None = None
        self.stats: Counter = Counter()
        #: the decode loop's next forwards made ready before its synchronisation (:meth:`prepare`): ``confirmed`` (the
        #: synchronisation gave the plan expected: the next step only replays) and ``missed`` (it plans again; the last
        #: step of every generation counts here too: no step follows)
        self.ahead: Counter = Counter()
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        #: shapes rounded up to :func:`shape_bucket` sizes (the decode loop's canvas length, the cache's active and
        #: packed rows, the logits columns here), so that a few graphs serve the shapes a generation goes through
        self.buckets = bool(buckets)
        #: the K/V buffers lent to the caches of this model's graph path (:class:`BufferPool`; None: each cache
        #: allocates its own). Between calls the pool holds the last calls' buffers: :meth:`clear` frees them
        self.buffers: BufferPool | None = BufferPool()
        self._signature = self._model_signature()  # the model's tensors the graphs read (check_model)
        #: the decode steps' work after their forwards, one graph per key (:meth:`tail`), and the static decode
        #: states they run on (``dllm.generate._StepBank``, one per shape), kept here so that the next call replays
        #: what an earlier one captured
        self.tails: OrderedDict[tuple, _Tail] = OrderedDict()
        #: their counts: ``replays``, ``captures``, ``eager:first sight`` / ``eager:capture failed``, ``evicted``
        self.tail_stats: Counter = Counter()
        self.banks: OrderedDict[tuple, Any] = OrderedDict()
        self.max_tails, self.max_banks = 4 * max_graphs, 4
        self.tail_pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._dtype = model.dtype  # part of every key; read again with the signature (check_model)

    @classmethod
    def for_model(cls, model, mode: str) -> GraphRunner | None:
        """The model's runner for ``GenerateConfig.graphs`` (created once per model and kept on it), or None
        when the mode is ``off`` (or ``auto`` off CUDA)."""
        check_graphs(mode)
        if mode == "off" or (mode == "auto" and getattr(model, "device", torch.device("cpu")).type != "cuda"):
            return None
        runner = cls.of(model)
        if runner is None:
            runner = cls(model)
            model.__dict__["_dllm_graphs"] = runner
        runner.check_model()
        return runner

    def _model_signature(self) -> tuple:
        m = self.model
        return (tuple(p.data_ptr() for p in m.parameters()), tuple(b.data_ptr() for b in m.buffers()),
                tuple(getattr(layer, "fast", False) for layer in getattr(m, "layers", ())))

    def check_model(self) -> None:
        """Drop every graph if the model's tensors moved or its layers changed path since the last check (a graph
        reads the weights by address and replays the kernels it captured: after the projections were fused again,
        the parameters replaced or moved, or the fast path switched, it would read freed memory or run the other
        path). Called once per generation (:meth:`for_model`), not per step."""
        sig = self._model_signature()
        if sig != self._signature and self.graphs:
            self.stats["evicted"] += len(self.graphs)
            self.graphs.clear()
        self._signature, self._dtype = sig, self.model.dtype

    @staticmethod
    def of(model) -> GraphRunner | None:
        """The runner :meth:`for_model` keeps on ``model``, or None where none was made."""
        return model.__dict__.get("_dllm_graphs")

    # -- eligibility ------------------------------------------------------------------------------------------
    def _model_reason(self, cfg: bool) -> str | None:
        """Why no forward of this model (with guidance) can go through a graph, or None."""
        if cfg:
            return "classifier-free guidance"
        if not isinstance(self.model, Transformer):
            return "not a dllm Transformer"
        if self.model.config.n_experts:
            return "mixture-of-experts routing (data-dependent shapes)"
        if len({p.device for p in self.model.parameters()}) > 1:  # one capture stream records one device's work
            return "model spread over several devices"
        return None

    def setting_reason(self, cache, cfg: bool) -> str | None:
        """Why every cached step (partial forward) of this model with this cache (and guidance) runs eagerly (None:
        they go through graphs; the decode loop buckets its shapes and borrows the pool's buffers only then). Full
        forwards: :meth:`full_reason`."""
        reason = self._model_reason(cfg)
        if reason is not None:
            return reason
        if not isinstance(cache, KVCache):
            return "cache without K/V buffers"
        if (cache.layer_input is not None or cache.observe is not None) and not cache.can_speculate:
            return "cache with per-layer hooks"
        return None

    def full_reason(self, cache, cfg: bool) -> str | None:
        """Why every full forward of this model with this cache (and guidance) runs eagerly, or None: they go
        through graphs (:meth:`full`), every forward without a cache (``NoCache``) and a K/V cache's refreshes
        once it holds its buffers. A cache whose forward runs code of its own (per-layer hooks, its own ``update``:
        state a replay would not update) runs its full forwards eagerly."""
        if isinstance(cache, NoCache):
            return self._model_reason(cfg)
        reason = self.setting_reason(cache, cfg)
        if reason is None and (cache.layer_input is not None or cache.observe is not None):
            return "cache with per-layer hooks"
        if reason is None and type(cache).update is not KVCache.update:
            return "cache with writes of its own"
        return reason

    # -- the step ---------------------------------------------------------------------------------------------
    def __call__(self, x, positions, key_mask, logits_idx, cache, query_idx, query_tokens=None,
                 stop: int | None = None) -> torch.Tensor | None:
        """Logits of a partial forward ``model(x, positions=..., attn_mask=key_mask, logits_idx=...,
        cache=cache, query_idx=query_idx, query_tokens=query_tokens)``, through a graph. ``stop``: run it up to that
        layer only (``stop_layer``; a speculative cache reads its drift tests there, then :meth:`segment` resumes or
        redoes it): None returned."""
        with on_device(x):  # capture and replay on the model's device, whichever is current (dllm.kernels.device)
            return self._step(x, positions, key_mask, logits_idx, cache, query_idx, query_tokens, stop=stop)

    def prepare(self, x, positions, key_mask, logits_idx, cache, query_idx, query_tokens=None,
                guard: torch.Tensor | None = None, stop: int | None = None) -> Prepared | None:
        """The first half of a replay, done ahead: the graph of this partial forward looked up and its static inputs
        filled (device-to-device copies, queued), so that :meth:`replay` later only launches it. None, with nothing
        done, where no captured graph has this key (the call then goes through :meth:`__call__`). The decode loop
        prepares the next step's forward before its host synchronisation, on the plan it expects (the current
        step's shapes and window), and replays it after, where the synchronisation's numbers confirm the plan: the
        host's work between the synchronisation and the launch, while the device waits, is then a few
        microseconds. Filling a graph's inputs has no effect beyond them: each call fills before it replays.

        ``guard`` (a 0-d bool on the device): each input is filled only where it is True, else keeps what it holds
        (the last forward's: the decode loop's guard for a forward launched before it knows whether the plan holds,
        ``Decoder._prepare_next``); the copies are then not remembered (what they hold is known on the device only),
        so the next call fills again. ``stop``: the first part of a speculative cache's forward, up to that layer
        (:meth:`__call__`'s; its replay returns None, the decode loop goes on from its drift tests)."""
        with on_device(x):
            B, W, key, live, query_tokens = self._key(x, positions, key_mask, logits_idx, cache, query_idx, query_tokens)
            key = _part_key(key, cache, 0, stop)
            g = self.graphs.get(key)
            if g is None or not g.captured or g.failed:
                return None
            self.graphs.move_to_end(key)  # in use: the last to be dropped
            self._fill_inputs(g, live, guard)
            return Prepared(g, B, W, cache, key)

    def replay(self, p: Prepared, count: bool = True) -> torch.Tensor | None:
        """The logits of a forward :meth:`prepare` made ready (its graph replayed), or None, with nothing done, where
        the runner no longer holds that graph (dropped since: least recently used, or :meth:`check_model` found the
        model changed): the caller runs the forward the usual way. ``count=False``: not counted in :attr:`stats`
        (a forward launched before the decode loop knows whether it uses it: counted there, where used)."""
        if not self.holds(p):
            return None
        with on_device(p.g.x):
            self._touch(p.g, p.cache)
            return self._run(p.g, p.cache, p.B, p.W, count)

    def holds(self, p: Prepared) -> bool:
        """Whether the graph :meth:`prepare` made ready is still held (not dropped since): :meth:`replay` launches
        it. A first part of a speculative forward (``stop``) returns no logits, so its caller asks here first."""
        return self.graphs.get(p.key) is p.g

    def full(self, x, positions, key_mask, logits_idx, cache) -> torch.Tensor | None:
        """Logits of a full forward ``model(x, positions=..., attn_mask=key_mask, logits_idx=..., cache=cache)``
        through a graph (``cache``: a ``NoCache`` or a K/V cache that :meth:`full_reason` accepts). A K/V cache that
        holds no buffers of this batch and canvas yet (a generation's first forward) takes them first
        (:meth:`KVCache.take_buffers`, from the pool: those the last call of this shape gave back), outside the
        graph, since an allocation is not captured. The graph is keyed by the shapes (a served batch's by its batch
        bucket: :func:`_rows_run`) and the K/V buffers' addresses, captured the second time its key is seen like
        a partial forward's, and writes every row of the cache's buffers in place; after a replay the cache counts as
        filled (the one thing its ``update`` does besides the writes)."""
        kv = isinstance(cache, KVCache)
        n_layers = len(self.model.layers)
        if kv and not _holds_buffers(cache, x.shape, n_layers, self._dtype):
            cfg = self.model.config
            cache.take_buffers(n_layers, (x.shape[0], cfg.n_kv_heads, x.shape[1], cfg.head_dim), self._dtype,
                               x.device)
        with on_device(x):
            B, W = logits_idx.shape
            Bb = _rows_run(cache, B) if kv else B
            Wb = shape_bucket(W, x.shape[1]) if self.buckets else W  # logits columns: the last one repeated up to Wb
            key = ("full", (Bb, *x.shape[1:]), Wb, key_mask is None, x.device, self._dtype,
                   _addresses(cache) if kv else ())
            live = (x, positions, key_mask, logits_idx, None, None)
            g = self.graphs.get(key)
            if g is None:
                g = self.graphs[key] = _Graph(*(None if t is None else t.new_empty(
                    (Bb, Wb if t is logits_idx else t.shape[1])) for t in live))
                self._evict()
            else:
                self.graphs.move_to_end(key)
            self._touch(g, cache)
            self._fill_inputs(g, live)
            out = self._go(g, cache, B, W, kind="full")
            if kv:
                cache.filled = True
            return out

    def _key(self, x, positions, key_mask, logits_idx, cache, query_idx, query_tokens):
        B, W = logits_idx.shape
        Wb = shape_bucket(W, x.shape[1]) if self.buckets else W  # logits columns: the last one repeated up to Wb
        Bb = _rows_run(cache, B)  # the packed rows count a bucket's spare rows in full
        if Bb > B and query_tokens is not None:
            Q = query_idx.shape[1]
            query_tokens = shape_bucket(min(query_tokens + (Bb - B) * Q, Bb * Q), Bb * Q)
        # a cache whose writes are KVCache.update's touches nothing but its K/V buffers inside the forward: its
        # graphs are keyed by the buffers' addresses (any cache object holding them, e.g. the next call's, from
        # the pool); a policy with its own update (state of its own, captured by address) by the object too
        # (or, for a policy that speculates, by what its graph_key names: the state its hooks keep by address)
        owner_id = None if type(cache).update is KVCache.update or cache.can_speculate else id(cache)
        key = ((Bb, *x.shape[1:]), query_idx.shape[1], Wb, key_mask is None, cache.read_cols is None,
               bool(cache.sparse_logits), x.device, self._dtype, owner_id, _addresses(cache), query_tokens,
               cache.graph_key())
        live = (x, positions, key_mask, logits_idx, query_idx, cache.read_cols)
        return B, W, key, live, query_tokens

    def _fill_inputs(self, g: _Graph, live, guard: torch.Tensor | None = None) -> None:
        for name, t in zip(_INPUTS, live):
            if t is not None:
                # positions, key mask and logits columns are usually the very tensors of the last step: their copy
                # (a kernel in the gap before the replay, while the device waits) is skipped
                owner = storage_of(t)
                sig = (owner, t.data_ptr(), t.shape, t.stride(), t._version)
                last = g.copied.get(name)
                if last is None or last[0] is not owner or last[1:] != sig[1:]:
                    if guard is None:
                        _fill(getattr(g, name), t)
                        g.copied[name] = sig
                    else:
                        _fill_where(guard, getattr(g, name), t)
                        g.copied.pop(name, None)

    def _touch(self, g: _Graph, cache) -> None:
        g.seen += 1
        self.last = (id(cache), g)

    def segment(self, x, positions, key_mask, logits_idx, cache, query_idx, start: int) -> torch.Tensor:
        """Logits of a speculative cache's partial forward run from layer ``start`` (``model(..., query_idx=query_idx,
        start_layer=start)``): resumed where its first part stopped (:meth:`__call__`'s ``stop``), or redone from the
        layer ``cache.redo_plan()`` named, each row switching to every row at its layer (``cache.redo_key()``, part
        of the key). A graph of its own, keyed like the forward it continues, captured the second time its key is
        seen; counted as ``resume ...`` / ``redo replays``, ``redo captures``, ``eager:redo, ...``."""
        with on_device(x):
            return self._step(x, positions, key_mask, logits_idx, cache, query_idx, None, start)

    def _step(self, x, positions, key_mask, logits_idx, cache, query_idx, query_tokens, start: int = 0,
              stop: int | None = None) -> torch.Tensor | None:
        B, W, key, live, query_tokens = self._key(x, positions, key_mask, logits_idx, cache, query_idx, query_tokens)
        Bb, Wb = key[0][0], key[2]
        kind = "" if not start else "resume" if cache.redo_key() is None else "redo"
        key = _part_key(key, cache, start, stop)
        g = self.graphs.get(key)
        if g is None:  # static buffers like the live inputs (dense, whatever their strides), at the bucket's sizes
            shapes = [None if t is None else (Bb, Wb if t is logits_idx else t.shape[1]) for t in live]
            g = self.graphs[key] = _Graph(*(None if t is None else t.new_empty(n) for t, n in zip(live, shapes)),
                                          query_tokens=query_tokens, start=start, stop=stop)
            self._evict()
        else:
            self.graphs.move_to_end(key)
        self._touch(g, cache)
        self._fill_inputs(g, live)
        return self._go(g, cache, B, W, kind=kind)

    def _go(self, g: _Graph, cache, B: int, W: int, kind: str = "") -> torch.Tensor:
        """The logits of graph ``g``'s forward (its inputs filled): eager where its capture failed or its key was not
        seen often enough yet (on the static buffers), else captured now or replayed; counted in :attr:`stats` under
        the partial forwards' names or ``kind``'s (``full``: a full forward; ``resume`` / ``redo``: a speculative
        cache's forward resumed or redone from a layer)."""
        eager, captures, replays = ("eager:", "captures", "replays") if not kind else \
            (f"eager:{'full forward' if kind == 'full' else kind}, ", f"{kind} captures", f"{kind} replays")
        if g.failed:
            self.stats[eager + "capture failed"] += 1
            return _narrow(self._forward(g, cache), B, W)
        if not g.captured and g.seen < self.capture_after:  # not seen often enough yet: eager on the static buffers
            self.stats[eager + "first sight"] += 1
            return _narrow(self._forward(g, cache), B, W)
        if not g.captured:
            with pinned():  # the constants the forward reads (aranges) live as long as the graph may replay them
                out = self._capture(g, cache)
            self.stats[captures] += 1
            return _narrow(out, B, W)
        return self._run(g, cache, B, W, name=replays)

    def _run(self, g: _Graph, cache, B: int, W: int, count: bool = True, name: str = "replays") -> torch.Tensor:
        if count:
            self.stats[name] += 1
        if g.graph is None:  # capture=False: the same forward on the same static buffers
            return _narrow(self._forward(g, cache), B, W)
        g.graph.replay()
        return None if g.out is None else g.out[:B, :W].clone()

    def _forward(self, g: _Graph, cache) -> torch.Tensor:
        partial = g.query_idx is not None  # else a full forward (:meth:`full`)
        kw, live = {}, None
        if partial:
            kw = {"query_idx": g.query_idx, "query_tokens": g.query_tokens}
            if g.start:
                kw["start_layer"] = g.start
            if g.stop is not None:
                kw["stop_layer"] = g.stop
            live, cache.read_cols = cache.read_cols, g.read_cols  # the forward reads the static copy (by address)
        k, v = (cache.k, cache.v) if isinstance(cache, KVCache) else ([], [])
        # a batch bucket (:func:`_rows_run`): the forward reads and writes the buffers whole, the views of the batch's
        # rows put back after
        whole = bool(k) and g.x.shape[0] > k[0].shape[0]
        if whole:
            cache.k, cache.v = [storage_of(t) for t in k], [storage_of(t) for t in v]
        try:
            return self.model(g.x, positions=g.positions, attn_mask=g.key_mask, logits_idx=g.logits_idx, cache=cache,
                              **kw)
        finally:
            if partial:
                cache.read_cols = live
            if whole or partial:
                cache.k, cache.v = k, v

    def _capture(self, g: _Graph, cache) -> torch.Tensor:
        if not self.capture:
            g.captured = True
            return self._forward(g, cache)
        # the warm-up is this step's forward: its logits are returned and its K/V writes are the step's writes
        out = _warm_up(lambda: self._forward(g, cache))
        try:
            # thread_local: CUDA calls of other threads (a server's event loop) do not invalidate the capture
            graph, g.out = capture_graph(lambda: self._forward(g, cache), pool=self.pool)
        except Exception as exc:  # an operation that cannot be captured: this shape stays eager
            log.warning("CUDA graph capture failed for batch %d, canvas %d, %s active rows (%s: %s); running "
                        "that shape eagerly", g.x.shape[0], g.x.shape[1], _active(g), type(exc).__name__, exc)
            g.out, g.graph, g.failed = None, None, True
            return out
        g.graph, g.captured = graph, True
        log.info("captured a CUDA graph: batch %d, canvas %d, %s active rows, %d logits columns",
                 g.x.shape[0], g.x.shape[1], _active(g), g.logits_idx.shape[1])
        return out

    def _evict(self) -> None:
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
            self.stats["evicted"] += 1
        full = [k for k in self.graphs if k[0] == "full"]  # least recently used first
        for k in full[:max(len(full) - self.max_full_graphs, 0)]:
            del self.graphs[k]
            self.stats["evicted"] += 1

    # -- the step after its forward ---------------------------------------------------------------------------
    def tail(self, key: tuple, fn, keep: Any = None):
        """``fn()``: a decode step's work after its forward (``Decoder._commit_graphed``), which reads and writes only
        memory that outlives it (the decode state's static copies, ``keep``, kept alive as long as the graph) and
        returns its outputs (tensors, and Python values that are the same at every run of ``key``). Run eagerly the
        first time ``key`` is seen, captured as a CUDA graph the second (its warm-up is that step's work) and
        replayed after: the outputs returned are then the graph's, overwritten by its next replay. Counted in
        :attr:`tail_stats`.
        With ``capture=False`` every run is ``fn()`` on the same memory (the CPU twin). Its own memory pool: the
        forwards' replays never overwrite its outputs."""
        t = self.tails.get(key)
        if t is None:
            t = self.tails[key] = _Tail(keep=keep)
            while len(self.tails) > self.max_tails:
                self.tails.popitem(last=False)
                self.tail_stats["evicted"] += 1
        else:
            self.tails.move_to_end(key)
        t.seen += 1
        if t.failed or (not t.captured and t.seen < self.capture_after):
            self.tail_stats["eager:" + ("capture failed" if t.failed else "first sight")] += 1
            return fn()
        if not t.captured:
            self.tail_stats["captures"] += 1
            with pinned():  # the constants it reads (aranges, tables) live as long as the graph may replay them
                return self._capture_tail(t, fn)
        self.tail_stats["replays"] += 1
        if t.graph is None:  # capture=False: the same work on the same memory
            return self._tail_body(t, fn)
        t.graph.replay()
        return t.out

    def _tail_body(self, t: _Tail, fn):
        return fn()

    def _capture_tail(self, t: _Tail, fn):
        t.captured = True
        if not self.capture:
            return self._tail_body(t, fn)
        out = _warm_up(fn)  # the warm-up is this step's work
        try:
            t.graph, t.out = capture_graph(fn, pool=self.tail_pool)
        except Exception as exc:  # an operation that cannot be captured: this key stays eager
            log.warning("CUDA graph capture of a decode step's sampler failed (%s: %s); running it eagerly",
                        type(exc).__name__, exc)
            t.graph, t.out, t.failed = None, None, True
        return out

    def drop_tails(self, keep: Any) -> None:
        """Drop the step graphs that run on ``keep`` (a bank given up: its memory may be reused)."""
        for k in [k for k, t in self.tails.items() if t.keep is keep]:
            del self.tails[k]
            self.tail_stats["evicted"] += 1

    def clear(self) -> None:
        """Drop every graph (and its memory) and the pool's free K/V buffers (buffers lent to a cache stay with it)."""
        self.graphs.clear()
        self.tails.clear()
        self.banks.clear()
        if self.buffers is not None:
            self.buffers.clear()


_data_ptr = torch.Tensor.data_ptr


def _warm_up(fn):
    """``fn()`` on a side stream before its capture (lazy initialisations, autotuning and kernel choices happen here,
    never during the capture); the current stream waits for its writes, even where it raised."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(s):
            return fn()
    finally:
        torch.cuda.current_stream().wait_stream(s)


def _part_key(key: tuple, cache, start: int, stop: int | None) -> tuple:
    """A partial forward's graph key, or for a part of a speculative cache's forward (run from layer ``start`` or up
    to layer ``stop``) the part's: its layers and the redo's schedule (``cache.redo_key()``) before the key."""
    if not start and stop is None:
        return key
    return ("part", start, stop, cache.redo_key(), *key)


def _addresses(cache) -> tuple:
    """The addresses of the cache's K/V buffers (part of a graph's key), read each step: C-level iteration over the
    layers (a partial forward's cache holds every layer's buffers; before that a layer may still be None)."""
    try:
        return (*map(_data_ptr, cache.k), *map(_data_ptr, cache.v))
    except TypeError:
        return tuple(t.data_ptr() for t in cache.k + cache.v if t is not None)


def _active(g: _Graph) -> str:
    """A graph's active rows, for the log: its width, or "all" (a full forward)."""
    return "all" if g.query_idx is None else str(g.query_idx.shape[1])


def _holds_buffers(cache: KVCache, shape, n_layers: int, dtype) -> bool:
    """Whether ``cache`` holds every layer's K/V buffers for a full forward of canvas ``shape`` ``(B, T)`` in
    ``dtype``: its ``update`` then writes them in place (no allocation, which a graph could not capture)."""
    B, T = shape
    if len(cache.k) != n_layers or len(cache.v) != n_layers:
        return False
    return all(t is not None and t.shape[0] == B and t.shape[2] == T and t.dtype == dtype
               for t in (*cache.k, *cache.v))


def _rows_run(cache: KVCache, B: int) -> int:
    """The rows a forward of a ``B``-row batch runs: a batch in a bucket's buffers (``KVCache.batch_buckets``, a served
    batch) runs as the bucket, its partial forwards and its full ones alike; the extra rows copy row 0 (:func:`_fill`;
    their writes land in the buffers' spare rows, their logits are dropped)."""
    return max(B, cache.capacity())


def _fill(static: torch.Tensor, t: torch.Tensor) -> None:
    """Copy the ``[B, n]`` live input ``t`` into its ``[Bb, nb]`` static buffer: the columns beyond ``n`` repeat the
    last one (logits columns of a wider bucket), the rows beyond ``B`` repeat row 0 (a batch bucket's spare rows)."""
    B, n = t.shape
    static[:B, :n].copy_(t)
    if static.shape[1] > n:
        static[:B, n:].copy_(t[:, -1:].expand(-1, static.shape[1] - n))
    if static.shape[0] > B:
        static[B:].copy_(static[:1].expand(static.shape[0] - B, -1))


def _fill_where(ok: torch.Tensor, static: torch.Tensor, t: torch.Tensor) -> None:
    """:func:`_fill` where the 0-d bool ``ok`` is True (on the device); where False ``static`` keeps its content."""
    if t.shape != static.shape:
        full = torch.empty_like(static)
        _fill(full, t)
        t = full
    torch.where(ok, t, static, out=static)


def _narrow(out: torch.Tensor, B: int, W: int) -> torch.Tensor:
    """The logits of the ``B`` rows and ``W`` columns asked for (a bucket's extra rows and columns dropped); None for
    a forward stopped before its logits."""
    return out if out is None or out.shape[:2] == (B, W) else out[:B, :W].contiguous()


__all__ = ["GRAPH_MODES", "BufferPool", "GraphRunner", "shape_bucket"]
