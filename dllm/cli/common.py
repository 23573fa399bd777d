"""What every command of the ``dllm`` command line shares: the decoding options and how they are read."""

from __future__ import annotations

import argparse

from dllm.evals.parallelbench.sweep import parse_scalar


def parse_params(items: list[str] | None, sampler: str | None = None) -> dict:
    """``["k=v", ...]`` -> dict with ints/floats/bools/None recognised.

    With a registered ``sampler`` a text parameter keeps the text as written (``--param delimiters=5`` is the text
    "5"). Numbers, flags (true/false) and unknown names are checked by :func:`dllm.samplers.get_sampler`, which
    names the parameter and its default or lists the sampler's parameters."""
    from dllm.samplers import SAMPLERS

    defaults = SAMPLERS[sampler].params() if sampler in SAMPLERS else {}
    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"error: --param expects key=value, got {item!r}")
        k, v = (x.strip() for x in item.split("=", 1))
        value = parse_scalar(v)
        if isinstance(defaults.get(k), str) and value is not None:
            value = v
        out[k] = value
    return out


def add_decode_args(p: argparse.ArgumentParser) -> None:
    """The decoding options every generating command takes (model, sampler, cache, lengths, seed, guide)."""
    p.add_argument("--model", default=None, help="checkpoint directory or bundled name (default: llada-tiny)")
    p.add_argument("--sampler", default=None, help="sampler name (see `dllm samplers`; default: the family baseline)")
    p.add_argument("--param", action="append", metavar="K=V", help="sampler parameter, repeatable")
    p.add_argument("--cache", default=None, help="cache policy name (default: none)")
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--block-length", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="decoding steps (default: gen-length)")
    p.add_argument("--cfg-scale", type=float, default=0.0)
    p.add_argument("--eos-early-stop", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    p.add_argument("--device", default=None)
    p.add_argument("--guide", default=None, metavar="PATH",
                   help="AR-guided unmasking: a causal LM checkpoint directory with the model's tokenizer, or the "
                        "bundled 'ar-tiny' (implies --sampler guided)")
    p.add_argument("--guide-mode", choices=["deterministic", "topk"], default=None,
                   help="guided verification rule (default deterministic; topk: k=2, r=0.5, set with --param)")


def load_model_arg(args):
    """The model named by ``--model`` (a checkpoint directory or a bundled name), in ``--dtype`` on ``--device``."""
    from dllm.assets import model_path
    from dllm.models import load_model

    return load_model(model_path(args.model), dtype=args.dtype, device=args.device)


def check_decode_args(args):
    """Every decoding option checked without loading the model (the checkpoint's config.json, ``--dtype``,
    ``--cache``, the lengths, the sampler and its ``--param`` names and values, and the block layout
    :func:`dllm.recipes.resolve` would pick for the checkpoint's block size, see
    :func:`dllm.recipes.precheck_layout`); returns :func:`decode_setup`'s pair. Commands call it before
    :func:`load_model_arg`."""
    from dllm.cli import checks
    from dllm.recipes import precheck_layout

    checks.dtype_name(args.dtype)
    checks.cache_name(args.cache)
    block_size = checks.model_dir(args.model)
    guide = getattr(args, "guide", None)
    if guide is not None:
        from dllm.samplers.guided import checked_guide_path

        path = checked_guide_path(guide)
        if not (path / "config.json").is_file():
            raise ValueError(f"--guide {guide}: no config.json there; give a causal LM checkpoint directory "
                             "(config.json, weights, the model's tokenizer) or the bundled 'ar-tiny'")
    config, sampler = decode_setup(args)
    precheck_layout(sampler, block_size, config)
    return config, sampler


def decode_setup(args):
    """``(GenerateConfig, sampler or None)`` from the decoding options."""
    from dllm.config import GenerateConfig
    from dllm.samplers import get_sampler

    config = GenerateConfig(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
                            cfg_scale=args.cfg_scale, eos_early_stop=args.eos_early_stop, seed=args.seed)
    params = parse_params(args.param, args.sampler)
    guide, mode = getattr(args, "guide", None), getattr(args, "guide_mode", None)
    if guide is not None or mode is not None:
        if args.sampler not in (None, "guided"):
            raise SystemExit(f"error: --guide/--guide-mode need the guided sampler, not --sampler {args.sampler}")
        args.sampler = "guided"
        params = {**params, **({"guide": guide} if guide is not None else {}), **({"mode": mode} if mode else {})}
    try:
        sampler = get_sampler(args.sampler, **params) if args.sampler else None
    except TypeError as exc:  # a factory's own arithmetic on a value of the wrong type
        raise ValueError(f"--sampler {args.sampler} --param {' '.join(args.param or [])}: a value of the wrong type "
                         f"({exc}); `dllm samplers` lists each parameter with its default") from None
    if params and sampler is None:
        raise SystemExit("error: --param needs --sampler")
    return config, sampler
