"""Small tensor and argument helpers shared by samplers, block policies, caches and the serving engine (no dllm
imports)."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from contextlib import contextmanager

import torch

#: Upper bound of the integer sampler, block-policy and cache parameters counted in canvas positions, steps or
#: tokens (block lengths, windows, radii, chunks, top-k): more than any model's context, and small enough that no
#: index arithmetic on it overflows int64 (a served request's parameters come from the client: ``2**63`` must be
#: refused, not decoded)
MAX_INT_PARAM = 1 << 20


def check_int(name: str, value, lo: int, hi: int = MAX_INT_PARAM, *, fix: str = "", what: str | None = None) -> None:
    """Raise a ValueError naming the parameter unless ``value`` is an integer in ``[lo, hi]``: a bool or a float
    (``4.0``, ``1e308``, NaN) is refused, not truncated. ``what`` describes the values taken (default
    ``"an integer >= lo"``); the message adds the upper bound and ``fix``."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and lo <= value <= hi
    if not ok:
        said = "is out of range" if isinstance(value, numbers.Number) else "is not a number"  # e.g. --param window=wide
        raise ValueError(f"{name}={value!r} {said}; it must be {what or f'an integer >= {lo}'} and at most {hi}{fix}")


#: A real-valued parameter given as an integer beyond this is refused: it is not exact as a float, and past 2**63 it
#: cannot reach a tensor at all (``torch.pow(x, 2**64)`` raises mid-decoding; a served request's JSON can hold it)
MAX_EXACT_INT = 1 << 53


def check_float_size(name: str, value, fix: str = "") -> None:
    """Raise a ValueError when ``value`` is an integer too large to be a float parameter (:data:`MAX_EXACT_INT`)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(value) > MAX_EXACT_INT:
        bits = int(value).bit_length()
        shown = f"{name}={value!r}" if bits <= 128 else f"{name} (an integer of {bits} bits)"
        raise ValueError(f"{shown} is too large: a real-valued parameter given as an integer must be at most 2**53 "
                         f"in size (write it as a float if it is meant){fix}")


def check_range(name: str, value, lo, hi, *, lo_open=False, hi_open=False, fix: str = "") -> None:
    """Raise a ValueError naming the parameter, its range and the fix (NaN, non-numbers, bools and integers too
    large for a float are refused)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise ValueError(f"{name}={value!r} is not a number; it must be a number in "
                         f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}{fix}")
    check_float_size(name, value, fix)
    bad = (value is None or value != value or value < lo or value > hi  # value != value: NaN
           or (lo_open and value == lo) or (hi_open and value == hi))
    if bad:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        raise ValueError(f"{name}={value!r} is out of range; it must lie in {lb}{lo}, {hi}{rb}{fix}")


def check_choice(name: str, value, choices) -> None:
    """Raise a ValueError naming the unknown value and listing the known ones (a list or an object, e.g. from JSON,
    where a single value is expected: said so, not Python's "unhashable type")."""
    try:
        known = value in choices
    except TypeError:
        raise ValueError(f"{name} takes a single value, one of {', '.join(choices)}; got {shown(value)}") from None
    if not known:
        raise ValueError(f"unknown {name} {value!r}; known: {', '.join(choices)}")


SHOWN_CHARS = 80  # the most characters of a caller's value an error message repeats


def shown(v) -> str:
    """``repr(v)`` for an error message, cut to :data:`SHOWN_CHARS` characters (a message never repeats a megabyte of
    a client's request back)."""
    r = repr(v)
    return r if len(r) <= SHOWN_CHARS else f"{r[:SHOWN_CHARS]}... ({len(r)} characters)"


def shape_bucket(n: int, cap: int | None = None) -> int:
    """The size a graph is captured at for a size ``n`` (active rows, packed rows, logits columns, canvas length):
    the next power of two up to 64 (a GPU step of that few rows costs what one row costs: it reads the weights once),
    above it ``n`` rounded up to an eighth of its power of two (at most 12.5% more work, eight sizes per doubling);
    never above ``cap`` (then ``cap``, or ``n`` where ``n`` exceeds it)."""
    if n <= 64:
        b = 1 << max(0, n - 1).bit_length()
    else:
        step = 1 << ((n - 1).bit_length() - 4)
        b = -(-n // step) * step
    return b if cap is None or b <= cap else max(cap, n)


_KEPT: dict = {}  # key -> a device constant made once and shared, read-only (kept)
_PINNED: set = set()  # keys of the constants a captured graph reads: kept for the process (pinned)
_pinning = 0
KEPT_UNPINNED = 64  # the most constants kept that no captured graph reads


@contextmanager
def pinned():
    """While a graph is captured (``dllm.graphs``; on the CPU the static-buffer path's first run in its place): every
    constant :func:`kept` returns (aranges, id tables, a sampler's tables) stays cached for the life of the process,
    as the graph replays the address it read (a constant freed and its memory reused would be read by every later
    replay)."""
    global _pinning
    _pinning += 1
    try:
        yield
    finally:
        _pinning -= 1


def kept(key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The device constant ``make()`` made once per ``key`` (a hashable that names its device) and shared: a decode
    step's constants (aranges, id tables, schedule tables) cost a kernel or a host copy each time they are made on a
    GPU. Read-only: never write into it. :data:`KEPT_UNPINNED` keys are kept, and every one a captured graph read
    (:func:`pinned`)."""
    t = _KEPT.get(key)
    if t is None:
        if len(_KEPT) - len(_PINNED) >= KEPT_UNPINNED:
            for old in [k for k in _KEPT if k not in _PINNED]:
                del _KEPT[old]
        t = _KEPT[key] = make()
    if _pinning:
        _PINNED.add(key)
    return t


def cached_arange(n: int, device) -> torch.Tensor:
    """``torch.arange(n, device=device)`` (int64), made once per (length, device) and shared (:func:`kept`): the decode
    loop's per-step masks compare columns against it every step, and on a GPU each new arange is a kernel. Read-only:
    never write into it."""
    n, device = int(n), torch.device(device)
    return kept(("arange", n, device), lambda: torch.arange(n, device=device))


def id_table(ids: tuple[int, ...], size: int, device) -> torch.Tensor:
    """A ``[size]`` bool tensor on ``device``, True at ``ids`` (those inside it): whether a token is one of many ids
    by one gather (``id_table(...)[tokens]``), where ``torch.isin`` against many ids sorts them and synchronises with
    the device on CUDA (no graph can hold it). Made once per (ids, size, device) and shared (:func:`kept`);
    read-only."""
    device = torch.device(device)

    def make():
        table = torch.zeros(size, dtype=torch.bool, device=device)
        table[torch.tensor([i for i in ids if 0 <= i < size], dtype=torch.long, device=device)] = True
        return table

    return kept(("id_table", tuple(ids), int(size), device), make)


def ids_on(ids: tuple[int, ...], device) -> torch.Tensor:
    """Token ids (a tuple: delimiters, stop tokens) as an int64 tensor on ``device``, made once per (ids, device) and
    shared (:func:`kept`), so a decode step does not copy them from the host each time. Read-only: never write into
    it."""
    device = torch.device(device)
    return kept(("ids", tuple(ids), device), lambda: torch.tensor(ids, dtype=torch.long, device=device))


def moved_rows(t: torch.Tensor, keep: torch.Tensor | None, n_new: int = 0, *, d: int = 0, dim: int | None = None,
               pad=0, shift: bool = False, fill=0) -> torch.Tensor:
    """``t`` (rows along dimension 0, one per batch row) moved with the rows of its batch, as the serving engine
    moves a running batch when requests leave or join, in this order: the ``keep`` rows selected (``[B']`` int64
    indices, ``None``: all, in order); along ``dim``, a canvas-column dimension, ``d`` columns of ``pad`` added on
    the left (``d < 0``: the first ``-d`` columns cropped; ``dim=None``: no column dimension); with ``shift`` the
    values themselves plus ``d`` (canvas columns: region starts, cursors); then ``n_new`` rows of ``fill``
    appended. Returns a contiguous tensor (``t`` itself when nothing moves and it is contiguous)."""
    if keep is not None:
        t = t.index_select(0, keep.to(t.device))
    if dim is not None and d > 0:
        shape = list(t.shape)
        shape[dim] = d
        t = torch.cat([t.new_full(shape, pad), t], dim=dim)
    elif dim is not None and d < 0:
        t = t.narrow(dim, -d, t.shape[dim] + d)
    if shift and d:
        t = t + d
    if n_new:
        t = torch.cat([t, t.new_full((n_new, *t.shape[1:]), fill)])
    return t.contiguous()


_BLOCK = 256  # chunk of the vocabulary for the blocked CPU reductions below


def _blocks(x: torch.Tensor):
    """``(head [..., n, _BLOCK] view, tail [..., V % _BLOCK])`` of the last dimension, or ``None`` when the
    plain kernel is as fast (GPU, small vocabularies)."""
    V = x.shape[-1]
    if x.device.type != "cpu" or V < 8 * _BLOCK:
        return None
    n = V // _BLOCK
    return x[..., : n * _BLOCK].unflatten(-1, (n, _BLOCK)), x[..., n * _BLOCK :]


def fast_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (first maximal index), computed blockwise on CPU, where PyTorch's last-dimension
    ``argmax`` is not vectorised and costs about twice a softmax at a 126k vocabulary (``amax`` is)."""
    parts = _blocks(x)
    if parts is None:
        return x.argmax(-1)
    head, tail = parts
    bmax = head.amax(-1)  # [..., n]
    b = bmax.argmax(-1)
    blk = head.gather(-2, b[..., None, None].expand(*b.shape, 1, _BLOCK)).squeeze(-2)
    idx = b * _BLOCK + blk.argmax(-1)
    if tail.shape[-1]:
        tv, ti = tail.max(-1)
        best = bmax.gather(-1, b[..., None]).squeeze(-1)
        idx = torch.where(tv > best, head.shape[-2] * _BLOCK + ti, idx)
    return idx


def top2_values(x: torch.Tensor) -> torch.Tensor:
    """``torch.topk(x, 2, dim=-1).values`` (``[..., 2]``), blockwise on CPU like :func:`fast_argmax`."""
    parts = _blocks(x)
    if parts is None:
        return torch.topk(x, 2, dim=-1).values
    head, tail = parts
    bmax = head.amax(-1)
    bv, bi = torch.topk(bmax, 2, dim=-1)  # the two largest block maxima
    blk = head.gather(-2, bi[..., :1, None].expand(*bi.shape[:-1], 1, _BLOCK)).squeeze(-2)
    cands = [torch.topk(blk, 2, dim=-1).values, bv[..., 1:]]
    if tail.shape[-1]:
        cands.append(torch.topk(tail, min(2, tail.shape[-1]), dim=-1).values)
    return torch.topk(torch.cat(cands, -1), 2, dim=-1).values


@contextmanager
def mask_column_excluded(x: torch.Tensor, mask_id: int):
    """``x[..., mask_id] = -inf`` for the duration of the block, restored on exit (in place, no copy)."""
    saved = x[..., mask_id].clone()
    x[..., mask_id].fill_(float("-inf"))  # a number baked into the kernel (x[...] = number lifts a host tensor)
    try:
        yield x
    finally:
        x[..., mask_id] = saved


def dense_window(logits: torch.Tensor) -> bool:
    """Whether a sampler (or a block policy) computes its per-position values at every window position, with no
    data-dependent shape or branch (no host synchronisation: on a GPU), rather than only where they can matter (less
    work: on the CPU). The values are the same either way (Dream's scores, Prophet's gaps and early-commit proposals,
    KLASS's KL values, AdaBlock's block ends). Called through the module (``ops.dense_window``), so that a test can
    set the GPU's choice on the CPU."""
    return logits.device.type != "cpu"
