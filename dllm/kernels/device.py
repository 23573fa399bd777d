"""The device a Triton kernel launches on.

Triton launches on the *current* CUDA device, not on its tensors' device (PyTorch's own operators switch to their
tensors' device). A model on ``cuda:1`` while ``cuda:0`` is current, or the layers of a model spread over several
GPUs (``load_model(device_map=...)``), would otherwise have their Triton kernels launched on the wrong device.
:func:`on_device` makes the tensor's device current around a launch; on a machine with one GPU (or none) it is a
no-op that costs a few attribute tests (the device count is read once, at the first CUDA tensor), and it leaves
``torch.compile`` (whose generated code sets the device itself) alone.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

_MULTI_GPU: bool | None = None  # several CUDA devices in this process (asked at the first CUDA tensor's launch)


def multi_gpu() -> bool:
    global _MULTI_GPU
    if _MULTI_GPU is None:
        _MULTI_GPU = torch.cuda.device_count() > 1
    return _MULTI_GPU


def on_device(t: torch.Tensor):
    """A context making ``t``'s CUDA device the current one (a null context for CPU tensors, while ``torch.compile``
    traces, on one-GPU machines and where it already is current)."""
    if not t.is_cuda or torch.compiler.is_compiling() or not multi_gpu() or \
            t.device.index == torch.cuda.current_device():
        return nullcontext()
    return torch.cuda.device(t.device)
