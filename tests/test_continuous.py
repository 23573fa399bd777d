"""Continuous batching in ``dllm.generate`` (``max_rows``): rows leave the batch at the step they finish and the next
prompts take their places, and every row decodes what it decodes in one batch of all the prompts: its tokens, commit
steps, finishing step, forwards and commit records, whatever the samplers, caches, model families and paths."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from conftest import ragged_prompts, random_model

import dllm
from dllm.assets import model_path
from dllm.models import load_model
from dllm.samplers import get_sampler

PROMPTS = ["What is 407 + 2185?", 'Copy the list: ["Ann Lee"]', "Name three colours.", "Hi",
           "Sort 3 1 2 please, then explain why.", "Count to five."]


@pytest.fixture(scope="module")
def tiny():
    return load_model(model_path("llada-tiny"))


@pytest.fixture(scope="module")
def dream_tiny():
    return load_model(model_path("dream-tiny"))


def same_rows(a, b) -> None:
    """``b`` (continuous) gives every row what ``a`` (one batch) gives it."""
    assert torch.equal(a.sequences, b.sequences)
    assert a.texts == b.texts and a.prompt_lengths == b.prompt_lengths
    sa, sb = a.stats, b.stats
    assert sb.commit_step == sa.commit_step
    assert sb.finish_step == sa.finish_step
    assert sb.row_nfe == sa.row_nfe
    assert sb.commit_top_ids == sa.commit_top_ids
    # the log-probabilities: to float rounding (the model's products differ in shape with the batch)
    lp_a, lp_b = torch.tensor(sa.commit_logprob), torch.tensor(sb.commit_logprob)
    assert torch.allclose(lp_a, lp_b, atol=1e-5, equal_nan=True)
    # every row the batch's forwards computed was decoding: none finished stays in the batch
    assert sb.row_forwards == sum(sb.row_nfe)
    assert sb.trace == []


CASES = [("llada", "none"), ("fast-dllm", "dual"), ("threshold", "prefix"), ("credit", "dual"), ("klass", "dual"),
         ("prophet", "dual"), ("adablock", "none"), ("multiblock", "none"), ("eoser", "dkv-decode"),
         ("localleap", "freecache"), ("fast-dllm", "elastic"), ("dream", "dual"), ("guided", "none")]


@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("sampler,cache", CASES)
def test_rows_decode_as_in_one_batch(tiny, dream_tiny, sampler, cache, graphs):
    model = dream_tiny if sampler.startswith("dream") else tiny
    kw = dict(sampler=sampler, cache=cache, gen_length=32, block_length=8, seed=3, eos_early_stop=True,
              record_confidence=True, record_top_logprobs=2)
    whole = dllm.generate(model, PROMPTS, graphs="off", **kw)
    for R in (2, 4):
        out = dllm.generate(model, PROMPTS, graphs=graphs, max_rows=R, **kw)
        same_rows(whole, out)
        # never more than R rows in a forward, and fewer of them than the batch of every prompt computed
        assert out.stats.nfe * R >= out.stats.row_forwards
    assert whole.stats.row_forwards == whole.stats.nfe * len(PROMPTS)


@pytest.mark.parametrize("sampler,cache", [("llada", "none"), ("fast-dllm", "dual"), ("fast-dllm", "elastic"),
                                           ("llada", "dkv-decode")])
def test_guided_rows_move_with_both_copies_of_the_cache(tiny, sampler, cache):
    """Classifier-free guidance doubles the forward's batch (conditional and unconditional rows): a cache's buffers
    hold both copies, and both move with the rows."""
    kw = dict(sampler=sampler, cache=cache, gen_length=32, block_length=8, cfg_scale=1.0, eos_early_stop=True)
    whole = dllm.generate(tiny, PROMPTS, **kw)
    out = dllm.generate(tiny, PROMPTS, max_rows=2, **kw)
    assert torch.equal(whole.sequences, out.sequences) and whole.stats.commit_step == out.stats.commit_step


def test_rows_leave_a_batch_of_every_prompt(tiny):
    """``max_rows`` at least the prompts: no row joins, finished rows leave; the rows computed are only those
    decoding, where the one batch kept its finished rows to the end."""
    kw = dict(sampler="fast-dllm", gen_length=32, block_length=8, eos_early_stop=True)
    whole = dllm.generate(tiny, PROMPTS, **kw)
    out = dllm.generate(tiny, PROMPTS, max_rows=len(PROMPTS), **kw)
    assert torch.equal(whole.sequences, out.sequences) and whole.stats.commit_step == out.stats.commit_step
    assert out.stats.nfe == whole.stats.nfe  # the same forwards: the last row to finish takes as many
    assert len(set(whole.stats.finish_step)) > 1  # rows finish at different steps here
    assert out.stats.row_forwards == sum(whole.stats.row_nfe) < whole.stats.row_forwards
    assert out.stats.own_logits_columns == out.stats.logits_columns
    assert whole.stats.own_logits_columns < whole.stats.logits_columns


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_one_row_at_a_time_is_each_prompt_alone(tiny, graphs):
    """Every row finishes alone: each next prompt starts a batch of its own (the cache taken again)."""
    kw = dict(sampler="fast-dllm", gen_length=16, block_length=8, seed=5, graphs=graphs)
    out = dllm.generate(tiny, PROMPTS[:3], max_rows=1, **kw)
    for i, p in enumerate(PROMPTS[:3]):
        alone = dllm.generate(tiny, [p], **kw)
        assert torch.equal(out.sequences[i], alone.sequences[0])
        assert out.stats.commit_step[i] == alone.stats.commit_step[0]
    assert out.stats.nfe == sum(out.stats.row_nfe)


def test_row_ids_key_the_streams_as_in_one_batch():
    """Sampled decoding (temperature): each row's draws come from its own stream, keyed by its id or by default by
    its prompt and how many identical prompts come before it in the call, whenever it joins."""
    tiny = random_model("llada")
    a, b, c = ragged_prompts(3)
    prompts = [a, b, a, c, a]
    kw = dict(gen_length=16, block_length=8, seed=11)
    for ids in (None, ["a", "b", "c", "d", "e"]):
        whole = dllm.generate(tiny, prompts, sampler=get_sampler("llada", temperature=1.0), row_ids=ids, **kw)
        out = dllm.generate(tiny, prompts, sampler=get_sampler("llada", temperature=1.0), row_ids=ids, max_rows=2,
                            **kw)
        assert torch.equal(whole.sequences, out.sequences)
    assert not torch.equal(whole.sequences[0], whole.sequences[2])  # identical prompts, their own streams


@pytest.mark.parametrize("name", ["sdar-tiny", "llada2-tiny", "fastdllm2-tiny"])
def test_block_diffusion_rows_join_and_leave_the_block_cache(name):
    model = load_model(model_path(name))
    kw = dict(gen_length=32, seed=1, eos_early_stop=True)
    whole = dllm.generate(model, PROMPTS[:5], **kw)
    assert whole.stats.cache == "block"
    out = dllm.generate(model, PROMPTS[:5], max_rows=2, **kw)
    assert torch.equal(whole.sequences, out.sequences) and whole.stats.commit_step == out.stats.commit_step
    assert out.stats.row_nfe == whole.stats.row_nfe


def test_a_non_finite_row_is_named_by_its_prompt():
    """The error names the caller's row (its index among the prompts), not its place in the batch it joined."""
    model = random_model("llada")
    prompts = [[10, 11, 12], [20, 21], [30, 31, 32, 33], [40, 41], [50, 51, 52]]

    def hook(_m, args, out):
        bad = (args[0] == 40).any(-1)  # the rows holding prompt 3
        if bad.any():
            out = out.clone()
            out[bad] = float("nan")
        return out

    handle = model.register_forward_hook(hook)
    try:
        with pytest.raises(dllm.NonFiniteLogitsError, match=r"row 3 at \[") as err:
            dllm.generate(model, prompts, gen_length=8, block_length=8, steps=8, max_rows=2)
    finally:
        handle.remove()
    assert err.value.rows == [3]


def test_bad_settings_are_refused_before_decoding(tiny, monkeypatch):
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_rows must be a positive integer"):
            dllm.generate(tiny, PROMPTS[:2], gen_length=8, max_rows=bad)
    calls = []
    monkeypatch.setattr(importlib.import_module("dllm.generate"), "prepare_prompts", lambda *a, **k: calls.append(a))
    with pytest.raises(ValueError, match="noise_scope='row'"):
        dllm.generate(tiny, PROMPTS[:2], gen_length=8, max_rows=2,
                      sampler=get_sampler("llada", temperature=1.0, noise_scope="region"))
    assert calls == []  # refused before the prompts are read


def test_a_prompt_too_long_is_refused_before_the_first_decodes(tiny, monkeypatch):
    """The last prompt would join late: its length is checked with every other's before any forward."""
    steps = []
    monkeypatch.setattr(importlib.import_module("dllm.generate").Decoder, "step", lambda self, st: steps.append(1))
    long = [7] * (tiny.max_seq_len - 8)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        dllm.generate(tiny, [[7, 8, 9]] * 3 + [long], gen_length=16, max_rows=2)
    assert steps == []


def test_evaluations_decode_the_same_with_continuous_batching(tiny, tmp_path):
    """eval-tasks and dllm eval with ``continuous``: the same outputs, scores and forwards per sample."""
    from dllm.evals.runner import evaluate_tasks
    from dllm.evals.standard import build_prompts, get_standard_task, load_samples
    from dllm.evals.standard.runner import run_standard_eval

    cfg = dllm.GenerateConfig(gen_length=16, block_length=8, eos_early_stop=True)
    a, b = (evaluate_tasks(tiny, ["waiting_line/copy"], 6, 1, cfg, sampler="fast-dllm", batch_size=2,
                           continuous=c)[0] for c in (False, True))
    assert [s["prediction"] for s in a.samples] == [s["prediction"] for s in b.samples]
    assert (a.score, a.nfe) == (b.score, b.nfe)

    task = get_standard_task("gsm8k")
    fixtures = Path(__file__).resolve().parent / "fixtures" / "eval" / "gsm8k.jsonl"
    samples, pool = load_samples(task, str(fixtures), shots=1)
    samples = samples[:4]
    prompts = build_prompts(task, samples, pool, 1)
    lines = []
    for c in (False, True):
        out = tmp_path / str(c)
        run_standard_eval(tiny, task, samples, cfg, out, prompts=prompts, sampler="fast-dllm", batch_size=2,
                          continuous=c)
        lines.append([{k: v for k, v in ln.items() if k in ("id", "output", "correct", "nfe")}
                      for ln in map(json.loads, (out / "samples.jsonl").read_text().splitlines())])
    assert lines[0] == lines[1]
