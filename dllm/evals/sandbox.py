"""Run untrusted generated code in a separate, resource-limited process.

Generated programs never run in the evaluating process: :func:`run_program` writes the program to a fresh
temporary directory and runs it with a separate Python interpreter (``python -I``, isolated mode) in its own
session, under ``resource.setrlimit`` limits set in the child before ``exec``: address space
(``memory_mb``), CPU seconds, file size, core dumps. A wall-clock ``timeout`` kills the child's whole
process group. A small guard prepended to the program disables the most destructive calls (killing
processes, removing trees, ``os.system``, ``subprocess``) — this is a safety net against accidents, not a
security boundary; run untrusted benchmarks in a container as well.

POSIX only (Linux, macOS).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["SandboxResult", "run_program"]

_GUARD = """\
import builtins as _b, os as _os, shutil as _sh, subprocess as _sp
def _dllm_blocked(*a, **k):
    raise PermissionError("blocked by the dllm evaluation sandbox")
for _name in ("kill", "killpg", "system", "fork", "forkpty", "putenv", "unsetenv", "removedirs", "rmdir",
              "chroot", "setuid", "setgid"):
    if hasattr(_os, _name):
        setattr(_os, _name, _dllm_blocked)
_sh.rmtree = _sh.move = _sh.chown = _dllm_blocked
_sp.Popen = _sp.run = _sp.call = _sp.check_call = _sp.check_output = _dllm_blocked
del _b, _os, _sh, _sp, _name
"""


@dataclass
class SandboxResult:
    status: str  # "passed" | "failed" | "timeout" | "memory" | "error"
    passed: bool
    returncode: int | None
    detail: str  # last lines of stderr, or why the run was stopped
    seconds: float


def _limits(memory_mb: int, cpu_s: int):
    def apply():  # runs in the child between fork and exec
        import resource

        mem = int(memory_mb) * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024 * 1024, 64 * 1024 * 1024))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_program(program: str, *, timeout: float = 10.0, memory_mb: int = 1024, guard: bool = True) -> SandboxResult:
    """Run ``program`` (Python source) in a sandboxed subprocess.

    Returns ``passed`` when it exits with status 0; ``timeout`` when it runs past ``timeout`` seconds of wall
    time (or its CPU limit); ``memory`` when it hits the ``memory_mb`` address-space limit (``MemoryError``
    or killed); ``failed`` for any other non-zero exit (assertion, exception, syntax error).
    """
    if os.name != "posix":
        raise RuntimeError("the code-execution sandbox needs a POSIX system (resource limits, process groups)")
    if timeout <= 0 or memory_mb <= 0:
        raise ValueError(f"timeout and memory_mb must be positive, got {timeout}, {memory_mb}")
    import time

    source = (_GUARD if guard else "") + program
    with tempfile.TemporaryDirectory(prefix="dllm-sandbox-") as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "PYTHONHASHSEED": "0",
               "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-I", "-B", path], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=_limits(memory_mb, max(1, int(timeout) + 1)))
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return SandboxResult("timeout", False, None, f"killed after {timeout:g} s wall time",
                                 time.perf_counter() - t0)
        secs = time.perf_counter() - t0
    rc = proc.returncode
    tail = "\n".join(err.decode("utf-8", "replace").strip().splitlines()[-5:])
    if rc == 0:
        return SandboxResult("passed", True, rc, "", secs)
    if "MemoryError" in tail or rc in (-signal.SIGKILL, -signal.SIGSEGV) and "Error" not in tail:
        return SandboxResult("memory", False, rc, tail or f"killed by signal {-rc}", secs)
    if rc == -signal.SIGXCPU:
        return SandboxResult("timeout", False, rc, "CPU time limit", secs)
    return SandboxResult("failed", False, rc, tail, secs)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
