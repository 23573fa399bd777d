"""The forward a CUDA graph captures is replay-safe, checked on the CPU.

On CUDA, :class:`dllm.graphs.GraphRunner` captures a cached step's forward once per graph key and replays it: the
same kernels, with the Python numbers of their arguments baked in, on the same memory. That is only correct when
every later forward with that key would issue the same operators with the same non-tensor arguments, reading and
writing the same memory (static inputs, the cache's K/V buffers, the weights; buffers allocated inside the forward
come from the graph's own pool), and when the forward never waits for the device (a host read of device data
inside a capture fails, or bakes in the value seen at capture).

On the CPU the runner's static-buffer path (``graphs="on"``, ``capture=False``) runs that very forward at each
"replay". Here every such forward is traced (``tests/op_trace.py``: each ATen operator, views included, with its
non-tensor arguments and its tensors' shapes, dtypes and strides; each Triton launch with its grid, scalars and
constexprs; the addresses of the memory read that existed before the forward) and counted for host
synchronisations (``tests/sync_counter.py``), grouped by graph (the runner's ``_Graph``: one per key), and the
capture and every replay of a key must agree. Decodes run twice, the second call with other prompts of the same
canvas bucket, so that a fresh cache replays the first call's graphs on the pooled K/V buffers.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
from contextlib import contextmanager

import pytest
import torch
from op_trace import OpTrace, Run, compare, replay_problems
from sync_counter import SyncCounter

import dllm
from dllm import kernels
from dllm.caches import ElasticCache
from dllm.graphs import GraphRunner
from dllm.models.fast import enable_fast_path
from dllm.models.transformer import Transformer
from dllm.samplers import get_sampler
from dllm.serve.engine import Engine

GEN = importlib.import_module("dllm.generate")  # the module (dllm.generate is also the function)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

CACHES = ["dual", "prefix", "dkv-decode", "freecache"]
SAMPLERS = ["llada", "threshold"]

# two calls per case: prompts of one canvas bucket, the second call's cache replays the first call's graphs
# (prompts on which the bundled models are unsure enough to take several cached steps per block)
TEXTS = {
    1: (["Name two colours, comma separated."], ["Write a short poem about the sea."]),
    3: (["Name two colours, comma separated.", "Copy: Carol", "Sort: 5, 3, 9, 1"],
        ["Write a short poem about the sea.", "Hi", "Reverse the list: Alice Adams, Brian Baker"]),
}
# without the chat template (short canvases for the Triton interpreter)
SHORT = {
    1: (["Copy: Carol"], ["Name a colour."]),
    2: (["Copy: Carol", "Hi"], ["Hi there", "Name a colour."]),
}


@functools.cache
def bundled(family: str) -> Transformer:
    """The bundled tiny checkpoint (read-only in the tests; a test that changes a model loads its own)."""
    return dllm.load_model(f"{family}-tiny")


# ------------------------------------------------------------------------------------------------ the recorder


class Recording:
    """The traced graph forwards of one runner, by graph (a ``_Graph``: one per key, kept alive here)."""

    def __init__(self, runner: GraphRunner):
        self.runner = runner
        self.graphs: dict[int, tuple] = {}
        self.call = 0

    def add(self, g, run: Run) -> None:
        self.graphs.setdefault(id(g), (g, []))[1].append(run)

    def problems(self) -> list[str]:
        out = []
        for g, runs in self.graphs.values():
            q = "all (a full forward)" if g.query_idx is None else g.query_idx.shape[1]
            out += replay_problems(f"graph B={g.x.shape[0]} T={g.x.shape[1]} Q={q} W={g.logits_idx.shape[1]} "
                                   f"N={g.query_tokens} mask={g.key_mask is not None}", runs)
        return out

    def replayed(self) -> list[list[Run]]:
        """Runs of the graphs run at least twice (a capture and a replay)."""
        return [runs for _, runs in self.graphs.values() if len(runs) >= 2]


def _names(model, g, cache) -> dict[int, str]:
    """Storage address -> what it is: the model's tensors, the graph's static inputs, the cache's K/V buffers."""
    names = {}
    for n, p in itertools.chain(model.named_parameters(), model.named_buffers()):
        names.setdefault(p.untyped_storage().data_ptr(), f"model {n}")
    for n, t in vars(g).items():
        if isinstance(t, torch.Tensor):
            names[t.untyped_storage().data_ptr()] = f"static {n}"
    for kind in ("k", "v"):
        for i, t in enumerate(getattr(cache, kind, ())):  # NoCache: no buffers
            if t is not None:
                names[t.untyped_storage().data_ptr()] = f"cache.{kind}[{i}]"
    return names


@contextmanager
def traced_graphs(model, **runner_kw):
    """A fresh runner (static-buffer path) on ``model`` whose graph forwards (captures and replays; not the eager
    first sight of a shape) are traced; yields the :class:`Recording`. The decode loop takes the path of a CUDA run
    (``_host_check_free``: no check is free)."""
    runner = GraphRunner(model, capture=False, **runner_kw)
    rec = Recording(runner)
    orig = GraphRunner._forward

    def forward(self, g, cache):
        if self is not runner or not g.captured:  # capture=False marks the graph captured before its first run
            return orig(self, g, cache)
        names = _names(model, g, cache)
        with SyncCounter() as syncs, OpTrace() as trace:
            out = orig(self, g, cache)
        rec.add(g, Run(rec.call, trace, syncs.where, names))
        return out

    saved, free = model.__dict__.get("_dllm_graphs"), GEN._host_check_free
    model.__dict__["_dllm_graphs"] = runner
    GraphRunner._forward = forward
    GEN._host_check_free = lambda t: False
    try:
        yield rec
    finally:
        GraphRunner._forward = orig
        GEN._host_check_free = free
        if saved is None:
            model.__dict__.pop("_dllm_graphs", None)
        else:
            model.__dict__["_dllm_graphs"] = saved


def decode_traced(model, cache: str, sampler, calls, gen_length=16, block_length=8, **kw) -> Recording:
    """``generate`` on the graph path once per prompt set in ``calls``, every graph forward traced."""
    with traced_graphs(model) as rec:
        for i, prompts in enumerate(calls):
            rec.call = i
            dllm.generate(model, prompts, sampler=sampler, cache=cache() if callable(cache) else cache, graphs="on",
                          gen_length=gen_length,
                          block_length=block_length, steps=gen_length, seed=1, **kw)
    return rec


def assert_replay_safe(rec: Recording, min_replays: int = 2, across_calls: bool = True) -> None:
    """No problem in any graph's runs, at least ``min_replays`` replays, and (``across_calls``) a graph captured in
    the first call replayed in the second."""
    problems = rec.problems()
    assert not problems, "\n".join(problems[:8])
    replays = sum(len(runs) - 1 for runs in rec.replayed())
    assert replays >= min_replays, f"only {replays} replays: the check is vacuous"
    if across_calls:
        calls = [sorted({r.call for r in runs}) for runs in rec.replayed()]
        assert any(len(c) > 1 for c in calls), f"no graph of the first call replayed in the second: {calls}"
    for runs in rec.replayed():  # the traces are the forward's: the model's products and the cache's writes
        names = set(runs[0].trace.names())
        assert "aten.mm.default" in names or "aten.addmm.default" in names, sorted(names)


# ------------------------------------------------------------------------------------------------ the cases


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_graph_forwards_replay_what_they_captured(family, cache, sampler, batch):
    """The PyTorch kernels (the CPU default) and the published layer: every key's replays issue the capture's
    operators with its arguments, on its memory, without host synchronisation; across two calls."""
    rec = decode_traced(bundled(family), cache, sampler, TEXTS[batch])
    assert_replay_safe(rec)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_fast_layer_graph_forwards_replay_what_they_captured(family, cache):
    """The fast layer (fused projections, RoPE writing the K/V buffers itself) with the PyTorch twins."""
    model = enable_fast_path(dllm.load_model(f"{family}-tiny"))
    rec = decode_traced(model, cache, "threshold", TEXTS[3])
    assert_replay_safe(rec)
    ops = {n for runs in rec.replayed() for n in runs[0].trace.names()}
    assert "aten.scatter_.src" in ops  # rope_qk_write_ref's writes into the K/V buffers


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_full_forward_graphs_replay_what_they_captured(family, fast):
    """Full forwards: every step without a cache, and a cache's refreshes (every row of its K/V buffers written in
    place; a graph captured in the first call replayed in the second, on the pooled buffers)."""
    model = enable_fast_path(dllm.load_model(f"{family}-tiny")) if fast else bundled(family)
    for cache in ("none", "prefix"):
        rec = decode_traced(model, cache, "llada", TEXTS[3], gen_length=24)
        assert_replay_safe(rec, across_calls=cache == "prefix")
        full = [runs for g, runs in rec.graphs.values() if g.query_idx is None and len(runs) >= 2]
        assert full, f"{cache}: no full forward replayed"
        if cache == "prefix":
            assert any(len({r.call for r in runs}) > 1 for runs in full)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_elastic_speculative_forwards_and_redos_replay_what_they_captured(family, fast):
    """Elastic-Cache on the graph path: its cached steps run speculatively (the hooks' per-step state in kept
    buffers, the drift tests into a device buffer) and, where a drift test failed, are redone from a layer (graphs
    of their own, keyed by each row's switch layer). Both kinds replay what they captured, across calls (the stored
    inputs, queries and kept buffers come back from the pool in their roles). A strict threshold makes the tests
    fail often enough on the trained models that redos replay."""
    model = enable_fast_path(dllm.load_model(f"{family}-tiny")) if fast else bundled(family)
    rec = decode_traced(model, lambda: ElasticCache(gamma=0.999), "threshold", TEXTS[3], gen_length=24)
    assert_replay_safe(rec)
    redos = [runs for g, runs in rec.graphs.values() if g.start and len(runs) >= 2]
    assert redos, "no redo replayed"


def test_graphs_replay_the_aranges_they_captured_after_many_other_lengths():
    """The shared aranges (``dllm.ops.cached_arange``) keep a bounded number of lengths; those a captured graph reads
    are kept for good (``pinned_aranges``), so a graph of one call replays its aranges in the next, even after more
    lengths than the bound were asked for in between (a long-lived server meets many). Elastic-Cache's parts read
    aranges inside their graphs."""
    from dllm.ops import cached_arange

    def calls():
        for i, prompts in enumerate(TEXTS[3]):
            if i:
                for n in range(100_000, 100_040):  # more lengths than the unpinned bound
                    cached_arange(n, "cpu")
            yield prompts

    rec = decode_traced(bundled("llada"), lambda: ElasticCache(gamma=0.999), "threshold", calls(), gen_length=24)
    assert_replay_safe(rec)


@pytest.mark.parametrize(("name", "cache"), [("sdar-tiny", "block"), ("fastdllm2-tiny", "block"),
                                           ("llada-tiny", "dkv-greedy")])
def test_other_graphed_caches_replay_what_they_captured(name, cache):
    """The block-diffusion checkpoints' exact cache (block-causal attention) and dKV-Cache-Greedy."""
    rec = decode_traced(dllm.load_model(name), cache, "llada", TEXTS[3], block_length=None if cache == "block" else 8)
    assert_replay_safe(rec)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_served_batches_replay_what_they_captured(family):
    """The serving engine: a batch in a bucket's K/V buffers (4 rows for 3, the runner reading the buffers whole),
    a request joining mid-block (rows out of step: the per-token work packed, ``query_tokens``), the canvas
    growing for a longer prompt (buffers moved through the pool)."""
    prompts = ['Please copy the list exactly: ["Ann Lee", "Bob Stone"]', "What is 12 + 30?",
               'Sort the list by last name: ["Wendy Harper", "Frank Dawson"]',
               "Fill in the Latin square with the symbols A, B, C, D."]
    kw = dict(gen_length=32, block_length=8, sampler="llada", cache="dual")
    with traced_graphs(bundled(family)) as rec:
        eng = Engine(bundled(family), max_rows=4, graphs="on")
        for p in prompts[:3]:
            eng.submit(p, **kw)
        for _ in range(5):
            eng.step()
        eng.submit(prompts[3], **kw)
        eng.run_until_idle()
        assert eng.stats()["joins"] == 1 and eng.stats()["retried"] == 0
    assert_replay_safe(rec, across_calls=False)
    shapes = {(g.x.shape[0], g.query_idx.numel(), g.query_tokens) for g, _ in rec.graphs.values()}
    assert any(B == 4 for B, _, _ in shapes), shapes  # the bucket of 3 rows
    assert any(n < rows for _, rows, n in shapes), shapes  # packed rows


@pytest.fixture
def splitk():
    """Split-K attention on the Triton backend (what float32 runs on a GPU; the interpreter's default is the flash
    kernel), then the previous choice."""
    old = kernels.dispatch._forced
    kernels.set_attention_backend("splitk")
    yield
    kernels.set_attention_backend(old)


def _triton_case(family, cache, fast, batch, want):
    model = dllm.load_model(f"{family}-tiny")
    if fast:
        enable_fast_path(model)
    # one token per step (a cached step per token); the sampler's own fused kernel is outside the forward: its
    # PyTorch path keeps the interpreter's time down
    sampler = get_sampler("llada", fused="off")
    rec = decode_traced(model, cache, sampler, SHORT[batch], gen_length=4, block_length=4, chat_template=False)
    assert_replay_safe(rec)
    launched = {n for runs in rec.replayed() for n in runs[0].trace.names() if n.startswith("triton.")}
    assert want <= launched, launched


@needs_triton
@pytest.mark.parametrize(("family", "cache", "batch"), [("llada", "dual", 2),  # slow: the interpreter
                                                   pytest.param("dream", "dkv-decode", 1, marks=pytest.mark.slow)])
def test_triton_fast_layer_graph_forwards_replay_what_they_captured(family, cache, batch, triton_backend):
    """The fast layer's Triton kernels (interpreter): their launches, grids, scalars and constexprs."""
    _triton_case(family, cache, True, batch, {"triton._norm_kernel", "triton._rope_kernel", "triton._attn_fwd",
                                              "triton._silu_mul_kernel"})


@needs_triton
def test_triton_fast_layer_full_forward_graphs_replay_what_they_captured(triton_backend):
    """Full forwards (no cache) through the fast layer's Triton kernels (interpreter): every query row attends."""
    model = enable_fast_path(dllm.load_model("llada-tiny"))
    sampler = get_sampler("llada", fused="off")
    rec = decode_traced(model, "none", sampler, SHORT[1], gen_length=4, block_length=4, chat_template=False)
    assert_replay_safe(rec, across_calls=False)
    full = [runs for g, runs in rec.graphs.values() if g.query_idx is None and len(runs) >= 2]
    assert full
    launched = {n for runs in full for n in runs[0].trace.names() if n.startswith("triton.")}
    assert {"triton._norm_kernel", "triton._rope_kernel", "triton._silu_mul_kernel", "triton._attn_fwd"} <= launched, \
        launched


@needs_triton
def test_triton_elastic_speculative_forwards_replay_what_they_captured(triton_backend):
    """Elastic-Cache's speculative parts through the Triton kernels (interpreter): the attention-mass kernel that
    picks the tracked tokens, and the attention, launched alike in every replay."""
    sampler = get_sampler("llada", fused="off")
    rec = decode_traced(bundled("llada"), lambda: ElasticCache(gamma=0.999), sampler, SHORT[1], gen_length=4,
                        block_length=4, chat_template=False)
    assert_replay_safe(rec)
    launched = {n for runs in rec.replayed() for n in runs[0].trace.names() if n.startswith("triton.")}
    assert {"triton._attn_mass", "triton._attn_fwd"} <= launched, launched


@needs_triton
def test_triton_splitk_attention_graph_forwards_replay_what_they_captured(triton_backend, splitk):
    """The published layer with the Triton split-K attention (the kernel float32 runs on a GPU), ragged rows."""
    _triton_case("dream", "prefix", False, 2, {"triton._attn_splitk"})


# ------------------------------------------------------------------------------------------------ the checker fails


@pytest.fixture
def final_norm(monkeypatch):
    """Install ``extra(h)`` after the model's last norm (inside every forward)."""
    orig = Transformer._final_norm

    def install(extra):
        monkeypatch.setattr(Transformer, "_final_norm", lambda self, h: extra(orig(self, h)))

    return install


def _problems(model) -> list[str]:
    rec = decode_traced(model, "dual", "llada", TEXTS[1])
    assert rec.replayed()
    return rec.problems()


def test_the_check_sees_a_step_dependent_number(final_norm):
    """A Python number that changes from call to call is baked into a captured kernel."""
    calls = itertools.count(3)

    def extra(h):
        n = next(calls)
        return h + n - n

    final_norm(extra)
    problems = _problems(dllm.load_model("llada-tiny"))
    assert problems and all("aten.add.Tensor" in p for p in problems), problems
    assert "aten.add.Tensor: field 0" in problems[0], problems[0]  # the number added differs


def test_the_check_sees_a_host_synchronisation(final_norm):
    def extra(h):
        if float(h.amax()) > 1e30:  # reads the device's value on the host
            h = h * 0
        return h

    final_norm(extra)
    problems = _problems(dllm.load_model("llada-tiny"))
    assert any("host synchronisations" in p and "__float__" in p for p in problems), problems
    assert any("synchronising operators" in p and "_local_scalar_dense" in p for p in problems), problems


def test_the_check_sees_memory_that_moves(final_norm):
    """A tensor made before the forward and read inside it, another one at each call (as a cache attribute
    replaced at every step would be): a graph would read the one seen at capture."""
    made = [torch.zeros(()) for _ in range(200)]
    calls = itertools.count()
    final_norm(lambda h: h + made[next(calls)])
    problems = _problems(dllm.load_model("llada-tiny"))
    assert problems and all("reads" in p and "at capture" in p and "aten.add.Tensor" in p for p in problems), problems


@needs_triton
def test_the_check_sees_host_data_and_triton_constexprs(triton_backend):
    """A tensor made from host values inside the forward is reported with its values; a Triton launch is traced
    with its grid, scalars and constexprs (a wider row: another ``BLOCK``), its tensors by origin."""
    from dllm.kernels import fused

    with OpTrace() as t:
        torch.ones(3) + torch.tensor([1.0, 2.0, 3.0])
    assert t.host_data and t.host_data[0][1] == ([1.0, 2.0, 3.0],)
    w = torch.ones(64)
    traces = []
    for n in (16, 16, 32):
        x = torch.randn(2, n)
        with OpTrace() as t:
            fused.rms_norm(x, w[:n], 1e-6)
        traces.append(t)
    launch = next(e for e in traces[0].ops if e[0] == "triton._norm_kernel")
    assert launch[1] == ("grid", ("tuple", (2,))) and ("BLOCK", 16) in launch[3]
    assert [a[-1] for a in launch[2][:5]] == ["ext", "ext", "ext", "int", "int"]  # x, x, w; the new outputs
    assert traces[0].ops == traces[1].ops
    assert [e.ptr for e in traces[0].external] != [e.ptr for e in traces[1].external]  # another x
    assert any("reads" in p for p in compare(traces[0], traces[1]))
    diff = compare(traces[0], traces[2])
    assert len(diff) == 1 and "differs" in diff[0], diff
