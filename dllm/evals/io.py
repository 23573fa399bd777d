"""One resumable, content-keyed JSONL store for evaluation results (``dllm eval`` and ``dllm parallelbench run``).

* **Incremental.** Results are appended one line at a time and flushed, so a killed run loses at most the line
  being written; a torn last line is ignored when read and cut off before the next append. Several processes
  append to shard files of their own (``samples.rank{R}.jsonl``), which the main process merges.
* **Keyed by content.** Every line carries ``key``: :func:`content_key` of the content of the record it scores
  (prompt, reference, tests, ...) and of the decode configuration that produced it. On resume a line counts as
  done only when its key is the key its record has now: a record rewritten since is recomputed and its stale
  line dropped (:meth:`JsonlStore.current`). Lines without a key (older runs) count as stale.
* **Configuration pinned.** The decode configuration of a directory is pinned in its ``run.json``;
  :func:`check_pinned` refuses a run with another one, naming the fields that differ and the fix (another
  output directory, or ``overwrite``, which discards the old results: :meth:`JsonlStore.clear`).
  :func:`read_run_file` reads it (a malformed file is a ``ValueError`` naming it) and :func:`pinned_state` says
  what a run does with the directory, without touching it, so a command can check before loading its model.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
from collections.abc import Callable, Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["ConfigChanged", "JsonlStore", "check_pinned", "content_key", "pinned_state", "read_lines", "read_run_file",
           "repair"]


def content_key(*parts: Any) -> str:
    """A short stable hash of JSON-serialisable ``parts`` (dict order does not matter; tuples hash as lists)."""
    text = json.dumps(parts, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


class ConfigChanged(ValueError):
    """A run's configuration differs from the one pinned in its output directory."""


def check_pinned(old: Mapping, new: Mapping, where: str | Path, *, what: str = "decode settings") -> None:
    """Raise :class:`ConfigChanged` naming every key whose value differs between ``old`` and ``new`` (nested
    dicts are compared key by key: ``data.style``)."""
    old, new = _flat(old), _flat(new)
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if diff:
        changes = "; ".join(f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in diff)
        raise ConfigChanged(f"{where} holds results made with different {what} ({changes}); use another --out "
                            "directory, the same settings to resume, or --overwrite to discard those results")


def pinned_state(old: Mapping | None, new: Mapping, where: str | Path, *, overwrite: bool,
                 what: str = "decode settings") -> str | None:
    """What a run with ``new`` does with a directory whose run file pinned ``old`` (``None``: no run file):
    ``None`` (no earlier run), ``"resume"`` (the same settings) or ``"discard"`` (other settings and
    ``overwrite``); other settings without ``overwrite`` raise :class:`ConfigChanged` (:func:`check_pinned`)."""
    if old is None:
        return None
    try:
        check_pinned(old, new, where, what=what)
    except ConfigChanged:
        if not overwrite:
            raise
        return "discard"
    return "resume"


def read_run_file(path: str | Path) -> dict | None:
    """The JSON object of a run file (``run.json``); ``None`` when there is no such file. A file that is not
    valid JSON, or holds something else than an object, raises ``ValueError`` naming it."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(old, dict):
        raise ValueError(f"{path} holds no settings object")
    return old


def _flat(d: Mapping, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def repair(path: Path) -> None:
    """Cut a torn last line (a kill in the middle of a write) so that appended lines start on a line of their own."""
    if not path.is_file():
        return
    with open(path, "rb") as f:
        data = f.read()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def read_lines(path: str | Path, *, strict: bool = False) -> list[dict]:
    """The JSON objects of a JSONL file; a torn last line is ignored, blank lines skipped. A malformed line
    raises (``strict``, naming the file and line) or is skipped with a warning."""
    path = Path(path)
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.endswith("\n"):
                break
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if strict:
                    raise ValueError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
                log.warning("%s:%d: skipping a malformed line", path, i)
    return out


def read_jsonl(path: str | Path, *, nonempty: bool = False) -> list[dict]:
    """The JSON objects of a complete JSONL file (``.gz`` too; blank lines skipped), for data files; errors name
    the file and line. ``nonempty``: a file without records is an error. (Results files, appended while a run
    may be killed, are read with :func:`read_lines`.)"""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {p}")
    opener = gzip.open if p.suffix == ".gz" else open
    rows = []
    with opener(p, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{i}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{p}:{i}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    if nonempty and not rows:
        raise ValueError(f"{p}: no records")
    return rows


def write_jsonl(path: str | Path, records: Iterable[dict]) -> Path:
    """Write ``records`` as a JSONL file (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


class JsonlStore:
    """Result lines of one output directory: ``<name>`` (merged) plus ``<stem>.rank{R}.jsonl`` shards.

    ``ident(line)`` says which result a line is (a sample id; a (setting, task, index) triple); ``key``
    in the line says which content it was computed from.
    """

    def __init__(self, directory: str | Path, ident: Callable[[dict], Hashable], name: str = "samples.jsonl"):
        self.dir = Path(directory)
        self.ident = ident
        self.path = self.dir / name
        self._stem = self.path.name[: -len(".jsonl")] if name.endswith(".jsonl") else name

    def shard(self, rank: int) -> Path:
        return self.dir / f"{self._stem}.rank{rank}.jsonl"

    def shards(self) -> list[Path]:
        return sorted(self.dir.glob(f"{self._stem}.rank*.jsonl"))

    def read(self) -> list[dict]:
        """Every line of the merged file, then of the shards (file order)."""
        files = ([self.path] if self.path.is_file() else []) + self.shards()
        return [row for p in files for row in read_lines(p)]

    def current(self, expected: Mapping[Hashable, str], lines: Iterable[dict] | None = None
                ) -> tuple[dict[Hashable, dict], list[dict], int]:
        """Split ``lines`` (default: :meth:`read`) by ``expected`` (ident -> key now).

        Returns ``(done, others, stale)``: ``done`` maps each expected ident to its first line with the
        expected key; ``others`` holds the first line of each ident not expected (results this run does not
        touch, kept as they are); ``stale`` counts the lines dropped (an expected ident with another key, or
        a repeat)."""
        done: dict[Hashable, dict] = {}
        others: dict[Hashable, dict] = {}
        stale = 0
        for row in self.read() if lines is None else lines:
            i = self.ident(row)
            if i in expected:
                if row.get("key") == expected[i] and i not in done:
                    done[i] = row
                else:
                    stale += 1
            elif i not in others:
                others[i] = row
            else:
                stale += 1
        return done, list(others.values()), stale

    def append(self, path: Path | None = None) -> _Appender:
        """A context manager writing lines to ``path`` (default: the merged file), each flushed at once."""
        return _Appender(path or self.path)

    def rewrite(self, lines: Iterable[dict]) -> None:
        """Replace the merged file with ``lines`` (atomically: a kill leaves the old file or the new one)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{self.path.name}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for row in lines:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def clear(self) -> None:
        """Remove the merged file and every shard."""
        for p in [self.path, *self.shards()]:
            p.unlink(missing_ok=True)


class _Appender:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> _Appender:
        repair(self.path)
        self.f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in __exit__
        return self

    def write(self, line: dict) -> None:
        self.f.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.f.flush()

    def sync(self) -> None:
        os.fsync(self.f.fileno())

    def __exit__(self, *exc) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
