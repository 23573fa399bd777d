"""Fixtures for the parity tests: cached tiny models, prompt sets and an EOS/EOT-heavy model variant."""

from __future__ import annotations

import functools

import torch
from conftest import EOS, EOT, ragged_prompts, random_model
from torch import nn

MASK_LOGIT = -1.0e4  # finite, so CFG's ``un + (s + 1) * (cond - un)`` stays finite; exp() underflows to 0


class NoMaskHead(nn.Module):
    """The LM head with the mask id's logit pinned to a very negative value.

    A trained checkpoint never predicts the mask token; a random one does (about 1-2% of argmax proposals
    for some seeds). When the mask id is proposed, the reference commits it (a no-op that leaves the
    position masked and can leave masks in its output) while dllm's samplers deliberately never propose
    it (they take the best other token), so the two legitimately diverge. Parity is asserted for models
    that behave like trained ones in this respect.
    """

    def __init__(self, head: nn.Linear, mask_id: int):
        super().__init__()
        self.inner = head
        self.mask_id = mask_id

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.inner(h)
        out[..., self.mask_id] = MASK_LOGIT
        return out


@functools.cache
def cached_model(family: str, seed: int, eos_heavy: bool = False, suppress_mask: bool = True):
    """``random_model(family, seed)`` with the mask id never proposed (see :class:`NoMaskHead`); with
    ``eos_heavy`` the EOS and EOT head rows are scaled copies of the rows of the two tokens the model most often predicts, so EOS/EOT become argmax proposals at many
    positions (otherwise the random model never proposes them and the EOS/EOT options are vacuous).
    The models are read-only in the tests; never mutate a cached one."""
    model = random_model(family, seed)
    if eos_heavy:
        with torch.no_grad():
            probe = torch.randint(3, model.mask_id, (4, 24), generator=torch.Generator().manual_seed(seed))
            probe[:, 12:] = model.mask_id
            top = torch.bincount(model(probe).argmax(-1).flatten(), minlength=model.config.vocab_size)
            top[[EOS, EOT, model.mask_id]] = -1
            a, b = torch.topk(top, 2).indices.tolist()
            w = model.head.weight
            w[EOS] = 1.08 * w[a]
            w[EOT] = 1.04 * w[b]
    if suppress_mask:
        model.head = NoMaskHead(model.head, model.mask_id)
    return model


def prompt_set(batch: int, seed: int) -> list[list[int]]:
    """``batch == 1``: one prompt; ``batch == 3``: three ragged prompts (lengths 5, 9, 3: left padding)."""
    return ragged_prompts(batch, seed) if batch > 1 else ragged_prompts(2, seed)[1:]
