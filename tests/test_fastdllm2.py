"""Fast-dLLM v2-format checkpoints (Fast_dLLM_QwenForCausalLM: Qwen2.5 architecture, block-diffusion attention,
token shift): the published layout (config fields, tensor names), loading checks, the attention and the shift,
the block decoders' checks and row independence (logits and trajectories against the reference code:
test_golden_fastdllm2.py), and ``dllm.generate`` on the format with the exact block cache."""

from __future__ import annotations

import json

import golden_models as gm
import pytest
import torch

from dllm.blockdiff import block_diffusion_generate
from dllm.models.loading import load_model, save_pretrained

PROMPTS = ["What is 12 + 30?", 'Please copy the list exactly: ["Ann Lee", "Bob Stone"]', "Hi"]


@pytest.fixture(scope="module")
def fd2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fastdllm2-tiny")
    save_pretrained(gm.fastdllm2_tiny(0), path)
    return path


def _copy_with_config(src, dst, cfg):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_the_checkpoint_is_in_the_published_layout(fd2_dir):
    from safetensors import safe_open

    cfg = json.loads((fd2_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Fast_dLLM_QwenForCausalLM"] and cfg["model_type"] == "Fast_dLLM_Qwen"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling.Fast_dLLM_QwenForCausalLM"
    assert cfg["auto_map"]["AutoConfig"] == "configuration.Fast_dLLM_QwenConfig"
    assert cfg["bd_size"] == 8 and "block_size" not in cfg and cfg["layer_types"] == ["full_attention"] * 2
    with safe_open(str(fd2_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    layer = {f"model.layers.0.{n}" for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.q_proj.bias",
        "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")}
    assert layer <= names and {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert len(names) == 3 + 2 * len(layer)  # no output-projection bias, no QK norms


def test_loading_detects_the_format_round_trips_and_checks_the_config(fd2_dir, tmp_path):
    import dllm

    m = dllm.load_model(str(fd2_dir))
    assert m.spec.family == "fastdllm2" and m.shift_logits and m.config.block_size == 8 and m.config.qkv_bias
    assert not m.config.out_bias and not m.config.qk_norm
    assert (m.mask_id, m.eot_id, m.pad_id) == (8, 7, 0)  # the bundled tokenizer's <|mask|>, <|im_end|>, pad
    x = torch.randint(0, m.config.vocab_size, (2, 19))
    assert torch.equal(m(x), gm.fastdllm2_tiny(0)(x))
    cfg = json.loads((fd2_dir / "config.json").read_text())
    for i, (bad, match) in enumerate((
            ({"use_sliding_window": True}, "use_sliding_window"), ({"bd_size": 0}, "bd_size"),
            ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
            ({"hidden_act": "gelu"}, "hidden_act"),
            ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"))):
        with pytest.raises(ValueError, match=match):
            load_model(_copy_with_config(fd2_dir, tmp_path / f"bad{i}", {**cfg, **bad}))
    # bd_size defaults to 32 as in the reference's configuration file; head_dim is honoured as its model file does
    no_bd = load_model(_copy_with_config(fd2_dir, tmp_path / "nobd", {k: v for k, v in cfg.items()
                                                                      if k != "bd_size"}))
    assert no_bd.config.block_size == 32
    with pytest.raises(ValueError, match="config.json implies"):  # 4 heads of 24: not the stored projections
        load_model(_copy_with_config(fd2_dir, tmp_path / "hd", {**cfg, "head_dim": 24}))
    from dllm.models import Transformer, TransformerConfig
    from dllm.models.spec import FASTDLLM2

    wide = Transformer(TransformerConfig(vocab_size=m.config.vocab_size, d_model=64, n_layers=1, n_heads=4,
                                         n_kv_heads=2, mlp_hidden=96, qkv_bias=True, head_size=24, block_size=4),
                       FASTDLLM2)
    wide.mask_id, wide.eos_id, wide.pad_id, wide.tokenizer = m.mask_id, m.eos_id, m.pad_id, m.tokenizer
    save_pretrained(wide, tmp_path / "wide")
    assert json.loads((tmp_path / "wide" / "config.json").read_text())["head_dim"] == 24
    back = load_model(tmp_path / "wide")
    assert back.config.head_dim == 24 and torch.equal(back(x), wide(x))


def test_attention_is_block_causal_and_logits_are_shifted(fd2_dir):
    m = load_model(fd2_dir)
    x = torch.randint(0, m.config.vocab_size, (1, 24))
    base = m(x)
    y = x.clone()
    y[0, 9] = (x[0, 9] + 1) % m.config.vocab_size  # a token of the block at positions 8-15
    out = m(y)
    # position c is predicted from hidden row c - 1: columns up to 8 come from rows of earlier blocks
    assert torch.equal(out[0, :9], base[0, :9])
    assert not torch.allclose(out[0, 9], base[0, 9])  # from row 8, which sees position 9 (same block)
    assert torch.equal(base[0, 0], base[0, 1])  # positions 0 and 1 both from row 0, as the reference's shift


def test_fastdllm2_decoder_checks_its_arguments_and_rows_are_independent(fd2_dir):
    m = load_model(fd2_dir)
    for kw, match in (({"small_block_length": 3}, "must divide block_length"),
                      ({"gen_length": 4}, "gen_length"), ({"top_k": 5}, "no denoising_steps"),
                      ({"remasking": "sequential"}, "no denoising_steps"), ({"temperature": -1.0}, "temperature"),
                      ({"top_p": 0.0}, "top_p"), ({"confidence_threshold": 1.5}, "confidence_threshold"),
                      ({"use_block_cache": 1}, "use_block_cache"), ({"gen_length": 600}, "context")):
        with pytest.raises(ValueError, match=match):
            block_diffusion_generate(m, ["What is 1 + 2?"], style="fastdllm2", **kw)
    with pytest.raises(ValueError, match="Fast-dLLM v2's"):
        block_diffusion_generate(m, ["What is 1 + 2?"], use_block_cache=True)  # style sdar
    for style in ("fastdllm2", "fastdllm2_generate"):
        kw = dict(gen_length=24, small_block_length=4, temperature=1.0, seed=3, use_block_cache=True, style=style)
        both = block_diffusion_generate(m, PROMPTS, **kw)
        for i, p in enumerate(PROMPTS):
            alone = block_diffusion_generate(m, [p], **kw)
            assert alone.sequences[0] == both.sequences[i] and alone.nfe[0] == both.nfe[i]
    out = block_diffusion_generate(m, PROMPTS[:1], gen_length=24, style="fastdllm2")  # defaults: greedy, 0.9
    assert out.texts is not None and out.trace[0][0]["kind"] == "prefill"


def test_a_prompt_of_one_block_is_attended_and_a_first_block_stop_ends_the_row(fd2_dir):
    """Where the reference misbehaves, the decoder does the consistent thing: a prompt of exactly one block is
    prefilled (the reference decodes without it), and a row that stops in the first block of a prompt shorter
    than a block ends normally (the reference's batch_sample raises TypeError there)."""
    m = load_model(fd2_dir)
    a, b = list(range(20, 28)), list(range(40, 48))
    outs = [block_diffusion_generate(m, [p], chat_template=False, gen_length=16, style="fastdllm2") for p in (a, b)]
    assert [f["kind"] for f in outs[0].trace[0][:2]] == ["prefill", "denoise"]
    assert outs[0].sequences[0] != outs[1].sequences[0]
    stop = m.eot_id
    for prompt in ([5, 6, 9], list(range(100, 110)), [300, 301]):
        out = block_diffusion_generate(m, [prompt], chat_template=False, gen_length=16, block_length=16,
                                       small_block_length=4, confidence_threshold=0.5, stop_ids=[stop],
                                       style="fastdllm2")
        seq = out.sequences[0]
        if stop in seq and len(prompt) + seq.index(stop) < 16:
            assert len(seq) == 16 - len(prompt) and set(seq[seq.index(stop) + 1:]) <= {m.pad_id}
            break
    else:
        pytest.fail("no prompt stopped in its first block; pick others")


def test_generate_decodes_the_format_with_the_exact_block_cache():
    """dllm.generate on a token-shift block-diffusion model: regions on the model's block grid and the exact block
    cache by default; every sampler gives the tokens and forwards of no cache while computing a fraction of the
    rows (the row before a block, whose hidden state predicts the block's first position, included)."""
    import dllm
    from dllm.samplers import SAMPLERS

    m = gm.fastdllm2_tiny(0)
    for name in SAMPLERS:
        if name in ("guided", "adablock"):  # the AR guide's tokenizer; delimiter ids of trained models
            continue
        sampler = dllm.get_sampler(name, **({"block_length": 8} if name == "multiblock" else {}))
        kw = dict(gen_length=16, steps=16, sampler=sampler, seed=1)
        base = dllm.generate(m, PROMPTS, cache="none", **kw)
        out = dllm.generate(m, PROMPTS, **kw)
        assert torch.equal(out.sequences, base.sequences), name
        assert out.stats.row_nfe == base.stats.row_nfe, name
        fractions = [float(f) for rec in out.stats.trace[1:] for f in rec["computed"]]
        assert fractions and max(fractions) < 0.7, name
    out = dllm.generate(m, PROMPTS, gen_length=16, steps=16)
    first = out.stats.trace[0]
    P = max(out.prompt_lengths)
    for b, n in enumerate(out.prompt_lengths):  # each row's first region ends at its prompt's block boundary
        assert int(first["hi"][b]) - (P - n) == (n // 8 + 1) * 8
