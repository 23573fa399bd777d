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

:func:`block_layout` is the block-policy part of the rule, from the recipe, the model's block size and the
config alone: ``resolve`` uses it, and :func:`precheck_layout` runs it before a model is loaded (the command line
reads the block size from the checkpoint's config.json).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from dllm.blocks import AlignedBlocks, BlockPolicyBase, FixedBlocks, SlidingWindow
from dllm.config import GenerateConfig
from dllm.samplers.recipe import Recipe, as_recipe, configure

__all__ = ["BlockLayout", "Recipe", "as_recipe", "baseline_name", "block_layout", "check_cache", "check_cache_fits",
           "check_flags", "check_sampler", "configure", "default_sampler", "model_block_size", "precheck_layout",
           "resolve"]


def baseline_name(family: str | None) -> str:
    """The name of a model family's baseline sampler (Dream-format: ``dream``, else ``llada``)."""
    return "dream" if family == "dream" else "llada"


def default_sampler(model):
    """The model family's baseline sampler (:func:`baseline_name`)."""
    from dllm.samplers import get_sampler

    return get_sampler(baseline_name(getattr(getattr(model, "spec", None), "family", "llada")))


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

    if not isinstance(config, GenerateConfig):
        raise TypeError(f"config={config!r} ({type(config).__name__}) is not a GenerateConfig: pass "
                        "dllm.GenerateConfig(gen_length=..., ...), or the options as keywords (gen_length=...)")
    if isinstance(sampler, str):
        sampler = get_sampler(sampler)
    if sampler is None:
        sampler = default_sampler(model)
    check_sampler(sampler)
    check_cache(cache)
    check_policy(block_policy)
    check_flags(config)
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
    if getattr(cache, "name", None) == "block":
        check_cache_fits("block", block_size)
        if getattr(cache, "model_grid", False):
            # the exact block cache on the model's grid (checked above: it has one), set at every call: a cache
            # object used again on another model takes that model's grid, not the one an earlier call set
            cache.block_size = block_size
        elif cache.block_size % block_size:
            raise ValueError(f"cache 'block' with block_size={cache.block_size} is not exact on this model, whose "
                             f"attention blocks are {block_size} tokens: use a multiple of {block_size}, or leave "
                             "block_size out (the model's)")
    cache = _Declared.wrap(cache, CacheBase) if cache is not None else NoCache()
    if not isinstance(cache, NoCache) and not getattr(model, "supports_cache", False):
        raise ValueError(f"cache {cache.name!r} needs a dllm Transformer; this model supports no caches (use cache=None)")
    layout = block_layout(recipe, block_size, config, block_policy)
    policy = _Declared.wrap(layout.policy, BlockPolicyBase).bind(model)
    layout.validate(policy)
    return recipe.sampler, cache, policy, layout.config


def check_sampler(sampler) -> None:
    """``sampler`` (a name already looked up) is a sampler: a recipe or an object with a ``step(logits, ctx)``
    method; else ``TypeError`` naming the accepted forms (before anything reads its attributes)."""
    if not callable(getattr(sampler, "step", None)):
        raise TypeError(f"sampler={sampler!r} ({type(sampler).__name__}) is not a sampler: pass a registered name "
                        "(dllm.list_samplers() or `dllm samplers` lists them), dllm.get_sampler(name, **params), or "
                        "an object with a step(logits, ctx) method")


def check_cache(cache) -> None:
    """``cache`` is None, a registered name, ``(name, params)`` or a cache object (at least a ``reset`` method,
    :class:`dllm.caches.Cache`); else ``TypeError`` naming the accepted forms (a number or a bare object failed with
    an AttributeError inside the decoder)."""
    if cache is None or isinstance(cache, str):
        return
    if isinstance(cache, tuple):
        try:
            ok = len(cache) == 2 and isinstance(cache[0], str) and isinstance(dict(cache[1]), dict)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise TypeError(f"cache={cache!r} is not a (name, params) pair: pass e.g. ('dual', {{'refresh_every': 8}}),"
                            " a name such as 'dual', or dllm.get_cache(name, **params)")
        return
    if not callable(getattr(cache, "reset", None)):
        raise TypeError(f"cache={cache!r} ({type(cache).__name__}) is not a cache: pass a registered name "
                        "(dllm.CACHES lists them), ('name', params), dllm.get_cache(name, **params), or None")


def check_policy(block_policy) -> None:
    """``block_policy`` is None or a block policy: an object with a ``next_region`` method (``dllm.blocks``);
    else ``TypeError`` naming the accepted forms (a name such as ``"adablock"`` is not looked up)."""
    if block_policy is not None and not callable(getattr(block_policy, "next_region", None)):
        raise TypeError(f"block_policy={block_policy!r} ({type(block_policy).__name__}) is not a block policy: pass "
                        "an object from dllm.blocks (FixedBlocks(32), AdaBlock(), SlidingWindow(64), ...), one with a "
                        "next_region method, or None (the sampler's own, else fixed blocks of block_length)")


def check_flags(config: GenerateConfig) -> None:
    """The on/off options of ``config`` are bools: a truthy string ("no") would silently switch them on.
    (GenerateConfig checks its numbers; ``generate`` and the serving engine both resolve through here.)"""
    for name in ("eos_early_stop", "chat_template", "record_confidence"):
        value = getattr(config, name)
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{name} must be True or False, got {value!r}")


def check_cache_fits(cache_name: str | None, block_size: int | None) -> None:
    """The exact ``block`` cache needs a block-diffusion model (``block_size``): refused here, before decoding (the
    command line: before the model loads, with the block size of config.json), not at the first forward."""
    if cache_name == "block" and not block_size:
        raise ValueError("cache 'block' is the exact cache of block-diffusion checkpoints (config block_size, e.g. "
                         "SDAR) and this model is not one; use 'prefix', 'dual' or another cache, or leave the cache "
                         "out (the sampler's own, or none)")


@dataclass(frozen=True)
class BlockLayout:
    """The block layout :func:`block_layout` picked: ``policy`` (not yet bound to a model), ``config`` (the
    caller's, with the recipe's preferred ``block_length`` where that applies), ``source``, what decided it, and
    ``recipe``, the recipe's name.

    ``source`` is ``"caller"`` (the caller's ``block_policy``), ``"recipe"`` (the recipe's block policy),
    ``"aligned"`` (the model's block grid: a block-diffusion model and no ``block_length`` from the caller),
    ``"fixed"`` (fixed blocks of the caller's ``block_length``), ``"preferred"`` (fixed blocks of the recipe's
    preferred ``block_length``) or ``"whole"`` (the whole canvas as one block)."""

    policy: Any
    config: GenerateConfig
    source: str
    recipe: str = ""

    def validate(self, policy=None) -> None:
        """``policy.validate(config)`` for ``policy`` (default: :attr:`policy`; ``resolve`` passes it bound to the
        model). A ``ValueError`` of a layout of the recipe's preferred block length also names the recipe and how
        to choose another length."""
        try:
            (self.policy if policy is None else policy).validate(self.config)
        except ValueError as e:
            if self.source != "preferred":
                raise
            raise ValueError(f"{e} (block_length={self.config.block_length} is the preferred block length of "
                             f"sampler {self.recipe!r}; pass block_length=... to choose another)") from None

    def needs_model(self) -> bool:
        """Whether :attr:`policy` must be bound to a model before it can be validated: all but
        :class:`~dllm.blocks.AlignedBlocks` with a block length and the policies that keep
        :meth:`BlockPolicyBase.bind <dllm.blocks.BlockPolicyBase.bind>` (fixed blocks, multi-block; AdaBlock reads
        its delimiters from the model's tokenizer), and a sliding window (binding only picks the family's window)."""
        if isinstance(self.policy, AlignedBlocks):
            return self.policy.block_length is None
        if isinstance(self.policy, SlidingWindow):  # binding picks the family's window; validation ignores it
            return False
        return not (isinstance(self.policy, BlockPolicyBase) and type(self.policy).bind is BlockPolicyBase.bind)


def block_layout(recipe: Recipe | None, block_size: int | None, config: GenerateConfig,
                 block_policy=None) -> BlockLayout:
    """The block policy and config ``generate`` decodes with (the module docstring's rule), for ``recipe``
    (``None``: the model family's baseline sampler, which prefers no layout) on a model of block size
    ``block_size`` (:func:`model_block_size`; ``None``: not a block-diffusion model), given the caller's ``config``
    and ``block_policy``. In order: the caller's ``block_policy``; the recipe's block policy; on a
    block-diffusion model with no ``config.block_length``, :class:`~dllm.blocks.AlignedBlocks` of ``block_size``;
    fixed blocks of ``config.block_length``; fixed blocks of the recipe's ``block_length`` when that is shorter
    than ``gen_length`` (``config`` then carries it); else the whole canvas. Nothing is bound or validated
    (:meth:`BlockLayout.validate`)."""
    name = recipe.name if recipe is not None else ""
    if block_policy is not None:
        return BlockLayout(block_policy, config, "caller", name)
    if recipe is not None and recipe.block_policy is not None:
        return BlockLayout(recipe.block_policy, config, "recipe", name)
    if block_size and config.block_length is None:
        return BlockLayout(AlignedBlocks(block_size), config, "aligned", name)
    if config.block_length is not None:
        return BlockLayout(FixedBlocks(), config, "fixed", name)
    bl = recipe.block_length if recipe is not None else None
    if bl and bl < config.gen_length:
        return BlockLayout(FixedBlocks(), dataclasses.replace(config, block_length=bl), "preferred", name)
    return BlockLayout(FixedBlocks(), config, "whole", name)


def precheck_layout(sampler, block_size: int | None, config: GenerateConfig) -> BlockLayout | None:
    """The block layout of ``generate(model, ..., config, sampler=sampler)`` on a model of block size
    ``block_size``, validated before the model is loaded (a command line's early check): the
    :class:`BlockLayout`, or ``None`` where it cannot be known or validated without the model. ``sampler``: a
    name, a recipe, a sampler object or ``None`` (the family's baseline). Raises the ``ValueError`` that
    :func:`resolve` would raise for the layout.

    Not known without the model: the layout of a recipe whose ``bind_model`` may change it (``klass``: its block
    length follows the model family's style), unless the caller's ``block_length`` decides it; not validated: a
    policy whose binding reads the model (:meth:`BlockLayout.needs_model`, e.g. AdaBlock)."""
    if isinstance(sampler, str):
        from dllm.samplers import get_sampler

        sampler = get_sampler(sampler)
    recipe = as_recipe(sampler).for_config(config) if sampler is not None else None
    layout = block_layout(recipe, block_size, config)
    if recipe is not None and type(recipe).bind_model is not Recipe.bind_model and layout.source != "fixed":
        return None
    if layout.needs_model():
        return None
    layout.validate()
    return layout


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
