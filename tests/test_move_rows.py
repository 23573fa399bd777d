"""Per-row state moving with the rows of its batch (what the serving engine does when requests leave and join):
the shared tensor helper :func:`dllm.ops.moved_rows`, the samplers' ``move_rows`` hooks (a composed sampler's
stages, wrappers forwarding to what they wrap) and the caches' (K/V buffers and a policy's own state)."""

from __future__ import annotations

import math

import torch

from dllm.caches import BlockExact, FreeCache
from dllm.ops import moved_rows
from dllm.samplers.composed import ComposedSampler
from dllm.samplers.prophet import Prophet
from dllm.samplers.rules import KLStable, _KLStep
from dllm.samplers.transforms import CreditFusion, TopP


def test_moved_rows_selects_shifts_and_appends_in_order():
    t = torch.arange(2 * 3 * 4).reshape(2, 3, 4)
    keep = torch.tensor([1])
    out = moved_rows(t, keep, 2, d=2, dim=2, pad=-7, fill=9)  # row 1, two columns of -7 on the left, two rows of 9
    want = torch.cat([torch.full((1, 3, 2), -7), t[1:]], 2)
    assert torch.equal(out, torch.cat([want, torch.full((2, 3, 6), 9)]))
    cropped = moved_rows(t, None, d=-1, dim=2)  # the first column cropped
    assert torch.equal(cropped, t[:, :, 1:]) and cropped.is_contiguous()
    assert torch.equal(moved_rows(t, torch.tensor([1, 0])), t.flip(0))
    # column indices: the values shift with the columns (the appended rows take ``fill``, unshifted)
    assert moved_rows(torch.tensor([3, 5]), torch.tensor([1, 0]), 1, d=2, shift=True, fill=-1).tolist() == [7, 5, -1]
    assert moved_rows(torch.tensor([3, 5]), None, d=-2, shift=True).tolist() == [1, 3]
    assert moved_rows(t, None) is t  # nothing moves
    mask = moved_rows(torch.ones(2, 3, dtype=torch.bool), None, 1, d=1, dim=1, pad=False, fill=False)
    assert mask.tolist() == [[False, True, True, True], [False, True, True, True], [False] * 4]


def _state(B: int = 3, T: int = 6, W: int = 4, V: int = 5, slots: int = 2) -> dict:
    g = torch.Generator().manual_seed(0)
    step = _KLStep(torch.randn(B, W, V, generator=g), 2, torch.tensor([2, 3, 2]), torch.randn(B, W, generator=g),
                   torch.rand(B, W, generator=g))
    return {"credit": {"tok": torch.randint(0, V, (B, T, slots), generator=g),
                       "val": torch.rand(B, T, slots, generator=g), "region": torch.tensor([2, 3, 2])},
            "klass": {"steps": [step]},
            ("dream_ratio", 0.001, 8): torch.ones(9, 9)}  # a table shared by all rows: not per row, left alone


def test_a_composed_samplers_stages_move_their_state_through_every_wrapper():
    """The credit tables (canvas-indexed, and their region starts) and KLASS's kept steps (window-indexed:
    ``lo`` shifts, a joining row has no history) move with the rows whether the sampler is called directly, behind
    a nucleus cut or under Prophet."""
    composed = ComposedSampler(KLStable(), credit=CreditFusion(slots=2))
    for sampler in (composed, TopP(composed, 0.5), Prophet(TopP(composed, 0.5))):
        state = _state()
        credit, step = dict(state["credit"]), state["klass"]["steps"][0]
        keep = torch.tensor([2, 0])
        sampler.move_rows(state, 1, keep, 1, canvas=torch.zeros(1, 7, dtype=torch.long), gen_lo=3, eos_id=0)
        tok = state["credit"]["tok"]
        assert tok.shape == (3, 7, 2)
        assert torch.equal(tok[:2, 1:], credit["tok"][[2, 0]]) and not tok[:, 0].any() and not tok[2].any()
        assert torch.equal(state["credit"]["val"][:2, 1:], credit["val"][[2, 0]])
        assert state["credit"]["region"].tolist() == [3, 3, 0]
        (moved,) = state["klass"]["steps"]
        assert moved.lo == 3 and moved.region.tolist() == [3, 3, -1]
        assert torch.equal(moved.logits[:2], step.logits[[2, 0]]) and not moved.logits[2].any()
        assert torch.equal(moved.kl[:2], step.kl[[2, 0]]) and moved.kl[2].eq(math.inf).all()
        assert state[("dream_ratio", 0.001, 8)].shape == (9, 9)
        # leaving: the first row goes, the canvas is cropped by one column
        sampler.move_rows(state, -1, torch.tensor([1, 2]), 0)
        assert state["credit"]["tok"].shape == (2, 6, 2) and state["credit"]["region"].tolist() == [2, -1]
        assert state["klass"]["steps"][0].lo == 2 and state["klass"]["steps"][0].region.tolist() == [2, -2]


def test_samplers_without_per_row_state_move_nothing():
    state = {"x": torch.ones(2)}
    ComposedSampler().move_rows(state, 1, torch.tensor([0]), 1)
    ComposedSampler(KLStable(), credit=CreditFusion()).move_rows(state, 1, None, 1)  # no tables written yet
    assert list(state) == ["x"]


def test_a_cache_moves_its_buffers_and_its_own_per_row_state():
    """:meth:`KVCache.move_rows`: the K/V buffers re-padded on the canvas axis, selected and extended with empty
    rows; FreeCache's region starts and the block cache's final columns (at least 0) shift with the columns."""
    g = torch.Generator().manual_seed(0)
    for cache in (FreeCache(), BlockExact(4)):
        cache.reset(3, 5)
        k = [torch.randn(3, 2, 5, 4, generator=g), None]
        cache.k, cache.v = list(k), [t.clone() if t is not None else None for t in k]
        if isinstance(cache, FreeCache):
            cache.cur_lo = torch.tensor([1, 2, 3])
        else:
            cache.final = torch.tensor([0, 2, 4])
        cache.move_rows(2, torch.tensor([2, 1]), 1)
        for buf in (cache.k, cache.v):
            assert buf[1] is None and buf[0].shape == (3, 2, 7, 4)
            assert torch.equal(buf[0][:2, :, 2:], k[0][[2, 1]]) and not buf[0][:, :, :2].any() and not buf[0][2].any()
        if isinstance(cache, FreeCache):
            assert cache.cur_lo.tolist() == [5, 4, 0]
        else:
            assert cache.final.tolist() == [6, 4, 0]
            cache.move_rows(-5, None, 0)
            assert cache.final.tolist() == [1, 0, 0] and cache.k[0].shape == (3, 2, 2, 4)
