"""Block-diffusion training of the tiny SDAR-, LLaDA2- and Fast-dLLM v2-format checkpoints.

A block-diffusion model attends bidirectionally inside a block and causally across blocks, and decodes block by
block with the finished blocks clean. Its training objective (BD3-LM's, used by SDAR and LLaDA2) puts a noisy
and a clean copy of each sequence in one forward of length ``2L``
(:func:`dllm.blockdiff.two_copy_inputs`):

* a noisy token of block ``b`` attends to the noisy tokens of block ``b`` and to the clean tokens of blocks
  before ``b``: exactly what it sees when block ``b`` is decoded;
* a clean token of block ``b`` attends to the clean tokens of blocks up to ``b`` (the finished blocks' keys);
* every block of the response has its own mask ratio ``t ~ U(eps, 1)``, so one forward trains every block at
  an independent noise level, and the loss is the cross-entropy on the masked tokens.

For a family with shifted logits (Fast-dLLM v2: token ``i`` predicted from hidden row ``i - 1``), the first token of
a block is predicted from the clean copy's last row of the block before (next-token prediction across the block
boundary, which is how Fast-dLLM v2's decoder gets each block's first token).

The checkpoints start from the bundled autoregressive model (``ar-tiny``), as SDAR, LLaDA2 and Fast-dLLM v2 start
from autoregressive models: dense weights are copied by name, a fused query/key/value projection takes the three
projections, QK norms start at one, and each mixture-of-experts layer is upcycled: every expert starts as the
dense MLP (plus a little noise, so that they can specialise), the router at small random weights, the shared
expert with a zero output projection, and with ``routed_scaling`` 1 the layer starts as the dense MLP exactly.
"""

from __future__ import annotations

import torch

from dllm.models.transformer import TransformerConfig, default_positions

#: Block-diffusion families the tiny trainer builds: their block size and config fields beyond the dense shape.
BLOCK_FAMILIES = {
    # SDAR (Qwen3 layout): per-head QK norms; blocks of 4 as SDAR-1.7B-Chat
    "sdar": {"block_size": 4},
    # LLaDA2.x (llada2_moe): fused QKV, QK norms, half the head rotary, a dense first layer, then 8 sigmoid-routed
    # experts in 4 groups (the best 2 groups, 2 experts per token) and one shared expert; blocks of 32
    "llada2": {"block_size": 32},
    # Fast-dLLM v2 (Qwen2.5 layout): QKV bias, no QK norms, token shift; blocks of 32 (bd_size)
    "fastdllm2": {"block_size": 32},
}


def is_block_family(family: str) -> bool:
    return family in BLOCK_FAMILIES


def model_config(family: str, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int,
                 mlp_hidden: int, tie_embeddings: bool, block_size: int | None = None) -> TransformerConfig:
    """The tiny model's config in ``family``'s layout (``block_size``: the family default when None)."""
    if family not in BLOCK_FAMILIES:
        raise ValueError(f"unknown block-diffusion family {family!r}; known: {', '.join(BLOCK_FAMILIES)}")
    bs = block_size or BLOCK_FAMILIES[family]["block_size"]
    common = dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                  mlp_hidden=mlp_hidden, max_seq_len=512, rope_theta=10000.0, norm_eps=1e-6,
                  tie_embeddings=tie_embeddings, block_size=bs)
    if family == "fastdllm2":
        return TransformerConfig(**common, qkv_bias=True)
    common["qk_norm"] = True
    if family == "sdar":
        return TransformerConfig(**common)
    head = d_model // n_heads
    return TransformerConfig(**common, fused_qkv=True, rope_dim=head // 2, n_experts=8, experts_per_token=2,
                             n_shared_experts=1, moe_hidden=mlp_hidden, dense_layers=1, n_groups=4, topk_groups=2,
                             routed_scaling=1.0)


def block_mask(valid: torch.Tensor, P: int, block_size: int, eps: float, gen: torch.Generator | None = None):
    """Masked response positions ``[B, R]`` and their mask ratios ``[B, R]``: one ratio ``t ~ U(eps, 1)`` per
    (row, block), blocks by position (``valid``: ``[B, L]`` real tokens, left padding; the response is columns
    ``P:``)."""
    B, L = valid.shape
    blk = default_positions(valid, B, L, valid.device)[:, P:] // block_size
    t_blocks = torch.rand(B, int(blk.max()) + 1, generator=gen) * (1 - eps) + eps
    t = t_blocks.gather(1, blk)
    return torch.rand(t.shape, generator=gen) < t, t


@torch.no_grad()
def upcycle_dense(model, dense_state: dict[str, torch.Tensor], noise: float = 0.01, seed: int = 0) -> None:
    """Initialise ``model`` (any layout of :class:`~dllm.models.transformer.Transformer`) from the state dict of a
    dense model of the same width (our parameter names: ``layers.i.q/k/v/o``, ``gate/up/down``): module
    docstring. Parameters with no dense counterpart keep their initialisation (QK norms: one)."""
    gen = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    for name, p in state.items():
        parts = name.split(".")
        src = None
        if name in dense_state:
            src = dense_state[name]
        elif parts[-2] == "qkv":  # layers.i.qkv.{weight,bias}
            pre = ".".join(parts[:-2])
            pieces = [dense_state.get(f"{pre}.{x}.{parts[-1]}") for x in "qkv"]
            src = torch.cat(pieces) if all(t is not None for t in pieces) else None
        elif "moe" in parts:
            i, kind = parts[1], parts[-2]
            if parts[3] == "experts" and f"layers.{i}.{kind}.weight" in dense_state:
                w = dense_state[f"layers.{i}.{kind}.weight"]
                src = w + noise * w.std() * torch.randn(w.shape, generator=gen)
            elif parts[3] == "shared" and kind == "down":
                src = torch.zeros_like(p)
            elif parts[3] == "router":
                src = 0.02 * torch.randn(p.shape, generator=gen)
        if src is None:
            continue
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"upcycling {name}: the dense model's tensor has shape {tuple(src.shape)}, the model "
                             f"needs {tuple(p.shape)}; use the dense model's width")
        p.copy_(src.to(p.dtype))
