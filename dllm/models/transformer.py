"""One bidirectional Transformer for every supported dLLM family.

RMSNorm (fp32 inside), rotary embeddings (split halves, fp32), SwiGLU MLP, grouped-query attention with an
optional QKV bias, optional per-head QK RMSNorm and an explicit head size (Qwen3-style, SDAR), and attention that
is bidirectional over the whole canvas or, for block-diffusion models (``block_size``), bidirectional inside a
block and causal across blocks. Family-specific facts (checkpoint names, special ids, Dream's logit shift) live in a
:class:`~dllm.models.spec.ModelSpec`; nothing cache- or sampler-specific is threaded through this file beyond
the generic partial-forward inputs of :meth:`Transformer.forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dllm import kernels
from dllm.kernels.fused import rms_norm_ref, rope_ref
from dllm.models import fast as fast_path


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    mlp_hidden: int
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = False
    head_size: int | None = None  # per-head size when it is not d_model / n_heads (Qwen3, SDAR)
    qk_norm: bool = False  # RMSNorm of each head's query and key before RoPE (Qwen3, SDAR)
    out_bias: bool = False  # a bias on the attention output projection (SDAR's attention_bias covers it)
    block_size: int | None = None  # block-diffusion attention: bidirectional in a block, causal across blocks
    rope_dim: int | None = None  # head dims that get RoPE (partial rotary, LLaDA2); None: all of them
    fused_qkv: bool = False  # one query/key/value projection (LLaDA2's query_key_value)
    # mixture of experts (LLaDA2): layers from ``dense_layers`` on route each token to ``experts_per_token`` of
    # ``n_experts`` SwiGLU experts (``moe_hidden`` wide) plus ``n_shared_experts`` always-on ones
    n_experts: int = 0
    experts_per_token: int = 2
    n_shared_experts: int = 0
    moe_hidden: int | None = None
    dense_layers: int = 0
    n_groups: int = 1  # group-limited routing: experts in n_groups groups, the best topk_groups kept per token
    topk_groups: int = 1
    routed_scaling: float = 1.0

    def __post_init__(self):
        if self.head_size is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        for name in ("head_size", "block_size", "rope_dim", "moe_hidden"):
            v = getattr(self, name)
            if v is not None and (type(v) is not int or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        if self.rope_dim is not None and (self.rope_dim > self.head_dim or self.rope_dim % 2):
            raise ValueError(f"rope_dim ({self.rope_dim}) must be even and at most head_dim ({self.head_dim})")
        if self.n_experts:
            if self.moe_hidden is None or not 1 <= self.experts_per_token <= self.n_experts:
                raise ValueError(f"a mixture of experts needs moe_hidden and 1 <= experts_per_token <= n_experts, got "
                                 f"{self.moe_hidden}, {self.experts_per_token}, {self.n_experts}")
            if self.n_experts % self.n_groups or not 1 <= self.topk_groups <= self.n_groups or \
                    self.n_experts // self.n_groups < 2:
                raise ValueError(f"n_experts ({self.n_experts}) must split into n_groups ({self.n_groups}) groups of at "
                                 f"least 2, and 1 <= topk_groups ({self.topk_groups}) <= n_groups")

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.d_model // self.n_heads


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back to the input dtype, then scale (LLaDA and Qwen2 agree on this order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float):
    """cos/sin of shape ``[B, 1, T, head_dim]`` (fp32) for integer ``positions`` ``[B, T]``."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    )
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE computed in fp32, returned in ``x.dtype``. ``x``: ``[B, H, T, D]``; with tables narrower
    than ``D`` (partial rotary) only the first ``cos.shape[-1]`` dims rotate, the rest pass through. The eager layer
    and the fast path's twin are one function (:func:`dllm.kernels.fused.rope_ref`)."""
    return rope_ref(x, cos, sin)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Mixture of SwiGLU experts with LLaDA2's routing: sigmoid scores of an fp32 router; the experts chosen by
    the scores plus a per-expert bias (``expert_bias``, routing only) within the ``topk_groups`` best groups (a
    group's score: the sum of its two best); the chosen experts' scores, normalised to sum 1 (when more than one)
    and times ``routed_scaling``, weight their outputs; shared experts are added for every token. Every token is
    routed on its own, so a row's output does not depend on its batch."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        d = cfg.d_model
        self.k, self.groups, self.topk_groups, self.scale = (cfg.experts_per_token, cfg.n_groups, cfg.topk_groups,
                                                             cfg.routed_scaling)
        self.router = nn.Linear(d, cfg.n_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        self.experts = nn.ModuleList(SwiGLU(d, cfg.moe_hidden) for _ in range(cfg.n_experts))
        self.shared = SwiGLU(d, cfg.moe_hidden * cfg.n_shared_experts) if cfg.n_shared_experts else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(experts [N, k], weights [N, k])`` for tokens ``x`` ``[N, d]``."""
        scores = torch.sigmoid(F.linear(x.float(), self.router.weight.float()))
        biased = scores + self.expert_bias.float()
        N, E = biased.shape
        group = biased.view(N, self.groups, E // self.groups).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group).scatter_(1, group.topk(self.topk_groups, dim=-1).indices, 1.0).bool()
        keep = keep[:, :, None].expand(N, self.groups, E // self.groups).reshape(N, E)
        idx = biased.masked_fill(~keep, float("-inf")).topk(self.k, dim=-1).indices
        w = scores.gather(1, idx)
        if self.k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, w = self.route(flat)
        out = torch.zeros(flat.shape[0], self.k, flat.shape[1], dtype=flat.dtype, device=flat.device)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                out[tok, slot] = expert(flat[tok])
        y = (out.to(w.dtype) * w[..., None]).sum(1).to(flat.dtype)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view(shape)


class RowPacking:
    """The active rows of a partial forward without their padding. ``rows`` ``[B, Q]`` pads a row's shorter active
    set by repeating its first index; the per-token work of a layer (norms, products, MLP) runs on the ``N``
    distinct rows packed as ``[1, N, ...]`` and only attention, RoPE and the cache's writes on the padded
    ``[B, Q, ...]`` layout, whose padding repeats the row's first token (as computing it again would). ``n`` above the
    number of distinct rows packs that many slots, the extra ones padding slots (computed and dropped: the graph
    path's bucketed sizes).

    ``take`` ``[N]``: the padded slot of each packed row (row-major order); ``spread`` ``[B * Q]``: the packed row
    of each slot (a padding slot: its row's first). Device work only: ``N`` comes from the host (the decode loop's
    synchronisation), and an ``N`` below the distinct rows fails a device assertion."""

    def __init__(self, rows: torch.Tensor, n: int):
        B, Q = rows.shape
        self.B, self.Q, self.N = B, Q, n
        real = torch.ones_like(rows, dtype=torch.bool)
        real[:, 1:] = rows[:, 1:] != rows[:, :1]
        flat = real.flatten()
        torch._assert_async(flat.sum() <= n, "query_tokens is below the number of distinct active rows")
        # the real rows first (row-major), then, where n exceeds their count (a graph's bucket), padding slots
        self.take = torch.argsort(flat.view(torch.uint8), descending=True, stable=True)[:n]
        packed = flat.long().cumsum(0) - 1
        self.spread = torch.where(flat, packed, packed.view(B, Q)[:, :1].expand(B, Q).flatten())

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, Q, ...]`` -> ``[1, N, ...]``."""
        return t.reshape(self.B * self.Q, *t.shape[2:]).index_select(0, self.take)[None]

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """``[1, N, ...]`` -> ``[B, Q, ...]`` (padding slots repeat their row's first)."""
        return t[0].index_select(0, self.spread).view(self.B, self.Q, *t.shape[2:])


class Block(nn.Module):
    fast = False  # run :func:`dllm.models.fast.block_forward` (set by :func:`dllm.models.fast.enable_fast_path`)
    fused = False  # q/k/v and gate/up parameters are views of fused buffers (:func:`dllm.models.fast.fuse_block`)

    def __init__(self, cfg: TransformerConfig, layer: int = 0):
        super().__init__()
        self.register_load_state_dict_post_hook(fast_path.refuse_after_load)
        d, hd = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.attn_norm = RMSNorm(d, cfg.norm_eps)
        if cfg.fused_qkv:
            self.qkv = nn.Linear(d, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, bias=cfg.qkv_bias)
        else:
            self.q = nn.Linear(d, cfg.n_heads * hd, bias=cfg.qkv_bias)
            self.k = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
            self.v = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.o = nn.Linear(cfg.n_heads * hd, d, bias=cfg.out_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps)
            self.k_norm = RMSNorm(hd, cfg.norm_eps)
        self.mlp_norm = RMSNorm(d, cfg.norm_eps)
        if cfg.n_experts and layer >= cfg.dense_layers:
            self.moe = MoE(cfg)
        else:
            self.gate = nn.Linear(d, cfg.mlp_hidden, bias=False)
            self.up = nn.Linear(d, cfg.mlp_hidden, bias=False)
            self.down = nn.Linear(cfg.mlp_hidden, d, bias=False)

    def forward(self, h, cos, sin, key_mask, layer_idx: int, cache=None, rows=None, blocks=None, pending=None,
                defer: bool = False, pack: RowPacking | None = None):
        """``h``: ``[B, Q, d]`` hidden states of the computed rows (all ``T`` rows when ``rows`` is None, else
        the canvas rows ``rows`` ``[B, Q]``); ``cos``/``sin`` are the RoPE tables of those rows. Keys and
        values of the rows not computed come from ``cache.update``. ``blocks``: ``(query blocks [B, Q], key
        blocks [B, T])`` for block-diffusion attention (a query attends to keys of its block and earlier ones), or
        an explicit ``[B, Q, T]`` bool pattern of which keys each query attends to.

        ``pending`` / ``defer`` (the fast path's residual fusion): the layer input is ``h + pending`` (the previous
        layer's last residual add, done here inside the norm's kernel), and with ``defer`` the layer returns
        ``(h, y)`` instead of ``h + y``, leaving its own last add to the next layer. ``pack``: ``h`` (and
        ``pending``) hold the active rows packed, ``[1, N, d]`` (:class:`RowPacking`); attention runs on the
        padded rows."""
        if self.fast:
            return fast_path.block_forward(self, h, cos, sin, key_mask, layer_idx, cache, rows, blocks, pending,
                                           defer, pack)
        if pending is not None:
            h = h + pending
        B, T, _ = h.shape
        x = self.attn_norm(h)
        if hasattr(self, "qkv"):  # one projection: queries, then keys, then values, per head
            q, k, v = self.qkv(x).view(B, T, -1, self.head_dim).split(
                [self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        else:
            q = self.q(x).view(B, T, self.n_heads, self.head_dim)
            k = self.k(x).view(B, T, self.n_kv_heads, self.head_dim)
            v = self.v(x).view(B, T, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):  # per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if pack is not None:  # attention on the padded rows
            q, k, v = pack.unpack(q), pack.unpack(k), pack.unpack(v)
            B, T = pack.B, pack.Q
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v) if rows is None else cache.update(layer_idx, k, v, rows)
        if blocks is None:
            a = kernels.attention(q, k, v, key_padding_mask=key_mask)
        elif isinstance(blocks, torch.Tensor):  # an explicit [B, Q, T] pattern (block-diffusion training)
            a = kernels.reference.pattern_attention(q, k, v, blocks, key_padding_mask=key_mask)
        else:
            a = kernels.reference.block_causal_attention(q, k, v, blocks[0], blocks[1], key_padding_mask=key_mask)
        observe = cache.observe if cache is not None else None
        if observe is not None:  # optional hook (Elastic-Cache: attention mass, drift test)
            observe(layer_idx, q, k, key_mask, rows)
        a = a.transpose(1, 2).reshape(B, T, -1)
        h = h + self.o(a if pack is None else pack.pack(a))
        x = self.mlp_norm(h)
        y = self.moe(x) if hasattr(self, "moe") else self.down(F.silu(self.gate(x)) * self.up(x))
        return (h, y) if defer else h + y

    def _apply(self, fn, recurse=True):
        # moving or casting gives each published parameter its own storage again: rebuild the fused tensors
        out = super()._apply(fn, recurse)
        fast_path.refuse_block(self)
        return out


class Transformer(nn.Module):
    """Bidirectional decoder. ``spec`` (a ModelSpec) and ``tokenizer`` are attached by the loader."""

    def __init__(self, cfg: TransformerConfig, spec=None):
        super().__init__()
        self.config = cfg
        self.spec = spec
        self.tokenizer = None
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        # Special ids; the loader sets them from config.json / the tokenizer, falling back to the spec.
        self.mask_id: int | None = spec.mask_id if spec else None
        self.eos_id: int | None = spec.eos_id if spec else None
        self.eot_id: int | None = spec.eot_id if spec else None
        self.pad_id: int | None = spec.pad_id if spec else None

    @staticmethod
    def expected_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
        """Parameter name -> shape for ``cfg`` (computed on the meta device, no memory used)."""
        with torch.device("meta"):
            m = Transformer(cfg)
        return {k: tuple(v.shape) for k, v in m.state_dict().items()}

    def enable_fast_path(self) -> Transformer:
        """Fused projections and kernels for every layer (:func:`dllm.models.fast.enable_fast_path`)."""
        return fast_path.enable_fast_path(self)

    @property
    def fast_path(self) -> bool:
        """Whether the layers run the fast path."""
        return any(layer.fast for layer in self.layers)

    # -- facts the decode loop asks for -------------------------------------------------------------------
    @property
    def shift_logits(self) -> bool:
        return bool(self.spec and self.spec.shift_logits)

    @property
    def max_seq_len(self) -> int:
        limit = self.config.max_seq_len
        return min(limit, self.spec.max_context) if self.spec else limit

    @property
    def supports_cache(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        query_idx: torch.Tensor | None = None,
        cache=None,
        logits_idx: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
        block_size: int | None = None,
        attn_pattern: torch.Tensor | None = None,
        query_tokens: int | None = None,
        start_layer: int = 0,
        stop_layer: int | None = None,
    ) -> torch.Tensor | None:
        """Logits for the positions the caller asks for.

        Args:
            tokens: ``[B, T]`` int64 canvas.
            positions: ``[B, T]`` int64 RoPE positions (per row; default ``cumsum(attn_mask) - 1`` or
                ``0..T-1``).
            attn_mask: ``[B, T]`` bool, True for real tokens; padded keys are never attended to.
            query_idx: ``[B, Q]`` int64 active rows of a partial forward (``None``: every row). Only these
                rows' hidden states are computed; their attention runs over every key, fresh ones for these
                rows and the cache's stored ones for the others. A row may repeat (padding of ragged active
                sets); rows never mix across the batch.
            cache: an object with ``update(layer, k, v[, rows]) -> (k, v)`` returning the full ``[B, Hkv, T,
                D]`` post-RoPE keys/values (see :mod:`dllm.caches`), or ``None``. Optional hooks:
                ``layer_input(layer, h, rows)`` (sees every layer's input; in a partial forward it may return
                ``[B, T, d]`` hidden states to compute every row from this layer on, or ``(h, rows)`` to compute
                other rows from this layer on (per-row refreshes), else None), ``observe(layer, q, k, key_mask, rows)`` (sees the queries and
                the full keys, e.g. for attention mass) and ``write_buffers(layer, batch)`` (the fast layer's partial
                forwards: ``(k, v)`` buffers to write the active rows' keys/values into in place of ``update``, or
                None).
            logits_idx: ``[B, R]`` int64 canvas columns whose *token* predictions are wanted; for families
                with shifted logits (Dream) the prediction for column ``c`` comes from hidden row ``c - 1``.
                ``None`` returns all ``T`` columns (shift applied the way the reference does it). In a partial
                forward every wanted row must be in ``query_idx`` (else ``ValueError``), except columns outside the
                cache's ``read_cols[b]`` (another row's window) or, with ``sparse_logits = True``, any column:
                such columns get all-zero logits.
            key_positions: ``[B, Lk]`` int64 positions of every key when the cache returns more keys than
                ``tokens`` holds (stored keys of earlier blocks before this forward's own, the block-diffusion
                cache of :mod:`dllm.blockdiff`); block-diffusion attention reads the keys' blocks from them.
                Default: ``positions``.
            block_size: the block grid of block-diffusion attention for this forward (default: the config's
                ``block_size``; a decoder may use another block length, as SDAR's ``block_diffusion_generate``
                does).
            attn_pattern: ``[B, T, T]`` bool, which keys each query attends to, replacing the block grid and the
                bidirectional default (padding keys still excluded); only for full forwards. Block-diffusion
                training uses it: a noisy and a clean copy of the sequence in one forward attend by rules that
                no block grid expresses (:mod:`dllm.tiny.train`).
            query_tokens: with ``query_idx`` whose rows pad their shorter active sets by repeating their first
                index: the number of distinct active rows over the batch (``N``, the sum of the rows' counts), or
                more (the extra rows are padding slots, computed and dropped: the graph path's bucketed sizes).
                Below ``B x Q``, each layer's per-token work (norms, products, MLP) runs on those ``N`` rows only
                and attention on the padded rows (:class:`RowPacking`): rows whose active sets differ (one row
                refreshing its block, the others reading their cache) no longer compute their padding. Not with a
                cache's ``layer_input`` / ``observe`` hooks or a layer's forward hooks (they see the padded rows).
                ``None``: the padded rows.
            start_layer: a partial forward resumed at this layer (``0``: the whole forward): the layers before it are
                not run; the cache's ``layer_input(start_layer, None, query_idx)`` gives the layer's input (``[B, T,
                d]`` or ``(h, rows)``, as a switch does), e.g. Elastic-Cache redoing a forward from the layer after
                the first one whose drift test failed, from the layer inputs it stored.
            stop_layer: a partial forward run up to this layer only (after ``start_layer``, below the number of
                layers): the layer's input goes to the cache's ``layer_input(stop_layer, h, rows)`` (which must not
                switch) and the forward returns None, to be resumed at ``start_layer=stop_layer`` (Elastic-Cache
                reading its drift tests between the two).

        Returns:
            ``[B, R, V]`` (or ``[B, T, V]``) logits in the model dtype.
        """
        B, T = tokens.shape
        if positions is None:
            positions = default_positions(attn_mask, B, T, tokens.device)
        hd, theta = self.config.rope_dim or self.config.head_dim, self.config.rope_theta
        shift = 1 if self.shift_logits else 0
        # a forward run in part hands a layer's input to the cache or takes it from it
        in_parts = query_idx is not None and cache is not None and cache.layer_input is not None
        if stop_layer is not None and not (in_parts and start_layer < stop_layer < len(self.layers)):
            raise ValueError(f"stop_layer={stop_layer}: a partial forward (query_idx) stopped at a layer after "
                             f"start_layer ({start_layer}) and below {len(self.layers)} needs a cache whose "
                             f"layer_input takes that layer's input")
        if start_layer:
            if not (in_parts and 0 < start_layer < len(self.layers)):
                raise ValueError(f"start_layer={start_layer}: a partial forward (query_idx) resumed at a layer 1 to "
                                 f"{len(self.layers) - 1} needs a cache whose layer_input gives that layer's input")
            cos = sin = h = None  # from the cache's layer_input at start_layer
        elif query_idx is None:
            cos, sin = rope_tables(positions, hd, theta)
            h = self.embed(tokens)
        else:
            if cache is None:
                raise ValueError("a partial forward (query_idx) needs a cache holding the other rows' keys/values")
            cos, sin = rope_tables(positions.gather(1, query_idx), hd, theta)
            h = self.embed(tokens.gather(1, query_idx))
        rows = query_idx
        if attn_pattern is not None and (query_idx is not None or cache is not None):
            raise ValueError("attn_pattern is for full forwards without a cache (training); drop query_idx / cache")
        bs = block_size or self.config.block_size
        query_blocks = positions // bs if bs else None
        key_blocks = (query_blocks if key_positions is None else key_positions // bs) if bs else None
        layer_input = cache.layer_input if cache is not None else None
        pack = None
        if query_tokens is not None:
            if rows is None or isinstance(query_tokens, bool) or not isinstance(query_tokens, int) \
                    or not 0 < query_tokens <= rows.numel():
                raise ValueError(f"query_tokens={query_tokens!r}: the number of distinct active rows of query_idx "
                                 f"(1 to B x Q), given only with query_idx")
            hooked = any(layer._forward_hooks or layer._forward_pre_hooks for layer in self.layers)
            if query_tokens < rows.numel() and layer_input is None and cache.observe is None and not hooked:
                pack = RowPacking(rows, query_tokens)  # layer hooks and cache hooks see the padded rows
                h = pack.pack(h)
        pending = None  # a fast layer's last residual add, done by the next layer inside its norm kernel
        for i, layer in enumerate(self.layers):
            if i < start_layer:
                continue
            if layer_input is not None:  # the cache sees each layer's input; it may switch to every row
                if pending is not None:
                    h, pending = h + pending, None
                switch = layer_input(i, h, rows)
                if i == stop_layer:  # the input of the first layer not run went to the cache
                    return None
                if switch is not None and rows is not None:  # every row ([B, T, d]) or new rows ((h, rows))
                    h, rows = switch if isinstance(switch, tuple) else (switch, None)
                    cos, sin = rope_tables(positions if rows is None else positions.gather(1, rows), hd, theta)
            if attn_pattern is not None:
                blocks = attn_pattern
            else:
                blocks = None if bs is None else (query_blocks if rows is None else query_blocks.gather(1, rows),
                                                  key_blocks)
            if layer.fast and not (layer._forward_hooks or layer._forward_pre_hooks):  # nobody sees layer outputs
                h, pending = layer(h, cos, sin, attn_mask, i, cache, rows, blocks, pending, True, pack=pack)
            else:
                h, pending = layer(h, cos, sin, attn_mask, i, cache, rows, blocks, pending, pack=pack), None
        if pending is not None:
            h = h + pending
        if rows is None:
            if logits_idx is None:
                idx = torch.arange(T, device=tokens.device).sub(shift).clamp_min(0).expand(B, T)
            else:
                idx = (logits_idx - shift).clamp_min(0)
            if not (logits_idx is None and shift == 0):
                h = h.gather(1, idx[..., None].expand(-1, -1, h.shape[-1]))
            return self.head(self._final_norm(h))
        # Partial forward: the wanted rows must be among the computed ones, except with a cache that computes
        # only the rows whose logits the sampler reads (``cache.sparse_logits``, dKV-Cache-Decode: not the
        # tokens decoded two or more steps ago): their columns get all-zero logits, never candidates.
        want = torch.arange(T, device=tokens.device).expand(B, T) if logits_idx is None else logits_idx
        want = (want - shift).clamp_min(0)
        hit = want[:, :, None] == rows[:, None, :]  # [B, R, Q]
        # Columns of another row's window (the logits of the union of the rows' windows, or each row's padded to the
        # widest) need not
        # be computed for this row: the cache's ``read_cols`` ([B, T] bool, when it has them) says which columns
        # each row reads; those must all be hit.
        need = cache.read_cols
        uncovered = ~hit.any(-1)
        missed = uncovered
        if need is not None:
            if need.shape[0] != B:
                need = need.repeat(B // need.shape[0], 1)  # classifier-free guidance doubles the batch
            wanted_cols = torch.arange(T, device=tokens.device).expand(B, T) if logits_idx is None else logits_idx
            missed = missed & need.gather(1, wanted_cols.clamp(0, T - 1))
        if not cache.sparse_logits and not _no_row_missed(missed):
            raise ValueError("logits were asked for rows outside query_idx; the cache's active set must contain "
                             "every row whose logits are read (for shifted-logit families, column c needs row c - 1)")
        pos = hit.to(torch.int8).argmax(-1)
        if pack is not None:  # the packed row of each wanted slot
            h = h[0].index_select(0, pack.spread.view(B, -1).gather(1, pos).flatten()).view(B, -1, h.shape[-1])
        else:
            h = h.gather(1, pos[..., None].expand(-1, -1, h.shape[-1]))
        return self.head(self._final_norm(h)).masked_fill(uncovered[..., None], 0.0)

    def _final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The last norm: the fused kernel on the fast path (its twin is ``RMSNorm.forward``'s operations)."""
        if self.layers[-1].fast:
            return fast_path.fused.rms_norm(h, self.norm.weight, self.norm.eps)
        return self.norm(h)


def _no_row_missed(missed: torch.Tensor) -> bool:
    """Whether no wanted row was left out; on CUDA an asynchronous device-side check (no host synchronisation:
    a failure surfaces as a device assertion at the next synchronisation)."""
    if missed.device.type == "cuda":
        torch._assert_async(~missed.any(), "logits were asked for rows outside query_idx")
        return True
    try:
        torch._assert_async(~missed.any())
    except RuntimeError:
        return False
    return True


def default_positions(attn_mask, B: int, T: int, device) -> torch.Tensor:
    """Per-row positions: ``cumsum(mask) - 1`` clipped at 0 (left padding), else ``0..T-1``."""
    if attn_mask is None:
        return torch.arange(T, device=device).expand(B, T)
    return (attn_mask.long().cumsum(-1) - 1).clamp_min(0)
