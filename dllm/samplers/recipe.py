"""A preset's recipe: a sampler with the block layout and the cache it was published with.

The class lives beside the samplers (the presets are recipes); :mod:`dllm.recipes` resolves a recipe against the
caller's choices, once, for ``generate``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dllm.ops import check_int


@dataclass(frozen=True)
class Recipe:
    """A named decoding setting. ``sampler``: the sampler; ``block_length``: preferred fixed block length
    (``None``: the caller's layout); ``block_policy``: preferred block policy (AdaBlock, SlidingWindow; wins
    over ``block_length``); ``cache``: preferred cache, a registered name or ``(name, ((param, value), ...))``."""

    sampler: Any
    block_length: int | None = None
    block_policy: Any = None
    cache: Any = None
    name: str = ""

    def __post_init__(self):
        if isinstance(self.sampler, Recipe):
            raise TypeError("a recipe's sampler must be a sampler, not another recipe (use recipe.sampler)")
        if self.block_length is not None:
            check_int("block_length", self.block_length, 1, what="a positive integer or None")
        if not self.name:
            object.__setattr__(self, "name", getattr(self.sampler, "name", type(self.sampler).__name__))

    def __getattr__(self, key):  # a recipe reads like its sampler (rule, temperature, ...)
        if key.startswith("__"):
            raise AttributeError(key)
        return getattr(self.sampler, key)

    def step(self, logits, ctx):
        return self.sampler.step(logits, ctx)

    def for_config(self, config) -> Recipe:
        """The recipe for the caller's :class:`~dllm.config.GenerateConfig` (this one; a recipe whose sampler and
        block policy share a block length takes the caller's ``block_length``, e.g. ``multiblock``)."""
        return self

    def bind_model(self, model) -> Recipe:
        """The recipe with its sampler bound to ``model`` (the sampler's ``bind_model`` hook)."""
        bound = self.sampler.bind_model(model) or self.sampler  # a hook that returns nothing keeps the sampler
        return self if bound is self.sampler else dataclasses.replace(self, sampler=bound)


def configure(sampler, **changes):
    """A copy of ``sampler`` (a dataclass sampler, or a recipe's sampler) with ``changes`` to its fields, e.g.
    ``configure(get_sampler("credit"), temperature=0.8)``."""
    if isinstance(sampler, Recipe):
        return dataclasses.replace(sampler, sampler=dataclasses.replace(sampler.sampler, **changes))
    return dataclasses.replace(sampler, **changes)


def as_recipe(sampler) -> Recipe:
    """A recipe for any sampler object (no preferences) or the recipe itself."""
    return sampler if isinstance(sampler, Recipe) else Recipe(sampler)
