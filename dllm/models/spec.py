"""ModelSpec: everything family-specific about a checkpoint, in one frozen record per family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dllm.models.transformer import TransformerConfig

# Internal parameter names of dllm.models.Transformer, per layer and global.
LAYER_PARAMS = ("attn_norm.weight", "q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias",
                "o.weight", "mlp_norm.weight", "gate.weight", "up.weight", "down.weight")
GLOBAL_PARAMS = ("embed.weight", "norm.weight", "head.weight")


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

    def key_map(self, cfg: TransformerConfig) -> dict[str, str]:
        """Our name -> checkpoint name, for every tensor the checkpoint must contain."""
        out = {}
        for ours, theirs in self.global_keys.items():
            if ours == "head.weight" and cfg.tie_embeddings:
                continue
            out[ours] = theirs
        for i in range(cfg.n_layers):
            for ours, theirs in self.layer_keys.items():
                if ours.endswith(".bias") and not cfg.qkv_bias:
                    continue
                out[f"layers.{i}.{ours}"] = theirs.format(i=i)
        return out


def _require(cfg: dict, keys: tuple[str, ...], family: str) -> None:
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise ValueError(f"config.json of a {family} checkpoint lacks the field(s) {missing}")


# ---------------------------------------------------------------------------------------------- LLaDA
def _llada_from_hf(c: dict) -> TransformerConfig:
    _require(c, ("d_model", "n_layers", "n_heads", "vocab_size"), "LLaDA")
    unsupported = []
    if c.get("block_type", "llama") not in ("llama",):
        unsupported.append(f"block_type={c['block_type']!r} (only 'llama')")
    if c.get("activation_type", "silu") not in ("silu", "swiglu"):
        unsupported.append(f"activation_type={c['activation_type']!r} (only 'silu')")
    if c.get("layer_norm_type", "rms") not in ("rms",):
        unsupported.append(f"layer_norm_type={c['layer_norm_type']!r} (only 'rms')")
    if c.get("alibi", False) or not c.get("rope", True):
        unsupported.append("position encoding other than RoPE")
    if c.get("include_bias", False):
        unsupported.append("include_bias=true")
    if unsupported:
        raise ValueError("unsupported LLaDA config: " + "; ".join(unsupported))
    n_heads = c["n_heads"]
    mlp = c.get("mlp_hidden_size") or int(c.get("mlp_ratio", 4) * c["d_model"])
    return TransformerConfig(
        vocab_size=c.get("embedding_size") or c["vocab_size"],
        d_model=c["d_model"],
        n_layers=c["n_layers"],
        n_heads=n_heads,
        n_kv_heads=c.get("n_kv_heads") or n_heads,
        mlp_hidden=mlp,
        max_seq_len=c.get("max_sequence_length", 4096),
        rope_theta=float(c.get("rope_theta", 10000.0)),
        norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        qkv_bias=bool(c.get("include_qkv_bias", False)),
        tie_embeddings=bool(c.get("weight_tying", False)),
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
def _dream_from_hf(c: dict) -> TransformerConfig:
    _require(c, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"), "Dream")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported Dream config: hidden_act={c['hidden_act']!r} (only 'silu')")
    n_heads = c["num_attention_heads"]
    return TransformerConfig(
        vocab_size=c["vocab_size"],
        d_model=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=c.get("num_key_value_heads") or n_heads,
        mlp_hidden=c.get("intermediate_size") or 4 * c["hidden_size"],
        max_seq_len=c.get("max_position_embeddings", 131072),
        rope_theta=float(c.get("rope_theta", 10000.0)),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        qkv_bias=True,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def _dream_to_hf(cfg: TransformerConfig, ids: dict) -> dict:
    return {
        "architectures": ["DreamModel"],
        "model_type": "Dream",
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
)

SPECS: dict[str, ModelSpec] = {"llada": LLADA, "dream": DREAM}


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
