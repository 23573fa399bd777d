"""The original's parsing of Sudoku answers (lists: :func:`dllm.evals.tasks.parse_list` with
``rules="parallelbench"``)."""

from __future__ import annotations

import re

# ----------------------------------------------------------------------------------------------------------
# Parsing


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
