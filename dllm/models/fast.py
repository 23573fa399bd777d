"""The fast layer path: projections fused at load time and the layer's elementwise work in a few fused kernels.

:func:`enable_fast_path` rebuilds each layer's query/key/value weights as one ``[(Hq + 2 Hkv) * D, d]`` matrix (and
bias), the dense MLP's gate and up weights as one ``[2 H, d]`` matrix and the QK-norm weights as one ``[2, D]``
table. The published parameters (``q.weight``, ``gate.weight``, ...) stay registered under their names as views
into the fused tensors, so no weight is stored twice and ``state_dict`` / ``save_pretrained`` still write the
published layout. A layer then runs (:func:`block_forward`):

``rms_norm`` -> QKV product -> ``rope_qk`` (QK norm + RoPE of queries and keys, one kernel) -> cache update ->
attention -> output product -> ``add_rms_norm`` (residual + MLP norm) -> gate/up product -> ``silu_mul`` -> down
product -> residual add. The last residual add is deferred to the next layer, whose first norm becomes
``add_rms_norm`` (:meth:`~dllm.models.transformer.Transformer.forward` passes it on; a layer with forward hooks, or a
cache's per-layer ``layer_input`` hook, sees the sum as before).

In a partial forward over a :class:`~dllm.caches.base.KVCache` the cache update is no separate step:
``rope_qk_write`` (the same kernel) writes the rotated keys and the values into the cache's buffers at the active
rows (:meth:`~dllm.caches.base.KVCache.write_buffers`). The attention kernels store their output as ``[B, T, H, D]``,
so the output product reads it without a copy. On CUDA a cached layer is nine kernels (``tests/test_launches.py``).

The kernels (:mod:`dllm.kernels.fused`) are Triton on CUDA and their PyTorch twins elsewhere; the cache hooks,
attention dispatch and block-diffusion attention are the eager layer's. The path has no host synchronisation and
no data-dependent shape (mixture-of-experts layers keep their eager MLP, which has both). The eager layer
(:meth:`dllm.models.transformer.Block.forward` without the fast path) is the readable definition and the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dllm import kernels
from dllm.kernels import fused

FAST_CHOICES = ("auto", True, False)


def check_fast(fast) -> None:
    if not any(fast is c or (isinstance(c, str) and fast == c) for c in FAST_CHOICES):
        raise ValueError(f"fast must be 'auto' (the fast layer path on CUDA devices only), True or False, got "
                         f"{fast!r}")


def wants_fast(fast, model: nn.Module) -> bool:
    """Whether ``fast`` (``"auto"``, True, False) turns the fast path on for ``model``: ``"auto"`` does when
    every parameter lives on a CUDA device."""
    check_fast(fast)
    if fast == "auto":
        params = list(model.parameters())
        return bool(params) and all(p.device.type == "cuda" for p in params)
    return bool(fast)


def enable_fast_path(model: nn.Module) -> nn.Module:
    """Fuse the projections of every layer of ``model`` (a :class:`~dllm.models.transformer.Transformer`) and
    switch its layers to :func:`block_forward`. Idempotent; returns ``model``."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"enable_fast_path needs a dllm Transformer (with .layers), got {type(model).__name__}")
    for layer in layers:
        if not (getattr(layer, "fused", False) and _still_views(layer)):  # fused already: the same tensors stay
            fuse_block(layer)
        layer.fast = True
    params = list(model.parameters())
    if params:
        fused.prepare(params[0])
    return model


def disable_fast_path(model: nn.Module) -> nn.Module:
    """Back to the eager layer (the fused storage stays; the published parameters remain views of it)."""
    for layer in model.layers:
        layer.fast = False
    return model


def _fuse(module: nn.Module, owners: list[tuple[nn.Module, str]], buffer: str) -> None:
    """Concatenate the tensors ``owner.<name>`` along dim 0 into buffer ``module.<buffer>`` (not saved) and
    re-register each as a Parameter viewing its rows. The old separate storages are freed."""
    parts = [getattr(o, n) for o, n in owners]
    with torch.no_grad():
        whole = torch.cat([p.detach() for p in parts], dim=0)
    start = 0
    for (owner, name), p in zip(owners, parts):
        n = p.shape[0]
        setattr(owner, name, nn.Parameter(whole[start:start + n], requires_grad=p.requires_grad))
        start += n
    module.register_buffer(buffer, whole, persistent=False)


def fuse_block(block: nn.Module) -> None:
    """Build the fused tensors of one layer (``qkv_weight`` / ``qkv_bias``, ``gate_up_weight``,
    ``qk_norm_weight``: non-persistent buffers) with the published parameters as views; already fused or fused
    by the checkpoint (LLaDA2's ``qkv``) parts are left as they are."""
    if hasattr(block, "q"):
        _fuse(block, [(block.q, "weight"), (block.k, "weight"), (block.v, "weight")], "qkv_weight")
        if block.q.bias is not None:
            _fuse(block, [(block.q, "bias"), (block.k, "bias"), (block.v, "bias")], "qkv_bias")
    if hasattr(block, "gate"):
        _fuse(block, [(block.gate, "weight"), (block.up, "weight")], "gate_up_weight")
    if hasattr(block, "q_norm"):
        q, k = block.q_norm.weight, block.k_norm.weight
        with torch.no_grad():
            whole = torch.stack([q.detach(), k.detach()])
        block.q_norm.weight = nn.Parameter(whole[0], requires_grad=q.requires_grad)
        block.k_norm.weight = nn.Parameter(whole[1], requires_grad=k.requires_grad)
        block.register_buffer("qk_norm_weight", whole, persistent=False)
    block.fused = True


def refuse_block(block: nn.Module) -> None:
    """Fuse again after the published parameters were replaced (``module.to(...)``, ``load_state_dict(...,
    assign=True)``): they then own separate storages, and the fused buffers are stale."""
    if getattr(block, "fused", False) and not _still_views(block):
        fuse_block(block)


def refuse_after_load(block: nn.Module, incompatible_keys=None) -> None:
    """``load_state_dict`` post-hook of every layer (a module-level function, so a model still pickles)."""
    refuse_block(block)


def _still_views(block: nn.Module) -> bool:
    pairs = []
    if hasattr(block, "q"):
        pairs.append((block.q.weight, block.qkv_weight))
        if block.q.bias is not None:
            pairs.append((block.q.bias, block.qkv_bias))
    if hasattr(block, "gate"):
        pairs.append((block.gate.weight, block.gate_up_weight))
    if hasattr(block, "q_norm"):
        pairs.append((block.q_norm.weight, block.qk_norm_weight))
    for p, whole in pairs:
        if p.device != whole.device or p.dtype != whole.dtype or \
                p.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr():
            return False
    return True


def block_forward(block, h, cos, sin, key_mask, layer_idx: int, cache=None, rows=None, blocks=None, pending=None,
                  defer: bool = False, pack=None):
    """:meth:`Block.forward` with fused weights and kernels; same inputs, same outputs (to rounding). ``pending``:
    the previous layer's deferred residual (the input is ``h + pending``, added inside the norm's kernel);
    ``defer``: return ``(h, y)`` and leave this layer's last add to the next one; ``pack``: ``h`` holds the active
    rows packed (:class:`~dllm.models.transformer.RowPacking`), unpacked around attention."""
    eps = block.attn_norm.eps
    if pending is None:
        x = fused.rms_norm(h, block.attn_norm.weight, eps)
    else:
        h, x = fused.add_rms_norm(h, pending, block.attn_norm.weight, eps)
    if hasattr(block, "qkv"):  # fused by the checkpoint (LLaDA2)
        qkv = block.qkv(x)
    else:
        qkv = F.linear(x, block.qkv_weight, getattr(block, "qkv_bias", None))
    if pack is not None:  # RoPE, the cache's writes and attention on the padded rows
        qkv = pack.unpack(qkv)
    B, T, _ = qkv.shape
    if hasattr(block, "q_norm"):
        norm_w, norm_eps = block.qk_norm_weight, block.q_norm.eps
    else:
        norm_w, norm_eps = None, 0.0
    targets = None
    if cache is not None and rows is not None:  # a partial forward: RoPE writes K/V into the cache itself
        write_buffers = getattr(cache, "write_buffers", None)
        targets = write_buffers(layer_idx, B) if write_buffers is not None else None
    if targets is not None:
        k, v = targets
        q = fused.rope_qk_write(qkv, cos, sin, block.n_heads, block.n_kv_heads, norm_w, norm_eps, k, v, rows)
    else:
        q, k, v = fused.rope_qk(qkv, cos, sin, block.n_heads, block.n_kv_heads, norm_w, norm_eps)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v) if rows is None else cache.update(layer_idx, k, v, rows)
    if blocks is None:
        a = kernels.attention(q, k, v, key_padding_mask=key_mask)
    elif isinstance(blocks, torch.Tensor):
        a = kernels.reference.pattern_attention(q, k, v, blocks, key_padding_mask=key_mask)
    else:
        a = kernels.reference.block_causal_attention(q, k, v, blocks[0], blocks[1], key_padding_mask=key_mask)
    observe = cache.observe if cache is not None else None
    if observe is not None:
        observe(layer_idx, q, k, key_mask, rows)
    a = a.transpose(1, 2).reshape(B, T, -1)
    h, x = fused.add_rms_norm(h, block.o(a if pack is None else pack.pack(a)), block.mlp_norm.weight,
                              block.mlp_norm.eps)
    if hasattr(block, "moe"):
        y = block.moe(x)
    else:
        y = F.linear(fused.silu_mul(F.linear(x, block.gate_up_weight)), block.down.weight)
    return (h, y) if defer else h + y
