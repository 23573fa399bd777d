"""The decode loop: prompt forms, statistics, EOS early stop, independent rows, CFG."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ragged_prompts, random_model

import dllm


def test_tensor_with_mask_equals_ragged_lists(family):
    model = random_model(family)
    prompts = ragged_prompts(3)
    P = max(map(len, prompts))
    ids = torch.zeros(3, P, dtype=torch.long)
    mask = torch.zeros(3, P, dtype=torch.long)
    for b, p in enumerate(prompts):  # right padding on purpose: generate re-pads on the left
        ids[b, : len(p)] = torch.tensor(p)
        mask[b, : len(p)] = 1
    a = dllm.generate(model, prompts, gen_length=8, steps=8)
    b = dllm.generate(model, ids, attention_mask=mask, gen_length=8, steps=8)
    assert torch.equal(a.sequences, b.sequences)


def test_stats_are_consistent(family):
    model = random_model(family)
    out = dllm.generate(model, ragged_prompts(3), gen_length=16, block_length=8, steps=8, sampler="llada")
    s = out.stats
    assert s.nfe == 8 and s.row_nfe == [8, 8, 8] and s.finish_step == [8, 8, 8]
    assert s.tokens_per_forward == 2.0
    assert len(s.trace) == 8
    per_row = torch.tensor([rec["committed"] for rec in s.trace]).sum(0)
    assert per_row.tolist() == [16, 16, 16]
    assert s.trace[0]["lo"] == [9, 9, 9] and s.trace[0]["hi"] == [17, 17, 17]  # prompt width 9, block 8
    assert s.trace[-1]["lo"] == [17, 17, 17]
    assert s.time_total >= s.time_model + s.time_sampler > 0
    assert s.logits_columns == s.own_logits_columns == 8 * 3 * 8  # rows in step: every column is a row's own


def test_rows_out_of_step_compute_their_own_logits_columns_or_the_unions():
    """``stats.logits_columns``: the (row, column) logits the steps computed; ``own_logits_columns``: those in each
    row's own window. With a confidence threshold each row leaves its blocks at its own step, so the rows of a batch
    sit in different blocks. The threshold sampler takes per-row windows (``SamplerBase.row_windows``): each row's
    logits are its own block's 8 columns at every step, the batch's own columns what the rows compute alone. Prophet
    widens the window to the canvas end: every row is computed over the union of the rows' windows, more than its own."""
    model = dllm.load_model("llada-tiny")
    prompts = ['Reverse the list: ["Kevin Irving", "Ann Lee", "Paula Parker"]', "What is 407 + 2185?",
               "Fill in the Latin square with the symbols A, B, C, D.", 'Copy the list: ["Ann Lee"]']
    for sampler in ("threshold", "prophet"):
        kw = dict(sampler=sampler, gen_length=32, block_length=8)
        batch = dllm.generate(model, prompts, **kw).stats
        alone = [dllm.generate(model, [p], **kw).stats for p in prompts]
        assert all(a.logits_columns == a.own_logits_columns > 0 for a in alone)
        assert batch.own_logits_columns == sum(a.own_logits_columns for a in alone)
        assert len({tuple(lo) for lo in (r["lo"] for r in batch.trace)}) > 1 and \
            any(len(set(r["lo"])) > 1 for r in batch.trace)  # rows in different blocks at a step
        if sampler == "threshold":
            assert batch.logits_columns == 4 * 8 * batch.nfe  # each row its block's 8 columns, finished or not
        else:
            assert batch.logits_columns > batch.own_logits_columns


def test_which_samplers_and_policies_take_per_row_windows():
    """Per-row windows (``Decoder.row_windows``) where the sampler declares them and no hook needs the batch's window:
    the baselines, the composed samplers with a stateless rule (CreditDecoding's tables too), KLASS (its kept steps at
    each row's columns), AdaBlock's refine; not Prophet (its window widened to the canvas end) or a sampler drawing the
    run's shared random stream."""
    from dllm.config import GenerateConfig
    from dllm.generate import Decoder
    from dllm.recipes import resolve
    from dllm.samplers import get_sampler

    model = dllm.load_model("llada-tiny")
    config = GenerateConfig(gen_length=32, block_length=8)
    got = {}
    for name in ("llada", "threshold", "fast-dllm", "credit", "localleap", "eoser-ass", "adablock", "elastic",
                 "klass", "multiblock", "prophet"):
        got[name] = Decoder(model, *resolve(model, name, None, None, config)).row_windows
    got["llada shared stream"] = Decoder(model, *resolve(model, get_sampler("llada", temperature=0.5,
                                                                             noise_scope="region"),
                                                         None, None, config)).row_windows
    assert got == {"llada": True, "threshold": True, "fast-dllm": True, "credit": True, "localleap": True,
                   "eoser-ass": True, "adablock": True, "elastic": True, "klass": True, "multiblock": True,
                   "prophet": False, "llada shared stream": False}


def test_per_row_windows_give_each_row_what_it_decodes_alone_with_its_records():
    """Per-row windows (the threshold sampler's, rows in different blocks): each row's tokens, forwards, commit steps,
    committed tokens' log-probabilities and top alternatives are those it gets alone, eager and on the step graphs'
    path (the CPU's twin of the CUDA graphs), with the dual cache and without. The step graph of per-row windows is
    keyed by the window's width alone: one graph serves every block of a generation (the union window's graphs are
    one per window)."""
    model = dllm.load_model("llada-tiny")
    prompts = ["What is 407 + 2185?", 'Copy the list: ["Ann Lee"]', "Name three colours."]
    for cache, graphs in (("dual", "on"), ("none", "off")):
        kw = dict(sampler="threshold", cache=cache, gen_length=32, block_length=8, graphs=graphs,
                  record_confidence=True, record_top_logprobs=2)
        batch = dllm.generate(model, prompts, **kw)
        assert any(len(set(r["lo"])) > 1 for r in batch.stats.trace)  # rows out of step
        for b, p in enumerate(prompts):
            one = dllm.generate(model, [p], **kw)
            n = one.sequences.shape[1]
            assert batch.sequences[b, -n:].tolist() == one.sequences[0].tolist()
            assert batch.stats.row_nfe[b] == one.stats.row_nfe[0]
            assert batch.stats.commit_step[b][-32:] == one.stats.commit_step[0][-32:]
            # the values up to float rounding: the model's products differ in shape with the batch
            assert batch.stats.commit_logprob[b][-32:] == pytest.approx(one.stats.commit_logprob[0][-32:], abs=1e-4)
            assert batch.stats.commit_top_ids[b][-32:] == one.stats.commit_top_ids[0][-32:]
            assert torch.allclose(torch.tensor(batch.stats.commit_top_logprobs[b][-32:]),
                                  torch.tensor(one.stats.commit_top_logprobs[0][-32:]), atol=1e-4, equal_nan=True)
        if graphs == "on":
            steps = batch.stats.step_graphs
            assert steps.get("captures") == 1 and steps["replays"] >= batch.stats.nfe - 3, steps


def test_eos_early_stop_fills_and_finishes_rows_independently():
    model = random_model("llada")
    prompts = ragged_prompts(3)
    base = dllm.generate(model, prompts, gen_length=16, block_length=4, steps=16)
    # Declare a token that row 0 produced in its first block to be EOS: row 0 must stop after block 0.
    eos = int(base.sequences[0, 0])
    model.eos_id = eos
    model.eot_id = None
    out = dllm.generate(model, prompts, gen_length=16, block_length=4, steps=16, eos_early_stop=True)
    row0 = out.sequences[0]
    first = int((row0 == eos).nonzero()[0])
    assert first < 4
    assert torch.equal(row0[:4], base.sequences[0, :4])  # the finished block keeps its tokens (dInfer's rule)
    assert (row0[4:] == eos).all()
    assert out.stats.row_nfe[0] == 4 and out.stats.finish_step[0] == 4
    for b in range(3):  # rows that never produce EOS run all 4 blocks, unaffected by row 0 stopping
        if not (base.sequences[b] == eos).any():
            assert out.stats.row_nfe[b] == 16
            assert torch.equal(out.sequences[b], base.sequences[b])
    assert out.stats.nfe == max(out.stats.row_nfe)


def test_cfg_changes_the_logits_and_keeps_nfe():
    model = random_model("llada")
    prompts = ragged_prompts(2)
    plain = dllm.generate(model, prompts, gen_length=16, steps=16)
    cfg = dllm.generate(model, prompts, gen_length=16, steps=16, cfg_scale=2.0)
    assert cfg.stats.nfe == plain.stats.nfe == 16
    assert not torch.equal(plain.sequences, cfg.sequences)


def test_seeded_runs_repeat_and_seeds_differ():
    model = random_model("dream")
    sampler = dllm.get_sampler("dream", alg="maskgit_plus", temperature=1.0)
    a = dllm.generate(model, ragged_prompts(2), gen_length=16, steps=16, sampler=sampler, seed=1)
    b = dllm.generate(model, ragged_prompts(2), gen_length=16, steps=16, sampler=sampler, seed=1)
    c = dllm.generate(model, ragged_prompts(2), gen_length=16, steps=16, sampler=sampler, seed=2)
    assert torch.equal(a.sequences, b.sequences)
    assert not torch.equal(a.sequences, c.sequences)


def test_dream_logits_are_shifted_by_one():
    model = random_model("dream")
    x = torch.randint(3, 90, (2, 10))
    full = model(x)
    cols = torch.tensor([[3, 4, 5], [7, 8, 9]])
    part = model(x, logits_idx=cols)
    assert torch.allclose(part, full.gather(1, cols[..., None].expand(-1, -1, full.shape[-1])))
    # the shift: Dream's column c equals the hidden row c-1 of the same network without the shift
    unshifted = copy.deepcopy(model)
    unshifted.spec = None
    rows = unshifted(x)
    assert torch.allclose(full[:, 1:], rows[:, :-1], atol=1e-6)
    assert torch.allclose(full[:, 0], rows[:, 0], atol=1e-6)


def test_eos_early_stop_with_a_sliding_window():
    """With Elastic's sliding window a row stops once a stop token has every position before it decoded:
    the rest is EOS-filled and the row takes fewer forwards than decoding every mask."""
    from dllm.samplers import SlidingWindow

    model = random_model("llada")
    prompts = ragged_prompts(3)
    kw = dict(gen_length=16, steps=16, block_policy=SlidingWindow(4))
    base = dllm.generate(model, prompts, **kw)
    row = base.sequences[0]
    eos = int(row[2])  # a token row 0 produces early; declare it EOS
    model.eos_id, model.eot_id = eos, None
    out = dllm.generate(model, prompts, eos_early_stop=True, **kw)
    row0 = out.sequences[0]
    first = int((row0 == eos).nonzero()[0])
    assert (row0[first:] == eos).all() and torch.equal(row0[:first], base.sequences[0, :first])
    assert out.stats.row_nfe[0] < base.stats.row_nfe[0]
    for b in range(3):
        if not (base.sequences[b] == eos).any():
            assert torch.equal(out.sequences[b], base.sequences[b])


def test_generate_under_inference_mode_decodes_what_it_decodes_outside():
    """A caller's ``torch.inference_mode()`` (a common way to call a model): the loop runs outside it (it reads
    tensors' version counters, which inference tensors do not keep), with every cache and on the graph path's
    static buffers, and gives the same tokens."""
    model = dllm.load_model("llada-tiny")
    kw = dict(gen_length=16, block_length=8, steps=16, sampler="llada")
    prompts = ["What is 12 + 30?", "What is 407 + 2185?"]
    for cache in ("none", "prefix", "dual", "dkv-decode", "freecache", "elastic"):
        for graphs in ("off", "on"):
            ref = dllm.generate(model, prompts, cache=cache, graphs=graphs, **kw)
            with torch.inference_mode():
                tensor_prompt = torch.tensor([model.tokenizer("What is 12 + 30?")["input_ids"]])  # an inference tensor
                out = dllm.generate(model, prompts, cache=cache, graphs=graphs, **kw)
                dllm.generate(model, tensor_prompt, cache=cache, graphs=graphs, **kw)
            assert torch.equal(out.sequences, ref.sequences), (cache, graphs)
            assert not out.sequences.is_inference()


def test_the_cuda_clock_holds_few_events_in_a_long_lived_decoder(monkeypatch):
    """On CUDA the step clock records events (no synchronisation) and reads them at the end; a decoder stepped for
    hours (the serving engine's, which never asks for the totals) folds the spans whose events completed along the
    way, so it holds a bounded number; the totals are those of every span."""
    from dllm.generate import _Clock

    class Event:  # a CUDA event whose completion the test controls; 1 ms between consecutive records
        clock, pending = 0, []

        def __init__(self, enable_timing=False):
            self.t, self.done = None, False

        def record(self):
            Event.clock += 1
            self.t = Event.clock
            Event.pending.append(self)

        def query(self):
            return self.done

        def elapsed_time(self, other):
            assert self.done and other.done
            return float(other.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = _Clock(torch.device("cuda"))
    steps = 3 * _Clock.MAX_SPANS
    for i in range(steps):
        a, b, c = clock.mark(), clock.mark(), clock.mark()
        clock.add("model", a, b)
        clock.add("sampler", b, c)
        if i % 10 == 9:  # the device catches up now and then
            for ev in Event.pending:
                ev.done = True
        assert len(clock.spans) <= _Clock.MAX_SPANS + 20
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: [setattr(ev, "done", True) for ev in Event.pending])
    totals = clock.totals()
    assert abs(totals["model"] - steps / 1000.0) < 1e-9 and abs(totals["sampler"] - steps / 1000.0) < 1e-9
    assert clock.spans == []
