"""The code-execution sandbox: failures, infinite loops and memory hogs are contained and reported."""

import os
import time
from pathlib import Path

import pytest

from dllm.evals.sandbox import run_program
from dllm.evals.standard import get_standard_task, load_samples

FIXTURES = Path(__file__).parent / "fixtures" / "eval"


def test_passing_and_failing_programs():
    assert run_program("assert sum([1, 2]) == 3\n").status == "passed"
    r = run_program("assert 1 == 2\n")
    assert r.status == "failed" and not r.passed and "AssertionError" in r.detail
    r = run_program("def f(:\n")
    assert r.status == "failed" and "SyntaxError" in r.detail


def test_infinite_loop_is_killed():
    t0 = time.perf_counter()
    r = run_program("while True:\n    pass\n", timeout=1.5)
    assert r.status == "timeout" and not r.passed
    assert time.perf_counter() - t0 < 10


def test_blocking_program_is_killed_by_the_wall_clock():
    # a program that blocks (not burning CPU) is stopped by the wall-clock timeout all the same
    r = run_program("import time\ntime.sleep(60)\n", timeout=1.0)
    assert r.status == "timeout"


@pytest.mark.parametrize("hog", [
    "x = bytearray(8 * 1024 ** 3)\n",  # one huge allocation
    "xs = []\nwhile True:\n    xs.append(bytearray(50 * 1024 ** 2))\n",  # growing until the limit
])
def test_memory_hog_is_stopped(hog):
    r = run_program(hog, timeout=20, memory_mb=300)
    assert r.status == "memory" and not r.passed, r


def test_generated_code_never_runs_in_this_process(tmp_path):
    marker = tmp_path / "marker"
    r = run_program(f"import os\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\n")
    assert r.passed and int(marker.read_text()) != os.getpid()


def test_guard_blocks_destructive_calls(tmp_path):
    (tmp_path / "keep").mkdir()
    r = run_program(f"import shutil\nshutil.rmtree({str(tmp_path / 'keep')!r})\n")
    assert r.status == "failed" and "blocked" in r.detail
    assert (tmp_path / "keep").exists()
    assert run_program("import os\nos.system('true')\n").status == "failed"


def test_humaneval_and_mbpp_programs_from_fixtures():
    he = get_standard_task("humaneval")
    samples, _ = load_samples(he, str(FIXTURES / "humaneval.jsonl"))
    s = samples[1]  # needs the prompt's `from typing import List`
    body = s.row["canonical_solution"]
    assert he.score(s, body)["correct"]  # a completion of the body
    full = "```python\ndef total(xs: List[int]) -> int:\n    return sum(xs)\n```"
    assert he.score(s, full)["correct"]  # a whole function in a fence
    wrong = he.score(s, "    return 0\n")
    assert not wrong["correct"] and wrong["status"] == "failed"
    loop = he.score(s, "    while True:\n        pass\n", timeout=1.0)
    assert not loop["correct"] and loop["status"] == "timeout"

    mbpp = get_standard_task("mbpp")
    samples, _ = load_samples(mbpp, str(FIXTURES / "mbpp.jsonl"))
    assert all(mbpp.score(s, f"```python\n{s.row['code']}\n```")["correct"] for s in samples)
    assert not mbpp.score(samples[3], "[BEGIN]\ndef double(x):\n    return x\n[DONE]")["correct"]
