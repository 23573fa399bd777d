"""Decoding recipes: a sampler, a block layout and a cache, resolved once, here.

A preset (``get_sampler("fast-dllm")``, ``sampler="fast-dllm"``) is a :class:`Recipe`: the sampler that decides
what to commit, the block layout it was published with (a fixed ``block_length`` or a block policy such as
AdaBlock or Elastic-Cache's sliding window) and the cache it was published with. A recipe reads like its
sampler (attribute access goes to ``recipe.sampler``), so code that inspects a preset's rule or temperature
keeps working. :func:`resolve` is the one place where the caller's choices and the recipe's meet:

* sampler: the caller's (a name, a recipe or a sampler object), else the model family's baseline;
* block policy: the caller's ``block_policy``; else the recipe's policy; else fixed blocks of the caller's
  ``GenerateConfig.block_length``, or of the recipe's ``block_length`` when the caller set none and it is shorter
  than ``gen_length``;
* cache: the caller's; else the recipe's (when the model supports caches); else none.

Block-diffusion checkpoints (``config.block_size``, SDAR) differ in two defaults: with no block policy and no
``block_length`` from the caller the regions are the model's own blocks (:class:`~dllm.blocks.AlignedBlocks`),
and with no cache from the caller the cache is the exact block cache (``block``) rather than the recipe's (the
recipes' caches approximate bidirectional models). The ``block`` cache gets the model's block size.
"""

from __future__ import annotations

import dataclasses

from dllm.blocks import AlignedBlocks, BlockPolicyBase, FixedBlocks
from dllm.config import GenerateConfig
from dllm.samplers.recipe import Recipe, as_recipe, configure

__all__ = ["Recipe", "as_recipe", "configure", "default_sampler", "model_block_size", "resolve"]


def default_sampler(model):
    """The model family's baseline sampler (Dream-format: ``dream``, else ``llada``)."""
    from dllm.samplers import get_sampler

    family = getattr(getattr(model, "spec", None), "family", "llada")
    return get_sampler("dream" if family == "dream" else "llada")


def model_block_size(model) -> int | None:
    """The block size of a block-diffusion dllm Transformer (SDAR, LLaDA2), ``None`` for other models (a wrapped
    Hugging Face model's ``config.block_size``, where one exists, means something else)."""
    if not getattr(model, "supports_cache", False):
        return None
    return getattr(getattr(model, "config", None), "block_size", None)


def resolve(model, sampler, cache, block_policy, config: GenerateConfig):
    """``(sampler, cache, policy, config)`` for ``generate`` (see the module docstring). ``sampler`` is a name, a
    :class:`Recipe` or a sampler object (``None``: the model family's baseline); ``cache`` a cache object, a name,
    ``(name, params)`` or ``None``. The sampler is bound to the model, the policy bound and validated."""
    from dllm.caches import NoCache, get_cache
    from dllm.caches.base import CacheBase
    from dllm.samplers import get_sampler
    from dllm.samplers.base import SamplerBase

    if isinstance(sampler, str):
        sampler = get_sampler(sampler)
    if sampler is None:
        sampler = default_sampler(model)
    recipe = as_recipe(sampler)
    recipe = dataclasses.replace(recipe, sampler=_Declared.wrap(recipe.sampler, SamplerBase)).bind_model(model)
    recipe = recipe.for_config(config)
    block_size = model_block_size(model)
    if cache is None and getattr(model, "supports_cache", False):
        cache = "block" if block_size else recipe.cache
    if isinstance(cache, str):
        cache = get_cache(cache)
    elif isinstance(cache, tuple):  # (name, params)
        cache = get_cache(cache[0], **dict(cache[1]))
    if getattr(cache, "name", None) == "block" and getattr(cache, "block_size", 0) is None:
        cache.block_size = block_size  # the exact block cache on the model's grid (ValueError at use without one)
    cache = _Declared.wrap(cache, CacheBase) if cache is not None else NoCache()
    if not isinstance(cache, NoCache) and not getattr(model, "supports_cache", False):
        raise ValueError(f"cache {cache.name!r} needs a dllm Transformer; this model supports no caches (use cache=None)")
    policy, preset_bl = block_policy or recipe.block_policy, None
    if policy is None and block_size and config.block_length is None:
        policy = AlignedBlocks()
    if policy is None:
        bl = recipe.block_length
        if bl and config.block_length is None and bl < config.gen_length:
            preset_bl = bl
            config = dataclasses.replace(config, block_length=bl)
        policy = FixedBlocks()
    policy = _Declared.wrap(policy, BlockPolicyBase).bind(model)
    try:
        policy.validate(config)
    except ValueError as e:
        if preset_bl is None:
            raise
        raise ValueError(f"{e} (block_length={preset_bl} is the preferred block length of sampler "
                         f"{recipe.name!r}; pass block_length=... to choose another)") from None
    return recipe.sampler, cache, policy, config


class _Declared:
    """An object that implements only the required part of a protocol (a sampler's ``step``, a policy's
    ``next_region``), seen with the declared no-op defaults of the hooks it lacks (``base``'s). The decode loop
    then calls every hook directly."""

    def __init__(self, obj, base):
        self._obj, self._base = obj, base

    @staticmethod
    def wrap(obj, base):
        return obj if isinstance(obj, base) else _Declared(obj, base)

    def __getattr__(self, key):
        if hasattr(self._obj, key):
            return getattr(self._obj, key)
        default = getattr(self._base, key)  # AttributeError for anything the protocol does not declare
        return default.__get__(self) if callable(default) and hasattr(default, "__get__") else default

    def __repr__(self) -> str:
        return repr(self._obj)
