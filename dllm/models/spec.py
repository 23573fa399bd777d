"""ModelSpec: everything family-specific about a checkpoint, in one frozen record per family."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from dllm.models.transformer import Transformer, TransformerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """Family facts. ``key_map`` maps our parameter names to checkpoint tensor names."""

    family: str
    model_type: str
    architectures: tuple[str, ...]
    config_from_hf: Callable[[dict], TransformerConfig]
    config_to_hf: Callable[[TransformerConfig, dict], dict]
    global_keys: dict[str, str]
    layer_keys: dict[str, str]  # "{i}" in the value is the layer index
    mask_id: int
    eos_id: int
    eot_id: int
    pad_id: int
    eot_token: str
    mask_token: str
    shift_logits: bool
    max_context: int
    layers_field: str = "n_layers"  # config.json field names, for error messages
    tie_field: str = "weight_tying"

    def key_map(self, cfg: TransformerConfig) -> dict[str, str]:
        """Our name -> checkpoint name, for every tensor the checkpoint must contain: the templates of
        ``global_keys`` / ``layer_keys`` (``{i}``: layer, ``{e}``: expert) whose parameter the model for ``cfg``
        has (biases, QK norms, fused or separate projections, dense or expert MLPs follow the config)."""
        have = Transformer.expected_shapes(cfg)
        out = {}
        for ours, theirs in self.global_keys.items():
            if ours in have and not (ours == "head.weight" and cfg.tie_embeddings):
                out[ours] = theirs
        for i in range(cfg.n_layers):
            for ours, theirs in self.layer_keys.items():
                for e in range(cfg.n_experts) if "{e}" in ours else (None,):
                    name = f"layers.{i}.{ours.format(e=e)}"
                    if name in have:
                        out[name] = theirs.format(i=i, e=e)
        return out


def _require(cfg: dict, keys: tuple[str, ...], family: str) -> None:
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise ValueError(f"config.json of a {family} checkpoint lacks the field(s) {missing}")


# Fields every transformers config.json may carry that do not change the forward pass (ids are checked elsewhere).
_GENERIC_FIELDS = frozenset({
    "architectures", "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id", "initializer_range",
    "attention_dropout", "tokenizer_class", "return_dict", "output_attentions", "output_hidden_states",
})


def _positive_int(c: dict, key: str, family: str, default=None) -> int:
    v = c.get(key, default)
    if type(v) is not int or v < 1:  # bool is an int subclass: refused too
        raise ValueError(f"config.json of a {family} checkpoint: {key} must be a positive integer, got {v!r}; "
                         "fix it there (the published value is in the original config.json)")
    return v


def _positive_float(c: dict, key: str, family: str, default: float) -> float:
    v = c.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
        raise ValueError(f"config.json of a {family} checkpoint: {key} must be a positive number, got {v!r}")
    return float(v)


def _flag(c: dict, key: str, family: str) -> bool:
    v = c.get(key, False)
    if not isinstance(v, bool) and v is not None:
        raise ValueError(f"config.json of a {family} checkpoint: {key} must be true or false, got {v!r}")
    return bool(v)


def _check_fields(c: dict, family: str, rules: dict[str, tuple[tuple, str]], ignored: frozenset[str],
                  extra_bad: list[str]) -> None:
    """Refuse fields set to values the Transformer does not implement; log fields no rule or list knows.

    ``rules``: field -> (accepted values, what is supported). ``ignored``: fields known not to change the forward
    pass (training and initialisation settings)."""
    bad = [f"{key}={c[key]!r} is not supported (only {what})"
           for key, (accepted, what) in rules.items() if key in c and c[key] not in accepted]
    bad += extra_bad
    if bad:
        raise ValueError(f"unsupported {family} config in config.json: " + "; ".join(bad) + ". dllm does not "
                         "implement such a model; loading it anyway would compute something else than it was trained to")
    unknown = sorted(set(c) - set(rules) - ignored - _GENERIC_FIELDS)
    if unknown:
        log.warning("config.json has field(s) dllm does not know and ignores: %s; check that they do not change "
                    "the %s model", unknown, family)


def _config(family: str, **fields) -> TransformerConfig:
    try:
        return TransformerConfig(**fields)
    except ValueError as e:
        raise ValueError(f"config.json of a {family} checkpoint: {e}") from None


# ---------------------------------------------------------------------------------------------- LLaDA
_NONE_OR_FALSE = (None, False)
_LLADA_RULES = {
    "block_type": (("llama",), "'llama'"),
    "activation_type": (("silu",), "'silu' (SiLU gate times up projection)"),
    "layer_norm_type": (("rms",), "'rms'"),
    "layer_norm_with_affine": ((True, None), "true"),
    "bias_for_layer_norm": (_NONE_OR_FALSE, "false"),
    "include_bias": (_NONE_OR_FALSE, "false"),
    "alibi": (_NONE_OR_FALSE, "false: RoPE positions"),
    "rope": ((True, None), "true"),
    "rope_scaling": ((None,), "null: plain RoPE"),
    "attention_layer_norm": (_NONE_OR_FALSE, "false: no QK norm"),
    "clip_qkv": ((None,), "null"),
    "multi_query_attention": (_NONE_OR_FALSE, "null or false: n_kv_heads sets the key/value heads"),
    "input_emb_norm": (_NONE_OR_FALSE, "false"),
    "scale_logits": (_NONE_OR_FALSE, "false"),
    "block_group_size": ((1, None), "1"),
}
_LLADA_USED = frozenset({"d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size", "mlp_ratio", "vocab_size",
                         "embedding_size", "max_sequence_length", "rope_theta", "rms_norm_eps", "include_qkv_bias",
                         "weight_tying"})
_LLADA_IGNORED = _LLADA_USED | {
    "alibi_bias_max", "attention_layer_norm_with_affine", "embedding_dropout", "residual_dropout", "flash_attention",
    "init_cutoff_factor", "init_device", "init_fn", "init_std", "precision",
    "rope_full_precision",  # RoPE is always computed in fp32, as the published models set it
}


def _llada_from_hf(c: dict) -> TransformerConfig:
    _require(c, ("d_model", "n_layers", "n_heads", "vocab_size"), "LLaDA")
    _check_fields(c, "LLaDA", _LLADA_RULES, _LLADA_IGNORED, [])
    d_model = _positive_int(c, "d_model", "LLaDA")
    n_heads = _positive_int(c, "n_heads", "LLaDA")
    vocab = _positive_int(c, "vocab_size", "LLaDA")
    if c.get("embedding_size") is not None:  # the embedding matrix may be padded beyond the vocabulary
        vocab = _positive_int(c, "embedding_size", "LLaDA")
        if vocab < c["vocab_size"]:
            raise ValueError(f"config.json of a LLaDA checkpoint: embedding_size {vocab} is smaller than vocab_size "
                             f"{c['vocab_size']}; fix it there")
    if c.get("mlp_hidden_size") is not None:
        mlp = _positive_int(c, "mlp_hidden_size", "LLaDA")
    else:
        mlp = int(_positive_float(c, "mlp_ratio", "LLaDA", 4) * d_model)
    return _config(
        "LLaDA",
        vocab_size=vocab,
        d_model=d_model,
        n_layers=_positive_int(c, "n_layers", "LLaDA"),
        n_heads=n_heads,
        n_kv_heads=_positive_int(c, "n_kv_heads", "LLaDA") if c.get("n_kv_heads") is not None else n_heads,
        mlp_hidden=mlp,
        max_seq_len=_positive_int(c, "max_sequence_length", "LLaDA", 4096),
        rope_theta=_positive_float(c, "rope_theta", "LLaDA", 10000.0),
        norm_eps=_positive_float(c, "rms_norm_eps", "LLaDA", 1e-5),
        qkv_bias=_flag(c, "include_qkv_bias", "LLaDA"),
        tie_embeddings=_flag(c, "weight_tying", "LLaDA"),
    )


def _llada_to_hf(cfg: TransformerConfig, ids: dict) -> dict:
    return {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads,
        "mlp_hidden_size": cfg.mlp_hidden,
        "vocab_size": cfg.vocab_size,
        "embedding_size": cfg.vocab_size,
        "max_sequence_length": cfg.max_seq_len,
        "rope": True,
        "rope_theta": cfg.rope_theta,
        "rope_full_precision": True,
        "block_type": "llama",
        "activation_type": "silu",
        "layer_norm_type": "rms",
        "rms_norm_eps": cfg.norm_eps,
        "include_bias": False,
        "include_qkv_bias": cfg.qkv_bias,
        "weight_tying": cfg.tie_embeddings,
        "mask_token_id": ids["mask_id"],
        "eos_token_id": ids["eos_id"],
        "pad_token_id": ids["pad_id"],
    }


LLADA = ModelSpec(
    family="llada",
    model_type="llada",
    architectures=("LLaDAModelLM",),
    config_from_hf=_llada_from_hf,
    config_to_hf=_llada_to_hf,
    global_keys={
        "embed.weight": "model.transformer.wte.weight",
        "norm.weight": "model.transformer.ln_f.weight",
        "head.weight": "model.transformer.ff_out.weight",
    },
    layer_keys={
        "attn_norm.weight": "model.transformer.blocks.{i}.attn_norm.weight",
        "q.weight": "model.transformer.blocks.{i}.q_proj.weight",
        "q.bias": "model.transformer.blocks.{i}.q_proj.bias",
        "k.weight": "model.transformer.blocks.{i}.k_proj.weight",
        "k.bias": "model.transformer.blocks.{i}.k_proj.bias",
        "v.weight": "model.transformer.blocks.{i}.v_proj.weight",
        "v.bias": "model.transformer.blocks.{i}.v_proj.bias",
        "o.weight": "model.transformer.blocks.{i}.attn_out.weight",
        "mlp_norm.weight": "model.transformer.blocks.{i}.ff_norm.weight",
        "gate.weight": "model.transformer.blocks.{i}.ff_proj.weight",
        "up.weight": "model.transformer.blocks.{i}.up_proj.weight",
        "down.weight": "model.transformer.blocks.{i}.ff_out.weight",
    },
    mask_id=126336,
    eos_id=126081,
    eot_id=126348,
    pad_id=126081,
    eot_token="<|eot_id|>",
    mask_token="<|mdm_mask|>",
    shift_logits=False,
    max_context=4096,
)


# ---------------------------------------------------------------------------------------------- Dream
_DREAM_RULES = {
    "hidden_act": (("silu",), "'silu'"),
    "rope_scaling": ((None,), "null: plain RoPE"),
    "use_sliding_window": (_NONE_OR_FALSE, "false: full attention"),
}
_DREAM_USED = frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps",
                         "tie_word_embeddings", "head_dim", "rope_parameters", "layer_types"})
_DREAM_IGNORED = _DREAM_USED | {
    "sliding_window", "max_window_layers",  # used only with use_sliding_window=true
    "attention_bias", "mlp_bias",  # Dream's model code always has QKV biases and no MLP bias; the tensors decide
}


def _dream_rope(c: dict) -> tuple[float, list[str]]:
    """RoPE theta from ``rope_theta`` or transformers 5's ``rope_parameters``; problems as messages."""
    params = c.get("rope_parameters")
    if params is None:
        return _positive_float(c, "rope_theta", "Dream", 10000.0), []
    kind = params.get("rope_type", "default") if isinstance(params, dict) else params
    if kind != "default":
        return 0.0, [f"rope_parameters={params!r} is not supported (only rope_type 'default')"]
    return _positive_float({**c, **params}, "rope_theta", "Dream", 10000.0), []


def _qwen_fields(c: dict, family: str, *, mlp_default: int | None, max_default: int) -> dict:
    """The fields Qwen-architecture configs (Dream, SDAR) share, read and checked."""
    d_model = _positive_int(c, "hidden_size", family)
    n_heads = _positive_int(c, "num_attention_heads", family)
    return dict(
        vocab_size=_positive_int(c, "vocab_size", family),
        d_model=d_model,
        n_layers=_positive_int(c, "num_hidden_layers", family),
        n_heads=n_heads,
        n_kv_heads=(_positive_int(c, "num_key_value_heads", family) if c.get("num_key_value_heads") is not None
                    else n_heads),
        mlp_hidden=(_positive_int(c, "intermediate_size", family) if c.get("intermediate_size") is not None
                    or mlp_default is None else mlp_default),
        max_seq_len=_positive_int(c, "max_position_embeddings", family, max_default),
        norm_eps=_positive_float(c, "rms_norm_eps", family, 1e-6),
        tie_embeddings=_flag(c, "tie_word_embeddings", family),
    )


def _qwen_hf(cfg: TransformerConfig, ids: dict) -> dict:
    """The fields Qwen-architecture configs (Dream, SDAR) share, written."""
    return {
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len,
        "mask_token_id": ids["mask_id"],
        "pad_token_id": ids["pad_id"],
        "eos_token_id": ids["eos_id"],
    }


def _dream_from_hf(c: dict) -> TransformerConfig:
    _require(c, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"), "Dream")
    fields = _qwen_fields(c, "Dream", mlp_default=4 * _positive_int(c, "hidden_size", "Dream"), max_default=131072)
    d_model, n_heads = fields["d_model"], fields["n_heads"]
    theta, bad = _dream_rope(c)
    if c.get("head_dim") is not None and c["head_dim"] * n_heads != d_model:
        bad.append(f"head_dim={c['head_dim']!r} is not supported (only hidden_size / num_attention_heads = "
                   f"{d_model // n_heads})")
    layer_types = c.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        bad.append(f"layer_types={layer_types!r} is not supported (only 'full_attention' in every layer)")
    _check_fields(c, "Dream", _DREAM_RULES, _DREAM_IGNORED, bad)
    return _config("Dream", **fields, rope_theta=theta, qkv_bias=True)


def _dream_to_hf(cfg: TransformerConfig, ids: dict) -> dict:
    return {"architectures": ["DreamModel"], "model_type": "Dream", **_qwen_hf(cfg, ids)}


DREAM = ModelSpec(
    family="dream",
    model_type="Dream",
    architectures=("DreamModel",),
    config_from_hf=_dream_from_hf,
    config_to_hf=_dream_to_hf,
    global_keys={
        "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight",
    },
    layer_keys={
        "attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
        "q.weight": "model.layers.{i}.self_attn.q_proj.weight",
        "q.bias": "model.layers.{i}.self_attn.q_proj.bias",
        "k.weight": "model.layers.{i}.self_attn.k_proj.weight",
        "k.bias": "model.layers.{i}.self_attn.k_proj.bias",
        "v.weight": "model.layers.{i}.self_attn.v_proj.weight",
        "v.bias": "model.layers.{i}.self_attn.v_proj.bias",
        "o.weight": "model.layers.{i}.self_attn.o_proj.weight",
        "mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
        "up.weight": "model.layers.{i}.mlp.up_proj.weight",
        "down.weight": "model.layers.{i}.mlp.down_proj.weight",
    },
    mask_id=151666,
    eos_id=151643,
    eot_id=151645,
    pad_id=151643,
    eot_token="<|im_end|>",
    mask_token="<|mask|>",
    shift_logits=True,
    max_context=2048,
    layers_field="num_hidden_layers",
    tie_field="tie_word_embeddings",
)

# ---------------------------------------------------------------------------------------------- SDAR
# SDAR (JetAstra/SDAR, SDARForCausalLM): a Qwen3-architecture block-diffusion model. Per-head QK RMSNorm before
# RoPE, an explicit head_dim, GQA, no logit shift; attention bidirectional inside a block of ``block_size`` tokens
# (block boundaries at multiples of block_size from the first position) and causal across blocks.
_SDAR_RULES = {
    "hidden_act": (("silu",), "'silu'"),
    "rope_scaling": ((None,), "null: plain RoPE"),
    "use_sliding_window": (_NONE_OR_FALSE, "false: full attention"),
}
_SDAR_USED = frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
                        "rms_norm_eps", "tie_word_embeddings", "attention_bias", "block_size"})
_SDAR_IGNORED = _SDAR_USED | {
    "sliding_window", "max_window_layers",  # used only with use_sliding_window=true
    "attn_implementation", "debug", "ep_size", "fuse_cross_entropy", "micro_forward", "skip_checkpoint",
    "use_deepep",  # kernel and training switches of the reference code
}


def _sdar_from_hf(c: dict) -> TransformerConfig:
    _require(c, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                 "block_size"), "SDAR")
    _check_fields(c, "SDAR", _SDAR_RULES, _SDAR_IGNORED, [])
    fields = _qwen_fields(c, "SDAR", mlp_default=None, max_default=32768)
    bias = _flag(c, "attention_bias", "SDAR")
    return _config(
        "SDAR", **fields,
        rope_theta=_positive_float(c, "rope_theta", "SDAR", 10000.0),
        qkv_bias=bias,
        out_bias=bias,
        head_size=_positive_int(c, "head_dim", "SDAR", fields["d_model"] // fields["n_heads"]),
        qk_norm=True,
        block_size=_positive_int(c, "block_size", "SDAR"),
    )


def _sdar_to_hf(cfg: TransformerConfig, ids: dict) -> dict:
    return {
        "architectures": ["SDARForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                     "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
        "model_type": "sdar",
        **_qwen_hf(cfg, ids),
        "head_dim": cfg.head_dim,
        "rope_scaling": None,
        "attention_bias": cfg.qkv_bias,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "block_size": cfg.block_size,
        # switches SDAR's model code reads (training kernels and parallelism), with the published values
        "fuse_cross_entropy": True, "micro_forward": False, "skip_checkpoint": False, "use_deepep": False,
        "ep_size": 1, "debug": False,
    }


SDAR = ModelSpec(
    family="sdar",
    model_type="sdar",
    architectures=("SDARForCausalLM",),
    config_from_hf=_sdar_from_hf,
    config_to_hf=_sdar_to_hf,
    global_keys=dict(DREAM.global_keys),
    layer_keys={
        **DREAM.layer_keys,
        "o.bias": "model.layers.{i}.self_attn.o_proj.bias",
        "q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
        "k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    },
    mask_id=151669,
    eos_id=151643,
    eot_id=151645,
    pad_id=151643,
    eot_token="<|im_end|>",
    mask_token="<MASK>",
    shift_logits=False,
    max_context=32768,
    layers_field="num_hidden_layers",
    tie_field="tie_word_embeddings",
)

# ---------------------------------------------------------------------------------------------- LLaDA2
# LLaDA2.x (inclusionAI, LLaDA2MoeModelLM, model_type "llada2_moe"): block diffusion (blocks of 32 in its
# generate) over a mixture-of-experts Transformer: fused query_key_value projection, per-head QK RMSNorm, partial
# rotary embeddings, the first ``first_k_dense_replace`` layers dense, then sigmoid-routed experts (group-limited
# top-k with an expert bias, routed scaling) plus shared experts; no logit shift.
_LLADA2_RULES = {
    "hidden_act": (("silu",), "'silu'"),
    "rope_scaling": ((None,), "null: plain RoPE"),
    "use_sliding_window": (_NONE_OR_FALSE, "false: full attention"),
    "use_qk_norm": ((None, True), "true: LLaDA2.x's query / key norms"),
}
_LLADA2_USED = frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
                          "rms_norm_eps", "tie_word_embeddings", "use_qkv_bias", "use_bias", "num_experts",
                          "num_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
                          "routed_scaling_factor", "moe_intermediate_size", "first_k_dense_replace",
                          "partial_rotary_factor", "block_size"})
_LLADA2_IGNORED = _LLADA2_USED | {
    "sliding_window", "max_window_layers", "embedding_dropout", "output_dropout", "output_router_logits",
    "norm_head",  # the model code's lm_head is a plain linear layer whatever its value
}


def _llada2_from_hf(c: dict) -> TransformerConfig:
    _require(c, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"),
             "LLaDA2")
    _check_fields(c, "LLaDA2", _LLADA2_RULES, _LLADA2_IGNORED, [])
    fields = _qwen_fields(c, "LLaDA2", mlp_default=None, max_default=16384)
    head = _positive_int(c, "head_dim", "LLaDA2", fields["d_model"] // fields["n_heads"])
    factor = _positive_float(c, "partial_rotary_factor", "LLaDA2", 1.0)
    experts = c.get("num_experts") or 0
    moe = {}
    if experts:
        moe = dict(n_experts=_positive_int(c, "num_experts", "LLaDA2"),
                   experts_per_token=_positive_int(c, "num_experts_per_tok", "LLaDA2"),
                   n_shared_experts=int(c.get("num_shared_experts") or 0),
                   moe_hidden=_positive_int(c, "moe_intermediate_size", "LLaDA2"),
                   dense_layers=int(c.get("first_k_dense_replace") or 0),
                   n_groups=_positive_int(c, "n_group", "LLaDA2", 1), topk_groups=_positive_int(c, "topk_group",
                                                                                               "LLaDA2", 1),
                   routed_scaling=_positive_float(c, "routed_scaling_factor", "LLaDA2", 1.0))
    return _config(
        "LLaDA2", **fields,
        rope_theta=_positive_float(c, "rope_theta", "LLaDA2", 10000.0),
        qkv_bias=_flag(c, "use_qkv_bias", "LLaDA2"),
        out_bias=_flag(c, "use_bias", "LLaDA2"),
        head_size=head,
        rope_dim=int(head * factor) if factor < 1 else None,
        qk_norm=True,
        fused_qkv=True,
        block_size=_positive_int(c, "block_size", "LLaDA2", 32),
        **moe,
    )


def _llada2_to_hf(cfg: TransformerConfig, ids: dict) -> dict:
    return {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        **_qwen_hf(cfg, ids),
        "head_dim": cfg.head_dim,
        "rope_scaling": None,
        "use_qkv_bias": cfg.qkv_bias,
        "use_bias": cfg.out_bias,
        "use_qk_norm": True,
        "norm_head": False,
        "partial_rotary_factor": (cfg.rope_dim or cfg.head_dim) / cfg.head_dim,
        "num_experts": cfg.n_experts or None,
        "num_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "n_group": cfg.n_groups,
        "topk_group": cfg.topk_groups,
        "routed_scaling_factor": cfg.routed_scaling,
        "moe_intermediate_size": cfg.moe_hidden,
        "first_k_dense_replace": cfg.dense_layers,
        "block_size": cfg.block_size,
        "use_sliding_window": False,
    }


_LLADA2_MLP = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
LLADA2 = ModelSpec(
    family="llada2",
    model_type="llada2_moe",
    architectures=("LLaDA2MoeModelLM",),
    config_from_hf=_llada2_from_hf,
    config_to_hf=_llada2_to_hf,
    global_keys={
        "embed.weight": "model.word_embeddings.weight",
        "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight",
    },
    layer_keys={
        "attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
        "qkv.weight": "model.layers.{i}.attention.query_key_value.weight",
        "qkv.bias": "model.layers.{i}.attention.query_key_value.bias",
        "q_norm.weight": "model.layers.{i}.attention.query_layernorm.weight",
        "k_norm.weight": "model.layers.{i}.attention.key_layernorm.weight",
        "o.weight": "model.layers.{i}.attention.dense.weight",
        "o.bias": "model.layers.{i}.attention.dense.bias",
        "mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        **{f"{ours}.weight": f"model.layers.{{i}}.mlp.{theirs}.weight" for ours, theirs in _LLADA2_MLP.items()},
        "moe.router.weight": "model.layers.{i}.mlp.gate.weight",
        "moe.expert_bias": "model.layers.{i}.mlp.gate.expert_bias",
        **{f"moe.experts.{{e}}.{ours}.weight": f"model.layers.{{i}}.mlp.experts.{{e}}.{theirs}.weight"
           for ours, theirs in _LLADA2_MLP.items()},
        **{f"moe.shared.{ours}.weight": f"model.layers.{{i}}.mlp.shared_experts.{theirs}.weight"
           for ours, theirs in _LLADA2_MLP.items()},
    },
    mask_id=156895,
    eos_id=156892,
    eot_id=156892,
    pad_id=156892,
    eot_token="<|role_end|>",
    mask_token="<|mask|>",
    shift_logits=False,
    max_context=32768,
    layers_field="num_hidden_layers",
    tie_field="tie_word_embeddings",
)

# ---------------------------------------------------------------------------------------------- Fast-dLLM v2
# Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_7B, Fast_dLLM_QwenForCausalLM, model_type "Fast_dLLM_Qwen"): a
# Qwen2.5-architecture block-diffusion model. QKV bias (always, whatever the config says), no output-projection
# bias, no QK norm, GQA; attention bidirectional inside a block of ``bd_size`` tokens (counted from the first
# position) and causal across blocks; token shift: the token at position i is predicted from hidden row i - 1.
_FASTDLLM2_RULES = {
    "hidden_act": (("silu",), "'silu'"),
    "rope_scaling": ((None,), "null: plain RoPE"),
    "use_sliding_window": (_NONE_OR_FALSE, "false: full attention"),
}
_FASTDLLM2_USED = frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                             "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                             "rope_theta", "rms_norm_eps", "tie_word_embeddings", "bd_size", "layer_types"})
_FASTDLLM2_IGNORED = _FASTDLLM2_USED | {
    "sliding_window", "max_window_layers",  # used only with use_sliding_window=true
}


def _fastdllm2_from_hf(c: dict) -> TransformerConfig:
    family = "Fast-dLLM v2"
    _require(c, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"),
             family)
    bad = []
    layer_types = c.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or
                                    any(t != "full_attention" for t in layer_types)):
        bad.append(f"layer_types={layer_types!r} is not supported (only 'full_attention' in every layer)")
    _check_fields(c, family, _FASTDLLM2_RULES, _FASTDLLM2_IGNORED, bad)
    fields = _qwen_fields(c, family, mlp_default=None, max_default=32768)
    head = (_positive_int(c, "head_dim", family) if c.get("head_dim") is not None  # the model file honours it
            else fields["d_model"] // fields["n_heads"])
    return _config(
        family, **fields,
        rope_theta=_positive_float(c, "rope_theta", family, 10000.0),
        qkv_bias=True,
        head_size=head if head * fields["n_heads"] != fields["d_model"] else None,
        block_size=_positive_int(c, "bd_size", family, 32),  # the configuration file's default
    )


def _fastdllm2_to_hf(cfg: TransformerConfig, ids: dict) -> dict:
    out = {
        "architectures": ["Fast_dLLM_QwenForCausalLM"],
        "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig", "AutoModel": "modeling.Fast_dLLM_QwenModel",
                     "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
        "model_type": "Fast_dLLM_Qwen",
        **_qwen_hf(cfg, ids),
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.n_layers,
        "layer_types": ["full_attention"] * cfg.n_layers,
        "bd_size": cfg.block_size,
    }
    if cfg.head_size is not None:
        out["head_dim"] = cfg.head_size
    return out


FASTDLLM2 = ModelSpec(
    family="fastdllm2",
    model_type="Fast_dLLM_Qwen",
    architectures=("Fast_dLLM_QwenForCausalLM",),
    config_from_hf=_fastdllm2_from_hf,
    config_to_hf=_fastdllm2_to_hf,
    global_keys=dict(DREAM.global_keys),
    layer_keys=dict(DREAM.layer_keys),
    mask_id=151665,
    eos_id=151645,
    eot_id=151645,
    pad_id=151643,
    eot_token="<|im_end|>",
    mask_token="|<MASK>|",
    shift_logits=True,
    max_context=32768,
    layers_field="num_hidden_layers",
    tie_field="tie_word_embeddings",
)

SPECS: dict[str, ModelSpec] = {"llada": LLADA, "dream": DREAM, "sdar": SDAR, "llada2": LLADA2,
                               "fastdllm2": FASTDLLM2}


def spec_for_model_type(model_type: str | None) -> ModelSpec:
    for spec in SPECS.values():
        if model_type and model_type.lower() == spec.model_type.lower():
            return spec
    known = ", ".join(repr(s.model_type) for s in SPECS.values())
    raise ValueError(
        f"unsupported model_type {model_type!r} in config.json; supported: {known}. "
        "Other Hugging Face models that return logits can be wrapped with dllm.models.hf.HFModel "
        "(samplers work, caches do not)."
    )


def vocab_size(model) -> int | None:
    """The vocabulary size of a dllm Transformer or a wrapped Hugging Face model (``None`` when unknown)."""
    for owner in (model, getattr(model, "hf", None)):
        size = getattr(getattr(owner, "config", None), "vocab_size", None)
        if isinstance(size, int):
            return size
    return None
