"""The original's parsing of list and Sudoku answers."""

from __future__ import annotations

import re

# ----------------------------------------------------------------------------------------------------------
# Parsing


def parse_list(text: str | None, strict: bool = False) -> list[str] | None:
    """The original's list parsing (not :func:`dllm.evals.tasks.parse_list`, which is more forgiving).

    Lenient: keep the text after the last ``[`` (if any) and before the next ``]`` (if any), split on
    commas, strip double quotes and spaces from each item, drop empty items. Text without brackets is
    parsed as a bare list. Strict: both brackets must be present (text around them is allowed); the inside
    must be ``"a", "b"`` exactly (``", "`` separators, each item in double quotes with no quote inside);
    otherwise None.
    """
    s = "" if text is None else str(text)
    if "[" in s:
        s = s.rsplit("[", 1)[1]
    elif strict:
        return None
    if "]" in s:
        s = s.split("]", 1)[0]
    elif strict:
        return None
    if not strict:
        return [item.strip('" ') for item in s.strip("[]").split(",") if item.strip()]
    items = []
    for item in s.split(", "):
        if not (item.startswith('"') and item.endswith('"')) or '"' in item[1:-1]:
            return None
        items.append(item[1:-1])
    return items


def parse_sudoku(text: str | None, strict: bool = False, n: int = 4) -> list[list[int]] | None:
    """Read an ``n`` x ``n`` digit grid.

    Lenient: drop spaces and commas; every non-empty line with exactly ``n`` digits is a row; there must be
    exactly ``n`` such rows. Strict: exactly ``n`` non-empty lines of exactly ``n`` digits each.
    """
    s = ("" if text is None else str(text)).strip()
    if not strict:
        s = s.replace(" ", "").replace(",", "")
        rows = []
        for line in s.split("\n"):
            if not line.strip():
                continue
            digits = re.findall(r"\d", line)
            if len(digits) == n:
                rows.append([int(d) for d in digits])
        return rows if len(rows) == n else None
    lines = [ln.strip() for ln in s.split("\n") if ln.strip()]
    if len(lines) != n or any(len(ln) != n or not ln.isdigit() for ln in lines):
        return None
    return [[int(c) for c in ln] for ln in lines]
