"""Block-diffusion training of the tiny SDAR / LLaDA2 checkpoints (dllm.tiny.block): the two-copy forward sees
what decoding sees, upcycling starts from the dense model exactly, and a short run writes a checkpoint that loads
and decodes with the exact block cache."""

from __future__ import annotations

import json

import pytest
import torch

import dllm
from dllm.assets import ASSETS
from dllm.blockdiff import two_copy_inputs
from dllm.models.spec import SPECS
from dllm.models.transformer import Transformer
from dllm.models.weights import init_weights
from dllm.tiny import block
from dllm.tiny.train import TrainConfig, train


def _model(family, seed=0, block_size=4):
    cfg = block.model_config(family, vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=48,
                             tie_embeddings=False, block_size=block_size)
    torch.manual_seed(seed)
    m = Transformer(cfg, SPECS[family])
    init_weights(m, std=0.3)
    return m.eval()


@pytest.mark.parametrize("family", ["sdar", "llada2", "fastdllm2"])
def test_two_copy_forward_equals_the_decoding_view_of_every_block(family):
    """Each noisy block's logits in the training forward equal a block-diffusion forward over the clean blocks
    before it followed by that noisy block, which is what the decoder computes for it (left padding included)."""
    m = _model(family)
    shift = m.shift_logits
    assert shift == (family == "fastdllm2")
    bs = m.config.block_size
    g = torch.Generator().manual_seed(1)
    B, L, P = 2, 15, 5
    clean = torch.randint(1, 50, (B, L), generator=g)
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[1, :2] = False  # row 1 is left-padded by two
    noisy = clean.clone()
    noisy[:, P:] = torch.where(torch.rand(B, L - P, generator=g) < 0.5, torch.zeros_like(clean[:, P:]), clean[:, P:])
    with torch.no_grad():
        logits = m(**two_copy_inputs(noisy, clean, valid, bs, P, shift))
        pos = (valid.long().cumsum(1) - 1).clamp_min(0)
        for b in range(B):
            real = valid[b].nonzero().flatten()
            for c in range(P, L):
                blk = int(pos[b, c]) // bs
                in_blk = real[(pos[b, real] // bs) == blk]
                before = real[(pos[b, real] // bs) < blk]
                cols = torch.cat([before, in_blk])
                toks = torch.cat([clean[b, before], noisy[b, in_blk]])[None]
                if shift and c == int(in_blk[0]):  # first of its block: from the clean block before
                    ref = m(clean[b, real][None], positions=pos[b, real][None])[0, (real == c).nonzero()[0, 0]]
                else:
                    full = m(toks, positions=pos[b, cols][None])[0]
                    ref = full[(cols == c).nonzero()[0, 0]]
                torch.testing.assert_close(logits[b, c - P], ref, atol=1e-5, rtol=1e-5)


def test_block_mask_draws_one_ratio_per_block():
    valid = torch.ones(3, 40, dtype=torch.bool)
    valid[0, :3] = False
    masked, t = block.block_mask(valid, 8, 4, 1e-3, torch.Generator().manual_seed(0))
    pos = (valid.long().cumsum(1) - 1).clamp_min(0)[:, 8:]
    assert masked.shape == t.shape == (3, 32)
    for b in range(3):
        for k in set((pos[b] // 4).tolist()):
            ratios = t[b][pos[b] // 4 == k]
            assert torch.all(ratios == ratios[0])  # one ratio per block
    assert len(set(t[1].tolist())) > 4 and float(t.min()) >= 1e-3


def test_upcycled_moe_layer_starts_as_the_dense_mlp():
    dense_cfg = block.model_config("sdar", vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                                   mlp_hidden=48, tie_embeddings=False)
    from dataclasses import replace

    dense_cfg = replace(dense_cfg, qk_norm=False, block_size=None)
    torch.manual_seed(0)
    dense = Transformer(dense_cfg, SPECS["dream"])
    init_weights(dense, std=0.3)
    with pytest.raises(ValueError, match="width"):
        bad = block.model_config("llada2", vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                                 mlp_hidden=64, tie_embeddings=False)
        block.upcycle_dense(Transformer(bad, SPECS["llada2"]), dense.state_dict(), noise=0.0)
    moe = Transformer(block.model_config("llada2", vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                                         mlp_hidden=48, tie_embeddings=False), SPECS["llada2"])
    block.upcycle_dense(moe, dense.state_dict(), noise=0.0)
    d1, m1 = dense.layers[1], moe.layers[1]
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        torch.testing.assert_close(m1.moe(x), d1.down(torch.nn.functional.silu(d1.gate(x)) * d1.up(x)))
        assert torch.equal(moe.layers[0].gate.weight, dense.layers[0].gate.weight)  # the dense first layer
        q, k, v = dense.layers[0].q.weight, dense.layers[0].k.weight, dense.layers[0].v.weight
        assert torch.equal(moe.layers[0].qkv.weight, torch.cat([q, k, v]))
        assert torch.equal(moe.embed.weight, dense.embed.weight)
    # with noise the experts differ from one another (they can specialise)
    block.upcycle_dense(moe, dense.state_dict(), noise=0.01)
    e = moe.layers[1].moe.experts
    assert not torch.equal(e[0].gate.weight, e[1].gate.weight)


@pytest.mark.parametrize("family", ["sdar", "llada2", "fastdllm2"])
def test_train_block_family_from_the_ar_model(tmp_path, family):
    torch.set_num_threads(1)
    ar = ASSETS / "ar-tiny"
    ar_cfg = json.loads((ar / "config.json").read_text())
    cfg = TrainConfig(family=family, d_model=ar_cfg["hidden_size"], n_layers=ar_cfg["num_hidden_layers"],
                      n_heads=ar_cfg["num_attention_heads"], mlp_hidden=ar_cfg["intermediate_size"], steps=2,
                      batch_size=4, examples_per_task=2, warmup=1, tie_embeddings=True, init_from_ar=str(ar),
                      list_item_tokens=True, block_size=8)
    summary = train(cfg, tmp_path / "ckpt")
    assert summary["steps_done"] == 2 and summary["final_loss"] > 0
    hf = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert hf["model_type"] == SPECS[family].model_type
    assert hf["bd_size" if family == "fastdllm2" else "block_size"] == 8
    model = dllm.load_model(tmp_path / "ckpt", dtype=torch.float32)
    assert model.config.block_size == 8 and model.tokenizer.convert_ids_to_tokens(model.mask_id) == "<|mask|>"
    a = dllm.generate(model, ["Please copy the list exactly: [a, b]"], gen_length=16, steps=16)
    b = dllm.generate(model, ["Please copy the list exactly: [a, b]"], gen_length=16, steps=16, cache="none")
    assert torch.equal(a.sequences, b.sequences)  # the exact block cache (the default here) changes nothing
    # continuing from the checkpoint (its loaded config names the head size) starts from its weights
    cont = train(TrainConfig(**{**cfg.__dict__, "steps": 1, "lr": 0.0, "init_from": str(tmp_path / "ckpt"),
                                "init_from_ar": None}), tmp_path / "cont")
    assert cont["steps_done"] == 1
    again = dllm.load_model(tmp_path / "cont", dtype=torch.float32)
    for (n, x), (_, y) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.allclose(x, y, atol=1e-6), n


def test_block_size_only_for_block_families(tmp_path):
    with pytest.raises(ValueError, match="block-diffusion families"):
        train(TrainConfig(family="llada", d_model=32, n_layers=1, n_heads=2, mlp_hidden=64, steps=1, batch_size=2,
                          examples_per_task=2, block_size=4), tmp_path / "x")
