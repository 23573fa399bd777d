"""dllm against golden trajectories recorded from the LLaDA-family reference code.

Fixtures: ``tests/fixtures/golden/<reference>_<model>.json`` (schema in ``tests/golden_common.py``), written by
``benchmarks/golden/record_llada.py``. Each case is replayed with the dllm sampler / cache / settings that claim
to reproduce the reference, and must give the same generated ids, the same number of forwards and the same
positions committed after every forward (and, for dKV-Cache-Decode, the same recomputed rows).

Documented convention differences the comparison allows for (each still checked):

* exact ties (case field ``ties``): compared up to the first forward whose selection was a tie;
* forwards that commit nothing for a row in the reference -- Fast-dLLM and dInfer move a batch block by block
  in lockstep, dInfer unrolls ``maximum_unroll`` forwards before checking the block, and the June 2025
  Fast-dLLM cached generators run one more forward after a block their first forward decoded entirely: per
  row, the sequence of non-empty commits must agree (and for one row, our NFE is the reference's forwards
  that committed something);
* dInfer fills a finished row with EOS only once the batch's block is done: the fill is compared through the
  output, not per forward.
"""

from __future__ import annotations

import functools

import golden_common as gc
import golden_models as gm
import pytest
import torch

from dllm.samplers import get_sampler
from dllm.samplers.composed import ComposedSampler
from dllm.samplers.llada import LLaDASampler
from dllm.samplers.rules import Threshold
from dllm.samplers.transforms import CreditFusion

FIXTURES = sorted(p.stem for p in gc.FIXTURES.glob("*.json")) if gc.FIXTURES.exists() else []


@functools.cache
def _model(key):
    if key == "llada-tiny":
        import dllm
        import dllm.assets

        return dllm.load_model(str(dllm.assets.model_path("llada-tiny")), dtype="float32")
    family, seed = key
    return gm.shaped_model(family, seed)


def fixture_model(fx: dict):
    m = fx["model"]
    return _model(m if isinstance(m, str) else (m["shaped"], m["seed"]))


# ------------------------------------------------------------------------------------------- per reference
def llada_generate(params: dict):
    """LLaDA ``generate.py`` -> :class:`LLaDASampler` (softmax in the logits' dtype, noise over the canvas, the
    reference's EOS/EOT exclusion at temperature > 0)."""
    sampler = LLaDASampler(temperature=params["temperature"], remasking=params["remasking"],
                           logits_eos_inf=params.get("logits_eos_inf", False),
                           confidence_eos_eot_inf=params.get("confidence_eos_eot_inf", False), eos_eot_quirk=True,
                           softmax_dtype="model", noise_scope="canvas")
    kw = dict(gen_length=params["gen_length"], block_length=params["block_length"], steps=params["steps"],
              cfg_scale=params["cfg_scale"], seed=params.get("seed", 0))
    return sampler, "none", kw


def fastdllm(params: dict):
    """Fast-dLLM ``llada/generate.py`` -> presets ``threshold`` / ``factor`` (``quirk=True``: the reference's
    acceptance of the last candidate) / ``fast-dllm`` (threshold + dual cache) with the reference's float64
    softmax, or :class:`LLaDASampler` for its even quota; cache ``none`` / ``prefix`` / ``dual``. At
    temperature > 0 (no cache only) the rule is built by hand with ``noise_scope="canvas"``."""
    T, cache = params["temperature"], params["cache"]
    common = dict(temperature=T, softmax_dtype="float64", block_length=params["block_length"])
    if params["threshold"] is not None:
        if T > 0:
            sampler = ComposedSampler(Threshold(params["threshold"]), noise_scope="canvas", temperature=T,
                                      softmax_dtype="float64")
        elif cache == "dual":
            sampler, cache = get_sampler("fast-dllm", tau=params["threshold"], **common), None  # its own dual cache
        else:
            sampler = get_sampler("threshold", tau=params["threshold"], **common)
    elif params.get("factor") is not None:
        sampler = get_sampler("factor", factor=params["factor"], quirk=True, **common)
    else:
        sampler = LLaDASampler(temperature=T, remasking=params["remasking"], softmax_dtype="float64",
                               noise_scope="canvas")
    kw = dict(gen_length=params["gen_length"], block_length=params["block_length"], steps=params["steps"],
              seed=params.get("seed", 0))
    return sampler, cache, kw


def dkv_decode(params: dict):
    """dKV-Cache-Decode (LLaDA) -> the ``dkv`` preset (even quota + ``dkv-decode`` cache) with
    ``refresh_every = cache_reloading_step`` and the reference's float64 softmax."""
    sampler = get_sampler("dkv", refresh_every=params["cache_reloading_step"], softmax_dtype="float64",
                          temperature=params["temperature"], block_length=params["block_length"])
    kw = dict(gen_length=params["gen_length"], block_length=params["block_length"], steps=params["steps"])
    return sampler, None, kw


def dinfer(params: dict):
    """dInfer ``ThresholdParallelDecoder`` -> the ``threshold`` preset with dInfer's ``min(tau, max - 1e-5)``
    (``max_slack=1e-5``); ``CreditThresholdParallelDecoder`` -> the same rule with :class:`CreditFusion` (the
    ``credit`` preset's stages, built by hand because the preset has no ``max_slack``). float32 softmax;
    ``early_stop`` -> ``eos_early_stop``."""
    common = dict(temperature=params["temperature"], softmax_dtype="float32", block_length=params["block_length"])
    if params["decoder"] == "credit":
        fusion = CreditFusion(alpha=params["credit_alpha"], beta=params["decay_beta"], gamma=params["boost_gamma"])
        sampler = ComposedSampler(Threshold(params["threshold"], max_slack=1e-5), credit=fusion,
                                  temperature=params["temperature"], softmax_dtype="float32")
    else:
        sampler = get_sampler("threshold", tau=params["threshold"], max_slack=1e-5, **common)
    kw = dict(gen_length=params["gen_length"], block_length=params["block_length"],
              eos_early_stop=params["early_stop"])
    return sampler, "none", kw


MAPPINGS = {"llada-generate": llada_generate, "fastdllm": fastdllm, "fastdllm-2506": fastdllm, "dkv-decode": dkv_decode,
            "dinfer": dinfer}


def lockstep(name: str, case: dict) -> bool:
    """Cases whose reference runs forwards that commit nothing for a row: Fast-dLLM and dInfer move a batch
    block by block in lockstep (a row whose block is done waits for the others), and dInfer unrolls
    ``maximum_unroll`` forwards before it checks whether the block is done. dllm runs neither."""
    if name.startswith(("fastdllm", "dinfer")) and len(case["prompt_ids"]) > 1:
        return True
    if name.startswith("fastdllm-2506"):  # June 2025: the cached generators check for a finished block after
        return case["params"]["cache"] != "none"  # their forward, so a block done by its first forward gets one more
    return name.startswith("dinfer") and case["params"]["maximum_unroll"] > 1


def computed_rows(query_idx, shape, G: int) -> list[list[int]]:
    """Per row, the sorted generated-position offsets a forward computed (every one for a full forward)."""
    B, T = shape
    if query_idx is None:
        return [list(range(G))] * B
    P = T - G
    return [sorted({int(c) - P for c in row if int(c) >= P}) for row in query_idx]


def fill_starts(case: dict, eos_id: int) -> list[int]:
    """Per row, the end of the block holding the reference's first EOS (where its early-stop fill starts)."""
    bl = case["params"]["block_length"]
    out = []
    for row in case["output"]:
        first = row.index(eos_id) if eos_id in row else len(row)
        out.append(min(len(row), (first // bl + 1) * bl))
    return out


def per_row_commits(steps: list) -> list[list[list[int]]]:
    """Per row, the non-empty commits in forward order (the batch's idle forwards left out)."""
    return [[s[b] for s in steps if s[b]] for b in range(len(steps[0]))]


def _cases():
    out = []
    for name in FIXTURES:
        ref = name.split("_")[0]
        if ref not in MAPPINGS:
            continue
        for case in gc.load_fixture(name)["cases"]:
            out.append(pytest.param(name, case["id"], id=f"{name}-{case['id']}"))
    return out


CASES = _cases()


@functools.cache
def _fixture(name):
    return gc.load_fixture(name)


def test_fixtures_present():
    """The LLaDA-family fixtures exist (a missing file would silently drop its cases)."""
    names = set(FIXTURES)
    for ref in MAPPINGS:
        for model in ("llada-tiny", "shaped-llada"):
            assert f"{ref}_{model}" in names


@pytest.mark.parametrize("name,case_id", CASES)
def test_golden(name, case_id):
    fx = _fixture(name)
    case = next(c for c in fx["cases"] if c["id"] == case_id)
    model = fixture_model(fx)
    assert gc.state_sha256(model) == fx["weights_sha256"], "the fixture was recorded with other weights"
    sampler, cache, kw = MAPPINGS[name.split("_")[0]](case["params"])
    queries: list = []  # per forward: the rows dllm computed (query_idx, None for a full forward)
    handle = model.register_forward_pre_hook(
        lambda _m, args, kwargs: queries.append((kwargs.get("query_idx"), (args[0] if args else kwargs["tokens"]).shape)),
        with_kwargs=True)
    try:
        out, steps = gc.record_steps(model, case["prompt_ids"], sampler=sampler, cache=cache, **kw)
    finally:
        handle.remove()
    ties = case.get("ties", [])
    if lockstep(name, case):  # per row, the sequence of non-empty commits must agree
        ours, ref = per_row_commits(steps), per_row_commits(case["steps"])
        if name.startswith("dinfer") and case["params"]["early_stop"]:
            # dInfer fills a row's later blocks with EOS only when the whole batch's block is done: compare
            # the positions each row decoded itself (the fill is checked through the output)
            ends = fill_starts(case, model.eos_id)
            ours, ref = ([[[p for p in s if p < e] for s in row] for row, e in zip(x, ends)] for x in (ours, ref))
            ours, ref = ([[s for s in row if s] for row in x] for x in (ours, ref))
        assert ours == ref, f"per-row commits differ: ours {ours}, the reference {ref}"
    elif ties:  # compare up to the first forward whose selection was an exact tie (torch.topk's own order)
        first = ties[0]
        diverge = gc.first_divergence(steps[:first], case["steps"][:first])
        assert diverge is None, diverge
        assert [len(r) for r in steps[first]] == [len(r) for r in case["steps"][first]]
    else:
        diverge = gc.first_divergence(steps, case["steps"])
        assert diverge is None, diverge
    if "computed" in case:
        G = out.sequences.shape[1]
        ours = [computed_rows(q, shape, G) for q, shape in queries]
        diverge = gc.first_divergence(ours, case["computed"])
        assert diverge is None, "rows recomputed: " + diverge
    assert out.sequences.tolist() == case["output"]
    if not lockstep(name, case):
        assert out.stats.nfe == case["nfe"]
    elif len(case["prompt_ids"]) == 1:  # extra forwards: ours are the reference's that commit something
        assert out.stats.nfe == sum(1 for s in case["steps"] if s[0])
        if name.startswith("fastdllm-2506"):  # and each extra one follows a block's first forward that did it all
            bl = case["params"]["block_length"]
            for i, s in enumerate(case["steps"]):
                if not s[0]:
                    assert i > 0 and len(case["steps"][i - 1][0]) == bl, f"forward {i} commits nothing"


def test_recorder_sees_every_forward():
    """record_steps itself: a plain LLaDA run commits every generated position exactly once, one forward each."""
    model = gm.shaped_llada(0)
    prompts = gm.shaped_prompts("llada", [6], 0)
    out, steps = gc.record_steps(model, prompts, sampler=get_sampler("llada"), gen_length=8, steps=4, block_length=8)
    assert len(steps) == out.stats.nfe == 4
    flat = sorted(p for s in steps for p in s[0])
    assert flat == list(range(8)) and all(len(s[0]) == 2 for s in steps)
    assert not torch.equal(out.sequences, torch.full_like(out.sequences, model.mask_id))


@pytest.mark.parametrize("name", [n for n in FIXTURES if n.startswith("dinfer_")])
def test_credit_preset_on_dinfer_fixtures(name):
    """The ``credit`` preset (threshold without dInfer's ``max - 1e-5`` slack) commits what dInfer's credit
    decoder committed on these cases, forward by forward (the slack changes nothing here)."""
    fx = _fixture(name)
    model = fixture_model(fx)
    for case in fx["cases"]:
        p = case["params"]
        if p["decoder"] != "credit":
            continue
        sampler = get_sampler("credit", alpha=p["credit_alpha"], beta=p["decay_beta"], gamma=p["boost_gamma"],
                              tau=p["threshold"], block_length=p["block_length"])
        out, steps = gc.record_steps(model, case["prompt_ids"], sampler=sampler, cache="none",
                                     gen_length=p["gen_length"], block_length=p["block_length"], eos_early_stop=True)
        diverge = gc.first_divergence(steps, case["steps"])
        assert diverge is None, f"{case['id']}: {diverge}"
        assert out.stats.nfe == case["nfe"]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_shaped_models_make_mask_and_eos_matter(family):
    """The shaped random models do what the fixtures need: real vocabulary and special ids, p(mask) far from
    negligible at masked positions yet never the argmax, and EOS proposed at some of them."""
    model = gm.shaped_model(family, 0)
    vocab, mask, eos = (126464, 126336, 126081) if family == "llada" else (152064, 151666, 151643)
    assert (model.config.vocab_size, model.mask_id, model.eos_id) == (vocab, mask, eos)
    stops = 0
    for seed in range(3):
        prompt = gm.shaped_prompts(family, [14], seed)[0]
        x = torch.tensor([prompt + [mask] * 48])
        probs = model(x)[0, len(prompt):].float().softmax(-1)
        assert 1e-5 < float(probs[:, mask].median()) < 1e-2
        top = probs.argmax(-1)
        assert not bool((top == mask).any())
        assert len(set(top.tolist())) > 1
        stops += int(((top == model.eos_id) | (top == model.eot_id)).sum())
    assert stops >= 3  # EOS / EOT proposed at some of the 3 x 48 masked positions
    with pytest.raises(ValueError, match="unknown shaped family"):
        gm.shaped_model("gpt", 0)
