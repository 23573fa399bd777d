"""The sampler registry: every named sampler and preset, ``get_sampler`` and ``list_samplers``."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dllm.ops import shown
from dllm.samplers.base import Sampler
from dllm.samplers.dream import DreamSampler
from dllm.samplers.llada import LLaDASampler
from dllm.samplers.presets import PRESETS
from dllm.samplers.prophet import Prophet
from dllm.samplers.recipe import Recipe


@dataclass(frozen=True)
class SamplerEntry:
    name: str
    factory: Callable[..., Sampler]
    description: str
    preset: dict[str, Any] = dataclasses.field(default_factory=dict)

    def params(self) -> dict[str, Any]:
        """Tunable parameters and their defaults (preset values applied)."""
        if dataclasses.is_dataclass(self.factory):
            defaults = {f.name: f.default for f in dataclasses.fields(self.factory)}
        else:  # a factory function with keyword parameters (presets)
            defaults = {k: p.default for k, p in inspect.signature(self.factory).parameters.items()}
        return {k: self.preset.get(k, v) for k, v in defaults.items() if k != "name"}


SAMPLERS: dict[str, SamplerEntry] = {}


def register(name: str, factory, description: str, **preset) -> None:
    SAMPLERS[name] = SamplerEntry(name, factory, description, preset)


register("llada", LLaDASampler, "LLaDA generate.py: Gumbel-max, low-confidence remasking, even quota per block")
register("llada-random", LLaDASampler, "LLaDA generate.py with random remasking", remasking="random")
register("dream", DreamSampler, "Dream diffusion_generate (alg: origin | maskgit_plus | topk_margin | entropy)")
for _alg in ("origin", "maskgit_plus", "topk_margin", "entropy"):
    register(f"dream-{_alg.replace('_', '-')}", DreamSampler, f"Dream diffusion_generate with alg={_alg}", alg=_alg)
for _name, (_factory, _desc) in PRESETS.items():
    register(_name, _factory, _desc)


def get_sampler(name: str, **params) -> Sampler:
    """Build a registered sampler; ``params`` override the entry's defaults. A parameter whose default is a number
    takes a number, one whose default is ``True`` / ``False`` takes a bool (else ``ValueError`` naming the
    parameter and its default)."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; known samplers: {', '.join(sorted(SAMPLERS))}")
    entry = SAMPLERS[name]
    known = entry.params()
    bad = sorted(set(params) - set(known))
    if bad:
        raise ValueError(f"sampler {name!r} has no parameter(s) {bad}; its parameters: {', '.join(known)}")
    for k, v in params.items():  # typed as the default is (e.g. --param tau=abc from the command line)
        d = known[k]
        if isinstance(d, bool):  # every flag of the registry is a plain switch (nothing else is meant by it)
            if not isinstance(v, bool):
                raise ValueError(f"{name}: {k}={v!r} is not true or false; {k} is a flag (default {d!r})")
        elif isinstance(d, (int, float)) and isinstance(v, (str, bool)):
            raise ValueError(f"{name}: {k}={v!r} is not a number; {k} takes a number (default {d!r})")
    return entry.factory(**{**entry.preset, **params, "name": name})


def list_samplers() -> list[SamplerEntry]:
    return [SAMPLERS[k] for k in sorted(SAMPLERS)]


def prophet(base: str = "llada", early: float = 7.5, mid: float = 5.0, late: float = 2.5, span="region",
            progress: str = "steps", temperature: float = 0.0, block_length: int | None = 32,
            name: str = "prophet") -> Prophet:
    """Prophet early commit over a registered sampler (default LLaDA low-confidence, block 32 as in the paper)."""
    if not isinstance(base, str):
        raise ValueError(f"base={shown(base)}: Prophet's base takes a single value, a registered sampler's name, e.g. "
                         "'llada' or 'fast-dllm'")
    if base in ("prophet", name):
        raise ValueError(f"base={base!r}: Prophet cannot wrap itself; use e.g. base='llada' or base='fast-dllm'")
    inner = get_sampler(base, temperature=temperature)
    if isinstance(inner, Recipe):  # the base preset's layout (and no cache: Prophet reads beyond the regions)
        return Recipe(Prophet(inner.sampler, early, mid, late, span=span, progress=progress, name=name),
                      block_length=block_length or inner.block_length, block_policy=inner.block_policy, name=name)
    return Recipe(Prophet(inner, early, mid, late, span=span, progress=progress, name=name),
                  block_length=block_length, name=name)


register("prophet", prophet, "Prophet early commit (gap 7.5/5.0/2.5 by progress) over LLaDA low-confidence, block 32")
