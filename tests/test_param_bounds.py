"""Every constructor parameter of the block policies and the caches is checked when the object is built: integers
are real integers (no bool, no float) within ``[lo, MAX_INT_PARAM]``, floats finite and in range, choices known;
each error is a ValueError naming the parameter (its range and a fix), not a late OverflowError or TypeError."""

from __future__ import annotations

import functools
import math
import re

import pytest

from dllm.blocks import AdaBlock, AlignedBlocks, FixedBlocks, MultiBlock, SlidingWindow, WholeCanvas
from dllm.caches import (
    CACHES,
    BlockExact,
    DKVDecode,
    DKVGreedy,
    DualCache,
    ElasticCache,
    FreeCache,
    PrefixCache,
    get_cache,
)
from dllm.samplers.base import MAX_INT_PARAM

NAN, INF = float("nan"), float("inf")
#: bad values of an integer parameter: a bool, a float (even a whole one), NaN, +-inf, negative, past int64
BAD_INT = [True, False, 4.0, 2.5, NAN, INF, -INF, -1, 2**63, MAX_INT_PARAM + 1, "4", None]
#: bad values of a float parameter in [0, 1]
BAD_UNIT = [True, NAN, INF, -INF, -0.1, 1.5, 2**63, "0.5", None]

# (class, parameter, lowest valid integer, accepts None)
INT_PARAMS = [
    (FixedBlocks, "block_length", 1, True),
    (AdaBlock, "block_length", 1, True),
    (AlignedBlocks, "block_length", 1, True),
    (MultiBlock, "block_length", 1, False),
    (SlidingWindow, "window", 1, True),  # None: the model family's window
    (PrefixCache, "refresh_every", 1, True),
    (DualCache, "refresh_every", 1, True),
    (DKVGreedy, "refresh_every", 1, True),
    (FreeCache, "refresh_every", 1, True),
    (ElasticCache, "refresh_every", 1, True),
    (ElasticCache, "track_num", 1, False),
    (DKVDecode, "refresh_every", 1, True),
    (DKVDecode, "full_steps", 0, False),
    (BlockExact, "block_size", 1, True),
]
# (class, parameter, lo, hi, lo_open)
UNIT_PARAMS = [
    (AdaBlock, "delimiter_threshold", 0, 1, False),
    (AdaBlock, "window", 0, 1, True),
    (MultiBlock, "add_threshold", 0, 1, True),
    (MultiBlock, "activate_threshold", 0, 1, False),
    (ElasticCache, "gamma", 0, 1, False),
]
CACHE_NAME = {cls: name for name, cls in CACHES.items()}


def _id(p):
    return f"{p[0].__name__}-{p[1]}"


def _raises(make, param, value):
    """``make(param=value)`` raises a ValueError whose message starts with ``param=value``; returns the message."""
    with pytest.raises(ValueError, match=re.escape(f"{param}={value!r}")) as info:
        make(**{param: value})
    assert "out of range" in str(info.value) or "must be" in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize("spec", INT_PARAMS, ids=_id)
def test_integer_parameters_refuse_bad_values(spec):
    cls, param, lo, none_ok = spec
    bad = [v for v in BAD_INT if not (v is None and none_ok)] + [lo - 1]
    for value in bad:
        msg = _raises(cls, param, value)
        if value is not None and not isinstance(value, str):
            assert f"at most {MAX_INT_PARAM}" in msg, msg  # the message gives the range
        if cls in CACHE_NAME:  # get_cache(name, **params) checks the same
            _raises(functools.partial(get_cache, CACHE_NAME[cls]), param, value)


@pytest.mark.parametrize("spec", INT_PARAMS, ids=_id)
def test_integer_parameters_keep_their_valid_values(spec):
    cls, param, lo, none_ok = spec
    for value in [lo, lo + 1, 8, MAX_INT_PARAM] + ([None] if none_ok else []):
        obj = cls(**{param: value})
        got = getattr(obj, "reload" if (cls, param) == (DKVDecode, "refresh_every") else param)
        assert got == value and type(got) is type(value), (cls, param, value, got)
    cls()  # the default builds
    np = pytest.importorskip("numpy")
    assert getattr(cls(**{param: np.int64(lo + 1)}), "reload" if cls is DKVDecode and param == "refresh_every"
                   else param) == lo + 1  # a numpy integer is an integer


@pytest.mark.parametrize("spec", UNIT_PARAMS, ids=_id)
def test_float_parameters_refuse_bad_values(spec):
    cls, param, lo, hi, lo_open = spec
    for value in BAD_UNIT + ([lo] if lo_open else []):
        if value is None and (cls, param) == (AdaBlock, "delimiter_threshold"):
            continue  # None: the model family's threshold
        _raises(cls, param, value)
        if cls in CACHE_NAME:
            _raises(functools.partial(get_cache, CACHE_NAME[cls]), param, value)
    for value in ([] if lo_open else [lo, 0.0]) + [0.5, hi, 1.0]:
        assert getattr(cls(**{param: value}), param) == value


def test_adablock_delimiter_ids_are_checked():
    for value in [(True,), (1.5,), (198.0,), (NAN,), (INF,), (-1,), (2**63,), (MAX_INT_PARAM + 1,), "-1", "198,-3",
                  "99999999999999999999", 2**63, -5]:
        with pytest.raises(ValueError, match=r"delimiters=.* is out of range; it must be a token id"):
            AdaBlock(delimiters=value)
    for value in [None, 1.5, True, {198}, b"\n"]:
        with pytest.raises(ValueError, match=r"delimiters=.* is not understood; use 'newline', 'newline-exact'"):
            AdaBlock(delimiters=value)
    assert AdaBlock(delimiters="198, 271").delimiters == (198, 271)
    assert AdaBlock(delimiters=[198, 271]).delimiters == (198, 271)
    assert AdaBlock(delimiters=198).delimiters == (198,)
    assert AdaBlock(delimiters=(0, MAX_INT_PARAM)).delimiters == (0, MAX_INT_PARAM)
    assert AdaBlock(delimiters=()).delimiters == ()  # refused at bind, where the model is known
    for mode in ("newline", "newline-exact"):
        assert AdaBlock(delimiters=mode).delimiters == mode


def test_fixed_blocks_whole_is_a_flag():
    for value in [1, 0, 1.0, NAN, "yes", None]:
        with pytest.raises(ValueError, match=re.escape(f"whole={value!r} must be True or False")):
            FixedBlocks(whole=value)
    assert FixedBlocks(whole=True).whole and not FixedBlocks(whole=False).whole
    assert WholeCanvas().whole


def test_dkv_decode_refresh_is_a_known_choice():
    for value in ["x", "Block", True, NAN, None, ["block"]]:
        with pytest.raises(ValueError, match=r"unknown dkv-decode refresh .*; known: block, global"):
            DKVDecode(refresh=value)
    for refresh in DKVDecode.REFRESH:
        assert get_cache("dkv-decode", refresh=refresh, refresh_every=3, full_steps=0).refresh == refresh
    # refresh_every is checked in both modes (the block mode keeps it itself, the global one in KVCache)
    for refresh in DKVDecode.REFRESH:
        with pytest.raises(ValueError, match=r"refresh_every=inf is out of range"):
            DKVDecode(refresh_every=INF, refresh=refresh)


def test_get_cache_names_unknown_caches_and_parameters():
    for name in ["turbo", 5, None, ("dual",)]:
        with pytest.raises(ValueError, match=re.escape(f"unknown cache {name!r}; known caches: ")):
            get_cache(name)
    with pytest.raises(ValueError, match=r"cache 'dual' has no parameter\(s\) \['gamma'\]; its parameters: refresh_every"):
        get_cache("dual", gamma=0.5)
    with pytest.raises(ValueError, match=r"cache 'elastic' has no parameter\(s\) \['track'\]; its parameters: gamma, "
                                         r"track_num, refresh_every"):
        get_cache("elastic", track=2)
    for name in CACHES:  # every registered cache builds with its defaults
        assert get_cache(name).name == name


def test_errors_come_at_construction_not_at_use():
    """The motivating case: ``ElasticCache(track_num=inf)`` used to build and overflow inside ``topk``."""
    with pytest.raises(ValueError, match=r"track_num=inf is out of range; it must be an integer >= 1 and at most "
                                         rf"{MAX_INT_PARAM} \(tracked tokens per layer; Elastic-Cache uses 1\)"):
        ElasticCache(track_num=INF)
    assert math.isclose(ElasticCache(gamma=1).gamma, 1.0) and ElasticCache(gamma=0).gamma == 0.0


@pytest.mark.parametrize(("sampler", "param"), [("llada", "temperature"), ("dream", "alg_temp"), ("credit", "alpha"),
                                                ("factor", "factor"), ("klass", "kl_threshold"),
                                                ("entropy-threshold", "threshold")])
def test_real_valued_parameters_refuse_integers_too_large_for_a_float(sampler, param):
    """A real-valued parameter given as an integer past 2**53 (JSON can hold 2**64: it reached torch.pow
    mid-decoding and failed there) is refused when the sampler is built, naming the parameter."""
    from dllm.samplers import get_sampler

    for big in (2**64, 10**30, -(2**60), 10**5000):
        with pytest.raises(ValueError, match=f"{param}.*too large"):
            get_sampler(sampler, **{param: big})
