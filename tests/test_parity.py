"""Token-exact parity of ``dllm.generate`` with plain restatements of the reference decode loops.

The oracles (``tests/oracles.py``) restate LLaDA ``generate.py`` and Dream ``diffusion_generate`` with one
full-canvas forward per step, per-row loops and the reference's random stream; ``dllm.generate`` must give
the same tokens on tiny random-weight fp32 models, for several seeds, batch 1 and batch 3 (ragged, left
padded), temperature 0 and > 0.

Test models (``helpers_parity.cached_model``) give the mask id a large probability but never the argmax (see
``MaskGapHead``): scores must come from the full-vocabulary softmax, as in the references. The EOS/EOT options are tested on an "EOS-heavy" variant that proposes EOS/EOT at many
positions, so the options actually change the output.
"""

from __future__ import annotations

import pytest
import torch
from conftest import MASK
from helpers_parity import MASK_BOOST, cached_model, prompt_set
from oracles import dream_oracle, llada_oracle

import dllm
from dllm.samplers import DreamSampler, LLaDASampler

SEEDS = (0, 1, 2)



def _mismatch(kind, seed, case, ours, ref, ties) -> str:
    return (f"{kind} parity failed (seed {seed}, case {case})\n ours:   {ours.tolist()}\n oracle: {ref.tolist()}\n"
            f" oracle boundary ties (step, row, k, value): {ties}")


def _boost(sampling: dict) -> float:
    """The test model's mask gap: a likely mask at temperature 0, an unlikely one under sampling noise (where a
    drawn mask id is a no-op commit in the reference and the best other token in dllm, a deliberate difference)."""
    return MASK_BOOST if sampling.get("temperature", 0.0) == 0 and not sampling.get("cfg") else -8.0


# --------------------------------------------------------------------------------------------------- LLaDA
def run_llada(seed: int, batch: int = 3, gen: int = 16, block: int = 8, steps: int = 8, cfg: float = 0.0,
              eos_heavy: bool = False, oracle_override: dict | None = None, **skw):
    """(ours, oracle) for one LLaDA configuration; ``skw`` are LLaDASampler / oracle sampling options."""
    model = cached_model("llada", seed, eos_heavy, mask_boost=_boost({**skw, "cfg": cfg}))
    prompts = prompt_set(batch, seed)
    skw.setdefault("softmax_dtype", "model")
    gseed = 1000 + seed
    ours = dllm.generate(model, prompts, gen_length=gen, block_length=block, steps=steps, seed=gseed,
                         cfg_scale=cfg, sampler=LLaDASampler(noise_scope="canvas", **skw))
    okw = dict(skw)
    okw.setdefault("eos_eot_quirk", False)  # LLaDASampler's default
    okw.update(oracle_override or {})
    ref = llada_oracle(model, prompts, gen_length=gen, block_length=block, steps=steps, cfg_scale=cfg, seed=gseed,
                       **okw)
    return ours, ref


def _l(id_, **kw):
    return pytest.param(kw, id=id_)


LLADA_CASES = [
    # low-confidence remasking: temperature, blocks / one block, uneven quotas, softmax dtype, batch
    _l("lc-t0-blk8x8-f64-b3", temperature=0.0, block=8, steps=8, softmax_dtype="float64"),
    _l("lc-t0-blk8x16-model-b1", temperature=0.0, block=8, steps=16, batch=1),
    _l("lc-t0-one16x8-model-b3", temperature=0.0, block=16, steps=8),
    _l("lc-t0-blk4x12-f32-b3", temperature=0.0, block=4, steps=12, softmax_dtype="float32"),  # quotas 2,1,1
    _l("lc-t0.7-blk8x8-f64-b3", temperature=0.7, block=8, steps=8, softmax_dtype="float64"),
    _l("lc-t0.7-blk8x16-model-b1", temperature=0.7, block=8, steps=16, batch=1),
    _l("lc-t0.7-one16x16-model-b3", temperature=0.7, block=16, steps=16),
    _l("lc-t0.7-one16x5-f64-b3", temperature=0.7, block=16, steps=5, softmax_dtype="float64"),  # 4,3,3,3,3
    _l("lc-t1.3-blk4x8-model-b1", temperature=1.3, block=4, steps=8, batch=1),
    # random remasking
    _l("rnd-t0-blk8x8-b3", remasking="random", temperature=0.0, block=8, steps=8),
    _l("rnd-t0.7-blk8x16-b3", remasking="random", temperature=0.7, block=8, steps=16),
    _l("rnd-t0.7-one16x8-b1", remasking="random", temperature=0.7, block=16, steps=8, batch=1),
    _l("rnd-t0-one16x16-b1", remasking="random", temperature=0.0, block=16, steps=16, batch=1),
    # classifier-free guidance
    _l("cfg1.5-lc-t0-blk8x8-b3", cfg=1.5, temperature=0.0, block=8, steps=8),
    _l("cfg1.5-lc-t0.7-one16x8-f64-b1", cfg=1.5, temperature=0.7, block=16, steps=8, batch=1,
       softmax_dtype="float64"),
    _l("cfg1.5-rnd-t0.7-blk8x8-b3", cfg=1.5, remasking="random", temperature=0.7, block=8, steps=8),
    _l("cfg0.5-lc-t0.7-blk8x16-b3", cfg=0.5, temperature=0.7, block=8, steps=16),
    # EOS / EOT options on the EOS-heavy model
    _l("eos-base-t0.7-b3", eos_heavy=True, temperature=0.7, block=8, steps=8),
    _l("eosinf-t0-blk8x8-b3", eos_heavy=True, logits_eos_inf=True, temperature=0.0, block=8, steps=8),
    _l("eosinf-t0.7-one16x8-b3", eos_heavy=True, logits_eos_inf=True, temperature=0.7, block=16, steps=8),
    _l("confinf-quirk-t0-blk8x8-b3", eos_heavy=True, confidence_eos_eot_inf=True, eos_eot_quirk=True,
       temperature=0.0, block=8, steps=8),
    _l("confinf-quirk-t0.7-blk8x8-b3", eos_heavy=True, confidence_eos_eot_inf=True, eos_eot_quirk=True,
       temperature=0.7, block=8, steps=8),
    _l("confinf-quirk-t0.7-one16x16-f64-b1", eos_heavy=True, confidence_eos_eot_inf=True, eos_eot_quirk=True,
       temperature=0.7, block=16, steps=16, batch=1, softmax_dtype="float64"),
    _l("confinf-t0-one16x16-b1", eos_heavy=True, confidence_eos_eot_inf=True, temperature=0.0, block=16,
       steps=16, batch=1),
    _l("confinf-t0.7-blk8x8-b3", eos_heavy=True, confidence_eos_eot_inf=True, temperature=0.7, block=8,
       steps=8),
    _l("eosinf-confinf-quirk-t0.7-blk8x16-b3", eos_heavy=True, logits_eos_inf=True, confidence_eos_eot_inf=True,
       eos_eot_quirk=True, temperature=0.7, block=8, steps=16),
    _l("eosinf-confinf-cfg1.5-t0.7-blk8x8-b3", eos_heavy=True, logits_eos_inf=True, confidence_eos_eot_inf=True,
       cfg=1.5, temperature=0.7, block=8, steps=8),
]


@pytest.mark.parametrize("case", LLADA_CASES)
def test_llada_parity(case, request):
    for seed in SEEDS:
        ours, ref = run_llada(seed, **case)
        assert torch.equal(ours.sequences, ref.sequences), _mismatch(
            "LLaDA", seed, request.node.callspec.id, ours.sequences, ref.sequences, ref.ties)
        assert ours.stats.nfe == ref.nfe == case["steps"]


# --------------------------------------------------------------------------------------------------- Dream
def run_dream(seed: int, batch: int = 3, gen: int = 16, steps: int = 16, **skw):
    model = cached_model("dream", seed, mask_boost=_boost(skw))
    prompts = prompt_set(batch, seed)
    gseed = 2000 + seed
    ours = dllm.generate(model, prompts, gen_length=gen, block_length=None, steps=steps, seed=gseed,
                         sampler=DreamSampler(noise_scope="canvas", **skw))
    ref = dream_oracle(model, prompts, gen_length=gen, steps=steps, seed=gseed, **skw)
    return ours, ref


def _dream_cases():
    cases = []
    for alg in ("origin", "maskgit_plus", "topk_margin", "entropy"):
        cases += [
            pytest.param({"alg": alg, "temperature": 0.0, "steps": 16}, id=f"{alg}-t0-s16-b3"),
            pytest.param({"alg": alg, "temperature": 0.0, "steps": 5, "batch": 1}, id=f"{alg}-t0-s5-b1"),
            pytest.param({"alg": alg, "temperature": 0.8, "top_p": 0.9, "steps": 5}, id=f"{alg}-t0.8-p0.9-s5-b3"),
            pytest.param({"alg": alg, "temperature": 0.8, "top_k": 5, "steps": 16, "batch": 1},
                         id=f"{alg}-t0.8-k5-s16-b1"),
        ]
        if alg == "origin":
            cases.append(pytest.param({"alg": alg, "temperature": 0.8, "steps": 12}, id=f"{alg}-t0.8-s12-b3"))
        else:
            cases += [
                pytest.param({"alg": alg, "temperature": 0.0, "alg_temp": 0.5, "steps": 16},
                             id=f"{alg}-t0-at0.5-s16-b3"),
                pytest.param({"alg": alg, "temperature": 0.8, "top_p": 0.9, "alg_temp": 0.5, "steps": 12},
                             id=f"{alg}-t0.8-p0.9-at0.5-s12-b3"),
            ]
    cases.append(pytest.param({"alg": "entropy", "temperature": 0.0, "eps": 0.05, "steps": 8},
                              id="entropy-t0-eps0.05-s8-b3"))
    return cases


@pytest.mark.parametrize("case", _dream_cases())
def test_dream_parity(case, request):
    for seed in SEEDS:
        ours, ref = run_dream(seed, **case)
        assert torch.equal(ours.sequences, ref.sequences), _mismatch(
            "Dream", seed, request.node.callspec.id, ours.sequences, ref.sequences, ref.ties)
        if case["alg"] != "origin":  # origin may reveal everything before its last step and stop early
            assert ours.stats.nfe == case["steps"]


def test_dream_schedule_has_zero_commit_steps():
    """steps == gen_length: ``int(16 * (1 - s/t)) == 0`` at step 0, so a step commits nothing (and parity
    above still holds); 16 tokens / 5 steps commits 3, 3, 3, 3, 4."""
    ours, _ = run_dream(0, alg="entropy", temperature=0.0, steps=16)
    per_step = [r["committed"] for r in ours.stats.trace]
    assert per_step[0] == [0, 0, 0] and len(per_step) == 16
    assert sum(c[0] for c in per_step) == 16
    ours, _ = run_dream(0, alg="maskgit_plus", temperature=0.0, steps=5)
    assert [r["committed"][0] for r in ours.stats.trace] == [3, 3, 3, 3, 4]


# ----------------------------------------------------------------------------------------- batch invariance
BATCH_INVARIANCE = [
    pytest.param("llada", {"gen_length": 16, "block_length": 8, "steps": 16}, LLaDASampler(), id="llada-blk8x16"),
    pytest.param("llada", {"gen_length": 16, "block_length": 4, "steps": 8, "cfg_scale": 1.5}, LLaDASampler(),
                 id="llada-blk4x8-cfg"),
    pytest.param("dream", {"gen_length": 16, "block_length": None, "steps": 16}, DreamSampler(alg="entropy"),
                 id="dream-entropy-s16"),
    pytest.param("dream", {"gen_length": 16, "block_length": None, "steps": 5}, DreamSampler(alg="maskgit_plus"),
                 id="dream-maskgit-s5"),
]


@pytest.mark.parametrize("family,kw,sampler", BATCH_INVARIANCE)
def test_batch_invariance(family, kw, sampler):
    """Temperature 0: each row of a ragged batch of 3 equals the same prompt decoded alone."""
    for seed in SEEDS:
        model = cached_model(family, seed)
        prompts = prompt_set(3, seed)
        batched = dllm.generate(model, prompts, seed=seed, sampler=sampler, **kw).sequences
        for b, p in enumerate(prompts):
            alone = dllm.generate(model, [p], seed=seed, sampler=sampler, **kw).sequences
            assert torch.equal(alone[0], batched[b]), (
                f"seed {seed} row {b}: {alone[0].tolist()} != {batched[b].tolist()}")


# ------------------------------------------------------------------------------------ the tests can fail
def test_llada_parity_detects_a_different_rule():
    """The comparison is not vacuous: a different remasking rule, a different random stream (region-scoped
    noise) or the other EOS/EOT reading each change the tokens on some seed."""
    remask_differs = stream_differs = quirk_differs = False
    for seed in SEEDS:
        ours, ref = run_llada(seed, temperature=0.0, oracle_override={"remasking": "random"})
        remask_differs |= not torch.equal(ours.sequences, ref.sequences)
        model, prompts = cached_model("llada", seed), prompt_set(3, seed)
        region = dllm.generate(model, prompts, gen_length=16, block_length=8, steps=8, seed=1000 + seed,
                               sampler=LLaDASampler(temperature=0.7, noise_scope="region", softmax_dtype="model"))
        ref = llada_oracle(model, prompts, gen_length=16, block_length=8, steps=8, temperature=0.7, seed=1000 + seed)
        stream_differs |= not torch.equal(region.sequences, ref.sequences)
        ours, ref = run_llada(seed, eos_heavy=True, temperature=0.7, confidence_eos_eot_inf=True,
                              oracle_override={"eos_eot_quirk": True})
        quirk_differs |= not torch.equal(ours.sequences, ref.sequences)
    assert remask_differs and stream_differs and quirk_differs


def test_parity_detects_scores_normalised_without_the_mask():
    """The test models' mask probability is not negligible: confidences renormalised without the mask column
    (the mask logit at -inf before the softmax) commit in another order than the reference on some seed."""
    differs = False
    for seed in SEEDS:
        model, prompts = cached_model("llada", seed), prompt_set(3, seed)
        kw = {"gen_length": 16, "block_length": 8, "steps": 8, "seed": seed}
        ref = llada_oracle(model, prompts, **kw).sequences
        handle = model.head.register_forward_hook(lambda _m, _i, out: out.index_fill_(-1, torch.tensor([MASK]), -1e30))
        try:
            renormalised = llada_oracle(model, prompts, **kw).sequences
        finally:
            handle.remove()
        differs |= not torch.equal(ref, renormalised)
    assert differs


def test_dream_parity_detects_a_different_rule():
    differs = stream_differs = False
    for seed in SEEDS:
        model, prompts = cached_model("dream", seed), prompt_set(3, seed)
        ours = dllm.generate(model, prompts, gen_length=16, steps=8, seed=seed, sampler=DreamSampler(alg="entropy"))
        ref = dream_oracle(model, prompts, gen_length=16, steps=8, seed=seed, alg="topk_margin")
        differs |= not torch.equal(ours.sequences, ref.sequences)
        region = dllm.generate(model, prompts, gen_length=16, steps=8, seed=seed,
                               sampler=DreamSampler(alg="entropy", alg_temp=0.5, noise_scope="region"))
        ref = dream_oracle(model, prompts, gen_length=16, steps=8, seed=seed, alg="entropy", alg_temp=0.5)
        stream_differs |= not torch.equal(region.sequences, ref.sequences)
    assert differs and stream_differs


def test_eos_options_are_exercised():
    """On the EOS-heavy model the EOS/EOT options change the oracle's output on some seed, EOS/EOT are
    generated, and exact confidence ties at 0 (EOS/EOT proposals) occur, so the tie rule is tested."""
    changed = {"eosinf": False, "confinf_t0": False, "confinf_t07": False, "quirk_t07": False}
    emitted = ties = 0
    for seed in SEEDS:
        model, prompts = cached_model("llada", seed, eos_heavy=True), prompt_set(3, seed)
        kw = {"gen_length": 16, "block_length": 8, "steps": 8, "seed": seed}
        for temp in (0.0, 0.7):
            base = llada_oracle(model, prompts, temperature=temp, **kw).sequences
            emitted += int(((base == model.eos_id) | (base == model.eot_id)).sum())
            conf = llada_oracle(model, prompts, temperature=temp, confidence_eos_eot_inf=True, eos_eot_quirk=False,
                                **kw)
            quirk = llada_oracle(model, prompts, temperature=temp, confidence_eos_eot_inf=True, eos_eot_quirk=True,
                                 **kw)
            ties += len(conf.ties) + len(quirk.ties)
            changed["eosinf"] |= not torch.equal(base, llada_oracle(model, prompts, temperature=temp,
                                                                     logits_eos_inf=True, **kw).sequences)
            changed["confinf_t0" if temp == 0 else "confinf_t07"] |= not torch.equal(base, conf.sequences)
            if temp == 0:
                assert torch.equal(conf.sequences, quirk.sequences)  # one tensor at T = 0: both ids removed
            else:
                changed["quirk_t07"] |= not torch.equal(conf.sequences, quirk.sequences)
    assert all(changed.values()), changed
    assert emitted > 0 and ties > 0
