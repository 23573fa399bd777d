"""The serving engine: continuous batching at step boundaries, every response token-identical to
``dllm.generate`` of the same request alone (float32, bundled tiny models)."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

import dllm
from dllm.caches.base import storage_of
from dllm.graphs import GraphRunner
from dllm.ops import shape_bucket
from dllm.serve import Engine, QueueFull, RequestError

PROMPTS = [
    'Please copy the list exactly: ["Ann Lee", "Bob Stone"]',
    'Reverse the list: ["Kevin Irving", "Ann Lee", "Paula Parker", "Julia Graham"]',
    "What is 12 + 30?",
    'Sort the list by last name: ["Wendy Harper", "Frank Dawson", "Martin Gordon"]',
    "Fill in the Latin square with the symbols A, B, C, D.",
    "What is 407 + 2185?",
]


@pytest.fixture(scope="module")
def llada():
    return dllm.load_model("llada-tiny", dtype="float32")


@pytest.fixture(scope="module")
def dream():
    return dllm.load_model("dream-tiny", dtype="float32")


def solo(model, prompt, rid, **kw):
    """The request alone, as dllm.generate runs it (its random stream keyed by seed and prompt, no cache)."""
    sampler = kw.pop("sampler", None)
    params = kw.pop("params", {})
    s = dllm.get_sampler(sampler, **params) if sampler else None
    out = dllm.generate(model, [prompt], sampler=s, cache="none", **kw)
    return out.sequences[0].tolist(), out.stats.row_nfe[0]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_concurrent_requests_with_mixed_settings_and_join_times_match_solo_runs(family, llada, dream):
    model = llada if family == "llada" else dream
    base = "llada" if family == "llada" else "dream"
    settings = [  # (sampler, params, gen_length, block_length, seed)
        (base, {}, 32, 8, 0),
        ("threshold", {}, 32, 8, 0),
        ("threshold", {"temperature": 0.8}, 32, 8, 5),
        ("eb", {"gamma": 0.1}, 16, None, 0),
        (base, {"temperature": 0.8}, 16, None, 3),
        ("factor", {}, 32, 16, 0),
        ("prophet", {}, 32, None, 0),  # progress from the row's own forwards
        ("eoser", {}, 32, None, 0),
        ("ascending", {}, 32, None, 0),
        ("credit", {}, 32, 8, 0),  # its credit tables move with the rows
        ("credit-localleap", {}, 32, 16, 0),
    ]
    eng = Engine(model, max_rows=3, max_running=3 * len(settings))  # every setting's batch runs at once
    reqs = []
    for wave in range(3):  # every setting gets a request per wave; waves 2 and 3 join running batches
        for k, (sampler, params, G, B, seed) in enumerate(settings):
            prompt = PROMPTS[(k + 2 * wave) % len(PROMPTS)]  # the joining requests have other prompt lengths
            rid = f"{family}-{wave}-{k}"
            h = eng.submit(prompt, gen_length=G, block_length=B, sampler=sampler, params=params, seed=seed,
                           request_id=rid)
            reqs.append((h, prompt, rid, dict(sampler=sampler, params=params, gen_length=G, block_length=B,
                                               seed=seed)))
        eng.step()
    assert eng.stats()["joins"] >= len(settings)  # requests did join running batches
    eng.run_until_idle()
    assert not eng.groups and not eng.waiting
    for h, prompt, rid, kw in reqs:
        r = h.result(timeout=0)
        tokens, nfe = solo(model, prompt, rid, **kw)
        assert r.tokens == tokens, (rid, kw)
        assert r.nfe == nfe, (rid, kw)
        assert r.finish_reason in ("stop", "length")


def test_rows_leave_and_the_canvas_shrinks_when_the_longest_prompt_leaves(llada):
    eng = Engine(llada, max_rows=4)
    long = PROMPTS[1] + " " + PROMPTS[3]
    h_long = eng.submit(long, gen_length=8, sampler="threshold", request_id="long")
    h_short = eng.submit(PROMPTS[2], gen_length=8, sampler="threshold", request_id="short")
    eng._admit()
    group = next(iter(eng.groups.values()))
    width = group.state.x.shape[1]
    h_long.cancel()
    eng.step()
    assert h_long.result(timeout=0).finish_reason == "cancelled"
    if eng.groups:  # the short request still running: its canvas holds only its own prompt now
        assert next(iter(eng.groups.values())).state.x.shape[1] < width
    eng.run_until_idle()
    tokens, nfe = solo(llada, PROMPTS[2], "short", sampler="threshold", gen_length=8)
    assert h_short.result(timeout=0).tokens == tokens


def test_streamed_pieces_are_the_final_prefix_and_add_up_to_the_answer(llada):
    eng = Engine(llada)
    h = eng.submit(PROMPTS[0], gen_length=32, block_length=8, sampler="llada", request_id="s")
    eng.start()
    pieces = list(h.delta_ids())
    eng.stop()
    r = h.result(timeout=5)
    assert len(pieces) > 1  # block by block
    assert sum(pieces, []) == r.tokens
    assert r.completion_tokens <= 32 and r.prompt_tokens > 0


def test_refusals_name_the_problem(llada):
    eng = Engine(llada, max_queue=2)
    with pytest.raises(RequestError, match="not served; served caches"):
        eng.submit(PROMPTS[0], cache="nope")
    with pytest.raises(RequestError, match="noise_scope"):
        eng.submit(PROMPTS[0], sampler="threshold", params={"noise_scope": "canvas"})
    with pytest.raises(RequestError, match="unknown sampler"):
        eng.submit(PROMPTS[0], sampler="nope")
    with pytest.raises(RequestError, match="per_region=3 is not true or false; per_region is a flag"):
        eng.submit(PROMPTS[0], sampler="ascending", params={"per_region": 3})
    with pytest.raises(RequestError, match="context"):
        eng.submit(PROMPTS[0], gen_length=llada.max_seq_len)
    with pytest.raises(RequestError, match="block_length"):
        eng.submit(PROMPTS[0], gen_length=32, block_length=5)
    eng.submit(PROMPTS[0], gen_length=8)
    eng.submit(PROMPTS[1], gen_length=8)
    with pytest.raises(QueueFull):
        eng.submit(PROMPTS[2], gen_length=8)
    eng.run_until_idle()
    assert eng.stats()["requests"]["stop"] + eng.stats()["requests"]["length"] == 2


def test_the_engine_decodes_without_autograd_whatever_the_callers_mode():
    """The engine's thread starts with autograd on, and a caller may step it under ``torch.inference_mode()``:
    either way a model whose parameters require gradients decodes without recording them, with the same tokens."""
    model = dllm.load_model("llada-tiny", dtype="float32").requires_grad_(True)
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a: seen.append((torch.is_grad_enabled(),
                                                                     torch.is_inference_mode_enabled())))
    try:
        want, _ = solo(model, PROMPTS[2], "r", gen_length=8, block_length=8, sampler="threshold")
        for mode in (torch.enable_grad, torch.inference_mode):
            eng = Engine(model, graphs="on")
            h = eng.submit(PROMPTS[2], gen_length=8, block_length=8, sampler="threshold", request_id="r")
            with mode():
                eng.run_until_idle()
            assert h.result(timeout=0).tokens == want
        eng = Engine(model, graphs="on")  # the background thread
        eng.start()
        h = eng.submit(PROMPTS[2], gen_length=8, block_length=8, sampler="threshold", request_id="r")
        assert h.result(timeout=60).tokens == want
        eng.stop()
    finally:
        hook.remove()
    assert seen and set(seen) == {(False, False)}, set(seen)


def test_a_failing_group_fails_only_its_requests(llada, monkeypatch):
    eng = Engine(llada)
    bad = eng.submit(PROMPTS[0], gen_length=16, sampler="factor", request_id="bad")
    good = eng.submit(PROMPTS[1], gen_length=16, sampler="threshold", request_id="good")
    eng._admit()
    group = next(g for g in eng.groups.values() if g.requests[0].request_id == "bad")

    def boom(st):
        raise RuntimeError("device lost")

    monkeypatch.setattr(group.decoder, "step", boom)
    eng.run_until_idle()
    assert bad.result(timeout=0).finish_reason == "error" and "device lost" in bad.result().error
    tokens, _ = solo(llada, PROMPTS[1], "good", sampler="threshold", gen_length=16)
    assert good.result(timeout=0).tokens == tokens
    assert torch.is_grad_enabled()  # the engine leaves global state alone


@pytest.mark.parametrize("cache", ["dual", "prefix", "dkv-decode", "dkv-greedy"])
def test_cached_requests_joining_and_leaving_match_solo_runs(cache, llada):
    """The K/V buffers move with the rows (re-padded, selected, extended): every response equals the request
    alone with the same cache."""
    eng = Engine(llada, max_rows=3)
    reqs = []
    for wave in range(3):
        for k in range(2):
            prompt = PROMPTS[(k + wave) % len(PROMPTS)]
            rid = f"{cache}-{wave}-{k}"
            sampler = "threshold" if k == 0 else "llada"
            reqs.append((eng.submit(prompt, gen_length=32, block_length=8, sampler=sampler, cache=cache,
                                    request_id=rid), prompt, rid, sampler))
        eng.step()
    eng.run_until_idle()
    assert eng.stats()["joins"] >= 2
    for h, prompt, rid, sampler in reqs:
        out = dllm.generate(llada, [prompt], gen_length=32, block_length=8, sampler=sampler, cache=cache)
        assert h.result(timeout=0).tokens == out.sequences[0].tolist(), rid
        assert h.result().nfe == out.stats.row_nfe[0]


def test_the_graph_path_serves_the_same_tokens_and_counts_how_forwards_ran():
    """``Engine(graphs="on")`` on the CPU runs the cached steps through the graph runner's static buffers (no
    capture): the same responses as eager forwards, and ``stats()["graphs"]`` (and /metrics) counts how every
    forward ran. Refused values are named."""
    model = dllm.load_model("llada-tiny", dtype="float32")  # its own: the runner's counts live on the model
    for graphs in (None, "sometimes", True):
        with pytest.raises(ValueError, match="graphs must be one of"):
            Engine(model, graphs=graphs)
    results = {}
    for graphs in ("off", "on"):
        eng = Engine(model, max_rows=3, graphs=graphs)
        hs = []
        for wave in range(3):
            for k in range(2):
                hs.append(eng.submit(PROMPTS[(k + wave) % len(PROMPTS)], gen_length=32, block_length=8,
                                     sampler="fast-dllm"))
            eng.step()
            for group in eng.groups.values():  # on the graph path the canvas is a bucket's length
                T = max(len(r) for r in group.state.rows) + 32
                assert group.state.x.shape[1] == (shape_bucket(T, model.max_seq_len) if graphs == "on" else T)
        eng.run_until_idle()
        if graphs == "on":  # the batches' K/V buffers went back to the graph path's pool as they ended
            assert GraphRunner.of(model).buffers.nbytes > 0
        results[graphs] = [h.result(timeout=0).tokens for h in hs]
        stats = eng.stats()["graphs"]
        if graphs == "off":
            assert stats == {}
        else:  # every forward counted once: replays or captures (a shape seen twice), eager with its reason
            assert "eager:full forward" not in stats  # a batch's first forward too: it takes its buffers first
            assert sum(stats.values()) - stats.get("evicted", 0) == eng.stats()["forwards"]
    assert results["on"] == results["off"]


def test_a_served_batch_moves_within_its_bucket_and_keeps_its_graphs():
    """On the graph path a batch's K/V buffers are sized for its bucket (3 rows: 4): a row joining moves within them,
    the buffers stay where they are, and the graphs captured for the bucket replay before and after; the runner runs
    the bucket's batch (its spare rows copies of row 0). Every answer is the request's alone."""
    model = dllm.load_model("llada-tiny", dtype="float32")
    eng = Engine(model, max_rows=4, graphs="on")
    kw = dict(gen_length=32, block_length=8, sampler="llada", params={"temperature": 0.7}, cache="dual")
    hs = [eng.submit(PROMPTS[2], sample=k, **kw) for k in range(3)]
    for _ in range(4):
        eng.step()
    cache = next(iter(eng.groups.values())).decoder.cache
    assert cache.k[0].shape[0] == 3 and cache.capacity() == 4
    where = [storage_of(t).data_ptr() for t in cache.k + cache.v]
    before = dict(eng.stats()["graphs"])
    assert before.get("replays", 0) >= 1
    hs.append(eng.submit(PROMPTS[2], sample=3, **kw))  # the same canvas: the fourth row joins the bucket
    eng.step()
    assert cache.k[0].shape[0] == 4 and [storage_of(t).data_ptr() for t in cache.k + cache.v] == where
    for _ in range(3):
        eng.step()
    after = eng.stats()["graphs"]
    assert after.get("replays", 0) >= before["replays"] + 2 and after.get("captures", 0) == before.get("captures", 0)
    eng.run_until_idle()
    assert eng.stats()["joins"] == 1 and eng.stats()["retried"] == 0
    for k, h in enumerate(hs):
        out = dllm.generate(model, [PROMPTS[2]] * (k + 1), gen_length=32, block_length=8, seed=0, cache="dual",
                            sampler=dllm.get_sampler("llada", temperature=0.7))
        assert h.result(timeout=0).tokens == out.sequences[k].tolist(), k


def test_a_served_batchs_full_forwards_run_as_its_bucket_and_replay_across_batch_sizes():
    """A served batch's full forwards (every row at a block's start: the dual cache refreshes its canvas) run as its
    bucket too, so a batch of 3 rows and one of 4 in the same buffers share the full forwards' graphs: every forward of
    the second batch (its 4 blocks' full forwards among them) replays what the first captured. Every answer is the
    request's alone."""
    model = dllm.load_model("llada-tiny", dtype="float32")
    eng = Engine(model, max_rows=4, graphs="on")
    kw = dict(gen_length=32, block_length=8, sampler="llada", cache="dual")
    first = [eng.submit(PROMPTS[2], **kw) for _ in range(3)]
    eng.run_until_idle()
    was = Counter(eng.stats()["graphs"])
    assert was["full captures"] >= 1
    second = [eng.submit(PROMPTS[2], **kw) for _ in range(4)]
    eng.run_until_idle()
    now = Counter(eng.stats()["graphs"]) - was
    assert now["full replays"] == 4 and set(now) == {"full replays", "replays"}, now  # every forward a replay
    alone = dllm.generate(model, [PROMPTS[2]], **kw).sequences[0].tolist()
    assert all(h.result(timeout=0).tokens == alone for h in first + second)


def test_a_served_batch_without_a_cache_rounds_its_canvas_up_so_that_other_prompt_lengths_replay():
    """Without a cache every forward of a served batch is a full forward through a graph, keyed by its canvas: the
    canvas is rounded up to a bucket (a served batch's longest prompt changes as rows join and leave), so a later
    batch whose longest prompt is another length in the same bucket replays every forward the first captured.
    Every answer is the request's alone."""
    model = dllm.load_model("llada-tiny", dtype="float32")
    eng = Engine(model, max_rows=4, graphs="on")
    kw = dict(gen_length=32, block_length=8, sampler="llada")
    first, second = [PROMPTS[3], PROMPTS[2], PROMPTS[5]], [PROMPTS[1], PROMPTS[2], PROMPTS[5]]
    handles = [eng.submit(p, **kw) for p in first]
    eng.step()
    group = next(iter(eng.groups.values()))
    assert group.decoder.buckets and group.state.x.shape[1] == 64  # 27 prompt tokens + 32: 59 columns, rounded up
    eng.run_until_idle()
    was = Counter(eng.stats()["graphs"])
    assert was["full captures"] == 1
    handles += [eng.submit(p, **kw) for p in second]
    eng.step()
    assert len(next(iter(eng.groups.values())).state.rows[0]) + 32 == 64  # exactly the bucket: 32 prompt tokens
    eng.run_until_idle()
    now = Counter(eng.stats()["graphs"]) - was
    assert set(now) == {"full replays"} and now["full replays"] == 32, now
    for h, p in zip(handles, first + second):
        assert h.result(timeout=0).tokens == dllm.generate(model, [p], **kw).sequences[0].tolist()


# samplers and caches with per-row state beyond the K/V buffers: (sampler, params, cache, gen_length, block_length)
STATEFUL = {
    "klass": [("klass", {}, None, 32, 8), ("klass", {"conf_threshold": 0.3, "kl_threshold": 0.05}, "prefix", 32, 16)],
    "guided": [("guided", {}, None, 32, 8), ("guided", {"mode": "topk", "chunk": 4}, None, 16, None)],
    "freecache": [("threshold", {}, "freecache", 32, 8), ("llada", {"temperature": 0.8}, "freecache", 32, 16)],
    "elastic": [("threshold", {}, "elastic", 32, 8), ("elastic", {}, None, 32, None)],
    # per-row windows: CreditDecoding's tables read and written at each row's columns, AdaBlock's refined blocks
    "credit": [("credit", {}, None, 32, 8), ("adablock", {}, "dual", 32, None)],
}


def _alone(model, prompt, sampler, params, cache, G, B, seed):
    out = dllm.generate(model, [prompt], sampler=dllm.get_sampler(sampler, **params), cache=cache, gen_length=G,
                        block_length=B, seed=seed)
    return out.sequences[0].tolist(), out.stats.row_nfe[0]


@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("kind", list(STATEFUL))
def test_stateful_samplers_and_caches_join_and_leave_exactly(kind, family, graphs, llada, dream):
    """KLASS's kept steps, the AR guide's cache and cursors (guide ``ar-tiny``), FreeCache's and Elastic-Cache's
    per-row state, CreditDecoding's tables (read at each row's own window) move with the rows: requests joining running groups mid-decode with longer and shorter prompts,
    others leaving, and the longest prompt cancelled mid-decode (the canvas cropped); every response equals the
    request alone, and no batch failed (a failed batch is retried alone, which would hide a wrong move). On the
    graph path (static buffers on the CPU) too: bucketed canvases, K/V buffers moved through the runner's pool."""
    model = llada if family == "llada" else dream
    settings = STATEFUL[kind]
    runner = GraphRunner.of(model)
    ahead0 = Counter(runner.ahead if runner is not None else {})
    eng = Engine(model, max_rows=3, graphs=graphs)
    reqs = []
    for wave in range(3):
        for k, (sampler, params, cache, G, B) in enumerate(settings):
            for j in range(2):
                prompt = PROMPTS[(k + 2 * wave + 3 * j) % len(PROMPTS)]
                h = eng.submit(prompt, gen_length=G, block_length=B, sampler=sampler, params=params, cache=cache,
                               seed=k, request_id=f"{kind}-{wave}-{k}-{j}")
                reqs.append((h, prompt, sampler, params, cache, G, B, k))
        eng.step()
        eng.step()
    eng.run_until_idle()
    assert eng.stats()["joins"] >= 2 * len(settings)  # requests joined running groups
    # a short request decoding, a longer prompt joins (the running rows are re-padded), then leaves (cropped)
    sampler, params, cache, G, B = settings[0]
    short = eng.submit(PROMPTS[2], gen_length=G, block_length=B, sampler=sampler, params=params, cache=cache)
    eng.step()
    long = eng.submit(PROMPTS[1] + " " + PROMPTS[3], gen_length=G, block_length=B, sampler=sampler, params=params,
                      cache=cache)
    eng.step()
    group = next(iter(eng.groups.values()))
    assert len(group.requests) == 2  # the long prompt joined the short one's running group
    width = group.state.x.shape[1]
    long.cancel()
    eng.step()  # the long row leaves before the forward: the canvas is cropped, then the short row steps on
    assert long.result(timeout=0).finish_reason == "cancelled"
    if not short.done():
        group = next(iter(eng.groups.values()))
        left, bucketed = group.state, group.decoder.buckets  # the graph path: forwards that can replay
        T = len(left.rows[0]) + G  # exact: cropped; on the graph path the bucket of what is left
        assert left.x.shape[1] == (shape_bucket(T, model.max_seq_len) if bucketed else T) and T < width
        # every forward without a cache, and the caches' (Elastic: speculative forwards)
        assert bucketed == (graphs == "on")
    eng.run_until_idle()
    reqs.append((short, PROMPTS[2], sampler, params, cache, G, B, 0))
    assert eng.stats()["retried"] == 0 and eng.stats()["engine_errors"] == 0
    assert not eng.groups and not eng.waiting
    if graphs == "on" and kind == "elastic":  # served: its next steps made ready ahead, never launched ahead
        ahead = Counter(GraphRunner.of(model).ahead) - ahead0
        assert ahead["confirmed"] > 0 and ahead["launched"] == 0, ahead
    for h, prompt, sampler, params, cache, G, B, seed in reqs:
        r = h.result(timeout=0)
        tokens, nfe = _alone(model, prompt, sampler, params, cache, G, B, seed)
        assert r.tokens == tokens, (h.request_id, sampler, cache)
        assert r.nfe == nfe, (h.request_id, sampler, cache)
        assert r.finish_reason in ("stop", "length")


def test_a_preset_runs_with_its_own_cache(llada):
    eng = Engine(llada)
    h = eng.submit(PROMPTS[0], gen_length=32, sampler="fast-dllm", request_id="fd")
    e = eng.submit(PROMPTS[1], gen_length=32, sampler="elastic", request_id="el")  # its cache: Elastic-Cache
    eng.run_until_idle()
    out = dllm.generate(llada, [PROMPTS[0]], gen_length=32, sampler="fast-dllm")  # dual cache
    assert h.result(timeout=0).tokens == out.sequences[0].tolist()
    out = dllm.generate(llada, [PROMPTS[1]], gen_length=32, sampler="elastic")
    assert e.result(timeout=0).tokens == out.sequences[0].tolist()


def test_the_engine_default_sampler_and_params_apply_to_requests_that_name_none(llada):
    eng = Engine(llada, sampler="threshold", params={"tau": 0.3})
    a = eng.submit(PROMPTS[0], gen_length=16, block_length=8, request_id="a")  # tau 0.3
    b = eng.submit(PROMPTS[0], gen_length=16, block_length=8, request_id="b", params={"tau": 0.95})
    c = eng.submit(PROMPTS[0], gen_length=16, block_length=8, request_id="c", sampler="llada")  # not 0.7's params
    eng.run_until_idle()
    for h, sampler, params in ((a, "threshold", {"tau": 0.3}), (b, "threshold", {"tau": 0.95}),
                               (c, "llada", {})):
        r = h.result()
        ids, nfe = solo(llada, PROMPTS[0], h.request_id, sampler=sampler, params=params, gen_length=16,
                        block_length=8)
        assert r.tokens == ids[-16:] and r.nfe == nfe
    assert a.result().nfe < b.result().nfe  # the lower threshold commits more per step
    with pytest.raises(RequestError, match="unknown sampler"):
        Engine(llada, sampler="nope")


@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("family", ["sdar", "llada2", "fastdllm2"])
def test_block_diffusion_requests_join_and_leave_exactly(family, graphs):
    """Block-diffusion checkpoints (SDAR, LLaDA2's mixture of experts, Fast-dLLM v2's token shift): their own
    blocks and exact block cache by default; requests of mixed samplers, lengths and join times each equal
    dllm.generate of the request alone (on the graph path too: bucketed canvases, the blocks still on the model's
    grid)."""
    import golden_models as gm

    sdar = {"sdar": gm.sdar_tiny, "llada2": gm.llada2_tiny, "fastdllm2": gm.fastdllm2_tiny}[family](0)
    eng = Engine(sdar, max_rows=3, graphs=graphs)
    reqs = []
    for wave in range(3):
        for k, (sampler, params) in enumerate([("llada", {}), ("threshold", {"tau": 0.5}),
                                               ("credit", {"temperature": 0.8})]):
            prompt = PROMPTS[(k + wave) % len(PROMPTS)]
            rid = f"sdar-{wave}-{k}"
            G = 16 if k != 1 else 8
            reqs.append((eng.submit(prompt, gen_length=G, steps=G, sampler=sampler, params=params, seed=k,
                                    request_id=rid), prompt, rid, sampler, params, G, k))
        eng.step()
    eng.run_until_idle()
    assert eng.stats()["joins"] >= 2
    if graphs == "on" and not sdar.config.n_experts:  # a mixture of experts runs eagerly (its routing's shapes)
        assert sum(v for k, v in eng.stats()["graphs"].items() if k in ("replays", "captures", "eager:first sight"))
    for h, prompt, rid, sampler, params, G, seed in reqs:
        out = dllm.generate(sdar, [prompt], gen_length=G, steps=G, sampler=dllm.get_sampler(sampler, **params),
                            seed=seed)
        assert h.result(timeout=0).tokens == out.sequences[0].tolist(), rid
        assert h.result().nfe == out.stats.row_nfe[0], rid
    # The longest prompt leaves after a few steps: the canvas is cropped and the final columns move left with it.
    eng = Engine(sdar, max_rows=4)
    h_long = eng.submit(PROMPTS[1] + " " + PROMPTS[3], gen_length=16, steps=16, request_id="long")
    h_short = eng.submit(PROMPTS[2], gen_length=16, steps=16, request_id="short")
    for _ in range(6):
        eng.step()
    width = next(iter(eng.groups.values())).state.x.shape[1]
    h_long.cancel()
    eng.run_until_idle()
    assert h_long.result(timeout=0).finish_reason == "cancelled" and eng.stats()["forwards"] > 6
    out = dllm.generate(sdar, [PROMPTS[2]], gen_length=16, steps=16)
    assert h_short.result(timeout=0).tokens == out.sequences[0].tolist()
    assert width > len(h_short.result().tokens)  # the group held the long prompt's padding before


def test_asyncio_callers_await_results_and_iterate_deltas(llada):
    """submit() from asyncio code: ``await aresult()`` and ``async for`` over the final prefix's pieces."""
    import asyncio

    eng = Engine(llada, max_rows=4)
    eng.start()
    try:
        async def one(i):
            h = eng.submit(PROMPTS[i], gen_length=16, sampler="threshold", request_id=f"a{i}")
            pieces = [ids async for ids in h.adelta_ids()]
            return h, pieces, await h.aresult()

        async def main():
            return await asyncio.gather(*(one(i) for i in range(3)))

        for h, pieces, r in asyncio.run(main()):
            flat = [t for p in pieces for t in p]
            assert flat and r.tokens[:len(flat)] == flat
            tokens, _ = solo(llada, PROMPTS[int(h.request_id[1:])], h.request_id, sampler="threshold", gen_length=16)
            assert r.tokens == tokens
    finally:
        eng.stop()


def test_guided_requests_share_one_loaded_guide(llada, tmp_path):
    """Requests naming the same guide checkpoint use one loaded guide (not a copy each); a guide the engine was not
    given (here a path that does not exist) is refused at submit."""
    eng = Engine(llada)
    eng.submit(PROMPTS[0], gen_length=8, sampler="guided")
    eng.submit(PROMPTS[1], gen_length=8, sampler="guided", params={"mode": "topk"})
    assert len({id(r.recipe.sampler.guide_model()[0]) for r in eng.waiting}) == 1
    with pytest.raises(RequestError, match="not one this server allows; allowed guides: ar-tiny"):
        eng.submit(PROMPTS[0], sampler="guided", params={"guide": str(tmp_path / "missing")})
    eng.run_until_idle()
    assert eng.stats()["requests"]["stop"] + eng.stats()["requests"]["length"] == 2


def _same_cache_state(cache, gc, sc, i, a, v0):
    """Row ``i`` of the group's cache ``gc`` against the request's own ``sc`` (``a``: the group's extra left padding
    of the row, ``v0``: its first real column there). Equal up to float rounding (a batch's products and sums are
    not a single row's, by some 1e-5 on some CPUs): a row moved to the wrong place differs by far more."""
    if cache == "none":
        return
    tol = dict(rtol=1e-4, atol=1e-4)
    for layer in range(len(sc.k)):
        for ours, its in ((gc.k, sc.k), (gc.v, sc.v)):
            torch.testing.assert_close(ours[layer][i, :, v0:], its[layer][0], **tol)
    if cache == "freecache":
        assert int(gc.cur_lo[i]) == int(sc.cur_lo[0]) + a
    elif cache == "elastic":
        assert gc.track[i, a:].tolist() == sc.track[0].tolist()
        for layer in range(len(sc.xc)):
            torch.testing.assert_close(gc.xc[layer][i, v0:], sc.xc[layer][0], **tol)
            torch.testing.assert_close(gc.qc[layer][i, :, v0:], sc.qc[layer][0], **tol)


def _same_sampler_state(sampler, gs, ss, i, a, P):
    """Row ``i`` of the group's sampler state ``gs`` against the request's own ``ss`` (``P``: the group's
    generation start)."""
    if sampler == "klass":
        ours, its = gs.get("klass", {}).get("steps", []), ss.get("klass", {}).get("steps", [])
        assert len(ours) >= len(its)
        for g in ours[:len(ours) - len(its)]:  # kept steps before the row joined: no history of it
            assert int(g.region[i]) < P
        for g, q in zip(ours[len(ours) - len(its):], its):
            assert int(g.region[i]) == int(q.region[0]) + a
            g_lo = int(g.lo[i, 0]) if torch.is_tensor(g.lo) else g.lo  # per-row windows: the row's own start
            c = q.lo + a - g_lo  # the request's window (its region) inside the group's
            torch.testing.assert_close(g.logits[i, c:c + q.logits.shape[1]], q.logits[0], rtol=1e-4, atol=1e-4)
    elif sampler == "guided" and "guided" in ss:
        ours, its = gs["guided"], ss["guided"]
        for name in ("npad", "fed"):
            assert int(ours[name][i]) == int(its[name][0]) + a
        assert bool(ours["stopped"][i]) == bool(its["stopped"][0])
        for la, lb in zip(ours["cache"].layers, its["cache"].layers):  # the valid slots, in order
            if lb.keys is None or lb.keys.dim() != 4:
                continue
            for x, y in ((la.keys, lb.keys), (la.values, lb.values)):
                torch.testing.assert_close(x[i][:, ours["slots"][i]], y[0][:, its["slots"][0]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sampler,cache", [("llada", "freecache"), ("llada", "elastic"), ("klass", "none"),
                                           ("guided", "none")])
def test_a_rows_state_after_joins_and_leaves_is_its_own(sampler, cache, llada):
    """Step by step, each running row's tokens, cached K/V, the cache policy's own per-row state (FreeCache's
    region start of the last plan; Elastic-Cache's stored layer inputs and queries and its tracked tokens) and
    the sampler's (KLASS's kept steps; the AR guide's cursors and its cache's valid slots) equal those of the same
    request decoded alone after as many forwards, shifted by the group's extra left padding: requests with longer
    and shorter prompts join mid-decode (the caches' ones also at a block boundary), rows leave when done."""
    from dllm.config import GenerateConfig
    from dllm.generate import Decoder, prepare_prompts
    from dllm.recipes import resolve

    eng = Engine(llada, max_rows=3)
    alone = {}
    # engine tick -> prompts submitted before it (LLaDA's sampler: one token per step, so tick 8 is a block start)
    schedule = {0: [2], 3: [1, 5], 8: [3], 11: [0]} if sampler == "llada" else {0: [2], 1: [1], 2: [5, 3], 3: [0]}
    for tick in range(80):
        for p in schedule.get(tick, []):
            h = eng.submit(PROMPTS[p], gen_length=16, block_length=8, sampler=sampler, cache=cache,
                           request_id=f"{sampler}-{cache}-{tick}-{p}")
            parts = resolve(llada, dllm.get_sampler(sampler), cache, None,
                            GenerateConfig(gen_length=16, block_length=8, seed=0))
            dec = Decoder(llada, *parts)
            alone[h.request_id] = (dec, dec.start(prepare_prompts(llada, [PROMPTS[p]], None, True)))
        if not eng.step():
            break
        for group in eng.groups.values():
            st = group.state
            for i, req in enumerate(group.requests):
                dec, s = alone[req.request_id]
                while int(s.row_nfe[0]) < int(st.row_nfe[i]):
                    dec.step(s)
                a = st.P - s.P  # the group's extra left padding of this row
                assert st.x[i, a:].tolist() == s.x[0].tolist()
                _same_cache_state(cache, group.decoder.cache, dec.cache, i, a, st.P - len(req.rows))
                _same_sampler_state(sampler, st.state, s.state, i, a, st.P)
    assert not eng.groups and not eng.waiting
    assert eng.stats()["joins"] >= 2 and eng.stats()["retried"] == 0


def test_logits_columns_count_each_rows_window_or_the_union(llada, monkeypatch):
    """``stats()["logits_columns"]``: the (row, column) logits the steps computed; ``own_logits_columns``: those in
    each row's own window. LLaDA's sampler in blocks of 8 decodes every step inside an 8-column region: alone, every
    column computed is the row's own. With a request joining two blocks behind, LLaDA's sampler (per-row windows,
    ``SamplerBase.row_windows``) still computes each row's 8 columns alone; without them (as for a sampler that does
    not declare them) every row is computed over the union of the rows' blocks, the other row's block too, while each
    row's own columns stay 8 per forward it took."""
    kw = dict(gen_length=32, block_length=8, steps=32, sampler="llada")
    engine = Engine(llada, max_rows=4)
    engine.submit(PROMPTS[0], **kw)
    engine.run_until_idle()
    s = engine.stats()
    assert s["logits_columns"] == s["own_logits_columns"] == 8 * s["request_nfe"] == 8 * 32

    for union in (False, True):
        if union:
            monkeypatch.setattr(sys.modules["dllm.generate"], "declares_row_windows", lambda sampler: False)
        engine = Engine(llada, max_rows=4)
        engine.submit(PROMPTS[1], **kw)
        for _ in range(16):  # two blocks decoded: the first row is in its third block
            engine.step()
        engine.submit(PROMPTS[2], **kw)
        engine.run_until_idle()
        s = engine.stats()
        assert s["requests"]["length"] + s["requests"]["stop"] == 2
        assert s["own_logits_columns"] == 8 * s["request_nfe"]
        assert (s["logits_columns"] > s["own_logits_columns"]) == union, (union, s["logits_columns"])
