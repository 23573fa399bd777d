"""What every command of the ``dllm`` command line shares: the decoding options and how they are read."""

from __future__ import annotations

import argparse
from pathlib import Path

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
            raise ValueError(f"--param expects key=value, got {item!r}")
        k, v = (x.strip() for x in item.split("=", 1))
        if k in out:
            raise ValueError(f"--param {k} is given twice ({k}={out[k]!r}, then {item!r}); give each parameter once")
        value = parse_scalar(v)
        if isinstance(defaults.get(k), str) and value is not None:
            value = v
        out[k] = value
    return out


# what dllm.recipes.resolve does with no cache from the caller
CONTINUOUS_HELP = ("continuous batching: --batch-size rows decode at once, a finished row's place taken by the next "
                   "prompt at once (the same outputs; the sampler's noise_scope must be 'row')")
CACHE_HELP = ("cache policy name, or 'none' (default: block on block-diffusion checkpoints; else the sampler preset's "
              "own cache: dual for fast-dllm, elastic for elastic, dkv-decode for dkv; else none)")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    """The decoding options every generating command takes (model, sampler, cache, lengths, seed, guide)."""
    p.add_argument("--model", default=None, help="checkpoint directory or bundled name (default: llada-tiny)")
    p.add_argument("--sampler", default=None, help="sampler name (see `dllm samplers`; default: the family baseline)")
    p.add_argument("--param", action="append", metavar="K=V", help="sampler parameter, repeatable")
    p.add_argument("--cache", default=None, help=CACHE_HELP)
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

    # the tokenizer the prompt check loaded (check_decode_args), not read a second time
    tokenizer = getattr(args, "prompt_tokenizer", None)
    tokenizer = True if tokenizer is None else tokenizer
    return load_model(model_path(args.model), dtype=args.dtype, device=args.device, tokenizer=tokenizer)


def check_decode_args(args, prompts=None, also=None):
    """Every decoding option checked without loading the model, against the checkpoint's config.json
    (:func:`dllm.cli.checks.model_dir`): ``--dtype``, ``--cache`` (``block`` needs a block-diffusion checkpoint),
    ``--gen-length`` (the model's context), ``--guide`` (a causal LM), the sampler and its ``--param`` names and
    values, and the block layout :func:`dllm.recipes.resolve` would pick for the checkpoint's block size (see
    :func:`dllm.recipes.precheck_layout`); with ``prompts`` (strings, conversations, token-id lists), the prompts
    too (token ids inside the vocabulary, no mask token; every prompt, measured with the tokenizer, fitting the
    context with ``--gen-length``); ``also``: another sampler decoding the same prompts (``--compare``), whose
    block layout is checked too. Returns :func:`decode_setup`'s pair. Commands call it before
    :func:`load_model_arg`."""
    from dllm.cli import checks
    from dllm.recipes import check_cache_fits, precheck_layout

    checks.dtype_name(args.dtype)
    checks.device_name(args.device)
    checks.cache_name(args.cache)
    facts = checks.model_dir(args.model)
    check_cache_fits(args.cache, facts.block_size)
    guide = getattr(args, "guide", None)
    if guide is not None:
        checks.guide_dir(guide)
    config, sampler = decode_setup(args)
    if args.cache is None and facts.block_size is None:  # the preset's own cache (--param cache=block)
        from dllm.recipes import as_recipe

        own = as_recipe(sampler).cache if sampler is not None else None
        check_cache_fits(own[0] if isinstance(own, tuple) else own, None)
    if guide is None and isinstance(getattr(sampler, "guide", None), str):  # --sampler guided --param guide=DIR
        checks.guide_dir(sampler.guide, f"--param guide={sampler.guide}")
    lengths = [len(r) for r in _token_id_prompts(prompts or [], facts)]
    text_lengths, args.prompt_tokenizer = _text_prompt_lengths(args.model, prompts)
    lengths += text_lengths
    longest = max(lengths, default=1)  # no prompts given (eval builds its own): a prompt takes 1 token at least
    if longest >= facts.context:
        raise ValueError(f"the longest prompt has {longest} tokens, the model's whole context (config.json: "
                         f"{facts.context} tokens) or more, leaving none to generate: shorten it")
    if longest + config.gen_length > facts.context:
        shown = f"the longest prompt has {longest} tokens" if lengths else "a prompt takes at least 1 token"
        raise ValueError(f"--gen-length {config.gen_length} does not fit the model's context of {facts.context} "
                         f"tokens (config.json; {shown}): use --gen-length {facts.context - longest} or less")
    precheck_layout(sampler, facts.block_size, config)
    if also is not None:  # a second sampler run on the same prompts (generate --compare)
        precheck_layout(also, facts.block_size, config)
    return config, sampler


def _text_prompt_lengths(model: str | None, prompts) -> tuple[list[int], object]:
    """The token counts of the string and conversation prompts, encoded as :func:`dllm.generate` encodes them (the
    chat template applied), with the checkpoint's tokenizer alone: no weights are read. Returns the counts and the
    tokenizer (None where no prompt is text), which :func:`load_model_arg` hands to the model."""
    from dllm.assets import model_path
    from dllm.generate import encode_prompt, is_conversation
    from dllm.models.loading import load_tokenizer

    texts = [p for p in prompts or [] if isinstance(p, str) or is_conversation(p)]
    if not texts:
        return [], None
    tok = load_tokenizer(Path(model_path(model)))
    return [len(encode_prompt(tok, p)) for p in texts], tok


def _token_id_prompts(prompts: list, facts) -> list[list[int]]:
    """The prompts given as token ids, checked as :func:`dllm.generate` checks them, with config.json's vocabulary
    and mask id (strings and conversations are checked once the tokenizer has encoded them)."""
    from dllm.generate import check_prompt_ids, is_conversation

    ids = {i: list(p) for i, p in enumerate(prompts) if not (isinstance(p, str) or is_conversation(p))}
    check_prompt_ids(ids, facts.vocab_size, facts.mask_id)
    return list(ids.values())


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
            raise ValueError(f"--guide/--guide-mode need the guided sampler, not --sampler {args.sampler}")
        args.sampler = "guided"
        for name, opt, value in (("guide", "--guide", guide), ("mode", "--guide-mode", mode)):
            if value is not None and name in params and params[name] != value:
                raise ValueError(f"{opt} {value} and --param {name}={params[name]} disagree; give one of them")
        params = {**params, **({"guide": guide} if guide is not None else {}), **({"mode": mode} if mode else {})}
    try:
        sampler = get_sampler(args.sampler, **params) if args.sampler else None
    except TypeError as exc:  # a factory's own arithmetic on a value of the wrong type
        raise ValueError(f"--sampler {args.sampler} --param {' '.join(args.param or [])}: a value of the wrong type "
                         f"({exc}); `dllm samplers` lists each parameter with its default") from None
    if params and sampler is None:
        raise ValueError("--param needs --sampler")
    return config, sampler
