"""Bundled tiny checkpoints (LLaDA, Dream, SDAR, LLaDA2 and Fast-dLLM v2 formats), trained by ``dllm train-tiny``."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
BUNDLED = {name: ASSETS / name for name in ("llada-tiny", "dream-tiny", "sdar-tiny", "llada2-tiny", "fastdllm2-tiny")}
DEFAULT_MODEL = "llada-tiny"


def model_path(name_or_path: str | None = None) -> Path:
    """A bundled model's directory by name (``llada-tiny``, ``dream-tiny``, the block-diffusion ``sdar-tiny``,
    ``llada2-tiny``, ``fastdllm2-tiny``), or the given path."""
    name = name_or_path or DEFAULT_MODEL
    return BUNDLED.get(name, Path(name))
