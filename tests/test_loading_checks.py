"""Strict checkpoint loading: config against tensors, special ids against the tokenizer, unsupported config fields,
corrupt files, devices, bundled names, and weights read straight to their device and dtype."""

from __future__ import annotations

import json
import logging
import re
import shutil
import weakref
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file

import dllm
import dllm.assets
from dllm.cli import main
from dllm.models import Transformer, load_model, save_pretrained

BUNDLED = {"llada": dllm.assets.model_path("llada-tiny"), "dream": dllm.assets.model_path("dream-tiny")}
N_LAYERS_KEY = {"llada": "n_layers", "dream": "num_hidden_layers"}
TIE_KEY = {"llada": "weight_tying", "dream": "tie_word_embeddings"}
HEAD = {"llada": "model.transformer.ff_out.weight", "dream": "lm_head.weight"}
EMBED = {"llada": "model.transformer.wte.weight", "dream": "model.embed_tokens.weight"}
LAYER2 = {"llada": "model.transformer.blocks.2.", "dream": "model.layers.2."}


def raises(exc, *fragments: str):
    """``pytest.raises`` whose message must contain every fragment (regex, case-insensitive)."""
    ctx = pytest.raises(exc)

    class _Check:
        def __enter__(self):
            self.info = ctx.__enter__()
            return self.info

        def __exit__(self, *a):
            handled = ctx.__exit__(*a)
            if handled:
                msg = str(self.info.value)
                for f in fragments:
                    assert re.search(f, msg, re.IGNORECASE), f"{f!r} not in error message: {msg}"
            return handled

    return _Check()


def copy_bundled(family: str, dest: Path, **config_changes) -> Path:
    d = dest / f"{family}-copy"
    shutil.copytree(BUNDLED[family], d)
    if config_changes:
        edit_config(d, **config_changes)
    return d


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def rewrite_weights(d: Path, fn) -> None:
    state = load_file(str(d / "model.safetensors"))
    fn(state)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


def logits_of(model) -> torch.Tensor:
    tokens = torch.arange(9, 9 + 26).view(2, 13)
    return model(tokens)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return {f: logits_of(load_model(p, dtype=torch.float32)) for f, p in BUNDLED.items()}


# ------------------------------------------------------------------------------------------------ bundled names
def test_bundled_names_in_python_api(reference):
    for family in ("llada", "dream"):
        model = dllm.load_model(f"{family}-tiny")
        assert model.spec.family == family and model.tokenizer is not None
        assert torch.equal(logits_of(model), reference[family])
    with raises(FileNotFoundError, "'llada-small' does not exist", "llada-tiny", "dream-tiny"):
        dllm.load_model("llada-small")


# ------------------------------------------------------------------------------------------- config vs tensors
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_fewer_layers_in_config_than_in_files(family, tmp_path):
    d = copy_bundled(family, tmp_path, **{N_LAYERS_KEY[family]: 2})
    with raises(ValueError, LAYER2[family], "layers 2-3", f"{N_LAYERS_KEY[family]}=2", f"set {N_LAYERS_KEY[family]} to 4"):
        load_model(d)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_more_layers_in_config_than_in_files(family, tmp_path):
    d = copy_bundled(family, tmp_path, **{N_LAYERS_KEY[family]: 6})
    with raises(ValueError, "lacks", LAYER2[family].replace("2", "4"), "hold 4 layers", f"{N_LAYERS_KEY[family]}=6"):
        load_model(d)


@pytest.mark.parametrize("field, value", [("n_layers", 0), ("n_layers", -1), ("n_layers", True), ("n_layers", "4"),
                                          ("n_heads", 0), ("d_model", 0), ("vocab_size", 0), ("mlp_hidden_size", 0)])
def test_non_positive_sizes_refused(field, value, tmp_path):
    d = copy_bundled("llada", tmp_path, **{field: value})
    with raises(ValueError, field, "positive integer", re.escape(repr(value))):
        load_model(d)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_tie_flag_must_be_boolean(family, tmp_path):
    d = copy_bundled(family, tmp_path, **{TIE_KEY[family]: "false"})
    with raises(ValueError, TIE_KEY[family], "true or false", "'false'"):
        load_model(d)


def test_zero_layers_dream(tmp_path):
    d = copy_bundled("dream", tmp_path, num_hidden_layers=0)
    with raises(ValueError, "num_hidden_layers", "positive integer"):
        load_model(d)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_unused_tensor_refused(family, tmp_path):
    d = copy_bundled(family, tmp_path)
    rewrite_weights(d, lambda s: s.__setitem__("model.extra.weight", torch.zeros(3)))
    with raises(ValueError, "model.extra.weight", "not used", "model.safetensors"):
        load_model(d)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_weight_tying_mismatch(family, tmp_path):
    untied = copy_bundled(family, tmp_path / "a", **{TIE_KEY[family]: False})  # the bundled models are tied
    with raises(ValueError, HEAD[family], f"{TIE_KEY[family]}=false", f"set {TIE_KEY[family]} to true"):
        load_model(untied)
    tied = copy_bundled(family, tmp_path / "b")
    rewrite_weights(tied, lambda s: s.__setitem__(HEAD[family], s[EMBED[family]].clone()))
    with raises(ValueError, HEAD[family], f"{TIE_KEY[family]}=true", f"set {TIE_KEY[family]} to false"):
        load_model(tied)


# --------------------------------------------------------------------------------------- special ids vs tokenizer
@pytest.mark.parametrize("family, mask, token", [("llada", 5, "<|mdm_mask|>"), ("dream", 8, "<|mask|>")])
def test_mask_id_must_match_tokenizer(family, mask, token, tmp_path):
    d = copy_bundled(family, tmp_path, mask_token_id=6)
    with raises(ValueError, "mask_token_id 6", re.escape(token), f"id {mask}", f"set mask_token_id to {mask}"):
        load_model(d)
    assert load_model(d, tokenizer=False).mask_id == 6  # without a tokenizer config.json is all there is


def test_eos_id_must_be_a_special_token(tmp_path):
    d = copy_bundled("llada", tmp_path, eos_token_id=100)
    with raises(ValueError, "eos_token_id 100", "not a special token", "eos_token_id 0", "<\\|endoftext\\|>"):
        load_model(d)


# ------------------------------------------------------------------------------------------ unsupported fields
LLADA_UNSUPPORTED = [
    ("rope_scaling", {"type": "linear", "factor": 2.0}), ("activation_type", "gelu"), ("activation_type", "swiglu"),
    ("layer_norm_type", "default"), ("block_type", "sequential"), ("alibi", True), ("rope", False),
    ("attention_layer_norm", True), ("input_emb_norm", True), ("scale_logits", True), ("block_group_size", 2),
    ("multi_query_attention", True), ("clip_qkv", 8.0), ("include_bias", True), ("bias_for_layer_norm", True),
    ("layer_norm_with_affine", False),
]
DREAM_UNSUPPORTED = [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), ("hidden_act", "gelu"), ("use_sliding_window", True),
    ("head_dim", 32), ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    ("layer_types", ["full_attention", "sliding_attention", "full_attention", "full_attention"]),
]


@pytest.mark.parametrize("family, field, value", [("llada", *fv) for fv in LLADA_UNSUPPORTED]
                         + [("dream", *fv) for fv in DREAM_UNSUPPORTED])
def test_unsupported_config_fields_refused(family, field, value, tmp_path):
    d = copy_bundled(family, tmp_path, **{field: value})
    with raises(ValueError, f"unsupported {'LLaDA' if family == 'llada' else 'Dream'} config", f"{field}=",
                "is not supported", r"\(only "):
        load_model(d)


def test_unknown_config_field_logged(tmp_path, caplog):
    d = copy_bundled("llada", tmp_path, frobnicate=3)
    with caplog.at_level(logging.WARNING, logger="dllm"):
        load_model(d)
    assert any("frobnicate" in r.getMessage() for r in caplog.records)


# Every field of the published config.json files (MODELS.md), with tiny sizes and the bundled tokenizer's ids.
LLADA_8B = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                 "AutoModel": "modeling_llada.LLaDAModelLM"},
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 64, "embedding_dropout": 0.0,
    "embedding_size": 1197, "eos_token_id": 0, "flash_attention": False, "include_bias": False,
    "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell",
    "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
    "mask_token_id": 5, "max_sequence_length": 4096, "mlp_hidden_size": 256, "mlp_ratio": 4, "model_type": "llada",
    "multi_query_attention": None, "n_heads": 4, "n_kv_heads": 4, "n_layers": 4, "pad_token_id": 0,
    "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True,
    "rope_theta": 10000.0, "scale_logits": False, "transformers_version": "4.46.3", "use_cache": False,
    "vocab_size": 1197, "weight_tying": False,
}
DREAM_7B = {
    "architectures": ["DreamModel"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 256, "mask_token_id": 8, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "Dream", "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 4,
    "pad_token_id": 0, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.46.2", "use_cache": False,
    "use_sliding_window": False, "vocab_size": 1197,
}


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_published_config_field_sets_accepted(family, tmp_path, caplog, reference):
    d = copy_bundled(family, tmp_path)
    (d / "config.json").write_text(json.dumps(LLADA_8B if family == "llada" else DREAM_7B))
    rewrite_weights(d, lambda s: s.__setitem__(HEAD[family], s[EMBED[family]].clone()))  # untied, as published
    with caplog.at_level(logging.WARNING, logger="dllm"):
        model = load_model(d, dtype=torch.float32)
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # every published field is known
    assert not model.config.tie_embeddings
    assert torch.equal(logits_of(model), reference[family])


def test_transformers5_rope_parameters_accepted(tmp_path, reference):
    """transformers 5 writes RoPE settings as rope_parameters; its theta is used."""
    plain = copy_bundled("dream", tmp_path / "plain", rope_theta=5e5)
    d = copy_bundled("dream", tmp_path / "v5")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    cfg["layer_types"] = ["full_attention"] * 4
    (d / "config.json").write_text(json.dumps(cfg))
    model = load_model(d, dtype=torch.float32)
    assert model.config.rope_theta == 5e5
    assert torch.equal(logits_of(model), logits_of(load_model(plain, dtype=torch.float32)))
    assert not torch.equal(logits_of(model), reference["dream"])


# ------------------------------------------------------------------------------------------------ corrupt files
def test_truncated_weights_name_the_file(tmp_path):
    d = copy_bundled("llada", tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with raises(ValueError, re.escape(str(f)), "corrupt or truncated", "copy it again"):
        load_model(d)


def test_garbage_weights_name_the_file(tmp_path):
    d = copy_bundled("dream", tmp_path)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with raises(ValueError, re.escape(str(d / "model.safetensors")), "corrupt or truncated"):
        load_model(d)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_corrupt_tokenizer_names_the_directory(name, tmp_path):
    d = copy_bundled("llada", tmp_path)
    (d / name).write_text('{"model": ')
    with raises(ValueError, "tokenizer files in", re.escape(str(d)), "cannot be loaded", "tokenizer=False"):
        load_model(d)


def test_truncated_shard_and_bad_index(tmp_path):
    model = load_model(BUNDLED["dream"])
    d = save_pretrained(model, tmp_path / "sharded", max_shard_bytes=300_000)
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) >= 3
    shards[1].write_bytes(shards[1].read_bytes()[:1000])
    with raises(ValueError, re.escape(str(shards[1])), "corrupt or truncated"):
        load_model(d)
    index = d / "model.safetensors.index.json"
    index.write_text("{broken")
    with raises(ValueError, re.escape(str(index)), "not valid JSON"):
        load_model(d)
    index.write_text(json.dumps({"metadata": {}}))
    with raises(ValueError, re.escape(str(index)), "weight_map"):
        load_model(d)


def test_index_names_wrong_shard(tmp_path):
    d = save_pretrained(load_model(BUNDLED["llada"]), tmp_path / "sharded", max_shard_bytes=300_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    counts = {f: list(index["weight_map"].values()).count(f) for f in files}
    here = next(f for f in files if counts[f] > 1)  # its shard stays listed
    there = next(f for f in files if f != here)
    key = next(k for k, v in index["weight_map"].items() if v == here)
    index["weight_map"][key] = there
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with raises(ValueError, re.escape(key), there, here, "index"):
        load_model(d)


# -------------------------------------------------------------------------------------------------------- devices
def test_cuda_without_cuda_is_a_clean_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    opened = []
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: opened.append(a))
    with raises(ValueError, "device 'cuda'", "CUDA is not available", "cpu"):
        load_model(BUNDLED["llada"], device="cuda")
    with raises(ValueError, "device_map", "CUDA is not available"):
        load_model(BUNDLED["llada"], device_map={"": 0})
    assert not opened  # refused before any weights were read
    with raises(ValueError, "'gpu'", "not a device"):
        load_model(BUNDLED["llada"], device="gpu")
    with raises(ValueError, "device or device_map"):
        load_model(BUNDLED["llada"], device="cpu", device_map="auto")


def test_cli_load_errors_are_one_line(tmp_path, monkeypatch, capsys):
    d = copy_bundled("llada", tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:5000])
    assert main(["generate", "hi", "--model", str(d), "--gen-length", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and str(f) in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "hi", "--device", "cuda", "--gen-length", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "CUDA is not available" in err


class _SpyOpen:
    """Wraps ``safetensors.safe_open``: records the device each file is opened on and keeps weak references to
    every tensor read, to count how many of them are alive at once."""

    def __init__(self, real):
        self.real, self.read_on, self.refs, self.max_alive = real, [], [], 0

    def __call__(self, filename, framework, device="cpu"):
        spy = self

        class _Handle:
            def __enter__(self):
                self.fh = spy.real(filename, framework=framework, device=device).__enter__()
                return self

            def __exit__(self, *a):
                return self.fh.__exit__(*a)

            def __getattr__(self, name):
                return getattr(self.fh, name)

            def get_tensor(self, key):
                t = self.fh.get_tensor(key)
                spy.read_on.append(device)
                spy.refs.append(weakref.ref(t))
                spy.max_alive = max(spy.max_alive, sum(r() is not None for r in spy.refs))
                return t

        return _Handle()


def test_weights_read_straight_to_device(monkeypatch, reference):
    spy = _SpyOpen(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", spy)

    def no_move(self, *a, **k):
        raise AssertionError("the loaded model was moved after loading")

    monkeypatch.setattr(Transformer, "to", no_move)
    model = load_model(BUNDLED["dream"], dtype=torch.float32, device="cpu")
    assert spy.read_on == ["cpu"] * len(spy.refs) and model.device.type == "cpu"
    assert torch.equal(logits_of(model), reference["dream"])
    spy.read_on.clear()
    model = load_model(BUNDLED["dream"], dtype=torch.float32, device="cpu:0")  # as accelerate names the CPU
    assert set(spy.read_on) == {"cpu"} and torch.equal(logits_of(model), reference["dream"])


def test_bf16_load_keeps_no_fp32_copy(monkeypatch, reference):
    ref = load_model(BUNDLED["llada"], dtype=torch.float32)
    spy = _SpyOpen(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", spy)
    model = load_model(BUNDLED["llada"], dtype=torch.bfloat16)  # the bundled weights are stored as float32
    assert len(spy.refs) == len(ref.state_dict()) - 1  # the tied head is read once
    assert spy.max_alive == 1  # one float32 tensor at a time, never the whole model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v.to(torch.bfloat16)), k


def test_device_map_reads_per_tensor_device(monkeypatch, reference):
    spy = _SpyOpen(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", spy)
    dmap = {"embed": "cpu", "layers.0": "cpu", "layers.1": "cpu", "layers.2": "cpu", "layers.3": "cpu", "norm": "cpu",
            "head": "cpu"}
    model = load_model(BUNDLED["llada"], dtype=torch.float32, device_map=dmap)
    assert set(spy.read_on) == {"cpu"} and len(spy.read_on) == len(spy.refs) > 0
    assert torch.equal(logits_of(model), reference["llada"])
    with raises(ValueError, "disk", "not supported"):
        load_model(BUNDLED["llada"], device_map={"embed": "cpu", "layers": "disk", "norm": "cpu", "head": "cpu"})


# ---------------------------------------------------------------------------------------------------- saving
def test_shard_size_as_string(tmp_path, reference):
    model = load_model(BUNDLED["llada"], dtype=torch.float32)
    d = save_pretrained(model, tmp_path / "s", max_shard_bytes="300KB")
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for p in d.glob("*.safetensors"):  # a shard over the limit holds one tensor larger than the limit
        assert p.stat().st_size <= 300_000 or len(load_file(str(p))) == 1, p.name
    assert torch.equal(logits_of(load_model(d, dtype=torch.float32)), reference["llada"])


@pytest.mark.parametrize("bad", [0, -5, True, "lots"])
def test_bad_shard_size_refused(bad, tmp_path):
    model = load_model(BUNDLED["dream"], tokenizer=False)
    with raises(ValueError, "shard|unit"):
        save_pretrained(model, tmp_path / "s", max_shard_bytes=bad)
