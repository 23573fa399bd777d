"""Samplers: commit rules and their stages, resolved by name through one registry."""

from __future__ import annotations

from dllm.samplers.base import Sampler, SamplerBase, StepContext, StepResult
from dllm.samplers.composed import ComposedSampler
from dllm.samplers.dream import DreamSampler
from dllm.samplers.llada import LLaDASampler
from dllm.samplers.prophet import Prophet
from dllm.samplers.recipe import Recipe
from dllm.samplers.registry import SAMPLERS, SamplerEntry, get_sampler, list_samplers, register
from dllm.samplers.rules import Ascending, EntropyBound, EntropyThreshold, Factor, KLStable, LocalLeap, Quota, Threshold
from dllm.samplers.transforms import CreditFusion, EOSRejection

__all__ = ["SAMPLERS", "AdaBlock", "Ascending", "BlockPolicy", "ComposedSampler", "SamplerBase", "CreditFusion", "DreamSampler",
           "EOSRejection", "EntropyBound", "EntropyThreshold", "Factor", "FixedBlocks", "KLStable", "LLaDASampler", "LocalLeap", "Prophet", "Quota",
           "Sampler", "SamplerEntry", "SlidingWindow", "StepContext", "StepResult", "Threshold", "WholeCanvas", "get_sampler",
           "list_samplers", "register", "Recipe"]


_BLOCKS = ("AdaBlock", "BlockPolicy", "FixedBlocks", "SlidingWindow", "WholeCanvas")


def __getattr__(name):  # block policies live in dllm.blocks; importable from here too
    if name in _BLOCKS:
        import dllm.blocks

        return getattr(dllm.blocks, name)
    raise AttributeError(f"module 'dllm.samplers' has no attribute {name!r}")
