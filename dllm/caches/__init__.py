"""Cache policies over one partial-forward primitive (see :mod:`dllm.caches.base`)."""

from __future__ import annotations

from dllm.caches.base import Cache, CacheState, KVCache, NoCache
from dllm.caches.elastic import ElasticCache
from dllm.caches.policies import BlockExact, DKVDecode, DKVGreedy, DualCache, FreeCache, PrefixCache

CACHES = {
    "none": NoCache,
    "prefix": PrefixCache,
    "dual": DualCache,
    "dkv-decode": DKVDecode,
    "dkv-greedy": DKVGreedy,
    "freecache": FreeCache,
    "elastic": ElasticCache,
    "block": BlockExact,
}


def get_cache(name: str, **params) -> Cache:
    """Resolve a cache policy by name (``dllm.caches.CACHES`` lists them)."""
    if name not in CACHES:
        raise ValueError(f"unknown cache {name!r}; known caches: {', '.join(sorted(CACHES))}")
    return CACHES[name](**params)


__all__ = ["CACHES", "BlockExact", "Cache", "CacheState", "DKVDecode", "DKVGreedy", "DualCache", "ElasticCache", "FreeCache", "KVCache",
           "NoCache", "PrefixCache", "get_cache"]
