"""Any Hugging Face model that returns logits works with every sampler, without caches."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, ModernBertConfig, ModernBertForMaskedLM

import dllm
from dllm.models.hf import HFModel
from dllm.samplers import SAMPLERS

V = 64


def bert():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=128)
    return HFModel(BertForMaskedLM(cfg).eval(), mask_id=V - 1, eos_id=2, pad_id=0)


def modernbert():
    torch.manual_seed(0)
    cfg = ModernBertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=128, pad_token_id=0, eos_token_id=2,
                           bos_token_id=1, cls_token_id=1, sep_token_id=2)
    return HFModel(ModernBertForMaskedLM(cfg).eval(), mask_id=V - 1, eos_id=2, pad_id=0)


CASES = [("bert", name) for name in sorted(SAMPLERS)] + [("modernbert", "llada"), ("modernbert", "dream")]


@pytest.mark.parametrize(("arch", "name"), CASES)
def test_every_sampler_runs_on_wrapped_hf_model(arch, name):
    model = bert() if arch == "bert" else modernbert()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    out = dllm.generate(model, prompts, gen_length=8, block_length=4, steps=8, sampler=name)
    assert out.sequences.shape == (2, 8)
    assert not (out.sequences == model.mask_id).any()
    assert out.stats.nfe >= 2


@pytest.mark.parametrize("make", [bert, modernbert], ids=["bert", "modernbert"])
def test_wrapped_model_is_batch_invariant(make):
    model = make()
    batch = dllm.generate(model, [[5, 6, 7], [8, 9, 10, 11, 12]], gen_length=8, steps=8)
    alone = dllm.generate(model, [[8, 9, 10, 11, 12]], gen_length=8, steps=8)
    assert torch.equal(batch.sequences[1], alone.sequences[0])
    # continuous batching (one row at a time here, rows of other lengths joining): the same rows
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18]]
    whole = dllm.generate(model, prompts, gen_length=8, block_length=4, sampler="fast-dllm")
    for rows in (1, 3):
        out = dllm.generate(model, prompts, gen_length=8, block_length=4, sampler="fast-dllm", max_rows=rows)
        assert torch.equal(whole.sequences, out.sequences) and whole.stats.commit_step == out.stats.commit_step


def test_wrapped_model_rejects_caches():
    class FakeCache:
        name = "dual"

        def reset(self, *a):
            pass

    with pytest.raises(ValueError, match="supports no caches"):
        dllm.generate(bert(), [[5, 6, 7]], gen_length=8, cache=FakeCache())


def test_wrapped_model_needs_mask_id():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    with pytest.raises(ValueError, match="mask token id"):
        HFModel(BertForMaskedLM(cfg))


def test_from_pretrained_loads_a_local_checkpoint_silently(tmp_path, capfd):
    """``HFModel.from_pretrained``: a saved masked LM and its tokenizer from a local directory (special ids from the
    tokenizer), the same logits as the model saved, string prompts decoded; nothing printed (no progress bar)."""
    from transformers import BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(V - 5)]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    tok = BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"))
    saved = bert().hf
    saved.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    capfd.readouterr()
    model = HFModel.from_pretrained(tmp_path / "ckpt")
    assert capfd.readouterr() == ("", "")
    assert (model.mask_id, model.eos_id, model.pad_id) == (4, 3, 0)  # [MASK]; [SEP] stands in for EOS; [PAD] is 0
    ids = torch.tensor([[2, 7, 8, 9, 3]])
    torch.testing.assert_close(model(ids), saved(input_ids=ids).logits, rtol=0, atol=0)
    out = dllm.generate(model, [[7, 8, 9]], gen_length=8, block_length=4, steps=8)
    assert out.sequences.shape == (1, 8) and not (out.sequences == 4).any()
