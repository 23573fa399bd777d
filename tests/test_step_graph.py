"""A decode step's work after its forward as one CUDA graph (``Decoder._commit_graphed``), checked on the CPU.

On the graph path, for a sampler whose step is a function of its tensors alone (``SamplerBase.graph_safe``), the
sampler, the commits into the canvas, their records and the regions' bookkeeping run as one graph per window
(``GraphRunner.tail``) on static copies of the decode state (``_StepBank``). On the CPU the runner's static-buffer
path (``capture=False``) runs that very work at each "replay"; here it must decode what the eager step decodes
(tokens, trace, commit steps, finish steps), across calls and interleaved decodes, and every run of a key must issue
the capture's operators with its arguments on its memory, without host synchronisation (``tests/op_trace.py``,
as ``test_graph_replay_safety.py`` checks the forwards).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections import Counter

import pytest
import torch
from conftest import random_model
from op_trace import OpTrace, Run, replay_problems
from sync_counter import SyncCounter

import dllm
import dllm.ops as dllm_ops
from dllm.generate import Decoder, _StepBank
from dllm.graphs import GraphRunner
from dllm.recipes import resolve
from dllm.samplers import SAMPLERS, get_sampler
from dllm.samplers.composed import ComposedSampler
from dllm.samplers.dream import DreamSampler
from dllm.samplers.llada import LLaDASampler
from dllm.samplers.prophet import Prophet
from dllm.samplers.rules import Threshold

GEN = importlib.import_module("dllm.generate")  # the module (dllm.generate is also the function)


def _sampler(name, t: float = 0.0):
    if not isinstance(name, str):  # a sampler object
        return name
    return get_sampler(name, **({"delimiters": (5, 6, 7)} if name == "adablock" else {}),
                       **({"temperature": t} if t else {}))


#: the registered samplers whose step may run as a graph (their parameters' defaults, greedy)
SAFE = [n for n in SAMPLERS if _sampler(n).graph_safe()]
PROMPTS = ([[5, 6, 7], [8, 9, 10, 11, 12], [13]], [[20, 21, 22, 23, 27], [24], [25, 26]])  # one canvas, two calls


def _decode(model, name, cache, calls=PROMPTS, t=0.0, step_graphs=True, **kw):
    """``generate`` on the graph path once per prompt set of ``calls``, with or without the step graphs."""
    saved = Decoder.step_graphs
    Decoder.step_graphs = step_graphs
    try:
        kw = {"gen_length": 16, "block_length": 8, "steps": 16, "seed": 1, **kw}
        return [dllm.generate(model, prompts, sampler=_sampler(name, t), cache=cache, graphs="on", **kw)
                for prompts in calls]
    finally:
        Decoder.step_graphs = saved


def _same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    for f in ("trace", "commit_step", "finish_step", "row_nfe", "nfe", "commit_logprob", "commit_top_ids",
              "commit_top_logprobs"):
        assert repr(getattr(a.stats, f)) == repr(getattr(b.stats, f)), f  # NaN (AdaBlock's records) equals NaN


def test_the_registered_graph_safe_samplers():
    """The baselines (Dream's schedule a shared table), the stateless rules, CreditDecoding and KLASS (their kept
    state in the bank) and Prophet declare themselves; the AR-guided sampler (its guide's forwards, its decisions on
    the host) and samplers drawing from the run's generator do not."""
    assert {"llada", "llada-random", "threshold", "fast-dllm", "factor", "localleap", "eb", "entropy-threshold",
            "ascending", "eoser", "eoser-ass", "credit", "dream", "prophet", "klass"} <= set(SAFE)
    assert "guided" not in SAFE
    assert not LLaDASampler(temperature=0.7, noise_scope="region").graph_safe()  # draws from the run's generator
    assert "dream" in SAFE and DreamSampler(noise_scope="region").graph_safe()  # greedy: no noise drawn
    for kw in (dict(temperature=0.7), dict(alg="origin"), dict(alg_temp=0.5)):  # draws from the run's generator
        assert not DreamSampler(noise_scope="region", **kw).graph_safe(), kw


@pytest.mark.parametrize("t", [0.0, 0.7])
@pytest.mark.parametrize("name", SAFE)
def test_step_graphs_decode_what_the_eager_step_decodes(name, t):
    """Every graph-safe sampler, greedy and sampled, without a cache and with the dual cache, in two calls (the
    second replays the first's graphs on the bank): the tokens and records of the step run eagerly."""
    if t and "temperature" not in SAMPLERS[name].params():
        pytest.skip(f"{name} has no temperature")
    model = random_model("llada")
    for cache in ("none", "dual"):
        # a model (and graph runner) of its own for each: the cache's statistics depend on the graphs already there
        graphed = _decode(random_model("llada"), name, cache, t=t)
        eager = _decode(random_model("llada"), name, cache, t=t, step_graphs=False)
        for a, b in zip(graphed, eager):
            _same(a, b)
            assert not b.stats.step_graphs
        if Decoder(model, *resolve(model, _sampler(name, t), cache, None, dllm.GenerateConfig(
                gen_length=16, block_length=8, steps=16, graphs="on")))._commit_graph is not None:
            assert graphed[1].stats.step_graphs.get("replays", 0) > 0, graphed[1].stats.step_graphs


def _graphed_as_eager(family: str, sampler, dense: bool, monkeypatch) -> list:
    """``sampler``'s decodes from the step graphs on a random ``family`` model, without a cache and with the dual
    cache, in two calls each (the second replays), checked against the eager step's; returns the graphed outputs.
    ``dense``: every window position scored, as on a GPU (else only where needed, as on the CPU)."""
    if dense:
        monkeypatch.setattr(dllm_ops, "dense_window", lambda logits: True)
    outs = []
    for cache in ("none", "dual"):
        graphed = _decode(random_model(family), sampler, cache)
        for a, b in zip(graphed, _decode(random_model(family), sampler, cache, step_graphs=False)):
            _same(a, b)
        assert graphed[1].stats.step_graphs.get("replays", 0) > 0, graphed[1].stats.step_graphs
        outs += graphed
    return outs


#: Dream's algorithms (greedy and sampled, its position draw, ``origin``'s reveal, top-p) on each row's noise
DREAMS = [DreamSampler(), DreamSampler(temperature=0.7), DreamSampler(alg="origin", temperature=0.7),
          DreamSampler(alg="maskgit_plus", temperature=0.5, alg_temp=0.5),
          DreamSampler(alg="topk_margin", temperature=0.8, top_p=0.9), DreamSampler(noise_scope="region")]
DREAM_IDS = ["greedy", "sampled", "origin", "alg-temp", "top-p", "region-greedy"]


@pytest.mark.parametrize("dense", [pytest.param(False, marks=pytest.mark.slow), True])  # the CPU path: slow run
@pytest.mark.parametrize("sampler", DREAMS, ids=DREAM_IDS)
def test_dream_step_graphs_decode_what_the_eager_step_decodes(sampler, dense, monkeypatch):
    """Dream's sampler on Dream's model (its logits shifted), without a cache and with the dual cache, in two calls:
    the tokens and records of the step run eagerly, every window position scored as on a GPU or only the masked
    ones as on the CPU."""
    _graphed_as_eager("dream", sampler, dense, monkeypatch)


@pytest.mark.parametrize("sampler", DREAMS[:5], ids=DREAM_IDS[:5])
def test_dream_step_graphs_replay_what_they_captured(sampler):
    """Every run of a Dream step graph's key issues its capture's operators on its memory, its schedule table among
    them, across calls, with more device constants made between the calls than are kept unpinned."""
    def run(i):
        if i:
            for n in range(dllm_ops.KEPT_UNPINNED + 8):
                dllm_ops.kept(("other", n), lambda: torch.zeros(1))
        _decode(model, sampler, "dual", calls=[PROMPTS[i]])

    model = random_model("dream")
    runs = traced(model, run, 2)
    found = problems(runs)
    assert not found, "\n".join(found[:8])
    assert any(len({r.call for r in rs}) > 1 for rs in runs.values()), "no graph of the first call replayed"


#: KLASS at thresholds where random weights' candidates are confident and stable at some steps and not at others,
#: both reference styles, a longer history
KLASSES = [get_sampler("klass", conf_threshold=0.02, kl_threshold=1.0, **kw) for kw in (
    {}, dict(style="dream"), dict(history=3), dict(temperature=0.7))]
KLASS_IDS = ["llada-style", "dream-style", "history-3", "sampled"]


@pytest.mark.parametrize("dense", [pytest.param(False, marks=pytest.mark.slow), True])  # the CPU path: slow run
@pytest.mark.parametrize("sampler", KLASSES, ids=KLASS_IDS)
def test_klass_step_graphs_decode_what_the_eager_step_decodes(sampler, dense, monkeypatch):
    """KLASS's kept steps (their logits, log-normalisers and KL values) in the step graphs' bank: the tokens and
    records of the eager step, commits by stability among them, every KL computed at every step as on a GPU or only
    where a candidate is confident as on the CPU."""
    graphed = _graphed_as_eager("llada", sampler, dense, monkeypatch)
    assert any(any(r["klass_ready"]) for o in graphed for r in o.stats.trace), "no stable commit"


@pytest.mark.parametrize("sampler", KLASSES, ids=KLASS_IDS)
def test_klass_step_graphs_replay_what_they_captured(sampler):
    runs = traced_steps(random_model("llada"), sampler, calls=PROMPTS * 2, gen_length=32, block_length=16, steps=32)
    found = problems(runs)
    assert not found, "\n".join(found[:8])
    assert any(len({r.call for r in rs}) > 1 for rs in runs.values()), "no graph of the first call replayed"


#: Prophet's early commit at gaps random weights reach (it fires), over each span, both progress measures, greedy and
#: sampled: its window runs to the canvas end (``window_columns``)
PROPHETS = [Prophet(LLaDASampler(), early=3.0, mid=1.6, late=1.1, **kw) for kw in (
    {}, dict(span="masked", progress="decoded"), dict(span=(2, 6)), dict(temperature=0.7))]
PROPHET_IDS = ["region", "masked-decoded", "fixed-span", "sampled"]


@pytest.mark.parametrize("dense", [pytest.param(False, marks=pytest.mark.slow), True])  # the CPU path: slow run
@pytest.mark.parametrize("sampler", PROPHETS, ids=PROPHET_IDS)
def test_prophet_step_graphs_decode_what_the_eager_step_decodes(sampler, dense, monkeypatch):
    """Prophet's early commits from the step graphs: the tokens and records of the eager step (its early commits among
    them), every window column's gap computed as on a GPU or only the spans' as on the CPU."""
    graphed = _graphed_as_eager("llada", sampler, dense, monkeypatch)
    assert any(any(r["early_commit"]) for o in graphed for r in o.stats.trace), "it never fired"


@pytest.mark.parametrize("sampler", PROPHETS, ids=PROPHET_IDS)
def test_prophet_step_graphs_replay_what_they_captured(sampler):
    runs = traced_steps(random_model("llada"), sampler)
    found = problems(runs)
    assert not found, "\n".join(found[:8])
    assert any(len({r.call for r in rs}) > 1 for rs in runs.values()), "no graph of the first call replayed"


@pytest.mark.parametrize("cache", ["prefix", "dkv-decode", "freecache", "elastic"])
def test_step_graphs_with_other_caches(cache):
    for name in ("llada", "fast-dllm"):
        for a, b in zip(_decode(random_model("llada"), name, cache),
                        _decode(random_model("llada"), name, cache, step_graphs=False)):
            _same(a, b)
            assert a.stats.step_graphs.get("replays", 0) > 0


def test_step_graphs_with_records_and_eos_early_stop():
    """Commit log-probabilities, the top tokens' records and EOS early stop (a canvas rewritten, not in place)."""
    kw = dict(record_confidence=True, record_top_logprobs=3, eos_early_stop=True)
    for cache in ("none", "dual"):
        for a, b in zip(_decode(random_model("llada"), "fast-dllm", cache, **kw),
                        _decode(random_model("llada"), "fast-dllm", cache, step_graphs=False, **kw)):
            _same(a, b)
            assert a.stats.step_graphs.get("replays", 0) > 0


@pytest.mark.parametrize("sampler", ["fast-dllm", "credit"])
def test_interleaved_decodes_of_one_shape_keep_their_own_state(sampler):
    """Two decodes of one shape share the runner's bank: stepped in turn, each decodes what it decodes alone (the
    bank's last state keeps its values in tensors of its own when the other takes the bank over, CreditDecoding's
    tables among them)."""
    model = random_model("llada")
    config = dllm.GenerateConfig(gen_length=16, block_length=8, steps=16, graphs="on", seed=1)
    alone = [dllm.generate(model, p, sampler=sampler, cache="dual", config=config) for p in PROMPTS]
    decs = [Decoder(model, *resolve(model, sampler, "dual", None, config)) for _ in PROMPTS]
    states = [d.start(p) for d, p in zip(decs, PROMPTS)]
    going = [True, True]
    while any(going):
        for i, (d, st) in enumerate(zip(decs, states)):
            if going[i]:
                going[i] = d.step(st)
    for d, st, a in zip(decs, states, alone):
        out = d.output(st)
        d.release()
        _same(out, a)
    assert GraphRunner.of(model).tail_stats["replays"] > 0


def _structure(d: dict) -> dict:
    return {k: _structure(v) if isinstance(v, dict) else v for k, v in d.items()}


def _bank_tensors(bank) -> list:
    return [*bank.t.values(), *bank.slots.values(), bank.logits, bank.nfe, bank.no_rows]


def _cuda_capture(self, t, fn):
    """A step graph's capture as CUDA runs it, on the CPU: the body runs twice, the warm-up (this step's work) and the
    capture, whose Python runs again while its kernels do not (here: run through ``_tail_body``, traced where
    :func:`traced` traces, then the bank's tensors put back as the warm-up left them)."""
    t.captured = True
    out = fn()
    kept = _bank_tensors(t.keep)
    warm = [x.clone() for x in kept]
    self._tail_body(t, fn)
    for x, v in zip(kept, warm):
        x.copy_(v)
    return out


@pytest.fixture
def cuda_like(monkeypatch):
    """The step graphs' captures (:func:`_cuda_capture`) and replays with CUDA's Python, on the CPU: a replay runs
    the captured kernels and no Python (here: the body runs, then the sampler's scratch state is put back as it was
    before, its tensors advanced in place)."""
    def replay(self, t, fn):
        st = t.keep.owner()
        was = _structure(st.state)
        out = fn()
        st.state.clear()
        st.state.update(was)
        return out

    monkeypatch.setattr(GraphRunner, "_capture_tail", _cuda_capture)
    monkeypatch.setattr(GraphRunner, "_tail_body", replay)


@pytest.mark.parametrize("name", ["credit", "klass", "fast-dllm", "dream", "prophet"])
def test_step_graphs_decode_what_the_eager_step_decodes_with_cudas_python(name, cuda_like):
    """The eager step's tokens where a capture's Python runs twice and a replay's not at all: a sampler whose scratch
    state is made at its first step (CreditDecoding's tables) is captured making it, and its replays leave the state
    as the capture's body did."""
    for cache in ("none", "dual"):
        graphed = _decode(random_model("llada"), name, cache, calls=PROMPTS * 2)
        assert sum(o.stats.step_graphs.get("replays", 0) for o in graphed) > 0
        for a, b in zip(graphed, _decode(random_model("llada"), name, cache, calls=PROMPTS * 2, step_graphs=False)):
            _same(a, b)


def test_a_step_that_makes_the_scratch_state_is_captured_making_it():
    """CreditDecoding's first step makes its tables: the capture's second run of the body starts from the scratch
    state the key saw (none), not the one its warm-up left, so every replay of that key makes the tables again."""
    runs = traced_steps(random_model("llada"), "credit", calls=PROMPTS * 2)
    found = problems(runs)
    assert not found, "\n".join(found[:8])
    assert any(len({r.call for r in rs}) > 1 for rs in runs.values()), "no graph of the first call replayed"


def test_non_finite_logits_raise_from_a_replayed_step():
    """A replayed step's non-finite check names the row and step as the eager step does."""
    model = random_model("llada")
    calls = {"n": 0}

    def hook(_m, _args, out):
        calls["n"] += 1
        if calls["n"] > 4:
            out = out.clone()
            out[1, :, 5] = float("nan")
        return out

    handle = model.register_forward_hook(hook)
    try:
        with pytest.raises(dllm.NonFiniteLogitsError, match=r"step 5: row 1 at \[") as err:
            _decode(model, "fast-dllm", "none", calls=PROMPTS[:1])
    finally:
        handle.remove()
    assert err.value.rows == [1]
    assert GraphRunner.of(model).tail_stats["replays"] > 0


# ------------------------------------------------------------------------------------------------ replay safety


def _names(runner) -> dict[int, str]:
    names = {}
    for bank in runner.banks.values():
        for f, t in bank.t.items():
            names[t.untyped_storage().data_ptr()] = f"bank {f}"
        for f in ("logits", "nfe", "no_rows"):
            names[getattr(bank, f).untyped_storage().data_ptr()] = f"bank {f}"
    return names


def traced(model, run, calls: int) -> dict[int, list[Run]]:
    """Every captured step graph's runs (capture and replays, the CPU twin) traced, by graph, over ``run(i)`` for
    ``i`` below ``calls`` (decodes on ``model``'s graph path), on the path a CUDA run takes (no check is free; every
    window position computed; a capture's body run twice, the traced run the second: :func:`_cuda_capture`)."""
    runs: dict[int, list[Run]] = {}
    held = {}  # every graph traced, kept alive: an evicted graph's id is not reused for another
    call = {"n": 0}

    def body(self, t_, fn):
        names = _names(self)
        with SyncCounter() as syncs, OpTrace() as trace:
            out = fn()
        held[id(t_)] = t_
        runs.setdefault(id(t_), []).append(Run(call["n"], trace, syncs.where, names))
        return out

    saved = GEN._host_check_free, dllm_ops.dense_window, GraphRunner._tail_body, GraphRunner._capture_tail
    GEN._host_check_free, dllm_ops.dense_window, GraphRunner._tail_body, GraphRunner._capture_tail = (
        lambda t: False), (lambda l: True), body, _cuda_capture
    model.__dict__.pop("_dllm_graphs", None)  # a fresh runner
    try:
        for i in range(calls):
            call["n"] = i
            run(i)
    finally:
        GEN._host_check_free, dllm_ops.dense_window, GraphRunner._tail_body, GraphRunner._capture_tail = saved
    return runs


def traced_steps(model, name, caches=("none", "dual"), t=0.0, calls=PROMPTS, **kw):
    """:func:`traced` over a call of ``generate`` per prompt set of ``calls`` (two by default) and cache."""
    def run(i):
        cache, prompts = caches[i // len(calls)], calls[i % len(calls)]
        _decode(model, name, cache, calls=[prompts], t=t, **kw)

    return traced(model, run, len(caches) * len(calls))


def problems(runs) -> list[str]:
    return [p for key, rs in runs.items() for p in replay_problems(f"graph {key}", rs)]


@pytest.mark.parametrize("name,t", [("llada", 0.0), ("llada", 0.7), ("llada-random", 0.7), ("fast-dllm", 0.0),
                                    ("threshold", 0.7), ("factor", 0.0), ("localleap", 0.0), ("eb", 0.0),
                                    ("entropy-threshold", 0.0), ("ascending", 0.0), ("eoser-ass", 0.0),
                                    ("eoser", 0.7), ("adablock", 0.0), ("multiblock", 0.0), ("elastic", 0.0),
                                    ("credit", 0.0), ("credit", 0.7), ("prophet", 0.0), ("prophet", 0.7),
                                    ("klass", 0.0), ("klass", 0.7)])
def test_step_graphs_replay_what_they_captured(name, t):
    runs = traced_steps(random_model("llada"), name, t=t)
    found = problems(runs)
    assert not found, "\n".join(found[:8])
    replayed = [rs for rs in runs.values() if len(rs) >= 2]
    assert sum(len(rs) - 1 for rs in replayed) >= 2, "the check is vacuous"
    assert any(len({r.call for r in rs}) > 1 for rs in replayed), "no graph of the first call replayed in the second"
    for rs in replayed:  # the traces are the sampler's and the loop's: a selection and the canvas written
        assert "aten.where.self_out" in rs[0].trace.names() or "aten.where.self" in rs[0].trace.names()


def test_step_graphs_after_elastic_cache_forwards_replay_what_they_captured():
    """Elastic-Cache's speculative forwards (their parts resumed or redone after a read of the drift tests) before
    the step graph: every run of a step graph's key issues its capture's operators on its memory, across calls."""
    runs = traced_steps(random_model("llada"), "fast-dllm", caches=("elastic",))
    found = problems(runs)
    assert not found, "\n".join(found[:8])
    assert any(len({r.call for r in rs}) > 1 for rs in runs.values()), "no graph of the first call replayed"


@pytest.mark.slow  # the Triton interpreter (the default run keeps a Triton layer's graph replay safety)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_fused_confidence_step_graphs_replay_what_they_captured(monkeypatch):
    """The greedy proposal and its score from the Triton confidence kernel (the path ``fused="auto"`` takes on
    CUDA; here under the interpreter), inside the step graph: replay-safe, and the tokens of the eager step. The
    model's forwards run the reference kernels (under the interpreter they would take minutes, and the forwards'
    graphs are test_graph_replay_safety.py's)."""
    from dllm import kernels
    from dllm.kernels import triton_kernels

    monkeypatch.setattr(kernels, "confidence_stats", lambda logits, temperature=0.0, noise=None, exclude=None:
                        triton_kernels.confidence_stats(logits, temperature=temperature, noise=noise, exclude=exclude))
    calls = ([[5, 6, 7]], [[20, 21]])  # one row (a kernel's program per row takes the interpreter ~0.1 s), one canvas
    kw = dict(calls=calls, gen_length=8, block_length=8, steps=4)  # one window of 4 steps per call
    for sampler in (LLaDASampler(fused="on"), ComposedSampler(rule=Threshold(0.9), fused="on")):
        runs = traced_steps(random_model("llada"), sampler, caches=("dual",), **kw)
        found = problems(runs)
        assert not found, "\n".join(found[:8])
        assert sum(len(rs) - 1 for rs in runs.values()) >= 2 and any(len({r.call for r in rs}) > 1 for rs in runs.values())
        assert any(n.startswith("triton.") for rs in runs.values() for n in rs[0].trace.names())
        for a, b in zip(_decode(random_model("llada"), sampler, "dual", **kw),
                        _decode(random_model("llada"), sampler, "dual", step_graphs=False, **kw)):
            _same(a, b)


@dataclasses.dataclass(frozen=True)
class _CountsSteps(LLaDASampler):
    """A sampler that declares itself graph-safe but reads the loop's step count (a number a graph bakes in)."""

    def step(self, logits, ctx):
        res = super().step(logits, ctx)
        return dataclasses.replace(res, info={"late": ctx.step + ctx.global_step})


def test_the_check_sees_a_step_number_baked_in():
    runs = traced_steps(random_model("llada"), _CountsSteps(), caches=("none",))
    assert any("against" in p and "add" in p for p in problems(runs)), problems(runs)[:3]


def test_the_bank_is_handed_over_not_shared():
    """A state bound to a bank gives its tensors up (copies of them) when another state of its shape binds it."""
    model = random_model("llada")
    config = dllm.GenerateConfig(gen_length=16, block_length=8, steps=16, graphs="on", seed=1)
    d1, d2 = (Decoder(model, *resolve(model, "fast-dllm", "none", None, config)) for _ in range(2))
    s1, s2 = d1.start(PROMPTS[0]), d2.start(PROMPTS[1])
    d1.step(s1)
    bank = next(iter(GraphRunner.of(model).banks.values()))
    assert s1.x is bank.t["x"]
    before = s1.x.clone()
    d2.step(s2)
    assert s2.x is bank.t["x"] and s1.x is not bank.t["x"] and torch.equal(s1.x, before)
    assert isinstance(bank, _StepBank)


# ------------------------------------------------------------------------------------------------ served batches

SERVED = ["What is 12 + 30?", 'Reverse the list: ["Ann Lee", "Bob Stone"]', "What is 407 + 2185?"]


def _serve(model, sampler, cache, step_graphs=True):
    """Three waves of two requests into one engine (3 rows, the graph path): requests join running batches, leave
    them as they finish, and wait for room. Returns each request's tokens and the engine's stats."""
    from dllm.serve import Engine

    saved = Decoder.step_graphs
    Decoder.step_graphs = step_graphs
    try:
        eng = Engine(model, max_rows=3, graphs="on")
        hs = []
        for wave in range(3):
            for k in range(2):
                hs.append(eng.submit(SERVED[(k + wave) % 3], gen_length=16, block_length=8, sampler=sampler,
                                     cache=cache))
            for _ in range(3):
                eng.step()
        eng.run_until_idle()
        return [h.result(timeout=0).tokens for h in hs], eng.stats()
    finally:
        Decoder.step_graphs = saved


@pytest.mark.parametrize("sampler,cache", [("fast-dllm", None), ("threshold", "none"), ("adablock", "dual"),
                                           ("dream", "dual"), ("credit", "dual"), ("klass", "dual")])
def test_served_steps_replay_their_graphs_as_rows_join_and_leave(sampler, cache):
    """The serving engine's steps take the step graphs too: its batches change shape as requests join and leave
    (each shape its own bank and graphs), and a state's tensors are copied into a bank's where they are not its
    own. The tokens are the eager step's, every replay issues its capture's operators on its memory, and graphs
    captured for one engine's batches replay in the next engine's."""
    # its own model: the runner's graphs live on it
    model = dllm.load_model("dream-tiny" if sampler == "dream" else "llada-tiny", dtype="float32")
    eager, stats = _serve(model, sampler, cache, step_graphs=False)
    assert stats["step_graphs"] == {} and stats["joins"] > 0
    served = []
    runs = traced(model, lambda i: served.append(_serve(model, sampler, cache)), 2)
    for tokens, stats in served:
        assert tokens == eager
        assert stats["joins"] > 0 and stats["retried"] == 0
    found = problems(runs)
    assert not found, "\n".join(found[:8])
    assert served[0][1]["step_graphs"].get("replays", 0) > 0
    assert any(len({r.call for r in rs}) > 1 for rs in runs.values()), "no graph of the first engine replayed later"


# ------------------------------------------------------------------------------------------------ on CUDA

CUDA_PROMPTS = ["What is 12 + 30?", "Please reverse the order of the list:\n[\"Alice Adams\", \"Brian Baker\"]"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sampler,cache", [("llada", "dual"), ("fast-dllm", "dual"), ("eb", "none"), ("llada", "elastic"),
                                           ("adablock", "dual"), ("multiblock", "dual"), ("elastic", None),
                                           ("dream", "dual"), ("dream", "none"), ("credit", "dual"),
                                           ("prophet", "dual"), ("klass", "dual")])
def test_cuda_step_graphs_capture_and_decode_what_the_uncaptured_path_decodes(sampler, cache):
    """Real captures of the step graphs (bf16): no capture fails, a later call replays what the earlier ones
    captured (a key is captured the second time it is seen), and every call decodes the uncaptured graph path's
    tokens, commit steps and forwards (its twin: the same kernels run instead of replayed)."""
    from test_graphs import uncaptured

    model = dllm.load_model("dream-tiny" if sampler == "dream" else "llada-tiny", device="cuda", dtype="bfloat16")
    kw = dict(gen_length=32, block_length=8, steps=32, sampler=sampler, cache=cache, record_confidence=True)
    twin = uncaptured(model, CUDA_PROMPTS, **kw)
    outs = [dllm.generate(model, CUDA_PROMPTS, graphs="auto", **kw) for _ in range(3)]
    assert not any("capture failed" in k for o in outs for k in o.stats.step_graphs), [o.stats.step_graphs for o in outs]
    assert sum(o.stats.step_graphs.get("captures", 0) for o in outs) >= 1, outs[0].stats.step_graphs
    assert outs[2].stats.step_graphs.get("replays", 0) >= 4, outs[2].stats.step_graphs
    for out in outs:
        assert torch.equal(out.sequences, twin.sequences)
        for f in ("commit_step", "finish_step", "row_nfe", "nfe", "commit_logprob"):
            assert repr(getattr(out.stats, f)) == repr(getattr(twin.stats, f)), f
    torch.rand(4, device="cuda")  # the device's random generator is usable after the captures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_served_step_graphs_capture_and_every_request_finishes():
    """The serving engine on CUDA with real step graphs: rows join and leave, no capture fails, replays happen and
    every request finishes (that an answer is the request's alone is the CPU tests', in float32)."""
    from dllm.serve import Engine

    model = dllm.load_model("llada-tiny", device="cuda", dtype="bfloat16")
    eng = Engine(model, max_rows=3, graphs="auto")
    kw = dict(gen_length=32, block_length=8, sampler="llada", cache="dual")
    hs = []
    for wave in range(3):
        hs.append(eng.submit(CUDA_PROMPTS[wave % 2], **kw))
        for _ in range(2):
            eng.step()
    eng.run_until_idle()
    s = eng.stats()
    assert s["joins"] > 0 and s["retried"] == 0, s
    assert not any("capture failed" in k for k in s["step_graphs"]) and s["step_graphs"].get("replays", 0) >= 4, s
    for h in hs:
        assert h.result(timeout=0).finish_reason in ("stop", "length")
    # a batch of 3 rows and then one of 4 in a bucket of 4: the second's forwards, its blocks' full forwards among
    # them (spare rows copies of row 0), replay the first's captures
    eng = Engine(model, max_rows=4, graphs="auto")
    for n in (3, 4):
        was = Counter(eng.stats()["graphs"])
        hs = [eng.submit(CUDA_PROMPTS[0], **kw) for _ in range(n)]
        eng.run_until_idle()
    now = Counter(eng.stats()["graphs"]) - was
    assert not any("capture failed" in k for k in eng.stats()["graphs"]), eng.stats()["graphs"]
    assert now["full replays"] >= 1 and set(now) == {"full replays", "replays"}, now  # every forward a replay
    assert all(h.result(timeout=0).finish_reason in ("stop", "length") for h in hs)
