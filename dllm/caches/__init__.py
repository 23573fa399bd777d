"""Cache policies over one partial-forward primitive (see :mod:`dllm.caches.base`)."""

from __future__ import annotations

import inspect

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


def check_cache_name(name) -> None:
    """``name`` is a registered cache policy (:data:`CACHES`); else a ValueError listing them."""
    if not isinstance(name, str) or name not in CACHES:
        raise ValueError(f"unknown cache {name!r}; known caches: {', '.join(sorted(CACHES))}")


def get_cache(name: str, **params) -> Cache:
    """Resolve a cache policy by name (``dllm.caches.CACHES`` lists them); ``params`` go to its constructor, which
    checks their values (a ValueError naming the parameter, its range and a fix)."""
    check_cache_name(name)
    sig = inspect.signature(CACHES[name]).parameters
    known = [p for p, v in sig.items() if v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)]
    unknown = sorted(set(params) - set(known))
    if unknown and not any(v.kind == v.VAR_KEYWORD for v in sig.values()):
        raise ValueError(f"cache {name!r} has no parameter(s) {unknown}; its parameters: {', '.join(known) or 'none'}")
    return CACHES[name](**params)


__all__ = ["CACHES", "BlockExact", "Cache", "CacheState", "DKVDecode", "DKVGreedy", "DualCache", "ElasticCache", "FreeCache", "KVCache",
           "NoCache", "PrefixCache", "check_cache_name", "get_cache"]
