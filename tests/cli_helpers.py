"""Running the command line in-process in tests."""

from __future__ import annotations

import re

from dllm.cli import main


def refused(capsys, argv: list[str], *needles: str, pattern: str | None = None) -> str:
    """Run the CLI in-process on ``argv``: exit code 2 and one ``error: ...`` line on stderr (no traceback) that
    contains every needle and matches ``pattern`` (a regular expression) where given; returns the line. Output of
    earlier commands in the same test is discarded first."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert pattern is None or re.search(pattern, lines[0]), (pattern, lines[0])
    return lines[0]
