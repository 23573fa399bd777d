"""The graph path of the cached decode step (dllm.graphs).

On CPU the runner's static-buffer path runs without capture (``graphs="on"``): the same static inputs, keys,
captures, replays and eager fallbacks as on CUDA, with the forward run on the static buffers instead of a graph
replay. It must decode exactly what the eager path decodes. The ``gpu`` tests capture real CUDA graphs.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from conftest import ragged_prompts
from helpers_parity import cached_model

import dllm
from dllm.caches import get_cache
from dllm.caches.base import CacheState
from dllm.graphs import BufferPool, GraphRunner, shape_bucket

CACHED = ["prefix", "dual", "dkv-decode", "dkv-greedy", "freecache"]


def _gen(model, cache, graphs, sampler="threshold", prompts=None, **kw):
    prompts = prompts if prompts is not None else ragged_prompts(3, 1)
    opts = dict(gen_length=16, block_length=8, steps=16, seed=1)
    opts.update(kw)
    return dllm.generate(model, prompts, sampler=sampler, cache=cache, graphs=graphs, **opts)


@pytest.mark.parametrize("cache", CACHED)
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_static_buffer_path_decodes_what_the_eager_path_decodes(family, cache):
    model = cached_model(family, 0)
    for sampler in ("threshold", "llada"):
        eager = _gen(model, cache, "off", sampler)
        graph = _gen(model, cache, "on", sampler)
        assert torch.equal(eager.sequences, graph.sequences), (family, cache, sampler)
        assert eager.stats.nfe == graph.stats.nfe
        assert eager.stats.commit_step == graph.stats.commit_step
        assert eager.stats.graphs == {}
        g = graph.stats.graphs
        assert "eager:full forward" not in g  # the first forward takes the cache's buffers, then runs as a graph
        assert sum(n for k, n in g.items() if k != "evicted") == graph.stats.nfe  # every forward counted once


def test_dual_cache_replays_one_graph_for_the_whole_generation():
    model = cached_model("llada", 0)
    cache = get_cache("dual")
    runner = GraphRunner(model, capture=False)
    model.__dict__["_dllm_graphs"], saved = runner, model.__dict__.get("_dllm_graphs")
    try:
        prompts = [ragged_prompts(3, 1)[0]]
        first = _gen(model, cache, "on", "llada", prompts=prompts, gen_length=32, block_length=8, steps=32)
        # 4 blocks of 8 steps: each block starts with a full forward (the first takes the cache's buffers from the
        # pool; each writes them in place: a graph of its own), then 7 partial forwards of one shape
        assert first.stats.graphs == {"eager:full forward, first sight": 1, "full captures": 1, "full replays": 2,
                                      "eager:first sight": 1, "captures": 1, "replays": 26}
        assert len(runner.graphs) == 2
        second = _gen(model, cache, "on", "llada", prompts=prompts, gen_length=32, block_length=8, steps=32)
        # the same buffers: no capture, every forward replayed, the first too
        assert second.stats.graphs == {"full replays": 4, "replays": 28}
        assert torch.equal(first.sequences, second.sequences)
    finally:
        model.__dict__["_dllm_graphs"] = saved


@contextmanager
def own_runner(model, **kw):
    """A fresh runner (static-buffer path) on the model for the block, then the model's own again."""
    runner = GraphRunner(model, capture=False, **kw)
    saved = model.__dict__.get("_dllm_graphs")
    model.__dict__["_dllm_graphs"] = runner
    try:
        yield runner
    finally:
        model.__dict__["_dllm_graphs"] = saved


def test_shape_buckets():
    assert [shape_bucket(n) for n in (1, 2, 3, 5, 17, 33, 64)] == [1, 2, 4, 8, 32, 64, 64]
    assert [shape_bucket(n) for n in (65, 72, 73, 129, 600)] == [72, 72, 80, 144, 640]
    for n in range(1, 3000):  # never below n, past 64 at most an eighth above it
        b = shape_bucket(n)
        assert n <= b and (n <= 64 or b <= n * 1.125), n
    assert len({shape_bucket(n) for n in range(1, 1025)}) == 7 + 4 * 8  # powers of two, then 8 per doubling
    assert shape_bucket(33, cap=36) == 36 and shape_bucket(40, cap=36) == 40  # capped, never below n


def test_buffer_pool_lends_a_buffer_to_one_cache_at_a_time_and_in_order():
    pool = BufferPool(max_shapes=2, small=0)  # every buffer counts as large here
    a, b = (pool.take((2, 3), torch.float32, "cpu") for _ in range(2))
    assert a.data_ptr() != b.data_ptr()
    pool.give([a, b])
    c, d, e = (pool.take((2, 3), torch.float32, "cpu") for _ in range(3))
    assert c is a and d is b and e is not a and e is not b  # in the order given back; none lent twice
    pool.give([torch.zeros(1), torch.zeros(4, 4)[:, :2], None])  # a view (not its own memory) is not kept
    assert [len(q) for q in pool.free.values()] == [1]
    pool.give([torch.zeros(2), torch.zeros(3)])  # a third shape: the one given back longest ago is freed
    assert len(pool.free) == 2 and ((1,), torch.float32, torch.device("cpu")) not in pool.free
    assert pool.nbytes == 5 * 4


def test_buffer_pool_lends_a_cache_the_buffers_it_gave_back_whatever_another_left():
    """A cache that takes fewer buffers of a shape than the last one gave back (dKV-Cache's K and V after
    Elastic-Cache's K, V and stored queries, all of one shape) takes the same ones at every later call: its graphs,
    keyed by the addresses, replay instead of being captured again."""
    pool = BufferPool(small=0)
    pool.give([torch.zeros(2, 3) for _ in range(3)])  # what the other cache left
    first = [pool.take((2, 3), torch.float32, "cpu") for _ in range(2)]
    for _ in range(3):
        pool.give(first)
        again = [pool.take((2, 3), torch.float32, "cpu") for _ in range(2)]
        assert [t.data_ptr() for t in again] == [t.data_ptr() for t in first]
    assert len(pool.free[((2, 3), torch.float32, torch.device("cpu"))]) == 1  # the third is still free


def test_buffer_pool_keeps_small_shapes_apart_from_large_ones():
    """Small buffers (a policy's per-step state) do not push the K/V buffers' shapes out: each kind has its own
    limit on the shapes kept."""
    pool = BufferPool(max_shapes=1, max_small=2, small=64)  # 16 floats and more count as large
    big = torch.zeros(4, 4)
    pool.give([big, torch.zeros(1), torch.zeros(2), torch.zeros(3)])  # three small shapes: the oldest freed
    assert pool.take((4, 4), torch.float32, "cpu") is big
    assert sorted(k[0] for k in pool.free) == [(2,), (3,)]
    pool.give([big, torch.zeros(5, 4)])  # a second large shape: the first freed, the small ones stay
    assert sorted(k[0] for k in pool.free) == [(2,), (3,), (5, 4)]


def test_fresh_caches_of_later_calls_replay_the_first_calls_graphs():
    """Each call builds a fresh cache (by name); the caches take the same K/V buffers from the runner's pool, and
    prompt lengths whose canvases round up to one bucket share a canvas length, so a later call with another prompt
    length replays what the first captured. Exact shapes capture again."""
    model = cached_model("llada", 0)
    kw = dict(gen_length=32, block_length=8, steps=32)
    five, seven = [ragged_prompts(1, 1)[0]], [ragged_prompts(4, 2)[3]]
    assert (len(five[0]), len(seven[0])) == (5, 7)  # canvases of 37 and 39 columns: one bucket of 64
    with own_runner(model) as runner:
        first = _gen(model, "dual", "on", "llada", prompts=five, **kw)
        assert first.stats.graphs.get("captures") == 1
        assert 0 < first.stats.cache_bytes <= runner.buffers.nbytes  # the call's buffers went back to the pool
        cache = get_cache("dual")
        second = _gen(model, cache, "on", "llada", prompts=seven, **kw)
        assert second.stats.graphs == {"full replays": 4, "replays": 28}
        assert len(runner.graphs) == 2  # the partial forwards' graph and the refreshes'
        assert cache.k == [] and not cache.filled  # released at the end of the call
        runner.clear()  # the graphs and the pool's free buffers
        assert not runner.graphs and runner.buffers.nbytes == 0
    assert torch.equal(first.sequences, _gen(model, "dual", "off", "llada", prompts=five, **kw).sequences)
    assert torch.equal(second.sequences, _gen(model, "dual", "off", "llada", prompts=seven, **kw).sequences)
    with own_runner(model, buckets=False) as runner:  # exact canvases: the other length is another graph
        _gen(model, "dual", "on", "llada", prompts=five, **kw)
        assert _gen(model, "dual", "on", "llada", prompts=seven, **kw).stats.graphs.get("captures") == 1
        assert len(runner.graphs) == 4  # per length: the partial forwards' graph and the refreshes'


def test_full_forwards_round_their_logits_columns_up_and_keep_their_exact_canvas():
    """A full forward's logits columns (the window's width) are rounded up to a bucket, the last column repeated: a
    generation in windows of 3 columns replays the graph captured for windows of 4, with the eager path's tokens.
    Without a cache a generation keeps its exact canvas (each of its steps has one shape; padding would cost every
    step): another prompt length captures a graph of its own."""
    model = cached_model("llada", 0)
    prompt = [ragged_prompts(4, 2)[3]]
    kw = dict(prompts=prompt, gen_length=12, steps=12)
    eager = _gen(model, "none", "off", "llada", block_length=3, **kw)
    for buckets, want in ((True, {"full replays": 12}), (False, {"eager:full forward, first sight": 1,
                                                                 "full captures": 1, "full replays": 10})):
        with own_runner(model, buckets=buckets) as runner:
            four, three = (_gen(model, "none", "on", "llada", block_length=b, **kw) for b in (4, 3))
            assert four.stats.graphs.get("full captures") == 1 and three.stats.graphs == want
            assert torch.equal(three.sequences, eager.sequences)
            other = _gen(model, "none", "on", "llada", prompts=ragged_prompts(1, 1), gen_length=12, block_length=4,
                         steps=12)
            assert other.stats.graphs.get("full captures") == 1 and len(runner.graphs) == 3 - buckets


def test_bucketed_widths_replay_where_exact_widths_change_every_step():
    """dKV-Cache-Decode computes only the rows the sampler reads (the masks left): its active width falls at every
    step, a new exact shape each time. Bucketed, the widths share a few graphs, with the eager path's tokens."""
    model = cached_model("llada", 0)
    kw = dict(prompts=ragged_prompts(2, 1), gen_length=32, block_length=32, steps=32)
    eager = _gen(model, "dkv-decode", "off", "llada", **kw)
    stats = {}
    for buckets in (False, True):
        with own_runner(model, buckets=buckets, max_graphs=64) as runner:
            out = _gen(model, "dkv-decode", "on", "llada", **kw)
            assert torch.equal(out.sequences, eager.sequences) and out.stats.nfe == eager.stats.nfe
            stats[buckets] = (out.stats.graphs, len(runner.graphs))
    (exact, n_exact), (bucketed, n_bucketed) = stats[False], stats[True]
    assert exact.get("replays", 0) == 0 and n_exact >= 20  # every cached step a shape of its own
    assert n_bucketed <= 8 and bucketed["replays"] >= 3 * n_bucketed, bucketed


@pytest.mark.filterwarnings("ignore:AdaBlock delimiters")
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_every_sampler_decodes_on_the_graph_path_what_it_decodes_eagerly(family):
    """Every registered sampler (its preset) with the prefix and dual caches, ragged prompts.

    With exact shapes the graph path (static buffers, packed rows, logits columns, pooled buffers) computes what
    the eager path computes, bit for bit: the same tokens in as many forwards on a random-weight model, whose
    confidences have near-ties. Bucketed, the canvas has more left padding and the query count is rounded up, and
    CPU attention's sums round by where their terms fall in the SIMD lanes (by CPU: 8 or 16 floats), so logits
    may differ in the last bits; on the bundled trained model, whose decisions are not near-ties, the tokens are
    the eager path's too."""
    model = cached_model(family, 0)
    tiny = dllm.load_model(f"{family}-tiny", dtype="float32")
    texts = ["Reverse the list: Alice Adams, Brian Baker", "Copy: Carol", "Add 12 and 30"]
    for name in dllm.SAMPLERS:
        for cache in ("dual", "prefix"):
            kw = dict(gen_length=16, block_length=8, steps=16, seed=1, sampler=name, cache=cache)
            eager = dllm.generate(model, ragged_prompts(3, 1), graphs="off", **kw)
            with own_runner(model, buckets=False):
                graph = dllm.generate(model, ragged_prompts(3, 1), graphs="on", **kw)
            ran = graph.stats.graphs.get("captures", 0) + graph.stats.graphs.get("replays", 0)
            assert ran > 0, (name, cache, graph.stats.graphs)  # cached steps through the static buffers
            assert torch.equal(eager.sequences, graph.sequences), (name, cache)
            assert eager.stats.nfe == graph.stats.nfe and eager.stats.commit_step == graph.stats.commit_step
            eager = dllm.generate(tiny, texts, graphs="off", **kw)
            graph = dllm.generate(tiny, texts, graphs="on", **kw)
            assert torch.equal(eager.sequences, graph.sequences), (name, cache, "bucketed")
            assert eager.stats.nfe == graph.stats.nfe and eager.stats.commit_step == graph.stats.commit_step


def test_the_plan_rounds_the_active_width_and_packed_rows_up_with_repeats():
    model = cached_model("llada", 0)
    B, T = 2, 40
    x = torch.randint(3, 60, (B, T), generator=torch.Generator().manual_seed(0))
    x[:, 20:] = model.mask_id
    cache = get_cache("dual")
    cache.reset(B, T)
    model(x, cache=cache)
    lo = torch.tensor([20, 30])
    state = CacheState(x, lo, lo + 5, torch.ones(B, dtype=torch.bool), torch.ones(B, dtype=torch.long), (20, 35), 20,
                       model.mask_id, 0, torch.zeros(B, T, dtype=torch.bool), 1, read_lo=lo, read_hi=lo + 5)
    exact, _ = cache.plan(state)
    assert exact.shape == (B, 5) and cache.query_tokens == 10  # no padding: every slot a real row
    cache.buckets = True
    rows, _ = cache.plan(state)
    assert rows.shape == (B, 8) and cache.query_tokens == 16
    assert torch.equal(rows[:, :5], exact) and torch.equal(rows[:, 5:], exact[:, :1].expand(B, 3))


def test_inputs_changed_in_place_are_copied_again():
    """The runner skips copying an input that is the very tensor it copied last, unmodified; a tensor changed in
    place (a new version) or another tensor at the same address is copied again."""
    model = cached_model("llada", 0)
    runner = GraphRunner(model, capture=False, capture_after=1)
    cache = get_cache("dual")
    B, T = 2, 12
    x = torch.randint(3, 60, (B, T), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(T).expand(B, T).clone()
    mask = torch.ones(B, T, dtype=torch.bool)
    cols = torch.arange(T)[4:8].expand(B, -1)
    rows = torch.arange(4, 8).expand(B, -1).contiguous()
    cache.reset(B, T)
    model(x, positions=positions, attn_mask=mask, cache=cache)  # fill the cache
    cache.read_cols = None

    def both():
        got = runner(x, positions, mask, cols, cache, rows)
        want = model(x, positions=positions, attn_mask=mask, logits_idx=cols, cache=cache, query_idx=rows)
        assert torch.equal(got, want)
        return got

    first = both()
    x[:, 5] = 7  # the canvas changed in place
    assert not torch.equal(both(), first)
    positions[1] += 1  # positions changed in place: a new version of the same tensor
    moved = both()
    mask[0, 0] = False  # the key mask too
    assert not torch.equal(both(), moved)
    assert len(runner.graphs) == 1 and runner.stats["captures"] == 1 and runner.stats["replays"] == 3


def test_graph_keys_follow_the_cache_buffers_and_the_lru_bound():
    model = cached_model("llada", 0)
    runner = GraphRunner(model, capture=False, max_graphs=1)
    saved = model.__dict__.get("_dllm_graphs")
    model.__dict__["_dllm_graphs"] = runner
    try:
        a = _gen(model, "prefix", "on", "llada")  # the prefix cache's active width changes with each block
        assert a.stats.graphs.get("evicted", 0) >= 1 and len(runner.graphs) == 1
        b = _gen(model, get_cache("dual"), "on", "llada", prompts=ragged_prompts(2, 3))
        assert torch.equal(b.sequences, _gen(model, "dual", "off", "llada", prompts=ragged_prompts(2, 3)).sequences)
    finally:
        model.__dict__["_dllm_graphs"] = saved


def test_eager_fallbacks_are_named():
    model = cached_model("llada", 0)
    el = _gen(model, "elastic", "on")
    assert "eager:cache with per-layer hooks" not in el.stats.graphs  # its cached steps speculate (below)
    assert el.stats.graphs.get("replays", 0) >= 1
    assert torch.equal(el.sequences, _gen(model, "elastic", "off").sequences)
    cfg = _gen(model, "dual", "on", "llada", cfg_scale=1.0)
    assert cfg.stats.graphs.get("eager:classifier-free guidance", 0) >= 1
    assert "replays" not in cfg.stats.graphs
    el_full = el.stats.graphs.get("eager:full forward", 0)
    assert el_full == sum(1 for t in el.stats.trace if t["refresh_layer"] == 0)  # hooks: full forwards eager
    assert "full replays" not in el.stats.graphs and "full captures" not in el.stats.graphs
    cfg_none = _gen(model, "none", "on", "llada", cfg_scale=1.0)
    assert cfg_none.stats.graphs == {"eager:full forward": cfg_none.stats.nfe}  # guidance: every forward eager


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_full_forwards_go_through_graphs_without_a_cache_and_for_refreshes(family):
    """A full forward (every step without a cache; a cache's refreshes) is a graph of its own, keyed by its shapes
    (and the cache's K/V buffers, written in place): captured the second time it is seen and replayed after, with
    the tokens of the eager path. A cache's first forward of a call takes its buffers from the pool first."""
    model = cached_model(family, 0)
    kw = dict(gen_length=32, block_length=8, steps=32)
    with own_runner(model) as runner:
        none = _gen(model, "none", "on", "llada", **kw)
        assert none.stats.graphs == {"eager:full forward, first sight": 1, "full captures": 1,
                                     "full replays": none.stats.nfe - 2}
        assert torch.equal(none.sequences, _gen(model, "none", "off", "llada", **kw).sequences)
        again = _gen(model, "none", "on", "llada", **kw)  # the next call replays every step
        assert again.stats.graphs == {"full replays": again.stats.nfe}
        assert torch.equal(again.sequences, none.sequences)
        refreshing = _gen(model, "dkv-greedy", "on", "threshold", **kw)  # a full forward every 4 forwards
        g = refreshing.stats.graphs
        fulls = sum(1 for t in refreshing.stats.trace if t["refresh_layer"] == 0)
        assert fulls >= 3 and "eager:full forward" not in g  # the first too, once it took the pool's buffers
        assert g.get("eager:full forward, first sight", 0) + g.get("full captures", 0) + g["full replays"] \
            == fulls and g["full replays"] >= 1
        assert torch.equal(refreshing.sequences, _gen(model, "dkv-greedy", "off", "threshold", **kw).sequences)
    # canvases of other lengths (exact, not rounded up to one bucket): the full graphs make way
    with own_runner(model, max_full_graphs=1, buckets=False) as runner:
        for n in (1, 2, 3):
            _gen(model, "none", "on", "llada", prompts=ragged_prompts(n, 2), **kw)
        full = [key for key in runner.graphs if key[0] == "full"]
        assert len(full) == 1 and full[0][1][1] == max(len(p) for p in ragged_prompts(3, 2)) + 32
        assert runner.stats["evicted"] == 2
    with own_runner(model, capture_after=1) as runner:
        cache = get_cache("prefix")
        _gen(model, cache, "on", "llada", **kw)
        assert cache.k == [] and not cache.filled  # released at the end of the call, ...
        second = _gen(model, cache, "on", "llada", **kw)
        assert "eager:full forward" not in second.stats.graphs and second.stats.graphs["full replays"] == 4
        assert any(key[0] == "full" for key in runner.graphs)


def test_mixture_of_experts_models_run_eagerly():
    """MoE routing gathers each expert's tokens with data-dependent shapes (nonzero): never captured."""
    model = dllm.load_model("llada2-tiny")
    assert model.config.n_experts
    out = dllm.generate(model, ["What is 12 + 30?"], gen_length=8, sampler="threshold", cache="block", graphs="on")
    assert out.stats.graphs.get("eager:mixture-of-experts routing (data-dependent shapes)", 0) >= 1
    assert "captures" not in out.stats.graphs


def test_graph_options_are_checked():
    model = cached_model("llada", 0)
    with pytest.raises(ValueError, match="graphs must be one of"):
        dllm.GenerateConfig(graphs="yes")
    with pytest.raises(ValueError, match="CUDA graphs need a model on a CUDA device"):
        GraphRunner(model, capture=True)
    with pytest.raises(ValueError, match="capture_after"):
        GraphRunner(model, capture=False, capture_after=0)
    with pytest.raises(ValueError, match="max_full_graphs"):
        GraphRunner(model, capture=False, max_full_graphs=0)
    assert GraphRunner.for_model(model, "auto") is None  # CPU: off
    assert GraphRunner.for_model(model, "off") is None


def test_cache_buffers_are_reused_across_resets():
    model = cached_model("llada", 0)
    cache = get_cache("dual")
    out = _gen(model, cache, "off", "llada")
    assert out.stats.cache_bytes == cache.nbytes > 0  # off the graph path the cache keeps its buffers
    ptrs = [t.data_ptr() for t in cache.k + cache.v]
    _gen(model, cache, "off", "llada")
    assert [t.data_ptr() for t in cache.k + cache.v] == ptrs
    _gen(model, cache, "off", "llada", prompts=ragged_prompts(2, 0))  # another batch: new buffers
    assert cache.k[0].shape[0] == 2


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def uncaptured(model, prompts, **kw):
    """``generate`` on the graph path without capture: the same bucketed shapes, static buffers and kernels as the
    captured path, each forward run instead of replayed. On CUDA in bf16 a product's rows may round differently with
    the number of rows it is computed with, so this twin, not ``graphs="off"`` (exact shapes), is the captured path's
    oracle there; that the bucketed shapes decode the exact shapes' tokens is the CPU tests' (float32)."""
    with own_runner(model):
        return dllm.generate(model, prompts, graphs="on", **kw)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cache", ["dual", "prefix", "none"])
def test_cuda_graphs_decode_what_the_eager_path_decodes(cache):
    model = dllm.load_model("llada-tiny", device="cuda", dtype="bfloat16")
    prompts = ["What is 12 + 30?", "Please reverse the order of the list:\n[\"Alice Adams\", \"Brian Baker\"]"]
    kw = dict(gen_length=32, block_length=8, steps=32, sampler="llada", cache=cache)
    eager = uncaptured(model, prompts, **kw)
    runner = GraphRunner.for_model(model, "auto")
    launched = runner.ahead["launched"]
    graph = dllm.generate(model, prompts, graphs="auto", **kw)
    g = graph.stats.graphs
    assert not any("capture failed" in k for k in g), g
    assert g.get("full replays", 0) >= 1, g  # refreshes (a cache's) or every forward (none) from a graph
    if cache != "none":
        assert g.get("captures", 0) >= 1 and g.get("replays", 0) >= 1
        assert runner.ahead["launched"] > launched  # next forwards launched before the synchronisation (pinned copy)
    assert torch.equal(eager.sequences, graph.sequences)
    torch.rand(4, device="cuda")  # the device's random generator is usable after the captures


@pytest.mark.gpu
@gpu
def test_cuda_graphs_launched_before_every_sync_decode_what_the_eager_path_decodes(monkeypatch):
    """Real graphs launched before every synchronisation, whatever the last numbers said: the device guard keeps an
    invalid plan's inputs (the step's own forward runs again), and every cache and sampler decodes the eager tokens."""
    from dllm.generate import Decoder

    monkeypatch.setattr(Decoder, "_launch_early", lambda self, st: True)
    model = dllm.load_model("llada-tiny", device="cuda", dtype="bfloat16")
    prompts = ["What is 12 + 30?", "Please reverse the order of the list:\n[\"Alice Adams\", \"Brian Baker\"]"]
    runner = GraphRunner.for_model(model, "auto")
    for cache in ("dual", "prefix", "dkv-decode", "dkv-greedy"):
        for sampler in ("threshold", "llada"):
            kw = dict(gen_length=32, block_length=8, steps=32, sampler=sampler, cache=cache)
            eager = uncaptured(model, prompts, **kw)
            for _ in range(2):  # the second call replays what the first captured
                graph = dllm.generate(model, prompts, graphs="auto", **kw)
                assert torch.equal(eager.sequences, graph.sequences), (cache, sampler)
    assert runner.ahead["launched"] > 0 and runner.ahead["discarded"] > 0, runner.ahead


@pytest.mark.gpu
@gpu
def test_cuda_graphs_of_one_call_replay_in_the_next():
    """Real captures: a later call (a fresh cache, another prompt length in the same canvas bucket, dKV-Cache-Decode's
    falling widths bucketed) replays the graphs the first call captured, with the eager path's tokens."""
    model = dllm.load_model("llada-tiny", device="cuda", dtype="bfloat16")
    kw = dict(gen_length=32, block_length=16, steps=32, sampler="llada")
    first, second = ["What is 12 + 30?"], ["What is 112 + 30?"]
    for cache in ("dual", "dkv-decode"):
        a = dllm.generate(model, first, graphs="auto", cache=cache, **kw)
        b = dllm.generate(model, second, graphs="auto", cache=cache, **kw)
        assert "eager:capture failed" not in a.stats.graphs, a.stats.graphs
        assert b.stats.graphs.get("replays", 0) >= 8 and b.stats.graphs.get("captures", 0) <= 1, b.stats.graphs
        for prompts, out in ((first, a), (second, b)):
            assert torch.equal(uncaptured(model, prompts, cache=cache, **kw).sequences, out.sequences)


@pytest.mark.gpu
@gpu
def test_cuda_graphs_of_elastic_speculative_steps_and_redos_decode_what_the_eager_path_decodes():
    """Real captures of Elastic-Cache's speculative partial forwards and of their redos (a strict threshold: drift
    tests fail often), through two calls (the second replays the first's graphs on the pooled buffers)."""
    from dllm.caches import ElasticCache

    model = dllm.load_model("llada-tiny", device="cuda", dtype="bfloat16")
    prompts = ["What is 12 + 30?", "Please reverse the order of the list:\n[\"Alice Adams\", \"Brian Baker\"]"]
    kw = dict(gen_length=32, block_length=8, steps=32, sampler="threshold")
    eager = uncaptured(model, prompts, cache=ElasticCache(gamma=0.999), **kw)
    stats = Counter()
    for _ in range(2):
        graph = dllm.generate(model, prompts, graphs="auto", cache=ElasticCache(gamma=0.999), **kw)
        assert torch.equal(eager.sequences, graph.sequences)
        stats.update(graph.stats.graphs)
    assert not any("capture failed" in k for k in stats), stats
    assert stats["replays"] >= 1 and stats["redo replays"] >= 1, stats  # the second call replays the first's parts
    torch.rand(4, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["sdar-tiny", "fastdllm2-tiny"])
def test_cuda_graphs_on_block_diffusion_checkpoints(name):
    model = dllm.load_model(name, device="cuda", dtype="bfloat16")
    prompts = ["What is 12 + 30?", "Please reverse the order of the list:\n[\"Alice Adams\", \"Brian Baker\"]"]
    kw = dict(gen_length=32, sampler="threshold", cache="block")
    eager = uncaptured(model, prompts, **kw)
    graph = dllm.generate(model, prompts, graphs="auto", **kw)
    assert "eager:capture failed" not in graph.stats.graphs, graph.stats.graphs
    assert torch.equal(eager.sequences, graph.sequences)
    torch.rand(4, device="cuda")


@pytest.mark.parametrize("name", ["sdar-tiny", "fastdllm2-tiny"])
def test_block_cache_static_buffer_path_on_block_diffusion_checkpoints(name):
    model = dllm.load_model(name)
    prompts = ["What is 12 + 30?", "Please reverse the order of the list:\n[\"Alice Adams\", \"Brian Baker\"]"]
    kw = dict(gen_length=32, sampler="threshold", cache="block")
    eager = dllm.generate(model, prompts, graphs="off", **kw)
    graph = dllm.generate(model, prompts, graphs="on", **kw)
    assert torch.equal(eager.sequences, graph.sequences) and eager.stats.nfe == graph.stats.nfe
    assert graph.stats.graphs.get("replays", 0) + graph.stats.graphs.get("captures", 0) >= 1, graph.stats.graphs


def test_load_model_compile_option_refuses_bad_values():
    """``load_model(compile=...)`` values torch.compile would refuse (or only refuse at the first forward) are
    refused before the checkpoint is read."""
    with pytest.raises(ValueError, match="compile must be True, False or a dict"):
        dllm.load_model("llada-tiny", compile="yes")
    with pytest.raises(ValueError, match="not torch.compile arguments"):
        dllm.load_model("llada-tiny", compile={"modes": "max-autotune"})
    # values torch.compile would only refuse at the first forward, refused before the checkpoint is read
    for kw, said in (({"backend": "inductr"}, "backend='inductr': must be a callable or one of"),
                     ({"mode": "fast"}, "mode='fast': must be one of"),
                     ({"mode": "max-autotune", "options": {"trace.enabled": True}}, "cannot both be given"),
                     ({"fullgraph": "yes"}, "fullgraph='yes': must be True or False"),
                     ({"dynamic": 1}, "dynamic=1: must be True, False or None"),
                     ({"options": ["x"]}, "options=\\['x'\\]: must be a dict"),
                     ({"recompile_limit": 0}, "recompile_limit=0: must be a positive integer")):
        with pytest.raises(ValueError, match=said):
            dllm.load_model("/nonexistent/checkpoint", compile=kw)


@pytest.mark.slow  # a compilation for each shape (the compiled fast model's decode: tests/test_fast_layer.py)
def test_load_model_compile_option():
    """``load_model(compile=...)`` compiles the forward in place: still a Transformer (graphs, caches and
    save_pretrained see the same module), and it decodes what the eager model decodes."""
    torch._dynamo.reset()  # compiled code is cached per code object (Transformer.forward), across tests
    eager = dllm.load_model("llada-tiny")
    compiled = dllm.load_model("llada-tiny", compile={"backend": "aot_eager", "dynamic": True})
    assert isinstance(compiled, dllm.models.Transformer)
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    prompts = ["What is 12 + 30?"]
    kw = dict(gen_length=16, block_length=8, steps=16, sampler="llada", cache="dual")
    a = dllm.generate(eager, prompts, **kw)
    b = dllm.generate(compiled, prompts, graphs="on", **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert b.stats.graphs.get("replays", 0) + b.stats.graphs.get("captures", 0) >= 1
    torch._dynamo.reset()


def test_graphs_are_dropped_when_the_weights_they_read_move():
    """A graph reads the weights by address and replays the kernels it captured: fusing the projections again,
    replacing the parameters or switching the fast path makes the next generation drop the model's graphs (the
    static-buffer path counts them like captured ones) instead of replaying them on freed memory."""
    from dllm.models.fast import disable_fast_path, enable_fast_path

    model = dllm.load_model("llada-tiny")
    enable_fast_path(model)
    qkv = [layer.qkv_weight.data_ptr() for layer in model.layers]
    enable_fast_path(model)  # idempotent: the same fused tensors
    assert [layer.qkv_weight.data_ptr() for layer in model.layers] == qkv
    kw = dict(gen_length=16, block_length=8, steps=16, sampler="llada", cache="dual", graphs="on")
    with own_runner(model) as runner:
        want = dllm.generate(model, ["What is 12 + 30?"], **kw).sequences
        assert runner.graphs and runner.stats["evicted"] == 0
        dllm.generate(model, ["What is 12 + 30?"], **kw)  # nothing moved: the graphs stay and replay
        assert runner.stats["evicted"] == 0
        n = len(runner.graphs)
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(sd, assign=True)  # new tensors: the layers fuse again
        assert [layer.qkv_weight.data_ptr() for layer in model.layers] != qkv
        out = dllm.generate(model, ["What is 12 + 30?"], **kw)
        assert runner.stats["evicted"] == n and torch.equal(out.sequences, want)
        dropped, n = runner.stats["evicted"], len(runner.graphs)
        disable_fast_path(model)  # the eager layer: the fast layer's graphs must not replay
        out = dllm.generate(model, ["What is 12 + 30?"], **kw)
        assert n > 0 and runner.stats["evicted"] == dropped + n and torch.equal(out.sequences, want)


def test_triton_launches_and_graphs_go_to_the_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device, not its tensors' (PyTorch's operators switch): with several
    GPUs, on_device makes the tensor's device current around the launches and a graph's capture and replay; with one
    GPU, for CPU tensors and where it already is current it is a null context. A model spread over several devices
    (device_map) runs its cached steps eagerly: one capture stream records one device's work."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from dllm.kernels import device

    on_1 = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1))
    if not device.multi_gpu():  # one GPU (or none): nothing to switch
        assert isinstance(device.on_device(on_1), nullcontext)
    monkeypatch.setattr(device, "_MULTI_GPU", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    ctx = device.on_device(on_1)
    assert isinstance(ctx, torch.cuda.device) and ctx.idx == 1
    assert isinstance(device.on_device(torch.zeros(1)), nullcontext)  # a CPU tensor
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert isinstance(device.on_device(on_1), nullcontext)  # already current

    model = dllm.load_model("llada-tiny")
    runner = GraphRunner(model, capture=False)
    cache = get_cache("dual")
    assert runner.setting_reason(cache, False) is None
    model.layers[1].to("meta")  # a layer elsewhere, as device_map places them
    assert runner.setting_reason(cache, False) == "model spread over several devices"


def test_the_next_forward_is_launched_before_the_sync_where_the_block_goes_on():
    """The dual cache's partial forwards keep one shape within a block: each step plans the next forward, fills its
    graph's inputs and launches it before its host synchronisation, so that the device goes on to it without
    waiting for the host; the synchronisation's numbers confirm the plan and the next step takes its logits (no
    plan, no input copy, no launch after the synchronisation). A block's last step, whose numbers said that one
    mask was left, prepares the next forward but does not launch it: the next forward is a full refresh, and the
    next step plans again. The tokens and every step's record are those of the path that plans after the
    synchronisation, and of the eager path."""
    import importlib

    from dllm.caches.base import KVCache

    G = importlib.import_module("dllm.generate")
    model = cached_model("llada", 0)
    prompts = [ragged_prompts(3, 1)[0]]
    kw = dict(prompts=prompts, gen_length=32, block_length=8, steps=32)
    events = []

    def spy(cls, name, tag):
        orig = getattr(cls, name)

        def wrapped(*a, **k):
            events.append(tag)
            return orig(*a, **k)
        return orig, wrapped

    patches = [(GraphRunner, "_fill_inputs", "fill"), (KVCache, "plan", "plan"), (GraphRunner, "replay", "replay"),
               (GraphRunner, "_step", "forward"), (G.Decoder, "_confirmed", "sync")]
    with own_runner(model) as runner:
        saved = [spy(cls, name, tag) for cls, name, tag in patches]
        for (cls, name, _), (_, wrapped) in zip(patches, saved):
            setattr(cls, name, wrapped)
        try:
            ahead = _gen(model, "dual", "on", "llada", **kw)
        finally:
            for (cls, name, _), (orig, _) in zip(patches, saved):
                setattr(cls, name, orig)
        # 4 blocks: the first's graph is captured at its third step, the others' replayed from their second; each
        # block's last step expected a partial forward where a refresh came, and launched nothing (one mask left)
        assert runner.ahead == {"confirmed": 5 + 3 * 6, "missed": 4, "launched": 23}
        assert ahead.stats.graphs == {"eager:full forward, first sight": 1, "full captures": 1, "full replays": 2,
                                      "eager:first sight": 1, "captures": 1, "replays": 26}
    # every confirmed synchronisation comes right after the launch of the forward it confirms; the block's last
    # steps fill the inputs and launch nothing; after a synchronisation the next step's first runner call is the plan
    # of the forward after it (the refresh plans too): nothing is launched or filled before it
    before_sync = [events[i - 1] for i, e in enumerate(events) if e == "sync"]
    assert before_sync.count("replay") == 23 and set(before_sync) == {"replay", "fill"}, before_sync
    after_sync = [events[i + 1] for i, e in enumerate(events[:-1]) if e == "sync"]
    assert set(after_sync) == {"plan"}, after_sync
    with own_runner(model):
        cache = get_cache("dual")
        cache.pipelined = False  # plans after the synchronisation, every step
        plain = _gen(model, cache, "on", "llada", **kw)
    eager = _gen(model, "dual", "off", "llada", **kw)
    for other in (plain, eager):
        assert torch.equal(ahead.sequences, other.sequences)
        assert ahead.stats.commit_step == other.stats.commit_step
    assert ahead.stats.trace == plain.stats.trace  # (the eager path's canvas is not rounded up: other columns)


def test_a_forced_refresh_is_not_launched_ahead():
    """dKV-Cache-Greedy's full forward every ``refresh_every`` forwards: the partial forward made ready before it is
    not launched before the synchronisation (it would be discarded: a forward's time for nothing); the others are,
    every one of them confirmed; nor is it made ready (no plan the synchronisation then misses). The tokens are the
    eager path's."""
    model = cached_model("llada", 0)
    kw = dict(prompts=[ragged_prompts(1, 1)[0]], gen_length=64, block_length=16, steps=64)
    with own_runner(model) as runner:
        out = _gen(model, "dkv-greedy", "on", "llada", **kw)
        assert runner.ahead["launched"] >= 20 and runner.ahead["launched"] == runner.ahead["confirmed"], runner.ahead
        assert "discarded" not in runner.ahead and "missed" not in runner.ahead
    fulls = sum(1 for t in out.stats.trace if t["refresh_layer"] == 0)
    assert fulls == 64 // 4  # every fourth forward
    assert torch.equal(out.sequences, _gen(model, "dkv-greedy", "off", "llada", **kw).sequences)


def test_the_refreshes_a_policy_schedules_are_not_launched_ahead_and_a_wider_forward_is_kept(monkeypatch):
    """dKV-Cache-Decode refreshes at its blocks' steps 0, 1, 8 (not counted by the forwards done) and its width
    falls with the masks left. No forward is made ready for one of its refreshes (none launched and discarded, no
    plan missed; with blocks of 16 a block's end is one of them), and a forward launched at this step's width where
    the next step's rows round to a narrower one is kept (``wider``): no launch is lost to a falling width. With
    ``Decoder.wide_ahead = 0`` those are planned again, and the decoder stops launching ahead in the window of the
    first, resuming in the next window (at batch 3 a width falls past the bucket in several windows: a discarded
    launch in each). The tokens are the eager path's either
    way."""
    from dllm.generate import Decoder

    model = cached_model("llada", 0)
    kw = dict(prompts=[ragged_prompts(1, 1)[0]], gen_length=64, block_length=16, steps=64)
    eager = _gen(model, "dkv-decode", "off", "llada", **kw)
    fulls = sum(1 for t in eager.stats.trace if t["refresh_layer"] == 0)
    for wide in (Decoder.wide_ahead, 0):
        monkeypatch.setattr(Decoder, "wide_ahead", wide)
        with own_runner(model) as runner:
            out = _gen(model, "dkv-decode", "on", "llada", **kw)
            ahead = dict(runner.ahead)
        assert torch.equal(out.sequences, eager.sequences), wide
        assert sum(1 for t in out.stats.trace if t["refresh_layer"] == 0) == fulls
        if wide:
            assert ahead["wider"] >= 2 and "discarded" not in ahead and "missed" not in ahead, ahead
            # of the 52 partial forwards, all but those after a refresh (8) and those met first (the graphs' first
            # sights, made ready by no step) launched ahead
            assert ahead["launched"] == ahead["confirmed"] >= 36, ahead
            launched = ahead["launched"]
        else:  # the first falling width discarded, no launch ahead after it in its window
            assert "wider" not in ahead and ahead["discarded"] == 1, ahead
            assert ahead["launched"] == ahead["confirmed"] + 1 < launched, ahead
    kw["prompts"] = ragged_prompts(3, 1)  # wide_ahead still 0: a width falls past its bucket in several windows
    eager = _gen(model, "dkv-decode", "off", "llada", **kw)
    with own_runner(model) as runner:
        out = _gen(model, "dkv-decode", "on", "llada", **kw)
    assert torch.equal(out.sequences, eager.sequences)
    # (1 and 4 when a miss stopped the launches ahead for the rest of the generation)
    assert runner.ahead["discarded"] >= 3 and runner.ahead["launched"] >= 10, runner.ahead


@pytest.mark.parametrize("cache", ["freecache"])
def test_a_cache_whose_plan_keeps_state_for_the_next_is_planned_after_the_sync(cache):
    model = cached_model("llada", 0)
    with own_runner(model) as runner:
        _gen(model, cache, "on", "llada", gen_length=32, block_length=8, steps=32)
        assert runner.ahead == {}


CHANGES = {  # what may happen between two steps, and is seen by the forward made ready before it
    "canvas replaced": lambda st, runner: setattr(st, "x", st.x.clone()),  # the serving engine's regrouping
    "positions written": lambda st, runner: st.positions.add_(0),
    "graph dropped": lambda st, runner: runner.graphs.clear(),  # least recently used, or the model changed
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_between_steps_drops_the_forward_made_ready(change):
    """A forward launched before the last synchronisation for a canvas or positions that changed since is dropped:
    the step plans again (and decodes what a fresh plan decodes). One whose graph was dropped since is kept: it ran
    on the graph before the graph was dropped, on the state the step has."""
    from dllm.generate import Decoder
    from dllm.recipes import resolve

    model = cached_model("llada", 0)
    prompts = [ragged_prompts(3, 1)[0]]
    config = dllm.GenerateConfig(gen_length=16, block_length=8, steps=16, graphs="on")
    outs = []
    for change_at in (None, 5):
        with own_runner(model) as runner:
            sampler, cache, policy, cfg = resolve(model, "llada", "dual", None, config)
            dec = Decoder(model, sampler, cache, policy, cfg)
            st = dec.start(prompts)
            n = 0
            while True:
                if n == change_at:
                    # within the first block, after its graph was captured: launched before the synchronisation
                    assert st.ahead is not None and st.ahead.logits is not None
                    CHANGES[change](st, runner)
                    ahead = dict(runner.ahead)
                    stats = dict(runner.stats)
                    runner._step = counted = _Counted(runner._step)  # the runner called the usual way
                running = dec.step(st)
                if n == change_at:  # planned again, and the forward run through the runner's own lookup
                    del runner._step
                    kept = change == "graph dropped"
                    assert counted.calls == (0 if kept else 1)
                    new = {k: v - stats.get(k, 0) for k, v in runner.stats.items() if v != stats.get(k, 0)}
                    assert new == {"replays": 1}, new
                    assert runner.ahead["discarded"] - ahead.get("discarded", 0) == (0 if kept else 1)
                n += 1
                if not running:
                    break
            outs.append(dec.output(st))
            dec.release()
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert outs[0].stats.commit_step == outs[1].stats.commit_step


class _Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)


def test_a_graph_launched_from_a_forward_made_ready_stays_recently_used():
    """Two decoders on one runner, steps interleaved: the graph one of them replays step after step through the
    forward made ready ahead is the most recently used one, the one dropped last."""
    from dllm.generate import Decoder
    from dllm.recipes import resolve

    model = cached_model("llada", 0)
    config = dllm.GenerateConfig(gen_length=32, block_length=16, steps=32, graphs="on")
    with own_runner(model) as runner:
        decs = []
        for prompts in ([ragged_prompts(3, 1)[0]], [ragged_prompts(3, 1)[0] * 6]):  # two canvas lengths: two graphs
            sampler, cache, policy, cfg = resolve(model, "llada", "dual", None, config)
            dec = Decoder(model, sampler, cache, policy, cfg)
            decs.append((dec, dec.start(prompts)))
        for dec, st in decs:  # each captures its graph and makes its next forward ready
            for _ in range(5):
                dec.step(st)
            assert st.ahead is not None
        first, st = decs[0]
        graph = st.ahead.ready.g
        assert list(runner.graphs.values())[-1] is not graph  # the second decoder's graph came last
        first.step(st)  # launched from the forward made ready
        assert list(runner.graphs.values())[-1] is graph
        for dec, _ in decs:
            dec.release()


def test_a_cache_overriding_after_plan_is_planned_after_the_sync_unless_it_says_otherwise():
    from dllm.caches import DualCache

    class Kept(DualCache):  # an after_plan that keeps state for the next plan
        def after_plan(self, state, rows):
            self.seen = state.lo.clone()

    assert DualCache().plans_ahead and not Kept().plans_ahead
    explicit = Kept()
    explicit.pipelined = True  # a policy that knows its after_plan keeps nothing the next plan reads
    assert explicit.plans_ahead
    model = cached_model("llada", 0)
    with own_runner(model) as runner:
        _gen(model, Kept(), "on", "llada", gen_length=32, block_length=8, steps=32)
        assert runner.ahead == {}


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_forward_launched_before_the_sync_on_every_step_decodes_what_the_eager_path_decodes(family, monkeypatch):
    """The next forward launched before every synchronisation, whatever the last numbers said (``_launch_early``
    forced): where the plan made ahead is not the next step's (a region ended, an active set outgrew the width, the
    window moved: the device guard, ``Decoder._guard``) the launch computes the step's own forward again, and where
    it is valid but not confirmed (another width) it computes the next step's rows; either way every row it writes is
    written again before it is read, so each cache, sampler and ragged batch decodes exactly what it decodes
    eagerly. Launches discarded, the invalid plans among them, show the guard was exercised."""
    from dllm.generate import Decoder

    monkeypatch.setattr(Decoder, "_launch_early", lambda self, st: True)
    model = cached_model(family, 0)
    discarded = 0
    for cache in ["prefix", "dual", "dkv-decode", "dkv-greedy"]:
        for sampler in ("threshold", "llada"):
            with own_runner(model) as runner:
                graph = _gen(model, cache, "on", sampler)
                assert runner.ahead["launched"] > 0, (cache, sampler)
                discarded += runner.ahead["discarded"]
            eager = _gen(model, cache, "off", sampler)
            assert torch.equal(eager.sequences, graph.sequences), (family, cache, sampler)
            assert eager.stats.commit_step == graph.stats.commit_step, (family, cache, sampler)
    assert discarded > 0


def test_the_guard_accepts_only_a_valid_forward_of_the_next_step():
    """``Decoder._guard`` on the step's numbers (rows left, non-finite logits, the next window's ends, the next plan's
    partial flag, largest active set and active rows): True only for rows left, finite logits, the same window and a
    partial forward that fits this step's width and packed rows."""
    from dllm.generate import Decoder

    dec = Decoder.__new__(Decoder)
    dec._bounds = None
    w_lo, w_hi, Q, N = 16, 24, 8, 20
    good = [1, 0, 16, 24, 1, 8, 20, 5, 1]  # ..., and the pace numbers after the seven the guard reads
    assert bool(dec._guard(torch.tensor(good), w_lo, w_hi, Q, N))
    assert bool(dec._guard(torch.tensor([1, 0, 16, 24, 1, 3, 7]), w_lo, w_hi, Q, N))  # smaller sets fit
    for i, bad in [(0, 0), (1, 1), (2, 24), (3, 32), (4, 0), (5, 9), (6, 21)]:
        v = list(good)
        v[i] = bad
        assert not bool(dec._guard(torch.tensor(v), w_lo, w_hi, Q, N)), (i, bad)
    assert bool(dec._guard(torch.tensor([1, 0, 16, 24, 1, 8, 10 ** 6]), w_lo, w_hi, Q, None))  # not packed


# ------------------------------------------------------------------------------------------------ Elastic-Cache


def deep_model(family: str, layers: int = 6, std: float = 0.5):
    """A random model of ``layers`` layers (the drift test then fails at various layers, so redos start at various
    layers and rows of a batch switch at different ones), the mask never the argmax (``MaskGapHead``)."""
    from conftest import EOS, EOT, PAD, VOCAB
    from helpers_parity import MaskGapHead

    from dllm.models import DREAM, LLADA, Transformer, TransformerConfig
    from dllm.models.weights import init_weights

    cfg = TransformerConfig(vocab_size=VOCAB, d_model=32, n_layers=layers, n_heads=4,
                            n_kv_heads=4 if family == "llada" else 2, mlp_hidden=64, qkv_bias=family == "dream",
                            max_seq_len=256)
    torch.manual_seed(0)
    model = Transformer(cfg, LLADA if family == "llada" else DREAM)
    init_weights(model, std=std)
    model.eval().requires_grad_(False)
    model.mask_id, model.eos_id, model.eot_id, model.pad_id = VOCAB - 1, EOS, EOT, PAD
    model.head = MaskGapHead(model.head, model.mask_id, 2.0)
    return model


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_elastic_speculative_steps_decode_what_the_eager_path_decodes(family):
    """Elastic-Cache's cached steps on the graph path run speculatively and are redone from the layer after the first
    failing drift test: the tokens, each step's refresh layer and active rows are the eager path's, with one row and
    with ragged rows that switch at different layers; redos start at several layers."""
    from dllm.caches import ElasticCache

    model = deep_model(family)
    starts, mixed, stopped, resumed = set(), False, False, False
    ahead = Counter()
    for gamma, track in ((0.9, 1), (0.999, 2)):
        for prompts in (ragged_prompts(1, 1), ragged_prompts(3, 1)):
            kw = dict(prompts=prompts, gen_length=24, steps=24)
            with own_runner(model) as runner:
                gcache, ecache = ElasticCache(gamma=gamma, track_num=track), ElasticCache(gamma=gamma, track_num=track)
                graph = _gen(model, gcache, "on", **kw)
                parts = [k for k in runner.graphs if k[0] == "part"]  # ("part", start, stop, schedule, ...)
                redos = [k for k in parts if k[3] is not None]
                ahead.update(runner.ahead)
            eager = _gen(model, ecache, "off", **kw)
            assert torch.equal(eager.sequences, graph.sequences), (gamma, len(prompts))
            L, Te, Tg = len(model.layers), ecache.canvas_len, gcache.canvas_len
            for te, tg in zip(eager.stats.trace, graph.stats.trace, strict=True):
                assert te["refresh_layer"] == tg["refresh_layer"]
                if te["refresh_layer"] != 0:  # a full forward's counts are the canvas (bucketed on the graph path)
                    c = torch.as_tensor(te["active"]).double()
                    assert torch.equal(c, torch.as_tensor(tg["active"]).double())
                    # the share of token-layers computed (the graph's own, _settle): each row's layers at every row,
                    # from the eager path's share, give the graph path's on its (bucketed) canvas
                    full = (torch.as_tensor(te["computed"]).double() * L * Te - L * c) / (Te - c)
                    want = ((L - full) * c + full * Tg) / (L * Tg)
                    assert torch.allclose(torch.as_tensor(tg["computed"]).double(), want, atol=1e-5), (te, tg)
            assert graph.stats.graphs.get("replays", 0) > 0
            starts |= {k[1] for k in redos}
            mixed |= any(len(set(k[3])) > 1 for k in redos)  # rows switching at different layers (or not at all)
            stopped |= any(k[2] is not None for k in parts)  # a forward run up to the layer expected to fail ...
            resumed |= any(k[1] and k[3] is None for k in parts)  # ... and resumed where no row's test failed there
    assert len(starts) >= 2 and mixed and stopped and resumed, (starts, mixed, stopped, resumed)
    # the next step's first part made ready before the synchronisation (planned on this step's numbers), launched
    # there under the guard, confirmed; launched and dropped where the guard failed (this step's first part again)
    assert ahead["confirmed"] and ahead["launched"] and ahead["missed"] and ahead["discarded"], ahead


def test_elastic_graphs_of_one_call_replay_in_the_next():
    """The stored layer inputs and queries and the kept per-step buffers come from the runner's pool and go back in
    the order taken: a fresh Elastic-Cache in the next call sees no forward for the first time (a part seen once in
    the first call is captured in the second, seen twice), and a third call captures nothing."""
    from dllm.caches import ElasticCache

    model = deep_model("llada")
    with own_runner(model) as runner:
        first = _gen(model, ElasticCache(), "on", prompts=ragged_prompts(1, 1), gen_length=24, steps=24)
        assert first.stats.graphs.get("captures") and first.stats.graphs.get("redo replays")
        second = _gen(model, ElasticCache(), "on", prompts=ragged_prompts(1, 1), gen_length=24, steps=24)
        assert not any("first sight" in k for k in second.stats.graphs if k != "eager:full forward"), second.stats.graphs
        third = _gen(model, ElasticCache(), "on", prompts=ragged_prompts(1, 1), gen_length=24, steps=24)
        stats = third.stats.graphs
        assert not any("captures" in k or "first sight" in k for k in stats), stats
        assert stats.get("replays") and stats.get("redo replays"), stats
        assert runner.stats.get("evicted", 0) == 0
    assert torch.equal(first.sequences, second.sequences) and torch.equal(first.sequences, third.sequences)


def test_a_resumed_or_stopped_forward_needs_a_cache_that_takes_its_layer_input():
    model = deep_model("llada", layers=2)
    x = torch.full((1, 8), model.mask_id)
    rows = torch.arange(4)[None]
    with pytest.raises(ValueError, match="start_layer=1: a partial forward"):
        model(x, start_layer=1)
    with pytest.raises(ValueError, match="start_layer=2"):
        model(x, query_idx=rows, cache=get_cache("elastic"), start_layer=2)
    with pytest.raises(ValueError, match="layer_input"):
        model(x, query_idx=rows, cache=get_cache("dual"), start_layer=1)
    with pytest.raises(ValueError, match="stop_layer=1: a partial forward"):
        model(x, stop_layer=1)
    with pytest.raises(ValueError, match="stop_layer=1"):
        model(x, query_idx=rows, cache=get_cache("elastic"), start_layer=1, stop_layer=1)


def test_elastic_speculative_steps_count_the_layers_a_redo_rewrote():
    """With exact shapes the speculative steps compute the eager path's token-layers (``computed``), and ``run`` adds
    the layers run at the active width that a redo rewrote: none where the forward stopped at the failing layer,
    some where it ran past it (the first cached step, with no failure to expect yet, or a failure that moved)."""
    from dllm.caches import ElasticCache

    model = deep_model("llada")
    kw = dict(prompts=ragged_prompts(1, 1), gen_length=24, steps=24)
    with own_runner(model, buckets=False):
        graph = _gen(model, ElasticCache(), "on", **kw)
    eager = _gen(model, ElasticCache(), "off", **kw)
    extra = []
    for te, tg in zip(eager.stats.trace, graph.stats.trace, strict=True):
        assert te["computed"] == tg["computed"]
        assert tg["run"] >= te["run"] - 1e-12
        extra.append(tg["run"] - te["run"] > 1e-12)
    assert any(extra) and not all(extra[1:]), extra


def test_an_elastic_cache_used_again_off_the_graph_path_decides_inside_its_forwards():
    """The decode loop sets a speculating cache's mode for each call: one object used on the graph path and then off
    it decodes the eager tokens both times (its speculative mode would skip every switch without the loop's redos)."""
    from dllm.caches import ElasticCache

    model = deep_model("llada")
    kw = dict(prompts=ragged_prompts(1, 1), gen_length=24, steps=24)
    eager = _gen(model, ElasticCache(), "off", **kw)
    cache = ElasticCache()
    with own_runner(model):
        assert torch.equal(_gen(model, cache, "on", **kw).sequences, eager.sequences) and cache.speculative
    again = _gen(model, cache, "off", **kw)
    assert torch.equal(again.sequences, eager.sequences) and not cache.speculative
    assert any(t["refresh_layer"] > 0 for t in again.stats.trace)  # its drift tests switched layers


@pytest.mark.gpu
@gpu
def test_cuda_dense_window_samplers_decode_what_their_cpu_form_decodes(monkeypatch):
    """On CUDA Dream, Prophet, KLASS and AdaBlock compute every window position (no host synchronisation in their
    step): in float32 the same tokens as their CPU form (only where it matters, deciding on the host) on the same
    device, with Prophet's early commits, KLASS's stable commits and AdaBlock's delimiter ends taking part; Prophet
    also over the dual cache (its logits to the canvas end: each row's columns read are made on the device)."""
    import dllm.ops as dllm_ops
    from dllm.samplers import get_sampler

    prompts = ["What is 12 + 30?", "Please reverse the order of the list:\n[\"Alice Adams\", \"Brian Baker\"]"]
    prophet = dict(early=0.5, mid=0.5, late=0.5)
    runs = [("dream-tiny", "dream", {}, None), ("llada-tiny", "prophet", prophet, None),
            ("llada-tiny", "prophet", prophet, "dual"),
            ("llada-tiny", "klass", dict(conf_threshold=0.3, kl_threshold=0.05), None),
            ("llada-tiny", "adablock", dict(delimiters=tuple(range(10, 60)), delimiter_threshold=0.0), None)]
    for path, name, params, cache in runs:
        model = dllm.load_model(path, device="cuda", dtype="float32")
        for t in (0.0, 0.7):
            kw = dict(gen_length=32, steps=32, sampler=get_sampler(name, temperature=t, **params), seed=3,
                      graphs="off", cache=cache, **({"block_length": 8} if name != "dream" else {}))
            dense = dllm.generate(model, prompts, **kw)
            with monkeypatch.context() as m:
                m.setattr(dllm_ops, "dense_window", lambda logits: False)
                sparse = dllm.generate(model, prompts, **kw)
            assert torch.equal(dense.sequences, sparse.sequences), (name, t)
