"""Sampler protocol and the shared pieces every commit rule is built from.

A sampler sees the logits of a *window* of canvas columns (the union of the rows' current regions, or each row's own
where it declares :meth:`SamplerBase.row_windows`) and returns a proposal for every window position plus the subset
to commit. Contract of ``step``:

* ``commit`` is a subset of ``ctx.cand`` (still-masked positions inside the row's current region);
* every unfinished row commits at least one token, unless the sampler's own schedule assigns zero tokens to
  this step (Dream's exact ``1 - s/t`` schedule does; it still finishes within its ``steps``);
* the proposal at committed positions is never the mask id;
* no Python loop over batch rows; inputs are not mutated; all randomness comes from :func:`canvas_rand` (or
  ``ctx.generator`` for the batch-dependent reference streams).

Randomness is per row by default (``noise_scope="row"``): each uniform is a counter-based hash of the row's key
(the run's seed and the row's identity), the row's own forward count, the generation column and the vocabulary
index, so a row draws the same numbers alone or in any batch. ``"region"`` and ``"canvas"`` draw from the run's
``torch.Generator`` over the window or the whole canvas (``canvas``: the reference implementations' random
stream); those depend on the batch.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from dllm.ops import (  # noqa: F401 (re-exported)
    MAX_INT_PARAM,
    cached_arange,
    check_choice,
    check_float_size,
    check_int,
    check_range,
    fast_argmax,
    mask_column_excluded,
    top2_values,
)

NOISE_SCOPES = ("row", "region", "canvas")
SOFTMAX_DTYPES = {"float32": torch.float32, "float64": torch.float64, "model": None}


def check_temperature(name: str, value, fix: str = " (use 0 for greedy decoding)") -> None:
    """Raise a ValueError unless ``value`` is a finite number >= 0 (NaN and infinity are refused: they would decode
    garbage silently); a TypeError when it is not a number at all."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number >= 0, got {value!r}{fix}")
    check_float_size(name, value, fix)
    if not (value == value and 0 <= value < float("inf")):
        raise ValueError(f"{name} must be >= 0 and finite, got {value!r}{fix}")


@dataclass
class StepContext:
    """Everything a sampler may read at one step. Window tensors are ``[B, W]``; per-row ones ``[B]``."""

    x: torch.Tensor  # [B, W] int64 current tokens in the window
    cand: torch.Tensor  # [B, W] bool still-masked positions of the row's current region (active rows only)
    step: torch.Tensor  # [B] int64 step index inside the row's current region
    steps: torch.Tensor  # [B] int64 schedule length of the row's current region
    n_region_start: torch.Tensor  # [B] int64 masked positions in the region when it started
    region_lo: torch.Tensor  # [B] int64 canvas column where the row's region starts
    region_hi: torch.Tensor  # [B] int64 canvas column where the row's region ends (exclusive)
    # canvas column of window position 0: an int for the batch, or a ``[B, 1]`` int64 tensor where each row's window
    # is its own (a sampler that declares :meth:`SamplerBase.row_windows`)
    win_lo: int | torch.Tensor
    canvas_len: int  # T, canvas width (prompt + padding + gen)
    gen_lo: int  # canvas column where generation starts
    global_step: int
    total_steps: int
    generator: torch.Generator | None
    mask_id: int
    eos_id: int | None
    eot_id: int | None
    state: dict = field(default_factory=dict)  # sampler scratch space for one generate() call
    # Canvas column where the union of the rows' regions ends (``None``: the window is that union). A sampler
    # with ``window_columns(win_lo, win_hi, gen_lo, canvas_len) -> (lo, hi)`` gets a wider window: its extra
    # columns are never candidates, only there to be read (and filled by an early commit, ``StepResult.finish``).
    win_hi: int | None = None
    # [B, T] the whole canvas (prompt, left padding, generation) as it stands before this step's commits; read
    # by samplers that need more than the window (AR-guided unmasking feeds the prompt to its guide).
    canvas: torch.Tensor | None = None
    # Per-row random streams (``noise_scope="row"``): ``[B, 2]`` int64 32-bit key words of each row (from the seed
    # and the row's identity) and ``[B]`` int64 forwards the row has taken so far. ``None`` outside the loop.
    row_key: torch.Tensor | None = None
    row_step: torch.Tensor | None = None
    draws: int = 0  # per-row draws made so far in this step (each draw gets its own stream)


def row_forwards(ctx: StepContext) -> torch.Tensor:
    """``[B]`` int64 forwards each row has taken before this step: the row's own progress counter. In one
    ``generate`` call every unfinished row has taken part in every forward, so this equals ``global_step``
    there; in a serving batch that rows join and leave it stays each row's own (``global_step`` counts the
    batch's forwards)."""
    if ctx.row_step is not None:
        return ctx.row_step.to(ctx.step.device)
    return torch.full_like(ctx.step, ctx.global_step)


@dataclass
class StepResult:
    proposal: torch.Tensor  # [B, W] int64 (the decode loop writes the commits into the canvas with it in place)
    commit: torch.Tensor  # [B, W] bool
    info: dict[str, Any] = field(default_factory=dict)  # appended to the loop's per-step trace
    # [B] bool or None. Early commit: a row marked here takes ``proposal`` at every still-masked column of the
    # window (columns beyond the regions included) and finishes (the decode loop does the fill; see Prophet).
    finish: torch.Tensor | None = None


@runtime_checkable
class Sampler(Protocol):
    """What the decode loop calls. Required: ``step``; the optional hooks are declared here with their no-op
    defaults (:class:`SamplerBase`) and called directly by the loop (the serving engine also calls
    :meth:`SamplerBase.move_rows` where a sampler has it)."""

    name: str
    #: ``window_columns(win_lo, win_hi, gen_lo, canvas_len) -> (lo, hi)`` or None: canvas columns whose logits
    #: the loop computes beyond the regions (ints for the batch, ``[B]`` tensors per row; Prophet's fill)
    window_columns: Any

    def step(self, logits: torch.Tensor, ctx: StepContext) -> StepResult:  # pragma: no cover - protocol
        ...

    def bind_model(self, model) -> Sampler:  # pragma: no cover - protocol
        """This sampler prepared for ``model`` (once per ``generate``: load a guide, take the family's style)."""


def declares_row_windows(sampler) -> bool:
    """Whether ``sampler`` declares that it takes each row's logits at the row's own window (:meth:`SamplerBase.row_windows`);
    a sampler object without the hook does not."""
    own = getattr(sampler, "row_windows", None)
    return callable(own) and bool(own())


def declares_graph_safe(sampler) -> bool:
    """Whether ``sampler`` declares its step graph-safe (:meth:`SamplerBase.graph_safe`); a sampler object without the
    hook does not."""
    safe = getattr(sampler, "graph_safe", None)
    return callable(safe) and bool(safe())


class SamplerBase:
    """No-op defaults of the optional :class:`Sampler` hooks (every dllm sampler inherits them)."""

    window_columns = None

    def bind_model(self, model):
        return self

    def graph_safe(self) -> bool:
        """Whether :meth:`step` is a function of its tensors alone, so that the decode loop may capture it in a CUDA
        graph with the rest of the step's work after the forward (``Decoder._commit_graphed``) and replay it: no
        host synchronisation, no tensor made from host data, no Python decision on device values, nothing drawn from
        ``ctx.generator``, ``ctx.global_step`` unread, its trace record's keys, shapes and dtypes the same at every
        step of a window, and what it keeps in :attr:`StepContext.state` dicts and lists of tensors and plain values
        whose layout (paths, shapes, dtypes, values) decides its Python (the bank keeps copies of the tensors and
        puts the layout the step left back after a replay; the layout is part of the graph's key). Default False:
        the step runs eagerly."""
        return False

    def row_windows(self) -> bool:
        """Whether :meth:`step` may see each row's logits at the columns of the row's own window rather than at the
        union of the rows' windows: ``ctx.win_lo`` then a ``[B, 1]`` tensor (each row's canvas column of its window
        position 0), every row's window as wide as the widest row's region (a row's columns past its region are
        never candidates, their logits possibly all zero). True for a step that reads window columns only relative to
        each row's own (its noise each row's counter-based stream of generation columns, or none) and keeps no state
        indexed by canvas columns; the decode loop then computes no row's logits at another row's columns, and keys
        its step graphs by the window's width alone. Default False: every row over the union window (``win_lo`` an
        int)."""
        return False

    def move_rows(self, state: dict, d: int, keep: torch.Tensor | None, n_new: int, *,
                  canvas: torch.Tensor | None = None, gen_lo: int = 0, eos_id: int | None = None) -> None:
        """Move the per-row scratch state this sampler keeps in ``state`` (:attr:`StepContext.state`) with the rows
        of its batch (the serving engine, as requests leave and join): the ``keep`` rows selected (``[B']`` int64
        indices, ``None``: all), canvas columns shifted by ``d`` (left padding added, or cropped when ``d < 0``),
        then ``n_new`` rows appended for joining requests, which start with the state their first step would
        build. ``canvas`` (``[n_new, T]``, padded like the batch), ``gen_lo`` and ``eos_id``: the joining rows'
        canvas, generation start and EOS id, for a sampler that builds their state from them (the AR guide).
        Default: no per-row state, nothing to move (a sampler that wraps others forwards this to them)."""


_M32 = 0xFFFFFFFF


# Odd multipliers below 2**31: a product with a 32-bit value stays below 2**63, so int64 never overflows.
_C1, _C2 = 0x7FEB352D, 0x31848BAB


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply finaliser, a bijection on 32-bit values) on int64 tensors."""
    h = h ^ (h >> 16)
    h = (h * _C1) & _M32
    h = h ^ (h >> 15)
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def _fmix32_(h: torch.Tensor) -> torch.Tensor:
    """:func:`_fmix32` in place (large noise tensors)."""
    h.bitwise_xor_(h >> 16).mul_(_C1).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 15).mul_(_C2).bitwise_and_(_M32)
    return h.bitwise_xor_(h >> 16)


def row_key_words(seed: int, ids) -> torch.Tensor:
    """``[B, 2]`` int64 32-bit key words, one pair per row, from ``(seed, row identity)`` (any ``str()``-able id)."""
    import hashlib

    out = []
    for rid in ids:
        d = hashlib.blake2b(f"{seed}\x1f{rid}".encode(), digest_size=8).digest()
        out.append([int.from_bytes(d[:4], "little"), int.from_bytes(d[4:], "little")])
    return torch.tensor(out, dtype=torch.long).reshape(-1, 2)


def row_hash(ctx: StepContext, W: int, n_tail: int | None) -> torch.Tensor:
    """``[B, W]`` (or ``[B, W, n_tail]``) int64 32-bit hashes of (row key, row forward count, this step's draw
    number, generation column[, tail index]): the same for a row whatever its batch. Advances ``ctx.draws``."""
    k = ctx.row_key
    dev = k.device
    d = ctx.draws
    ctx.draws += 1
    step = (ctx.row_step.to(dev) * 0x9E37 + d * 0x7F4A7C15 + 1) & _M32
    base = _fmix32(k[:, 1] ^ _fmix32(k[:, 0] ^ _fmix32(step)))  # [B]
    # [1, W] generation columns, or [B, W] where each row's window is its own (win_lo a [B, 1] tensor)
    col = (torch.arange(W, device=dev)[None] + (ctx.win_lo - ctx.gen_lo + (1 << 20))) & _M32
    h = _fmix32(base[:, None] ^ _fmix32(col))  # [B, W]
    if n_tail is None:
        return _fmix32(h ^ 0x165667B1)
    v = _fmix32(torch.arange(n_tail, device=dev) + 0x2545F491)  # [V]
    return _fmix32_(h[..., None] ^ v)


def row_uniform(ctx: StepContext, W: int, n_tail: int | None, dtype) -> torch.Tensor:
    """Uniform numbers in ``(0, 1)`` from :func:`row_hash` (32 random bits in float64, 24 in float32)."""
    h = row_hash(ctx, W, n_tail)
    if dtype == torch.float64:
        return h.to(torch.float64).add_(0.5).mul_(2.0 ** -32)
    return (h >> 8).to(dtype).add_(0.5).mul_(2.0 ** -24)


def fused_enabled(mode: str, logits: torch.Tensor, eligible: bool) -> bool:
    """The one rule for a sampler's ``fused`` option (``"auto"`` | ``"on"`` | ``"off"``): whether this step's
    proposal and score come from :func:`dllm.kernels.confidence_stats`. ``eligible``: the sampler's stage allows
    it (greedy, a float32 score the kernel computes). ``"auto"`` uses the kernel where the dispatcher runs Triton
    (CUDA), ``"on"`` wherever eligible."""
    from dllm import kernels

    if mode == "off" or not eligible:
        return False
    return mode == "on" or kernels.uses_triton(logits)


def canvas_rand(shape_tail: tuple[int, ...], ctx: StepContext, W: int, B: int, dtype, device, scope: str):
    """Uniform noise for the window: per row (``row``, the default: batch-invariant, :func:`row_uniform`), drawn
    from ``ctx.generator`` over the window (``region``) or over the whole canvas and sliced (``canvas``: the
    random stream of reference implementations that draw noise for every position)."""
    if scope == "row" and ctx.row_key is not None:
        if len(shape_tail) > 1:
            raise ValueError(f"per-row noise takes at most one trailing dimension, got {shape_tail}")
        return row_uniform(ctx, W, shape_tail[0] if shape_tail else None, dtype).to(device)
    if scope == "canvas":
        u = torch.rand((B, ctx.canvas_len, *shape_tail), generator=ctx.generator, dtype=dtype, device=device)
        return u[:, ctx.win_lo : ctx.win_lo + W]
    return torch.rand((B, W, *shape_tail), generator=ctx.generator, dtype=dtype, device=device)


def argmax_unmasked(x: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    """``x.argmax(-1)`` over every column but ``mask_id``: the proposal of a step, never the mask token.

    The mask column is set to ``-inf`` in place for the argmax and restored after (``[...]`` writes, no copy
    of ``x``), so the probabilities computed from ``x`` elsewhere keep the whole vocabulary, as the reference
    implementations compute them."""
    if mask_id is None or not 0 <= mask_id < x.shape[-1]:
        return fast_argmax(x)
    with mask_column_excluded(x, mask_id):
        return fast_argmax(x)


def gumbel_argmax(logits: torch.Tensor, temperature: float, ctx: StepContext, scope: str = "row"):
    """LLaDA's Gumbel-max in float64: ``argmax(exp(l) / (-log u) ** T)``; plain argmax at ``T = 0``. The mask
    token is never proposed (:func:`argmax_unmasked`); the noise is drawn for the whole vocabulary, so the
    random stream is the reference's."""
    if temperature == 0:
        return argmax_unmasked(logits, ctx.mask_id)
    B, W, V = logits.shape
    u = canvas_rand((V,), ctx, W, B, torch.float64, logits.device, scope)
    return argmax_unmasked(logits.to(torch.float64).exp() / (-torch.log(u)) ** temperature, ctx.mask_id)


def select_topk(conf: torch.Tensor, cand: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Commit mask of the ``k[b]`` most confident candidates of each row (ties: lower column first)."""
    conf = torch.where(cand, conf, float("-inf"))  # masked_fill(~cand, ...) in one kernel, not two
    order = torch.sort(conf, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(-1, order, cached_arange(conf.shape[-1], conf.device).expand_as(order))
    return (ranks < k[:, None]) & cand


def top_p_logits(logits: torch.Tensor, top_p: float, fill: float | None = None) -> torch.Tensor:
    """Keep the smallest prefix of the sorted distribution whose mass exceeds ``top_p`` (first always kept); the
    rest is set to ``fill`` (default the dtype's minimum, as Dream; SDAR and LLaDA2 use ``-inf``)."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=True)
    cum = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cum > top_p
    remove = torch.cat([torch.zeros_like(remove[..., :1]), remove[..., :-1]], dim=-1)
    mask = torch.zeros_like(remove).scatter_(-1, sorted_idx, remove)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min if fill is None else fill)


def top_k_logits(logits: torch.Tensor, top_k: int, fill: float | None = None) -> torch.Tensor:
    """Keep the ``top_k`` largest logits (ties with the k-th kept); the rest is set to ``fill`` (as top_p_logits)."""
    k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, k).values[..., -1:]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min if fill is None else fill)


def ensure_progress(commit: torch.Tensor, conf: torch.Tensor, cand: torch.Tensor, only_empty: bool = False) -> torch.Tensor:
    """Add each row's most confident candidate (rows with candidates always commit at least one); with
    ``only_empty`` only to rows that commit nothing."""
    best = torch.where(cand, conf, float("-inf")).argmax(-1, keepdim=True)
    top1 = (cached_arange(conf.shape[-1], conf.device)[None] == best) & cand  # one-hot at best, in two kernels
    if only_empty:
        top1 = top1 & ~commit.any(-1, keepdim=True)
    return commit | top1


def token_prob(logits: torch.Tensor, x0: torch.Tensor, softmax_dtype: str = "float32") -> torch.Tensor:
    """``softmax(logits)[x0]``: the probability of each proposal, ``[B, W]``. ``softmax_dtype`` is a key of
    :data:`SOFTMAX_DTYPES` (``"model"``: the logits' own dtype)."""
    dt = SOFTMAX_DTYPES[softmax_dtype] or logits.dtype
    p = torch.softmax(logits.to(dt), dim=-1)
    return p.gather(-1, x0[..., None]).squeeze(-1)


def even_quota(ctx: StepContext) -> torch.Tensor:
    """LLaDA's linear schedule: ``base = n // S``; the first ``n % S`` steps of the region get one more."""
    steps = ctx.steps.clamp_min(1)
    base = ctx.n_region_start // steps
    return base + (ctx.step < ctx.n_region_start % steps)  # int64 + bool: int64, without a cast kernel
