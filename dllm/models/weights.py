"""Safetensors weights against a config: names, shapes and dtypes checked from the file headers before any tensor is
read, then each tensor read straight onto its device and converted to the model dtype one at a time."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import torch

from dllm.models.spec import ModelSpec
from dllm.models.transformer import Transformer, TransformerConfig

# safetensors' dtype codes (header "dtype" field)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}

Plan = dict[Path, list[tuple[str, str]]]  # file -> [(checkpoint name, our name)]


def check_device(device, what: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` that exists on this machine, else a ValueError saying what to pass."""
    if isinstance(device, bool):
        raise ValueError(f"{what} {device!r} is not a device; use e.g. 'cpu', 'cuda', 'cuda:1' or a GPU index")
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"{what} {device!r} is not a device torch knows ({e}); use e.g. 'cpu', 'cuda', 'cuda:1'") \
            from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise ValueError(f"{what} {device!r} asks for a GPU but CUDA is not available ({why}); load on the CPU "
                             "with device 'cpu' (CLI: --device cpu) or install a CUDA build of torch")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"{what} {device!r}: this machine has {torch.cuda.device_count()} GPU(s) "
                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
        return torch.device("cuda", index)
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{what} {device!r}: MPS is not available on this machine; use device 'cpu'")
    if dev.type == "meta":
        raise ValueError(f"{what} {device!r} holds no data: weights cannot be read onto it; use 'cpu' or 'cuda'")
    if dev.type not in ("cpu", "cuda", "mps"):
        backend = getattr(torch, dev.type, None)
        if not callable(getattr(backend, "is_available", None)) or not backend.is_available():
            raise ValueError(f"{what} {device!r}: no {dev.type} device is available on this machine; use 'cpu' or "
                             "'cuda'")
    return dev


def _safetensors_device(dev: torch.device) -> str:
    """safetensors' spelling: "cpu" (it refuses "cpu:0", which accelerate hands out), "cuda:1"..."""
    return dev.type if dev.index is None or dev.type == "cpu" else f"{dev.type}:{dev.index}"


def _open(f: Path, device: str = "cpu"):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(f), framework="pt", device=device)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"{f} is not a readable safetensors file ({e}): it is corrupt or truncated; copy it again "
                         "from the original checkpoint") from None


def _layer_index(key: str, spec: ModelSpec) -> int | None:
    """The layer a checkpoint tensor name belongs to, from the family's layer name templates."""
    for template in spec.layer_keys.values():
        pattern = re.escape(template).replace(re.escape("{i}"), r"(\d+)")
        m = re.fullmatch(pattern, key)
        if m:
            return int(m.group(1))
    return None


def _span(indices: list[int]) -> str:
    lo, hi = min(indices), max(indices)
    return f"layer {lo}" if lo == hi else f"layers {lo}-{hi}"


def inspect_files(files: list[Path], spec: ModelSpec, cfg: TransformerConfig,
                  weight_map: dict[str, str] | None = None, expected: dict[str, tuple[int, ...]] | None = None) -> Plan:
    """Check the tensors in ``files`` against ``cfg`` from the headers only: every tensor is used, none is missing,
    none is stored twice, shapes agree with the config, dtypes are floating point and the index (``weight_map``)
    matches the shards. ``expected``: our parameter name -> shape, when the caller has the (meta) model already.
    Returns which tensors to read from which file."""
    expected = expected or Transformer.expected_shapes(cfg)
    wanted = spec.key_map(cfg)  # ours -> theirs
    ours_of = {v: k for k, v in wanted.items()}
    plan: Plan = {}
    where: dict[str, Path] = {}
    unexpected: list[str] = []
    for f in files:
        with _open(f) as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if key in where:
                    raise ValueError(f"tensor {key!r} is stored twice, in {where[key].name} and {f.name}; the shards "
                                     "do not belong together: copy the checkpoint again")
                where[key] = f
                if weight_map is not None and weight_map.get(key) != f.name:
                    listed = weight_map.get(key)
                    raise ValueError(f"model.safetensors.index.json lists tensor {key!r} in {listed} but it is stored "
                                     f"in {f.name}; the index does not match the shards: restore it")
                ours = ours_of.get(key)
                if ours is None:
                    unexpected.append(key)
                    continue
                header = fh.get_slice(key)
                code, shape = header.get_dtype(), tuple(header.get_shape())
                dtype = _ST_DTYPES.get(code)
                if dtype is None or not dtype.is_floating_point:
                    raise ValueError(f"tensor {key!r} in {f.name} has dtype {dtype or code}; expected a float tensor")
                if shape != expected[ours]:
                    raise ValueError(
                        f"tensor {key!r} in {f.name} has shape {shape} but config.json implies "
                        f"{expected[ours]}; the weights do not match this config"
                    )
                plan.setdefault(f, []).append((key, ours))
    if weight_map is not None:
        ghosts = sorted(set(weight_map) - set(where))
        if ghosts:
            listed = {k: weight_map[k] for k in ghosts[:3]}
            raise ValueError(f"model.safetensors.index.json lists tensor(s) {listed} (name: shard) that no shard "
                             "holds; the index does not match the shards: restore it")
    missing = [theirs for ours, theirs in wanted.items() if theirs not in where]
    _refuse_mismatch(spec, cfg, unexpected, missing, where)
    return plan


def _refuse_mismatch(spec: ModelSpec, cfg: TransformerConfig, unexpected: list[str], missing: list[str],
                     where: dict[str, Path]) -> None:
    """The most specific message for tensors the config does not use or lacks."""
    head = spec.global_keys["head.weight"]
    tie, layers = spec.tie_field, spec.layers_field
    more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
    if missing and not set(spec.key_map(cfg).values()) & set(where):
        raise ValueError(f"checkpoint lacks tensor(s) {missing[:5]}{more} required by its config.json: none of the "
                         f"{spec.family} tensor names is in the files (they hold e.g. {sorted(where)[:2]}); check "
                         "model_type in config.json")
    if head in unexpected and cfg.tie_embeddings:
        raise ValueError(f"config.json says {tie}=true (the output head shares the embedding matrix) but "
                         f"{where[head].name} holds a separate output head {head!r}; set {tie} to false")
    held = {i for i in (_layer_index(k, spec) for k in where) if i is not None}
    n_held = max(held) + 1 if held else 0
    extra = sorted(i for i in held if i >= cfg.n_layers)
    if extra:
        surplus = [k for k in unexpected if _layer_index(k, spec) in extra]
        raise ValueError(f"the weights hold {_span(extra)} ({len(surplus)} tensors: {surplus[0]!r}, ...) that "
                         f"config.json's {layers}="
                         f"{cfg.n_layers} does not use: the checkpoint has {n_held} layers; set {layers} to {n_held}")
    absent = sorted({i for i in (_layer_index(k, spec) for k in missing) if i is not None and i >= n_held})
    if absent:
        example = next(k for k in missing if _layer_index(k, spec) == absent[0])
        raise ValueError(f"the checkpoint lacks {_span(absent)} (e.g. {example!r}): the files hold {n_held} layers "
                         f"but config.json says {layers}={cfg.n_layers}; set {layers} to {n_held}")
    if missing == [head]:
        raise ValueError(f"the checkpoint lacks the output head {head!r} and config.json says {tie}=false; if the "
                         f"head shares the embedding matrix, set {tie} to true")
    if missing:
        raise ValueError(f"checkpoint lacks tensor(s) {missing[:5]}{more} required by its config.json")
    if unexpected:
        files = sorted({where[k].name for k in unexpected})
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise ValueError(f"tensor(s) {unexpected[:5]}{more} in {', '.join(files)} are not used by a {spec.family} "
                         "model with this config.json: the config does not describe these weights; fix config.json "
                         "or remove the tensors")


def read_tensors(plan: Plan, dtype: torch.dtype, place: Callable[[str], torch.device]) -> dict[str, torch.Tensor]:
    """Read every planned tensor straight onto ``place(our name)`` and convert it to ``dtype`` there, one tensor at a
    time (no second copy of the model in the stored dtype, no CPU copy of weights bound for a GPU)."""
    state: dict[str, torch.Tensor] = {}
    for f, keys in plan.items():
        by_device: dict[torch.device, list[tuple[str, str]]] = {}
        for theirs, ours in keys:
            by_device.setdefault(place(ours), []).append((theirs, ours))
        for dev, group in by_device.items():
            with _open(f, _safetensors_device(dev)) as fh:
                for theirs, ours in group:
                    state[ours] = _read_one(fh, f, theirs, dtype)
    return state


def _read_one(fh, f: Path, key: str, dtype: torch.dtype) -> torch.Tensor:
    from safetensors import SafetensorError

    try:
        t = fh.get_tensor(key)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"{f}: reading tensor {key!r} failed ({e}): the file is corrupt or truncated; copy it again "
                         "from the original checkpoint") from None
    return t.to(dtype)  # the stored-dtype tensor is freed on return


def init_weights(model: Transformer, std: float = 0.02) -> None:
    """GPT-style init: normal(0, std) weights, scaled-down residual projections, zero biases, unit norms."""
    n = model.config.n_layers
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        elif name.endswith(".bias"):
            torch.nn.init.zeros_(p)
        elif name.endswith(("o.weight", "down.weight")):
            torch.nn.init.normal_(p, std=std / math.sqrt(2 * n))
        else:
            torch.nn.init.normal_(p, std=std)
