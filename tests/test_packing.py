"""Packed partial forwards (``query_tokens``, :class:`dllm.models.transformer.RowPacking`): when the rows of a batch
have active sets of different sizes (one row refreshing its block, the others reading their cache), the per-token
work runs on the rows' own active positions and only attention on the padded rows. The padded forward
(``KVCache.pack_rows = False``) is the oracle: the same logits and cache writes, the same tokens."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_model

import dllm
from dllm.caches import get_cache
from dllm.caches.base import padded_rows
from dllm.models.fast import enable_fast_path


def _partial_inputs(model, B=3, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, 90, (B, T), generator=g)
    cache = get_cache("dual")
    cache.reset(B, T)
    model(x, cache=cache)  # fills the K/V buffers
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 5:9] = True  # four rows
    mask[1, :] = True  # every row (a refresh)
    mask[2, 10:12] = True  # two rows
    counts = mask.sum(-1)
    rows = padded_rows(mask, counts)[:, :int(counts.max())]
    logits_idx = (rows + (1 if model.shift_logits else 0)).clamp_max(T - 1)
    return x, cache, rows, logits_idx, int(counts.sum())


@pytest.mark.parametrize("fast", [False, True], ids=["eager", "fast"])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_packed_partial_forward_equals_the_padded_one(family, fast):
    model = random_model(family)
    if fast:
        enable_fast_path(model)
    x, cache, rows, logits_idx, n = _partial_inputs(model)
    assert n < rows.numel()  # there is padding to skip
    padded_cache, packed_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    padded = model(x, cache=padded_cache, query_idx=rows, logits_idx=logits_idx)
    packed = model(x, cache=packed_cache, query_idx=rows, logits_idx=logits_idx, query_tokens=n)
    assert torch.equal(padded, packed)
    for a, b in zip(padded_cache.k + padded_cache.v, packed_cache.k + packed_cache.v):
        assert torch.equal(a, b)  # the cache's writes too (padding slots repeat their row's first)


def test_packed_partial_forward_with_the_triton_kernels(triton_backend):
    """The fast layer's Triton kernels (interpreted) on packed rows: the padded forward's logits."""
    model = enable_fast_path(random_model("llada"))
    x, cache, rows, logits_idx, n = _partial_inputs(model, seed=1)
    padded = model(x, cache=copy.deepcopy(cache), query_idx=rows, logits_idx=logits_idx)
    packed = model(x, cache=copy.deepcopy(cache), query_idx=rows, logits_idx=logits_idx, query_tokens=n)
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)


def test_a_wrong_query_token_count_is_refused():
    model = random_model("llada")
    x, cache, rows, logits_idx, n = _partial_inputs(model)
    for wrong in (n - 1, 1):
        with pytest.raises(RuntimeError, match="query_tokens is below the number of distinct active rows"):
            model(x, cache=copy.deepcopy(cache), query_idx=rows, logits_idx=logits_idx, query_tokens=wrong)


@pytest.mark.parametrize("fast", [False, True], ids=["eager", "fast"])
def test_more_query_tokens_than_distinct_rows_pack_padding_slots_too(fast):
    """A count above the distinct rows (the graph path's bucketed sizes) packs that many slots, the extra ones
    padding: the logits and the cache's writes are still the padded forward's."""
    model = random_model("llada")
    if fast:
        enable_fast_path(model)
    x, cache, rows, logits_idx, n = _partial_inputs(model, seed=2)
    padded_cache = copy.deepcopy(cache)
    padded = model(x, cache=padded_cache, query_idx=rows, logits_idx=logits_idx)
    for more in (n + 1, rows.numel() - 1):
        assert n < more < rows.numel()
        packed_cache = copy.deepcopy(cache)
        packed = model(x, cache=packed_cache, query_idx=rows, logits_idx=logits_idx, query_tokens=more)
        assert torch.equal(padded, packed)
        for a, b in zip(padded_cache.k + padded_cache.v, packed_cache.k + packed_cache.v):
            assert torch.equal(a, b)


@pytest.fixture(scope="module")
def llada_tiny():
    return dllm.load_model("llada-tiny", dtype="float32")


PROMPTS = ['Please copy the list exactly: ["Ann Lee", "Bob Stone"]',
           'Reverse the list: ["Kevin Irving", "Ann Lee", "Paula Parker", "Julia Graham"]',
           "What is 407 + 2185?", "Fill in the Latin square with the symbols A, B, C, D."]


def _run(model, cache_name, packed, **kw):
    cache = get_cache(cache_name)
    cache.pack_rows = packed
    return dllm.generate(model, PROMPTS, gen_length=64, block_length=16, sampler="fast-dllm", cache=cache, **kw)


@pytest.mark.parametrize("cache", ["prefix", "dual", "dkv-decode", "dkv-greedy", "freecache", "elastic"])
def test_generate_packed_equals_padded_with_rows_out_of_step(cache, llada_tiny):
    """A confidence threshold lets each row finish its blocks at its own step; packed, the forwards run only the
    rows' own active sets, and every token, forward count and per-row statistic is the padded run's."""
    padded, packed = _run(llada_tiny, cache, False), _run(llada_tiny, cache, True)
    assert torch.equal(padded.sequences, packed.sequences)
    assert padded.stats.row_nfe == packed.stats.row_nfe
    assert [r["computed"] for r in padded.stats.trace] == [r["computed"] for r in packed.stats.trace]
    run_padded = sum(r["run"] for r in padded.stats.trace)
    run_packed = sum(r["run"] for r in packed.stats.trace)
    if cache == "elastic":  # its per-layer hooks see the padded rows: never packed
        assert run_packed == run_padded
    else:
        assert run_packed < run_padded  # some forward had rows out of step, and ran less packed


def test_the_graph_path_packs_too(llada_tiny):
    """The graph runner's static-buffer path (CPU twin of the CUDA graphs) keys and runs packed forwards."""
    padded = _run(llada_tiny, "dual", False, graphs="on")
    packed = _run(llada_tiny, "dual", True, graphs="on")
    assert torch.equal(padded.sequences, packed.sequences)
    assert sum(r["run"] for r in packed.stats.trace) < sum(r["run"] for r in padded.stats.trace)
    assert packed.stats.graphs.get("replays", 0) + packed.stats.graphs.get("captures", 0) > 0


def test_block_diffusion_models_pack_their_exact_cache():
    """SDAR's exact block cache: rows out of step (a threshold sampler) pack the same way."""
    model = dllm.load_model("sdar-tiny", dtype="float32")
    outs = []
    for packed in (False, True):
        cache = get_cache("block")
        cache.pack_rows = packed
        outs.append(dllm.generate(model, PROMPTS, gen_length=32, sampler="threshold", cache=cache))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert outs[0].stats.row_nfe == outs[1].stats.row_nfe
    assert sum(r["run"] for r in outs[1].stats.trace) < sum(r["run"] for r in outs[0].stats.trace)


def test_guidance_packs_both_copies(llada_tiny):
    """Classifier-free guidance stacks an unconditional copy of the batch: the packed count doubles with it."""
    padded = _run(llada_tiny, "dual", False, cfg_scale=0.5)
    packed = _run(llada_tiny, "dual", True, cfg_scale=0.5)
    assert torch.equal(padded.sequences, packed.sequences)
    assert sum(r["run"] for r in packed.stats.trace) < sum(r["run"] for r in padded.stats.trace)


def test_query_tokens_is_checked_and_layer_hooks_see_padded_rows():
    model = random_model("llada")
    x, cache, rows, logits_idx, n = _partial_inputs(model)
    for bad in (0, rows.numel() + 1, 2.0, True):
        with pytest.raises(ValueError, match="query_tokens"):
            model(x, cache=copy.deepcopy(cache), query_idx=rows, logits_idx=logits_idx, query_tokens=bad)
    with pytest.raises(ValueError, match="given only with query_idx"):
        model(x, query_tokens=5)
    shapes = []
    handle = model.layers[0].register_forward_hook(lambda mod, args, out: shapes.append(tuple(args[0].shape)))
    try:
        hooked = model(x, cache=copy.deepcopy(cache), query_idx=rows, logits_idx=logits_idx, query_tokens=n)
    finally:
        handle.remove()
    assert shapes == [tuple(rows.shape) + (model.config.d_model,)]  # not packed: the hook sees [B, Q, d]
    assert torch.equal(hooked, model(x, cache=copy.deepcopy(cache), query_idx=rows, logits_idx=logits_idx))
