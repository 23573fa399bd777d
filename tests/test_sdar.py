"""SDAR-format checkpoints (SDARForCausalLM: Qwen3 architecture, block-diffusion attention): the published
layout (config fields, tensor names, tokenizer), loading checks, the block-causal attention, and the block
decoder's checks and row independence (its logits and trajectories against SDAR's own code:
test_golden_sdar.py)."""

from __future__ import annotations

import json

import golden_models as gm
import pytest
import torch

from dllm.blockdiff import block_diffusion_generate
from dllm.models.loading import load_model, save_pretrained


def make_sdar(path, *, seed: int = 0, block_size: int = 4, bias: bool = False):
    """:func:`golden_models.sdar_tiny` written to ``path`` in SDAR's published layout."""
    m = gm.sdar_tiny(seed, block_size, bias)
    save_pretrained(m, path)
    return m


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sdar-tiny")
    make_sdar(path)
    return path


def test_the_checkpoint_is_in_sdars_published_layout(sdar_dir):
    from safetensors import safe_open

    cfg = json.loads((sdar_dir / "config.json").read_text())
    assert cfg["architectures"] == ["SDARForCausalLM"] and cfg["model_type"] == "sdar"
    assert cfg["block_size"] == 4 and cfg["head_dim"] == 24 and cfg["attention_bias"] is False
    with safe_open(str(sdar_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    layer = {f"model.layers.0.{n}.weight" for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
        "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
        "post_attention_layernorm")}
    assert layer <= names and {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert len(names) == 3 + 2 * len(layer)
    with safe_open(str(sdar_dir / "model.safetensors"), "pt") as f:
        assert tuple(f.get_tensor("model.layers.0.self_attn.q_norm.weight").shape) == (24,)
        assert tuple(f.get_tensor("model.layers.0.self_attn.q_proj.weight").shape) == (4 * 24, 64)


def test_loading_round_trips_and_checks_the_config(sdar_dir, tmp_path):
    m = load_model(sdar_dir)
    assert m.spec.family == "sdar" and m.config.block_size == 4 and m.config.qk_norm and m.config.head_dim == 24
    assert m.mask_id == m.tokenizer.mask_token_id
    m2 = make_sdar(tmp_path / "b", bias=True)  # attention_bias: q/k/v and o projections
    back = load_model(tmp_path / "b")
    x = torch.randint(0, m2.config.vocab_size, (2, 11))
    assert torch.equal(m2(x), back(x))
    cfg = json.loads((sdar_dir / "config.json").read_text())
    for bad, match in (({"use_sliding_window": True}, "use_sliding_window"), ({"block_size": 0}, "block_size"),
                       ({"rope_scaling": {"type": "yarn"}}, "rope_scaling")):
        d = tmp_path / f"bad{len(match)}"
        d.mkdir()
        for f in sdar_dir.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        (d / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ValueError, match=match):
            load_model(d)
    no_block = {k: v for k, v in cfg.items() if k != "block_size"}
    (tmp_path / "bad2").mkdir()
    for f in sdar_dir.iterdir():
        (tmp_path / "bad2" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "bad2" / "config.json").write_text(json.dumps(no_block))
    with pytest.raises(ValueError, match="block_size"):
        load_model(tmp_path / "bad2")


def test_attention_is_bidirectional_in_a_block_and_causal_across_blocks(sdar_dir):
    m = load_model(sdar_dir)
    x = torch.randint(0, m.config.vocab_size, (1, 12))
    base = m(x)
    y = x.clone()
    y[0, 9] = (x[0, 9] + 1) % m.config.vocab_size  # a token of block 2 (positions 8-11)
    out = m(y)
    assert torch.equal(out[0, :8], base[0, :8])  # earlier blocks never see it
    assert not torch.allclose(out[0, 8], base[0, 8])  # its own block does, before it too
    # Left padding: blocks follow the row's own positions, so a padded row computes what it computes alone.
    pad = torch.cat([torch.full((1, 3), m.pad_id), x], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 12, dtype=torch.bool)], 1)
    assert torch.allclose(m(pad, attn_mask=mask)[0, 3:], base[0], atol=1e-5)


def test_block_decoder_checks_its_arguments_and_rows_are_independent(sdar_dir):
    import dllm
    from dllm.blockdiff import block_diffusion_generate

    m = load_model(sdar_dir)
    with pytest.raises(ValueError, match="block-diffusion checkpoint"):
        block_diffusion_generate(dllm.load_model("llada-tiny"), ["hi"])
    for kw, match in (({"temperature": 0.0}, "top_k=1"), ({"remasking": "entropy_bounded"}, "known: low_conf"),
                      ({"denoising_steps": 8, "block_length": 4}, "exceeds block_length"),
                      ({"gen_length": 0}, "gen_length"), ({"top_p": 0.0}, "top_p"),
                      ({"gen_length": 600}, "context")):
        with pytest.raises(ValueError, match=match):
            block_diffusion_generate(m, ["What is 1 + 2?"], **kw)
    prompts = ["What is 12 + 30?", 'Please copy the list exactly: ["Ann Lee", "Bob Stone"]']
    kw = dict(gen_length=12, block_length=4, denoising_steps=4, top_k=0, seed=3)
    both = block_diffusion_generate(m, prompts, **kw)
    for i, p in enumerate(prompts):
        alone = block_diffusion_generate(m, [p], **kw)
        assert alone.sequences[0] == both.sequences[i] and alone.nfe[0] == both.nfe[i]
    assert len(both.sequences[0]) % 4 == (-both.prompt_lengths[0]) % 4 and len(both.sequences[0]) >= 12
    # The exact cache: each denoising forward over a block sees the stored blocks exactly as a full-canvas
    # forward does (block-causal attention), so the first block's proposals equal the full forward's argmax.
    x = torch.tensor([m.tokenizer.encode("abc def ghi jk")[:8] + [m.mask_id] * 4])
    full = m(x, block_size=4)[0, 8:]
    out = block_diffusion_generate(m, [x[0, :8].tolist()], gen_length=4, block_length=4, denoising_steps=1,
                                   top_k=1, chat_template=False, remasking="low_confidence_static")
    assert out.sequences[0] == full.argmax(-1).tolist() and out.nfe[0] == 3  # prefill, the block, its store


def test_generate_decodes_sdar_on_its_own_blocks_with_the_exact_block_cache():
    """dllm.generate on a block-diffusion model: regions on the model's block grid and the exact block cache by
    default; every sampler gives the tokens and forwards of no cache while computing a fraction of the rows."""
    import dllm
    from dllm.samplers import SAMPLERS

    m = gm.sdar_tiny(0)
    prompts = ["What is 12 + 30?", 'Please copy the list exactly: ["Ann Lee", "Bob Stone"]', "Hi"]
    for name in SAMPLERS:
        if name in ("guided", "adablock"):  # the AR guide's tokenizer; delimiter ids of trained models
            continue
        sampler = dllm.get_sampler(name, **({"block_length": 4} if name == "multiblock" else {}))
        kw = dict(gen_length=16, steps=16, sampler=sampler, seed=1)
        base = dllm.generate(m, prompts, cache="none", **kw)
        out = dllm.generate(m, prompts, **kw)
        assert torch.equal(out.sequences, base.sequences), name
        assert out.stats.row_nfe == base.stats.row_nfe, name
        fractions = [float(f) for rec in out.stats.trace[1:] for f in rec["computed"]]
        assert fractions and max(fractions) < 0.5, name  # after the first forward: blocks, not the canvas
    out = dllm.generate(m, prompts, gen_length=16, steps=16)
    first = out.stats.trace[0]
    P = max(out.prompt_lengths)
    for b, n in enumerate(out.prompt_lengths):  # each row's first region ends at its prompt's block boundary
        off = P - n
        assert int(first["hi"][b]) - off == (n // 4 + 1) * 4
    with pytest.raises(ValueError, match="block-diffusion checkpoints"):
        dllm.generate(dllm.load_model("llada-tiny"), ["hi"], gen_length=8, block_length=8, steps=8, cache="block")
    with pytest.raises(ValueError, match="multiple of gen_length"):
        dllm.generate(m, prompts, gen_length=16, steps=6)


def test_the_block_cache_adds_one_synchronisation():
    from sync_counter import syncs_per_step

    import dllm

    m = gm.sdar_tiny(0)
    for name in ("llada", "threshold", "credit"):
        per_step, where, steps = syncs_per_step(lambda name=name: dllm.generate(m, ["What is 12 + 30?", "Hi"],
                                                                                gen_length=16, steps=16, sampler=name))
        assert steps > 0 and 1 <= per_step <= 2, (name, per_step, where.most_common(4))


def test_the_command_line_generates_and_evaluates_an_sdar_checkpoint(sdar_dir, tmp_path, capsys):
    """`dllm generate` and `dllm eval-tasks` / `dllm parallelbench run` take an SDAR directory like any checkpoint."""
    from dllm.cli import main

    assert main(["generate", "What is 1 + 2?", "--model", str(sdar_dir), "--gen-length", "8", "--json"]) == 0
    import json

    assert len(json.loads(capsys.readouterr().out)["sequences"][0]) == 8
    assert main(["eval-tasks", "--model", str(sdar_dir), "--tasks", "waiting_line/copy", "--n", "2",
                 "--gen-length", "16"]) == 0
    assert "waiting_line/copy" in capsys.readouterr().out
    assert main(["parallelbench", "run", "--model", str(sdar_dir), "--tasks", "waiting_line/copy", "--n", "2",
                 "--method", "threshold", "--gen-length", "16", "--out", str(tmp_path / "pb")]) == 0
    assert (tmp_path / "pb").is_dir()


def test_multi_block_decoding_keeps_the_block_cache_exact():
    """d3LLM's multi-block decoding on a block-diffusion model: several blocks decode at once and the block cache
    still gives the tokens and forwards of no cache (a block's K/V become final once it is done)."""
    import dllm

    m = gm.sdar_tiny(0)
    prompts = ["What is 12 + 30?", 'Please copy the list exactly: ["Ann Lee", "Bob Stone"]', "Hi"]
    for kw in (dict(threshold=2.0, block_length=4, add_threshold=0.25), dict(threshold=0.5, block_length=8)):
        s = dllm.get_sampler("multiblock", **kw)
        base = dllm.generate(m, prompts, sampler=s, gen_length=16, cache="none")
        out = dllm.generate(m, prompts, sampler=s, gen_length=16, cache="block")
        assert torch.equal(out.sequences, base.sequences) and out.stats.row_nfe == base.stats.row_nfe
        assert max(float(f) for rec in out.stats.trace[1:] for f in rec["computed"]) < 0.6
    # with blocks of 4 added at a quarter, a later block is decoded while an earlier one still holds masks
    out = dllm.generate(m, prompts[:1], sampler=dllm.get_sampler("multiblock", threshold=2.0, block_length=4,
                                                                   add_threshold=0.25), gen_length=16)
    step = out.stats.commit_step[0]  # the step at which each generated position was committed
    assert any(step[q] > step[p] for p in range(4, 16) for q in range(p // 4 * 4 - 4, p // 4 * 4))


def test_the_callers_block_length_sets_the_multi_block_size():
    import dllm

    m = dllm.load_model("llada-tiny")
    out = dllm.generate(m, ["What is 12 + 30?"], gen_length=16, block_length=4, steps=16, sampler="multiblock")
    assert int(out.stats.trace[0]["hi"][0]) - out.prompt_lengths[0] == 4  # the first region: one block of 4
    with pytest.raises(ValueError, match="multiple of the multi-block block_length \\(32\\)"):
        dllm.generate(m, ["What is 12 + 30?"], gen_length=16, steps=16, sampler="multiblock")


def _model_for(style: str):
    """A random tiny model the style fits (Fast-dLLM v2's styles need its shifted logits; the others SDAR's)."""
    return gm.fastdllm2_tiny(0) if style.startswith("fastdllm2") else gm.sdar_tiny(0)


@pytest.mark.parametrize("style", ["sdar", "llada2", "llada21", "fastdllm2"])
def test_block_decoders_refuse_a_canvas_longer_than_the_context(style):
    model = _model_for(style)
    with pytest.raises(ValueError, match=r"more than the model's context of 512"):
        block_diffusion_generate(model, ["Copy: [a, b]"], gen_length=600, style=style,
                                 **({"temperature": 0.0} if style == "llada2" else {}))


@pytest.mark.parametrize("style", ["sdar", "llada2", "llada21", "fastdllm2"])
@pytest.mark.parametrize("bad,match", [({"top_p": 1.5}, r"top_p=1.5 must be a number in \(0, 1\]"),
                                       ({"top_p": True}, r"top_p=True"),
                                       ({"confidence_threshold": -0.1}, r"confidence_threshold=-0.1 must be a number"),
                                       ({"confidence_threshold": "0.9"}, r"confidence_threshold='0.9'")])
def test_block_decoders_check_sampling_arguments(style, bad, match):
    kw = {"temperature": 0.0} if style == "llada2" else {}
    with pytest.raises(ValueError, match=match):
        block_diffusion_generate(_model_for(style), ["Copy: [a, b]"], gen_length=8, style=style, **{**kw, **bad})


def test_generate_never_overwrites_a_committed_token_on_sdar():
    """dllm.generate's samplers commit masked positions only, also where SDAR's own decoder overwrites (fewer steps
    than the block, several commits per step): every non-mask token of the canvas stays as it is at every later
    forward, and in the output."""
    from test_golden_sdar import sdar_integer

    import dllm
    from dllm.samplers import SAMPLERS

    m = sdar_integer(0)
    prompts = ["What is 12 + 30?", 'Please copy the list exactly: ["Ann Lee", "Bob Stone"]']
    canvases: list[torch.Tensor] = []
    handle = m.register_forward_pre_hook(lambda _m, args, kw: canvases.append((args[0] if args else kw["tokens"])
                                                                                .detach().clone()), with_kwargs=True)
    try:
        for name in SAMPLERS:
            if name in ("guided", "adablock"):  # the AR guide's tokenizer; delimiter ids of trained models
                continue
            canvases.clear()
            out = dllm.generate(m, prompts, gen_length=32, steps=8, sampler=name, cache="none", seed=2)
            final = torch.cat([canvases[0][:, :canvases[0].shape[1] - out.sequences.shape[1]], out.sequences], 1)
            seen = [c[:len(prompts)] for c in canvases] + [final]
            for a, b in zip(seen, seen[1:]):
                kept = a != m.mask_id
                assert torch.equal(a[kept], b[kept]), name
    finally:
        handle.remove()
