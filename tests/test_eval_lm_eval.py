"""The lm-eval adapter: a project-written task through lm_eval's own evaluator (generation and
log-likelihood), and the Monte-Carlo log-likelihood estimator against exact values."""

import itertools
import math
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from dllm.evals.standard.lm_eval_adapter import DLLMLM  # noqa: E402 - registers the `dllm` model

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "tests" / "fixtures" / "eval" / "lm_eval_tasks"


@pytest.fixture(scope="module")
def lm():
    return DLLMLM(pretrained="llada-tiny", gen_length=16, mc_num=8, mc_batch_size=4, device="cpu")


def test_simple_evaluate_generation_and_loglikelihood(monkeypatch, lm):
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(REPO)  # the task YAMLs name their data file relative to the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tm = TaskManager(include_path=str(TASKS), include_defaults=False)
    res = lm_eval.simple_evaluate(model=lm, tasks=["dllm_tiny_gen", "dllm_tiny_mc"], task_manager=tm,
                                  apply_chat_template=True, log_samples=True, bootstrap_iters=0)
    assert set(res["results"]) == {"dllm_tiny_gen", "dllm_tiny_mc"}
    assert 0.0 <= res["results"]["dllm_tiny_gen"]["exact_match,none"] <= 1.0
    assert 0.0 <= res["results"]["dllm_tiny_mc"]["acc,none"] <= 1.0
    gen = res["samples"]["dllm_tiny_gen"]
    assert len(gen) == 6
    for s in gen:
        out = s["resps"][0][0]
        assert "\n" not in out and "+" not in out  # the task's `until` strings end the answer
        a = s["arguments"]
        ctx = a[0][0] if isinstance(a, list) else a["gen_args_0"]["arg_0"]
        assert ctx.startswith("<|startoftext|><|start_header_id|>user")  # lm_eval applied our chat template
    mc = res["samples"]["dllm_tiny_mc"]
    assert len(mc) == 6
    for s in mc:
        lls = [float(r[0][0]) for r in s["resps"]]
        assert len(lls) == 4 and all(ll < 0 and math.isfinite(ll) for ll in lls)
    assert lm.stats["nfe"] > 0 and lm.stats["answer_tokens"] >= 0


def test_generate_until_cuts_at_until_and_keeps_order(lm):
    class Req:
        def __init__(self, *args):
            self.args = args

    ctx = lm.apply_chat_template([{"role": "user", "content": "Generate a 4x4 Latin square with the symbols A, B, C, D:"}])
    full = lm.generate_until([Req(ctx, {"until": []})])[0]
    assert full, "the tiny model answers something"
    stop = full[len(full) // 2]
    cut = lm.generate_until([Req(ctx + "", {"until": [stop]}), Req("short", {"until": ["\n"]})])
    assert cut[0] == full[: full.index(stop)]
    assert "\n" not in cut[1]


def _exact_elbo(lm, prefix, target):
    """The LLaDA bound E_k E_subset[(L/k) * sum of masked CE] by enumerating every mask subset."""
    L, P = len(target), len(prefix)
    seq = torch.tensor(prefix + target)
    total = 0.0
    for k in range(1, L + 1):
        subsets = list(itertools.combinations(range(L), k))
        acc = 0.0
        for sub in subsets:
            x = seq.clone()[None]
            for j in sub:
                x[0, P + j] = lm.model.mask_id
            logp = torch.log_softmax(lm._logits(x, P, torch.arange(P, P + L)[None])[0], -1)
            acc += -(L / k) * sum(float(logp[j, target[j]]) for j in sub)
        total += acc / len(subsets)
    return -total / L


def test_mc_loglikelihood_matches_exact_bound(lm):
    prefix = lm._encode(lm.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}]))
    one = lm._encode("5")[-1:]
    # one target token: every draw masks it, the estimate is exactly log p(token | prefix)
    exact1 = float(torch.log_softmax(lm._logits(torch.tensor([prefix + [lm.model.mask_id]]), len(prefix),
                                                torch.tensor([[len(prefix)]]))[0, 0], -1)[one[0]])
    assert lm.mc_loglikelihood(prefix, one, torch.Generator().manual_seed(0)) == pytest.approx(exact1, abs=1e-4)
    # three tokens: the stratified Monte-Carlo estimate converges to the enumerated bound
    target = lm._encode("123")[-3:] if len(lm._encode("123")) >= 3 else [10, 11, 12]
    exact = _exact_elbo(lm, prefix, target)
    old = lm.mc_num, lm.mc_batch_size
    lm.mc_num, lm.mc_batch_size = 600, 3
    try:
        est = lm.mc_loglikelihood(prefix, target, torch.Generator().manual_seed(1))
    finally:
        lm.mc_num, lm.mc_batch_size = old
    assert est == pytest.approx(exact, rel=0.03), (est, exact)


def test_cfg_and_greedy_options():
    cfg = DLLMLM(pretrained="llada-tiny", gen_length=16, mc_num=4, mc_batch_size=4, cfg_scale=1.0,
                 check_greedy=True, device="cpu")

    class Req:
        def __init__(self, *args):
            self.args = args

    (ll, greedy), = cfg.loglikelihood([Req("What is 2 + 3?", "5")])
    assert math.isfinite(ll) and isinstance(greedy, bool)
    with pytest.raises(ValueError, match="no sampler="):
        DLLMLM(pretrained="llada-tiny", threshold=0.9, device="cpu")
    with pytest.raises(NotImplementedError, match="loglikelihood_rolling"):
        cfg.loglikelihood_rolling([])


def test_dllm_lm_eval_command_forwards_to_lm_eval_with_dllm_registered(monkeypatch):
    import lm_eval.__main__ as lm_main
    from lm_eval.api.registry import get_model

    from dllm.cli import main

    seen = {}

    def fake_cli():
        import sys

        seen["argv"] = list(sys.argv)
        seen["model"] = get_model("dllm")

    monkeypatch.setattr(lm_main, "cli_evaluate", fake_cli)
    assert main(["lm-eval", "--model", "dllm", "--model_args", "pretrained=llada-tiny", "--tasks", "x"]) == 0
    assert seen["argv"] == ["lm-eval", "--model", "dllm", "--model_args", "pretrained=llada-tiny", "--tasks", "x"]
    assert seen["model"] is DLLMLM


@pytest.mark.parametrize("family", ["sdar", "fastdllm2"])
def test_block_diffusion_loglikelihood_with_blocks_of_one_is_autoregressive(tmp_path, family):
    """With blocks of one token the block-diffusion bound has one term per token, each the log-probability of
    the token given the clean ones before it: the exact autoregressive log-likelihood, whatever the draws. SDAR
    reads it from the masked position itself, Fast-dLLM v2 (token shift) from the clean row before."""
    import golden_models as gm

    from dllm.models.loading import save_pretrained

    model = (gm.sdar_tiny(0, block_size=1) if family == "sdar" else gm.fastdllm2_tiny(0, block_size=1))
    save_pretrained(model, tmp_path / "m")
    lm = DLLMLM(pretrained=str(tmp_path / "m"), mc_num=4, mc_batch_size=2, device="cpu", dtype="float32")
    prefix, target = [11, 23, 5, 40], [7, 19, 3]
    got = lm.mc_loglikelihood(prefix, target, torch.Generator().manual_seed(0))
    want = 0.0
    with torch.no_grad():
        for i, t in enumerate(target):
            if family == "sdar":  # the masked position, given the clean tokens before it
                x = torch.tensor([prefix + target[:i] + [model.mask_id]])
                logits = model(x)[0, -1]
            else:  # the shifted head: the clean sequence's prediction for the next column
                x = torch.tensor([prefix + target[:i + 1]])
                logits = model(x)[0, -1]
            want += float(torch.log_softmax(logits.float(), -1)[t])
    assert got == pytest.approx(want, abs=1e-4)
    assert lm.mc_loglikelihood(prefix, target, torch.Generator().manual_seed(1)) == pytest.approx(got, abs=1e-5)


def test_block_diffusion_loglikelihood_scores_each_block_given_clean_blocks(tmp_path):
    """Blocks of 4 on an SDAR-format model: the Monte-Carlo bound converges to the exact per-block bound (every
    mask count and subset of each block enumerated, earlier blocks clean), and is below the exact log-likelihood
    estimate's ceiling of 0."""
    import itertools as it

    import golden_models as gm

    from dllm.models.loading import save_pretrained

    model = gm.sdar_tiny(0, block_size=4)
    save_pretrained(model, tmp_path / "m")
    lm = DLLMLM(pretrained=str(tmp_path / "m"), mc_num=2048, mc_batch_size=256, device="cpu", dtype="float32")
    prefix, target = [11, 23, 5, 40, 9, 2], [7, 19, 3, 30, 8]  # columns 6..10: blocks 1 (6, 7) and 2 (8, 9, 10)
    seq = prefix + target
    exact = 0.0
    with torch.no_grad():
        for cols in ([6, 7], [8, 9, 10]):
            n = len(cols)
            for k in range(1, n + 1):
                subsets = list(it.combinations(cols, k))
                for sub in subsets:
                    x = torch.tensor([seq[:cols[-1] + 1]])
                    x[0, list(sub)] = model.mask_id
                    lp = torch.log_softmax(model(x)[0].float(), -1)
                    exact += sum(float(lp[c, seq[c]]) for c in sub) * (n / k) / n / len(subsets)
    got = lm.mc_loglikelihood(prefix, target, torch.Generator().manual_seed(0))
    assert got == pytest.approx(exact, rel=0.05) and got < 0


class _Request:
    def __init__(self, context: str, kwargs: dict):
        self.args = (context, kwargs)


def _chat(lm, text: str) -> str:
    return lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)


def test_a_request_decodes_as_alone_whatever_shares_its_batch():
    """A request's generation length is its own (a shorter ``max_gen_toks`` beside it shortened it), and identical
    contexts (lm-eval's repeats) draw their own samples, the same at any batch size."""
    alone = DLLMLM(pretrained="llada-tiny", gen_length=32, batch_size=1, device="cpu", dtype="float32")
    together = DLLMLM(pretrained="llada-tiny", gen_length=32, batch_size=2, device="cpu", dtype="float32")
    reverse = _Request(_chat(alone, 'Please reverse the order of the list:\n["Alice Adams", "Brian Baker", '
                                    '"Carol Carter"]'), {"until": [], "max_gen_toks": 32})
    short = _Request(_chat(alone, "What is 12 + 7?"), {"until": [], "max_gen_toks": 4})
    one = alone.generate_until([reverse, short])
    assert one == together.generate_until([reverse, short])
    assert one[0].startswith('["Carol Carter", "Brian Baker", "Alice Adams"]')  # its whole answer, not 4 tokens

    shuffle = _Request(_chat(alone, 'Please shuffle the list:\n["Alice Adams", "Brian Baker", "Carol Carter"]'),
                       {"until": []})
    kw = dict(pretrained="llada-tiny", sampler="llada", temperature=4.0, gen_length=16, device="cpu",
              dtype="float32")
    draws = {bs: DLLMLM(batch_size=bs, **kw).generate_until([shuffle] * 4) for bs in (1, 4)}
    assert draws[1] == draws[4]
    # with continuous batching (two rows at once, a finished row's place taken by the next request): the same
    assert DLLMLM(batch_size=2, continuous="true", **kw).generate_until([shuffle] * 4) == draws[1]
    cont = DLLMLM(pretrained="llada-tiny", gen_length=32, batch_size=2, continuous=True, device="cpu", dtype="float32")
    assert cont.generate_until([reverse, short, reverse]) == alone.generate_until([reverse, short, reverse])
    assert len(set(draws[1])) > 1  # each repeat draws anew
