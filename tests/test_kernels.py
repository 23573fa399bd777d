"""Kernel tests: the Triton kernels under ``TRITON_INTERPRET=1`` (CPU, fp32/fp16) against the reference twins.

The interpreter must be selected before Triton's ``@jit`` decorators run, so this module sets the variable before it
imports :mod:`dllm.kernels.triton_kernels`. The interpreter is slow (one program at a time in numpy): shapes are
tiny. Tolerance (flash-attention rule): the kernel's error against a float64 oracle is at most twice the error of
the same-precision plain PyTorch computation, plus a tiny absolute floor. bf16 and speed are GPU-only tests.
"""

from __future__ import annotations

import os

import torch  # noqa: E402  (importing torch does not import triton)

# Without CUDA the kernels run under the interpreter on CPU tensors; with CUDA the same tests run compiled.
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's decorators run (see the module docstring)

import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

import dllm.kernels as K  # noqa: E402
from dllm.kernels import reference as R  # noqa: E402
from dllm.kernels import triton_kernels as T  # noqa: E402

assert T._INTERPRET == (DEV == "cpu"), "triton_kernels was imported before TRITON_INTERPRET was set"

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FLOOR = {torch.float32: 1e-6, torch.float16: 1e-4}


@pytest.fixture(autouse=True)
def _restore_backend():
    saved = K._backend
    yield
    if saved is None:
        K._backend, K._module = None, None
    else:
        K.set_backend(saved)


def _inputs(B, Hq, Hkv, Lq, Lk, D, dtype, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g)
    k = torch.randn(B, Hkv, Lk, D, generator=g)
    v = torch.randn(B, Hkv, Lk, D, generator=g)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def _padding(B, Lk, seed=0, full_row=None):
    g = torch.Generator().manual_seed(seed + 1)
    mask = torch.rand(B, Lk, generator=g) > 0.3
    mask[:, 0] = True
    if full_row is not None:
        mask[full_row] = False
    return mask.to(DEV)


def _naive(q, k, v, mask):
    """Plain PyTorch attention entirely in the inputs' precision (the tolerance baseline); and the LSE."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return p @ v, lse


def _assert_close_rule(got, oracle, baseline, dtype, what):
    finite = torch.isfinite(oracle)
    err = (got.double() - oracle.double())[finite].abs().max().item() if finite.any() else 0.0
    base = (baseline.double() - oracle.double())[finite].abs().max().item() if finite.any() else 0.0
    assert err <= 2 * base + FLOOR[dtype], f"{what}: kernel error {err:.3g} > 2 x torch error {base:.3g}"
    assert torch.equal(torch.isfinite(got), finite), f"{what}: non-finite pattern differs"
    assert (got[~finite] == oracle[~finite]).all(), f"{what}: non-finite entries differ"


# (B, Hq, Hkv, Lq, Lk, D, fully masked batch row)
SHAPES = [
    (1, 4, 1, 1, 129, 16, None),  # GQA 4:1, one query row, long keys
    (2, 7, 1, 7, 33, 64, 1),  # GQA 7:1, padded rows, a fully masked batch row
    (1, 2, 2, 33, 7, 16, None),  # MHA, more queries than keys
    (1, 1, 1, 129, 33, 16, None),  # many query tiles
    (2, 4, 1, 7, 1, 16, 1),  # a single key (Lk = 1), GQA 4:1; batch row 1 fully masked
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}x{}Lq{}Lk{}D{}".format(*s[:6]))
def test_attention_matches_reference(shape, dtype):
    B, Hq, Hkv, Lq, Lk, D, full = shape
    q, k, v = _inputs(B, Hq, Hkv, Lq, Lk, D, dtype)
    mask = _padding(B, Lk, full_row=full) if full is not None or Lk > 8 else None
    if Lk == 1:
        assert mask is not None and mask[0].all()  # row 0 attends to its only key, row 1 to nothing
    out, lse = T.attention(q, k, v, key_padding_mask=mask, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (B, Hq, Lq) and lse.dtype == torch.float32
    ref_out, ref_lse = _naive(q.double(), k.double(), v.double(), mask)  # float64 oracle
    base_out, base_lse = _naive(q, k, v, mask)
    _assert_close_rule(out, ref_out, base_out, dtype, "out")
    twin_out, twin_lse = R.attention(q, k, v, key_padding_mask=mask, return_lse=True)  # the reference twin
    _assert_close_rule(twin_out, ref_out, base_out, dtype, "reference out")
    _assert_close_rule(lse, ref_lse, base_lse, dtype, "lse")
    assert not out.isnan().any()
    if full is not None:
        assert (out[full] == 0).all() and (lse[full] == float("-inf")).all()
    # the no-LSE path returns the same output
    assert torch.equal(T.attention(q, k, v, key_padding_mask=mask), out)


def test_attention_non_contiguous_inputs():
    B, Hq, Hkv, L, D = 2, 4, 2, 9, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, L, Hq, D, generator=g).to(DEV).transpose(1, 2)  # [B, L, H, D] storage
    kv = torch.randn(B, L, 2, Hkv, 2 * D, generator=g).to(DEV)
    k = kv[:, :, 0, :, ::2].transpose(1, 2)  # strided in every dim
    v = kv[:, :, 1, :, D:].transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    mask = torch.ones(B, 2 * L, dtype=torch.bool, device=DEV)[:, ::2]  # non-contiguous mask
    mask[0, 3] = False
    out, lse = T.attention(q, k, v, key_padding_mask=mask, return_lse=True)
    ref, ref_lse = R.attention(q.contiguous(), k.contiguous(), v.contiguous(), mask.contiguous(), return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_attention_lse_merge_of_split_keys():
    q, k, v = _inputs(1, 4, 1, 7, 33, 16, torch.float32, seed=5)
    whole, lse = T.attention(q, k, v, return_lse=True)
    o1, l1 = T.attention(q, k[:, :, :20], v[:, :, :20], return_lse=True)
    o2, l2 = T.attention(q, k[:, :, 20:], v[:, :, 20:], return_lse=True)
    merged_lse = torch.logaddexp(l1, l2)
    merged = torch.exp(l1 - merged_lse)[..., None] * o1 + torch.exp(l2 - merged_lse)[..., None] * o2
    torch.testing.assert_close(merged_lse, lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)


def test_attention_bf16_under_interpreter_is_widened():
    q, k, v = _inputs(1, 2, 1, 3, 7, 16, torch.bfloat16)
    out = T.attention(q, k, v)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, R.attention(q, k, v), atol=2e-2, rtol=2e-2)


def test_attention_rejects_bad_gqa():
    q, k, v = _inputs(1, 3, 2, 1, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        T.attention(q, k, v)


@pytest.mark.parametrize("twin", ["triton", "reference"])
def test_key_padding_mask_must_be_batch_by_keys_bool(twin):
    """Both twins refuse a mask that is not ``[B, Lk]`` bool (a ``[1, Lk]`` mask with B = 2 used to be read with the
    wrong batch stride by the Triton kernel); an explicitly expanded mask (batch stride 0) gives the right answer."""
    M = T if twin == "triton" else R
    B, Lk = 2, 9
    q, k, v = _inputs(B, 2, 1, 3, Lk, 16, torch.float32, seed=9)
    one = torch.ones(1, Lk, dtype=torch.bool, device=DEV)
    one[0, 2:5] = False
    for bad, what in ((one, r"\[B, Lk\] = \[2, 9\].*\[1, 9\].*expand\(2, 9\)"),
                      (one.expand(B, Lk)[:, :-1], r"\[B, Lk\] = \[2, 9\].*\[2, 8\]"),
                      (one.expand(B, Lk).long(), "bool.*torch.int64.*mask.bool")):
        with pytest.raises(ValueError, match=what):
            M.attention(q, k, v, key_padding_mask=bad)
        with pytest.raises(ValueError, match=what):
            M.attention(q, k, v, key_padding_mask=bad, return_lse=True)
        with pytest.raises(ValueError, match=what):
            M.attention_mass(q, k, key_padding_mask=bad)
    full = one.expand(B, Lk).contiguous()
    out, lse = M.attention(q, k, v, key_padding_mask=one.expand(B, Lk), return_lse=True)
    ref, ref_lse = _naive(q.double(), k.double(), v.double(), full)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    mass = M.attention_mass(q, k, key_padding_mask=one.expand(B, Lk))
    assert torch.equal(mass, M.attention_mass(q, k, key_padding_mask=full))
    assert (mass[:, 2:5] == 0).all() and (mass[:, :2] > 0).all()


# ------------------------------------------------------------------------------------- split-K attention

# (B, Hq, Hkv, Lq, Lk, D, fully masked batch row, key splits)
SPLITK_CASES = [
    ((1, 4, 1, 1, 129, 16, None), (1, 2, 3, 7)),  # GQA 4:1, one query row, Lk not a multiple of the tile
    ((2, 7, 1, 7, 33, 16, 1), (3,)),  # GQA 7:1 (7 x 7 = 49 packed rows: two tiles), padded keys, a masked row
    ((1, 2, 2, 33, 70, 16, None), (2, 7)),  # MHA, 33 query rows (two tiles)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", SPLITK_CASES, ids=lambda c: "B{}H{}x{}Lq{}Lk{}D{}".format(*c[0][:6]))
def test_splitk_attention_matches_oracle(case, dtype):
    (B, Hq, Hkv, Lq, Lk, D, full), splits = case
    q, k, v = _inputs(B, Hq, Hkv, Lq, Lk, D, dtype, seed=12)
    mask = _padding(B, Lk, seed=12, full_row=full)
    ref_out, ref_lse = _naive(q.double(), k.double(), v.double(), mask)  # float64 oracle
    base_out, base_lse = _naive(q, k, v, mask)
    for S in splits:
        out, lse = T.attention_splitk(q, k, v, key_padding_mask=mask, return_lse=True, num_splits=S)
        assert out.shape == q.shape and out.dtype == dtype and lse.shape == (B, Hq, Lq) and lse.dtype == torch.float32
        _assert_close_rule(out, ref_out, base_out, dtype, f"out, {S} splits")
        _assert_close_rule(lse, ref_lse, base_lse, dtype, f"lse, {S} splits")
        assert not out.isnan().any()
        if full is not None:
            assert (out[full] == 0).all() and (lse[full] == float("-inf")).all()
        assert torch.equal(T.attention_splitk(q, k, v, key_padding_mask=mask, num_splits=S), out)


def test_splitk_combine_of_splits_with_a_fully_masked_split():
    """Three key ranges of 11 keys; the middle one is fully masked for batch row 0 and the first for row 1: the
    combine gives those ranges zero weight, and equals the LSE-weighted merge of per-range attention."""
    q, k, v = _inputs(2, 4, 2, 5, 33, 16, torch.float32, seed=13)
    mask = torch.ones(2, 33, dtype=torch.bool, device=DEV)
    mask[0, 11:22] = False
    mask[1, :11] = False
    out, lse = T.attention_splitk(q, k, v, key_padding_mask=mask, return_lse=True, num_splits=3)
    parts = [T.attention(q, k[:, :, r], v[:, :, r], key_padding_mask=mask[:, r].contiguous(), return_lse=True)
             for r in (slice(0, 11), slice(11, 22), slice(22, 33))]
    total = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
    merged = sum(torch.exp(l - total)[..., None] * o for o, l in parts)
    torch.testing.assert_close(lse, total, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, merged, atol=1e-5, rtol=1e-5)
    whole, whole_lse = T.attention(q, k, v, key_padding_mask=mask, return_lse=True)
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse, atol=1e-5, rtol=1e-5)


def test_splitk_non_contiguous_and_empty():
    B, Hq, Hkv, L, D = 2, 4, 2, 9, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, L, Hq, D, generator=g).to(DEV).transpose(1, 2)
    kv = torch.randn(B, L, 2, Hkv, 2 * D, generator=g).to(DEV)
    k, v = kv[:, :, 0, :, ::2].transpose(1, 2), kv[:, :, 1, :, D:].transpose(1, 2)
    mask = torch.ones(B, 2 * L, dtype=torch.bool, device=DEV)[:, ::2]
    mask[0, 3] = False
    out, lse = T.attention_splitk(q, k, v, key_padding_mask=mask, return_lse=True, num_splits=2)
    ref, ref_lse = R.attention(q.contiguous(), k.contiguous(), v.contiguous(), mask.contiguous(), return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    q, k, v = _inputs(1, 2, 1, 3, 0, 16, torch.float32)
    out, lse = T.attention_splitk(q, k, v, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()
    for bad in (0, 65, 2.0, True):
        with pytest.raises(ValueError, match="num_splits"):
            T.attention_splitk(*_inputs(1, 2, 1, 3, 9, 16, torch.float32), num_splits=bad)


def test_splitk_fp32_split_count_and_rows_do_not_depend_on_batch():
    for B in (1, 2, 8, 64):
        assert T.splitk_num_splits(B, 32, 32, 32, 4096, torch.float32) == T.splitk_num_splits(
            1, 32, 32, 32, 4096, torch.float32)
    assert T.splitk_num_splits(8, 32, 32, 32, 4096, torch.bfloat16) < T.splitk_num_splits(
        1, 32, 32, 32, 4096, torch.bfloat16)  # in half precision the batch fills the GPU too
    assert T.splitk_num_splits(1, 28, 4, 32, 100, torch.bfloat16) == 1  # at least 128 keys per split
    q, k, v = _inputs(3, 4, 1, 2, 300, 16, torch.float32, seed=14)
    mask = _padding(3, 300, seed=14)
    whole = T.attention_splitk(q, k, v, key_padding_mask=mask)
    for b in range(3):
        one = T.attention_splitk(q[b:b + 1], k[b:b + 1], v[b:b + 1], key_padding_mask=mask[b:b + 1])
        assert torch.equal(one[0], whole[b])


# ----------------------------------------------------------------------------------- attention dispatch


@pytest.fixture
def attn_dispatch(monkeypatch):
    """The Triton backend with a clean dispatch state; timings come from the test (``measured``), not CUDA."""
    from dllm.kernels import dispatch as D

    K.set_backend("triton")
    monkeypatch.delenv("DLLM_ATTENTION", raising=False)
    monkeypatch.setattr(D, "_forced", None)
    monkeypatch.setattr(D, "_choices", {})
    monkeypatch.setattr(D, "_timings", {})
    monkeypatch.setattr(D, "_on_gpu", lambda t: True)  # pretend the tensors are on a GPU
    monkeypatch.setattr(D, "_capturing", lambda: False)
    fake = {"sdpa": 3.0, "triton": 2.0, "splitk": 1.0, "splitk-2x": 0.7, "splitk-wide": 0.5}
    measured = []
    monkeypatch.setattr(D, "_l2_flush_buffer", lambda: None)

    def measure(fn, flush=None):
        fn()  # the candidate really runs (under the interpreter)
        name = D._running
        measured.append(name)
        return fake[name]

    real_run = D.run

    def run(name, *a):
        D._running = name
        return real_run(name, *a)

    monkeypatch.setattr(D, "_measure", measure)
    monkeypatch.setattr(D, "run", run)
    return SimpleNamespace(D=D, fake=fake, measured=measured)


def test_dispatch_times_each_bucket_once_and_keeps_the_fastest(attn_dispatch):
    D, fake, measured = attn_dispatch.D, attn_dispatch.fake, attn_dispatch.measured
    q, k, v = _inputs(1, 4, 1, 3, 40, 16, torch.bfloat16, seed=15)
    out = K.attention(q, k, v)
    assert measured == ["sdpa", "triton", "splitk"]
    torch.testing.assert_close(out, R.attention(q, k, v), atol=2e-2, rtol=2e-2)
    key = D.bucket(q, k, None, False)
    assert key == (1, 4, 1, 4, 64, 16, "bfloat16", False, False, str(q.device))
    assert K.attention_choices()[key] == {"choice": "splitk", "ms": {c: fake[c] for c in ("sdpa", "triton", "splitk")}}
    _, k2, v2 = _inputs(1, 4, 1, 3, 50, 16, torch.bfloat16, seed=16)  # Lk 50: the same power-of-two bucket
    K.attention(q, k2, v2)
    assert len(measured) == 3
    q4, k4, v4 = _inputs(1, 4, 1, 4, 40, 16, torch.bfloat16, seed=17)  # 4 queries: the same Lq bucket as 3
    K.attention(q4, k4, v4)
    assert len(measured) == 3
    fake.update(sdpa=0.5)  # a new bucket (a mask) measures again; SDPA is now the fastest
    mask = torch.ones(1, 40, dtype=torch.bool, device=DEV)
    mask[0, :7] = False
    out = K.attention(q, k, v, key_padding_mask=mask)
    assert len(measured) == 6 and K.attention_choices()[D.bucket(q, k, mask, False)]["choice"] == "sdpa"
    torch.testing.assert_close(out, R.attention(q, k, v, key_padding_mask=mask), atol=2e-2, rtol=2e-2)
    # SDPA has no LSE: return_lse measures the two Triton kernels only
    out, lse = K.attention(q, k, v, return_lse=True)
    assert measured[6:] == ["triton", "splitk"] and lse.shape == (1, 4, 3)
    K.reset_attention_choices()
    assert K.attention_choices() == {}


def test_confidence_split_count_does_not_depend_on_the_rows_in_float32(monkeypatch):
    """The vocabulary splits of the confidence kernel set the order of its merge's sums: in float32 they never depend
    on the row count (a row's statistics are the same in any batch), in half precision the rows fill the GPU too."""
    monkeypatch.setattr(T, "_num_sms", lambda: 132)
    V = 126464
    fp32 = {T.confidence_splits(V, n, torch.float32) for n in (1, 32, 128, 512, 4096)}
    assert fp32 == {31}  # ceil(V / 4 tiles of 1,024)
    half = [T.confidence_splits(V, n, torch.bfloat16) for n in (1, 32, 128, 512, 4096)]
    assert half == [31, 17, 5, 2, 1]  # 4 x 132 programs over the rows, at most 31
    assert T.confidence_splits(1000, 1, torch.float32) == 1  # one tile of the vocabulary


def test_splitk_split_count_fills_the_sms_in_whole_waves(monkeypatch):
    """The split count of a GPU launch (132 SMs, whole 128-key tiles): the fewest splits whose waves x (keys per split
    + a split's fixed cost) is within 10% of the shortest, never a partial last wave that costs a whole one, never
    many short splits where a few long ones take one wave."""
    monkeypatch.setattr(T, "_num_sms", lambda: 132)
    monkeypatch.setattr(T, "_interpreting", lambda: False)
    bf16 = torch.bfloat16
    # 32:32 heads, batch 1: 32 programs. 5 splits (160 programs: two waves of 896 keys) lose to 4 (one of 1,024)
    assert T.splitk_num_splits(1, 32, 32, 32, 4096, bf16) == 4
    assert T.splitk_num_splits(1, 32, 32, 32, 4096, bf16, waves=4) == 16  # 512 programs of 256 keys: 4 waves
    assert T.splitk_num_splits(1, 28, 4, 32, 4096, bf16) == 8  # 16 programs x 8 = 128: one wave of 512 keys
    assert T.splitk_num_splits(1, 32, 32, 32, 768, bf16) == 3  # 768 keys: 3 x 256 in one wave (6 x 128 in two)
    assert T.splitk_num_splits(4, 32, 32, 32, 4096, bf16) == 1  # 128 programs already fill the SMs
    assert T.splitk_num_splits(16, 32, 32, 32, 4096, bf16) == 1  # 512: 4 waves whatever the count
    # just past a multiple of 512 keys, 4 splits need 1,152-key ranges: still 4 (33 splits of 128 keys in 8 waves
    # read less per SM, but pay a split's fixed cost 8 times)
    assert T.splitk_num_splits(1, 32, 32, 32, 4097, bf16) == 4
    assert T.splitk_num_splits(1, 28, 4, 32, 4097, bf16) == 7
    assert max(T.splitk_num_splits(1, 32, 32, 32, lk, bf16) for lk in range(128, 16384, 61)) == 4
    assert T.splitk_candidates(1, 32, 32, 32, 4096, bf16) == {"splitk": 4, "splitk-2x": 8, "splitk-wide": 16}
    assert T.splitk_candidates(1, 32, 32, 32, 768, bf16) == {"splitk": 3, "splitk-2x": 6}  # 6 is also 4 waves'
    assert T.splitk_candidates(1, 32, 32, 32, 768, bf16, distinct=False)["splitk-wide"] == 6
    for B, Hq, Hkv, Lk in ((1, 32, 32, 4096), (1, 28, 4, 2000), (2, 32, 8, 3000), (1, 32, 32, 300), (3, 28, 4, 4096)):
        base = math.ceil(32 * (Hq // Hkv) / 64) * Hkv * B

        def cost(n, Lk=Lk, base=base):
            chunk = math.ceil(math.ceil(Lk / n) / 128) * 128  # the count that runs: ceil(Lk / chunk)
            return math.ceil(base * math.ceil(Lk / chunk) / 132) * (min(chunk, Lk) + T.SPLIT_OVERHEAD_KEYS)

        n = T.splitk_num_splits(B, Hq, Hkv, 32, Lk, bf16)
        best = min(cost(m) for m in range(1, min(math.ceil(Lk / 128), 64) + 1))
        assert cost(n) <= 1.1 * best
        assert all(cost(m) > 1.1 * best for m in range(1, n))


def test_dispatch_times_more_key_splits_where_that_is_another_count(attn_dispatch, monkeypatch):
    """"splitk-2x" (about twice the split count) and "splitk-wide" (four waves of programs over the SMs) are
    candidates only where their split counts differ from split-K's own; chosen, one runs split-K with its count and
    gives the same attention."""
    D, measured = attn_dispatch.D, attn_dispatch.measured
    monkeypatch.setattr(T, "_num_sms", lambda: 2)  # a small GPU: one wave is 2 programs, four waves 8
    q, k, v = _inputs(1, 4, 1, 3, 1024, 16, torch.bfloat16, seed=18)
    assert T.splitk_num_splits(1, 4, 1, 3, 1024, torch.bfloat16) == 2
    assert T.splitk_num_splits(1, 4, 1, 3, 1024, torch.bfloat16, waves=4) == 8
    splits = []
    real = T.attention_splitk
    monkeypatch.setattr(T, "attention_splitk", lambda *a, **kw: splits.append(kw.get("num_splits")) or real(*a, **kw))
    out = K.attention(q, k, v)
    assert measured == ["sdpa", "triton", "splitk", "splitk-2x", "splitk-wide"]
    assert K.attention_choices()[D.bucket(q, k, None, False)]["choice"] == "splitk-wide"
    assert splits == [None, 4, 8, 8]  # timed: split-K's own count, then 4 and 8; the chosen call: 8
    torch.testing.assert_close(out, R.attention(q, k, v), atol=2e-2, rtol=2e-2)
    q2, k2, v2 = _inputs(1, 4, 1, 3, 100, 16, torch.bfloat16, seed=19)  # 100 keys: one split either way
    K.attention(q2, k2, v2)
    assert measured[5:] == ["sdpa", "triton", "splitk"]


def test_dispatch_fp32_is_a_fixed_choice_and_capture_never_times(attn_dispatch, monkeypatch):
    D, measured = attn_dispatch.D, attn_dispatch.measured
    for B in (1, 4):
        q, k, v = _inputs(B, 4, 1, 3, 40, 16, torch.float32)
        assert D.choose(T, q, k, v) == "splitk" and D.choose(T, q, k, v, return_lse=True) == "splitk"
    assert measured == []
    q, k, v = _inputs(1, 4, 1, 3, 40, 16, torch.bfloat16)
    monkeypatch.setattr(D, "_capturing", lambda: True)
    assert D.choose(T, q, k, v) == "sdpa" and D.choose(T, q, k, v, return_lse=True) == "triton"
    assert measured == [] and K.attention_choices() == {}
    D._choices[D.bucket(q, k, None, False)] = "splitk"  # measured before the capture: used during it
    assert D.choose(T, q, k, v) == "splitk" and measured == []
    monkeypatch.setattr(D, "_on_gpu", lambda t: False)  # the interpreter: the flash kernel, as before
    assert D.choose(T, q, k, v) == "triton"


def test_dispatch_overrides(attn_dispatch, monkeypatch):
    D, measured = attn_dispatch.D, attn_dispatch.measured
    q, k, v = _inputs(1, 4, 1, 3, 40, 16, torch.bfloat16)
    for name in ("sdpa", "triton", "splitk-wide", "splitk-2x", "splitk"):
        monkeypatch.setenv("DLLM_ATTENTION", name)
        assert D.choose(T, q, k, v) == name
    assert D.choose(T, q, k, v, return_lse=True) == "splitk"
    monkeypatch.setenv("DLLM_ATTENTION", "sdpa")
    assert D.choose(T, q, k, v, return_lse=True) == "triton"  # SDPA has no LSE
    K.set_attention_backend("splitk")  # beats the environment
    assert D.choose(T, q, k, v) == "splitk"
    calls = []
    monkeypatch.setattr(T, "attention_splitk", lambda *a, **kw: calls.append(1) or "splitk ran")
    assert K.attention(q, k, v) == "splitk ran" and calls == [1]
    K.set_attention_backend(None)
    monkeypatch.setenv("DLLM_ATTENTION", "flash")
    with pytest.raises(ValueError, match="DLLM_ATTENTION='flash'"):
        D.choose(T, q, k, v)
    with pytest.raises(ValueError, match="unknown attention backend"):
        K.set_attention_backend("cudnn")
    assert measured == []
    K.set_backend("reference")  # the reference backend never consults the attention dispatch
    K.set_attention_backend("splitk")
    assert torch.equal(K.attention(q, k, v), R.attention(q, k, v))


# ------------------------------------------------------------------------------------------ torch.compile


def test_compile_through_dispatcher_on_reference_backend_matches_eager():
    K.set_backend("reference")
    q, k, v = _inputs(2, 4, 2, 3, 9, 16, torch.float32, seed=17, device="cpu")
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :4] = False

    def step(q, k, v, mask):
        out, lse = K.attention(q, k, v, key_padding_mask=mask, return_lse=True)
        return K.attention(q, k, v, key_padding_mask=mask) * 2 + out, lse

    torch._dynamo.reset()
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v, mask)
    want = step(q, k, v, mask)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("op", ["flash_attention", "splitk_attention", "confidence_stats"])
def test_custom_ops_schema_and_fake(op):
    q, k, v = _inputs(1, 4, 1, 3, 40, 16, torch.float32)
    mask = _padding(1, 40)
    args = {"flash_attention": (q, k, v, mask), "splitk_attention": (q, k, v, mask, 3),
            "confidence_stats": (_logits((3, 300), torch.float32), None, 0.0, 64, 2, 7)}[op]
    # under the interpreter the kernels cannot run on the fake tensors of the dispatch tests; schema and fake run
    utils = ("test_schema", "test_faketensor") if DEV == "cpu" else None
    kw = {} if utils is None else {"test_utils": utils}
    torch.library.opcheck(getattr(torch.ops.dllm, op).default, args, **kw)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        outs = getattr(torch.ops.dllm, op)(*fake)
    real = getattr(torch.ops.dllm, op)(*args)
    for f, r in zip(outs, real):  # the strides too: the attention output is stored [B, Lq, Hq, D]
        assert f.shape == r.shape and f.dtype == r.dtype and f.stride() == r.stride()
    if op != "confidence_stats":
        assert real[0].transpose(1, 2).is_contiguous()  # the layer's reshape into the output product is a view


# ------------------------------------------------------------------------------------------- attention mass


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_attention_mass_matches_reference_and_sums(dtype):
    B, Hq, Hkv, Lq, Lk, D = 2, 7, 1, 7, 33, 16
    q, k, _ = _inputs(B, Hq, Hkv, Lq, Lk, D, dtype, seed=2)
    mask = _padding(B, Lk, seed=2, full_row=1)
    mass = T.attention_mass(q, k, key_padding_mask=mask)
    assert mass.shape == (B, Lk) and mass.dtype == torch.float32
    oracle = _naive_mass(q.double(), k.double(), mask)  # float64 oracle
    _assert_close_rule(mass, oracle, _naive_mass(q, k, mask), dtype, "mass")
    _assert_close_rule(R.attention_mass(q, k, key_padding_mask=mask), oracle, _naive_mass(q, k, mask), dtype,
                       "reference mass")
    # the kernel normalises with its own fp32 LSE: the sum is Hq x Lq to fp32 rounding, whatever the input dtype
    torch.testing.assert_close(mass.sum(-1).cpu(), torch.tensor([Hq * Lq, 0.0]), atol=Hq * Lq * 1e-5, rtol=0)
    assert (mass[0][~mask[0]] == 0).all()
    # with the LSE from the attention kernel: the same values
    _, lse = T.attention(q, k, k, key_padding_mask=mask, return_lse=True)
    torch.testing.assert_close(T.attention_mass(q, k, key_padding_mask=mask, lse=lse), mass, atol=1e-6, rtol=1e-6)


def _naive_mass(q, k, mask):
    """Plain PyTorch attention mass entirely in the inputs' precision (the tolerance baseline), ``[B, Lk]``."""
    group = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.nan_to_num(torch.softmax(s, -1), nan=0.0).sum(dim=(1, 2))


def test_attention_mass_permutes_with_keys():
    q, k, _ = _inputs(1, 4, 1, 5, 40, 16, torch.float32, seed=4)
    mask = _padding(1, 40, seed=4)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0)).to(DEV)
    mass = T.attention_mass(q, k, key_padding_mask=mask)
    permuted = T.attention_mass(q, k[:, :, perm], key_padding_mask=mask[:, perm])
    torch.testing.assert_close(permuted, mass[:, perm], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mass.sum(-1).cpu(), torch.tensor([20.0]), atol=1e-4, rtol=0)


def test_attention_mass_is_deterministic():
    q, k, _ = _inputs(1, 2, 2, 3, 33, 16, torch.float32, seed=6)
    assert torch.equal(T.attention_mass(q, k), T.attention_mass(q, k))


# ------------------------------------------------------------------------------------------ attention drift


def _drift_inputs(B, Hq, Hkv, Lq, Lk, D, dtype, seed=0, device=DEV):
    """Old and new queries and keys as Elastic-Cache's drift test sees them: the new ones moved a little (and a few
    keys rewritten), a key mask with a padded left edge, some query rows padding."""
    g = torch.Generator().manual_seed(seed)
    q_old = torch.randn(B, Hq, Lq, D, generator=g)
    q_new = q_old + 0.3 * torch.randn(B, Hq, Lq, D, generator=g)
    k_old = torch.randn(B, Hkv, Lk, D, generator=g)
    k_new = k_old.clone()
    k_new[:, :, -3:] = torch.randn(B, Hkv, 3, D, generator=g)
    mask = torch.rand(B, Lk, generator=g) > 0.2
    mask[:, :2] = False  # left padding
    mask[:, 2] = True
    rows_ok = torch.rand(B, Lq, generator=g) > 0.3
    rows_ok[:, 0] = True
    return [t.to(device, dtype) for t in (q_old, k_old, q_new, k_new)] + [mask.to(device), rows_ok.to(device)]


def _naive_drift(q_old, k_old, q_new, k_new, mask, rows_ok):
    """The drift similarity computed plainly in the inputs' precision (float64: the oracle)."""
    def probs(q, k):
        s = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
        if mask is not None:
            s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
        return torch.softmax(s, -1)

    a, b = probs(q_old, k_old), probs(q_new, k_new)
    cos = (a * b).sum(1) / (a.norm(dim=1).clamp_min(1e-8) * b.norm(dim=1).clamp_min(1e-8))  # [B, Lq, Lk]
    w = rows_ok[:, :, None] & (mask[:, None, :] if mask is not None else torch.ones_like(cos, dtype=torch.bool))
    return (cos * w).sum((1, 2)) / w.sum((1, 2)).clamp_min(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(2, 4, 4, 5, 37, 16), (3, 6, 2, 40, 70, 32), (1, 3, 1, 1, 9, 8)])
def test_attention_drift_matches_the_reference(shape, dtype):
    """The Triton drift test (Elastic-Cache's cosine similarity over heads of two attention distributions, averaged
    over the counted rows and the keys) against its reference twin and a float64 oracle: GQA, a key mask with left
    padding, padded query rows, query rows past one tile (40) and keys past several."""
    *t, mask, rows_ok = _drift_inputs(*shape, dtype, seed=shape[4])
    got = T.attention_drift(*t, mask, rows_ok)
    assert got.shape == (shape[0],) and got.dtype == torch.float32
    ref = R.attention_drift(*t, mask, rows_ok)
    oracle = _naive_drift(*(x.double() for x in t), mask, rows_ok).float()
    tol = 2e-6 if dtype == torch.float32 else 1e-5  # fp16 values: products exact in fp32 either way
    torch.testing.assert_close(got, oracle, atol=tol, rtol=0)
    torch.testing.assert_close(ref, oracle, atol=tol, rtol=0)
    unmasked = T.attention_drift(*t, None, rows_ok)  # no key mask: every key counts
    torch.testing.assert_close(unmasked, _naive_drift(*(x.double() for x in t), None, rows_ok).float(), atol=tol,
                               rtol=0)


def test_attention_drift_counts_only_the_rows_and_keys_it_is_given():
    """Identical distributions score 1; a padded query row or a masked key changes nothing however it differs; a
    batch row with no counted query row scores 0; a row's score does not depend on the other rows of its batch."""
    q_old, k_old, q_new, k_new, mask, rows_ok = _drift_inputs(3, 4, 2, 6, 45, 16, torch.float32, seed=3)
    same = T.attention_drift(q_old, k_old, q_old, k_old, mask, rows_ok)
    torch.testing.assert_close(same, torch.ones(3, device=DEV), atol=1e-6, rtol=0)
    base = T.attention_drift(q_old, k_old, q_new, k_new, mask, rows_ok)
    assert (base < 0.999).all()
    q2 = q_new.clone()
    q2[~rows_ok[:, None, :].expand(-1, 4, -1)] = 7.0  # the padded rows' queries
    torch.testing.assert_close(T.attention_drift(q_old, k_old, q2, k_new, mask, rows_ok), base, atol=0, rtol=0)
    k2 = k_new.clone()
    k2[~mask[:, None, :].expand(-1, 2, -1)] = -5.0  # the masked keys
    torch.testing.assert_close(T.attention_drift(q_old, k_old, q_new, k2, mask, rows_ok), base, atol=0, rtol=0)
    none = rows_ok.clone()
    none[1] = False
    got = T.attention_drift(q_old, k_old, q_new, k_new, mask, none)
    assert got[1] == 0 and torch.equal(got[[0, 2]], base[[0, 2]])
    alone = T.attention_drift(q_old[1:2], k_old[1:2], q_new[1:2], k_new[1:2], mask[1:2], rows_ok[1:2])
    assert torch.equal(alone, base[1:2])
    with pytest.raises(ValueError, match="rows_ok"):
        T.attention_drift(q_old, k_old, q_new, k_new, mask, rows_ok[:, :2])


@pytest.mark.parametrize("mod", [T, R], ids=["triton", "reference"])
def test_attention_drift_records_each_rows_first_fall_below_its_gate(mod):
    """With a gate and a record (Elastic-Cache's first failing layer, with no host synchronisation): a row whose
    similarity is below its gate records the index and closes its gate; a row above it, or whose gate is closed
    (-inf), keeps its record; a later call records nothing more for a closed row. The similarities returned are
    those of the call without a gate."""
    t = _drift_inputs(3, 4, 2, 6, 45, 16, torch.float32, seed=4)
    sim = mod.attention_drift(*t)
    gate = torch.stack([sim[0] + 0.01, sim[1] - 0.01, torch.tensor(float("-inf"), device=DEV)]).contiguous()
    first = torch.full((3,), 9, dtype=torch.long, device=DEV)
    got = mod.attention_drift(*t, gate, first, 2)
    assert torch.equal(got, sim)
    assert first.tolist() == [2, 9, 9]
    assert gate[0] == float("-inf") and gate[1] == sim[1] - 0.01 and gate[2] == float("-inf")
    gate[1] = 1.5  # every similarity is below it now
    mod.attention_drift(*t, gate, first, 3)
    assert first.tolist() == [2, 3, 9] and (gate == float("-inf")).all()
    with pytest.raises(ValueError, match="gate and first go together"):
        mod.attention_drift(*t, gate, None, 1)
    with pytest.raises(ValueError, match="first must be a contiguous"):
        mod.attention_drift(*t, gate, first.int(), 1)


# ---------------------------------------------------------------------------------------- confidence stats


def _logits(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    x[..., 5] = float("-inf")  # the mask column, as the decode loop sets it
    return x.to(DEV)


def _check_stats(got, ref, atol):
    assert torch.equal(got.token, ref.token)
    assert got.token.dtype == torch.int64
    for name in ("p_token", "p_max", "p_second", "entropy"):
        a, b = getattr(got, name), getattr(ref, name)
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=atol, rtol=atol, msg=name)


def _naive_stats(x, token):
    """``(p_token, p_max, p_second, entropy)`` of ``softmax(x)`` computed plainly in ``x``'s own dtype (the
    tolerance baseline; in float64, the oracle), with the proposal ``token`` given."""
    p = torch.softmax(x, -1)
    top2 = torch.topk(p, 2, -1).values
    entropy = -torch.special.xlogy(p, p).sum(-1)
    return p.gather(-1, token[..., None]).squeeze(-1), top2[..., 0], top2[..., 1], entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_confidence_stats_matches_reference(dtype, temperature):
    x = _logits((2, 3, 1031), dtype)
    noise = torch.rand(2, 3, 1031, generator=torch.Generator().manual_seed(1)).to(DEV) if temperature else None
    got = T.confidence_stats(x, temperature, noise)
    ref = R.confidence_stats(x, temperature, noise)
    # exact by construction: the same argmax (first maximal index) of the same float32 values
    assert torch.equal(got.token, ref.token) and got.token.dtype == torch.int64
    assert got.token.shape == (2, 3)
    # probabilities and entropy: the flash-attention rule against a float64 oracle, in both dtypes
    oracle = _naive_stats(x.double(), got.token)
    baseline = _naive_stats(x, got.token)
    for name, a, o, b, r in zip(("p_token", "p_max", "p_second", "entropy"), got[1:], oracle, baseline, ref[1:]):
        assert a.dtype == torch.float32 and a.shape == (2, 3), name
        _assert_close_rule(a, o, b, dtype, name)
        _assert_close_rule(r, o, b, dtype, "reference " + name)
    if temperature == 0:
        assert torch.equal(got.p_token, got.p_max)


def test_confidence_stats_split_merge_ties_and_tiny_vocab():
    x = _logits((4, 700), torch.float32, seed=3)
    x[0, 100] = x[0, 650] = 20.0  # tie across splits: first index wins, p_second == p_max
    x[1, :400] = float("-inf")  # whole splits of -inf
    noise = torch.rand(700, generator=torch.Generator().manual_seed(2)).to(DEV)  # broadcast over rows
    for splits in (1, 3, 11):
        for temperature, u in ((0.0, None), (1.5, noise)):
            _check_stats(T._confidence_stats(x, temperature, u, 64, splits), R.confidence_stats(x, temperature, u), 1e-5)
    got = T.confidence_stats(x)
    assert got.token[0] == 100 and got.p_second[0] == got.p_max[0]
    one = torch.randn(3, 1, device=DEV)
    _check_stats(T.confidence_stats(one), R.confidence_stats(one), 1e-6)
    assert (R.confidence_stats(one).p_second == 0).all() and (R.confidence_stats(one).p_max == 1).all()


def test_confidence_stats_second_stage_lane_and_split_ties():
    """Ties inside one split across lanes and tiles (lane 10 and lane 11 of a 256-wide tile, and lane 10 of the next
    tile) and across splits resolve to the first index; the on-device merge handles up to 64 splits."""
    x = _logits((3, 2000), torch.float32, seed=4)
    x[0, 10] = x[0, 11] = x[0, 266] = 30.0
    x[1, 1999] = x[1, 700] = 30.0
    x[2, 300] = 25.0
    x[2, 301] = 25.0 - 1e-3  # the second-largest in the neighbouring lane
    ref = R.confidence_stats(x)
    for splits in (1, 2, 5, 64):
        got = T._confidence_stats(x, 0.0, None, 256 if splits < 64 else 16, splits)
        _check_stats(got, ref, 1e-5)
    assert got.token.tolist()[:2] == [10, 700]
    with pytest.raises(ValueError, match="splits"):
        T._confidence_stats(x, 0.0, None, 16, 65)


@pytest.fixture
def merge_mode():
    """The confidence kernels' merge mode for the test (T.set_confidence_merge), then the previous one."""
    prev = T.set_confidence_merge("kernel")
    yield T.set_confidence_merge
    T.set_confidence_merge(prev)


def test_confidence_stats_merged_by_the_rows_last_program_give_the_same_values(merge_mode):
    """One launch, the row's last program merging (an atomic count per row), against two launches: the same bits for
    every split count, with noise, an excluded column, ties across splits and rows of -inf, and any leading shape."""
    x = _logits((4, 700), torch.float32, seed=3)
    x[0, 100] = x[0, 650] = 20.0
    x[1, :400] = float("-inf")
    noise = torch.rand(4, 700, generator=torch.Generator().manual_seed(2)).to(DEV)
    for splits in (1, 3, 11):
        for temperature, u, excl in ((0.0, None, -1), (1.5, noise, -1), (0.0, None, 650)):
            got = {}
            for mode in T.CONFIDENCE_MERGES:
                merge_mode(mode)
                got[mode] = T._confidence_stats(x.view(2, 2, 700), temperature,
                                                u.view(2, 2, 700) if u is not None else None, 64, splits, excl)
            one, two = got["last-program"], got["kernel"]
            assert one.token.shape == (2, 2)
            for f in ("token", "p_token", "p_max", "p_second", "entropy"):
                assert torch.equal(getattr(one, f), getattr(two, f)), (splits, temperature, excl, f)
    with pytest.raises(ValueError, match="confidence merge must be one of"):
        merge_mode("atomic")


def test_confidence_stats_excluding_a_column_in_one_pass():
    """``exclude`` (the mask token): never the proposal, still in the softmax, the top-2 and the entropy. The
    kernel skips the column in its proposal; the reference corrects the statistics of a pass without it; both
    against the full softmax in float64."""
    x = _logits((4, 700), torch.float32, seed=5)
    x[0, 42] = 30.0  # the excluded column is the largest logit: p_max is its probability, the token is another
    x[1, 100] = x[1, 650] = 20.0  # a tie away from the column
    x[2, 41] = 25.0
    noise = torch.rand(700, generator=torch.Generator().manual_seed(6)).to(DEV)
    for temperature, u in ((0.0, None), (1.5, noise)):
        ref = R.confidence_stats(x, temperature, u, exclude=42)
        assert not (ref.token == 42).any()
        for splits in (1, 3, 11):
            _check_stats(T._confidence_stats(x, temperature, u, 64, splits, 42), ref, 1e-5)
        assert torch.equal(T.confidence_stats(x, temperature, u, exclude=42).token, ref.token)
    ref = R.confidence_stats(x, exclude=42)
    p = torch.softmax(x.double(), -1)
    masked = x.clone()
    masked[:, 42] = float("-inf")
    token = masked.argmax(-1)
    assert torch.equal(ref.token, token) and ref.token[1] == 100
    torch.testing.assert_close(ref.p_token.double(), p.gather(-1, token[:, None]).squeeze(-1), atol=1e-6, rtol=1e-5)
    top2 = p.topk(2, -1).values
    torch.testing.assert_close(ref.p_max.double(), top2[:, 0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ref.p_second.double(), top2[:, 1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ref.entropy.double(), -torch.special.xlogy(p, p).sum(-1), atol=1e-5, rtol=1e-5)
    assert ref.p_max[0] > 0.99 and ref.p_token[0] < 0.01  # the excluded column holds the mass
    for out_of_range in (None, -1, 700):  # no column excluded
        _check_stats(T.confidence_stats(x, exclude=out_of_range), R.confidence_stats(x), 1e-6)


def test_confidence_stats_reference_semantics():
    """The reference agrees with the samplers' definitions: softmax prob, top-2 margin, entropy."""
    x = _logits((3, 50), torch.float32, seed=7)
    st = R.confidence_stats(x)
    p = torch.softmax(x, -1)
    top = torch.topk(p, 2, -1).values
    assert torch.equal(st.token, x.argmax(-1))
    torch.testing.assert_close(st.p_max, top[:, 0])
    torch.testing.assert_close(st.p_second, top[:, 1])
    torch.testing.assert_close(st.entropy, -(p * torch.log(p.clamp_min(1e-30))).sum(-1))
    u = torch.rand(3, 50, generator=torch.Generator().manual_seed(8)).to(DEV)
    noisy = R.confidence_stats(x, 0.5, u)
    lla = (x.double().exp() / (-torch.log(u.double())) ** 0.5).argmax(-1)  # LLaDA's float64 Gumbel-max
    assert torch.equal(noisy.token, lla)
    torch.testing.assert_close(noisy.p_token, p.gather(-1, lla[:, None]).squeeze(-1))
    with pytest.raises(ValueError):
        R.confidence_stats(x, -1.0)
    with pytest.raises(ValueError):
        R.confidence_stats(x, 0.5, torch.rand(4, 50, device=DEV))


# ----------------------------------------------------------------------------------------------- dispatch


def test_dispatch_default_and_override():
    K._backend, K._module = None, None
    expected = "triton" if torch.cuda.is_available() else "reference"
    assert K.get_backend() == expected
    K.set_backend("triton")
    assert K.get_backend() == "triton"
    q, k, v = _inputs(1, 2, 1, 3, 9, 16, torch.float32)
    torch.testing.assert_close(K.attention(q, k, v), R.attention(q, k, v), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(K.attention_mass(q, k), R.attention_mass(q, k), atol=1e-5, rtol=1e-5)
    x = _logits((2, 40), torch.float32)
    _check_stats(K.confidence_stats(x), R.confidence_stats(x), 1e-6)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        K.set_backend("cuda")


def test_dispatch_env_override(monkeypatch):
    K._backend, K._module = None, None
    monkeypatch.setenv("DLLM_KERNELS", "triton")
    assert K.get_backend() == "triton"
    K._backend, K._module = None, None
    monkeypatch.setenv("DLLM_KERNELS", "reference")
    assert K.get_backend() == "reference"


def test_import_dllm_does_not_import_triton():
    code = "import sys, dllm, dllm.kernels as K; K.attention; print('triton' in sys.modules)"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_model_forward_triton_backend_matches_reference(family):
    from tests.conftest import random_model

    model = random_model(family).to(DEV)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 90, (2, 9), generator=g).to(DEV)
    attn_mask = torch.ones(2, 9, dtype=torch.bool, device=DEV)
    attn_mask[1, :3] = False  # left padding
    K.set_backend("reference")
    ref = model(tokens, attn_mask=attn_mask)
    K.set_backend("triton")
    got = model(tokens, attn_mask=attn_mask)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------- samplers via the dispatcher


def _spy_confidence(monkeypatch, module):
    calls = []
    real = module.confidence_stats

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(module, "confidence_stats", spy)
    return calls


@pytest.mark.parametrize("confidence", ["prob", "margin", "neg_entropy"])
def test_threshold_sampler_uses_triton_confidence_kernel(monkeypatch, confidence):
    """With the Triton backend the composed samplers take proposal and score from the fused kernel (through
    the dispatcher), and decode the same tokens as the plain PyTorch path."""
    import dllm
    from dllm.samplers import get_sampler
    from tests.conftest import ragged_prompts, random_model

    model = random_model("llada").to(DEV)
    prompts = ragged_prompts(2)
    K.set_backend("reference")
    plain = dllm.generate(model, prompts, gen_length=8, block_length=8,
                          sampler=get_sampler("threshold", tau=0.3, confidence=confidence, fused="off"))
    K.set_backend("triton")
    calls = _spy_confidence(monkeypatch, T)
    fused = dllm.generate(model, prompts, gen_length=8, block_length=8,
                          sampler=get_sampler("threshold", tau=0.3, confidence=confidence))
    assert calls and len(calls) == fused.stats.nfe
    assert torch.equal(fused.sequences, plain.sequences)


def test_auto_fused_keeps_exact_path_on_reference_backend(monkeypatch):
    """On the reference backend ``fused="auto"`` keeps the bit-exact PyTorch path; ``"on"`` forces the
    dispatcher (the kernel's PyTorch twin) and still decodes the same tokens here."""
    import dllm
    from dllm.kernels import reference
    from dllm.samplers import get_sampler
    from tests.conftest import ragged_prompts, random_model

    model = random_model("dream")
    prompts = ragged_prompts(3)
    K.set_backend("reference")
    calls = _spy_confidence(monkeypatch, reference)
    auto = dllm.generate(model, prompts, gen_length=8, sampler=get_sampler("factor", factor=1.0))
    assert calls == []
    forced = dllm.generate(model, prompts, gen_length=8, sampler=get_sampler("factor", factor=1.0, fused="on"))
    assert len(calls) == forced.stats.nfe
    assert torch.equal(auto.sequences, forced.sequences)


BASELINE_SAMPLERS = [
    pytest.param("llada", {"remasking": "low_confidence"}, id="llada-low_confidence"),
    pytest.param("dream", {"alg": "maskgit_plus"}, id="dream-maskgit_plus"),
    pytest.param("dream", {"alg": "topk_margin"}, id="dream-topk_margin"),
    pytest.param("dream", {"alg": "entropy"}, id="dream-entropy"),
]


@pytest.mark.parametrize(("family", "params"), BASELINE_SAMPLERS)
def test_baseline_samplers_use_triton_confidence_kernel(monkeypatch, family, params):
    """With the Triton backend, LLaDA's greedy low-confidence remasking and Dream's greedy confidence algorithms
    take proposal and score from the fused kernel, once per forward, and decode the same tokens as the plain
    PyTorch path (reference backend, where ``fused="auto"`` keeps the bit-exact path)."""
    import dllm
    from dllm.samplers import get_sampler
    from tests.conftest import ragged_prompts, random_model

    model = random_model(family).to(DEV)
    prompts = ragged_prompts(2)
    kw = {"gen_length": 8, "steps": 4} | ({"block_length": 4} if family == "llada" else {})
    K.set_backend("reference")
    ref_calls = _spy_confidence(monkeypatch, R)
    plain = dllm.generate(model, prompts, sampler=get_sampler(family, **params), **kw)
    assert ref_calls == []  # auto on the reference backend: the plain path, the dispatcher is not called
    K.set_backend("triton")
    calls = _spy_confidence(monkeypatch, T)
    fused = dllm.generate(model, prompts, sampler=get_sampler(family, **params), **kw)
    assert fused.stats.nfe > 1 and len(calls) == fused.stats.nfe
    assert torch.equal(fused.sequences, plain.sequences)
    off = dllm.generate(model, prompts, sampler=get_sampler(family, fused="off", **params), **kw)
    assert len(calls) == fused.stats.nfe  # fused="off": no further kernel call
    assert torch.equal(off.sequences, plain.sequences)


def test_baseline_samplers_fuse_only_where_allowed():
    """Which steps go through the kernel: never at T > 0, with random remasking, Dream's ``origin``, a non-float32
    softmax or LLaDA's EOS/EOT exclusion (not even with ``fused="on"``), never with ``"off"``; ``"auto"`` only on
    the Triton backend (and, for Dream, whose softmax runs in the logits' dtype, float32 logits)."""
    from types import SimpleNamespace

    from dllm.samplers import DreamSampler, LLaDASampler

    ctx = SimpleNamespace(eos_id=1, eot_id=2)
    f32 = torch.zeros(1, 2, 16, device=DEV)
    bf16 = f32.bfloat16()
    K.set_backend("reference")
    assert not LLaDASampler()._fused(f32, ctx) and not DreamSampler(alg="entropy")._fused(f32)
    assert LLaDASampler(fused="on")._fused(f32, ctx) and DreamSampler(alg="entropy", fused="on")._fused(bf16)
    K.set_backend("triton")
    assert LLaDASampler()._fused(f32, ctx) and LLaDASampler()._fused(bf16, ctx)  # float32 confidence softmax
    assert LLaDASampler(softmax_dtype="model")._fused(f32, ctx)
    assert LLaDASampler(confidence_eos_eot_inf=True)._fused(f32, SimpleNamespace(eos_id=None, eot_id=None))
    assert DreamSampler(alg="maskgit_plus")._fused(f32) and not DreamSampler(alg="maskgit_plus")._fused(bf16)
    never_llada = [({"temperature": 0.5}, f32), ({"remasking": "random"}, f32), ({"softmax_dtype": "float64"}, f32),
                   ({"softmax_dtype": "model"}, bf16), ({"confidence_eos_eot_inf": True}, f32)]
    for kw, logits in never_llada:
        for fused in ("auto", "on"):
            assert not LLaDASampler(fused=fused, **kw)._fused(logits, ctx), (kw, fused)
    for kw in ({"alg": "origin"}, {"temperature": 0.5}):
        for fused in ("auto", "on"):
            assert not DreamSampler(fused=fused, **kw)._fused(f32), (kw, fused)
    assert not LLaDASampler(fused="off")._fused(f32, ctx) and not DreamSampler(fused="off")._fused(f32)


def test_dream_fused_scores_match_dream_definitions():
    """``fused_scores`` gives Dream's scores: p_max, top-1 minus top-2, and the negative entropy, which differs
    from Dream's ``sum p log(p + 1e-10)`` by less than ``V * 1e-10``."""
    from dllm.samplers.dream import _alg_confidence, fused_scores

    x = _logits((5, 300), torch.float32, seed=11)
    probs = torch.softmax(x, -1)
    conf = probs.max(-1).values
    for alg in ("maskgit_plus", "topk_margin", "entropy"):
        got, tok = fused_scores(x, alg)  # the dispatcher: the reference backend here
        assert torch.equal(tok, x.argmax(-1)) and got.dtype == torch.float32
        want = _alg_confidence(probs, conf, alg)
        if alg == "entropy":  # Dream's score is higher by sum p log(1 + 1e-10 / p), in [0, V * 1e-10]
            torch.testing.assert_close(got, want, atol=300 * 1e-10 + 1e-6, rtol=0)
        else:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="origin.*no fused score"):
        fused_scores(x, "origin")


@pytest.mark.parametrize("name", ["threshold", "llada", "dream"])
def test_fused_option_is_checked(name):
    from dllm.samplers import get_sampler

    with pytest.raises(ValueError, match="fused.*auto.*on.*off"):
        get_sampler(name, fused="yes")


# ------------------------------------------------------------------------------------------------ GPU only


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(2, 32, 32, 32, 1024, 128), (1, 28, 4, 32, 4096, 128), (2, 7, 1, 7, 129, 64)])
def test_gpu_attention_and_mass(shape, dtype):
    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v = _inputs(B, Hq, Hkv, Lq, Lk, D, dtype, device="cuda")
    mask = _padding(B, Lk, full_row=B - 1 if B > 1 else None).cuda()
    out, lse = T.attention(q, k, v, key_padding_mask=mask, return_lse=True)
    ref_out, ref_lse = R.attention(q.float(), k.float(), v.float(), key_padding_mask=mask, return_lse=True)
    base_out, base_lse = _naive(q, k, v, mask)
    _assert_close_rule(out, ref_out, base_out, torch.float16, "out")
    _assert_close_rule(lse, ref_lse, base_lse, torch.float16, "lse")
    mass = T.attention_mass(q, k, key_padding_mask=mask, lse=lse)
    ref_mass = R.attention_mass(q.float(), k.float(), key_padding_mask=mask)
    torch.testing.assert_close(mass, ref_mass, atol=Hq * Lq * 1e-3, rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_attention_drift_at_llada_8b_shape(dtype):
    """The drift test at Elastic-Cache's shapes on LLaDA-8B (32 heads of 128, 32 tracked rows, a 768-key canvas
    with left padding) against the float64 oracle."""
    t = _drift_inputs(2, 32, 32, 32, 768, 128, dtype, seed=5, device="cuda")
    got = T.attention_drift(*t)
    oracle = _naive_drift(*(x.double() for x in t[:4]), *t[4:]).float()
    torch.testing.assert_close(got, oracle, atol=1e-5 if dtype == torch.float32 else 1e-4, rtol=0)
    # with a gate (a graph's drift test): row 0 falls below its gate, row 1 does not
    gate = torch.stack([oracle[0] + 0.05, oracle[1] - 0.05]).cuda()
    first = torch.full((2,), 7, dtype=torch.long, device="cuda")
    T.attention_drift(*t, gate, first, 3)
    assert first.tolist() == [3, 7] and gate[0].item() == float("-inf") and gate[1].item() > 0


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_confidence_stats(dtype):
    x = _logits((32, 126464), dtype).cuda()
    u = torch.rand(32, 126464, device="cuda")
    for temperature, noise in ((0.0, None), (0.7, u)):
        _check_stats(T.confidence_stats(x, temperature, noise), R.confidence_stats(x, temperature, noise), 1e-4)


@gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 32, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_confidence_stats_merged_by_the_last_program_match_two_launches(rows, dtype, merge_mode):
    """On the device the programs of a row run concurrently: the last to finish must see every other's partials.
    The one-launch form (the default) gives the two-launch form's values, call after call, each call on new logits
    (a partial missed, or read from the last call's buffers, would be another row's or call's statistics). The token
    is the same; the probabilities and the entropy may differ by a few roundings, not more: the merge is the same
    code in both, but the compiler may contract its multiply-adds differently in the two kernels (on an H200, 512
    rows in bf16, the entropy differed by a rounding; in the interpreter, and so on the CPU, the bits are equal)."""
    x0 = _logits((rows, 126464), dtype).cuda()
    for i in range(50):
        x = torch.roll(x0, 977 * i, dims=-1)  # new logits for every call
        merge_mode("kernel")
        want = T.confidence_stats(x)
        merge_mode("last-program")
        got = T.confidence_stats(x)
        assert torch.equal(got.token, want.token), i
        for f in ("p_token", "p_max", "p_second", "entropy"):
            torch.testing.assert_close(getattr(got, f), getattr(want, f), rtol=5e-7, atol=1e-9, msg=f"{f}, call {i}")


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(2, 32, 32, 32, 1024, 128), (1, 28, 4, 17, 4097, 128), (2, 8, 2, 40, 300, 256),
                                   (3, 4, 1, 7, 129, 64)], ids=lambda s: "B{}H{}x{}Lq{}Lk{}D{}".format(*s))
def test_gpu_fp32_attention_tiles(shape):
    """The float32 launches (their own fixed tiles, ``fp32_tiles``) against the fp32 reference, and split-K's rows
    the same bits alone and in their batch."""
    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v = _inputs(B, Hq, Hkv, Lq, Lk, D, torch.float32, device="cuda")
    mask = _padding(B, Lk, full_row=B - 1 if B > 1 else None).cuda()
    ref_out, ref_lse = R.attention(q, k, v, key_padding_mask=mask, return_lse=True)
    for fn in (T.attention, T.attention_splitk):
        out, lse = fn(q, k, v, key_padding_mask=mask, return_lse=True)
        torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(T.attention_mass(q, k, key_padding_mask=mask),
                               R.attention_mass(q, k, key_padding_mask=mask), atol=1e-3, rtol=1e-4)
    whole = T.attention_splitk(q, k, v, key_padding_mask=mask)
    for b in range(B):
        one = T.attention_splitk(q[b:b + 1], k[b:b + 1], v[b:b + 1], key_padding_mask=mask[b:b + 1])
        assert torch.equal(one[0], whole[b])


BENCH_SHAPES = [(1, 32, 32, 32, 1024, 128), (1, 32, 32, 32, 4096, 128), (1, 28, 4, 32, 2048, 128),
                (4, 28, 4, 32, 4096, 128)]


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", BENCH_SHAPES, ids=lambda s: "B{}H{}x{}Lq{}Lk{}D{}".format(*s))
def test_gpu_splitk_bf16_matches_sdpa_and_oracle(shape):
    import torch.nn.functional as F

    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v = _inputs(B, Hq, Hkv, Lq, Lk, D, torch.bfloat16, device="cuda")
    sdpa = F.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != Hkv)
    out, lse = T.attention_splitk(q, k, v, return_lse=True)
    torch.testing.assert_close(out, sdpa, atol=1e-2, rtol=1e-2)
    ref_out, ref_lse = R.attention(q.float(), k.float(), v.float(), return_lse=True)
    base_out, base_lse = _naive(q, k, v, None)
    _assert_close_rule(out, ref_out, base_out, torch.float16, "out")
    _assert_close_rule(lse, ref_lse, base_lse, torch.float16, "lse")
    mask = _padding(B, Lk, full_row=B - 1 if B > 1 else None).cuda()
    out_m = T.attention_splitk(q, k, v, key_padding_mask=mask)
    _assert_close_rule(out_m, R.attention(q.float(), k.float(), v.float(), key_padding_mask=mask),
                       _naive(q, k, v, mask)[0], torch.float16, "masked out")


def _replayed_ms(fn, flush: torch.Tensor, calls: int = 20, rounds: int = 5) -> float:
    """Device milliseconds per call of ``fn`` as a CUDA graph replays it after the L2 cache was overwritten: one graph
    of ``calls`` (zero ``flush``, call ``fn``) pairs against one of the zeroings alone, the median of ``rounds``
    replays of each, the difference per call. Written apart from the dispatch's own timer, which times each replay
    between events."""
    fn()
    torch.cuda.synchronize()
    graphs = []
    for with_fn in (True, False):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                flush.zero_()
                if with_fn:
                    fn()
        graphs.append(graph)
    spans: list[list[float]] = [[], []]
    for _ in range(rounds):
        for i, graph in enumerate(graphs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            spans[i].append(start.elapsed_time(end))
    return (statistics.median(spans[0]) - statistics.median(spans[1])) / calls


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", BENCH_SHAPES[:3], ids=lambda s: "B{}H{}x{}Lq{}Lk{}D{}".format(*s))
def test_gpu_dispatch_picks_the_fastest(shape):
    """The dispatch's choice is within 1.3x of the fastest candidate timed the way it chooses: replayed from a CUDA
    graph with the L2 cache cleared, as the cached decode steps run attention. Eager calls of these shapes are
    host-bound (a Triton launch costs more host time than the kernel's device time), so eager timings would rank
    the launchers, not the kernels."""
    from dllm.kernels import dispatch as D

    K.set_backend("triton")
    K.set_attention_backend("auto")
    try:
        B, Hq, Hkv, Lq, Lk, Dh = shape
        q, k, v = _inputs(B, Hq, Hkv, Lq, Lk, Dh, torch.bfloat16, device="cuda")
        K.reset_attention_choices()
        out = K.attention(q, k, v)
        got = K.attention_choices()[D.bucket(q, k, None, False)]
        assert set(got["ms"]) == {"sdpa", "triton"} | set(T.splitk_candidates(B, Hq, Hkv, Lq, Lk, q.dtype))
        flush = D._l2_flush_buffer()  # the buffer the dispatch clears the L2 cache with (the timer is the test's own)
        ms = {c: _replayed_ms(lambda: D.run(c, T, q, k, v, None, False), flush)  # noqa: B023
              for c in got["ms"]}
        assert ms[got["choice"]] <= 1.3 * min(ms.values()), (got, ms)
        torch.testing.assert_close(out, D.run("sdpa", T, q, k, v, None, False), atol=1e-2, rtol=1e-2)
    finally:
        K.set_attention_backend(None)


@gpu
@needs_cuda
def test_gpu_torch_compile_through_custom_ops():
    K.set_backend("triton")
    q, k, v = _inputs(2, 28, 4, 32, 1000, 128, torch.bfloat16, device="cuda")
    mask = _padding(2, 1000).cuda()
    logits = _logits((32, 126464), torch.bfloat16).cuda()

    def step(q, k, v, mask, logits):
        a, lse = K.attention(q, k, v, key_padding_mask=mask, return_lse=True)
        st = K.confidence_stats(logits)
        return a * 2, lse, st.token, st.p_max, st.entropy

    try:
        for name in ("splitk", "triton"):
            K.set_attention_backend(name)
            torch._dynamo.reset()
            got = torch.compile(step, fullgraph=True)(q, k, v, mask, logits)
            want = step(q, k, v, mask, logits)
            # attention: Inductor autotunes the tiles of a user Triton kernel itself, and may pick other tiles than
            # the eager call's autotuner (another order of the sums): one bf16 rounding apart at a few elements
            # (H200: 12 of 229,376, 2**-7 relative); the confidence statistics have no tile choice: equal
            torch.testing.assert_close(got[0], want[0], atol=2e-3, rtol=2 ** -6)
            torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-5)
            for g, w in zip(got[2:], want[2:]):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    finally:
        K.set_attention_backend(None)


def test_empty_shapes():
    q, k, v = _inputs(1, 2, 1, 0, 9, 16, torch.float32)
    out, lse = T.attention(q, k, v, return_lse=True)
    assert out.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)
    assert T.attention_mass(q, k).eq(0).all()
    q, k, v = _inputs(1, 2, 1, 3, 0, 16, torch.float32)
    out, lse = T.attention(q, k, v, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()
    assert T.confidence_stats(torch.randn(0, 7, device=DEV)).token.shape == (0,)


def _big_offsets_check(B: int, T_: int, H: int, D: int, rows: int, V: int, device: str) -> None:
    """Attention on q / k / v viewed from one fused ``[B, T, 3, H, D]`` projection output (the fast layer's layout:
    a batch stride of ``T x 3 H D``) and confidence statistics of ``rows x V`` logits: the last batch row and the
    last logits row against the reference on that row alone. At the GPU test's sizes the offsets of the last rows
    pass 2^31 (int32 products wrap there); here at small sizes, the same code under the interpreter."""
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    qkv = torch.randn(B, T_, 3, H, D, device=device, dtype=dt)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, T, D] strided views
    q = q[:, :, :32]  # a decode step's few queries over every key
    ref = R.attention(q[-1:].float(), k[-1:].float(), v[-1:].float()).to(dt)
    for name, fn in (("flash", T.attention), ("split-K", T.attention_splitk)):
        out = fn(q, k, v)
        torch.testing.assert_close(out[-1:], ref, atol=2e-2, rtol=2e-2, msg=name)
    del qkv, q, k, v, out
    x = torch.randn(rows, V, device=device, dtype=dt) * 3
    _check_stats(_last(T.confidence_stats(x)), R.confidence_stats(x[-1:].float()), 1e-3)


def _last(stats):
    return type(stats)(*(f[-1:] for f in stats))


def test_big_offsets_logic_at_small_sizes():
    _big_offsets_check(B=3, T_=48, H=2, D=16, rows=5, V=700, device=DEV)


@gpu
@needs_cuda
def test_gpu_offsets_past_2_31():
    """LLaDA-8B's shapes where int32 offsets wrap: the fused QKV output's batch stride (4,096 x 12,288) at 44 rows,
    and 17,000 rows of its 126,464-word vocabulary (4.4 GB each in bf16)."""
    assert 43 * 4096 * 3 * 32 * 128 > 2**31 and 16999 * 126464 > 2**31
    _big_offsets_check(B=44, T_=4096, H=32, D=128, rows=17000, V=126464, device="cuda")


@gpu
@needs_cuda
def test_gpu_confidence_fp32_rows_do_not_depend_on_the_batch():
    """In float32 the vocabulary split count leaves the rows out: a row's statistics are the same bits alone and in
    a batch of 64 (in half precision the split count follows the rows)."""
    x = _logits((64, 126464), torch.float32).cuda()
    whole = T.confidence_stats(x)
    for i in (0, 37, 63):
        alone = T.confidence_stats(x[i:i + 1])
        for name, a, b in zip(alone._fields, alone, whole):
            assert torch.equal(a[0], b[i]), (name, i)
