"""Kernel dispatch.

The backend is chosen once per process: ``reference`` (pure PyTorch, :mod:`dllm.kernels.reference`) unless a
Triton backend is registered and CUDA is present. :func:`set_backend` overrides the choice (tests use it).
Triton is imported lazily, only when its backend is selected.
"""

from __future__ import annotations

from types import ModuleType

from dllm.kernels import reference

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


def set_backend(name: str) -> None:
    """Select the kernel backend: ``"reference"`` or ``"triton"``."""
    global _backend, _module
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; known backends: {', '.join(_BACKENDS)}")
    _module = reference if name == "reference" else _triton_module()
    _backend = name


def get_backend() -> str:
    """The active backend's name (chosen on first use when not set)."""
    if _backend is None:
        set_backend("reference")
    return _backend  # type: ignore[return-value]


def attention(q, k, v, key_padding_mask=None, return_lse=False):
    """Dispatching wrapper; see :func:`dllm.kernels.reference.attention` for shapes and dtypes."""
    if _module is None:
        get_backend()
    return _module.attention(q, k, v, key_padding_mask=key_padding_mask, return_lse=return_lse)


def attention_mass(q, k, key_padding_mask=None, lse=None):
    """Dispatching wrapper; see :func:`dllm.kernels.reference.attention_mass`."""
    if _module is None:
        get_backend()
    return _module.attention_mass(q, k, key_padding_mask=key_padding_mask, lse=lse)


__all__ = ["attention", "attention_mass", "get_backend", "reference", "set_backend"]
