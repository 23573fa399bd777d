"""Fixtures for the parity tests: cached tiny models, prompt sets and an EOS/EOT-heavy model variant."""

from __future__ import annotations

import functools

import torch
from conftest import EOS, EOT, ragged_prompts, random_model
from torch import nn

MASK_BOOST = 3.0  # added to the mask logit (capped below the best other one): p(mask) often 1-40 %


class MaskGapHead(nn.Module):
    """The LM head with the mask id's logit raised by ``boost`` but kept at least ``0.5`` below the largest
    other logit of the position.

    A random checkpoint gives the mask token an arbitrary logit: sometimes the argmax (the reference then
    commits the mask id, a no-op, where dllm proposes the best other token: a deliberate difference), mostly
    a negligible probability (which hides whether scores are normalised with or without the mask column).
    Here the mask is never the argmax, and with ``boost = 3`` it holds a large share of the probability mass
    that varies from position to position independently of the top token's, so a score computed without the
    mask column ranks positions differently from the references' full-vocabulary softmax. Under CFG
    (``un + (s + 1) (cond - un)``) the mask can become the argmax; those tests, and the ones with Gumbel noise
    at temperature > 0, use a negative boost (a negligible mask probability).
    """

    def __init__(self, head: nn.Linear, mask_id: int, boost: float = MASK_BOOST):
        super().__init__()
        self.inner = head
        self.mask_id = mask_id
        self.boost = boost

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.inner(h)
        others = out.clone()
        others[..., self.mask_id] = float("-inf")
        out[..., self.mask_id] = torch.minimum(out[..., self.mask_id] + self.boost, others.amax(-1) - 0.5)
        return out


@functools.cache
def cached_model(family: str, seed: int, eos_heavy: bool = False, suppress_mask: bool = True,
                 mask_boost: float = MASK_BOOST):
    """``random_model(family, seed)`` with the mask id never the argmax but likely (see :class:`MaskGapHead`); with
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
        model.head = MaskGapHead(model.head, model.mask_id, mask_boost)
    return model


def prompt_set(batch: int, seed: int) -> list[list[int]]:
    """``batch == 1``: one prompt; ``batch == 3``: three ragged prompts (lengths 5, 9, 3: left padding)."""
    return ragged_prompts(batch, seed) if batch > 1 else ragged_prompts(2, seed)[1:]
