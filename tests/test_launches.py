"""Kernel launches of the fast layer's cached step, counted on the CPU (tests/launch_counter.py): what the CUDA
path launches per layer in a partial forward over a K/V cache, the kernels of one forward at LLaDA-8B's depth, and
the counter itself."""

from __future__ import annotations

import pytest
import torch
from launch_counter import LaunchCounter

import dllm.ops as dllm_ops
from dllm.config import GenerateConfig
from dllm.generate import Decoder
from dllm.models import LLADA, Transformer, TransformerConfig
from dllm.models.fast import enable_fast_path
from dllm.models.weights import init_weights
from dllm.recipes import resolve


def test_the_counter_counts_kernels_not_views_or_allocations(triton_backend):
    x = torch.randn(4, 8)
    with LaunchCounter() as c:
        y = x.view(8, 4).t().unsqueeze(0)  # views: nothing
        torch.empty(3)  # an allocation: nothing
        z = x + 1  # one kernel
        x.transpose(0, 1).contiguous()  # one copy kernel
        torch.nn.functional.linear(x, torch.randn(5, 8))  # composite: one product (and the weight's randn)
    assert y.shape == (1, 4, 8) and z.shape == x.shape
    assert dict(c.counts) == {"aten.add": 1, "aten.clone": 1, "aten.randn": 1, "aten.mm": 1}
    from dllm.kernels import fused

    w = torch.ones(8)
    with LaunchCounter() as c:  # a Triton kernel is one launch; the interpreter's own tensor work is not counted
        fused.rms_norm(x, w, 1e-6)
    assert dict(c.counts) == {"triton._norm_kernel": 1}


def _tiny_decoder(layers: int, sampler: str, cache: str, steps: int):
    """A random-weight LLaDA-shaped model with the fast layer on the graph path (the CPU's static-buffer twin), its
    decoder and state after ``steps`` steps (the first a full forward, then cached steps)."""
    cfg = TransformerConfig(vocab_size=128, d_model=64, n_layers=layers, n_heads=4, n_kv_heads=4, mlp_hidden=96,
                            max_seq_len=128)
    torch.manual_seed(0)
    model = Transformer(cfg, LLADA)
    init_weights(model, std=0.5)
    model.eval().requires_grad_(False)
    model.mask_id, model.eos_id, model.eot_id, model.pad_id = 127, 1, 2, 1
    enable_fast_path(model)
    config = GenerateConfig(gen_length=16, block_length=8, steps=16, graphs="on")
    s, c, p, config = resolve(model, sampler, cache, None, config)
    dec = Decoder(model, s, c, p, config)
    st = dec.start(torch.randint(3, 120, (1, 16), generator=torch.Generator().manual_seed(1)).tolist())
    for _ in range(steps):
        dec.step(st)
    return dec, st


def _cached_forward_launches(layers: int, cache: str = "dual") -> LaunchCounter:
    dec, st = _tiny_decoder(layers, "llada", cache, 3)
    lo, hi = st.window
    cstate = dec._cache_state(st, (lo, hi))
    rows, _ = dec.cache.plan(cstate)
    assert rows is not None  # a partial forward
    with LaunchCounter() as c:
        dec.model(st.x, positions=st.positions, attn_mask=st.key_mask, logits_idx=dec.cols_all[lo:hi].expand(1, -1),
                  cache=dec.cache, query_idx=rows)
    return c


@pytest.mark.parametrize("cache", ["dual", pytest.param("prefix", marks=pytest.mark.slow)])  # slow: the interpreter
def test_the_cached_fast_layer_launches_nine_kernels(cache, triton_backend):
    """Per layer (the difference between 3 and 2 layers): the previous layer's residual add + norm, QKV product,
    RoPE writing K/V into the cache, attention, output product, add + norm, gate/up product, SiLU-mul, down
    product. No scatter, no copy of the attention output, no separate residual add."""
    two, three = _cached_forward_launches(2, cache), _cached_forward_launches(3, cache)
    per_layer = {k: three.counts[k] - two.counts.get(k, 0) for k in three.counts}
    per_layer = {k: n for k, n in per_layer.items() if n}
    assert per_layer == {"triton._norm_kernel": 2, "aten.mm": 4, "triton._rope_kernel": 1, "triton._attn_fwd": 1,
                         "triton._silu_mul_kernel": 1}, per_layer
    # at LLaDA-8B's depth the forward's own kernels (RoPE tables, embedding, logits) spread over 32 layers
    outside = two.total - 2 * sum(per_layer.values())
    assert (32 * sum(per_layer.values()) + outside) / 32 <= 15


@pytest.mark.parametrize("sampler, budget", [("llada", 106), ("threshold", 103)])
def test_the_decode_loops_own_kernels_per_cached_step_stay_within_budget(sampler, budget, triton_backend,
                                                                         monkeypatch):
    """A dual-cache step's kernels outside its forward (the confidence kernels, the sampler's rule, the commits, the
    region bookkeeping, the next plan, the step's one stack of host numbers, the graph inputs' copies under the
    guard of a forward launched before the synchronisation), counted as the CUDA path runs them with the step's
    work after its forward eager (``Decoder.step_graphs`` off): at most ``budget``
    (119 and 117 before the loop was trimmed, 96 and 93 before the early launch added its guard and the regions'
    pace: 8 kernels that spare the device its wait for the host at every step; 104 and 101 before the step read
    each row's step in its region, a ``where`` and its scalar, which spares a forward launched ahead of every
    refresh a policy schedules). On a GPU each is a launch and a few microseconds of device time in every
    step."""
    monkeypatch.setattr(Decoder, "step_graphs", False)
    dec, st = _tiny_decoder(2, sampler, "dual", 4)
    loop, forward, counts = _loop_kernels(dec, st)
    assert len(forward) == 1 and st.trace[-1]["refresh_layer"] == -1  # one partial forward
    assert 0 < loop <= budget, counts


@pytest.mark.parametrize("sampler", ["llada", "threshold", "dream", "credit", "klass", "prophet"])
def test_with_the_step_graph_the_host_launches_few_kernels_per_cached_step(sampler, triton_backend, monkeypatch):
    """The same step with its work after the forward as one graph (``Decoder._commit_graphed``): the host launches
    the forward's graph, the step graph, the logits' copy into it, the trace record's copies out, the next plan, the
    synchronisation's concatenation and the guarded copies of the next forward's inputs; at most 40 kernels where it
    launched over a hundred, the step graph's own kernels (about ninety) replayed in one launch. Dream's baseline,
    CreditDecoding (its tables in the bank), KLASS (its kept steps) and Prophet (its window to the canvas end) alike,
    each scoring every window position as on a GPU."""
    monkeypatch.setattr(dllm_ops, "dense_window", lambda logits: True)
    dec, st = _tiny_decoder(2, sampler, "dual", 4)
    loop, forward, counts, tail = _loop_kernels(dec, st, tails=True)
    assert len(forward) == 1 and len(tail) == 1 and st.trace[-1]["refresh_layer"] == -1
    assert tail[0] > 80  # the work the graph holds
    host = loop - tail[0] + 2  # the graphs' kernels as their launches
    assert host <= 40, (host, counts)


def _loop_kernels(dec, st, tails: bool = False):
    """``(kernels outside the forwards, each forward's kernels, the counter's counts)`` of one step, counted as the
    CUDA path runs it (the forwards: the graph runner's, replayed as graphs there); with ``tails``, also each step
    graph's kernels (``GraphRunner.tail``'s runs, counted in the first number too)."""
    import importlib

    from dllm.graphs import GraphRunner

    G = importlib.import_module("dllm.generate")
    forward, tail = [], []
    orig, orig_tail, free = GraphRunner._forward, GraphRunner._tail_body, G._host_check_free

    with LaunchCounter() as counter:
        def counted(self, g, cache):
            n0 = counter.total
            out = orig(self, g, cache)
            forward.append(counter.total - n0)
            return out

        def counted_tail(self, t, fn):
            n0 = counter.total
            out = orig_tail(self, t, fn)
            tail.append(counter.total - n0)
            return out

        GraphRunner._forward, G._host_check_free = counted, (lambda t: False)  # the path a CUDA run takes
        GraphRunner._tail_body = counted_tail
        try:
            dec.step(st)
        finally:
            GraphRunner._forward, GraphRunner._tail_body, G._host_check_free = orig, orig_tail, free
    out = (counter.total - sum(forward), forward, dict(counter.counts))
    return (*out, tail) if tails else out


def test_elastic_cache_step_launches_few_kernels(triton_backend, monkeypatch):
    """Elastic-Cache's cached step on the graph path (Triton backend, its interpreter here), counted in one step:

    * its per-layer hook in the forward's graph, at a layer that tests for drift: the tracked queries' gathers, the
      old keys, the drift test (two LSE passes, the fused kernel, its finish, which also records the row's first
      failure with no host synchronisation), the window's attention mass and its top-k: at most 15 kernels (51 with
      the test composed in PyTorch). The last layer runs no test (a failure there would switch no layer);
    * the host's launches: what its plan needs of the decode state is the host's (the masks, the rows testing, the
      tracked set), the rest runs inside its forwards' graphs (the window and tracked rows at the first layer, the
      drift tests' outcome at the end of a part), and the step's work after its forward is the step graph; each
      forward part and the step graph one launch: within the dual cache's budget plus 16 (123 with the sampler's
      work eager; 164 before the plan's split; 37 for the dual cache)."""
    from dllm.caches.elastic import ElasticCache

    dec, st = _tiny_decoder(4, "llada", "elastic", 4)
    per = []
    orig = ElasticCache.observe

    def counted(self, layer, q, k, key_mask, rows):
        with LaunchCounter() as c:
            out = orig(self, layer, q, k, key_mask, rows)
        if rows is not None:
            per.append((layer, dict(c.counts)))
        return out

    monkeypatch.setattr(ElasticCache, "observe", counted)
    loop, forward, counts, tail = _loop_kernels(dec, st, tails=True)
    assert dec.cache.speculative and st.trace[-1]["refresh_layer"] != 0  # a cached step on the graph path
    tested = [(layer, c) for layer, c in per if "triton._attn_drift" in c]
    assert tested and all(layer < 3 for layer, _ in tested)  # 4 layers: none tests at the last
    assert all(c.get("triton._drift_finish") == 1 and sum(c.values()) <= 15 for _, c in tested), tested
    assert forward and len(tail) == 1  # one or more forward parts, one step graph
    host = loop - sum(tail) + len(tail) + len(forward)  # the graphs' kernels as their launches
    assert 0 < host <= 40 + 16, counts
