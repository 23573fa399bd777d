"""Batch invariance: a row's output does not depend on the batch it is decoded in.

The matrix: every registered sampler x every cache x both model families, at temperature 0 and seeded at
temperature 0.8. A target row decoded alone must give the same tokens, NFE and per-step commits as inside two
ragged batches (first of two rows; last of three, with a longer prompt beside it, so its left padding and
window differ). Random streams are per row (``noise_scope="row"``, keyed by the seed and the row's identity);
every cache decides per row (refreshes, drift tests, the rows it recomputes).
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import ragged_prompts
from helpers_parity import cached_model

import dllm
from dllm.caches import CACHES
from dllm.generate import prepare_prompts
from dllm.samplers import SAMPLERS, get_sampler

FAMILIES = ("llada", "dream")
GEN, BLOCK = 16, 8
# (family, cache): every cache on the bidirectional families; the block-diffusion families (SDAR, LLaDA2's mixture
# of experts, Fast-dLLM v2's token shift) with no cache and their exact block cache, which only block-diffusion
# models take
BLOCK_FAMILIES = ("sdar", "llada2", "fastdllm2")
MATRIX = [(f, c) for f in FAMILIES for c in CACHES if c != "block"] + \
    [(f, c) for f in BLOCK_FAMILIES for c in ("none", "block")]


def _model(family):
    return _block_model(family) if family in BLOCK_FAMILIES else cached_model(family, 0, eos_heavy=True)


@functools.cache
def _block_model(family):
    import golden_models as gm

    return {"sdar": gm.sdar_tiny, "llada2": gm.llada2_tiny, "fastdllm2": gm.fastdllm2_tiny}[family](0)


def _sampler(name, temperature, model=None):
    kw = {"delimiters": (5, 6, 7)} if name == "adablock" and model is None else {}  # random models: no tokenizer
    params = SAMPLERS[name].params()
    if "temperature" in params:
        kw["temperature"] = temperature
    elif temperature:
        return None
    return get_sampler(name, **kw)


def _row(out, b):
    """What must not depend on the batch: tokens, NFE, and the positions committed at every step."""
    steps = out.stats.commit_step[b]
    return out.sequences[b].tolist(), out.stats.row_nfe[b], steps


def _check(model, name, cache, temperature, **kw) -> list[str]:
    """The ways ``name`` depends on the batch (empty: none)."""
    sampler = _sampler(name, temperature)
    if sampler is None:
        return []
    target, others = ragged_prompts(4, seed=7)[1], ragged_prompts(4, seed=8)
    run = lambda prompts: dllm.generate(model, prompts, gen_length=GEN, block_length=BLOCK, steps=GEN,  # noqa: E731
                                        sampler=sampler, cache=cache, seed=3, **kw)
    alone = _row(run([target]), 0)
    first = _row(run([target, others[0]]), 0)
    last = _row(run([others[2], others[1], target]), 2)
    return [f"{name} ({where})" for where, got in (("first of two", first), ("last of three", last)) if got != alone]


#: greedy in the default run, seeded sampling too in the slow one (``pytest -m slow``, which CI also runs)
TEMPERATURES = [0.0, pytest.param(0.8, marks=pytest.mark.slow)]


@pytest.mark.parametrize("family,cache", MATRIX)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_every_sampler_is_batch_invariant(family, cache, temperature):
    model = _model(family)
    bad = [f for name in SAMPLERS for f in _check(model, name, cache, temperature)]
    assert not bad, bad


@functools.cache
def _bundled(family):
    model = dllm.load_model(f"{family}-tiny", dtype="float32")
    qs = ["What is 12 + 7?", "Sort: 5 3 9 1", "Reverse the list a b c d e", "Count the letters in banana"]
    return model, prepare_prompts(model, qs)


#: every cache on the trained LLaDA; on the trained Dream no cache and the dual cache, its other caches in the slow
#: run (the random-weight matrix above takes every cache on both families in the default run)
BUNDLED = [pytest.param(f, c, marks=[pytest.mark.slow] if f == "dream" and c not in ("none", "dual") else [])
           for f in FAMILIES for c in CACHES if c != "block"]


@pytest.mark.parametrize("family,cache", BUNDLED)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_bundled_models_are_batch_invariant(family, cache, temperature):
    """The trained tiny models, task prompts of different lengths, 4 blocks: rows finish blocks at different
    steps, so a batch-wide refresh (one row's block start) would change the others' cached state."""
    model, prompts = _bundled(family)
    bad = []
    for name in SAMPLERS:
        sampler = _sampler(name, temperature, model)
        if sampler is None:
            continue
        kw = dict(gen_length=32, block_length=8, steps=32, sampler=sampler, cache=cache, seed=2)
        alone = _row(dllm.generate(model, [prompts[0]], **kw), 0)
        batch = _row(dllm.generate(model, [prompts[1], prompts[2], prompts[0], prompts[3]], **kw), 2)
        if batch != alone:
            bad.append(name)
    assert not bad, bad


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", ["none", "dual", "elastic"])
def test_eos_early_stop_is_batch_invariant(family, cache):
    model = cached_model(family, 0, eos_heavy=True)
    bad = [f for name in ("fast-dllm", "threshold", "credit", "llada") for t in (0.0, 0.8)
           for f in _check(model, name, cache, t, eos_early_stop=True)]
    assert not bad, bad


def test_row_ids_key_the_random_stream():
    """Explicit row ids (e.g. evaluation sample ids) key a row's stream: the same id gives the same draw in any
    batch; another id or seed another draw; the same prompt twice in one call gets two streams by default."""
    model = cached_model("llada", 0)
    p = ragged_prompts(3, seed=1)
    s = get_sampler("llada", temperature=1.0)
    kw = dict(gen_length=GEN, block_length=BLOCK, steps=GEN, sampler=s, seed=5)
    a = dllm.generate(model, [p[0], p[1]], row_ids=["a", "b"], **kw).sequences
    b = dllm.generate(model, [p[2], p[0]], row_ids=["c", "a"], **kw).sequences
    assert torch.equal(a[0], b[1])
    c = dllm.generate(model, [p[0]], row_ids=["z"], **kw).sequences
    assert not torch.equal(a[0], c[0])
    d = dllm.generate(model, [p[0], p[0]], **kw).sequences
    assert not torch.equal(d[0], d[1])
    e = dllm.generate(model, [p[0]], **kw).sequences
    assert torch.equal(d[0], e[0])  # the first occurrence has the same stream as the prompt alone
    with pytest.raises(ValueError, match="row_ids has 1 entries for 2 prompts"):
        dllm.generate(model, [p[0], p[1]], row_ids=["a"], **kw)


def test_reference_streams_depend_on_the_batch():
    """The references' random streams (``noise_scope="canvas"``) are drawn for the whole batch at once, as the
    references draw them: a row's draw then depends on its neighbours (documented; the default is per row)."""
    model = cached_model("llada", 0)
    p = ragged_prompts(3, seed=1)
    s = get_sampler("llada", temperature=1.0, noise_scope="canvas")
    kw = dict(gen_length=GEN, block_length=BLOCK, steps=GEN, sampler=s, seed=5)
    alone = dllm.generate(model, [p[1]], **kw).sequences[0]
    batch = dllm.generate(model, [p[0], p[1]], **kw).sequences[1]
    assert not torch.equal(alone, batch)


def test_row_noise_is_uniform_and_decorrelated():
    """The per-row counter-based uniforms: mean and variance of U(0, 1), no correlation between neighbouring
    vocabulary entries, columns, steps or rows, and a different stream per draw within a step."""
    from dllm.samplers.base import StepContext, row_key_words, row_uniform

    B, W, V = 3, 8, 4096
    ctx = StepContext(x=torch.zeros(B, W, dtype=torch.long), cand=torch.ones(B, W, dtype=torch.bool),
                      step=torch.zeros(B, dtype=torch.long), steps=torch.ones(B, dtype=torch.long),
                      n_region_start=torch.ones(B, dtype=torch.long), region_lo=torch.zeros(B, dtype=torch.long),
                      region_hi=torch.full((B,), W), win_lo=10, canvas_len=40, gen_lo=10, global_step=0,
                      total_steps=1, generator=None, mask_id=0, eos_id=None, eot_id=None,
                      row_key=row_key_words(0, ["a", "b", "c"]), row_step=torch.tensor([0, 0, 1]))
    u = row_uniform(ctx, W, V, torch.float64)
    u2 = row_uniform(ctx, W, V, torch.float64)  # the next draw of the same step
    assert u.shape == (B, W, V) and float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    corr = lambda a, b: float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])  # noqa: E731
    assert abs(corr(u[..., 1:], u[..., :-1])) < 0.01
    assert abs(corr(u[:, 1:], u[:, :-1])) < 0.01
    assert abs(corr(u[0], u[1])) < 0.01 and abs(corr(u[1], u[2])) < 0.01
    assert abs(corr(u, u2)) < 0.01
    # a row's numbers depend on its key, step, column and draw only: the same row in another batch position
    ctx2 = StepContext(**{**ctx.__dict__, "row_key": row_key_words(0, ["c", "a"]), "row_step": torch.tensor([1, 0]),
                          "x": ctx.x[:2], "draws": 0})
    v = row_uniform(ctx2, W, V, torch.float64)
    assert torch.equal(v[0], u[2]) and torch.equal(v[1], u[0])


def test_per_row_draws_have_the_reference_distributions():
    """Dream's categorical proposal by inversion of the cumulative probabilities, and LLaDA's Gumbel-max with
    per-row uniforms, draw tokens with the softmax's probabilities (the references use torch.multinomial and
    torch.rand; only the stream differs)."""
    from dllm.samplers.dream import dream_proposal

    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0]])
    p = torch.softmax(logits, -1)[0]
    n = 40000
    u = torch.rand(n, generator=g, dtype=torch.float64)
    _, x0 = dream_proposal(logits.expand(n, -1), 1.0, None, None, "maskgit_plus", None, u=u)
    freq = torch.bincount(x0, minlength=5).double() / n
    assert torch.allclose(freq, p.double(), atol=0.01), (freq, p)
    # Gumbel-max over per-row noise (what gumbel_argmax computes at temperature 1)
    from dllm.samplers.base import StepContext, row_key_words, row_uniform

    W = n // 8
    ctx = StepContext(x=torch.zeros(8, W, dtype=torch.long), cand=torch.ones(8, W, dtype=torch.bool),
                      step=torch.zeros(8, dtype=torch.long), steps=torch.ones(8, dtype=torch.long),
                      n_region_start=torch.ones(8, dtype=torch.long), region_lo=torch.zeros(8, dtype=torch.long),
                      region_hi=torch.full((8,), W), win_lo=0, canvas_len=W, gen_lo=0, global_step=0,
                      total_steps=1, generator=None, mask_id=99, eos_id=None, eot_id=None,
                      row_key=row_key_words(1, range(8)), row_step=torch.zeros(8, dtype=torch.long))
    uu = row_uniform(ctx, W, 5, torch.float64)
    x = (logits.double().exp() / (-torch.log(uu))).argmax(-1)
    freq = torch.bincount(x.flatten(), minlength=5).double() / x.numel()
    assert torch.allclose(freq, p.double(), atol=0.01), (freq, p)
