"""Count the operations that make the host wait for the device (on CUDA) while the decode loop runs.

Works on any device: it counts the calls, not the waits. ``item`` / ``tolist`` / ``bool()`` / ``int()`` /
``float()`` / ``__index__`` on a tensor, ``nonzero`` / ``masked_select`` / ``unique``, ``isin`` against more ids
than its broadcast comparison takes (it sorts them with ``unique``), and indexing or assigning with a boolean-mask
tensor (a data-dependent shape) are what synchronise on CUDA.
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode

SYNC_FUNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
              torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
              torch.Tensor.cpu}


def _isin_sorts(elements, test_elements, *args, **kwargs) -> bool:
    """Whether ``torch.isin`` takes its sorting path (PyTorch's heuristic, numpy's): ``unique`` on both inputs."""
    n = elements.numel() if isinstance(elements, torch.Tensor) else 1
    k = test_elements.numel() if isinstance(test_elements, torch.Tensor) else 1
    return n > 0 and k >= 10.0 * n ** 0.145


class SyncCounter(TorchFunctionMode):
    """``with SyncCounter() as c: ...``; ``c.count`` the syncing calls, ``c.where`` by (op, file, line)."""

    def __init__(self):
        super().__init__()
        self.where: collections.Counter = collections.Counter()

    @property
    def count(self) -> int:
        return sum(self.where.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = None
        if func in SYNC_FUNCS:
            name = getattr(func, "__name__", str(func))
        elif func is torch.isin and _isin_sorts(*args, **(kwargs or {})):
            name = "isin[sorting]"
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 0 for i in idx):
                name = f"{func.__name__}[bool mask]"
        if name is not None:
            frames = [f for f in traceback.extract_stack()[:-1] if "/dllm/" in f.filename]
            f = frames[-1] if frames else traceback.extract_stack()[-2]
            self.where[(name, f.filename.rsplit("/dllm/", 1)[-1], f.lineno)] += 1
        return func(*args, **(kwargs or {}))


def syncs_per_step(run) -> tuple[float, collections.Counter, int]:
    """Run ``run()`` (a dllm.generate call) counting syncs inside ``Decoder.step`` only, on the path a CUDA run
    takes; returns (syncs per step, where, steps)."""
    import importlib

    G = importlib.import_module("dllm.generate")  # the module (dllm.generate is also the function)

    counter = SyncCounter()
    steps = 0
    orig = G.Decoder.step

    def counted(self, st):
        nonlocal steps
        steps += 1
        with counter:
            return orig(self, st)

    G.Decoder.step = counted
    free = G._host_check_free
    G._host_check_free = lambda t: False  # count the path a CUDA run takes (on CPU some checks are free)
    try:
        run()
    finally:
        G.Decoder.step = orig
        G._host_check_free = free
    return counter.count / max(steps, 1), counter.where, steps
