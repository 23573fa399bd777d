"""The serving engine's progress check is each row's own: a batch that lives on because requests keep joining it
is not a batch that makes no progress (it once failed with "decoding made no progress after 136 steps" under a
flood, its requests retried alone), and a row that truly commits nothing still fails alone."""

from __future__ import annotations

import dataclasses

import pytest

import dllm
from dllm.samplers.llada import LLaDASampler
from dllm.serve import Engine

G = 4  # gen_length = block_length = steps: each request takes 4 forwards; one batch from start to end may take
LIMIT = 4 * (G + G) + 8  # Decoder.start's limit: 40 forwards


@pytest.fixture(scope="module")
def llada():
    return dllm.load_model("llada-tiny", dtype="float32")


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_a_batch_that_requests_keep_joining_outlives_the_one_batch_limit(graphs, llada):
    """Requests join one batch every other tick, so it never empties and takes more forwards than one batch decoded
    from start to end may: no batch fails, nothing is retried, and every answer equals the request decoded alone."""
    eng = Engine(llada, max_rows=2, graphs=graphs)
    handles = []
    ticks = LIMIT + 12
    for t in range(ticks):
        if t % 2 == 0:
            prompt = f"What is {t} + 30?"
            handles.append((prompt, eng.submit(prompt, gen_length=G, block_length=G, seed=0)))
        eng.step()
        assert len(eng.groups) == 1  # the same batch all along: it never emptied
    group = next(iter(eng.groups.values()))
    assert group.state.nfe >= ticks > LIMIT  # the batch's forwards, beyond what one batch alone may take
    eng.run_until_idle()
    stats = eng.stats()
    assert stats["retried"] == 0 and stats["engine_errors"] == 0
    assert stats["joins"] >= len(handles) - 2
    for prompt, h in handles:
        r = h.result(timeout=0)
        out = dllm.generate(llada, [prompt], cache="none", gen_length=G, block_length=G, seed=0)
        assert r.finish_reason in ("stop", "length") and r.error is None
        assert r.tokens == out.sequences[0].tolist()
        assert r.nfe == out.stats.row_nfe[0] == G


def test_a_row_that_commits_nothing_still_fails_alone(llada, monkeypatch):
    """The engine's own per-row check: a row whose sampler commits nothing ends with an error after its own limit of
    forwards (the engine does not hang on it); its neighbour, a request with other settings, is answered."""
    step = LLaDASampler.step

    def stuck(self, logits, ctx):
        res = step(self, logits, ctx)
        if ctx.steps.max() == 3:  # only the request with steps=3 (gen_length 4): it never commits
            res = dataclasses.replace(res, commit=res.commit & False)
        return res

    monkeypatch.setattr(LLaDASampler, "step", stuck)
    eng = Engine(llada, max_rows=2)
    bad = eng.submit("What is 1 + 30?", gen_length=G, block_length=G, steps=3, seed=0)
    good = eng.submit("What is 2 + 30?", gen_length=G, block_length=G, seed=0)
    for _ in range(LIMIT + 8):
        if not eng.step():
            break
    assert not eng.pending()
    r = bad.result(timeout=0)
    assert r.finish_reason == "error" and "no progress after" in r.error
    assert good.result(timeout=0).finish_reason in ("stop", "length")
