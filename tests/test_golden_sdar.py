"""SDAR against its own code: logits of SDARForCausalLM (modeling_sdar.py) and trajectories of
``block_diffusion_generate`` (generate.py), recorded by ``benchmarks/golden/record_sdar.py`` on the random-weight
SDAR checkpoint of ``golden_models.sdar_tiny``: the same logits within 1e-5 (float32), and the same tokens,
forward count and positions committed at every forward, greedy (``top_k=1``) and seeded sampling."""

from __future__ import annotations

import golden_common as gc
import golden_models as gm
import pytest
import torch

from dllm.blockdiff import block_diffusion_generate

FX = gc.load_fixture("sdar_sdar-tiny")


@pytest.fixture(scope="module")
def model():
    m = gm.sdar_tiny(FX["model"]["seed"])
    assert gc.state_sha256(m) == FX["weights_sha256"], "the fixture was recorded with other weights"
    return m


@pytest.mark.parametrize("i", range(len(FX["logits"])))
def test_logits_equal_sdars_model_code(model, i):
    rec = FX["logits"][i]
    want = gc.decode_logits(rec)
    got = model(torch.tensor([rec["input_ids"]]), block_size=rec["block_length"])[0]
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("case_id", [c["id"] for c in FX["cases"]])
def test_block_diffusion_generate_matches_sdars_decoder(model, case_id):
    case = next(c for c in FX["cases"] if c["id"] == case_id)
    p = case["params"]
    out = block_diffusion_generate(model, case["prompt_ids"], chat_template=False, **p)
    P = len(case["prompt_ids"][0])
    assert out.sequences[0] == case["output"][0]
    assert out.nfe[0] == case["nfe"]
    ours = [{"kind": "prefill" if f["block"] is None else ("store" if f["store"] else "denoise"),
             "block": f["block"], "committed": [c - P for c in f["committed"]]} for f in out.trace[0]]
    theirs = [{**f, "committed": sorted(f["committed"])} for f in case["forwards"]]
    assert [{**f, "committed": sorted(f["committed"])} for f in ours] == theirs


def test_fixture_covers_every_strategy_with_mask_and_eos_in_play():
    rules = {c["params"]["remasking"] for c in FX["cases"]}
    assert rules == {"low_confidence_dynamic", "low_confidence_static", "sequential"}
    assert any(c["params"]["top_k"] == 1 for c in FX["cases"]) and any(c["params"]["top_k"] != 1 for c in FX["cases"])
    # several commits in one forward happen (the dynamic rule) and some rows stop early at EOS
    assert any(len(f["committed"]) > 1 for c in FX["cases"] for f in c["forwards"])
    eos = FX["cases"][0]["params"]["stop_ids"][0]
    assert any(eos in c["output"][0] for c in FX["cases"])
