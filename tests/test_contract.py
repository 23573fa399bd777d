"""Sampler contract (DESIGN invariant 5) on random logits, driven through ``sampler.step`` directly.

Every registered sampler, at temperature 0 and > 0 (and a few non-default stages), is given hand-built
:class:`StepContext` objects that are consistent with what the decode loop produces: each row has a contiguous
region inside the window, ``1 <= steps <= n_region_start <= W``, ``step < steps``, and at most
``n_region_start`` still-masked candidates in the region; some rows have no candidates (finished rows).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from conftest import ragged_prompts, random_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dllm
from dllm.samplers import SAMPLERS, DreamSampler, LLaDASampler, get_sampler
from dllm.samplers.base import StepContext
from dllm.samplers.llada import even_quota

WIN_LO = 5  # canvas column of window position 0 (a prompt of 5 tokens before it)


def _configs() -> list[tuple[str, dict]]:
    out = []
    for name, entry in sorted(SAMPLERS.items()):
        out.append((name, {}))
        if "temperature" in entry.params():
            out.append((name, {"temperature": 0.7}))
    out += [
        ("llada", {"logits_eos_inf": True, "confidence_eos_eot_inf": True}),
        ("llada", {"temperature": 1.0, "noise_scope": "canvas", "softmax_dtype": "float64"}),
        ("llada-random", {"temperature": 0.5, "noise_scope": "canvas"}),
        ("dream", {"alg_temp": 0.5}),
        ("dream-maskgit-plus", {"temperature": 0.5, "top_p": 0.9, "top_k": 3}),
        ("dream-topk-margin", {"alg_temp": 1.0, "noise_scope": "canvas"}),
        ("dream-origin", {"temperature": 1.0, "top_k": 2}),
    ]
    return out


CONFIGS = _configs()
IDS = [name + "".join(f"-{k}={v}" for k, v in p.items()) for name, p in CONFIGS]


@dataclasses.dataclass
class Case:
    logits: torch.Tensor
    ctx_args: dict
    V: int

    def ctx(self, seed: int = 0) -> StepContext:
        a = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.ctx_args.items()}
        return StepContext(**a, generator=torch.Generator().manual_seed(seed), state={})


@st.composite
def cases(draw) -> Case:
    B = draw(st.integers(1, 3))
    W = draw(st.integers(1, 12))
    V = draw(st.integers(3, 20))
    mask_id = draw(st.integers(0, V - 1))
    eos_id = draw(st.sampled_from([None, *range(V)]))
    eot_id = draw(st.sampled_from([None, *range(V)]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, W), generator=g)
    x = torch.where(x == mask_id, (x + 1) % V, x)  # non-candidates: mostly real tokens...
    outside_mask = torch.rand(B, W, generator=g) < 0.2
    cand = torch.zeros(B, W, dtype=torch.bool)
    step, steps, n_start, lo, hi = [], [], [], [], []
    for b in range(B):
        S = draw(st.integers(1, W))
        n = draw(st.integers(S, W))
        s = draw(st.integers(0, S - 1))
        r0 = draw(st.integers(0, W - n))
        has = draw(st.booleans()) if b else True  # row 0 always has candidates, others maybe not
        # Candidates the decode loop would leave after ``s`` LLaDA-quota steps; sometimes fewer.
        left = n - sum(n // S + (i < n % S) for i in range(s))
        k = draw(st.integers(1, left)) if has else 0
        pos = torch.randperm(n, generator=g)[:k] + r0
        cand[b, pos] = True
        # ...and outside the region a few masks (later blocks), which are not candidates.
        region = torch.zeros(W, dtype=torch.bool)
        region[r0 : r0 + n] = True
        x[b] = torch.where(outside_mask[b] & ~region, mask_id, x[b])
        step.append(s), steps.append(S), n_start.append(n), lo.append(WIN_LO + r0), hi.append(WIN_LO + r0 + n)
    x = torch.where(cand, mask_id, x)
    kind = draw(st.sampled_from(["randn", "wide", "ties", "mask_high", "mask_top"]))
    if kind == "ties":
        logits = torch.randint(-2, 3, (B, W, V), generator=g).float()
    else:
        logits = torch.randn(B, W, V, generator=g) * (4.0 if kind == "wide" else 1.0)
    if kind == "mask_high":
        logits[..., mask_id] += 3.0
    elif kind == "mask_top":  # the mask token dominates every distribution
        logits[..., mask_id] = 50.0
    ctx_args = {
        "x": x, "cand": cand, "step": torch.tensor(step), "steps": torch.tensor(steps),
        "n_region_start": torch.tensor(n_start), "region_lo": torch.tensor(lo), "region_hi": torch.tensor(hi),
        "win_lo": WIN_LO, "canvas_len": WIN_LO + W + 3, "gen_lo": WIN_LO, "global_step": int(max(step)),
        "total_steps": int(max(steps)), "mask_id": mask_id, "eos_id": eos_id, "eot_id": eot_id,
    }
    return Case(logits, ctx_args, V)


CONTRACT = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=IDS)
@CONTRACT
@given(case=cases())
def test_step_contract(name, params, case):
    _check_step_contract(name, params, case)


EOS_IS_MASK = Case(  # found by the property test: a row that stopped filled its masks with EOS == the mask id
    logits=torch.tensor([[[0.5507, 0.2704, 0.6472, 0.2490], [-0.3354, 0.4564, -0.6255, 0.4539]]]),
    ctx_args={"x": torch.tensor([[0, 0]]), "cand": torch.tensor([[True, True]]), "step": torch.tensor([0]),
              "steps": torch.tensor([1]), "n_region_start": torch.tensor([2]), "region_lo": torch.tensor([5]),
              "region_hi": torch.tensor([7]), "win_lo": 5, "canvas_len": 10, "gen_lo": 5, "global_step": 0,
              "total_steps": 1, "mask_id": 0, "eos_id": 0, "eot_id": 3},
    V=4)


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=IDS)
def test_step_contract_when_eos_is_the_mask_id(name, params):
    _check_step_contract(name, params, dataclasses.replace(EOS_IS_MASK, logits=EOS_IS_MASK.logits.clone()))


def _check_step_contract(name, params, case):
    sampler = get_sampler(name, **params)
    ctx = case.ctx(seed=1)
    logits_before = case.logits.clone()
    x_before, cand_before = ctx.x.clone(), ctx.cand.clone()
    res = sampler.step(case.logits, ctx)
    B, W = ctx.cand.shape

    # shapes and dtypes
    assert res.proposal.shape == (B, W) and res.commit.shape == (B, W)
    assert res.commit.dtype == torch.bool
    assert res.proposal.dtype == torch.long

    # inputs untouched
    assert torch.equal(case.logits, logits_before)
    assert torch.equal(ctx.x, x_before) and torch.equal(ctx.cand, cand_before)

    # commit is a subset of the candidates
    assert not (res.commit & ~ctx.cand).any()

    # committed proposals are real tokens of the vocabulary, never the mask
    committed = res.proposal[res.commit]
    assert not (committed == ctx.mask_id).any(), "a committed position proposes the mask token"
    assert ((committed >= 0) & (committed < case.V)).all()

    n_cand = ctx.cand.sum(-1)
    n_commit = res.commit.sum(-1)
    last = ctx.step == ctx.steps - 1
    if isinstance(sampler, DreamSampler):
        # Dream's exact 1 - s/t schedule may assign zero tokens mid-region; the last step takes them all.
        assert torch.equal(n_commit[last], n_cand[last])
    else:
        assert (n_commit[n_cand > 0] >= 1).all(), "a row with candidates committed nothing"
    if isinstance(sampler, LLaDASampler):
        assert torch.equal(n_commit, torch.minimum(even_quota(ctx), n_cand))
        assert torch.equal(even_quota(ctx), ctx.n_region_start // ctx.steps
                           + (ctx.step < ctx.n_region_start % ctx.steps).long())

    # deterministic under a seed
    res2 = sampler.step(case.logits.clone(), case.ctx(seed=1))
    assert torch.equal(res.commit, res2.commit)
    assert torch.equal(res.proposal[res.commit], res2.proposal[res2.commit])
    assert torch.equal(res.proposal, res2.proposal)


@pytest.mark.parametrize(("name", "params"), [
    (name, params)
    for name in ("dream", "dream-origin", "dream-maskgit-plus", "dream-topk-margin")
    for params in ({}, {"temperature": 0.8}, {"alg_temp": 0.5})
    if not (name == "dream-origin" and "alg_temp" in params)  # alg_temp does not apply to alg='origin'
])
def test_dream_last_step_commits_every_candidate(name, params):
    """Dream's schedule finishes a region at its last step whatever the confidences (mask logit dominant)."""
    sampler = get_sampler(name, **params)
    g = torch.Generator().manual_seed(0)
    B, W, V = 2, 8, 11
    x = torch.full((B, W), 10)
    cand = torch.ones(B, W, dtype=torch.bool)
    cand[1, :5] = False
    x[1, :5] = 3
    ctx = StepContext(x=x, cand=cand, step=torch.tensor([7, 7]), steps=torch.tensor([8, 8]),
                      n_region_start=torch.tensor([8, 8]), region_lo=torch.tensor([0, 0]),
                      region_hi=torch.tensor([8, 8]), win_lo=0, canvas_len=8, gen_lo=0, global_step=7,
                      total_steps=8, generator=g, mask_id=10, eos_id=0, eot_id=1)
    logits = torch.randn(B, W, V, generator=g)
    logits[..., 10] = 30.0
    res = sampler.step(logits, ctx)  # the mask id has the largest logit everywhere
    assert torch.equal(res.commit, cand)
    assert not (res.proposal[cand] == 10).any()


# ------------------------------------------------------------------------------------ end to end (tiny model)
@pytest.mark.parametrize("sampler", ["llada", "dream-origin", "dream-entropy"])
def test_generate_never_emits_the_mask_even_when_the_model_prefers_it(sampler):
    model = random_model("llada", seed=2)
    model.head.weight[model.mask_id] *= 50.0  # the raw model now predicts the mask almost everywhere
    raw = model(torch.tensor([[5, 6, 7, model.mask_id, model.mask_id]]))
    assert (raw.argmax(-1) == model.mask_id).any()
    out = dllm.generate(model, ragged_prompts(3), gen_length=8, steps=8, sampler=sampler)
    assert not (out.sequences == model.mask_id).any()
    assert out.stats.nfe == 8 if sampler == "llada" else out.stats.nfe <= 8  # origin may reveal all early
@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("sampler", [None, "llada-random", "dream-origin", "dream-maskgit-plus"])
def test_generate_end_to_end(family, sampler):
    model = random_model(family, seed=3)
    prompts = ragged_prompts(3, seed=1)
    G, block = 8, 4
    out = dllm.generate(model, prompts, gen_length=G, block_length=block, steps=4, sampler=sampler, seed=5)
    seqs = out.sequences
    assert seqs.shape == (3, G)
    assert not (seqs == model.mask_id).any(), "generate left a mask in the output"
    assert out.prompt_lengths == [len(p) for p in prompts]
    if sampler is None and family == "llada":
        assert out.stats.nfe == 4  # LLaDA's baseline takes exactly ``steps`` forwards
        assert out.stats.row_nfe == [4, 4, 4]
        assert all(sum(t["committed"][b] for t in out.stats.trace) == G for b in range(3))
    # Prompts are untouched: decoding the prompt + output canvas one more time reproduces it, and the
    # prompt given as a padded tensor with an attention mask gives the same result.
    P = max(map(len, prompts))
    padded = torch.full((3, P), model.pad_id)
    am = torch.zeros(3, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, P - len(p):] = torch.tensor(p)
        am[b, P - len(p):] = 1
    before = padded.clone()
    out2 = dllm.generate(model, padded, attention_mask=am, gen_length=G, block_length=block, steps=4,
                         sampler=sampler, seed=5)
    assert torch.equal(padded, before), "generate mutated the caller's prompt tensor"
    assert torch.equal(out2.sequences, seqs)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("early_stop", [False, True])
def test_generate_keeps_prompt_tokens(family, early_stop):
    """Reconstruct the canvas the model sees at every forward: its prompt columns are exactly the
    left-padded prompts, and the final canvas is prompt + ``out.sequences``."""
    model = random_model(family, seed=1)
    prompts = ragged_prompts(3, seed=2)
    copies = [list(p) for p in prompts]
    P = max(map(len, prompts))
    seen = []
    handle = model.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
    try:
        out = dllm.generate(model, prompts, gen_length=8, block_length=4, steps=8, seed=0,
                            eos_early_stop=early_stop)
    finally:
        handle.remove()
    assert prompts == copies, "generate mutated the caller's prompt lists"
    assert len(seen) == out.stats.nfe
    expected = torch.full((3, P), model.pad_id)
    for b, p in enumerate(prompts):
        expected[b, P - len(p):] = torch.tensor(p)
    for canvas in seen:
        assert torch.equal(canvas[:, :P], expected)
    # Each forward sees the previous forward's canvas plus that step's commits (never a changed token).
    for before, after in itertools.pairwise(seen):
        changed = before != after
        rewritten = changed & (before != model.mask_id)  # only EOS early stop may overwrite a token, with EOS
        assert (after[rewritten] == model.eos_id).all() and (early_stop or not rewritten.any())
    assert not (out.sequences == model.mask_id).any()


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("params", [("llada", {}), ("dream", {"alg_temp": 0.5}), ("dream-origin", {"temperature": 1.0})])
def test_generate_rows_finishing_early(family, params):
    """EOS early stop finishes one row while the others go on: finished rows have no candidates, which
    every sampler must accept (Dream's ``alg_temp`` draw used to fail on them)."""
    model = random_model(family, seed=4)
    prompts = ragged_prompts(3, seed=3)
    kw = {"gen_length": 8, "block_length": 4, "steps": 8, "seed": 2, "sampler": get_sampler(params[0], **params[1])}
    first = dllm.generate(model, prompts, **kw).sequences
    # an EOS id that occurs in row 0's first block only, so row 0 stops after it and the others go on
    others = set(first[1:, :4].flatten().tolist()) | set(first[:, 4:].flatten().tolist())
    stop = next((t for t in first[0, :4].tolist() if t not in others), None)
    if stop is None:
        pytest.fail("no token suitable as EOS; change the seed")
    model.eos_id, model.eot_id = stop, None
    out = dllm.generate(model, prompts, eos_early_stop=True, **kw)
    assert not (out.sequences == model.mask_id).any()
    assert out.stats.finish_step[0] < min(out.stats.finish_step[1:])
    assert torch.equal(out.sequences[0, :4], first[0, :4])  # the finished block keeps its tokens (dInfer's rule)
    assert (out.sequences[0, 4:] == model.eos_id).all()  # every later position is EOS
    if params[0] == "llada":  # greedy: the other rows do not notice
        assert torch.equal(out.sequences[1:], first[1:])
