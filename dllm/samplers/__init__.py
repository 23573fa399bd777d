"""Samplers: commit rules and their stages, resolved by name through one registry."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dllm.samplers.base import Sampler, StepContext, StepResult
from dllm.samplers.blocks import BlockPolicy, FixedBlocks, WholeCanvas
from dllm.samplers.dream import DreamSampler
from dllm.samplers.llada import LLaDASampler


@dataclass(frozen=True)
class SamplerEntry:
    name: str
    factory: Callable[..., Sampler]
    description: str
    preset: dict[str, Any] = dataclasses.field(default_factory=dict)

    def params(self) -> dict[str, Any]:
        """Tunable parameters and their defaults (preset values applied)."""
        out = {}
        for f in dataclasses.fields(self.factory):
            if f.name == "name":
                continue
            out[f.name] = self.preset.get(f.name, f.default)
        return out


SAMPLERS: dict[str, SamplerEntry] = {}


def register(name: str, factory, description: str, **preset) -> None:
    SAMPLERS[name] = SamplerEntry(name, factory, description, preset)


register("llada", LLaDASampler, "LLaDA generate.py: Gumbel-max, low-confidence remasking, even quota per block")
register("llada-random", LLaDASampler, "LLaDA generate.py with random remasking", remasking="random")
register("dream", DreamSampler, "Dream diffusion_generate (alg: origin | maskgit_plus | topk_margin | entropy)")
for _alg in ("origin", "maskgit_plus", "topk_margin", "entropy"):
    register(f"dream-{_alg.replace('_', '-')}", DreamSampler, f"Dream diffusion_generate with alg={_alg}", alg=_alg)


def get_sampler(name: str, **params) -> Sampler:
    """Build a registered sampler; ``params`` override the entry's defaults."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; known samplers: {', '.join(sorted(SAMPLERS))}")
    entry = SAMPLERS[name]
    known = entry.params()
    bad = sorted(set(params) - set(known))
    if bad:
        raise ValueError(f"sampler {name!r} has no parameter(s) {bad}; its parameters: {', '.join(known)}")
    return entry.factory(**{**entry.preset, **params, "name": name})


def list_samplers() -> list[SamplerEntry]:
    return [SAMPLERS[k] for k in sorted(SAMPLERS)]


__all__ = ["SAMPLERS", "BlockPolicy", "DreamSampler", "FixedBlocks", "LLaDASampler", "Sampler", "SamplerEntry",
           "StepContext", "StepResult", "WholeCanvas", "get_sampler", "list_samplers", "register"]
