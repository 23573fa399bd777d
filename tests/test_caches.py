"""Cache policies over the partial forward: exactness, layer-0 K/V, partial-forward oracle, Dream's shift,
and every cache with several samplers / block policies / batch sizes."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from conftest import ragged_prompts, random_model
from helpers_parity import cached_model, prompt_set

import dllm
from dllm import generate
from dllm.caches import CACHES, KVCache, get_cache
from dllm.caches.base import rows_from_mask
from dllm.samplers import SAMPLERS as SAMPLER_REGISTRY

CACHE_NAMES = [n for n in CACHES if n not in ("none", "block")]  # block: block-diffusion models (test_sdar.py)


def _canvas(model, P=6, G=12, B=2, seed=0, frac_masked=0.5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, model.mask_id, (B, P + G), generator=g)
    gen = x[:, P:]
    gen[torch.rand(gen.shape, generator=g) < frac_masked] = model.mask_id
    return x


def _full(model, x, cache=None, attn_mask=None):
    return model(x, attn_mask=attn_mask, cache=cache)


# ------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("name", CACHE_NAMES)
@pytest.mark.parametrize("batch", [1, 3])
def test_refresh_every_step_reproduces_no_cache(family, name, batch):
    model = cached_model(family, 0)
    prompts = prompt_set(batch, 1)
    kw = dict(gen_length=16, block_length=8, steps=16)
    base = generate(model, prompts, **kw).sequences
    out = generate(model, prompts, cache=get_cache(name, refresh_every=1), **kw)
    assert torch.equal(out.sequences, base)
    assert all(rec["refresh_layer"] == 0 for rec in out.stats.trace)


@functools.cache
def bundled_model(family: str):
    """The bundled trained tiny model (``dllm/assets/{family}-tiny``) in fp32; read-only in the tests."""
    return dllm.load_model(Path(dllm.__file__).parent / "assets" / f"{family}-tiny", dtype=torch.float32)


def bundled_prompts(batch: int) -> list:
    """Chat prompts of the waiting-line task: batch 3 has three prompt lengths (left padding)."""
    from dllm.evals import tasks as T

    return [ex.messages for ex in T.generate("waiting_line/reverse", 3, seed=7)][:batch]


@pytest.mark.parametrize("name", CACHE_NAMES)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("bundled", ["llada", "dream"])
def test_refresh_every_step_reproduces_no_cache_on_bundled_models(bundled, name, batch):
    """The same exactness on the bundled trained tiny models (confident, structured attention)."""
    model = bundled_model(bundled)
    prompts = bundled_prompts(batch)
    kw = dict(gen_length=16, block_length=8, steps=16)
    base = generate(model, prompts, **kw)
    out = generate(model, prompts, cache=get_cache(name, refresh_every=1), **kw)
    assert torch.equal(out.sequences, base.sequences)
    assert all(rec["refresh_layer"] == 0 for rec in out.stats.trace)
    if batch == 3:
        assert len(set(out.prompt_lengths)) == 3  # ragged


def test_stats_in_trace():
    model = cached_model("llada", 0)
    out = generate(model, prompt_set(3, 0), gen_length=16, block_length=8, steps=16, cache="dual")
    trace = out.stats.trace
    assert trace[0]["refresh_layer"] == 0 and trace[0]["computed"] == [1.0] * 3
    partial = [r for r in trace if r["refresh_layer"] == -1]
    assert partial, "the dual cache never ran a partial forward"
    T = 9 + 16
    for r in partial:
        assert all(0 < c < 1 for c in r["computed"])
        assert all(a < T for a in r["active"])
    assert out.stats.time_cache >= 0
    plain = generate(model, prompt_set(3, 0), gen_length=16, block_length=8, steps=16)
    assert all(r["refresh_layer"] == 0 for r in plain.stats.trace)


# ---------------------------------------------------------------------------------- partial forward
def test_layer0_kv_of_unchanged_tokens_equal_cached(family):
    model = random_model(family)
    x = _canvas(model)
    cache = get_cache("dual")
    cache.reset(*x.shape)
    _full(model, x, cache)
    k0, v0 = cache.k[0].clone(), cache.v[0].clone()
    g = torch.Generator().manual_seed(3)
    active = torch.rand(x.shape, generator=g) < 0.4
    shift = 1 if model.shift_logits else 0
    active[:, x.shape[1] - shift:] = False
    x2 = x.clone()
    changed = active & (torch.rand(x.shape, generator=g) < 0.5)
    x2[changed] = 7  # some active rows change token, the rest are unchanged
    rows = rows_from_mask(active)
    model(x2, query_idx=rows, cache=cache, logits_idx=rows + shift)
    same = ~changed
    assert torch.equal(cache.k[0].transpose(1, 2)[same], k0.transpose(1, 2)[same])
    assert torch.equal(cache.v[0].transpose(1, 2)[same], v0.transpose(1, 2)[same])
    assert not torch.equal(cache.k[0].transpose(1, 2)[changed], k0.transpose(1, 2)[changed])


@pytest.mark.parametrize("seed", [0, 1])
def test_random_active_set_logits_equal_full_forward(family, seed):
    model = random_model(family)
    x = _canvas(model, B=3, seed=seed)
    attn = torch.ones_like(x, dtype=torch.bool)
    attn[1, :2] = False  # a left-padded row
    cache = get_cache("dual")
    cache.reset(*x.shape)
    full = _full(model, x, cache, attn)  # the cache holds the true K/V of this canvas
    g = torch.Generator().manual_seed(seed + 10)
    active = (torch.rand(x.shape, generator=g) < 0.3) & attn
    shift = 1 if model.shift_logits else 0
    active[:, x.shape[1] - shift:] = False  # (Dream: the last row predicts no column)
    rows = rows_from_mask(active)  # ragged per row: padded with duplicates
    cols = rows + shift
    part = model(x, attn_mask=attn, query_idx=rows, cache=cache, logits_idx=cols)
    ref = full.gather(1, cols[..., None].expand(-1, -1, full.shape[-1]))
    torch.testing.assert_close(part, ref, rtol=1e-5, atol=1e-5)


def test_rows_from_mask_pads_with_duplicates():
    m = torch.tensor([[0, 1, 0, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    r = rows_from_mask(m)
    assert r.tolist() == [[1, 3, 4], [0, 0, 0], [0, 0, 0]]


def test_partial_forward_needs_cache_and_queried_rows():
    model = random_model("llada")
    x = _canvas(model)
    with pytest.raises(ValueError, match="needs a cache"):
        model(x, query_idx=torch.zeros(2, 1, dtype=torch.long))
    cache = get_cache("dual")
    cache.reset(*x.shape)
    _full(model, x, cache)
    with pytest.raises(ValueError, match="outside query_idx"):
        model(x, query_idx=torch.tensor([[6, 7]] * 2), cache=cache, logits_idx=torch.tensor([[6, 8]] * 2))


# ---------------------------------------------------------------------------------------- Dream shift
class _UnshiftedDual(KVCache):
    """A buggy dual cache that starts its query window at the region start (ignores Dream's shift)."""

    name = "unshifted"

    def select(self, state):
        return None if bool((state.step_in == 0).any()) else torch.zeros_like(state.x, dtype=torch.bool)

    def plan(self, state):
        if not self.filled or self.select(state) is None:
            return super().plan(state)
        c = torch.arange(state.x.shape[1])[None]
        c0, c1 = state.cols
        mask = ((c >= c0) & (c < c1)).expand_as(state.x)
        self._rows, self._counts, self._refresh_layer = rows_from_mask(mask), mask.sum(-1), -1
        return self._rows, None


def test_dream_window_includes_the_row_before_the_region():
    model = cached_model("dream", 0)
    prompts = prompt_set(1, 0)
    kw = dict(gen_length=16, block_length=8, steps=16)
    out = generate(model, prompts, cache="dual", **kw)  # the window starts one row early: works
    assert not out.sequences.eq(model.mask_id).any()
    with pytest.raises(ValueError, match="outside query_idx"):
        generate(model, prompts, cache=_UnshiftedDual(), **kw)


def test_dream_dual_partial_logits_match_full_on_window():
    """With true K/V in the cache, the dual cache's window (region shifted one row left) gives the full
    forward's logits for every region column; the unshifted window would read row c instead of c - 1."""
    model = random_model("dream")
    x = _canvas(model, P=6, G=12, B=2)
    cache = get_cache("dual")
    cache.reset(*x.shape)
    full = _full(model, x, cache)
    lo, hi = 10, 14
    cols = torch.arange(lo, hi).expand(2, -1)
    rows = torch.arange(lo - 1, hi).expand(2, -1)
    part = model(x, query_idx=rows, cache=cache, logits_idx=cols)
    torch.testing.assert_close(part, full[:, lo:hi], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ every cache x samplers
SAMPLER_NAMES = sorted(n for n in SAMPLER_REGISTRY if n != "guided")  # guided: tests/test_guided.py
SAMPLER_PARAMS = {
    # random models have no tokenizer: delimiter ids; most of the vocabulary, so blocks really vary
    "adablock": {"delimiters": tuple(range(3, 60)), "delimiter_threshold": 0.2},
    "prophet-firing": {"early": 2.0, "mid": 1.0, "late": 0.5},  # low thresholds: the all-in step fires
}


def _sampler(name):
    from dllm import get_sampler

    return get_sampler(name.removesuffix("-firing"), **SAMPLER_PARAMS.get(name, {}))


@pytest.mark.parametrize("name", CACHE_NAMES)
@pytest.mark.parametrize("sampler", [*SAMPLER_NAMES, "prophet-firing"])
def test_every_cache_with_every_sampler(family, name, sampler):
    """Every registered sampler (its block policy / early commit included) with every cache, ragged batch 3
    with EOS early stop: the default refresh decodes every position; a refresh every step equals no cache."""
    model = cached_model(family, 0, eos_heavy=True)
    prompts = ragged_prompts(3)
    kw = dict(gen_length=16, block_length=8, steps=16, sampler=_sampler(sampler), seed=0, eos_early_stop=True)
    out = generate(model, prompts, cache=name, **kw)
    assert not out.sequences.eq(model.mask_id).any()
    assert out.stats.nfe <= 16 + 4
    partial = any(r["refresh_layer"] != 0 for r in out.stats.trace)  # the cache was used
    # (dkv-decode refreshes at a region's first two steps: AdaBlock's short delimiter blocks may take no more)
    assert partial or out.stats.nfe == 1 or (name == "dkv-decode" and sampler == "adablock")
    base = generate(model, prompts, cache="none", **kw)
    exact = generate(model, prompts, cache=get_cache(name, refresh_every=1), **kw)
    assert torch.equal(exact.sequences, base.sequences)
    assert exact.stats.row_nfe == base.stats.row_nfe
    if sampler == "prophet-firing":
        assert any(any(r["early_commit"]) for r in out.stats.trace)
    if sampler == "adablock":
        assert any(any(r["delimiter_block"]) for r in out.stats.trace)


def test_cfg_with_cache():
    model = cached_model("llada", 0)
    kw = dict(gen_length=16, block_length=8, steps=16, cfg_scale=1.0)
    base = generate(model, prompt_set(3, 0), **kw).sequences
    assert torch.equal(generate(model, prompt_set(3, 0), cache=get_cache("dual", refresh_every=1), **kw).sequences, base)
    for name in CACHE_NAMES:
        assert not generate(model, prompt_set(3, 0), cache=name, **kw).sequences.eq(model.mask_id).any()


def _lockstep(out) -> bool:
    """Whether every row's region started at the same column on every step."""
    return all(len(set(r["lo"])) == 1 for r in out.stats.trace)


def test_batch_rows_independent_with_cache():
    """The documented batch property (docs/caches.md, "Batches"): rows never mix, and while the rows'
    regions advance together every cache but elastic computes for a row exactly what it computes for it alone,
    so a row's output does not depend on the other rows; when the regions drift apart only the exact mode
    (a refresh every step) is batch-independent, for every cache."""
    model = cached_model("llada", 0)
    prompts = ragged_prompts(3)
    kw = dict(gen_length=16, block_length=8, steps=16)
    for name in ("prefix", "dual", "dkv-decode", "dkv-greedy", "freecache"):
        both = generate(model, prompts, cache=name, sampler="threshold", **kw)
        assert _lockstep(both), name  # the precondition (one token per step on this model)
        assert any(r["refresh_layer"] == -1 for r in both.stats.trace), name
        for i, p in enumerate(prompts):
            alone = generate(model, [p], cache=name, sampler="threshold", **kw).sequences[0]
            assert torch.equal(both.sequences[i], alone), (name, i)
    for name in CACHE_NAMES:  # the factor rule commits different counts per row: the regions drift apart
        both = generate(model, prompts, cache=get_cache(name, refresh_every=1), sampler="factor", **kw)
        assert not _lockstep(both), name
        for i, p in enumerate(prompts):
            alone = generate(model, [p], cache=get_cache(name, refresh_every=1), sampler="factor", **kw).sequences[0]
            assert torch.equal(both.sequences[i], alone), (name, i)


def test_invalid_refresh_every():
    with pytest.raises(ValueError, match="refresh_every"):
        get_cache("dual", refresh_every=0)


# ------------------------------------------------------------------------------------ elastic, presets
def test_elastic_drift_test_sets_refresh_layer():
    model = cached_model("llada", 0)
    kw = dict(gen_length=16, block_length=8, steps=16, sampler="threshold")
    out = generate(model, prompt_set(3, 0), cache=get_cache("elastic", gamma=0.0), **kw)
    never = out.stats.trace
    always = generate(model, prompt_set(3, 0), cache=get_cache("elastic", gamma=1.0), **kw).stats.trace
    assert never[0]["refresh_layer"] == 0 and always[0]["refresh_layer"] == 0
    assert all(r["refresh_layer"] == -1 for r in never[1:])
    assert all(r["refresh_layer"] == 1 for r in always[1:])  # the first layer's test fails: layers 1.. in full
    assert all(a["computed"][0] > n["computed"][0] for a, n in zip(always[1:], never[1:]))
    # what the batch ran, padding included: the largest active set for every row, from layer 1 on every position
    T, L = max(out.prompt_lengths) + 16, model.config.n_layers
    assert never[0]["run"] == always[0]["run"] == 1.0
    for r in never[1:]:
        assert r["run"] == max(r["active"]) / T and r["run"] >= max(r["computed"]) - 1e-6  # computed: float32
    for r in always[1:]:
        assert r["run"] == pytest.approx((max(r["active"]) + (L - 1) * T) / (L * T))
        assert r["run"] >= max(r["computed"]) - 1e-6


def test_elastic_drift_test_runs_the_triton_kernel_on_the_triton_backend(monkeypatch):
    """On the Triton backend (CUDA; here its interpreter) Elastic-Cache's drift test is the fused kernel
    (``kernels.attention_drift``), inside the graph path's parts and on the eager path with classifier-free
    guidance's doubled batch: each call's similarities are those of the reference twin on the same tensors, and on
    the graph path (where each row's first failing layer is recorded by the kernel) what it recorded is what the
    reference's rule records from the reference's similarities. The drift kernel alone runs in Triton (the
    forwards' kernels are the reference's: under the interpreter they would take most of the time)."""
    pytest.importorskip("triton")
    from dllm import kernels
    from dllm.kernels import reference, triton_kernels

    calls = []
    orig = triton_kernels.attention_drift

    def spy(*args):  # compared at the call: the cache writes into these tensors afterwards
        gated = len(args) > 6
        before = [t.clone() for t in args[6:8]]  # the gate and the first failures, written in place
        out = orig(*args)
        ref = reference.attention_drift(*args[:6])
        calls.append((out.clone(), ref))
        if gated:
            reference.record_below(ref, *before, args[8])
            assert torch.equal(before[0], args[6]) and torch.equal(before[1], args[7])
            recorded.append(args[8])
        return out

    recorded = []

    monkeypatch.setattr(kernels, "attention_drift", spy)
    model = cached_model("llada", 0)
    for graphs, cfg in (("on", 0.0), ("off", 1.5)):
        generate(model, prompt_set(2, 0), gen_length=8, block_length=8, steps=4, sampler="llada", cache="elastic",
                 graphs=graphs, cfg_scale=cfg)
    assert len(calls) >= 2 * (model.config.n_layers - 1) and recorded  # no test at the last layer
    for got, ref in calls:
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=0)


def test_presets_select_their_cache():
    from dllm import get_sampler

    model = cached_model("llada", 0)
    out = generate(model, prompt_set(1, 0), gen_length=64, sampler="fast-dllm")
    assert any(r["refresh_layer"] == -1 for r in out.stats.trace)  # dual cache partial steps
    out = generate(model, prompt_set(1, 0), gen_length=64, sampler="fast-dllm", cache="none")
    assert all(r["refresh_layer"] == 0 for r in out.stats.trace)
    out = generate(model, prompt_set(1, 0), gen_length=64, sampler=get_sampler("fast-dllm", cache="none"))
    assert all(r["refresh_layer"] == 0 for r in out.stats.trace)
    for name, cls in (("elastic", "ElasticCache"), ("dkv", "DKVDecode")):
        s = get_sampler(name)
        assert type(get_cache(s.cache[0], **dict(s.cache[1]))).__name__ == cls
        out = generate(model, prompt_set(3, 0), gen_length=32, steps=32, sampler=name)
        assert not out.sequences.eq(model.mask_id).any()
        assert any(r["refresh_layer"] != 0 for r in out.stats.trace)


def _state(x, lo, hi, step_in, committed, shift=0, cols=None, nfe=5):
    from dllm.caches import CacheState

    B = x.shape[0]
    t = lambda v: torch.full((B,), v, dtype=torch.long)  # noqa: E731
    return CacheState(x, t(lo), t(hi), torch.ones(B, dtype=torch.bool), t(step_in), cols or (lo, hi), 4, 9, shift,
                      committed, nfe)


@pytest.mark.parametrize("shift", [0, 1])
def test_active_sets(shift):
    """The rows each policy recomputes on a cached step (canvas: prompt 0..3, block 8..11, masks = 9)."""
    x = torch.tensor([[5, 5, 5, 5, 6, 6, 6, 6, 9, 7, 9, 9, 9, 9, 9, 9]])
    committed = torch.zeros_like(x, dtype=torch.bool)
    committed[0, 9] = True  # decoded at the previous step

    def rows(name, step_in=2, **kw):
        c = get_cache(name, **kw)
        c.filled, c.cur_lo = True, torch.tensor([4])
        q, refresh = c.plan(_state(x, 8, 12, step_in, committed, shift))
        return None if q is None else set(q[0].tolist())

    win = set(range(8 - shift, 12 - shift))
    assert rows("dual") == win | set(range(8 - shift, 12))
    assert rows("prefix") == set(range(8 - shift, 16))
    assert rows("dkv-decode") == win | {8, 10, 11, 12, 13, 14, 15} | {9}
    assert rows("dkv-decode", step_in=1) is None  # steps 0 and 1 of a block are full
    assert rows("dkv-greedy") == win | {9} | set(range(8 - shift, 12))
    assert rows("freecache", step_in=0) == set(range(4 - shift, 12))  # the finished block's clean K/V
    assert rows("dual", step_in=0) is None and rows("prefix", step_in=0) is None
    assert rows("dual", refresh_every=5) is None  # nfe 5: a forced refresh


@pytest.mark.parametrize("name", CACHE_NAMES)
def test_the_host_twin_of_the_refresh_rule_is_the_plans(name):
    """``KVCache.refreshes_at`` (which the decode loop asks, before the synchronisation, whether the next forward
    refreshes) says what the plan's full rows say, for every step in a region and count of forwards a row has taken,
    with the policy's own refresh settings and a forced ``refresh_every``."""
    x = torch.tensor([[5, 5, 5, 5, 6, 6, 6, 6, 9, 7, 9, 9, 9, 9, 9, 9]])
    committed = torch.zeros_like(x, dtype=torch.bool)
    options = [{}, {"refresh_every": 3}]
    if name == "dkv-decode":
        options += [{"refresh_every": 5, "full_steps": 1}, {"refresh": "global"}, {"refresh_every": None}]
    for kw in options:
        c = get_cache(name, **kw)
        c.filled, c.cur_lo, c.track = True, torch.tensor([4]), None
        full = []
        for step_in in range(12):
            for row_nfe in range(12):
                state = _state(x, 8, 12, step_in, committed, nfe=row_nfe)
                state.row_nfe = torch.tensor([row_nfe])
                _, counts = c.plan_mask(state)
                full.append(not bool(counts[0]))  # no row keeps a partial forward: the row refreshes
                assert c.refreshes_at(step_in, row_nfe) == full[-1], (kw, step_in, row_nfe)
        assert any(full) and not all(full), kw


# ---------------------------------------------------------------------------------- Elastic sliding window
def test_sliding_window_slide_unit():
    from dllm.samplers import SlidingWindow

    m = torch.tensor([[0, 0, 1, 0, 1, 1, 0, 1, 1, 0],    # masks at 2, 4, 5, 7, 8
                      [0, 0, 0, 0, 0, 0, 0, 0, 1, 0],    # one mask left: the window runs to the end
                      [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)  # none: lo = hi = T
    lo, hi = SlidingWindow(3).slide(m, torch.tensor([2, 2, 2]))
    assert lo.tolist() == [2, 8, 10] and hi.tolist() == [6, 10, 10]
    lo, hi = SlidingWindow(3).slide(m, torch.tensor([5, 2, 2]))  # masks before the start do not count
    assert lo.tolist()[0] == 5 and hi.tolist()[0] == 9
    with pytest.raises(ValueError, match=r"window=0 is out of range; it must be an integer >= 1"):
        SlidingWindow(0)


class _Recorder:
    """Threshold sampler that records, per step, each row's candidate columns and the canvas."""

    def __init__(self):
        from dllm.samplers import get_sampler

        self.inner, self.seen = get_sampler("threshold", tau=0.5), []

    def step(self, logits, ctx):
        cols = torch.arange(ctx.win_lo, ctx.win_lo + ctx.x.shape[1])
        self.seen.append(([set(cols[c].tolist()) for c in ctx.cand], ctx.canvas.clone()))
        return self.inner.step(logits, ctx)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_sliding_window_candidates_are_the_first_masks(family):
    """Every step, each active row's candidates are exactly its first W remaining masks (ragged batch)."""
    from dllm.samplers import SlidingWindow

    model, W, G = cached_model(family, 1), 4, 24
    rec = _Recorder()
    out = generate(model, prompt_set(3, 1), sampler=rec, gen_length=G, block_policy=SlidingWindow(W))
    assert not out.sequences.eq(model.mask_id).any()
    T = out.sequences.shape[1] + max(len(p) for p in prompt_set(3, 1))
    slid = False
    for cands, canvas in rec.seen:
        for b, cand in enumerate(cands):
            masks = (canvas[b] == model.mask_id).nonzero().flatten().tolist()
            assert cand == set(masks[:W]), (b, cand, masks[:W])
            slid |= bool(masks) and masks[0] > T - G and cand and max(cand) >= T - G + W and len(masks) > W
    assert slid  # the window left the first W columns while masks remained behind its end


def test_elastic_preset_slides_and_matches_plain_sliding_threshold_with_full_refresh():
    """The elastic preset decodes with the sliding window; forcing a refresh every step reproduces a no-cache
    threshold run over the same window token for token (both families, ragged batch)."""
    from dllm import get_sampler
    from dllm.samplers import SlidingWindow

    assert isinstance(get_sampler("elastic").block_policy, SlidingWindow)
    for family, window in (("llada", 16), ("dream", 32)):  # the reference's window per family
        model = cached_model(family, 2)
        assert get_sampler("elastic").block_policy.bind(model).window == window
        kw = dict(gen_length=48, steps=48)
        base = generate(model, prompt_set(3, 2), sampler="threshold", block_policy=SlidingWindow(window), **kw)
        out = generate(model, prompt_set(3, 2), sampler="elastic",
                       cache=get_cache("elastic", refresh_every=1), **kw)
        assert torch.equal(out.sequences, base.sequences), family


# ---------------------------------------------------------------------------------------- dKV-Cache-Decode
def test_dkv_decode_recomputes_the_reference_rows_and_refreshes_on_the_block_step():
    """dKV-Cache-Decode as its reference runs it: full forwards at the block-local steps 0, 1 and every
    multiple of ``refresh_every`` (3 here: 8 steps per block is not a multiple, so a global forward count
    would refresh elsewhere); at the other steps exactly the still-masked positions and the tokens decoded at
    the previous step are computed (not the block's tokens decoded earlier)."""
    model = cached_model("llada", 0)
    prompts = prompt_set(1, 0)
    P = len(prompts[0])
    canvases = []
    handle = model.register_forward_pre_hook(lambda _m, args, _kw: canvases.append(args[0].clone()), with_kwargs=True)
    try:
        out = generate(model, prompts, gen_length=16, block_length=8, steps=16, sampler="dkv",
                       cache=get_cache("dkv-decode", refresh_every=3))
    finally:
        handle.remove()
    T = P + 16
    for step, (rec, x) in enumerate(zip(out.stats.trace, canvases)):
        i = step % 8  # the step inside the block (every block takes its 8 steps)
        if i < 2 or i % 3 == 0:
            assert rec["refresh_layer"] == 0 and rec["active"] == [T], (step, rec)
            continue
        decoded_last = (canvases[step - 1] != x) & (canvases[step - 1] == model.mask_id)
        want = int(((x == model.mask_id) | decoded_last).sum())
        assert rec["refresh_layer"] == -1 and rec["active"] == [want], (step, rec["active"], want)
    # the earlier variant recomputes the whole current block and refreshes on the global forward count
    glob = generate(model, prompts, gen_length=16, block_length=8, steps=16, sampler="dkv",
                    cache=get_cache("dkv-decode", refresh_every=3, refresh="global"))
    assert [r["refresh_layer"] for r in glob.stats.trace] != [r["refresh_layer"] for r in out.stats.trace]
    with pytest.raises(ValueError, match="unknown dkv-decode refresh 'x'; known: block, global"):
        get_cache("dkv-decode", refresh="x")


def test_dkv_decode_refreshing_every_step_is_the_no_cache_run(family):
    model = cached_model(family, 1)
    prompts = prompt_set(3, 1)
    kw = dict(gen_length=16, block_length=8, steps=16, sampler="dkv")
    ref = generate(model, prompts, cache="none", **kw)
    out = generate(model, prompts, cache=get_cache("dkv-decode", refresh_every=1), **kw)
    assert torch.equal(out.sequences, ref.sequences)
