"""Operator traces of a forward, for checking on the CPU that a CUDA graph captured from it would replay correctly.

A CUDA graph replays the kernels it recorded: the same operators with the same non-tensor arguments (Python
numbers are baked into the kernels), on the same memory. :class:`OpTrace` records, for every operator dispatched
while it is active (views included):

* the operator's name and its arguments: numbers, bools, dtypes, devices, lists and the like as they are; a tensor as
  ``(shape, dtype, strides, storage offset, origin)``, its origin ``"int"`` (its storage was allocated by an earlier
  operator of the trace) or ``"ext"`` (memory that existed before: static inputs, K/V buffers, weights), and the
  outputs' ``(shape, dtype, strides)``;
* for each ``"ext"`` tensor, its storage address, apart (:attr:`OpTrace.external`): a graph reads that memory by
  address, so every replay must find its data there;
* every Triton launch (kernels under ``TRITON_INTERPRET=1``): the kernel, its grid, its scalar and ``constexpr``
  arguments and its tensors as above (the interpreter's own tensor work is not traced);
* the operators that make the host wait for the device (``_local_scalar_dense``: ``item`` / ``int`` / ``bool`` of a
  tensor; ``nonzero``, ``masked_select``, ``unique``, ``equal``, ...): :attr:`OpTrace.syncs`;
* tensors made from host data (``torch.tensor(...)``: ``lift_fresh``), with their values: inside a captured region
  that is a host-to-device copy of whatever the host held at capture.

A custom operator built with ``torch.library.triton_op`` (the fused kernels) is recorded, then traced through: its
Python implementation runs under the trace, so its allocations, views and Triton launches appear.

:func:`compare` lists how traces of replays of one graph differ; :func:`replay_problems` what a graph's traced runs
(:class:`Run`) show wrong.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

#: operators that read device data on the host (a synchronisation on CUDA) or whose output shape depends on data
SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "nonzero_static", "masked_select", "unique",
            "_unique", "_unique2", "unique_dim", "unique_consecutive", "equal", "allclose", "is_set_to",
            "_assert_scalar"}
HOST_DATA_OPS = {"lift_fresh", "lift_fresh_copy", "lift"}

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@dataclasses.dataclass(frozen=True)
class Ext:
    """An argument that reads memory allocated before the traced region: entry ``op`` of the trace, argument
    ``where``, storage ``ptr``; ``shape`` and ``dtype`` of the tensor (for messages)."""

    op: int
    where: str
    ptr: int
    shape: tuple
    dtype: Any


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class OpTrace(TorchDispatchMode):
    """``with OpTrace() as tr: forward()``; then ``tr.ops`` (entries), ``tr.external`` (:class:`Ext`), ``tr.syncs``
    (names of syncing operators), ``tr.host_data`` (values of tensors made from host data)."""

    _active: list[OpTrace] = []

    def __init__(self, triton: bool = True):
        super().__init__()
        self.ops: list[tuple] = []
        self.external: list[Ext] = []
        self.syncs: list[str] = []
        self.host_data: list[tuple] = []
        self._internal: set[int] = set()  # storage addresses allocated inside the trace
        self._triton = triton
        self._patched = None

    # -- argument normal forms ----------------------------------------------------------------------------------
    def _tensor(self, t: torch.Tensor, where: str) -> tuple:
        desc = (tuple(t.shape), t.dtype, tuple(t.stride()), t.storage_offset(), t.device.type)
        if t.untyped_storage().nbytes() == 0:
            return ("T", *desc, "empty")
        ptr = _storage_ptr(t)
        if ptr in self._internal:
            return ("T", *desc, "int")
        self.external.append(Ext(len(self.ops), where, ptr, tuple(t.shape), t.dtype))
        return ("T", *desc, "ext")

    def _norm(self, a, where: str):
        if isinstance(a, torch.Tensor):
            return self._tensor(a, where)
        if isinstance(a, bool) or a is None or isinstance(a, (int, str)):
            return a
        if isinstance(a, float):
            return ("f", a.hex())  # NaN equals NaN here; -0.0 differs from 0.0
        if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return a
        if isinstance(a, (list, tuple)):
            return type(a).__name__, tuple(self._norm(x, f"{where}[{i}]") for i, x in enumerate(a))
        if isinstance(a, dict):
            return "dict", tuple((k, self._norm(v, f"{where}.{k}")) for k, v in sorted(a.items()))
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ("sym", str(a))
        return ("obj", type(a).__name__, _ADDRESS.sub("", repr(a)))  # e.g. triton dtypes, generators

    def _outputs(self, out, inputs: set[int]):
        """Normal form of the outputs; the storage of an output that is no input's is allocated here."""
        res = []
        for t in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(t, torch.Tensor):
                if t.untyped_storage().nbytes():
                    ptr = _storage_ptr(t)
                    if ptr not in inputs:
                        self._internal.add(ptr)
                res.append((tuple(t.shape), t.dtype, tuple(t.stride())))
            else:  # a host value (a synchronisation's): its type, not the data
                res.append(("value", type(t).__name__))
        return tuple(res)

    # -- operators ----------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func.__name__.split(".")[0]
        with torch._C.DisableTorchFunction():  # the trace's own tensor queries are not the forward's (SyncCounter)
            flat = [*args, *kwargs.values()]
            inputs = {_storage_ptr(t) for t in _tensors(flat) if t.untyped_storage().nbytes()}
            index = len(self.ops)
            entry_args = tuple(self._norm(a, f"arg{i}") for i, a in enumerate(args))
            entry_kwargs = tuple((k, self._norm(v, k)) for k, v in sorted(kwargs.items()))
            if ns == "aten" and name in SYNC_OPS:
                self.syncs.append(f"aten.{func.__name__}")
            if ns == "aten" and name in HOST_DATA_OPS:
                vals = tuple(t.flatten().tolist() if t.numel() <= 64 else ("numel", t.numel())
                             for t in _tensors(args))
                self.host_data.append((index, vals))
                entry_args = (entry_args, ("values", vals))
        self.ops.append(None)  # placeholder: a traced-through custom operator's inner operators follow it
        impl = _triton_op_impl(func) if ns != "aten" else None
        if impl is not None:  # torch.library.triton_op: run its implementation under the trace
            with self:
                out = impl(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            self.ops[index] = (f"{ns}.{func.__name__}", entry_args, entry_kwargs, self._outputs(out, inputs))
        return out

    # -- Triton launches ----------------------------------------------------------------------------------------
    def _launch(self, fn_self, args, grid, kwargs):
        with torch._C.DisableTorchFunction():
            grid_n = ("fn",) if callable(grid) else self._norm(grid, "grid")
            entry_args = tuple(self._norm(a, f"arg{i}") for i, a in enumerate(args))
            entry_kwargs = tuple((k, self._norm(v, k)) for k, v in sorted(kwargs.items()))
        self.ops.append((f"triton.{fn_self.__name__}", ("grid", grid_n), entry_args, entry_kwargs))

    def __enter__(self):
        if self._triton and not OpTrace._active:
            self._patch_triton()
        OpTrace._active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            OpTrace._active.pop()
            if self._patched is not None and self not in OpTrace._active:  # the outermost exit
                cls, orig = self._patched
                cls.run = orig
                self._patched = None

    def _patch_triton(self):
        try:
            from triton.runtime import interpreter
        except ImportError:  # no Triton: nothing to record
            return
        cls = interpreter.InterpretedFunction
        orig = cls.run

        def run(fn_self, *args, grid, warmup, **kwargs):
            if not warmup and OpTrace._active:
                OpTrace._active[-1]._launch(fn_self, args, grid, kwargs)
            # the interpreter's own tensor work is neither an operator nor a synchronisation of the launch
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                return orig(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        cls.run = run
        self._patched = (cls, orig)

    # -- summaries ----------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return [e[0] for e in self.ops]


def _tensors(xs):
    for x in xs:
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from _tensors(x)


def _triton_op_impl(func):
    """The Python implementation of a ``torch.library.triton_op`` operator (launching its kernels directly), or
    None for other operators."""
    from torch._library.custom_ops import _maybe_get_opdef
    from torch._library.triton import triton_ops_to_kernels

    opdef = _maybe_get_opdef(func)
    if opdef is None or opdef._qualname not in triton_ops_to_kernels:
        return None
    return opdef._init_fn


def _diff_entry(a: tuple, b: tuple) -> str:
    if a[0] != b[0]:
        return f"{a[0]} against {b[0]}"
    parts = []
    for i, (x, y) in enumerate(zip(a[1:], b[1:])):
        if x != y:
            parts.append(f"field {i}: {x!r} against {y!r}")
    return f"{a[0]}: " + "; ".join(parts)


def compare(first: OpTrace, later: OpTrace, names_first: dict[int, str] | None = None,
            names_later: dict[int, str] | None = None) -> list[str]:
    """How trace ``later`` differs from ``first`` (empty: a graph captured from ``first`` replays ``later``'s work):
    the operator sequence with its non-tensor arguments and tensor shapes / dtypes / strides, then the addresses
    of the memory read that existed before the forward (``names_*``: address -> a name, for the message)."""
    n1, n2 = names_first or {}, names_later or {}
    problems = []
    if len(first.ops) != len(later.ops):
        problems.append(f"{len(first.ops)} operators against {len(later.ops)}")
    for i, (a, b) in enumerate(zip(first.ops, later.ops)):
        if a != b:
            problems.append(f"operator {i} differs: {_diff_entry(a, b)}")
            break  # the rest follows from the first difference
    if problems:
        return problems
    for a, b in zip(first.external, later.external):
        if (a.op, a.where) != (b.op, b.where):  # cannot happen with equal traces; kept as a guard
            problems.append(f"external reads out of step: {a} against {b}")
            break
        if a.ptr != b.ptr:
            problems.append(f"operator {a.op} ({first.ops[a.op][0]}) {a.where} {list(a.shape)} {a.dtype} reads "
                            f"{n1.get(a.ptr, hex(a.ptr))} at capture, {n2.get(b.ptr, hex(b.ptr))} at replay")
    return problems


@dataclasses.dataclass
class Run:
    """One traced run of a graph's work: the capture (its warm-up's twin) or a replay, on the CPU twin."""
    call: int  # which decode call (or engine) it ran in
    trace: OpTrace
    syncs: Any  # sync_counter.SyncCounter.where: the calls that synchronise on CUDA
    names: dict  # storage address -> a name, for the messages


def replay_problems(what: str, runs: list[Run]) -> list[str]:
    """What the runs of one graph (``runs[0]``: its capture) show wrong for a captured graph: host synchronisations
    or tensors made from host data in any run, and replays that differ from the capture (:func:`compare`).
    ``what``: the graph, for the messages."""
    out = []
    for i, r in enumerate(runs):
        if r.syncs:
            out.append(f"{what}, run {i}: host synchronisations {dict(r.syncs)}")
        if r.trace.syncs:
            out.append(f"{what}, run {i}: synchronising operators {r.trace.syncs}")
        if r.trace.host_data:
            out.append(f"{what}, run {i}: tensors made from host data {r.trace.host_data}")
    for i, r in enumerate(runs[1:], 1):
        for p in compare(runs[0].trace, r.trace, runs[0].names, r.names):
            out.append(f"{what}, replay {i} (call {r.call}) against the capture (call {runs[0].call}): {p}")
    return out
