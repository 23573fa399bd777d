"""Every bad input gets an error that says what is wrong and how to fix it (or which options exist)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import random_model
from safetensors.torch import load_file, save_file

import dllm
from dllm import GenerateConfig, generate, get_cache, get_sampler, load_model, save_pretrained
from dllm.samplers import DreamSampler, LLaDASampler


def raises(exc, *fragments: str):
    """``pytest.raises`` that also checks every fragment (a regex, case-insensitive) is in the message."""

    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(exc)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *a):
            handled = self.ctx.__exit__(*a)
            if not handled:
                return False
            msg = str(self.info.value)
            for f in fragments:
                assert re.search(f, msg, re.IGNORECASE), f"{f!r} not in error message: {msg}"
            return handled

    return _Check()


PROMPTS = [[5, 6, 7], [8, 9]]


@pytest.fixture(scope="module")
def llada():
    return random_model("llada")


# ------------------------------------------------------------------------------------------ registries
def test_unknown_sampler(llada):
    with raises(ValueError, "unknown sampler 'fastest'", "known samplers", "llada", "dream-entropy"):
        get_sampler("fastest")
    with raises(ValueError, "unknown sampler 'fastest'", "known samplers: .*llada"):
        generate(llada, PROMPTS, gen_length=4, sampler="fastest")


def test_unknown_cache(llada):
    with raises(ValueError, "unknown cache 'turbo'", "known caches", "none"):
        get_cache("turbo")
    with raises(ValueError, "unknown cache 'turbo'", "known caches"):
        generate(llada, PROMPTS, gen_length=4, cache="turbo")


def test_unknown_sampler_parameter():
    with raises(ValueError, "'llada'", "no parameter", "tempreature", "temperature", "remasking"):
        get_sampler("llada", tempreature=0.5)
    with raises(ValueError, "'dream-entropy'", "top_q", "top_p"):
        get_sampler("dream-entropy", top_q=0.9)


def test_unknown_generate_option(llada):
    with raises(TypeError, "gen_lenght", "gen_length", "block_length", "steps"):
        generate(llada, PROMPTS, gen_lenght=4)


# ---------------------------------------------------------------------------------------- sampler params
@pytest.mark.parametrize(("kwargs", "fragments"), [
    ({"top_p": 0}, ("top_p=0", r"\(0, 1\]")),
    ({"top_p": 1.5}, ("top_p=1.5", r"\(0, 1\]")),
    ({"eps": 0}, ("eps=0", r"\(0, 1\)")),
    ({"eps": 1.0}, ("eps=1.0", r"\(0, 1\)")),
    ({"top_k": 0}, ("top_k", "positive integer")),
    ({"alg_temp": -1.0}, ("alg_temp", ">= 0")),
    ({"temperature": -0.1}, ("temperature must be >= 0", "-0.1", "use 0 for greedy")),
    ({"alg": "greedy"}, ("unknown Dream alg 'greedy'", "origin", "maskgit_plus", "topk_margin", "entropy")),
    ({"noise_scope": "global"}, ("noise_scope", "region", "canvas")),
])
def test_dream_sampler_params(kwargs, fragments):
    with raises(ValueError, *fragments):
        DreamSampler(**kwargs)
    with raises(ValueError, *fragments):
        get_sampler("dream", **kwargs)


@pytest.mark.parametrize(("kwargs", "fragments"), [
    ({"temperature": -1.0}, ("temperature must be >= 0", "use 0 for greedy")),
    ({"remasking": "high_confidence"}, ("remasking 'high_confidence'", "low_confidence", "random")),
    ({"softmax_dtype": "float16"}, ("softmax_dtype 'float16'", "float32", "float64", "model")),
    ({"noise_scope": "global"}, ("noise_scope", "region", "canvas")),
])
def test_llada_sampler_params(kwargs, fragments):
    with raises(ValueError, *fragments):
        LLaDASampler(**kwargs)
    with raises(ValueError, *fragments):
        get_sampler("llada", **kwargs)


# --------------------------------------------------------------------------------------- generate config
@pytest.mark.parametrize(("kwargs", "fragments"), [
    ({"gen_length": 0}, ("gen_length must be a positive integer", "0")),
    ({"gen_length": 4.0}, ("gen_length must be a positive integer",)),
    ({"block_length": -2}, ("block_length must be a positive integer or None",)),
    ({"steps": 0}, ("steps must be a positive integer or None",)),
    ({"cfg_scale": -1.0}, ("cfg_scale must be >= 0",)),
])
def test_bad_generate_config(kwargs, fragments):
    with raises(ValueError, *fragments):
        GenerateConfig(**kwargs)


@pytest.mark.parametrize(("kwargs", "fragments"), [
    ({"gen_length": 10, "block_length": 4}, ("gen_length \\(10\\) is not a multiple of block_length \\(4\\)",
                                             "gen_length=12", "block_length that divides 10")),
    ({"gen_length": 8, "block_length": 16}, ("block_length \\(16\\) is larger than gen_length \\(8\\)",
                                             "block_length <= gen_length")),
    ({"gen_length": 8, "block_length": 2, "steps": 6}, ("steps \\(6\\) must divide evenly over the 4 blocks",
                                                         "multiple of 4", "steps=4")),
    ({"gen_length": 8, "steps": 16}, ("steps \\(16\\) exceeds gen_length \\(8\\)", "steps <= gen_length")),
])
def test_bad_block_and_steps(llada, kwargs, fragments):
    with raises(ValueError, *fragments):
        generate(llada, PROMPTS, **kwargs)


def test_prompt_plus_gen_beyond_context(llada):
    long_prompt = [[5] * 250]
    with raises(ValueError, r"longest prompt \(250 tokens\) \+ gen_length \(16\) = 266", "context of 256",
                "shorten the prompt or lower gen_length"):
        generate(llada, long_prompt, gen_length=16)


# ------------------------------------------------------------------------------------------------ prompts
def test_prompt_with_mask_token(llada):
    with raises(ValueError, "prompt 1 contains the mask token", f"id {llada.mask_id}", "remove it"):
        generate(llada, [[5, 6], [7, llada.mask_id, 8]], gen_length=4)


def test_empty_prompt(llada):
    with raises(ValueError, "prompt 1 is empty", "at least one token"):
        generate(llada, [[5, 6], []], gen_length=4)
    am = torch.tensor([[1, 1], [0, 0]])
    with raises(ValueError, "prompt 1 is empty"):
        generate(llada, torch.tensor([[5, 6], [7, 8]]), attention_mask=am, gen_length=4)


@pytest.mark.parametrize("prompts", [[], ()])
def test_empty_prompt_list(llada, prompts):
    with raises(ValueError, "non-empty", "list of token-id lists"):
        generate(llada, prompts, gen_length=4)
    with raises(ValueError, "non-empty", r"\[B, L\]", r"shape \(0, 3\)"):
        generate(llada, torch.zeros(0, 3, dtype=torch.long), gen_length=4)


def test_string_prompt_without_tokenizer(llada):
    assert llada.tokenizer is None
    with raises(ValueError, "string prompts need a tokenizer", "load_model", "pass token ids"):
        generate(llada, "hello", gen_length=4)
    with raises(ValueError, "string prompts need a tokenizer"):
        generate(llada, [[{"role": "user", "content": "hi"}]], gen_length=4)


def test_token_ids_outside_vocabulary(llada):
    with raises(ValueError, "prompt 0", "1000", r"outside the vocabulary \(0\.\.95\)", "tokenizer"):
        generate(llada, [[5, 1000]], gen_length=4)
    with raises(ValueError, "prompt 1", "-3", "outside the vocabulary"):
        generate(llada, [[5], [-3, 4]], gen_length=4)


def test_attention_mask_shape_mismatch(llada):
    with raises(ValueError, r"attention_mask shape \(2, 3\) != prompts shape \(2, 2\)"):
        generate(llada, torch.tensor([[5, 6], [7, 8]]), attention_mask=torch.ones(2, 3), gen_length=4)


def test_attention_mask_without_tensor_prompts(llada):
    with raises(ValueError, "attention_mask", "tensor"):
        generate(llada, PROMPTS, attention_mask=torch.ones(2, 3), gen_length=4)


def test_prompt_tensor_with_wrong_rank(llada):
    with raises(ValueError, "prompts tensor", "3", "\\[B, L\\]"):
        generate(llada, torch.ones(2, 3, 4, dtype=torch.long), gen_length=4)


def test_model_without_mask_id():
    m = random_model("llada")
    m.mask_id = None
    with raises(ValueError, "no mask token id", "set model.mask_id"):
        generate(m, PROMPTS, gen_length=4)


def test_guide_not_available(llada):  # AR-guided decoding exists now (issue 7): a bad guide is a clear error
    with raises(ValueError, "AR-guided"):
        generate(llada, PROMPTS, gen_length=4, guide=object())


# ------------------------------------------------------------------------------------------------- caches
class _StubCache:
    name = "stub"

    def reset(self, batch, canvas_len):
        pass

    def plan(self, state):
        return None, None

    def update(self, layer, k, v):
        return k, v


class _NoCacheModel(torch.nn.Module):
    """The smallest object the decode loop accepts as a model, without cache support."""

    supports_cache = False
    mask_id, eos_id, eot_id, pad_id = 11, 1, None, 1
    max_seq_len = 64
    tokenizer = None
    spec = None

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(12))

    @property
    def device(self):
        return self.w.device

    def forward(self, tokens, *, positions=None, attn_mask=None, query_idx=None, cache=None, logits_idx=None):
        B = tokens.shape[0]
        R = tokens.shape[1] if logits_idx is None else logits_idx.shape[1]
        return self.w.expand(B, R, 12) + torch.arange(12.0)


def test_cache_on_model_without_cache_support():
    model = _NoCacheModel()
    assert not generate(model, PROMPTS, gen_length=4).sequences.eq(model.mask_id).any()  # works without a cache
    with raises(ValueError, "cache 'stub'", "supports no caches", "cache=None"):
        generate(model, PROMPTS, gen_length=4, cache=_StubCache())


# ------------------------------------------------------------------------------------------- checkpoints
@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A single-file LLaDA-format checkpoint without tokenizer files."""
    return save_pretrained(random_model("llada"), tmp_path / "ckpt")


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def test_missing_directory(tmp_path):
    with raises(FileNotFoundError, "does not exist", "local checkpoint directory"):
        load_model(tmp_path / "nowhere")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with raises(FileNotFoundError, "config.json is missing", "next to its safetensors weights"):
        load_model(ckpt, tokenizer=False)


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with raises(ValueError, "config.json", "not valid JSON"):
        load_model(ckpt, tokenizer=False)


def test_missing_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with raises(FileNotFoundError, "no weights", "model.safetensors", "model.safetensors.index.json"):
        load_model(ckpt, tokenizer=False)


def test_shards_without_index(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    with raises(FileNotFoundError, "no weights", "found \\['model-00001-of-00001.safetensors'\\]",
                "no model.safetensors.index.json"):
        load_model(ckpt, tokenizer=False)


def test_missing_shard(tmp_path):
    d = save_pretrained(random_model("dream"), tmp_path / "sharded", max_shard_bytes=20_000)
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) >= 3
    shards[1].unlink()
    with raises(FileNotFoundError, "lists shard\\(s\\) missing", shards[1].name, "complete checkpoint"):
        load_model(d, tokenizer=False)


def test_missing_tokenizer_files(ckpt):
    with raises(FileNotFoundError, "tokenizer files missing", "tokenizer.json", "tokenizer=False"):
        load_model(ckpt)
    assert load_model(ckpt, tokenizer=False).tokenizer is None


def _rewrite_weights(d: Path, fn) -> None:
    state = load_file(str(d / "model.safetensors"))
    fn(state)
    save_file(state, str(d / "model.safetensors"))


def test_tensor_shape_mismatch(ckpt):
    key = "model.transformer.blocks.1.up_proj.weight"
    _rewrite_weights(ckpt, lambda s: s.__setitem__(key, torch.zeros(65, 32)))
    with raises(ValueError, key, r"shape \(65, 32\)", r"config.json implies \(64, 32\)", "do not match"):
        load_model(ckpt, tokenizer=False)


def test_integer_tensor(ckpt):
    key = "model.transformer.ln_f.weight"
    _rewrite_weights(ckpt, lambda s: s.__setitem__(key, torch.ones(32, dtype=torch.int32)))
    with raises(ValueError, key, "torch.int32", "expected a float tensor"):
        load_model(ckpt, tokenizer=False)


def test_missing_tensor(ckpt):
    key = "model.transformer.blocks.0.attn_out.weight"
    _rewrite_weights(ckpt, lambda s: s.pop(key))
    with raises(ValueError, "lacks tensor", key, "config.json"):
        load_model(ckpt, tokenizer=False)


def test_wrong_family_tensor_names(tmp_path):
    """Dream weights under a LLaDA config: every tensor is missing, and the message says which."""
    d = save_pretrained(random_model("dream"), tmp_path / "dream")
    _edit_config(d, model_type="llada", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, include_qkv_bias=True)
    with raises(ValueError, "lacks tensor", "model.transformer.wte.weight", "more"):
        load_model(d, tokenizer=False)


def test_unsupported_model_type(ckpt):
    _edit_config(ckpt, model_type="bert")
    with raises(ValueError, "unsupported model_type 'bert'", "supported: 'llada', 'Dream'", "HFModel"):
        load_model(ckpt, tokenizer=False)
    _edit_config(ckpt, model_type=None)
    with raises(ValueError, "unsupported model_type None", "'llada'"):
        load_model(ckpt, tokenizer=False)


def test_unsupported_llada_block_type(ckpt):
    _edit_config(ckpt, block_type="sequential")
    with raises(ValueError, "unsupported LLaDA config", "block_type='sequential'", "only 'llama'"):
        load_model(ckpt, tokenizer=False)


def test_config_missing_fields(ckpt):
    _edit_config(ckpt, d_model=None)
    with raises(ValueError, "config.json of a LLaDA checkpoint lacks", "d_model"):
        load_model(ckpt, tokenizer=False)


def test_mask_id_outside_vocab(ckpt):
    _edit_config(ckpt, mask_token_id=500)
    with raises(ValueError, "mask_token_id 500", "outside the vocabulary \\(96\\)", "fix it"):
        load_model(ckpt, tokenizer=False)
    _edit_config(ckpt, mask_token_id=None)  # the 8B default does not fit a 96-token vocabulary
    with raises(ValueError, "no usable mask token id", "add mask_token_id"):
        load_model(ckpt, tokenizer=False)


@pytest.mark.parametrize("dtype", ["float8", "half-precision", "int8"])
def test_unknown_dtype(ckpt, dtype):
    with raises(ValueError, f"unknown dtype '{dtype}'", "bfloat16", "float32"):
        load_model(ckpt, dtype=dtype, tokenizer=False)
    with raises(ValueError, f"unknown dtype '{dtype}'"):
        save_pretrained(random_model("llada"), ckpt, dtype=dtype)


def test_dllm_exports():
    assert callable(dllm.generate) and callable(dllm.load_model)
