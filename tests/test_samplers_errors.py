"""Bad parameters of the parallel samplers raise clear errors naming the parameter, its range and a fix."""

from __future__ import annotations

import re

import pytest
from conftest import ragged_prompts, random_model

import dllm
from dllm.samplers import (
    AdaBlock,
    Ascending,
    ComposedSampler,
    CreditFusion,
    EOSRejection,
    Factor,
    KLStable,
    LocalLeap,
    Prophet,
    Threshold,
    get_sampler,
)

BAD = [
    # (callable, message pattern)
    (lambda: Threshold(0.0), r"tau=0\.0 is out of range; it must lie in \(0, 1\]; tau is a confidence threshold"),
    (lambda: Threshold(1.5), r"tau=1\.5 is out of range; it must lie in \(0, 1\]"),
    (lambda: get_sampler("threshold", tau=-0.2), r"tau=-0\.2 is out of range"),
    (lambda: get_sampler("fast-dllm", tau=2), r"tau=2 is out of range; it must lie in \(0, 1\]"),
    (lambda: Threshold(0.9, max_slack=1.0), r"max_slack=1\.0 is out of range; it must lie in \[0, 1\)"),
    (lambda: LocalLeap(radius=-1), r"radius=-1 is out of range; it must be an integer >= 0"),
    (lambda: LocalLeap(radius=1.5), r"radius=1\.5 is out of range"),
    (lambda: get_sampler("localleap", radius=-3), r"radius=-3 is out of range"),
    (lambda: LocalLeap(kappa=1.2), r"kappa=1\.2 is out of range; it must lie in \(0, 1\]"),
    (lambda: LocalLeap(kappa=0.7, tau=0.8), r"tau=0\.8 is larger than kappa=0\.7; .* must be <= kappa"),
    (lambda: LocalLeap(tau=0.0), r"tau=0\.0 is out of range"),
    (lambda: CreditFusion(beta=1.2), r"beta=1\.2 is out of range; it must lie in \[0, 1\]; beta is the per-step credit decay"),
    (lambda: get_sampler("credit", beta=-0.1), r"beta=-0\.1 is out of range; it must lie in \[0, 1\]"),
    (lambda: CreditFusion(alpha=-1), r"alpha=-1 is out of range"),
    (lambda: CreditFusion(gamma=-0.5), r"gamma=-0\.5 is out of range"),
    (lambda: CreditFusion(slots=0), r"slots=0 is out of range; it must be an integer >= 1"),
    (lambda: Factor(0), r"factor=0 is out of range; it must lie in \(0, inf\); ParallelBench sweeps"),
    (lambda: get_sampler("factor", factor=-1.0), r"factor=-1\.0 is out of range"),
    (lambda: KLStable(history=0), r"history=0 is out of range; it must be an integer >= 1"),
    (lambda: KLStable(kl_threshold=0), r"kl_threshold=0 is out of range; it must lie in \(0, inf\)"),
    (lambda: KLStable(conf_threshold=1.0), r"conf_threshold=1\.0 is out of range; it must lie in \[0, 1\)"),
    (lambda: get_sampler("klass", softmax_dtype="float16"), r"unknown softmax_dtype 'float16'; known: float32, float64, model"),
    (lambda: EOSRejection(gamma_min=1.5), r"gamma_min=1\.5 is out of range; it must lie in \[0, 1\]; EOSER uses 0\.4"),
    (lambda: EOSRejection(progress="time"), r"unknown EOS rejection progress 'time'; known: step, step-total, decoded, ass"),
    (lambda: get_sampler("eoser-ass", steps=0), r"steps=0 is out of range; it must be a positive integer or None"),
    (lambda: Ascending(steps=-2), r"steps=-2 is out of range"),
    (lambda: ComposedSampler(confidence="entropy"), r"unknown confidence 'entropy'; known: prob, margin, neg_entropy, random"),
    (lambda: ComposedSampler(temperature=-1.0), r"temperature=-1\.0 is out of range; it must lie in \[0, inf\); use 0"),
    (lambda: ComposedSampler(rule="threshold"), r"rule must be a commit rule"),
    (lambda: get_sampler("localleap", foo=1), r"sampler 'localleap' has no parameter\(s\) \['foo'\]; its parameters: kappa, tau"),
    (lambda: Prophet(get_sampler("llada"), span="answer"), r"span='answer' is not understood; use 'region', 'masked' or 'OFFSET:LENGTH'"),
    (lambda: Prophet(get_sampler("llada"), span=(-1, 5)), r"the offset must be >= 0 and the length >= 1"),
    (lambda: Prophet(get_sampler("llada"), early=-1), r"early=-1 is out of range; it must lie in \[0, inf\); Prophet's thresholds"),
    (lambda: Prophet(get_sampler("llada"), bounds=(0.7, 0.3)), r"bounds=\(0\.7, 0\.3\) must be two progress values"),
    (lambda: Prophet(get_sampler("llada"), progress="time"), r"unknown progress 'time'; known: steps, decoded"),
    (lambda: Prophet("llada"), r"inner must be a sampler"),
    (lambda: get_sampler("prophet", base="prophet"), r"Prophet cannot wrap itself"),
    (lambda: get_sampler("prophet", base="nope"), r"unknown sampler 'nope'; known samplers:"),
    (lambda: AdaBlock(delimiter_threshold=1.5), r"delimiter_threshold=1\.5 is out of range; it must lie in \[0, 1\]; the reference uses 0\.3"),
    (lambda: AdaBlock(window=0), r"window=0 is out of range; it must lie in \(0, 1\]"),
    (lambda: AdaBlock(block_length=0), r"block_length=0 is out of range; it must be a positive integer or None"),
    (lambda: AdaBlock(delimiters="semicolon"), r"delimiters='semicolon' is not understood; use 'newline', 'newline-exact' or token ids"),
    (lambda: AdaBlock(delimiters=()).bind(random_model("llada")), r"AdaBlock delimiters is empty"),
]


@pytest.mark.parametrize(("make", "pattern"), BAD, ids=[re.sub(r"\W+", "_", p[:40]) for _, p in BAD])
def test_bad_parameters_raise_clear_errors(make, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        make()


def test_adablock_delimiter_outside_the_vocabulary():
    model = random_model("llada")
    with pytest.raises(ValueError, match=r"AdaBlock delimiter id\(s\) \[500\] are not in the vocabulary \(0\.\.95\)"):
        dllm.generate(model, ragged_prompts(2), gen_length=16, sampler=get_sampler("adablock", delimiters=(3, 500)))
    with pytest.raises(ValueError, match=r"AdaBlock delimiters contain the mask id 95"):
        dllm.generate(model, ragged_prompts(2), gen_length=16, sampler=get_sampler("adablock", delimiters="95"))


def test_adablock_newline_delimiters_without_a_tokenizer_warn_and_use_fixed_blocks():
    model = random_model("dream")
    with pytest.warns(UserWarning, match=r"delimiters='newline' needs the model's tokenizer .* delimiters=\(id, \.\.\.\)"):
        out = dllm.generate(model, ragged_prompts(2), gen_length=16, block_length=8, sampler="adablock")
    assert not any(any(t["delimiter_block"]) for t in out.stats.trace)
    assert {t["hi"][0] - t["lo"][0] for t in out.stats.trace if t["committed"][0]} == {8}

    class NoNewline:
        def __len__(self):
            return 3

        def batch_decode(self, ids):
            return ["a", "b", "c"]

    model.tokenizer = NoNewline()
    with pytest.raises(ValueError, match=r"no token of the tokenizer matches delimiters='newline'"):
        dllm.generate(model, ragged_prompts(2), gen_length=16, sampler="adablock")


def test_unbound_adablock_is_reported():
    from dllm.config import GenerateConfig

    with pytest.raises(ValueError, match="AdaBlock is not bound to a model"):
        AdaBlock().validate(GenerateConfig())
