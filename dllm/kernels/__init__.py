"""Kernel dispatch.

The backend is chosen once per process, on first use: ``triton`` (:mod:`dllm.kernels.triton_kernels`) when CUDA
is available and Triton imports, else ``reference`` (pure PyTorch, :mod:`dllm.kernels.reference`).
:func:`set_backend` overrides the choice (tests use it). Triton is imported lazily, only when its backend is
selected. The Triton functions run CUDA tensors, and CPU tensors under ``TRITON_INTERPRET=1``; other CPU tensors
go to the reference functions, so a CUDA process can still run CPU models. The environment variable
``DLLM_KERNELS=reference|triton`` replaces the automatic choice (not an explicit :func:`set_backend`).

On the Triton backend :func:`attention` runs one of SDPA, the flash kernel and the split-K kernel, chosen per shape
bucket by :mod:`dllm.kernels.dispatch` (``DLLM_ATTENTION=sdpa|triton|splitk|auto``, :func:`set_attention_backend`;
:func:`attention_choices` reports the choices). The reference backend always runs the reference twin.

Callers: the model's attention (:func:`attention`), Elastic-Cache (:func:`attention_mass`, and its drift test,
:func:`attention_drift`), and the samplers' greedy confidence (:func:`confidence_stats`: ``ComposedSampler``,
``LLaDASampler`` and ``DreamSampler`` with their ``fused`` option, by default only where :func:`uses_triton` is
true, so the reference backend keeps their bit-exact PyTorch paths).
"""

from __future__ import annotations

from types import ModuleType

from dllm.kernels import dispatch, reference
from dllm.kernels.device import on_device
from dllm.kernels.dispatch import attention_choices, reset_attention_choices, set_attention_backend
from dllm.kernels.reference import ConfidenceStats

_BACKENDS = ("reference", "triton")
_backend: str | None = None
_module: ModuleType | None = None


def _triton_module() -> ModuleType:
    try:
        from dllm.kernels import triton_kernels
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "the 'triton' kernel backend is not available in this build of dllm "
            f"({exc}); use set_backend('reference')"
        ) from exc
    return triton_kernels


def _default_backend() -> str:
    import os

    import torch

    forced = os.environ.get("DLLM_KERNELS")
    if forced:
        return forced

    if torch.cuda.is_available():
        try:
            _triton_module()
        except RuntimeError:
            return "reference"
        return "triton"
    return "reference"


def set_backend(name: str) -> None:
    """Select the kernel backend: ``"reference"`` or ``"triton"``."""
    global _backend, _module
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; known backends: {', '.join(_BACKENDS)}")
    _module = reference if name == "reference" else _triton_module()
    _backend = name


def get_backend() -> str:
    """The active backend's name (chosen on first use when not set: Triton on CUDA, the reference elsewhere)."""
    if _backend is None:
        set_backend(_default_backend())
    return _backend  # type: ignore[return-value]


def uses_triton(t) -> bool:
    """Whether the dispatcher sends tensor ``t`` (any shape and dtype) to a Triton kernel (Triton backend, and a
    CUDA tensor or the Triton interpreter)."""
    return get_backend() == "triton" and _module._usable(t)


def attention(q, k, v, key_padding_mask=None, return_lse=False):
    """Dispatching wrapper; see :func:`dllm.kernels.reference.attention` for shapes and dtypes."""
    if _module is None:
        get_backend()
    if _module is reference:
        return reference.attention(q, k, v, key_padding_mask=key_padding_mask, return_lse=return_lse)
    with on_device(q):  # Triton launches on the current device (dllm.kernels.device)
        return dispatch.attention(_module, q, k, v, key_padding_mask=key_padding_mask, return_lse=return_lse)


def attention_mass(q, k, key_padding_mask=None, lse=None):
    """Dispatching wrapper; see :func:`dllm.kernels.reference.attention_mass`."""
    if _module is None:
        get_backend()
    with on_device(q):
        return _module.attention_mass(q, k, key_padding_mask=key_padding_mask, lse=lse)


def attention_drift(q_old, k_old, q_new, k_new, key_padding_mask, rows_ok, gate=None, first=None, index=0):
    """Dispatching wrapper; see :func:`dllm.kernels.reference.attention_drift`."""
    if _module is None:
        get_backend()
    with on_device(q_old):
        return _module.attention_drift(q_old, k_old, q_new, k_new, key_padding_mask, rows_ok, gate, first, index)


def confidence_stats(logits, temperature=0.0, noise=None, exclude=None):
    """Dispatching wrapper; see :func:`dllm.kernels.reference.confidence_stats`."""
    if _module is None:
        get_backend()
    with on_device(logits):
        return _module.confidence_stats(logits, temperature=temperature, noise=noise, exclude=exclude)


__all__ = ["ConfidenceStats", "attention", "attention_choices", "attention_drift", "attention_mass",
           "confidence_stats", "dispatch", "get_backend", "reference", "reset_attention_choices",
           "set_attention_backend", "set_backend", "uses_triton"]
