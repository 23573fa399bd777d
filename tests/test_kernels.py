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
import subprocess  # noqa: E402
import sys  # noqa: E402

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
def test_gpu_confidence_stats(dtype):
    x = _logits((32, 126464), dtype).cuda()
    u = torch.rand(32, 126464, device="cuda")
    for temperature, noise in ((0.0, None), (0.7, u)):
        _check_stats(T.confidence_stats(x, temperature, noise), R.confidence_stats(x, temperature, noise), 1e-4)


def test_empty_shapes():
    q, k, v = _inputs(1, 2, 1, 0, 9, 16, torch.float32)
    out, lse = T.attention(q, k, v, return_lse=True)
    assert out.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)
    assert T.attention_mass(q, k).eq(0).all()
    q, k, v = _inputs(1, 2, 1, 3, 0, 16, torch.float32)
    out, lse = T.attention(q, k, v, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()
    assert T.confidence_stats(torch.randn(0, 7, device=DEV)).token.shape == (0,)
