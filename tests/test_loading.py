"""Checkpoint round trip in the published LLaDA / Dream formats (MODELS.md), with a real tokenizer."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors import safe_open

import dllm
from dllm.models import DREAM, LLADA, Transformer, TransformerConfig, load_model, save_pretrained
from dllm.models.weights import init_weights
from dllm.tiny import tokenizer as tb

MASK_TOKEN = {"llada": "<|mdm_mask|>", "dream": "<|mask|>"}
EOT_TOKEN = {"llada": "<|eot_id|>", "dream": "<|im_end|>"}
N_LAYERS = 2

LLADA_TENSORS = {"model.transformer.wte.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight"} | {
    f"model.transformer.blocks.{i}.{n}.weight"
    for i in range(N_LAYERS)
    for n in ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj", "up_proj", "ff_out")
}
DREAM_TENSORS = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} | {
    f"model.layers.{i}.{n}"
    for i in range(N_LAYERS)
    for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
              "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
              "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight",
              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
}
LLADA_FIELDS = {"d_model": 32, "n_layers": N_LAYERS, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 64,
                "max_sequence_length": 256, "rope": True, "block_type": "llama", "activation_type": "silu",
                "layer_norm_type": "rms", "include_bias": False, "include_qkv_bias": False, "weight_tying": False,
                "model_type": "llada", "architectures": ["LLaDAModelLM"]}
DREAM_FIELDS = {"hidden_size": 32, "num_hidden_layers": N_LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
                "intermediate_size": 64, "max_position_embeddings": 256, "tie_word_embeddings": False,
                "hidden_act": "silu", "model_type": "Dream", "architectures": ["DreamModel"]}


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory) -> dict[str, Path]:
    """Real tokenizers for both families (trained once: the vocabulary is shared)."""
    root = tmp_path_factory.mktemp("tok")
    with mock.patch.object(tb, "train_tokenizer", functools.lru_cache(tb.train_tokenizer)):
        return {f: tb.build_tokenizer(root / f, f) for f in ("llada", "dream")}


def make_model(family: str, tok_dir: Path, seed: int = 0) -> Transformer:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    cfg = TransformerConfig(vocab_size=len(tok), d_model=32, n_layers=N_LAYERS, n_heads=4,
                            n_kv_heads=4 if family == "llada" else 2, mlp_hidden=64, qkv_bias=family == "dream",
                            max_seq_len=256)
    torch.manual_seed(seed)
    model = Transformer(cfg, LLADA if family == "llada" else DREAM)
    init_weights(model, std=0.5)
    if family == "dream":  # non-zero biases, so a lost bias would show in the logits
        for layer in model.layers:
            for lin in (layer.q, layer.k, layer.v):
                torch.nn.init.normal_(lin.bias, std=0.5)
    model.eval().requires_grad_(False)
    model.tokenizer = tok
    model.mask_id = tok.convert_tokens_to_ids(MASK_TOKEN[family])
    model.eos_id = model.pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    model.eot_id = tok.convert_tokens_to_ids(EOT_TOKEN[family])
    return model


@pytest.fixture(scope="module", params=["llada", "dream"])
def saved(request, tok_dirs, tmp_path_factory):
    """(family, in-memory model, directory with a single-file checkpoint)."""
    family = request.param
    model = make_model(family, tok_dirs[family])
    d = save_pretrained(model, tmp_path_factory.mktemp(f"ckpt-{family}"))
    return family, model, d


def logits_of(model, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(9, model.config.vocab_size, (2, 13), generator=g)
    am = torch.ones(2, 13, dtype=torch.bool)
    am[1, :4] = False
    return model(tokens, attn_mask=am)


def tensor_names(d: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():  # noqa: SIM118 - safe_open handles are not iterable
                t = fh.get_tensor(k)
                out[k] = (t.dtype, tuple(t.shape))
    return out


def test_round_trip_identical_logits(saved):
    _, model, d = saved
    loaded = load_model(d, dtype=torch.float32)
    assert loaded.dtype == torch.float32 and loaded.spec is model.spec
    assert loaded.config == model.config
    assert torch.equal(logits_of(loaded), logits_of(model))


def test_published_field_and_tensor_names(saved):
    family, model, d = saved
    cfg = json.loads((d / "config.json").read_text())
    fields = LLADA_FIELDS if family == "llada" else DREAM_FIELDS
    for k, v in fields.items():
        assert cfg[k] == v, k
    V = model.config.vocab_size
    assert cfg["vocab_size"] == V
    if family == "llada":
        assert cfg["embedding_size"] == V
        assert "hidden_size" not in cfg and "num_hidden_layers" not in cfg
    else:
        assert "d_model" not in cfg and "n_layers" not in cfg
    assert cfg["mask_token_id"] == model.mask_id and cfg["eos_token_id"] == model.eos_id
    assert cfg["pad_token_id"] == model.pad_id
    assert cfg["torch_dtype"] == "float32"
    names = tensor_names(d)
    assert set(names) == (LLADA_TENSORS if family == "llada" else DREAM_TENSORS)
    head = "model.transformer.ff_out.weight" if family == "llada" else "lm_head.weight"
    assert names[head][1] == (V, 32)
    up = "model.transformer.blocks.0.ff_proj.weight" if family == "llada" else "model.layers.0.mlp.gate_proj.weight"
    assert names[up][1] == (64, 32)
    if family == "dream":  # GQA: 2 kv heads of 8
        assert names["model.layers.0.self_attn.k_proj.weight"][1] == (16, 32)
        assert names["model.layers.0.self_attn.q_proj.bias"][1] == (32,)
    # tokenizer files travel with the checkpoint
    assert (d / "tokenizer.json").is_file() and (d / "tokenizer_config.json").is_file()


def test_sharded_round_trip(saved, tmp_path):
    _, model, _ = saved
    d = save_pretrained(model, tmp_path / "sharded", max_shard_bytes=40_000)
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(shards) >= 3
    assert "model.safetensors" not in shards
    assert all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == set(tensor_names(d))
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.state_dict().values())
    loaded = load_model(d, dtype=torch.float32)
    assert torch.equal(logits_of(loaded), logits_of(model))
    # re-saving unsharded into the same directory removes the stale shards and index
    save_pretrained(model, d)
    assert sorted(p.name for p in d.glob("*.safetensors")) == ["model.safetensors"]
    assert not (d / "model.safetensors.index.json").exists()
    assert torch.equal(logits_of(load_model(d, dtype="float32")), logits_of(model))


def test_bf16_save_fp32_load(saved, tmp_path):
    family, model, _ = saved
    d = save_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((d / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {dt for dt, _ in tensor_names(d).values()} == {torch.bfloat16}
    stored = load_model(d)  # no dtype: the stored dtype is kept
    assert stored.dtype == torch.bfloat16
    loaded = load_model(d, dtype=torch.float32)
    assert loaded.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    rounded = make_model(family, d)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    assert torch.equal(logits_of(loaded), logits_of(rounded))
    assert not torch.equal(logits_of(loaded), logits_of(model))  # the rounding really happened


def test_device_map(saved):
    _, model, d = saved
    ref = logits_of(model)
    auto = load_model(d, dtype=torch.float32, device_map="auto")
    assert auto.device.type == "cpu"
    assert torch.equal(logits_of(auto), ref)
    explicit = load_model(d, dtype=torch.float32,
                          device_map={"embed": "cpu", "layers": "cpu", "norm": "cpu", "head": "cpu"})
    assert torch.equal(logits_of(explicit), ref)
    per_layer = {"embed": "cpu", "norm": "cpu", "head": "cpu", **{f"layers.{i}": "cpu" for i in range(N_LAYERS)}}
    assert torch.equal(logits_of(load_model(d, dtype=torch.float32, device_map=per_layer)), ref)


def test_special_ids_from_config_and_tokenizer(saved, tmp_path):
    family, model, d = saved
    tok = model.tokenizer
    loaded = load_model(d, dtype=torch.float32)
    assert loaded.mask_id == tok.convert_tokens_to_ids(MASK_TOKEN[family]) == tok.mask_token_id
    assert loaded.eos_id == tok.convert_tokens_to_ids("<|endoftext|>") == tok.eos_token_id
    assert loaded.pad_id == tok.pad_token_id
    assert loaded.eot_id == tok.convert_tokens_to_ids(EOT_TOKEN[family])
    assert loaded.tokenizer is not None and len(loaded.tokenizer) == len(tok)
    # config.json must agree with the tokenizer on the mask id; the other ids come from config.json
    cfg = json.loads((d / "config.json").read_text())
    e = tmp_path / "edited"
    e.mkdir()
    for f in d.iterdir():
        (e / f.name).write_bytes(f.read_bytes())
    eos = tok.convert_tokens_to_ids(EOT_TOKEN[family])  # another special token
    cfg.update(eos_token_id=[eos, 0], pad_token_id=3)
    (e / "config.json").write_text(json.dumps(cfg))
    edited = load_model(e, dtype=torch.float32)
    assert (edited.mask_id, edited.eos_id, edited.pad_id) == (tok.mask_token_id, eos, 3)
    assert edited.eot_id == tok.convert_tokens_to_ids(EOT_TOKEN[family])  # eot comes from the tokenizer
    cfg.update(mask_token_id=7)
    (e / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"mask_token_id 7 differs .* set mask_token_id to {tok.mask_token_id}"):
        load_model(e, dtype=torch.float32)
    # without a tokenizer config.json is all there is, and ids outside the checkpoint's vocabulary (the 8B
    # defaults) are not used
    bare = load_model(e, dtype=torch.float32, tokenizer=False)
    assert bare.tokenizer is None and bare.mask_id == 7
    assert bare.eot_id is None
    # ids missing from config.json come from the tokenizer
    for k in ("mask_token_id", "eos_token_id", "pad_token_id"):
        del cfg[k]
    (e / "config.json").write_text(json.dumps(cfg))
    from_tok = load_model(e, dtype=torch.float32)
    assert (from_tok.mask_id, from_tok.eos_id, from_tok.pad_id, from_tok.eot_id) == (
        tok.mask_token_id, tok.eos_token_id, tok.pad_token_id, tok.convert_tokens_to_ids(EOT_TOKEN[family]))


def test_generate_with_string_prompts(saved):
    family, _, d = saved
    loaded = load_model(d, dtype=torch.float32)
    tok = loaded.tokenizer
    prompts = ["What is 2 + 3?", "Name a colour."]
    seen = []
    handle = loaded.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
    try:
        out = dllm.generate(loaded, prompts, gen_length=8, block_length=4, steps=4, seed=0)
    finally:
        handle.remove()
    if family == "llada":
        texts = [f"<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n{p}<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n" for p in prompts]
    else:
        texts = [f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n" for p in prompts]
    expected = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert out.prompt_lengths == [len(e) for e in expected]
    P = max(out.prompt_lengths)
    for b, e in enumerate(expected):  # the canvas the model saw holds exactly the templated prompt
        assert seen[0][b, P - len(e) : P].tolist() == e
    first = expected[0][0]
    if family == "llada":
        assert first == tok.convert_tokens_to_ids("<|startoftext|>")
    else:
        assert first == tok.convert_tokens_to_ids("<|im_start|>")
    assert out.sequences.shape == (2, 8) and not (out.sequences == loaded.mask_id).any()
    assert isinstance(out.texts, list) and len(out.texts) == 2 and all(isinstance(t, str) for t in out.texts)
    # same result as passing the token ids; chat_template=False encodes the raw string
    ids = dllm.generate(loaded, expected, gen_length=8, block_length=4, steps=4, seed=0)
    assert torch.equal(ids.sequences, out.sequences)
    raw = dllm.generate(loaded, prompts, gen_length=8, block_length=4, steps=4, seed=0, chat_template=False)
    assert raw.prompt_lengths == [len(tok(p)["input_ids"]) for p in prompts]
