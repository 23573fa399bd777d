"""The nucleus cut as a logits transform in front of any sampler (dllm.samplers.transforms.TopP)."""

from __future__ import annotations

import pytest
import torch
from conftest import ragged_prompts
from helpers_parity import cached_model

import dllm
from dllm.samplers.dream import top_p_logits
from dllm.samplers.transforms import TopP, nucleus, with_top_p


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.9, 0.999])
def test_nucleus_is_dreams_cut_over_the_proposable_tokens(top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=g) * 3
    mask_id = 49
    cut = nucleus(logits, top_p, mask_id)
    no_mask = logits.masked_fill(torch.arange(50) == mask_id, float("-inf"))
    assert torch.equal(cut, top_p_logits(no_mask, top_p, fill=float("-inf")))
    assert torch.isinf(cut[..., mask_id]).all()
    kept = torch.isfinite(cut)
    top = no_mask.argmax(-1, keepdim=True)
    assert kept.gather(-1, top).all()  # the most probable proposable token always stays
    p = torch.softmax(no_mask, -1)
    mass = (p * kept).sum(-1)
    assert (mass >= min(top_p, 1.0) - 1e-6).all()  # the kept set holds at least top_p
    # and it is the smallest such prefix: without its least probable token it would hold at most top_p
    least = torch.where(kept, p, torch.full_like(p, 2.0)).amin(-1)
    assert ((mass - least) <= top_p + 1e-6).all()


def test_top_p_one_passes_the_logits_through():
    model = cached_model("llada", 0)
    kw = dict(gen_length=16, block_length=8, steps=16, seed=1)
    for name in ("llada", "threshold", "fast-dllm"):
        a = dllm.generate(model, ragged_prompts(3, 1), sampler=dllm.get_sampler(name), **kw)
        b = dllm.generate(model, ragged_prompts(3, 1), sampler=with_top_p(dllm.get_sampler(name), 1.0), **kw)
        assert torch.equal(a.sequences, b.sequences) and a.stats.nfe == b.stats.nfe


def test_a_one_token_nucleus_makes_sampling_greedy():
    """With only the most probable token left, a temperature has nothing to draw from: the run is the greedy one."""
    model = cached_model("llada", 0)
    kw = dict(gen_length=16, block_length=8, steps=16, seed=3)
    hot = dllm.generate(model, ragged_prompts(3, 2), sampler=TopP(dllm.get_sampler("llada", temperature=1.0), 1e-9),
                        **kw)
    cold = dllm.generate(model, ragged_prompts(3, 2), sampler=TopP(dllm.get_sampler("llada"), 1e-9), **kw)
    plain_hot = dllm.generate(model, ragged_prompts(3, 2), sampler=dllm.get_sampler("llada", temperature=1.0), **kw)
    assert torch.equal(hot.sequences, cold.sequences)
    assert not torch.equal(hot.sequences, plain_hot.sequences)  # the cut did something


def test_top_p_wraps_recipes_and_checks_its_value():
    rec = dllm.get_sampler("fast-dllm")
    wrapped = with_top_p(rec, 0.5)
    assert wrapped.cache == rec.cache and wrapped.block_length == rec.block_length
    assert isinstance(wrapped.sampler, TopP) and wrapped.sampler.name == rec.sampler.name
    with pytest.raises(ValueError, match="top_p"):
        TopP(dllm.get_sampler("llada"), 0)
    with pytest.raises(ValueError, match="top_p"):
        TopP(dllm.get_sampler("llada"), 1.5)
    with pytest.raises(TypeError, match="inner must be a sampler"):
        TopP(object(), 0.5)
