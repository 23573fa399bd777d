"""Checks of command-line arguments that run before any model loads: files to read, files and directories to
write, numbers that must be positive, cache and dtype names.

Each raises ``ValueError`` with a message naming the option, the problem and the fix; :func:`dllm.cli.main`
prints it as one ``error: ...`` line.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

PICTURE_TYPES = (".png", ".gif", ".html", ".htm")


def input_file(path: str | os.PathLike, option: str) -> Path:
    """``path`` exists, is a file and is readable."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{option} {path}: no such file")
    if p.is_dir():
        raise ValueError(f"{option} {path} is a directory; give a file")
    if not os.access(p, os.R_OK):
        raise ValueError(f"{option} {path}: not readable (permission denied)")
    return p


def input_dir(path: str | os.PathLike, option: str) -> Path:
    """``path`` exists and is a directory."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{option} {path}: no such directory")
    if not p.is_dir():
        raise ValueError(f"{option} {path} is a file; give a directory")
    return p


def _writable_ancestor(p: Path, option: str, shown: str) -> None:
    """The nearest existing ancestor of ``p`` is a writable directory (so ``p`` can be created)."""
    parent = p.parent if str(p.parent) else Path(".")
    while not parent.exists():
        if parent == parent.parent:
            break
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {shown}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {shown}: cannot write in {parent} (permission denied); choose another path")


def output_file(path: str | os.PathLike, option: str, *, make_parents: bool = False) -> Path:
    """``path`` can be written: not a directory, and its directory exists (or, with ``make_parents``, can be
    made) and is writable."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{option} {path} is a directory; give a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{option} {path}: not writable (permission denied)")
    if not make_parents and not p.parent.is_dir():
        raise ValueError(f"{option} {path}: the directory {p.parent} does not exist; create it first")
    _writable_ancestor(p, option, str(path))
    return p


def output_dir(path: str | os.PathLike, option: str, *, hint: str = "give a directory") -> Path:
    """``path`` is a directory that exists or can be made, and is writable."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{option} {path} is a file, not a directory; {hint}")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise ValueError(f"{option} {path}: cannot write in it (permission denied)")
    else:
        _writable_ancestor(p, option, str(path))
    return p


def picture_file(path: str | os.PathLike, option: str) -> Path:
    """A trajectory picture to write: a known extension, a writable place, and for PNG/GIF matplotlib."""
    p = output_file(path, option)
    ext = p.suffix.lower()
    if ext not in PICTURE_TYPES:
        raise ValueError(f"{option} {path}: unknown picture type {ext or '(no extension)'!r}; end the name in "
                         ".png, .gif or .html")
    if ext in (".png", ".gif") and (importlib.util.find_spec("matplotlib") is None
                                     or importlib.util.find_spec("PIL") is None):
        raise ValueError(f'{option} {path}: PNG and GIF pictures need matplotlib and Pillow (pip install '
                         '"dllm[viz]"); or write .html, which needs neither')
    return p


def positive(value, option: str, *, allow_none: bool = True) -> None:
    """``value`` is >= 1 (or None, when allowed)."""
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise ValueError(f"{option} must be >= 1, got {value}")


def cache_name(name: str | None) -> None:
    """``--cache`` names a registered cache policy."""
    if name is None:
        return
    from dllm.caches import check_cache_name

    try:
        check_cache_name(name)
    except ValueError as exc:
        raise ValueError(f"--cache {name}: {exc}") from None


def dtype_name(name: str | None) -> None:
    """``--dtype`` is one the loader knows."""
    if name is None:
        return
    from dllm.models.loading import resolve_dtype

    try:
        resolve_dtype(name)
    except ValueError as exc:
        raise ValueError(f"--dtype: {exc}") from None


def device_name(device: str | None) -> None:
    """``--device`` names a device this machine has (the loader's own check, before it reads anything)."""
    if device is None:
        return
    from dllm.models.weights import check_device

    check_device(device, "--device")


def host_name(host: str) -> None:
    """``--host`` is an IP address or a host name (letters, digits and hyphens between dots): what the server can
    bind, checked before the model loads (the server failed only once it started, after loading)."""
    import ipaddress
    import re

    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    label = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
    if len(host) > 253 or not re.fullmatch(rf"{label}(\.{label})*\.?", host):
        raise ValueError(f"--host {host!r} is not an IP address or a host name; use e.g. 127.0.0.1 (this machine "
                         "only), 0.0.0.0 (every interface) or localhost")


@dataclass(frozen=True)
class ModelFacts:
    """What config.json tells about a checkpoint before any weight is read (:func:`model_dir`)."""

    family: str
    block_size: int | None  # block-diffusion checkpoints; None for LLaDA and Dream
    vocab_size: int
    context: int  # the longest prompt + generation the model takes (``Transformer.max_seq_len``)
    mask_id: int | None  # config.json's mask_token_id (None: the loader takes the tokenizer's)


def model_dir(name: str | None) -> ModelFacts:
    """``--model`` is a bundled name or a checkpoint directory with a readable config.json that the loader accepts
    (its checks of config.json, which read no weights); returns what the options are checked against. The model is
    built on the meta device (no memory, no weights), so its context and vocabulary are the loaded model's own."""
    import torch

    from dllm.assets import model_path
    from dllm.models.loading import read_config
    from dllm.models.spec import spec_for_model_type
    from dllm.models.transformer import Transformer
    from dllm.samplers.guided import bundled_guides

    if name is not None and not name.strip():
        from dllm.assets import BUNDLED

        raise ValueError(f"--model {name!r} is empty; give a checkpoint directory or a bundled name "
                         f"({', '.join(BUNDLED)}), or leave --model out (llada-tiny)")
    path = Path(model_path(name))
    if name in bundled_guides() and not path.is_dir():
        raise ValueError(f"--model {name}: {name} is the bundled AR guide (a causal LM), not a diffusion model; pass it "
                         f"as --guide {name} and keep a diffusion --model (default: llada-tiny)")
    hf_cfg = read_config(path)
    spec = spec_for_model_type(hf_cfg.get("model_type"))
    with torch.device("meta"):
        model = Transformer(spec.config_from_hf(hf_cfg), spec)
    mask = hf_cfg.get("mask_token_id")
    return ModelFacts(spec.family, model.config.block_size, model.config.vocab_size, model.max_seq_len,
                      mask if type(mask) is int else None)


def guide_dir(name: str, shown: str | None = None) -> Path:
    """``--guide`` is the bundled guide or a causal LM checkpoint directory: a config.json whose ``model_type`` is
    one of transformers' causal LMs (what ``AutoModelForCausalLM`` loads without remote code), checked before
    any model loads. ``shown``: how the error names the option (default ``--guide NAME``)."""
    from dllm.samplers.guided import checked_guide_path

    shown = shown or f"--guide {name}"
    try:
        path = checked_guide_path(name)
    except FileNotFoundError as exc:
        raise ValueError(f"{shown}: {exc}") from None
    if not (path / "config.json").is_file():
        raise ValueError(f"{shown}: no config.json there; give a causal LM checkpoint directory "
                         "(config.json, weights, the model's tokenizer) or the bundled 'ar-tiny'")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from dllm.models.loading import read_config

    model_type = read_config(path).get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        from dllm.models.spec import SPECS

        what = ("a diffusion checkpoint (give it as --model)" if str(model_type).lower() in
                {s.model_type.lower() for s in SPECS.values()} else "not a causal LM transformers knows")
        raise ValueError(f"{shown}: its config.json has model_type {model_type!r}, {what}; the guide is an "
                         "autoregressive (causal) LM with the model's tokenizer, e.g. the bundled 'ar-tiny'")
    return path
