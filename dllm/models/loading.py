"""Load and save checkpoints in the published LLaDA / Dream formats from a local directory."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from dllm.models.spec import ModelSpec, spec_for_model_type
from dllm.models.transformer import Transformer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(set(_DTYPES))}")
    return _DTYPES[dtype]


def read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist (pass a local checkpoint directory)")
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"{cfg_file} is missing: a checkpoint directory needs config.json next to its safetensors weights"
        )
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON ({e}); restore it from the original checkpoint") from None


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index.name} lists shard(s) missing from {path}: {missing}; copy the complete checkpoint"
            )
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(p.name for p in path.glob("*.safetensors"))
    hint = f" (found {found} but no model.safetensors.index.json)" if found else ""
    raise FileNotFoundError(
        f"no weights in {path}: expected model.safetensors or sharded files with "
        f"model.safetensors.index.json{hint}"
    )


def _load_tokenizer(path: Path):
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"tokenizer files missing in {path}: expected {' and '.join(TOKENIZER_FILES)}; "
            "copy them from the original checkpoint or pass tokenizer=False"
        )
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    # AutoTokenizer reads config.json, whose model_type ("llada", "Dream") transformers does not know; it
    # warns about it although the tokenizer files are complete. Keep that noise out of our users' logs.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(path))
    finally:
        hf_logging.set_verbosity(level)


def load_model(
    path,
    *,
    dtype=None,
    device=None,
    device_map=None,
    tokenizer: bool = True,
) -> Transformer:
    """Load a LLaDA- or Dream-format checkpoint from a local directory.

    Args:
        path: directory with ``config.json``, ``model.safetensors`` (or shards plus
            ``model.safetensors.index.json``) and the tokenizer files.
        dtype: ``torch.dtype`` or name (``"bfloat16"``...); default: the checkpoint's ``torch_dtype``
            (fp32 on CPU when that is bf16/fp16 and no dtype is given would silently change numerics, so
            the stored dtype is kept).
        device: a single device for all weights.
        device_map: ``"auto"`` or an accelerate device map; layers are dispatched over several devices
            through accelerate (for checkpoints larger than one device).
        tokenizer: load the tokenizer (``model.tokenizer``); required for string prompts.
    """
    path = Path(path)
    hf_cfg = read_config(path)
    spec = spec_for_model_type(hf_cfg.get("model_type"))
    cfg = spec.config_from_hf(hf_cfg)
    files = weight_files(path)
    dt = resolve_dtype(dtype) or resolve_dtype(hf_cfg.get("torch_dtype") or "float32")
    with torch.device("meta"):
        model = Transformer(cfg, spec)
    state = _read_state(files, spec, cfg, dt)
    if cfg.tie_embeddings:  # one stored matrix; the module lists it under both names
        state["head.weight"] = state["embed.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    if cfg.tie_embeddings:
        model.head.weight = model.embed.weight
    model.eval().requires_grad_(False)
    if tokenizer:
        model.tokenizer = _load_tokenizer(path)
    _set_special_ids(model, hf_cfg, spec, model.tokenizer)
    if device_map is not None:
        model = _dispatch(model, device_map)
    elif device is not None:
        model = model.to(device)
    return model


def _set_special_ids(model: Transformer, hf_cfg: dict, spec: ModelSpec, tok=None) -> None:
    """Special ids from config.json, else the tokenizer, else the family's published ids (when they fit the
    vocabulary: a small checkpoint without a tokenizer does not get the 8B model's ids)."""
    V = model.config.vocab_size

    def pick(key: str, from_tok, default):
        value = hf_cfg.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            if not isinstance(value, int) or not 0 <= value < V:
                raise ValueError(f"{key} {value!r} in config.json is outside the vocabulary ({V}); fix it there")
            return value
        if isinstance(from_tok, int) and from_tok != getattr(tok, "unk_token_id", None) and 0 <= from_tok < V:
            return from_tok
        return default if default is not None and default < V else None

    def tok_id(attr=None, token=None):
        if tok is None:
            return None
        return getattr(tok, attr, None) if attr else tok.convert_tokens_to_ids(token)

    model.mask_id = pick("mask_token_id", tok_id("mask_token_id"), spec.mask_id)
    if model.mask_id is None:
        raise ValueError(
            f"no usable mask token id: config.json has no mask_token_id, the tokenizer has no mask token and "
            f"the {spec.family} default ({spec.mask_id}) is outside the vocabulary ({V}); add mask_token_id "
            "to config.json"
        )
    model.eos_id = pick("eos_token_id", tok_id("eos_token_id"), spec.eos_id)
    model.pad_id = pick("pad_token_id", tok_id("pad_token_id"), model.eos_id)
    model.eot_id = pick("eot_token_id", tok_id(token=spec.eot_token), spec.eot_id)


def _read_state(files: list[Path], spec: ModelSpec, cfg, dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    expected = Transformer.expected_shapes(cfg)
    wanted = spec.key_map(cfg)  # ours -> theirs
    theirs_to_ours = {v: k for k, v in wanted.items()}
    state: dict[str, torch.Tensor] = {}
    unexpected = []
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                ours = theirs_to_ours.get(key)
                if ours is None:
                    unexpected.append(key)
                    continue
                t = fh.get_tensor(key)
                if not t.is_floating_point():
                    raise ValueError(f"tensor {key!r} in {f.name} has dtype {t.dtype}; expected a float tensor")
                if tuple(t.shape) != expected[ours]:
                    raise ValueError(
                        f"tensor {key!r} in {f.name} has shape {tuple(t.shape)} but config.json implies "
                        f"{expected[ours]}; the weights do not match this config"
                    )
                state[ours] = t.to(dtype)
    missing = [wanted[k] for k in wanted if k not in state]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint lacks tensor(s) {missing[:5]}{more} required by its config.json")
    if unexpected:
        log.warning("ignoring %d unexpected tensor(s), e.g. %s", len(unexpected), unexpected[:3])
    return state


def _dispatch(model: Transformer, device_map):
    from accelerate import dispatch_model, infer_auto_device_map

    if device_map == "auto":
        device_map = infer_auto_device_map(model, no_split_module_classes=["Block"], dtype=model.dtype)
    if isinstance(device_map, dict) and model.config.tie_embeddings:
        device_map = {**device_map, "head": device_map.get("embed", next(iter(device_map.values())))}
    return dispatch_model(model, device_map=device_map)


def save_pretrained(model: Transformer, path, *, dtype=None, max_shard_bytes: int | None = None) -> Path:
    """Write ``model`` in its family's published format (config.json, safetensors, tokenizer)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = model.spec
    dt = resolve_dtype(dtype) or model.dtype
    ids = {"mask_id": model.mask_id, "eos_id": model.eos_id, "pad_id": model.pad_id}
    hf_cfg = spec.config_to_hf(model.config, ids)
    hf_cfg["torch_dtype"] = str(dt).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    own = dict(model.state_dict())
    tensors = {theirs: own[ours].detach().to("cpu", dt).contiguous() for ours, theirs in spec.key_map(model.config).items()}
    for stale in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        stale.unlink()
    if max_shard_bytes is None:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(path))
    return path
