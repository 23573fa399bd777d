"""LLaDA2-format checkpoints (LLaDA2MoeModelLM: block diffusion over a mixture of experts): the published layout,
loading checks, and decoding with every sampler through dllm.generate (its own blocks and the exact block cache).
Logits and LLaDA2's own decoder against its code: test_golden_llada2.py."""

from __future__ import annotations

import json

import golden_models as gm
import pytest
import torch

import dllm
from dllm.models.loading import load_model, save_pretrained


@pytest.fixture(scope="module")
def llada2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llada2-tiny")
    save_pretrained(gm.llada2_tiny(0), path)
    return path


def test_the_checkpoint_is_in_llada2s_published_layout_and_round_trips(llada2_dir, tmp_path):
    from safetensors import safe_open

    cfg = json.loads((llada2_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LLaDA2MoeModelLM"] and cfg["model_type"] == "llada2_moe"
    assert cfg["partial_rotary_factor"] == 0.5 and cfg["first_k_dense_replace"] == 1 and cfg["num_experts"] == 8
    with safe_open(str(llada2_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert tuple(f.get_tensor("model.layers.0.attention.query_key_value.weight").shape) == ((4 + 2 * 2) * 16, 64)
    assert {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.0.mlp.gate_proj.weight",  # the dense first layer
            "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.expert_bias",
            "model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.2.mlp.shared_experts.up_proj.weight",
            "model.layers.2.attention.query_layernorm.weight", "model.layers.2.attention.dense.weight"} <= names
    assert "model.layers.1.mlp.gate_proj.weight" not in names and "model.layers.0.mlp.gate.weight" not in names
    m = load_model(llada2_dir)
    assert m.spec.family == "llada2" and m.config.rope_dim == 8 and m.config.n_experts == 8
    x = torch.randint(0, m.config.vocab_size, (2, 11))
    assert torch.equal(m(x), gm.llada2_tiny(0)(x))
    for bad, match in (({"rope_scaling": {"type": "yarn"}}, "rope_scaling"), ({"hidden_act": "gelu"}, "hidden_act"),
                       ({"num_experts_per_tok": 9}, "experts_per_token"),
                       ({"use_qk_norm": False}, "use_qk_norm")):  # LLaDA2.1's model file makes the norms optional
        d = tmp_path / f"bad{len(match)}"
        d.mkdir()
        for f in llada2_dir.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        (d / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ValueError, match=match):
            load_model(d)


def test_generate_decodes_llada2_on_its_blocks_with_the_exact_block_cache():
    from dllm.samplers import SAMPLERS

    m = gm.llada2_tiny(0)
    prompts = ["What is 12 + 30?", 'Please copy the list exactly: ["Ann Lee", "Bob Stone"]', "Hi"]
    for name in ("llada", "threshold", "credit", "entropy-threshold", "klass", "eb"):
        assert name in SAMPLERS
        kw = dict(gen_length=16, steps=16, sampler=name, seed=1)
        base = dllm.generate(m, prompts, cache="none", **kw)
        out = dllm.generate(m, prompts, **kw)
        assert torch.equal(out.sequences, base.sequences), name
        assert out.stats.row_nfe == base.stats.row_nfe, name
        assert max(float(f) for rec in out.stats.trace[1:] for f in rec["computed"]) < 0.5, name


def test_llada2_decoder_checks_eos_early_stop_and_minimal_topk():
    from dllm.blockdiff import block_diffusion_generate

    m = gm.llada2_tiny(0)
    kw = dict(gen_length=8, block_length=4, chat_template=False)
    for bad, match in (({"minimal_topk": 0}, "minimal_topk must be a positive integer"),
                       ({"minimal_topk": 2.0}, "minimal_topk must be a positive integer"),
                       ({"minimal_topk": 9}, "minimal_topk \\(9\\) exceeds gen_length \\(8\\)"),
                       ({"eos_early_stop": 1}, "eos_early_stop must be True or False"),
                       ({"eos_early_stop": True, "stop_ids": []}, "eos_early_stop needs a stop token")):
        with pytest.raises(ValueError, match=match):
            block_diffusion_generate(m, [[5, 6, 7]], style="llada2", **bad, **kw)
    for style in ("sdar", "fastdllm2", "fastdllm2_generate"):
        for bad in ({"eos_early_stop": True}, {"minimal_topk": 2}):
            with pytest.raises(ValueError, match="LLaDA2's generate options"):
                block_diffusion_generate(m, [[5, 6, 7]], style=style, **bad, **kw)
    # minimal_topk caps the forwards per block at gen_length // minimal_topk: with 2 forwards for 4 positions,
    # denoising_steps may exceed block_length before the cap
    out = block_diffusion_generate(m, [[5, 6, 7]], style="llada2", denoising_steps=8, minimal_topk=4, **kw)
    assert max(sum(1 for f in out.trace[0] if f["block"] == b) for b in (0, 1, 2)) <= 2
