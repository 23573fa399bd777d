"""LLaDA2.x against its own code: logits of LLaDA2MoeModelLM (the Hugging Face ``modeling_llada2_moe.py``) and
trajectories of its ``generate``, recorded by ``benchmarks/golden/record_llada2.py`` on the random-weight
LLaDA2-format checkpoint of ``golden_models.llada2_tiny`` (fused QKV, QK norms, partial rotary, a dense layer,
then routed experts with an expert bias and a shared expert): the same logits (float32, within 1e-5 of each
position's largest |logit|, ``golden_common.LOGITS_RTOL``), and the same tokens, forward count and positions committed
at every forward, greedy and seeded sampling, with ``generate``'s ``eos_early_stop`` and ``minimal_topk``."""

from __future__ import annotations

import golden_common as gc
import golden_models as gm
import pytest
import torch

from dllm.blockdiff import block_diffusion_generate

FX = gc.load_fixture("llada2_llada2-tiny")


@pytest.fixture(scope="module")
def model():
    m = gm.llada2_tiny(FX["model"]["seed"])
    assert gc.state_sha256(m) == FX["weights_sha256"], "the fixture was recorded with other weights"
    return m


@pytest.mark.parametrize("i", range(len(FX["logits"])))
def test_logits_equal_llada2s_model_code(model, i):
    rec = FX["logits"][i]
    want = gc.decode_logits(rec)
    got = model(torch.tensor([rec["input_ids"]]), block_size=rec["block_length"])[0]
    gc.assert_logits_close(got, want)


def _cut_after_eos(seq: list[int], eos: int) -> list[int]:
    return seq[: seq.index(eos) + 1] if eos in seq else seq


@pytest.mark.parametrize("case_id", [c["id"] for c in FX["cases"]])
def test_llada2_style_decoding_matches_llada2s_generate(model, case_id):
    case = next(c for c in FX["cases"] if c["id"] == case_id)
    p = case["params"]
    out = block_diffusion_generate(model, case["prompt_ids"], chat_template=False, style="llada2",
                                   gen_length=p["gen_length"], block_length=p["block_length"],
                                   denoising_steps=p["steps"], confidence_threshold=p["threshold"],
                                   temperature=p["temperature"], top_k=p["top_k"], top_p=p["top_p"], seed=p["seed"],
                                   stop_ids=[p["eos_id"]], eos_early_stop=p.get("eos_early_stop", False),
                                   minimal_topk=p.get("minimal_topk"))
    P = len(case["prompt_ids"][0])
    assert _cut_after_eos(out.sequences[0], p["eos_id"]) == case["output"][0]
    assert out.nfe[0] == case["nfe"]
    assert [sorted(c - P for c in f["committed"]) for f in out.trace[0]] == case["forwards"]


def test_fixture_exercises_eos_early_stop_and_minimal_topk():
    cases = {c["id"]: c for c in FX["cases"]}
    early = [c for c in FX["cases"] if c["params"].get("eos_early_stop")]
    # a row ended by the early return: fewer forwards than the same run without it, same tokens
    assert any(cases[c["id"].replace("_stop_", "_keep_")]["nfe"] > c["nfe"] for c in early
               if c["id"].replace("_stop_", "_keep_") in cases)
    # ... and one ended by a stop token in the canvas past gen_length (more than gen_length tokens)
    assert any(len(c["output"][0]) > c["params"]["gen_length"] for c in early)
    # minimal_topk caps the forwards per block below denoising_steps (the default 1 too, when gen_length is short)
    capped = [c for c in FX["cases"] if "minimal_topk" in c["params"]
              and c["params"]["gen_length"] // c["params"]["minimal_topk"] < c["params"]["steps"]]
    assert {c["params"]["minimal_topk"] for c in capped} >= {1, 2, 4}


def test_fixture_exercises_routing_eos_and_several_commits_per_forward(model):
    eos = FX["cases"][0]["params"]["eos_id"]
    assert any(eos in c["output"][0] for c in FX["cases"])
    assert any(len(f) > 1 for c in FX["cases"] for f in c["forwards"])
    assert any(c["params"]["temperature"] > 0 for c in FX["cases"])
    # the routing really varies: different tokens go to different experts, and the expert bias matters
    moe = model.layers[1].moe
    x = torch.randn(64, model.config.d_model, generator=torch.Generator().manual_seed(0))
    idx, _ = moe.route(x)
    assert len(set(idx.flatten().tolist())) == model.config.n_experts
    bias = moe.expert_bias.clone()
    try:
        moe.expert_bias.zero_()
        assert not torch.equal(moe.route(x)[0], idx)
    finally:
        moe.expert_bias.copy_(bias)
