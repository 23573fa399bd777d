"""Kernel launches a forward or a decode step would issue on CUDA, counted on the CPU.

The profiler's kernel count needs a GPU. On the CPU, :class:`LaunchCounter` counts what the CUDA path launches:

* every Triton kernel launch (the kernels run under ``TRITON_INTERPRET=1``; their interpreter's own tensor work is
  not counted);
* every ATen operator that is a CUDA kernel: not views, allocations or metadata (``empty``, ``view``, ``expand``,
  ``_unsafe_view``, ``detach``, ...) and not the host read of a scalar (a synchronisation, counted by
  :mod:`sync_counter`).

A composite operator counts as the kernels it decomposes into (``linear`` -> ``mm``), which is what CUDA runs.
Library (cuBLAS) products count one each, as the profiler mostly sees them. ``counts`` keeps the names.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# operators that launch nothing on CUDA: allocation, metadata, views that the dispatcher does not mark as views
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "_reshape_alias",
        "lift_fresh", "detach", "alias", "resize_", "set_", "is_nonzero", "sym_size", "sym_stride", "sym_numel",
        "sym_storage_offset", "_local_scalar_dense", "result_type"}


class LaunchCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self._patched = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = func.namespace
        name = func.__name__.split(".")[0]
        if ns == "aten" and not func.is_view and name not in FREE:
            self.counts[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime import interpreter

        cls = interpreter.InterpretedFunction
        orig = cls.run
        counts = self.counts

        def run(fn_self, *args, grid, warmup, **kwargs):
            if not warmup:
                counts[f"triton.{fn_self.__name__}"] += 1
            with _disable_current_modes():  # the interpreter's own tensor copies are not kernels
                return orig(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        cls.run = run
        self._patched = (cls, orig)
        return super().__enter__()

    def __exit__(self, *exc):
        cls, orig = self._patched
        cls.run = orig
        return super().__exit__(*exc)
