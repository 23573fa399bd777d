"""Load and save checkpoints in the published LLaDA / Dream / SDAR / LLaDA2 / Fast-dLLM v2 formats (a local directory
or a bundled name)."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import torch

from dllm.models.fast import check_fast, enable_fast_path, wants_fast
from dllm.models.spec import ModelSpec, spec_for_model_type
from dllm.models.transformer import Transformer
from dllm.models.weights import check_device, inspect_files, read_tensors
from dllm.ops import shown

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def resolve_dtype(dtype) -> torch.dtype | None:
    if isinstance(dtype, torch.dtype) and not (dtype.is_floating_point and dtype.itemsize >= 2):
        raise ValueError(f"dtype {dtype} cannot hold the model's weights (the layers compute in floating point of "
                         "16 bits or more); use torch.float32, torch.bfloat16 or torch.float16 (or their names)")
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {shown(dtype)}; use one of {sorted(set(_DTYPES))}")
    return _DTYPES[dtype]


def read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not path.is_dir():
        from dllm.assets import BUNDLED

        raise FileNotFoundError(f"model directory {str(path)!r} does not exist (pass a local checkpoint directory or "
                                f"a bundled name: {', '.join(BUNDLED)})")
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"{cfg_file} is missing: a checkpoint directory needs config.json next to its safetensors weights"
        )
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON ({e}); restore it from the original checkpoint") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file} holds {type(cfg).__name__}, not a JSON object; restore it from the checkpoint")
    return cfg


def checkpoint_block_size(path: Path) -> int | None:
    """The ``block_size`` of the model :func:`load_model` would build from the checkpoint directory ``path``
    (block-diffusion formats: SDAR, LLaDA2, Fast-dLLM v2; ``None`` for LLaDA and Dream), read from config.json
    alone, no weights. Raises what :func:`load_model` raises for a missing or unreadable config.json, an
    unsupported ``model_type`` or a config field the model does not implement."""
    hf_cfg = read_config(path)
    return spec_for_model_type(hf_cfg.get("model_type")).config_from_hf(hf_cfg).block_size


def read_index(path: Path) -> dict[str, str] | None:
    """The ``weight_map`` (tensor name -> shard file) of a sharded checkpoint, None for a single file."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        data = json.loads(index.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{index} is not valid JSON ({e}); restore it from the original checkpoint") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index} has no weight_map (tensor name -> shard file name); restore it from the original "
                         "checkpoint")
    return weight_map


def weight_files(path: Path) -> list[Path]:
    weight_map = read_index(path)
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"model.safetensors.index.json lists shard(s) missing from {path}: {missing}; copy the complete "
                "checkpoint"
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


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer (transformers' ``AutoTokenizer``, never the checkpoint's own code); a clear error
    when its files are missing or broken."""
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
        with warnings.catch_warnings():  # nor its deprecation notes about config fields it does not use here
            warnings.simplefilter("ignore", FutureWarning)
            # never the checkpoint's own Python code (SDAR's config.json names some in auto_map)
            return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # tokenizers and transformers raise many types; all mean the same to the user
        raise ValueError(f"the tokenizer files in {path} cannot be loaded ({type(e).__name__}: {e}); copy them "
                         "again from the original checkpoint, or pass tokenizer=False") from None
    finally:
        hf_logging.set_verbosity(level)


def load_model(
    path,
    *,
    dtype=None,
    device=None,
    device_map=None,
    tokenizer=True,
    fast="auto",
    compile=False,
) -> Transformer:
    """Load a LLaDA-, Dream-, SDAR-, LLaDA2- or Fast-dLLM v2-format checkpoint from a local directory or by bundled
    name.

    The checkpoint is checked before any tensor is read: config.json fields the model does not implement are
    refused, every tensor in the files must be used, none missing, shapes as the config implies; the mask and EOS
    ids in config.json must agree with the tokenizer. Each tensor is then read straight onto its device and
    converted to ``dtype`` there, one at a time.

    Args:
        path: directory with ``config.json``, ``model.safetensors`` (or shards plus
            ``model.safetensors.index.json``) and the tokenizer files, or a bundled name (``"llada-tiny"``,
            ``"dream-tiny"``).
        dtype: ``torch.dtype`` or name (``"bfloat16"``...); default: the checkpoint's ``torch_dtype``
            (fp32 on CPU when that is bf16/fp16 and no dtype is given would silently change numerics, so
            the stored dtype is kept).
        device: a single device for all weights (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
        device_map: ``"auto"`` or a dict module name -> device (accelerate's format); layers are placed over
            several devices and dispatched through accelerate (for checkpoints larger than one device).
        tokenizer: load the tokenizer (``model.tokenizer``); required for string prompts. A tokenizer already
            loaded from this checkpoint (:func:`load_tokenizer`) may be given instead, and is used as it is.
        fast: the fast layer path (:mod:`dllm.models.fast`: projections fused at load time, fused Triton kernels):
            ``"auto"`` turns it on when every weight is on a CUDA device, ``True`` / ``False`` force it on / off
            (on the CPU the fused kernels run as their PyTorch twins). The published parameter names and
            ``save_pretrained`` are the same either way.
        compile: ``torch.compile`` the model's forward in place (``nn.Module.compile``: the model stays a
            :class:`Transformer`, its state dict and ``save_pretrained`` unchanged): ``False`` (default), ``True``
            (torch.compile's defaults) or a dict of ``torch.compile`` keyword arguments (``{"mode": "max-autotune"}``,
            ``{"backend": "aot_eager"}``...). The first forwards of each new shape compile.
    """
    check_fast(fast)
    compile_kw = _compile_options(compile)
    if not isinstance(tokenizer, bool) and not (callable(getattr(tokenizer, "encode", None))
                                                and callable(getattr(tokenizer, "decode", None))):
        raise ValueError(f"tokenizer must be True, False or a tokenizer (load_tokenizer(path)), got {tokenizer!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path is {path!r} ({type(path).__name__}); pass a checkpoint directory or a bundled name "
                        "such as 'llada-tiny'")
    if isinstance(path, str) and not path.strip():
        from dllm.assets import BUNDLED

        raise ValueError(f"path is {path!r}, empty; pass a checkpoint directory or a bundled name "
                         f"({', '.join(BUNDLED)})")
    if isinstance(path, str):
        from dllm.assets import model_path

        path = model_path(path)  # a bundled name, as on the command line
    path = Path(path)
    if device is not None and device_map is not None:
        raise ValueError("give device or device_map, not both")
    target = check_device(device) if device is not None else torch.device("cpu")
    hf_cfg = read_config(path)
    spec = spec_for_model_type(hf_cfg.get("model_type"))
    cfg = spec.config_from_hf(hf_cfg)
    files = weight_files(path)
    dt = resolve_dtype(dtype) or resolve_dtype(hf_cfg.get("torch_dtype") or hf_cfg.get("dtype") or "float32")
    with torch.device("meta"):
        model = Transformer(cfg, spec)
    placement = _device_map(model, device_map, dt) if device_map is not None else None
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    plan = inspect_files(files, spec, cfg, read_index(path), shapes)
    tok = (load_tokenizer(path) if tokenizer else None) if isinstance(tokenizer, bool) else tokenizer
    ids = _special_ids(hf_cfg, spec, cfg.vocab_size, tok)
    devices = {ours: _placed(ours, placement) if placement else target for keys in plan.values() for _, ours in keys}
    state = read_tensors(plan, dt, devices.__getitem__)
    if cfg.tie_embeddings:  # one stored matrix; the module lists it under both names
        state["head.weight"] = state["embed.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    if cfg.tie_embeddings:
        model.head.weight = model.embed.weight
    model.eval().requires_grad_(False)
    if wants_fast(fast, model):
        enable_fast_path(model)
    model.tokenizer = tok
    for name, value in ids.items():
        setattr(model, name, value)
    if placement is not None:
        from accelerate import dispatch_model

        model = dispatch_model(model, device_map={k: str(v) for k, v in placement.items()})
    if compile_kw is not None:
        model.compile(**compile_kw)
    return model


def _compile_options(compile) -> dict | None:
    """``load_model(compile=...)`` checked before anything is read: None (no compile) or torch.compile's kwargs."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return {}
    if isinstance(compile, dict) and all(isinstance(k, str) for k in compile):
        import inspect

        known = set(inspect.signature(torch.compile).parameters) - {"model"}
        unknown = sorted(set(compile) - known)
        if unknown:
            raise ValueError(f"compile options {unknown} are not torch.compile arguments; known: {', '.join(sorted(known))}")
        _check_compile_values(compile)
        return dict(compile)
    raise ValueError(f"compile must be True, False or a dict of torch.compile keyword arguments, got {compile!r}")


def _check_compile_values(kw: dict) -> None:
    """The values of ``load_model(compile={...})`` that torch.compile would only refuse at the first forward."""
    def bad(name, want):
        return ValueError(f"compile option {name}={kw[name]!r}: {want}")

    for name in ("fullgraph", "disable", "isolate_recompiles"):
        if name in kw and not isinstance(kw[name], bool):
            raise bad(name, "must be True or False")
    if "dynamic" in kw and kw["dynamic"] is not None and not isinstance(kw["dynamic"], bool):
        raise bad("dynamic", "must be True, False or None")
    if kw.get("backend") is not None and not callable(kw["backend"]):
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        if kw["backend"] not in backends:
            raise bad("backend", f"must be a callable or one of {', '.join(backends)}")
    if kw.get("mode") is not None:
        import torch._inductor

        modes = list(torch._inductor.list_mode_options())
        if kw["mode"] not in modes:
            raise bad("mode", f"must be one of {', '.join(modes)} (or None)")
        if kw.get("options") is not None:
            raise ValueError("compile options mode and options cannot both be given (torch.compile takes one); "
                             "drop one of them")
    if kw.get("options") is not None and not (isinstance(kw["options"], dict)
                                             and all(isinstance(k, str) for k in kw["options"])):
        raise bad("options", "must be a dict of Inductor settings keyed by name")
    limit = kw.get("recompile_limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise bad("recompile_limit", "must be a positive integer or None")
    if kw.get("name") is not None and not isinstance(kw["name"], str):
        raise bad("name", "must be a string")


def _device_map(model: Transformer, device_map, dtype: torch.dtype) -> dict[str, torch.device]:
    """Module name -> checked device; ``"auto"`` is resolved by accelerate on the (meta) model."""
    if device_map == "auto":
        from accelerate import infer_auto_device_map

        device_map = infer_auto_device_map(model, no_split_module_classes=["Block"], dtype=dtype)
    if not isinstance(device_map, dict) or not device_map:
        raise ValueError(f"device_map must be 'auto' or a dict module name -> device, got {device_map!r}")
    out = {}
    for name, dev in device_map.items():
        if dev == "disk":
            raise ValueError(f"device_map puts {name!r} on 'disk': offloading weights to disk is not supported; "
                             "map every module to a GPU or 'cpu'")
        out[name] = check_device(dev, f"device_map entry {name!r} ->")
    if model.config.tie_embeddings:  # the tied head lives with the embedding
        out["head"] = _placed("embed.weight", out)
    return out


def _placed(name: str, placement: dict[str, torch.device]) -> torch.device:
    """The device of parameter ``name``: the longest module prefix in ``placement``."""
    owners = [k for k in placement if k == "" or name == k or name.startswith(k + ".")]
    if not owners:
        raise ValueError(f"device_map places no module holding {name!r}; add it (or an entry for \"\": all "
                         "modules)")
    return placement[max(owners, key=len)]


def _special_ids(hf_cfg: dict, spec: ModelSpec, V: int, tok=None) -> dict[str, int | None]:
    """Special ids from config.json, else the tokenizer, else the family's published ids (when they fit the
    vocabulary: a small checkpoint without a tokenizer does not get the 8B model's ids). The mask and EOS ids of
    config.json must agree with the tokenizer."""

    def pick(key: str, from_tok, default):
        value = hf_cfg.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            if type(value) is not int or not 0 <= value < V:
                raise ValueError(f"{key} {value!r} in config.json is outside the vocabulary ({V}); fix it there")
            return value
        if isinstance(from_tok, int) and 0 <= from_tok < V:
            return from_tok
        return default if default is not None and default < V else None

    def token_id(token: str) -> int | None:
        i = tok.convert_tokens_to_ids(token)
        return i if isinstance(i, int) and i != tok.unk_token_id else None

    tok_mask = tok_eot = None
    if tok is not None:
        tok_mask = tok.mask_token_id if tok.mask_token_id is not None else token_id(spec.mask_token)
        tok_eot = token_id(spec.eot_token)
        _check_against_tokenizer(hf_cfg, tok, tok_mask)
    ids = {"mask_id": pick("mask_token_id", tok_mask, spec.mask_id)}
    if ids["mask_id"] is None:
        raise ValueError(
            f"no usable mask token id: config.json has no mask_token_id, the tokenizer has no mask token and "
            f"the {spec.family} default ({spec.mask_id}) is outside the vocabulary ({V}); add mask_token_id "
            "to config.json"
        )
    ids["eos_id"] = pick("eos_token_id", getattr(tok, "eos_token_id", None), spec.eos_id)
    ids["pad_id"] = pick("pad_token_id", getattr(tok, "pad_token_id", None), ids["eos_id"])
    ids["eot_id"] = pick("eot_token_id", tok_eot, spec.eot_id)
    return ids


def _check_against_tokenizer(hf_cfg: dict, tok, tok_mask: int | None) -> None:
    mask = hf_cfg.get("mask_token_id")
    if mask is not None and tok_mask is not None and mask != tok_mask:
        name = tok.convert_ids_to_tokens(tok_mask)
        raise ValueError(
            f"config.json's mask_token_id {mask} differs from the tokenizer's mask token {name!r} (id {tok_mask}); "
            f"decoding with the wrong mask id gives garbage: set mask_token_id to {tok_mask} in config.json (or, if "
            f"the model was trained with id {mask}, make that token the tokenizer's mask_token)"
        )
    eos = hf_cfg.get("eos_token_id")
    special = set(tok.all_special_ids)
    special |= {i for i, t in (getattr(tok, "added_tokens_decoder", None) or {}).items() if getattr(t, "special", 0)}
    for e in eos if isinstance(eos, list) else [eos]:
        if isinstance(e, int) and e not in special:
            shown = tok.convert_ids_to_tokens(e) if 0 <= e < len(tok) else "outside the tokenizer"
            raise ValueError(
                f"config.json's eos_token_id {e} ({shown!r}) is not a special token of the tokenizer, whose "
                f"eos_token_id {tok.eos_token_id} is {tok.eos_token!r}; generation would never stop on it: set "
                f"eos_token_id to {tok.eos_token_id} in config.json"
            )


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when it views part of a larger storage (the fast path's fused projections): safetensors
    refuses tensors that share memory."""
    return t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t


# what a tokenizer's save_pretrained (and the tiny trainer's training.json) may leave in a checkpoint directory:
# removed from an earlier save when the new save does not write them, so they cannot override the new tokenizer
_SAVED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                          "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt",
                          "tokenizer.model", "spiece.model")
_STALE_RECORDS = ("training.json",)


def _shard_size(max_shard_bytes) -> int | str | None:
    """``max_shard_bytes`` checked: None, a positive whole number of bytes, or a positive size like ``"5GB"``."""
    from huggingface_hub.serialization._base import parse_size_to_int

    fix = "give a positive number of bytes or a size like '5GB' (units KB, MB, GB, TB)"
    if max_shard_bytes is None:
        return None
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, (int, float, str)):
        raise ValueError(f"max_shard_bytes {max_shard_bytes!r} is not a size; {fix}")
    if isinstance(max_shard_bytes, str):
        try:
            n = parse_size_to_int(max_shard_bytes)
        except ValueError:
            raise ValueError(f"max_shard_bytes {max_shard_bytes!r} is not a size; {fix}") from None
    else:
        n = max_shard_bytes
    if not (math.isfinite(n) and n >= 1 and n == int(n)):
        raise ValueError(f"max_shard_bytes {max_shard_bytes!r} must be at least one whole byte; {fix}")
    return max_shard_bytes if isinstance(max_shard_bytes, str) else int(n)


def save_pretrained(model: Transformer, path, *, dtype=None, max_shard_bytes: int | str | None = None) -> Path:
    """Write ``model`` in its family's published format (config.json, safetensors, tokenizer).

    ``max_shard_bytes`` (a positive number of bytes, or a size such as ``"5GB"``) splits the weights into
    ``model-0000N-of-0000M.safetensors`` plus ``model.safetensors.index.json`` through ``huggingface_hub``'s
    state-dict saving; without it one ``model.safetensors`` is written. The arguments are checked before anything
    is created or written.

    Saving into the directory of an earlier save replaces it: the earlier weight files are removed, and so are the
    earlier tokenizer files (``tokenizer.json``, ``special_tokens_map.json``, ``chat_template.jinja`` and the
    other standard tokenizer file names) that this save does not write, and the tiny trainer's ``training.json``,
    which described the earlier model. Other files in the directory are left alone.

    A model without a tokenizer (loaded with ``tokenizer=False``) is refused when ``path`` already holds tokenizer
    files: they belong to another save and may not match this model. Load the model with its tokenizer, save into
    a new directory, or remove those files first."""
    from huggingface_hub import save_torch_state_dict

    shard_size = _shard_size(max_shard_bytes)
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)  # what mkdir would run into
    if existing is not None and not existing.is_dir():
        raise ValueError(f"save_pretrained: {existing} is a file, not a directory; give a directory path to write "
                         "the checkpoint in (a new one, or the directory of an earlier save to replace it)")
    dt = resolve_dtype(dtype) or model.dtype
    old_tok = [name for name in _SAVED_TOKENIZER_FILES if (path / name).is_file()] if path.is_dir() else []
    if model.tokenizer is None and old_tok:
        raise ValueError(f"save_pretrained: {path} holds another save's tokenizer ({', '.join(old_tok)}) and this "
                         "model has none (loaded with tokenizer=False), so the checkpoint would pair it with a "
                         "tokenizer that may not match; load the model with its tokenizer, save into a new "
                         "directory, or remove those files first")
    path.mkdir(parents=True, exist_ok=True)
    spec = model.spec
    ids = {"mask_id": model.mask_id, "eos_id": model.eos_id, "pad_id": model.pad_id}
    hf_cfg = spec.config_to_hf(model.config, ids)
    hf_cfg["torch_dtype"] = str(dt).removeprefix("torch.")
    own = dict(model.state_dict())
    tensors = {theirs: _own_storage(own[ours].detach().to("cpu", dt).contiguous())
               for ours, theirs in spec.key_map(model.config).items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    save_torch_state_dict(tensors, path, max_shard_size=max(total, 1) if shard_size is None else shard_size)
    written: set[str] = set()
    if model.tokenizer is not None:
        written = {Path(f).name for f in model.tokenizer.save_pretrained(str(path))}
    for name in (*old_tok, *_STALE_RECORDS):
        if name not in written and (path / name).is_file():
            (path / name).unlink()
    return path
