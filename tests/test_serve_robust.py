"""No request can stop the serving engine: random schedules of submits, cancellations, client timeouts,
steps and failing batches, over mixed samplers, caches and lengths; every request is answered exactly once,
the ones not cancelled with their solo ``dllm.generate`` output, and no row is left behind."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

import dllm
from dllm.generate import Decoder, prepare_prompts
from dllm.serve import Engine

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PROMPTS = ["What is 12 + 30?", 'Please copy the list exactly: ["Ann Lee", "Bob Stone"]',
           'Reverse the list: ["Kevin Irving", "Ann Lee", "Paula Parker"]', "What is 407 + 2185?"]
# (sampler, params, gen_length, block_length, cache, seed)
SETTINGS = [
    ("llada", {}, 2, None, "none", 0),
    ("llada", {"temperature": 0.8}, 4, None, "prefix", 3),
    ("threshold", {}, 8, 4, "dual", 0),
    ("threshold", {"temperature": 0.8}, 8, 4, "none", 7),
    ("credit", {}, 8, 4, "none", 0),
    ("fast-dllm", {}, 8, 4, None, 0),  # its own cache (dual)
    ("eb", {"gamma": 0.1}, 4, None, "dkv-decode", 0),
]


@functools.cache
def _model():
    return dllm.load_model("llada-tiny", dtype="float32")


@functools.cache
def _solo(k: int, p: int) -> tuple[tuple[int, ...], int]:
    sampler, params, G, B, cache, seed = SETTINGS[k]
    out = dllm.generate(_model(), [PROMPTS[p]], sampler=dllm.get_sampler(sampler, **params), gen_length=G,
                        block_length=B, cache=cache, seed=seed)
    return tuple(out.sequences[0].tolist()), out.stats.row_nfe[0]


def _submit(eng: Engine, k: int, p: int):
    sampler, params, G, B, cache, seed = SETTINGS[k]
    return eng.submit(PROMPTS[p], gen_length=G, block_length=B, sampler=sampler, params=params, cache=cache,
                      seed=seed)


def test_a_cancelled_request_alone_in_its_batch_one_step_from_done_leaves_the_engine_serving():
    """The disconnect that killed the engine: the dropped batch must not be stepped again."""
    e = Engine(_model())
    h = e.submit("What is 12 + 30?", gen_length=2)
    e.step()
    h.cancel()
    e.step()
    assert h.result(timeout=0).finish_reason == "cancelled"
    assert not e.groups and e.stats()["running"] == 0 and e.stats()["engine_errors"] == 0
    h2 = e.submit("What is 12 + 30?", gen_length=2)
    e.run_until_idle()
    out = dllm.generate(_model(), ["What is 12 + 30?"], gen_length=2)
    assert h2.result(timeout=0).tokens == out.sequences[0].tolist()
    assert h.finishes == 1 and h2.finishes == 1


_SUBMIT = st.tuples(st.just("submit"), st.integers(0, len(SETTINGS) - 1), st.integers(0, len(PROMPTS) - 1))
_STEP = st.tuples(st.just("step"))
ACTIONS = st.one_of(  # submits and steps weighted up, so batches form, join, fill and drain
    _SUBMIT, _SUBMIT, _SUBMIT, _STEP, _STEP, _STEP,
    st.tuples(st.just("cancel"), st.integers(0, 63)),
    st.tuples(st.just("timeout"), st.integers(0, 63)),
    st.tuples(st.just("fail"), st.integers(0, 63)),  # a batch's next forward raises once
    st.tuples(st.just("fail_join")),  # the next merge into a running batch raises once
    st.tuples(st.just("poison"), st.integers(0, len(PROMPTS) - 1)),  # every forward holding this prompt raises
)


@functools.cache
def _prompt_ids(p: int) -> tuple[int, ...]:
    return tuple(prepare_prompts(_model(), [PROMPTS[p]], None, True)[0])


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(ACTIONS, min_size=6, max_size=40), st.integers(1, 4), st.integers(1, len(SETTINGS)))
def test_random_schedules_answer_every_request_once_exactly_and_free_every_row(schedule, max_rows, spread):
    """A failing batch is dropped and its requests retried alone: only the request whose own forward fails
    (a poisoned prompt) or one that was alone in a failing batch ends with an error; every other request not
    cancelled gets exactly its solo output."""
    eng = Engine(_model(), max_rows=max_rows)
    reqs = []  # (handle, setting, prompt)
    cancelled, alone_when_failed, poisoned = set(), set(), set()
    join_faults, fired = [], []
    real_join = eng._join

    def join(key, group, newcomers, dec, state):
        if group is not None and join_faults:
            fired.append(join_faults.pop())
            raise RuntimeError("device lost")
        return real_join(key, group, newcomers, dec, state)

    eng._join = join
    real_step = Decoder.step

    def step(self, state):
        if any(tuple(r) in poisoned for r in state.rows):
            raise FloatingPointError("non-finite logits")
        return real_step(self, state)

    Decoder.step = step
    try:
        for action in schedule:
            if action[0] == "submit":
                k = action[1] % spread  # few settings: bigger batches
                reqs.append((_submit(eng, k, action[2]), k, action[2]))
            elif action[0] == "step":
                eng.step()
            elif action[0] in ("cancel", "timeout") and reqs:
                h = reqs[action[1] % len(reqs)][0]
                if action[0] == "timeout":  # a client that stops waiting cancels its request
                    try:
                        h.result(timeout=0)
                        continue
                    except TimeoutError:
                        pass
                h.cancel()
                cancelled.add(h.request_id)
            elif action[0] == "fail_join":
                join_faults.append(True)
            elif action[0] == "poison":
                poisoned.add(_prompt_ids(action[1]))
            elif action[0] == "fail" and eng.groups:
                group = list(eng.groups.values())[action[1] % len(eng.groups)]

                def boom(state, group=group):
                    if len(group.requests) == 1:  # alone in its batch when the fault fires: it fails
                        alone_when_failed.add(group.requests[0].request_id)
                    raise RuntimeError("device lost")

                group.decoder.step = boom
        for _ in range(1000):
            if not eng.step():
                break
    finally:
        Decoder.step = real_step
    assert not eng.groups and not eng.waiting
    s = eng.stats()
    assert s["running"] == 0 and s["waiting"] == 0
    assert s["engine_errors"] == len(fired)  # only the injected merge faults
    for h, _, _ in reqs:  # what the schedules exercised (pytest --hypothesis-show-statistics)
        event(f"outcome: {h.result(timeout=0).finish_reason}")
    event(f"requests retried alone: {s['retried'] > 0}")
    for h, k, p in reqs:
        assert h.finishes == 1, h.request_id
        r = h.result(timeout=0)
        tokens, nfe = _solo(k, p)
        if r.finish_reason == "cancelled":
            assert h.request_id in cancelled
            assert tuple(r.tokens) == tokens[:len(r.tokens)]  # what was final so far
        elif r.finish_reason == "error":
            assert ("non-finite" in r.error and _prompt_ids(p) in poisoned) or (
                h.request_id in alone_when_failed and "device lost" in r.error), (h.request_id, r.error)
        else:
            assert tuple(r.tokens) == tokens and r.nfe == nfe, (h.request_id, SETTINGS[k])
            assert r.finish_reason in ("stop", "length")


def test_a_request_whose_forward_fails_ends_alone_and_its_batch_mates_get_their_exact_answers(monkeypatch):
    eng = Engine(_model(), max_rows=4)
    hs = [eng.submit(PROMPTS[p], gen_length=16, block_length=8, sampler="llada") for p in range(3)]

    def streamed_so_far(h):
        return sum(len(v) for kind, v in h._log if kind == "ids")

    for _ in range(8):  # until a batch mate has streamed part of its answer
        eng.step()
        if streamed_so_far(hs[0]) or streamed_so_far(hs[2]):
            break
    assert streamed_so_far(hs[0]) or streamed_so_far(hs[2])
    assert len(eng.groups) == 1 and len(next(iter(eng.groups.values())).requests) == 3
    bad = _prompt_ids(1)
    real_step = Decoder.step

    def step(self, state):
        if any(tuple(r) == bad for r in state.rows):
            raise FloatingPointError("non-finite logits")
        return real_step(self, state)

    monkeypatch.setattr(Decoder, "step", step)
    streamed = {i: [] for i in range(3)}
    eng.run_until_idle()
    for i, h in enumerate(hs):
        for ids in h.delta_ids():
            streamed[i] += ids
    assert hs[1].result(timeout=0).finish_reason == "error" and "non-finite" in hs[1].result().error
    for i in (0, 2):
        out = dllm.generate(_model(), [PROMPTS[i]], gen_length=16, block_length=8, sampler="llada")
        r = hs[i].result(timeout=0)
        assert r.tokens == out.sequences[0].tolist() and r.nfe == out.stats.row_nfe[0]
        assert streamed[i] == r.tokens  # nothing streamed twice after the restart
    assert eng.stats()["retried"] == 3 and eng.stats()["engine_errors"] == 0


def test_a_failing_tick_fails_its_requests_and_the_background_loop_keeps_serving(monkeypatch):
    eng = Engine(_model())
    real = eng._admit
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 1:
            with eng._lock:
                held = list(eng.waiting)
            if held:
                raise RuntimeError("bookkeeping bug")
        return real()

    monkeypatch.setattr(eng, "_admit", flaky)
    h = eng.submit(PROMPTS[0], gen_length=4)
    eng.start()
    try:
        r = h.result(timeout=30)
        assert r.finish_reason == "error" and "internal error" in r.error
        assert eng.alive() and eng.stats()["engine_errors"] == 1
        h2 = eng.submit(PROMPTS[0], gen_length=4)
        assert h2.result(timeout=30).tokens == dllm.generate(_model(), [PROMPTS[0]], gen_length=4).sequences[0].tolist()
    finally:
        eng.stop()
    assert not eng.alive()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_stop_never_waits_on_a_dead_engine_and_its_requests_are_answered(monkeypatch):
    eng = Engine(_model())

    def die():
        raise SystemExit("thread killed")  # not an Exception: the loop ends

    monkeypatch.setattr(eng, "step", die)
    h = eng.submit(PROMPTS[0], gen_length=4)
    eng.start()
    r = h.result(timeout=30)  # answered, not left waiting
    assert r.finish_reason == "error"
    for _ in range(100):
        if not eng.alive():
            break
        time.sleep(0.01)
    assert not eng.alive()
    eng.submit(PROMPTS[1], gen_length=4)  # queued after the loop died: stop() must not wait for it
    t0 = time.monotonic()
    eng.stop(drain=True)
    assert time.monotonic() - t0 < 5


def test_async_waiters_hold_no_thread_and_see_every_event():
    """Thousands of awaiting clients cost no worker threads: they are woken through their event loop."""
    import asyncio

    eng = Engine(_model(), max_rows=4)
    eng.start()
    try:
        async def main():
            before = threading.active_count()
            handles = [eng.submit(PROMPTS[i % 4], gen_length=8, block_length=4, sampler="threshold")
                       for i in range(8)]
            tasks = [asyncio.ensure_future(h.aresult()) for h in handles]
            await asyncio.sleep(0.05)
            during = threading.active_count()
            results = await asyncio.gather(*tasks)
            return handles, results, before, during

        handles, results, before, during = asyncio.run(main())
        assert during <= before + 1
        for i, r in enumerate(results):
            out = dllm.generate(_model(), [PROMPTS[i % 4]], gen_length=8, block_length=4, sampler="threshold")
            assert r.tokens == out.sequences[0].tolist()
    finally:
        eng.stop()
    assert torch.is_grad_enabled()
