"""SDAR against its own code: logits of SDARForCausalLM (modeling_sdar.py) and trajectories of
``block_diffusion_generate`` (generate.py), recorded by ``benchmarks/golden/record_sdar.py`` on two random-weight
SDAR checkpoints, both built without a float-dependent step so that the fixtures hold on every CPU:
``golden_models.sdar_tiny`` (``sdar_sdar-tiny.json``) and :func:`sdar_integer` (``sdar_sdar-integer.json``: the
dynamic rule with fewer steps than the block, blocks of 8 and 16 with 4 steps, where the reference's top-k
overwrites decoded tokens in any block; prompt positions overwritten; committed mask tokens that leave a block masked after its last step, where the reference raises).
Checked: the same logits within 1e-5 (float32), and the same tokens, forward count and positions committed and
overwritten at every forward, greedy (``top_k=1``) and seeded sampling."""

from __future__ import annotations

import golden_common as gc
import golden_models as gm
import pytest
import torch

from dllm.blockdiff import UnfinishedBlockError, block_diffusion_generate

FX = gc.load_fixture("sdar_sdar-tiny")


def sdar_integer(seed: int = 0, block_size: int = 8):
    """A random-weight SDAR-format model built without a float-dependent step, for fixtures that hold on every
    CPU: every weight is a small integer times a power of two (``torch.randint``: the same draws on every CPU,
    where ``torch.randn``'s vectorised kernels differ between CPU capabilities), so the weights are bit-identical
    everywhere. EOS and the mask token are made contenders by an integer rule rather than from a forward's
    argmax: embedding column 0 holds the constant 4 and no layer writes feature 0 of the residual stream, so head
    column 0 acts as a per-token bias; it is 0 for every id but EOS (12) and the mask token (10), which then take
    a few percent of the probability at most positions (EOS ends rows, the mask token is sometimes sampled and
    committed). The architecture is :func:`golden_models.sdar_tiny`'s (QK norms, head_dim 24 with d_model 64,
    GQA 4/2, 2 layers) on the bundled Qwen-style tokenizer; the head is twice the other matrices' scale, so
    that top-k / temperature sampling gives confident proposals."""
    import dllm
    from dllm.models import Transformer, TransformerConfig
    from dllm.models.spec import SDAR

    tok_model = dllm.load_model("dream-tiny", dtype="float32")
    cfg = TransformerConfig(vocab_size=gm.TINY_VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            mlp_hidden=128, max_seq_len=512, rope_theta=10000.0, norm_eps=1e-6, head_size=24,
                            qk_norm=True, block_size=block_size)
    g = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        m = Transformer(cfg, SDAR)
    with torch.no_grad():
        for name, p in m.named_parameters():  # sorted order is the module's own (fixed)
            if "norm" in name:  # 1 + [-22, 22] / 128
                p.copy_(1 + torch.randint(-22, 23, p.shape, generator=g).float() * 2.0 ** -7)
            else:  # [-45, 45] / 128 (std about 0.2); residual outputs [-22, 22] / 128; the head twice that
                r = 22 if name.endswith(("o.weight", "down.weight")) else 45
                scale = 2.0 ** (-6 if name == "head.weight" else -7)
                p.copy_(torch.randint(-r, r + 1, p.shape, generator=g).float() * scale)
        m.embed.weight[:, 0] = 4.0  # the constant feature
        for layer in m.layers:
            layer.o.weight[0] = 0.0
            layer.down.weight[0] = 0.0
        m.norm.weight[0] = 1.0
        m.head.weight[:, 0] = 0.0
        m.head.weight[tok_model.eos_id, 0] = 12.0
        m.head.weight[tok_model.mask_id, 0] = 10.0
    m.tokenizer = tok_model.tokenizer
    m.mask_id, m.eos_id, m.pad_id, m.eot_id = tok_model.mask_id, tok_model.eos_id, tok_model.pad_id, tok_model.eot_id
    return m.eval().requires_grad_(False)


FIXTURES = {"tiny": FX, "integer": gc.load_fixture("sdar_sdar-integer")}
BUILDERS = {"tiny": gm.sdar_tiny, "integer": sdar_integer}
CASES = [(name, c["id"]) for name, fx in FIXTURES.items() for c in fx["cases"]]


_models: dict = {}


def _model(name: str):
    if name not in _models:
        fx = FIXTURES[name]
        m = BUILDERS[name](fx["model"]["seed"])
        assert gc.state_sha256(m) == fx["weights_sha256"], "the fixture was recorded with other weights"
        _models[name] = m
    return _models[name]


@pytest.mark.parametrize("name,i", [(n, i) for n, fx in FIXTURES.items() for i in range(len(fx["logits"]))])
def test_logits_equal_sdars_model_code(name, i):
    rec = FIXTURES[name]["logits"][i]
    want = gc.decode_logits(rec)
    got = _model(name)(torch.tensor([rec["input_ids"]]), block_size=rec["block_length"])[0]
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5


def _ours(trace: list[dict], P: int) -> list[dict]:
    return [{"kind": "prefill" if f["block"] is None else ("store" if f["store"] else "denoise"), "block": f["block"],
             "committed": sorted(c - P for c in f["committed"]),
             "overwritten": sorted(c - P for c in f.get("overwritten", []))} for f in trace]


def _theirs(forwards: list[dict]) -> list[dict]:
    return [{"kind": f["kind"], "block": f["block"], "committed": sorted(f["committed"]),
             "overwritten": sorted(f.get("overwritten", []))} for f in forwards]


@pytest.mark.parametrize("name,case_id", CASES)
def test_block_diffusion_generate_matches_sdars_decoder(name, case_id):
    model = _model(name)
    case = next(c for c in FIXTURES[name]["cases"] if c["id"] == case_id)
    P = len(case["prompt_ids"][0])
    if "error" in case:  # the reference raised IndexError after one more denoising forward over the block
        with pytest.raises(UnfinishedBlockError, match="still holds") as err:
            block_diffusion_generate(model, case["prompt_ids"], chat_template=False, **case["params"])
        e = err.value
        assert case["error"].startswith("IndexError")
        extra = case["forwards"][-1]
        assert extra["kind"] == "denoise" and extra["block"] == e.block and not extra["committed"]
        assert _ours(e.trace, P) == _theirs(case["forwards"][:-1]) and e.nfe == case["nfe"] - 1
        start, tokens = case["last_block"]["start"], case["last_block"]["tokens"]
        assert e.masks == [P + start + j for j, t in enumerate(tokens) if t == model.mask_id]
        assert e.sequence[max(start, 0):start + len(tokens)] == tokens[max(-start, 0):]
        assert e.row == 0 and f"block {e.block} still holds" in str(e) and "IndexError" in str(e)
        return
    out = block_diffusion_generate(model, case["prompt_ids"], chat_template=False, **case["params"])
    assert out.sequences[0] == case["output"][0]
    assert out.nfe[0] == case["nfe"]
    assert _ours(out.trace[0], P) == _theirs(case["forwards"])


def test_fixture_covers_every_strategy_with_mask_and_eos_in_play():
    cases = [c for fx in FIXTURES.values() for c in fx["cases"]]
    rules = {c["params"]["remasking"] for c in cases}
    assert rules == {"low_confidence_dynamic", "low_confidence_static", "sequential"}
    assert any(c["params"]["top_k"] == 1 for c in cases) and any(c["params"]["top_k"] != 1 for c in cases)
    # several commits in one forward happen (the dynamic rule) and some rows stop early at EOS
    assert any(len(f["committed"]) > 1 for c in cases for f in c["forwards"])
    for fx in FIXTURES.values():
        eos = fx["cases"][0]["params"]["stop_ids"][0]
        assert any(eos in c["output"][0] for c in fx["cases"] if "output" in c)


def test_integer_fixture_covers_overwrites_in_later_blocks_and_unfinished_blocks():
    """The reference's top-k writes over decoded tokens of blocks after the first with the dynamic rule (blocks
    of 8 and of 16 with 4 steps), over prompt positions, and a committed mask token leaves a block masked."""
    cases = FIXTURES["integer"]["cases"]

    def later_overwrites(bl):
        return [c["id"] for c in cases if c["params"]["block_length"] == bl and c["params"]["denoising_steps"] == 4
                and c["params"]["remasking"] == "low_confidence_dynamic"
                for f in c["forwards"] if f["overwritten"] and f["block"] > min(
                    g["block"] for g in c["forwards"] if g["block"] is not None)]

    assert len(later_overwrites(8)) >= 2 and len(later_overwrites(16)) >= 2
    assert any(p < 0 for c in cases for f in c["forwards"] for p in f["overwritten"])  # prompt tokens
    assert sum("error" in c for c in cases) >= 2


def test_an_unfinished_block_names_its_row_in_a_batch():
    """The error names the row of the batch that ran into it; the rows before it decode as alone."""
    cases = {c["id"]: c for c in FIXTURES["integer"]["cases"]}
    bad, good = cases["p1_static_b4_s1"], cases["p2_static_b4_s1"]
    assert "error" in bad and "error" not in good and bad["params"] == good["params"]
    with pytest.raises(UnfinishedBlockError) as err:
        block_diffusion_generate(_model("integer"), good["prompt_ids"] + bad["prompt_ids"], chat_template=False,
                                 **bad["params"])
    assert err.value.row == 1 and str(err.value).startswith(f"row 1: block {err.value.block} still holds")
