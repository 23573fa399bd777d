"""Cache policies over one partial-forward primitive (see :mod:`dllm.caches.base`)."""

from __future__ import annotations

from dllm.caches.base import Cache, NoCache

CACHES = {"none": NoCache}


def get_cache(name: str, **params) -> Cache:
    """Resolve a cache policy by name (``dllm.caches.CACHES`` lists them)."""
    if name not in CACHES:
        raise ValueError(f"unknown cache {name!r}; known caches: {', '.join(sorted(CACHES))}")
    return CACHES[name](**params)


__all__ = ["CACHES", "Cache", "NoCache", "get_cache"]
