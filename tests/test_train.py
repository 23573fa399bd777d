"""train-tiny: a few steps on a toy configuration write a checkpoint that loads and generates."""

from __future__ import annotations

import json

import pytest
import torch

import dllm
from dllm.train import TrainConfig, train


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_train_tiny_writes_a_loadable_checkpoint(tmp_path, family):
    torch.set_num_threads(1)
    cfg = TrainConfig(family=family, d_model=32, n_layers=1, n_heads=2, mlp_hidden=64, steps=3, batch_size=4,
                      examples_per_task=2, warmup=1)
    summary = train(cfg, tmp_path / "ckpt")
    assert summary["steps_done"] == 3 and summary["final_loss"] > 0
    hf = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert hf["model_type"] == ("llada" if family == "llada" else "Dream")
    model = dllm.load_model(tmp_path / "ckpt", dtype=torch.float32)
    assert model.shift_logits == (family == "dream")
    assert model.tokenizer.convert_ids_to_tokens(model.mask_id) == ("<|mdm_mask|>" if family == "llada" else "<|mask|>")
    out = dllm.generate(model, ["What is 1 + 2?"], gen_length=8, steps=8)
    assert out.sequences.shape == (1, 8) and isinstance(out.texts[0], str)
    # continuing from the checkpoint starts from its weights
    cont = train(TrainConfig(**{**cfg.__dict__, "steps": 1, "lr": 0.0, "init_from": str(tmp_path / "ckpt")}),
                 tmp_path / "cont")
    assert cont["steps_done"] == 1
    again = dllm.load_model(tmp_path / "cont", dtype=torch.float32)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6), n
