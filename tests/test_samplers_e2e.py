"""End to end: every preset through ``dllm.generate`` on both families, token parity with the plain
reference loops of ``tests/sampler_oracles.py``, the composition matrix, preferred block layouts, trace.

Test models are tiny random-weight fp32 models whose confidences are low (mostly 0.2-0.8), so the oracle
tests use thresholds scaled to that range: the rules then commit several tokens per step and really
differ from one-token-per-step decoding.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import sampler_oracles as O
import torch
from conftest import ragged_prompts, random_model
from helpers_parity import cached_model, prompt_set

import dllm
from dllm.caches import get_cache
from dllm.recipes import Recipe, configure
from dllm.samplers import (
    SAMPLERS,
    AdaBlock,
    ComposedSampler,
    CreditFusion,
    EOSRejection,
    Factor,
    FixedBlocks,
    KLStable,
    LocalLeap,
    Prophet,
    Quota,
    Threshold,
    get_sampler,
)
from dllm.samplers.presets import PRESETS

FAMILIES = ("llada", "dream")



def _rows(sel_fn):
    """Adapt a one-row oracle selection to ``block_oracle``'s rule signature."""
    return lambda j, conf, cand, i, n, **_: sel_fn(conf, cand)


def _check(ours, ref_seq, ref_nfe=None):
    assert torch.equal(ours.sequences, ref_seq), f"\n ours:   {ours.sequences.tolist()}\n oracle: {ref_seq.tolist()}"
    if ref_nfe is not None:
        assert ours.stats.row_nfe == ref_nfe


# ------------------------------------------------------------------------------------------ oracle parity
ORACLE_CASES = {
    "threshold": (lambda: ComposedSampler(Threshold(0.4)), lambda: _rows(lambda c, m: O.threshold_select(c, m, 0.4)), None),
    "threshold-dinfer": (lambda: ComposedSampler(Threshold(0.4, max_slack=1e-5)),
                         lambda: _rows(lambda c, m: O.dinfer_threshold_select(c, m, 0.4)), None),
    "factor": (lambda: ComposedSampler(Factor(2.0)), lambda: _rows(lambda c, m: O.factor_select(c, m, 2.0, False)), None),
    "factor-quirk": (lambda: ComposedSampler(Factor(2.2, quirk=True)),
                     lambda: _rows(lambda c, m: O.factor_select(c, m, 2.2, True)), None),
    "localleap": (lambda: ComposedSampler(LocalLeap(0.55, 0.35, 2)),
                  lambda: _rows(lambda c, m: O.localleap_select(c, m, 0.55, 0.35, 2)), None),
    "credit": (lambda: ComposedSampler(Threshold(0.5), credit=CreditFusion(0.7, 0.8, 0.2)),
               lambda: _rows(lambda c, m: O.threshold_select(c, m, 0.5)), (0.7, 0.8, 0.2)),
    "credit+localleap": (lambda: ComposedSampler(LocalLeap(0.6, 0.4, 3), credit=CreditFusion(1.0, 0.7, 0.2)),
                         lambda: _rows(lambda c, m: O.localleap_select(c, m, 0.6, 0.4, 3)), (1.0, 0.7, 0.2)),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_block_rules_match_the_reference_loop(family, case):
    make, rule, credit = ORACLE_CASES[case]
    for seed in (0, 1):
        model = cached_model(family, seed)
        prompts = prompt_set(3, seed)
        ours = dllm.generate(model, prompts, gen_length=16, block_length=8, sampler=make())
        ref, nfe = O.block_oracle(model, prompts, gen_length=16, block_length=8, rule=rule(), credit=credit)
        _check(ours, ref, nfe)
        assert ours.stats.nfe < 16, "the rule never committed more than one token per step"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", ["threshold", "credit", "factor"])
def test_block_rules_match_the_reference_loop_with_temperature(family, case):
    """Batch 1 (the references' batch): the canvas-wide Gumbel noise stream is the reference's."""
    make, rule, credit = ORACLE_CASES[case]
    for seed in (0, 1):
        model = cached_model(family, seed)
        prompts = prompt_set(1, seed)
        sampler = configure(make(), temperature=0.8, noise_scope="canvas")
        ours = dllm.generate(model, prompts, gen_length=16, block_length=8, sampler=sampler, seed=7 + seed)
        ref, nfe = O.block_oracle(model, prompts, gen_length=16, block_length=8, rule=rule(), credit=credit,
                                  temperature=0.8, seed=7 + seed)
        _check(ours, ref, nfe)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_klass_matches_the_reference_loop(family, seed):
    model = cached_model(family, seed)
    prompts = prompt_set(3, seed)
    states = {}

    def rule(j, conf, cand, i, n, *, logits, lo, hi, **_):
        row = states.setdefault((j, lo), O.KLASSRow(2))
        probs = torch.softmax(logits[lo:hi].float(), -1)
        sel = row.select(probs, conf[lo:hi], cand[lo:hi], O.llada_quota(n, 8)[min(i, 7)], 0.3, 0.05)
        return {lo + c for c in sel}

    ours = dllm.generate(model, prompts, gen_length=16, block_length=8, steps=16,
                         sampler=ComposedSampler(KLStable(0.3, 0.05, 2)))
    ref, nfe = O.block_oracle(model, prompts, gen_length=16, block_length=8, rule=rule)
    _check(ours, ref, nfe)
    assert any(sum(t["klass_ready"]) for t in ours.stats.trace)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_eoser_and_ascending_match_the_reference(family, seed):
    """EOSER over the even quota (one block) and EOSER + ASS, with a frequent token as EOS."""
    model = copy.copy(cached_model(family, seed))  # shallow: shares the weights, own special ids
    prompts = prompt_set(3, seed)
    G, S = 16, 8
    plain = dllm.generate(model, prompts, gen_length=G, steps=S, sampler=get_sampler("llada"))
    eos = model.eos_id = int(torch.bincount(plain.sequences.flatten()).argmax())  # a frequent token plays EOS

    def eoser_rule(j, conf, cand, i, n, *, x0, **_):
        fac = O.eoser_factor(i, S, 0.4)
        conf = [c * fac if int(x0[k]) == eos else c for k, c in enumerate(conf)]
        return O.quota_select(conf, cand, O.llada_quota(G, S)[i])

    ours = dllm.generate(model, prompts, gen_length=G, steps=S, sampler=get_sampler("eoser"))
    ref, nfe = O.block_oracle(model, prompts, gen_length=G, block_length=G, rule=eoser_rule)
    _check(ours, ref, nfe)
    assert not torch.equal(plain.sequences, ours.sequences), "EOS rejection changed nothing; use another model"

    quotas = O.ass_schedule(G, 4, 1)[0]  # 1, 2, 4, 9

    def ass_rule(j, conf, cand, i, n, *, x0, **_):
        fac = O.ass_eoser_factor(i, 4, 0.01)
        conf = [c * fac if int(x0[k]) == eos else c for k, c in enumerate(conf)]
        return O.quota_select(conf, cand, quotas[i])

    ours = dllm.generate(model, prompts, gen_length=G, sampler=get_sampler("eoser-ass"))
    ref, nfe = O.block_oracle(model, prompts, gen_length=G, block_length=G, rule=ass_rule)
    _check(ours, ref, nfe)
    assert ours.stats.nfe == 4 and [t["committed"] for t in ours.stats.trace] == [[q] * 3 for q in quotas]


class SizedBlocks:
    """Test-only block policy with explicit block sizes (ASS's multi-block layout)."""

    def __init__(self, sizes):
        self.sizes = sizes

    def validate(self, cfg):
        assert sum(self.sizes) == cfg.gen_length

    def next_region(self, lo, gen_hi, cfg):
        ends = torch.tensor(self.sizes).cumsum(0) + (gen_hi - cfg.gen_length)
        hi = torch.stack([ends[ends > int(v)][0] if (ends > int(v)).any() else torch.tensor(gen_hi) for v in lo])
        return hi, torch.ones_like(lo)


def test_ascending_multi_block_schedule():
    """L = 64 in the reference's 3-block layout (15 | 16 | 33): steps 1, 2, 4, 8 | 16 | 33."""
    model = random_model("llada", seed=1)
    out = dllm.generate(model, ragged_prompts(2), gen_length=64, sampler=get_sampler("ascending"),
                        block_policy=SizedBlocks([15, 16, 33]))
    want = [q for block in O.ass_schedule(64, 6, 3) for q in block]
    assert [t["committed"][0] for t in out.stats.trace] == want == [1, 2, 4, 8, 16, 33]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("span", [None, (3, 4)])
def test_prophet_matches_the_reference_loop(family, span):
    fired = 0
    for seed in (0, 1):
        model = cached_model(family, seed)
        prompts = prompt_set(3, seed)
        kw = dict(early=3.0, mid=1.2, late=0.9)
        sampler = Prophet(get_sampler("llada"), span="region" if span is None else span, **kw)
        ours = dllm.generate(model, prompts, gen_length=16, block_length=8, steps=16, sampler=sampler)
        ref, nfe = O.prophet_oracle(model, prompts, gen_length=16, block_length=8, steps=16, span=span, **kw)
        _check(ours, ref, nfe)
        fired += sum(sum(t["early_commit"]) for t in ours.stats.trace)
        for b, n in enumerate(ours.stats.row_nfe):
            assert ours.stats.finish_step[b] == n
    assert fired > 0, "Prophet never fired; lower the test thresholds"


@pytest.mark.parametrize("family", FAMILIES)
def test_adablock_matches_the_reference_loop(family):
    delimited = 0
    for seed in (0, 1):
        model = cached_model(family, seed)
        prompts = prompt_set(3, seed)
        probe = dllm.generate(model, prompts, gen_length=32, block_length=8, sampler=get_sampler("threshold", tau=0.4))
        ids = torch.bincount(probe.sequences.flatten()).topk(3).indices.tolist()  # frequent tokens as "delimiters"
        sampler = get_sampler("adablock", tau=0.4, block_length=8, delimiters=tuple(ids),
                              delimiter_threshold=0.35)
        ours = dllm.generate(model, prompts, gen_length=32, sampler=sampler)
        ref, nfe, blocks = O.adablock_oracle(model, prompts, gen_length=32, b0=8, ids=ids, delim_thr=0.35, tau=0.4)
        _check(ours, ref, nfe)
        for b in range(3):  # block bounds reported in the trace
            starts = [t for t in ours.stats.trace if t["block_start"][b]]
            assert [t["hi"][b] - t["lo"][b] for t in starts] == blocks[b]
        delimited += sum(sum(t["delimiter_block"]) for t in ours.stats.trace)
    assert delimited > 0, "no block ended at a delimiter; adjust the test"


# ------------------------------------------------------------------------------------------ every preset
def _preset_kw(name, model):
    if name == "adablock":  # random models have no tokenizer: delimiters by id
        return {"delimiters": (5, 6, 7)}
    return {}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_end_to_end(family, name):
    """Batch 3 with ragged prompts, temperature 0 and 0.7: no mask left, trace per step, rows independent."""
    model = random_model(family, seed=3)
    prompts = ragged_prompts(3, seed=1)
    for T in (0.0, 0.7):
        sampler = get_sampler(name, temperature=T, **_preset_kw(name, model))
        out = dllm.generate(model, prompts, gen_length=32, sampler=sampler, seed=4)
        assert out.sequences.shape == (3, 32)
        assert not (out.sequences == model.mask_id).any()
        s = out.stats
        assert len(s.trace) == s.nfe and max(s.row_nfe) == s.nfe
        assert [sum(t["committed"][b] for t in s.trace) for b in range(3)] == [32, 32, 32]
        if T == 0:  # a row's output does not depend on its batch neighbours
            # Elastic-Cache decides refreshes for the whole batch and its sliding windows differ per row (the
            # union window refreshes more K/V), so only its exact mode (a refresh every step) is batch-free.
            cache = get_cache("elastic", refresh_every=1) if name == "elastic" else None
            if cache is not None:
                out = dllm.generate(model, prompts, gen_length=32, sampler=sampler, seed=4, cache=cache)
            for b in (0, 2):
                alone = dllm.generate(model, [prompts[b]], gen_length=32, sampler=sampler, seed=4, cache=cache)
                assert torch.equal(alone.sequences[0], out.sequences[b]), (name, b)


BUNDLED = [Path(dllm.__file__).parent / "assets" / n for n in ("llada-tiny", "dream-tiny")]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_on_the_bundled_tiny_models(name):
    from dllm.evals import tasks as T

    convs = [ex.messages for ex in T.generate("waiting_line/reverse", 2, seed=7)]
    for path in BUNDLED:
        model = dllm.load_model(path, dtype=torch.float32)
        out = dllm.generate(model, convs, gen_length=32, sampler=get_sampler(name))
        assert not (out.sequences == model.mask_id).any() and len(out.texts) == 2


# ---------------------------------------------------------------------------------------- compositions
DELIMS = tuple(range(3, 60))  # most of the vocabulary: blocks end at a "delimiter" often enough to test it

COMPOSITIONS = {
    "credit+localleap": lambda: get_sampler("credit-localleap", kappa=0.6, tau=0.4),
    "credit+factor": lambda: ComposedSampler(Factor(1.0), credit=CreditFusion()),
    "credit+klass": lambda: ComposedSampler(KLStable(0.3, 0.05), credit=CreditFusion()),
    "adablock+factor": lambda: Recipe(ComposedSampler(Factor(1.0)), block_policy=AdaBlock(8, 0.2, DELIMS)),
    "adablock+credit": lambda: Recipe(ComposedSampler(Threshold(0.5), credit=CreditFusion()), block_policy=AdaBlock(8, 0.2, DELIMS)),
    "adablock+localleap": lambda: Recipe(ComposedSampler(LocalLeap(0.6, 0.4)), block_policy=AdaBlock(8, 0.2, DELIMS)),
    "adablock+quota": lambda: Recipe(ComposedSampler(Quota()), block_policy=AdaBlock(8, 0.2, DELIMS)),
    **{f"eoser+{c}+threshold": (lambda c=c: ComposedSampler(Threshold(0.5), confidence=c, eos_rejection=EOSRejection(0.4, "decoded")))
       for c in ("prob", "margin", "neg_entropy", "random")},
    **{f"eoser+{c}+quota": (lambda c=c: ComposedSampler(Quota(), confidence=c, eos_rejection=EOSRejection(0.4)))
       for c in ("prob", "margin", "neg_entropy", "random")},
    # EOS early rejection with the other confidence rules (threshold-style rules: progress = fraction decoded)
    "eoser+factor": lambda: ComposedSampler(Factor(1.0), eos_rejection=EOSRejection(0.4, "decoded")),
    "eoser+localleap": lambda: ComposedSampler(LocalLeap(0.6, 0.4), eos_rejection=EOSRejection(0.4, "decoded")),
    "eoser+klass": lambda: ComposedSampler(KLStable(0.3, 0.05), eos_rejection=EOSRejection(0.4)),
    **{f"prophet+{b}": (lambda b=b: get_sampler("prophet", base=b, early=2.0, mid=1.0, late=0.5))
       for b in ("llada", "fast-dllm", "credit", "localleap", "klass", "dream", "dream-origin", "eoser-ass", "factor")},
    "prophet+adablock": lambda: Recipe(Prophet(ComposedSampler(Threshold(0.5)), early=2.0, mid=1.0, late=0.5),
                                       block_policy=AdaBlock(8, 0.2, DELIMS)),
    "prophet-masked+credit": lambda: Recipe(Prophet(get_sampler("credit").sampler, span="masked", progress="decoded",
                                                    early=2.0, mid=1.0, late=0.5), block_length=32),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("combo", list(COMPOSITIONS))
def test_composition_matrix(family, combo):
    model = random_model(family, seed=5)
    prompts = ragged_prompts(3, seed=2)
    sampler = COMPOSITIONS[combo]()
    for T in (0.0, 0.6):
        if T:
            sampler = configure(sampler, temperature=T) if hasattr(sampler, "confidence") else sampler
        out = dllm.generate(model, prompts, gen_length=32, block_length=None if "adablock" in combo else 8,
                            steps=32, sampler=sampler, seed=1)
        assert not (out.sequences == model.mask_id).any()
        assert [sum(t["committed"][b] for t in out.stats.trace) for b in range(3)] == [32, 32, 32]
        if combo.startswith("prophet"):
            assert all("early_commit" in t for t in out.stats.trace)
        if combo.startswith("eoser"):  # the EOS attenuation ran on every step
            assert all(len(t["eos_factor"]) == 3 for t in out.stats.trace)
        if "adablock" in combo:
            assert any(any(t["delimiter_block"]) for t in out.stats.trace), "no delimiter block in the composition"


@pytest.mark.parametrize("family", FAMILIES)
def test_klass_preset_fused_path_decodes_like_the_composed_rule(family, monkeypatch):
    """The ``klass`` preset's chunked CPU path (one window row per chunk here) gives the tokens and per-step
    trace of ``ComposedSampler(KLStable(...))`` through the decode loop (ragged batch, several blocks)."""
    monkeypatch.setattr(KLStable, "chunk_bytes", 1)  # one row per chunk
    model = cached_model(family, 1)
    prompts = prompt_set(3, 1)
    kw = dict(gen_length=24, block_length=8, steps=24)
    preset = dllm.generate(model, prompts, sampler=get_sampler("klass", conf_threshold=0.3, kl_threshold=0.05,
                                                               style="llada"), **kw)
    plain = dllm.generate(model, prompts, sampler=ComposedSampler(KLStable(0.3, 0.05)), **kw)
    assert torch.equal(preset.sequences, plain.sequences)
    assert preset.stats.trace == plain.stats.trace
    assert any(sum(t["klass_ready"]) for t in preset.stats.trace)


@pytest.mark.parametrize("family", FAMILIES)
def test_klass_preset_takes_the_style_of_the_model_family(family):
    """``klass`` (style ``auto``) decodes a LLaDA model as KLASS's LLaDA script (``conf > thr``, else the even
    quota, block 64) and a Dream model as its Dream code (``conf >= thr``, else the single most confident
    candidate, the whole canvas as one region); the two styles differ on these models."""
    model, prompts = cached_model(family, 1), prompt_set(3, 1)
    kw = dict(gen_length=16, steps=8)
    auto = dllm.generate(model, prompts, sampler=get_sampler("klass", conf_threshold=0.3, kl_threshold=0.05), **kw)
    dream_rule = ComposedSampler(KLStable(0.3, 0.05, fallback=None, inclusive=True))
    llada_rule = ComposedSampler(KLStable(0.3, 0.05))
    dream = dllm.generate(model, prompts, sampler=dream_rule, block_length=None, **kw)
    llada = dllm.generate(model, prompts, sampler=llada_rule, block_length=64 if kw["gen_length"] % 64 == 0 else None,
                          **kw)
    assert torch.equal(auto.sequences, dream.sequences if family == "dream" else llada.sequences)
    assert not torch.equal(dream.sequences, llada.sequences) or dream.stats.nfe != llada.stats.nfe
    for style in ("llada", "dream"):
        s = get_sampler("klass", style=style)
        assert s.style == style and s.rule.inclusive == (style == "dream")
        assert s.block_length == (None if style == "dream" else 64)
    assert get_sampler("klass", style="dream", block_length=8).block_length == 8
    with pytest.raises(ValueError, match="unknown style 'x'; known: auto, llada, dream"):
        get_sampler("klass", style="x")


@pytest.mark.parametrize("family", FAMILIES)
def test_early_commit_is_recorded_false_on_every_step_without_prophet(family):
    """Every step's trace says whether an early commit fired, for every sampler: False throughout for
    samplers that have none (every registered one but Prophet and the guided sampler's EOS fill)."""
    model = random_model(family, seed=5)
    prompts = ragged_prompts(3, seed=2)
    names = [n for n in SAMPLERS if n not in ("prophet", "guided")]
    assert len(names) >= 20
    for name in names:
        sampler = get_sampler(name, **_preset_kw(name, model))
        out = dllm.generate(model, prompts, gen_length=16, block_length=8, steps=16, sampler=sampler, seed=1)
        trace = out.stats.trace
        assert trace and all(t["early_commit"] == [False, False, False] for t in trace), name
    # Prophet (always firing) over the same loop: the key is the same, and True
    out = dllm.generate(model, prompts, gen_length=16, block_length=8, steps=16,
                        sampler=Prophet(get_sampler("llada"), early=0.0, mid=0.0, late=0.0))
    assert [t["early_commit"] for t in out.stats.trace] == [[True, True, True]]


def test_prophet_fill_covers_the_whole_generation_and_stops_the_row():
    model = random_model("llada", seed=5)
    prompts = ragged_prompts(3, seed=2)
    sampler = Prophet(get_sampler("llada"), early=0.0, mid=0.0, late=0.0)  # fires at the first step
    out = dllm.generate(model, prompts, gen_length=32, block_length=8, steps=32, sampler=sampler)
    assert out.stats.nfe == 1 and out.stats.trace[0]["committed"] == [32, 32, 32]
    assert out.stats.trace[0]["early_commit"] == [True, True, True]
    # the fill is this step's argmax over the whole generation (temperature 0)
    P = max(map(len, prompts))
    x = torch.full((3, P + 32), model.mask_id)
    am = torch.zeros(3, P + 32, dtype=torch.bool)
    for b, p in enumerate(prompts):
        x[b, P - len(p) : P] = torch.tensor(p)
        x[b, : P - len(p)] = model.pad_id
        am[b, P - len(p) :] = True
    logits = model(x, positions=(am.long().cumsum(-1) - 1).clamp_min(0), attn_mask=am)[:, P:]
    logits[..., model.mask_id] = float("-inf")
    assert torch.equal(out.sequences, logits.argmax(-1))


@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_prophet_fixed_span_with_a_cache_after_a_row_finished_early(cache):
    """A fixed span reaches left of the block; once a row commits early and finishes, the others go on with a cache
    that computes no row of a finished row: the finished row reads no logits (it did, its span's columns, and the
    forward refused them). Each row decodes what it decodes alone."""
    model = random_model("llada")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    sampler = Prophet(get_sampler("llada"), early=3.0, mid=1.6, late=1.1, span=(2, 6))
    kw = dict(gen_length=16, block_length=8, steps=16, sampler=sampler, cache=cache, seed=1)
    out = dllm.generate(model, prompts, **kw)
    assert len(set(out.stats.finish_step)) > 1, out.stats.finish_step  # rows finished at different steps
    for b, p in enumerate(prompts):
        assert out.sequences[b].tolist() == dllm.generate(model, [p], **kw).sequences[0].tolist()


# ------------------------------------------------------------------------------------ preferred layouts
def test_preset_block_length_is_used_when_the_caller_sets_none():
    model = random_model("llada", seed=1)
    out = dllm.generate(model, ragged_prompts(2), gen_length=64, sampler="fast-dllm")
    P = max(map(len, ragged_prompts(2)))
    assert {t["hi"][0] - t["lo"][0] for t in out.stats.trace if t["committed"][0]} == {32}
    assert {t["lo"][0] for t in out.stats.trace if t["committed"][0]} == {P, P + 32}
    out = dllm.generate(model, ragged_prompts(2), gen_length=64, block_length=16, sampler="fast-dllm")
    assert {t["hi"][0] - t["lo"][0] for t in out.stats.trace if t["committed"][0]} == {16}
    out = dllm.generate(model, ragged_prompts(2), gen_length=16, sampler="fast-dllm")  # shorter than 32: one block
    assert {t["hi"][0] - t["lo"][0] for t in out.stats.trace if t["committed"][0]} == {16}
    out = dllm.generate(model, ragged_prompts(2), gen_length=64, sampler="fast-dllm",
                        block_policy=FixedBlocks(block_length=8))
    assert {t["hi"][0] - t["lo"][0] for t in out.stats.trace if t["committed"][0]} == {8}
    out = dllm.generate(model, ragged_prompts(2), gen_length=64, sampler="prophet")  # Prophet's paper block 32
    assert {t["lo"][0] for t in out.stats.trace if t["committed"][0]} <= {P, P + 32}


def test_preset_block_length_that_does_not_divide_gen_length_names_its_source():
    model = random_model("llada", seed=1)
    with pytest.raises(ValueError, match=r"block_length=32 is the preferred block length of sampler 'fast-dllm'"):
        dllm.generate(model, ragged_prompts(2), gen_length=48, sampler="fast-dllm")


def test_adablock_finds_newline_delimiters_in_the_tokenizer():
    class Tok:  # the decode surface AdaBlock uses
        texts = ["a", "b", "\n", "x\n", "\n\n", "c"]

        def __len__(self):
            return len(self.texts)

        def batch_decode(self, ids):
            return [self.texts[i[0]] for i in ids]

    model = random_model("dream", seed=1)
    model.tokenizer = Tok()
    bound = AdaBlock().bind(model)
    assert bound.delimiters == (2, 3, 4) and bound.delimiter_threshold == 0.5
    assert AdaBlock(delimiters="newline-exact").bind(model).delimiters == (2,)
    model = random_model("llada", seed=1)
    model.tokenizer = Tok()
    assert AdaBlock().bind(model).delimiter_threshold == 0.3
    assert AdaBlock(delimiters="3,4").bind(model).delimiters == (3, 4)


def test_registry_and_cli_list_the_presets(capsys):
    from dllm.cli import build_parser

    for name in ("fast-dllm", "localleap", "credit", "prophet", "adablock", "eoser-ass", "klass", "threshold", "factor"):
        assert name in SAMPLERS
    args = build_parser().parse_args(["samplers"])
    args.func(args)
    text = capsys.readouterr().out
    assert "localleap: LocalLeap" in text and "    radius = 4" in text and "    tau = 0.75" in text
    assert get_sampler("threshold", tau=0.7).rule.tau == 0.7
    assert get_sampler("factor", factor=1.6, quirk=True).rule == Factor(1.6, True)


# --------------------------------------------------------------------------------- block layout (recipes.block_layout)


def test_block_layout_picks_the_policy_and_config_in_resolves_order():
    from dllm.blocks import AdaBlock, AlignedBlocks
    from dllm.config import GenerateConfig
    from dllm.recipes import as_recipe, block_layout

    cfg = GenerateConfig(gen_length=64)
    fast = get_sampler("fast-dllm")
    lay = block_layout(fast, None, cfg)
    assert (lay.source, type(lay.policy), lay.config.block_length, lay.recipe) == ("preferred", FixedBlocks, 32,
                                                                                   "fast-dllm")
    assert block_layout(fast, None, GenerateConfig(gen_length=16)).source == "whole"  # 32 is not shorter
    assert block_layout(None, None, cfg).source == "whole"
    assert block_layout(as_recipe(get_sampler("llada")), None, cfg).source == "whole"
    lay = block_layout(fast, 4, cfg)  # a block-diffusion model: its own grid wins over the preset's 32
    assert lay.source == "aligned" and lay.policy == AlignedBlocks(4) and lay.config is cfg
    lay = block_layout(fast, 4, GenerateConfig(gen_length=64, block_length=8))
    assert lay.source == "fixed" and lay.policy == FixedBlocks() and lay.config.block_length == 8
    assert block_layout(get_sampler("adablock"), 4, cfg).source == "recipe"
    assert block_layout(fast, 4, cfg, FixedBlocks(block_length=16)).source == "caller"
    assert isinstance(block_layout(get_sampler("adablock"), None, cfg).policy, AdaBlock)


@pytest.mark.parametrize("model_name, sampler, kw", [
    ("sdar-tiny", None, dict(gen_length=64, steps=5)),  # aligned blocks of 4: 5 * 4 is not a multiple of 64
    ("sdar-tiny", None, dict(gen_length=64, block_length=5)),
    ("sdar-tiny", "fast-dllm", dict(gen_length=64, steps=8, block_length=16)),
    ("sdar-tiny", "fast-dllm", dict(gen_length=48, steps=6)),  # aligned (the preset's 32 does not apply)
    ("llada-tiny", "fast-dllm", dict(gen_length=48)),  # the preset's 32 does not divide 48
    ("llada-tiny", None, dict(gen_length=32, block_length=8, steps=6)),
    ("llada-tiny", "multiblock", dict(gen_length=48)),
    ("llada-tiny", "multiblock", dict(gen_length=64, block_length=24)),
    ("llada-tiny", "elastic", dict(gen_length=16, steps=32)),
    ("llada-tiny", "fast-dllm", dict(gen_length=64)),  # fine
    ("sdar-tiny", None, dict(gen_length=64, steps=16)),  # fine
])
def test_the_layout_checked_before_loading_is_the_one_resolve_checks(model_name, sampler, kw):
    """precheck_layout (config.json's block size, no model) refuses exactly what resolve refuses, in its words."""
    import dllm.assets
    from dllm.config import GenerateConfig
    from dllm.models.loading import checkpoint_block_size
    from dllm.recipes import precheck_layout, resolve

    path = dllm.assets.model_path(model_name)
    cfg = GenerateConfig(**kw)

    def outcome(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    model = dllm.load_model(str(path), dtype="float32")
    early = outcome(lambda: precheck_layout(sampler, checkpoint_block_size(path), cfg))
    late = outcome(lambda: resolve(model, sampler, None, None, cfg))
    assert early == late


def test_precheck_layout_leaves_what_needs_the_model_to_resolve():
    from dllm.config import GenerateConfig
    from dllm.recipes import precheck_layout

    cfg = GenerateConfig(gen_length=64)
    assert precheck_layout("adablock", None, cfg) is None  # AdaBlock reads its delimiters from the tokenizer
    assert precheck_layout("klass", None, cfg) is None  # its block length follows the model family's style
    assert precheck_layout("klass", None, GenerateConfig(gen_length=64, block_length=16)).source == "fixed"
    with pytest.raises(ValueError, match="not a multiple of block_length"):
        precheck_layout("klass", None, GenerateConfig(gen_length=64, block_length=24))
    assert precheck_layout("fast-dllm", None, cfg).config.block_length == 32
    assert precheck_layout("fast-dllm", 4, cfg).source == "aligned"


def test_klstable_defaults_are_the_klass_presets():
    """The bare rule and the ``klass`` preset decide alike by default: ALGORITHMS.md's 0.6 / 0.015 (the rule's own
    defaults were 0.9 / 0.01)."""
    import inspect

    from dllm.samplers.presets import klass

    rule = KLStable()
    preset = inspect.signature(klass).parameters
    assert (rule.conf_threshold, rule.kl_threshold, rule.history) == (
        preset["conf_threshold"].default, preset["kl_threshold"].default, preset["history"].default) == (0.6, 0.015, 2)
