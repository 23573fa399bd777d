"""Golden tests of each parallel-sampler rule on fixed logits against the plain restatements in
``tests/sampler_oracles.py`` (reference semantics, quirk options included)."""

from __future__ import annotations

import pytest
import sampler_oracles as O
import torch

from dllm.config import GenerateConfig
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
    Quota,
    Threshold,
    get_sampler,
)
from dllm.samplers.base import StepContext


def exclude_mask(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Logits with no mass on the mask id (in place)."""
    logits[..., mask_id] = float("-inf")
    return logits


def make_ctx(cand: torch.Tensor, *, x=None, win_lo=0, step=0, steps=4, n_start=None, global_step=0,
             total_steps=16, mask_id=0, eos_id=None, eot_id=None, canvas_len=None, gen_lo=0, region_lo=None,
             state=None, seed=0) -> StepContext:
    B, W = cand.shape
    if x is None:
        x = torch.where(cand, mask_id, 3)
    full = lambda v: torch.full((B,), v, dtype=torch.long) if not isinstance(v, torch.Tensor) else v  # noqa: E731
    return StepContext(
        x=x, cand=cand, step=full(step), steps=full(steps),
        n_region_start=full(n_start if n_start is not None else W), region_lo=full(region_lo if region_lo is not None else win_lo),
        region_hi=full(win_lo + W), win_lo=win_lo, canvas_len=canvas_len or win_lo + W, gen_lo=gen_lo,
        global_step=global_step, total_steps=total_steps, generator=torch.Generator().manual_seed(seed),
        mask_id=mask_id, eos_id=eos_id, eot_id=eot_id, state={} if state is None else state)


def random_conf(B, W, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    conf = torch.rand(B, W, generator=g)
    if ties:
        conf = (conf * 5).floor() / 5 + 0.1  # values in {0.1, 0.3, ..., 0.9}: many exact ties
    else:
        conf = conf ** 0.4  # plenty of values above 0.7
    cand = torch.rand(B, W, generator=g) < 0.7
    cand[0, 0] = True
    cand[-1] = False if B > 2 else cand[-1]  # one row without candidates
    return conf, cand


def rows_of(commit: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(r).flatten().tolist()) for r in commit]


CASES = [(B, W, seed, ties) for seed in range(6) for (B, W) in ((1, 1), (3, 7), (4, 33)) for ties in (False, True)]


@pytest.mark.parametrize(("B", "W", "seed", "ties"), CASES)
def test_threshold_and_factor_and_localleap_match_the_references(B, W, seed, ties):
    conf, cand = random_conf(B, W, seed, ties)
    ctx = make_ctx(cand)
    rows = [(conf[b].tolist(), cand[b].tolist()) for b in range(B)]
    for tau in (0.3, 0.9, 1.0):
        ours = rows_of(Threshold(tau).select(conf, ctx)[0])
        assert ours == [O.threshold_select(c, m, tau) for c, m in rows]
        ours = rows_of(Threshold(tau, max_slack=1e-5).select(conf, ctx)[0])
        assert ours == [O.dinfer_threshold_select(c, m, tau) for c, m in rows]
    for f in (0.7, 1.0, 1.9):
        for quirk in (False, True):
            ours = rows_of(Factor(f, quirk).select(conf, ctx)[0])
            assert ours == [O.factor_select(c, m, f, quirk) for c, m in rows], (f, quirk)
    for kappa, tau, r in ((0.9, 0.75, 4), (0.8, 0.5, 0), (0.95, 0.6, 1), (0.9, None, 4), (0.7, 0.7, 100)):
        ours = rows_of(LocalLeap(kappa, tau, r).select(conf, ctx)[0])
        assert ours == [O.localleap_select(c, m, kappa, tau, r) for c, m in rows], (kappa, tau, r)


def test_factor_quirk_accepts_the_failing_last_candidate():
    # sorted 0.99, 0.9, 0.2 with f = 1: thresholds -, 1 - 1/3, 1 - 1/4 -> the last fails
    conf = torch.tensor([[0.2, 0.99, 0.9]])
    cand = torch.ones(1, 3, dtype=torch.bool)
    ctx = make_ctx(cand)
    assert rows_of(Factor(1.0).select(conf, ctx)[0]) == [{1, 2}]
    assert rows_of(Factor(1.0, quirk=True).select(conf, ctx)[0]) == [{0, 1, 2}]
    # failing in the middle: no difference
    conf = torch.tensor([[0.2, 0.99, 0.3, 0.1]])
    ctx = make_ctx(torch.ones(1, 4, dtype=torch.bool))
    assert rows_of(Factor(1.0, quirk=True).select(conf, ctx)[0]) == [{1}]


def test_localleap_neighbourhood_counts_absolute_positions_and_reaches_outside_the_region():
    # window columns 0..9; region is columns 3..9; an anchor at 3 (conf 0.95) relaxes 4..7 (radius 4)
    conf = torch.tensor([[0.0, 0.0, 0.0, 0.95, 0.8, 0.2, 0.8, 0.8, 0.8, 0.5]])
    cand = torch.tensor([[False, False, False, True, True, True, False, True, True, True]])  # 6 decoded
    ctx = make_ctx(cand)
    commit = LocalLeap(0.9, 0.75, 4).select(conf, ctx)[0]
    assert rows_of(commit) == [{3, 4, 7}]  # 8 is 5 away; 6 is not a candidate; 5 below tau


@pytest.mark.parametrize("seed", range(4))
def test_quota_and_ascending_schedules(seed):
    conf, cand = random_conf(3, 12, seed)
    cand[:] = True
    for s in range(4):
        ctx = make_ctx(cand, step=s, steps=4, n_start=12)
        got = rows_of(Quota().select(conf, ctx)[0])
        k = O.llada_quota(12, 4)[s]
        assert got == [O.quota_select(conf[b].tolist(), cand[b].tolist(), k) for b in range(3)]


@pytest.mark.parametrize(("L", "steps", "blocks"), [(256, 8, 1), (128, 7, 1), (128, 7, 4), (64, 6, 3), (200, 7, 1),
                                                     (255, 7, 1), (32, 5, 2)])
def test_ascending_quota_matches_the_reference_schedule(L, steps, blocks):
    """Step through the reference's block layout with our rule (global power index) and compare quotas."""
    ref = O.ass_schedule(L, steps, blocks)
    gstep = 0
    rule = Ascending(steps=steps)
    for quotas in ref:
        left = sum(quotas)
        for q in quotas:
            cand = torch.zeros(1, left, dtype=torch.bool)
            cand[:] = True
            got = int(rule.quota(make_ctx(cand, global_step=gstep))[0])
            assert got == q, (L, blocks, gstep, ref)
            left -= q
            gstep += 1
        assert left == 0


def test_ascending_without_a_step_cap_finishes_once_the_remainder_is_small():
    quotas, left, i = [], 256, 0
    while left:
        q = int(Ascending().quota(make_ctx(torch.ones(1, left, dtype=torch.bool), global_step=i))[0])
        quotas.append(q)
        left -= q
        i += 1
    assert quotas == [1, 2, 4, 8, 16, 32, 64, 129]
    per_region = Ascending(per_region=True)
    assert int(per_region.quota(make_ctx(torch.ones(1, 9, dtype=torch.bool), step=0, global_step=5))[0]) == 1


@pytest.mark.parametrize("progress", ["step", "step-total", "ass", "decoded"])
def test_eos_rejection_factor_matches_the_reference(progress):
    G = 256
    for s in range(10):
        ctx = make_ctx(torch.ones(2, 4, dtype=torch.bool), step=s, steps=8, total_steps=32, global_step=s,
                       canvas_len=G + 5, gen_lo=5, n_start=8)
        g = EOSRejection(0.4, progress).factor(ctx)
        if progress == "step":
            want = O.eoser_factor(s, 8, 0.4)
        elif progress == "step-total":
            want = O.eoser_factor(s, 32, 0.4)
        elif progress == "ass":
            want = min(O.ass_eoser_factor(s, 8, 0.4), 1.0)
        else:
            want = 0.4 + 0.6 * 0.5  # 4 of 8 left
        assert g.tolist() == pytest.approx([want, want])


@pytest.mark.parametrize("confidence", ["prob", "margin", "neg_entropy", "random"])
def test_eos_rejection_attenuates_only_eos_proposals(confidence):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 10, generator=g)
    logits[:, ::2, 7] = 6.0  # EOS (7) is the argmax at even columns
    cand = torch.ones(2, 6, dtype=torch.bool)
    kw = dict(mask_id=9, eos_id=7, eot_id=8, step=0, steps=5)
    base = ComposedSampler(Quota(), confidence=confidence)
    eoser = ComposedSampler(Quota(), confidence=confidence, eos_rejection=EOSRejection(0.4))
    from dllm.samplers.scores import confidence_score

    l = exclude_mask(logits.clone(), 9)
    x0 = l.argmax(-1)
    c0 = confidence_score(l, x0, confidence, make_ctx(cand, **kw))
    c1, fac = EOSRejection(0.4).apply(c0, x0, make_ctx(cand, **kw))
    eos = x0 == 7
    assert eos.any() and (~eos).any()
    assert torch.allclose(c1[eos], c0[eos] * 0.4) and torch.equal(c1[~eos], c0[~eos])
    assert fac.tolist() == pytest.approx([0.4, 0.4])
    r0, r1 = base.step(l, make_ctx(cand, **kw)), eoser.step(l, make_ctx(cand, **kw))
    assert r1.info["eos_factor"].tolist() == pytest.approx([0.4, 0.4])
    assert torch.equal(r0.proposal, r1.proposal)


def test_credit_fusion_matches_dense_dinfer_credits_over_a_block():
    """Several steps of one block: our sparse table (slots >= steps: exact) vs dInfer's dense matrices."""
    B, W, V, steps = 2, 9, 40, 7
    g = torch.Generator().manual_seed(3)
    stage = CreditFusion(0.7, 0.8, 0.2, slots=8)
    dense = [O.DenseCredit(0.7, 0.8, 0.2) for _ in range(B)]
    state: dict = {}
    cand = torch.ones(B, W, dtype=torch.bool)
    base = torch.randn(B, W, V, generator=g) * 2
    for s in range(steps):
        # logits drift slowly so top-1 tokens repeat and credits accumulate
        logits = exclude_mask(base + 0.8 * torch.randn(B, W, V, generator=g), V - 1)
        ctx = make_ctx(cand, win_lo=4, canvas_len=4 + W + 3, mask_id=V - 1, state=state, region_lo=4)
        fused, top = stage.apply(logits, ctx)
        for b in range(B):
            want = dense[b].fuse(logits[b], cand[b], (4, 4 + W))
            assert torch.allclose(fused[b], want, atol=1e-5, rtol=1e-5), s
        assert torch.equal(top, logits.argmax(-1))
        cand = cand & (torch.rand(B, W, generator=g) < 0.85)  # some positions get decoded
        cand[:, 0] = True


def test_credit_sparse_table_evicts_the_smallest_credit():
    V, W = 12, 1
    stage = CreditFusion(1.0, 0.5, 1.0, slots=2)
    state: dict = {}
    cand = torch.ones(1, W, dtype=torch.bool)
    for tok in (3, 4, 5):  # three different top-1 tokens, two slots: token 3 (oldest, smallest) is evicted
        logits = torch.full((1, W, V), -5.0)
        logits[0, 0, tok] = 5.0
        fused, _ = stage.apply(exclude_mask(logits, V - 1), make_ctx(cand, mask_id=V - 1, state=state))
    tok = state["credit"]["tok"][0, 0]
    assert sorted(tok.tolist()) == [4, 5]
    assert fused[0, 0, 3] == -5.0 and fused[0, 0, 4] > -5.0


def test_credit_resets_when_the_region_changes():
    V = 10
    stage = CreditFusion()
    state: dict = {}
    cand = torch.ones(1, 4, dtype=torch.bool)
    logits = exclude_mask(torch.randn(1, 4, V, generator=torch.Generator().manual_seed(1)), V - 1)
    stage.apply(logits, make_ctx(cand, mask_id=V - 1, state=state, region_lo=0, canvas_len=12))
    assert state["credit"]["val"].sum() > 0
    stage.apply(logits, make_ctx(cand, win_lo=4, mask_id=V - 1, state=state, region_lo=4, canvas_len=12))
    assert state["credit"]["val"][:, :4].sum() == 0  # the old region's credits are gone


def test_klass_matches_the_reference_within_a_block():
    B, W, V = 2, 8, 30
    g = torch.Generator().manual_seed(5)
    rule = KLStable(conf_threshold=0.5, kl_threshold=0.05, history=2)
    sampler = ComposedSampler(rule)
    rows = [O.KLASSRow(2) for _ in range(B)]
    state: dict = {}
    base = torch.randn(B, W, V, generator=g) * 3
    x = torch.full((B, W), V - 1)
    fired = 0
    for s in range(W):
        logits = exclude_mask(base + 0.05 * s * torch.randn(B, W, V, generator=g), V - 1)
        cand = x == V - 1
        ctx = make_ctx(cand, x=x, step=s, steps=W, n_start=W, mask_id=V - 1, state=state, region_lo=0)
        res = sampler.step(logits, ctx)
        probs = torch.softmax(logits, -1)
        conf = probs.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
        for b in range(B):
            if not cand[b].any():
                continue
            want = rows[b].select(probs[b], conf[b].tolist(), cand[b].tolist(), O.llada_quota(W, W)[s], 0.5, 0.05)
            assert rows_of(res.commit[b : b + 1])[0] == want, (s, b)
        fired += int(res.info["klass_ready"].sum())
        x = torch.where(res.commit, res.proposal, x)
    assert fired > 0, "the KL-stable path never fired; adjust the test logits"


def _klass_kl_values(state):
    """The KL values the lazy KLStable has computed for the steps it keeps (``nan``: not computed)."""
    return [r.kl.clone() for r in state["klass"]["steps"]]


def _klass_shifting_window_run(monkeypatch, chunk_bytes, sampler=None):
    """KLASS steps over a canvas of 12 columns whose window start moves (0, 1, 2, ...) while the region stays,
    three rows with different masks; per step the proposals, commits, ``klass_ready`` and the KL values
    computed for the kept steps."""
    monkeypatch.setattr(KLStable, "chunk_bytes", chunk_bytes)
    B, T, V = 3, 12, 30
    g = torch.Generator().manual_seed(11)
    sampler = sampler or ComposedSampler(KLStable(conf_threshold=0.3, kl_threshold=0.05, history=2))
    base = torch.randn(B, T, V, generator=g) * 3
    x = torch.full((B, T), V - 1)
    x[:, :2] = 4  # the first two columns are decoded: the window may start before or after them
    x[1, 2:5] = 7  # rows 1 and 2 have fewer masks: the rows' masked columns differ
    x[2, 6:8] = 7
    state: dict = {}
    out = []
    for s in range(T):
        win_lo = s % 3
        logits = exclude_mask(base[:, win_lo:] + 0.03 * s * torch.randn(B, T - win_lo, V, generator=g), V - 1)
        xw = x[:, win_lo:]
        cand = xw == V - 1
        if not cand.any():
            break
        ctx = make_ctx(cand, x=xw, win_lo=win_lo, step=s, steps=T, n_start=T, mask_id=V - 1, state=state,
                       region_lo=0, canvas_len=T)
        res = sampler.step(logits, ctx)
        out.append((res.proposal.clone(), res.commit.clone(), res.info["klass_ready"].clone(),
                    _klass_kl_values(state)))
        x[:, win_lo:] = torch.where(res.commit & cand, res.proposal, xw)
    return out


ONE_PASS = 1 << 40  # chunk_bytes: the whole window in one chunk (the GPU layout)


def _klass_row_windows_run(per_row: bool, sampler=None, rows_from: int | None = None):
    """KLASS over a canvas of 12 columns, three rows whose windows of 10 start at their own moving columns (row ``b``
    at ``(step + b) % 3``): per step and row the proposals, commits, ``klass_ready`` and the KL values kept, from one
    batch with per-row windows (``win_lo`` a ``[B, 1]`` tensor) or from each row alone (an int window start; from step
    ``rows_from`` on a ``[1, 1]`` tensor: the switch to the per-row form after lazy steps)."""
    import dataclasses

    B, T, V, W = 3, 12, 30, 10
    g = torch.Generator().manual_seed(11)
    base = torch.randn(B, T, V, generator=g) * 3
    noise = torch.randn(T, B, T, V, generator=g)
    x = torch.full((B, T), V - 1)
    x[:, :2] = 4
    x[1, 2:5] = 7
    x[2, 6:8] = 7
    groups = [list(range(B))] if per_row else [[b] for b in range(B)]
    runs = {}
    for rows in groups:
        sampler_g = sampler or ComposedSampler(KLStable(conf_threshold=0.3, kl_threshold=0.05, history=2))
        state: dict = {}
        xs = x[rows].clone()
        for s in range(8):
            lo = torch.tensor([[(s + b) % 3] for b in rows])
            cols = lo + torch.arange(W)[None]
            logits = exclude_mask(torch.stack([base[b, c] + 0.03 * s * noise[s, b, c] for b, c in zip(rows, cols)]),
                                  V - 1)
            xw = xs.gather(1, cols)
            cand = xw == V - 1
            ctx = make_ctx(cand, x=xw, win_lo=0, step=s, steps=T, n_start=T, mask_id=V - 1, state=state,
                           region_lo=0, canvas_len=T)
            ctx = dataclasses.replace(ctx, region_hi=torch.full((len(rows),), T),
                                      win_lo=lo if per_row or s >= (rows_from or 99) else int(lo[0, 0]))
            res = sampler_g.step(logits, ctx)
            for i, b in enumerate(rows):
                runs.setdefault(b, []).append((res.proposal[i].clone(), res.commit[i].clone(),
                                               res.info["klass_ready"][i].clone(),
                                               [k[i].clone() for k in _klass_kl_values(state)]))
            xs.scatter_(1, cols, torch.where(res.commit & cand, res.proposal, xw))
    return runs


@pytest.mark.parametrize("preset", [False, True])
def test_klass_with_per_row_windows_equals_each_row_alone(preset):
    """Per-row windows (the decode loop's, ``SamplerBase.row_windows``): KLASS's kept steps are read at each row's own
    columns (every KL at every step), and each row's proposals, commits, readiness and KL values are those of the row
    alone with its window as the batch's (the lazy KL where it computed one), bit for bit; the ``klass`` preset's
    chunked CPU path alike (per-row windows take the one-pass form)."""
    sampler = get_sampler("klass", conf_threshold=0.3, kl_threshold=0.05).sampler if preset else None
    batch, alone = _klass_row_windows_run(True, sampler), _klass_row_windows_run(False, sampler)
    fired = 0
    for b in range(3):
        assert len(batch[b]) == len(alone[b]) == 8
        for got, want in zip(batch[b], alone[b]):
            for u, v in zip(got[:3], want[:3]):
                assert torch.equal(u, v), b
            fired += int(got[2])
            for u, v in zip(got[3], want[3]):
                both = ~torch.isnan(u) & ~torch.isnan(v)
                assert torch.equal(u[both], v[both]), b
    assert fired > 0, "the KL-stable path never fired; adjust the test logits"


@pytest.mark.parametrize("rows_from", [1, 2])
def test_klass_switching_to_per_row_windows_after_lazy_steps_decides_alike(rows_from):
    """A row whose window becomes per row after steps of the lazy KL (the serving engine: rows join a row decoded
    alone on the CPU): the dense form first computes what the lazy steps left out (``_KLHistory.complete``), and every
    step's proposals, commits, readiness and KL values are those of the lazy run throughout."""
    switched, lazy = _klass_row_windows_run(False, rows_from=rows_from), _klass_row_windows_run(False)
    fired = 0
    for b in range(3):
        for s, (got, want) in enumerate(zip(switched[b], lazy[b])):
            for u, v in zip(got[:3], want[:3]):
                assert torch.equal(u, v), (b, s)
            fired += int(got[2]) if s >= rows_from else 0
            for u, v in zip(got[3], want[3]):
                both = ~torch.isnan(u) & ~torch.isnan(v)
                assert torch.equal(u[both], v[both]), (b, s)
    assert fired > 0, "the KL-stable path never fired after the switch"


def _same_runs(first, second):
    assert len(first) == len(second) > 4
    for a, b in zip(first, second):
        for u, v in zip(a[:3], b[:3]):
            assert torch.equal(u, v)
        assert len(a[3]) == len(b[3])
        for u, v in zip(a[3], b[3]):  # KL values computed in both (nan: not computed; the set depends on the
            both = ~torch.isnan(u) & ~torch.isnan(v)  # chunking) are the same, bit for bit
            assert torch.equal(u[both], v[both])
    assert sum(int(r[2].sum()) for r in first) > 0, "the KL-stable path never fired; adjust the test logits"
    assert sum(int(torch.isfinite(u).sum()) for r in first for u in r[3]) > 10


@pytest.mark.parametrize("rows_per_chunk", [1, 3])
def test_klass_chunked_kl_equals_the_one_pass_kl(monkeypatch, rows_per_chunk):
    """On CPU the KL runs in cache-sized chunks of window rows, only over rows still masked in some batch row;
    every KL a masked position has is the one-pass value, bit for bit, and so are the commits."""
    whole = _klass_shifting_window_run(monkeypatch, ONE_PASS)
    chunked = _klass_shifting_window_run(monkeypatch, rows_per_chunk * 3 * 30 * 4)  # B * V * 4 bytes per row
    _same_runs(whole, chunked)


@pytest.mark.parametrize("softmax_dtype", ["float32", "float64"])
@pytest.mark.parametrize("rows_per_chunk", [1, 3, None])
def test_klass_preset_fused_path_equals_the_composed_path(monkeypatch, rows_per_chunk, softmax_dtype):
    """The ``klass`` preset's CPU path (proposal, softmax and KL per chunk of rows) reproduces
    ``ComposedSampler(KLStable(...))`` bit for bit: proposals, commits, readiness and KL history."""
    from dllm.samplers.presets import KLASSSampler

    chunk = ONE_PASS if rows_per_chunk is None else rows_per_chunk * 3 * 30 * (8 if softmax_dtype == "float64" else 4)
    preset = get_sampler("klass", conf_threshold=0.3, kl_threshold=0.05, softmax_dtype=softmax_dtype).sampler
    assert isinstance(preset, KLASSSampler) and preset._chunked(torch.zeros(1, 1, 1), make_ctx(torch.ones(1, 1) > 0))
    composed = ComposedSampler(KLStable(conf_threshold=0.3, kl_threshold=0.05), softmax_dtype=softmax_dtype)
    _same_runs(_klass_shifting_window_run(monkeypatch, ONE_PASS, composed),
               _klass_shifting_window_run(monkeypatch, chunk, preset))
    # the fused proposal and confidence are the whole-window argmax and softmax, bit for bit
    g = torch.Generator().manual_seed(3)
    logits = exclude_mask(torch.randn(3, 7, 3000, generator=g) * 4, 2999)
    cand = torch.ones(3, 7, dtype=torch.bool)
    monkeypatch.setattr(KLStable, "chunk_bytes", 2 * 3 * 3000 * 4)
    x0, conf, _ = preset.rule.fused_step(logits, make_ctx(cand, mask_id=2999), softmax_dtype)
    dt = torch.float64 if softmax_dtype == "float64" else torch.float32
    assert torch.equal(x0, logits.argmax(-1))
    assert torch.equal(conf, torch.softmax(logits.to(dt), -1).gather(-1, x0[..., None]).squeeze(-1))


class _EagerKLASS:
    """The eager form of KLStable's stable mask (what the rule computed before its KL became lazy): every step
    the KL of every window position against the previous step (``inf`` where the position was not in the
    previous window or the row's region changed), a per-canvas-column history of the last ``history`` values
    shifted at the window's columns only, reset when a row's region changes."""

    def __init__(self, rule, B, T, dt):
        self.rule, self.dt = rule, dt
        self.hist = torch.full((B, T, rule.history), float("inf"))
        self.prev = None

    def step(self, logits, ctx):
        l = logits.to(self.dt)
        p = torch.softmax(l, -1)
        lse = l.amax(-1) - torch.log(p.amax(-1))
        B, W, _ = l.shape
        kl = torch.full((B, W), float("inf"), dtype=self.dt)
        if self.prev is not None:
            pl, plse, plo, preg = self.prev
            same = preg == ctx.region_lo
            self.hist[~same] = float("inf")
            for w in range(W):
                v = w + ctx.win_lo - plo
                if 0 <= v < pl.shape[1]:
                    d = torch.nansum((l[:, w] - pl[:, v].to(self.dt)) * p[:, w], -1)
                    kl[:, w] = (d - lse[:, w] + plse[:, v]).clamp_min(0)
            kl[~same] = float("inf")
        hw = self.hist[:, ctx.win_lo : ctx.win_lo + W]
        hw.copy_(torch.cat([hw[..., 1:], kl.float()[..., None]], -1))
        self.prev = (logits, lse, ctx.win_lo, ctx.region_lo.clone())
        return (hw < self.rule.kl_threshold).all(-1), kl.float(), p


@pytest.mark.parametrize("history", [1, 2, 3])
@pytest.mark.parametrize(("path", "softmax_dtype"), [("fused", "float32"), ("fused", "float64"),
                                                     ("composed", "float32"), ("composed", "float64")])
def test_klass_lazy_kl_commits_what_the_eager_history_commits(monkeypatch, path, softmax_dtype, history):
    """The lazy KL (only at confident candidates, past distributions recomputed from the kept logits) against
    the eager per-step history: three rows with different masks, a window start that moves (0, 1, 2, 1, ...)
    and regions that change at different steps per row; the same proposals, commits and ``klass_ready`` at
    every step, and every KL value the lazy form computed equals the eager one (bit for bit)."""
    from dllm.samplers.presets import KLASSSampler

    B, T, V = 3, 20, 40
    dt = torch.float64 if softmax_dtype == "float64" else torch.float32
    rule = KLStable(conf_threshold=0.3, kl_threshold=0.05, history=history)
    row_bytes = B * V * (8 if softmax_dtype == "float64" else 4)
    if path == "fused":  # chunks of one window row
        monkeypatch.setattr(KLStable, "chunk_bytes", row_bytes)
        sampler = KLASSSampler(rule, softmax_dtype=softmax_dtype)
        assert sampler._chunked(torch.zeros(1, 1, 1), make_ctx(torch.ones(1, 1) > 0))
    else:  # chunks of three window rows, or the whole window (the GPU layout)
        monkeypatch.setattr(KLStable, "chunk_bytes", 3 * row_bytes if history != 2 else ONE_PASS)
        sampler = ComposedSampler(rule, softmax_dtype=softmax_dtype)
    eager = _EagerKLASS(rule, B, T, dt)
    g = torch.Generator().manual_seed(21)
    base = torch.randn(B, T, V, generator=g) * 3
    x = torch.full((B, T), V - 1)
    x[0, [0, 5]] = 4
    x[1, 2:4] = 7
    x[2, [1, 9, 12]] = 7
    switch = torch.tensor([5, 8, 11])  # the step at which each row's region [0, 8) becomes [8, 20)
    state: dict = {}
    prev_kl, prev_hot = None, torch.zeros(B, T, dtype=torch.bool)
    fired = fired_after_switch = revived = 0
    for s in range(16):
        win_lo = (0, 1, 2, 1)[s % 4]
        region_lo = torch.where(s >= switch, 8, 0)
        step = 0.1 * torch.randn(B, T, V, generator=g)  # a random walk: a slow drift
        step[:, ::3] *= 6  # some columns drift faster: KL values on both sides of the threshold
        base += step
        logits = exclude_mask(base[:, win_lo:].clone(), V - 1)
        xw = x[:, win_lo:]
        cols = torch.arange(win_lo, T)
        cand = (xw == V - 1) & (cols[None] >= region_lo[:, None]) & (cols[None] < region_lo[:, None] + 8 + 4 * (region_lo[:, None] > 0))
        ctx = make_ctx(cand, x=xw, win_lo=win_lo, step=s, steps=T, n_start=T, mask_id=V - 1, state=state,
                       region_lo=region_lo, canvas_len=T)
        res = sampler.step(logits, ctx)
        stable, kl, p = eager.step(logits, ctx)
        x0 = logits.argmax(-1)
        conf = p.gather(-1, x0[..., None]).squeeze(-1)
        want, info = rule.decide(conf, ctx, stable)
        assert torch.equal(res.proposal, torch.where(cand, x0, xw)), s
        assert torch.equal(res.commit, want), s
        assert torch.equal(res.info["klass_ready"], info["klass_ready"]), s
        kept = state["klass"]["steps"]
        assert len(kept) == min(s + 1, history)
        for got, ref in zip(reversed(kept), (kl, prev_kl)):  # this step's and (history > 1) the previous one's
            done = ~torch.isnan(got.kl)
            assert torch.equal(got.kl[done], ref[done]), s
        assert not torch.isnan(kept[-1].kl[cand & (conf > rule.conf_threshold)]).any()  # computed where confident
        ready = cand & stable & (conf > rule.conf_threshold)
        fired += int(ready.sum())
        fired_after_switch += int(ready[s >= switch + history].sum())
        hot = torch.zeros(B, T, dtype=torch.bool)
        hot[:, win_lo:] = cand & (conf > rule.conf_threshold)
        revived += int((ready & ~prev_hot[:, win_lo:]).sum())  # stable, but not confident at the step before
        prev_kl, prev_hot = kl, hot
        x[:, win_lo:] = torch.where(res.commit, res.proposal, xw)
    assert fired > 10 and fired_after_switch > 0, "the KL-stable path never fired; adjust the test logits"
    if history > 1:  # their earlier KL values were not computed when needed: recomputed from the kept logits
        assert revived > 0, "no position became KL-stable without having been confident; adjust the test logits"


@pytest.mark.parametrize("span", ["region", "0:3", "masked"])
def test_prophet_gap_and_schedule_match_the_reference(span):
    g = torch.Generator().manual_seed(2)
    B, W, V = 3, 10, 16
    logits = exclude_mask(torch.randn(B, W, V, generator=g) * 3, V - 1)
    cand = torch.rand(B, W, generator=g) < 0.6
    cand[:, 1] = True
    x = torch.where(cand, V - 1, 4)
    inner = get_sampler("llada")
    top2 = torch.topk(logits, 2, -1).values
    gap = (top2[..., 0] - top2[..., 1])
    for gstep, total in ((0, 100), (40, 100), (80, 100)):
        for thr_scale in (0.5, 1.0, 2.0):
            p = Prophet(inner, early=7.5 * thr_scale, mid=5.0 * thr_scale, late=2.5 * thr_scale, span=span)
            ctx = make_ctx(cand, x=x, mask_id=V - 1, global_step=gstep, total_steps=total, steps=W, n_start=W)
            res = p.step(logits, ctx)
            for b in range(B):
                if span == "region" or span == "masked":
                    cols = torch.nonzero(cand[b]).flatten().tolist()
                else:
                    cols = [0, 1, 2]
                mean = sum(float(gap[b, c]) for c in cols) / len(cols)
                want = O.prophet_should_exit(gstep + 1, total, mean, 7.5 * thr_scale, 5.0 * thr_scale, 2.5 * thr_scale)
                assert bool(res.finish[b]) == want
                if want:  # every masked column takes the argmax; all candidates are committed
                    assert torch.equal(res.commit[b], cand[b])
                    assert torch.equal(res.proposal[b][x[b] == V - 1], logits[b].argmax(-1)[x[b] == V - 1])


def test_adablock_block_length_matches_compute_block_length():
    """Random logits with delimiters planted: refine() vs the reference's compute_block_length per row."""
    V, G, P = 20, 32, 3
    ids = [5, 6]
    cfg = GenerateConfig(gen_length=G, block_length=None)
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        B = 4
        T = P + G
        logits = torch.randn(B, T, V, generator=g)
        for b in range(B):  # plant some delimiters with varying confidence
            for c in torch.randint(P, T, (3,), generator=g).tolist():
                logits[b, c, ids[c % 2]] = float(torch.rand(1, generator=g)) * 6
        logits = exclude_mask(logits, V - 1)
        policy = AdaBlock(block_length=8, delimiter_threshold=0.3, delimiters=tuple(ids))
        done = torch.tensor([0, 4, 9, 20])  # tokens generated before this block, per row
        lo = P + done
        hi, steps = policy.next_region(lo, T, cfg)
        win_lo = int(lo.min())
        new_hi, _, info = policy.refine(logits[:, win_lo:], win_lo, lo, hi, steps, torch.ones(B, dtype=torch.bool), cfg)
        pred = logits.argmax(-1)
        for b in range(B):
            want = O.adablock_length(logits[b], pred[b], int(lo[b]), G, int(done[b]), 8, ids, 0.3)
            assert int(new_hi[b] - lo[b]) == want, (seed, b)
        assert info["block_start"].all()


def test_composed_quota_is_llada():
    """ComposedSampler(Quota()) reproduces LLaDASampler step for step (same helpers, same stream)."""
    g = torch.Generator().manual_seed(0)
    logits = exclude_mask(torch.randn(3, 9, 30, generator=g), 29)
    cand = torch.rand(3, 9, generator=g) < 0.8
    cand[:, 0] = True
    for T in (0.0, 0.9):
        for dtype in ("float32", "float64", "model"):
            a = get_sampler("llada", temperature=T, softmax_dtype=dtype, noise_scope="canvas")
            b = ComposedSampler(Quota(), temperature=T, softmax_dtype=dtype, noise_scope="canvas")
            ra = a.step(logits, make_ctx(cand, mask_id=29, step=1, steps=4, n_start=9, canvas_len=14))
            rb = b.step(logits, make_ctx(cand, mask_id=29, step=1, steps=4, n_start=9, canvas_len=14))
            assert torch.equal(ra.commit, rb.commit) and torch.equal(ra.proposal, rb.proposal)


def test_credit_sparse_proposal_equals_the_dense_fused_logits():
    """``propose`` (greedy, never materialises the fused logits) vs ``apply`` + argmax + softmax."""
    B, W, V = 3, 11, 50
    g = torch.Generator().manual_seed(9)
    stage = CreditFusion(1.3, 0.9, 0.5, slots=4)
    s_sparse: dict = {}
    s_dense: dict = {}
    base = torch.randn(B, W, V, generator=g) * 2
    cand = torch.ones(B, W, dtype=torch.bool)
    for step in range(8):
        logits = base + torch.randn(B, W, V, generator=g)
        if step % 3 == 2:
            logits = logits.round()  # exact ties between tokens
        logits = exclude_mask(logits, V - 1)
        kw = dict(mask_id=V - 1, region_lo=2, win_lo=2, canvas_len=2 + W)
        x0, conf, top = stage.propose(logits, make_ctx(cand, state=s_sparse, **kw))
        fused, top_d = stage.apply(logits, make_ctx(cand, state=s_dense, **kw))
        want_x0 = fused.argmax(-1)
        assert torch.equal(top, top_d)
        assert torch.equal(x0, want_x0), step
        assert torch.allclose(conf, torch.softmax(fused, -1).gather(-1, want_x0[..., None]).squeeze(-1), rtol=1e-5)
        cand = cand & (torch.rand(B, W, generator=g) < 0.8)
        cand[:, 0] = True


def test_fast_argmax_and_top2_match_torch_at_large_vocabularies():
    from dllm.samplers.base import fast_argmax, top2_values

    for V in (2048, 2049, 126_464 // 8, 5000):
        for kind in range(3):
            g = torch.Generator().manual_seed(V + kind)
            x = torch.randn(2, 3, V, generator=g) if kind == 0 else torch.randint(0, 4, (2, 3, V), generator=g).float()
            if kind == 2:
                x[..., : V // 2] = float("-inf")
            assert torch.equal(fast_argmax(x), x.argmax(-1))
            assert torch.equal(top2_values(x), torch.topk(x, 2, -1).values)


def test_entropy_bound_commits_the_prefix_whose_entropy_less_its_largest_is_within_gamma():
    """EB-Sampler's rule against a direct computation: Categorical entropies sorted ascending, the prefix with
    cumsum - cummax <= gamma, at least one; non-candidates never committed."""
    from types import SimpleNamespace

    from dllm.samplers.rules import EntropyBound

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, 40, generator=g) * torch.tensor([0.5, 3.0, 8.0])[:, None, None]
    cand = torch.rand(3, 10, generator=g) < 0.7
    cand[:, 0] = True
    for gamma in (0.0, 0.05, 0.5, 5.0):
        commit, info = EntropyBound(gamma).select(None, SimpleNamespace(cand=cand), logits=logits)
        for b in range(3):
            idx = cand[b].nonzero().flatten()
            ent = torch.distributions.Categorical(logits=logits[b, idx]).entropy()
            order = torch.argsort(ent, stable=True)
            srt = ent[order]
            k = max(1, int(((srt.cumsum(0) - srt.cummax(0).values) <= gamma).sum()))
            expect = torch.zeros(10, dtype=torch.bool)
            expect[idx[order[:k]]] = True
            assert torch.equal(commit[b], expect), (gamma, b)
            assert int(info["accepted"][b]) == k
    with pytest.raises(ValueError, match="gamma"):
        EntropyBound(-0.1)


def test_entropy_threshold_commits_low_entropy_candidates_and_the_lowest_one():
    """d3LLM's rule against a direct computation (float64 softmax, -sum p log(p + 1e-12))."""
    from types import SimpleNamespace

    from dllm.samplers.rules import EntropyThreshold

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 9, 30, generator=g) * torch.tensor([0.5, 4.0, 10.0])[:, None, None]
    cand = torch.rand(3, 9, generator=g) < 0.6
    cand[:, 2] = True
    for thr in (0.0, 0.3, 1.5, 10.0):
        commit, _ = EntropyThreshold(thr).select(None, SimpleNamespace(cand=cand), logits=logits)
        p = torch.softmax(logits.double(), -1)
        ent = -(p * torch.log(p + 1e-12)).sum(-1)
        for b in range(3):
            idx = cand[b].nonzero().flatten().tolist()
            best = min(idx, key=lambda i: (float(ent[b, i]), i))
            expect = {i for i in idx if float(ent[b, i]) <= thr} | {best}
            assert set(commit[b].nonzero().flatten().tolist()) == expect, (thr, b)
    with pytest.raises(ValueError, match="threshold"):
        EntropyThreshold(-1.0)


@pytest.mark.parametrize("max_slack", [0.0, 0.05])
def test_threshold_commits_already_progress_so_the_composed_sampler_skips_its_own_pass(max_slack):
    """``Threshold.ensures_progress``: its commit lies within the candidates and holds each row's most confident one,
    so ComposedSampler's ``ensure_progress(commit & cand, only_empty=True)`` would return it unchanged (it is skipped)."""
    from dllm.samplers.base import ensure_progress
    from dllm.samplers.rules import Threshold

    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        cand = torch.rand(6, 9, generator=g) < 0.5
        cand[0] = False  # a row without candidates
        conf = torch.rand(6, 9, generator=g)
        conf[1] = 0.95  # ties above tau
        conf[2, :4] = conf[2, 5:].max()  # ties at the row's best
        rule = Threshold(0.8, max_slack)
        commit, _ = rule.select(conf, make_ctx(cand))
        assert rule.ensures_progress
        assert torch.equal(ensure_progress(commit & cand, conf, cand, only_empty=True), commit)
        assert not (commit & ~cand).any() and torch.equal(commit.any(-1), cand.any(-1))
