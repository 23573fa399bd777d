"""Cache protocol: a policy over the model's partial forward.

Once per forward ``plan(state)`` returns ``(query_idx, refresh_from_layer)``: the active rows to compute
(``None``: all) and the first layer that recomputes every row (``None``: none). Inside the forward the model
calls ``update(layer, k, v)`` per layer with the fresh post-RoPE K/V of the active rows and attends over what
it returns (fresh K/V for active rows, cached K/V for the rest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Cache(Protocol):
    name: str

    def reset(self, batch: int, canvas_len: int) -> None:  # pragma: no cover - protocol
        """Start a new generate() call."""

    def plan(self, state: Any) -> tuple[torch.Tensor | None, int | None]:  # pragma: no cover - protocol
        ...

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...  # pragma: no cover - protocol


@dataclass
class NoCache:
    """Recompute everything at every step (the exact baseline every cache is tested against)."""

    name: str = "none"

    def reset(self, batch: int, canvas_len: int) -> None:
        pass

    def plan(self, state: Any) -> tuple[None, None]:
        return None, None

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v
