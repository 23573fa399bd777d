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
import zlib
from collections.abc import Callable, Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["ConfigChanged", "JsonlStore", "check_pinned", "content_key", "pinned_state", "read_jsonl", "read_jsonl_lines",
           "read_lines", "read_run_file", "repair"]


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
    """The JSON objects of a JSONL file; a torn last line is ignored, blank lines skipped. A malformed line (not
    UTF-8, not JSON, or JSON that is not an object) raises (``strict``, naming the file and line) or is skipped
    with a warning."""
    return [row for _, row in read_numbered_lines(path, strict=strict)]


def read_numbered_lines(path: str | Path, *, strict: bool = False) -> list[tuple[int, dict]]:
    """:func:`read_lines` with each object's line number: ``[(line, object), ...]``."""
    path = Path(path)
    out = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                break
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
                problem = None if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"
            except UnicodeDecodeError:
                problem = "not UTF-8 text"
            except json.JSONDecodeError as exc:
                problem = f"not valid JSON ({exc.msg})"
            if problem is None:
                out.append((i, row))
            elif strict:
                raise ValueError(f"{path}:{i}: {problem}")
            else:
                log.warning("%s:%d: skipping a malformed line (%s)", path, i, problem)
    return out


def read_jsonl(path: str | Path, *, nonempty: bool = False) -> list[dict]:
    """The JSON objects of a complete JSONL file (``.gz`` too; blank lines skipped), for data files; errors name
    the file and line. ``nonempty``: a file without records is an error. (Results files, appended while a run
    may be killed, are read with :func:`read_lines`.)"""
    return [row for _, row in read_jsonl_lines(path, nonempty=nonempty)]


def read_jsonl_lines(path: str | Path, *, nonempty: bool = False) -> list[tuple[int, dict]]:
    """:func:`read_jsonl` with each record's line number: ``[(line, record), ...]``."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {p}")
    opener = gzip.open if p.suffix == ".gz" else open
    rows = []
    try:
        with opener(p, "rb") as f:
            for i, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
                except UnicodeDecodeError as exc:
                    raise ValueError(f"{p}:{i}: not UTF-8 text ({exc.reason} at byte {exc.start} of the line); a "
                                     "data file must be UTF-8 JSONL, one JSON object per line: convert it (e.g. "
                                     "iconv -t UTF-8) or give another file") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{p}:{i}: not valid JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{p}:{i}: each line must be a JSON object, got {type(row).__name__}")
                rows.append((i, row))
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise ValueError(f"{p}: a name ending in .gz must be a gzip-compressed JSONL file, but this one could not be "
                         f"decompressed ({exc}); gzip it again, or rename it without .gz if it is plain JSONL") from None
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
        """Every line of the merged file, then of the shards (file order). Lines that are malformed, or objects
        ``ident`` cannot identify (no id), are skipped with a warning, as :func:`read_lines` skips malformed lines."""
        files = ([self.path] if self.path.is_file() else []) + self.shards()
        out = []
        for p in files:
            for i, row in read_numbered_lines(p, strict=False):
                try:
                    self.ident(row)
                except (KeyError, TypeError, ValueError) as exc:  # an object, but not a result line of this store
                    log.warning("%s:%d: skipping a line that is not a result (%s: %s)", p, i, type(exc).__name__, exc)
                    continue
                out.append(row)
        return out

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
