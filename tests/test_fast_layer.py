"""The fast layer path (dllm.models.fast, dllm.kernels.fused): fused kernels against their PyTorch twins and the
eager modules, fused projections without duplicated storage, fast models against eager ones (full and cached
partial forwards, every checkpoint family), the published layout after fusion, torch.compile."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from conftest import random_model

import dllm
from dllm import kernels
from dllm.kernels import fused
from dllm.models import spec as specs
from dllm.models.fast import disable_fast_path, enable_fast_path
from dllm.models.transformer import RMSNorm, Transformer, TransformerConfig, apply_rope, rope_tables
from dllm.models.weights import init_weights

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tiny(family: str, seed: int = 0) -> Transformer:
    """Random tiny models in each checkpoint family's shape, every optional piece switched on somewhere: QKV bias
    (Dream, SDAR), explicit head size, QK norm, output bias and block attention (SDAR), the checkpoint's fused QKV,
    partial rotary and a mixture of experts after a dense layer (LLaDA2). Norm weights and biases are random so
    that a mixed-up row shows."""
    if family in ("llada", "dream"):
        model = random_model(family, seed)
    else:
        common = dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=48,
                      max_seq_len=256, qk_norm=True, qkv_bias=True, block_size=4)
        if family == "sdar":
            cfg, spec = TransformerConfig(**common, head_size=12, out_bias=True), specs.SDAR
        else:
            cfg = TransformerConfig(**common, fused_qkv=True, rope_dim=4, n_experts=4, moe_hidden=16,
                                    n_shared_experts=1, dense_layers=1, n_groups=2, topk_groups=1)
            spec = specs.LLADA2
        torch.manual_seed(seed)
        model = Transformer(cfg, spec)
        init_weights(model, std=0.5)
        model.eval().requires_grad_(False)
        model.mask_id, model.eos_id, model.eot_id, model.pad_id = 95, 1, 2, 1
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


FAMILIES = ["llada", "dream", "sdar", "llada2"]


# ------------------------------------------------------------------------------------------------ kernels


def _close(a, b, dtype):
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_kernels_match_their_twins_and_the_eager_norm(dtype, triton_backend):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 40, generator=g).to(dtype)
    y = torch.randn(2, 5, 40, generator=g).to(dtype)
    norm = RMSNorm(40, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(40, generator=g))
    eager = norm(h)
    assert torch.equal(fused.rms_norm_ref(h, norm.weight, 1e-5), eager)
    _close(fused.rms_norm(h, norm.weight, 1e-5), eager, dtype)
    s_ref, n_ref = fused.add_rms_norm_ref(h, y, norm.weight, 1e-5)
    assert torch.equal(s_ref, h + y) and torch.equal(n_ref, norm(h + y))
    s, n = fused.add_rms_norm(h, y, norm.weight, 1e-5)
    assert s.dtype == n.dtype == dtype
    assert torch.equal(s, h + y)  # one rounding of an exact fp32 sum, as h + y
    _close(n, n_ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope_dim,qk_norm", [(None, False), (None, True), (6, True), (4, False)])
def test_rope_kernel_matches_its_twin_and_the_eager_layer(dtype, rope_dim, qk_norm, triton_backend):
    B, T, Hq, Hkv, D = 2, 5, 4, 2, 10
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    positions = torch.randint(0, 50, (B, T), generator=g)
    cos, sin = rope_tables(positions, rope_dim or D, 10000.0)
    norm_w = (1 + 0.5 * torch.randn(2, D, generator=g)).to(dtype) if qk_norm else None
    # the eager layer's operations
    q, k, v = qkv.view(B, T, -1, D).split([Hq, Hkv, Hkv], dim=2)
    if qk_norm:
        qn, kn = RMSNorm(D, 1e-6).to(dtype), RMSNorm(D, 1e-6).to(dtype)
        with torch.no_grad():
            qn.weight.copy_(norm_w[0])
            kn.weight.copy_(norm_w[1])
        q, k = qn(q), kn(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    eq, ek = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rq, rk, rv = fused.rope_qk_ref(qkv, cos, sin, Hq, Hkv, norm_w, 1e-6)
    assert torch.equal(rq, eq) and torch.equal(rk, ek) and torch.equal(rv, v)
    tq, tk, tv = fused.rope_qk(qkv, cos, sin, Hq, Hkv, norm_w, 1e-6)
    assert tq.shape == eq.shape and tk.shape == ek.shape and torch.equal(tv, v)
    _close(tq, eq, dtype)
    _close(tk, ek, dtype)
    if rope_dim and not qk_norm:  # the dims past rope_dim pass through untouched
        assert torch.equal(tq[..., rope_dim:], eq[..., rope_dim:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope_dim,qk_norm", [(None, False), (6, True)])
def test_rope_write_kernel_equals_rope_then_the_cache_scatter(dtype, rope_dim, qk_norm, triton_backend):
    """rope_qk_write (RoPE with the keys and values written into the cache at the active columns) against its
    twin, which is rope_qk followed by KVCache.update's two scatters; untouched cache columns keep their bits."""
    B, T, Hq, Hkv, D, L = 2, 4, 4, 2, 10, 9
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    cos, sin = rope_tables(torch.randint(0, 50, (B, T), generator=g), rope_dim or D, 10000.0)
    norm_w = (1 + 0.5 * torch.randn(2, D, generator=g)).to(dtype) if qk_norm else None
    rows = torch.tensor([[1, 4, 6, 6], [0, 2, 3, 8]])  # a repeated column (padding) carries the same values
    qkv.view(B, T, -1)[0, 3] = qkv[0, 2]
    k0, v0 = torch.randn(B, Hkv, L, D, generator=g).to(dtype), torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    # the twin is the unfused path, operation for operation
    q, k, v = fused.rope_qk_ref(qkv, cos, sin, Hq, Hkv, norm_w, 1e-6)
    k1, v1 = k0.clone(), v0.clone()
    idx = rows[:, None, :, None].expand(-1, Hkv, -1, D)
    k1.scatter_(2, idx, k)
    v1.scatter_(2, idx, v)
    k2, v2 = k0.clone(), v0.clone()
    assert torch.equal(fused.rope_qk_write_ref(qkv, cos, sin, Hq, Hkv, norm_w, 1e-6, k2, v2, rows), q)
    assert torch.equal(k2, k1) and torch.equal(v2, v1)
    k3, v3 = k0.clone(), v0.clone()
    tq = fused.rope_qk_write(qkv, cos, sin, Hq, Hkv, norm_w, 1e-6, k3, v3, rows)
    assert tq.shape == q.shape
    _close(tq, q, dtype)
    _close(k3, k1, dtype)
    assert torch.equal(v3, v1)  # values are copied, not computed
    untouched = torch.ones(B, L, dtype=torch.bool)
    untouched.scatter_(1, rows, False)
    assert torch.equal(k3.transpose(1, 2)[untouched], k0.transpose(1, 2)[untouched])


def test_rope_write_refuses_mismatched_caches():
    qkv = torch.randn(1, 2, 8 * 4)
    cos, sin = rope_tables(torch.zeros(1, 2, dtype=torch.long), 4, 1e4)
    rows = torch.tensor([[0, 1]])
    good = torch.zeros(1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"k_cache must be \[B=1, Hkv=2, L, D=4\]"):
        fused.rope_qk_write(qkv, cos, sin, 4, 2, None, 1e-6, torch.zeros(1, 3, 5, 4), good, rows)
    with pytest.raises(ValueError, match="v_cache must be"):
        fused.rope_qk_write(qkv, cos, sin, 4, 2, None, 1e-6, good, good.double(), rows)
    with pytest.raises(ValueError, match="differ"):
        fused.rope_qk_write(qkv, cos, sin, 4, 2, None, 1e-6, good, torch.zeros(1, 2, 6, 4), rows)
    with pytest.raises(ValueError, match="rows must be"):
        fused.rope_qk_write(qkv, cos, sin, 4, 2, None, 1e-6, good, good.clone(), rows.int())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_kernel_matches_its_twin_and_the_eager_mlp(dtype, triton_backend):
    gu = torch.randn(3, 4, 2 * 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    g, u = gu[..., :24], gu[..., 24:]
    eager = torch.nn.functional.silu(g) * u
    assert torch.equal(fused.silu_mul_ref(gu), eager)
    _close(fused.silu_mul(gu), eager, dtype)


def test_fused_kernels_refuse_bad_shapes():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(x, torch.ones(6), 1e-5)
    with pytest.raises(ValueError, match="must agree"):
        fused.add_rms_norm(x, x[..., :4], torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="qkv must be"):
        fused.rope_qk(torch.randn(2, 3, 30), *rope_tables(torch.zeros(2, 3, dtype=torch.long), 4, 1e4), 4, 2)
    with pytest.raises(ValueError, match="cos/sin"):
        fused.rope_qk(torch.randn(2, 3, 32), *rope_tables(torch.zeros(2, 5, dtype=torch.long), 4, 1e4), 2, 1)
    with pytest.raises(ValueError, match="even"):
        fused.silu_mul(torch.randn(2, 5))


# ------------------------------------------------------------------------------------------------ fusion


def _storage_bytes(model) -> int:
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_fusion_keeps_one_copy_of_the_weights_and_the_published_names(family):
    model = _tiny(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    nbytes = _storage_bytes(model)
    enable_fast_path(model)
    assert model.fast_path
    assert _storage_bytes(model) == nbytes
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    dense = model.layers[0]
    if family != "llada2":  # the published q/k/v are row views of the fused matrix
        assert dense.q.weight.untyped_storage().data_ptr() == dense.qkv_weight.untyped_storage().data_ptr()
        assert torch.equal(dense.qkv_weight, torch.cat([before[f"layers.0.{n}.weight"] for n in "qkv"]))
    assert torch.equal(dense.gate_up_weight, torch.cat([before["layers.0.gate.weight"], before["layers.0.up.weight"]]))
    # an in-place update of a published parameter is an update of the fused tensor
    with torch.no_grad():
        dense.gate.weight.mul_(2)
    assert torch.equal(dense.gate_up_weight[:dense.gate.weight.shape[0]], 2 * before["layers.0.gate.weight"])


def test_moving_or_assigning_weights_fuses_again():
    model = enable_fast_path(_tiny("sdar"))
    tokens = torch.randint(0, 95, (2, 8))
    ref = model(tokens)
    model.to(torch.float64)
    block = model.layers[0]
    assert block.qkv_weight.dtype == torch.float64
    assert block.k.weight.untyped_storage().data_ptr() == block.qkv_weight.untyped_storage().data_ptr()
    model.to(torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["layers.1.up.weight"] = state["layers.1.up.weight"] * 0
    model.load_state_dict(state, assign=True)
    assert model.layers[1].up.weight.untyped_storage().data_ptr() == \
        model.layers[1].gate_up_weight.untyped_storage().data_ptr()
    assert not model.layers[1].gate_up_weight[48:].any()
    model.load_state_dict({k: v for k, v in _tiny("sdar").state_dict().items()})
    torch.testing.assert_close(model(tokens), ref, atol=1e-5, rtol=1e-5)
    buf = io.BytesIO()  # a pickled fast model comes back fused (its hooks are module-level functions)
    torch.save(model, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert again.fast_path and torch.equal(again(tokens), model(tokens))
    assert again.layers[0].v.weight.untyped_storage().data_ptr() == \
        again.layers[0].qkv_weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("family", ["dream", "llada2"])
def test_save_after_fusion_writes_the_published_layout_and_reloads(family, tmp_path):
    model = enable_fast_path(_tiny(family))
    tokens = torch.randint(0, 95, (2, 8))
    dllm.save_pretrained(model, tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as fh:
        stored = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}  # noqa: SIM118
    published = {theirs: tuple(model.state_dict()[ours].shape) for ours, theirs in
                 model.spec.key_map(model.config).items()}
    assert stored == published
    for fast in (False, True):
        again = dllm.load_model(tmp_path, tokenizer=False, fast=fast)
        assert again.fast_path is fast
        torch.testing.assert_close(again(tokens), model(tokens), atol=1e-5, rtol=1e-5)


def test_load_model_fast_choices():
    assert not dllm.load_model("llada-tiny", tokenizer=False).fast_path  # auto: CPU stays eager
    assert dllm.load_model("llada-tiny", tokenizer=False, fast=True).fast_path
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="fast must be"):
            dllm.load_model("llada-tiny", tokenizer=False, fast=bad)


# ------------------------------------------------------------------------------------------------ the model


class RowCache:
    """A minimal cache: full forwards store every layer's K/V, partial forwards scatter the computed rows in.
    Records what the hooks see."""

    read_cols = None
    sparse_logits = False

    def __init__(self):
        self.k, self.v, self.seen = {}, {}, []

    def update(self, layer, k, v, rows=None):
        if rows is None:
            self.k[layer], self.v[layer] = k.clone(), v.clone()
            return k, v
        idx = rows[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.k[layer].scatter_(2, idx, k)
        self.v[layer].scatter_(2, idx, v)
        return self.k[layer], self.v[layer]

    def layer_input(self, layer, h, rows):
        self.seen.append(("in", layer, h.clone()))

    def observe(self, layer, q, k, key_mask, rows):
        self.seen.append(("obs", layer, q.clone()))


def _compare_runs(eager, fast, tokens, mask, rows, atol=1e-5):
    c0, c1 = RowCache(), RowCache()
    torch.testing.assert_close(fast(tokens, attn_mask=mask, cache=c1), eager(tokens, attn_mask=mask, cache=c0),
                               atol=atol, rtol=atol)
    changed = tokens.clone()
    changed.scatter_(1, rows, 7)
    cols = rows + int(eager.shift_logits)  # Dream reads column c from row c - 1
    out0 = eager(changed, attn_mask=mask, cache=c0, query_idx=rows, logits_idx=cols)
    out1 = fast(changed, attn_mask=mask, cache=c1, query_idx=rows, logits_idx=cols)
    torch.testing.assert_close(out1, out0, atol=atol, rtol=atol)
    assert [s[:2] for s in c1.seen] == [s[:2] for s in c0.seen]
    for a, b in zip(c0.seen, c1.seen):
        torch.testing.assert_close(b[2], a[2], atol=atol, rtol=atol)
    for layer in c0.k:
        torch.testing.assert_close(c1.k[layer], c0.k[layer], atol=atol, rtol=atol)


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_model_equals_the_eager_model_full_and_partial(family):
    eager = _tiny(family)
    fast = enable_fast_path(copy.deepcopy(eager))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 95, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    rows = torch.tensor([[4, 5, 9, 10], [6, 7, 7, 10]])  # a repeated row, as ragged active sets are padded
    # the twins: the eager layer's operations in the eager order (the fused products may round differently)
    _compare_runs(eager, fast, tokens, mask, rows)
    disable_fast_path(fast)  # back to the eager layer over the fused storage
    assert not fast.fast_path
    assert torch.equal(fast(tokens, attn_mask=mask), eager(tokens, attn_mask=mask))


def test_the_deferred_residual_add_keeps_hooks_and_cache_inputs_whole():
    """A fast layer leaves its last residual add to the next layer's norm; a layer with a forward hook still
    returns (and shows the hook) the whole hidden state, the same as the eager layer's to rounding."""
    eager = _tiny("llada2")
    fast = enable_fast_path(copy.deepcopy(eager))
    tokens = torch.randint(3, 95, (2, 8), generator=torch.Generator().manual_seed(8))
    seen = {}
    for name, model in (("eager", eager), ("fast", fast)):
        handle = model.layers[0].register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, out))
        try:
            out = model(tokens)
        finally:
            handle.remove()
        seen[name + " logits"] = out
    assert isinstance(seen["fast"], torch.Tensor)
    torch.testing.assert_close(seen["fast"], seen["eager"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(seen["fast logits"], seen["eager logits"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast(tokens), seen["fast logits"], atol=1e-5, rtol=1e-5)  # no hook: deferred adds


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fast_forward_has_no_host_synchronisation_outside_the_moe(family):
    """Counted on the twins' path (the calls that would synchronise on CUDA); a mixture-of-experts layer keeps its
    eager routing, whose ``nonzero`` is the only synchronisation left."""
    from sync_counter import SyncCounter

    model = enable_fast_path(_tiny(family))
    tokens = torch.randint(3, 95, (2, 12), generator=torch.Generator().manual_seed(7))
    rows = torch.tensor([[4, 5], [6, 7]])
    cache = RowCache()
    with SyncCounter() as counter:
        model(tokens, cache=cache)
        model(tokens, cache=cache, query_idx=rows, logits_idx=rows + int(model.shift_logits))
    outside_moe = {k: n for k, n in counter.where.items() if k[0] != "nonzero"}
    assert not outside_moe
    assert (counter.count > 0) == (family == "llada2")


@pytest.mark.parametrize("family", ["dream", "llada2"])
def test_fast_model_with_the_triton_kernels(family, triton_backend):
    eager = _tiny(family)
    fast = enable_fast_path(copy.deepcopy(eager))
    tokens = torch.randint(3, 95, (2, 8), generator=torch.Generator().manual_seed(4))
    rows = torch.tensor([[2, 3], [5, 6]])
    _compare_runs(eager, fast, tokens, None, rows, atol=1e-4)


def test_generate_on_the_bundled_model_gives_the_same_tokens():
    eager = dllm.load_model("llada-tiny")
    fast = dllm.load_model("llada-tiny", fast=True)
    prompts = ["List three fruits.", "Name two colours, comma separated."]
    kw = dict(gen_length=32, block_length=16, sampler="fast-dllm")
    out0 = dllm.generate(eager, prompts, **kw)
    out1 = dllm.generate(fast, prompts, **kw)
    assert out1.sequences.tolist() == out0.sequences.tolist()


def test_kv_cache_offers_its_buffers_to_the_fast_layer_only_where_update_is_the_plain_scatter():
    from dllm.caches import get_cache

    model = dllm.load_model("llada-tiny")
    for name, offers in (("dual", True), ("prefix", True), ("elastic", False)):
        cache = get_cache(name)
        cache.reset(2, 12)
        assert cache.write_buffers(0, 2) is None  # nothing stored yet: update names the problem
        dllm.generate(model, ["One.", "Two."], gen_length=8, block_length=8, cache=cache)
        got = cache.write_buffers(0, 2)
        assert (got is not None) == offers, name
        if offers:
            assert got[0] is cache.k[0] and got[1] is cache.v[0] and got[0].is_contiguous()
            assert cache.write_buffers(0, 3) is None  # another batch: update raises


@pytest.mark.slow  # the interpreter: a minute; the default run decodes through the Triton fast layer with the dual
@pytest.mark.parametrize("cache", ["dual", "prefix"])  # cache in tests/test_graph_replay_safety.py
def test_fast_model_with_the_triton_kernels_decodes_the_eager_tokens_with_a_cache(cache, triton_backend):
    """The whole decode loop through the Triton kernels (interpreter): RoPE writing the cache's keys and values
    itself, the attention output stored for a view into the output product."""
    eager = dllm.load_model("llada-tiny")
    fast = dllm.load_model("llada-tiny", fast=True)
    # short token prompts of two lengths (under the interpreter a kernel's time grows with the canvas)
    prompts = [[11, 12, 13, 14], [15, 16, 17, 18, 19, 20, 21]]
    kw = dict(gen_length=16, block_length=8, sampler="fast-dllm", cache=cache)
    kernels.set_backend("reference")
    out0 = dllm.generate(eager, prompts, **kw)
    kernels.set_backend("triton")
    out1 = dllm.generate(fast, prompts, **kw)
    assert out1.sequences.tolist() == out0.sequences.tolist()


# ------------------------------------------------------------------------------------------------ compile


@pytest.mark.parametrize("fast", [False, True])
def test_torch_compile_matches_eager(fast):
    model = _tiny("dream")
    if fast:
        enable_fast_path(model)
    tokens = torch.randint(3, 95, (2, 8), generator=torch.Generator().manual_seed(5))
    ref = model(tokens)
    torch._dynamo.reset()  # compilations of Transformer.forward by earlier tests count towards the recompile limit
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(tokens), ref, atol=1e-5, rtol=1e-5)


def test_inductor_compiles_the_fast_model():
    model = enable_fast_path(_tiny("llada2"))
    tokens = torch.randint(3, 95, (2, 8), generator=torch.Generator().manual_seed(6))
    ref = model(tokens)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(model)(tokens), ref, atol=1e-4, rtol=1e-4)


def test_a_compiled_fast_model_decodes_with_the_dual_cache():
    """Cached partial forwards through the compiled model (the cache hooks are traced or run between graphs)."""
    model = dllm.load_model("llada-tiny", fast=True)
    prompts = ["List three fruits.", "Name two colours, comma separated."]
    kw = dict(gen_length=32, block_length=16, sampler="fast-dllm", cache="dual")
    ref = dllm.generate(model, prompts, **kw)
    torch._dynamo.reset()
    out = dllm.generate(torch.compile(model, backend="aot_eager"), prompts, **kw)
    assert out.sequences.tolist() == ref.sequences.tolist()


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", ["llada-tiny", "sdar-tiny", "llada2-tiny"])
def test_bf16_fast_path_gives_the_eager_tokens_on_cuda(name):
    eager = dllm.load_model(name, device="cuda", dtype="bfloat16", fast=False)
    fast = dllm.load_model(name, device="cuda", dtype="bfloat16")
    assert fast.fast_path  # auto on CUDA
    prompts = ["List three fruits.", "Name two colours, comma separated."]
    out0 = dllm.generate(eager, prompts, gen_length=32, block_length=16)
    out1 = dllm.generate(fast, prompts, gen_length=32, block_length=16)
    assert out1.sequences.tolist() == out0.sequences.tolist()


@pytest.mark.gpu
@cuda
def test_bf16_fast_layer_kernels_on_cuda():
    model = _tiny("sdar").to("cuda", torch.bfloat16)
    fast = enable_fast_path(copy.deepcopy(model))
    tokens = torch.randint(3, 95, (2, 16), device="cuda")
    torch.testing.assert_close(fast(tokens).float(), model(tokens).float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kernel_on_cuda(dtype):
    B, T, Hq, Hkv, D, L = 2, 32, 8, 2, 128, 300
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=g).to("cuda", dtype)
    cos, sin = rope_tables(torch.randint(0, 300, (B, T), generator=g).cuda(), D, 10000.0)
    rows = torch.stack([torch.randperm(L, generator=g)[:T] for _ in range(B)]).cuda()
    k0 = torch.randn(B, Hkv, L, D, generator=g).to("cuda", dtype)
    v0 = torch.randn(B, Hkv, L, D, generator=g).to("cuda", dtype)
    k1, v1, k2, v2 = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    q1 = fused.rope_qk_write_ref(qkv, cos, sin, Hq, Hkv, None, 1e-6, k1, v1, rows)
    q2 = fused.rope_qk_write(qkv, cos, sin, Hq, Hkv, None, 1e-6, k2, v2, rows)
    _close(q2.float(), q1.float(), dtype)
    _close(k2.float(), k1.float(), dtype)
    assert torch.equal(v2, v1)
