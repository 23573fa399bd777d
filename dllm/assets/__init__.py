"""Bundled tiny checkpoints (LLaDA and Dream formats), trained by ``dllm train-tiny``."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
BUNDLED = {"llada-tiny": ASSETS / "llada-tiny", "dream-tiny": ASSETS / "dream-tiny"}
DEFAULT_MODEL = "llada-tiny"


def model_path(name_or_path: str | None = None) -> Path:
    """A bundled model's directory by name (``llada-tiny``, ``dream-tiny``), or the given path."""
    name = name_or_path or DEFAULT_MODEL
    return BUNDLED.get(name, Path(name))
