"""``dllm generate`` and ``dllm samplers``."""

from __future__ import annotations

import codecs
import json
import sys
from pathlib import Path

from dllm.cli import checks
from dllm.cli.common import add_decode_args, check_decode_args, load_model_arg


def _batch_line(line: str, where: str):
    """One ``--batch-file`` line: ``{"prompt": ...}`` (a string, a conversation or token ids); a JSON list of
    ``{"role", "content"}`` messages (a conversation) or of integers (token ids); anything else is plain text
    (``[INST] ...`` included). A conversation's messages are checked as :func:`dllm.generate` checks them."""
    from dllm.generate import check_conversation, is_conversation

    text = line.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: a line starting with '{{' must be a JSON object ({exc.msg}); e.g. "
                             '{"prompt": "..."}') from None
        if not isinstance(obj, dict) or "prompt" not in obj:
            raise ValueError(f'{where}: a JSON object line needs a "prompt" key, e.g. {{"prompt": "..."}}')
        prompt = obj["prompt"]
        if isinstance(prompt, str) and not prompt.strip():
            raise ValueError(f'{where}: "prompt" is empty; give the text to answer, or remove the line')
        if is_conversation(prompt):
            check_conversation(prompt, where)
        elif not (isinstance(prompt, str) or _is_token_ids(prompt)):
            raise ValueError(f'{where}: "prompt" must be a string, a list of {{"role", "content"}} messages or a '
                             f"list of token ids, not {json.dumps(prompt)[:60]}")
        return prompt
    if text.startswith("["):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return line
        if is_conversation(obj):
            check_conversation(obj, where)
            return obj
        if _is_token_ids(obj):
            return obj
    return line


def _is_token_ids(obj) -> bool:
    from dllm.generate import is_token_id

    return isinstance(obj, list) and bool(obj) and all(is_token_id(t) for t in obj)


def _read_batch_file(path: str) -> list:
    """The prompts of ``--batch-file`` (checked: a readable UTF-8 file with at least one prompt)."""
    checks.input_file(path, "--batch-file")
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"--batch-file {path}: not UTF-8 text (byte {exc.start}); give a text file, one prompt "
                         "per line") from None
    prompts = [_batch_line(ln, f"{path}:{i}") for i, ln in enumerate(lines, 1) if ln.strip()]
    if not prompts:
        raise ValueError(f"--batch-file {path} has no prompts (it is empty or blank); write one prompt per line")
    return prompts


def _unescape(text: str) -> str:
    """Backslash escapes (``\\n``, ``\\t``, ``\\u00e9``) decoded; every other character kept as it is."""
    try:
        return codecs.decode(text.encode("latin-1", "backslashreplace"), "unicode_escape")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--escapes: {text[:40]!r} has a bad escape ({exc.reason}); write a backslash itself as "
                         "\\\\") from None


def cmd_generate(args) -> int:
    from dllm.generate import _shared_stream, generate

    prompts = list(args.prompt or [])
    for i, p in enumerate(prompts, 1):
        if not p.strip():  # an unset shell variable ("$PROMPT") decoded as an empty prompt
            raise ValueError(f"PROMPT {i} is empty ({p!r}); give the text to answer")
    if args.batch_file:
        prompts += _read_batch_file(args.batch_file)
    prompts = [_unescape(p) if args.escapes and isinstance(p, str) else p for p in prompts]
    if not prompts:
        raise ValueError("give a PROMPT or --batch-file")
    if args.trace_out:
        checks.picture_file(args.trace_out, "--trace-out")
    theirs = None
    if args.compare:
        if not args.trace_out:
            raise ValueError("--compare draws a picture: give --trace-out FILE.png or FILE.html")
        if Path(args.trace_out).suffix.lower() == ".gif":  # of checks.PICTURE_TYPES, the one a comparison lacks
            raise ValueError("--compare draws FILE.png or FILE.html (a GIF shows one run)")
        from dllm.samplers import get_sampler

        theirs = get_sampler(args.compare)  # an unknown name is refused before the model loads
    checks.positive(args.max_rows, "--max-rows")
    config, sampler = check_decode_args(args, prompts, also=theirs)  # before the model loads
    if args.max_rows is not None and _shared_stream(sampler):
        raise ValueError("--max-rows needs each row's own random stream; the sampler's noise_scope must be 'row'")
    model = load_model_arg(args)
    if args.trace_out:
        import dataclasses

        config = dataclasses.replace(config, record_confidence=True)
    out = generate(model, prompts, config, sampler=sampler, cache=args.cache, max_rows=args.max_rows)
    s = out.stats
    if args.trace_out:
        _draw_traces(args, model, prompts, config, sampler, theirs, out)
    guided = None
    if getattr(sampler, "name", None) == "guided" or args.sampler == "guided":
        from dllm.samplers.guided import guided_summary

        guided = guided_summary(s)
    if args.json:
        print(json.dumps({
            "sequences": out.sequences.tolist(), "texts": out.texts, "nfe": s.nfe, "row_nfe": s.row_nfe,
            "tokens_per_forward": s.tokens_per_forward, "finish_step": s.finish_step,
            "time": {"model": s.time_model, "sampler": s.time_sampler, "cache": s.time_cache, "total": s.time_total},
            **({"guided": guided} if guided is not None else {}),
        }))
    else:
        for text in out.texts:
            print(text)
        extra = ""
        if guided is not None:
            extra = (f", AR forwards {guided['ar_forwards']}, {guided['accepted_per_verification']:.2f} drafts "
                     f"accepted/verification, acceptance {guided['acceptance_rate']:.2f}")
        print(f"[nfe {s.nfe}, {s.tokens_per_forward:.2f} tokens/forward, {s.time_total:.2f}s{extra}]", file=sys.stderr)
    return 0


def _draw_traces(args, model, prompts, config, sampler, theirs, out) -> None:
    """``--trace-out`` (and ``--compare``, whose sampler is ``theirs``): one picture per prompt, captioned with the
    prompt, model, sampler and its ``--param`` settings."""
    from dllm.assets import DEFAULT_MODEL
    from dllm.cli.common import parse_params
    from dllm.generate import default_sampler, generate
    from dllm.viz import render, render_compare, run_info

    tok = getattr(model, "tokenizer", None)
    name = args.model or DEFAULT_MODEL
    main = sampler if sampler is not None else default_sampler(model)
    params = parse_params(args.param)
    # the caption names the cache that ran (recorded in the output); --cache none is named too
    infos = [run_info(p, name, main, params, args.cache) for p in prompts]
    other = None
    if theirs is not None:
        other = generate(model, prompts, config, sampler=theirs)
        other_infos = [run_info(p, name, theirs) for p in prompts]
        s = other.stats
        print(f"[--compare {args.compare}: nfe {s.nfe}, {s.tokens_per_forward:.2f} tokens/forward]", file=sys.stderr)
    for row in range(len(prompts)):
        path = Path(args.trace_out)
        if len(prompts) > 1:
            path = path.with_name(f"{path.stem}-{row}{path.suffix}")
        if other is None:
            render(out, path, row=row, tokenizer=tok, info=infos[row])
        else:
            render_compare([out, other], path, row=row, tokenizer=tok, infos=[infos[row], other_infos[row]],
                           labels=[infos[row]["sampler"], other_infos[row]["sampler"]])
        print(f"[trajectory of row {row}: {path}]", file=sys.stderr)


def cmd_samplers(args) -> int:
    from dllm.samplers import list_samplers

    for e in list_samplers():
        print(f"{e.name}: {e.description}")
        for k, v in e.params().items():
            print(f"    {k} = {v!r}")
    return 0


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text with a model (default: the bundled llada-tiny)")
    g.add_argument("prompt", nargs="*", help="prompt text(s); the chat template is applied")
    g.add_argument("--batch-file", help="file with one prompt per line: plain text, {\"prompt\": ...}, or a JSON "
                   "list of chat messages or of token ids (other lines starting with '[' are plain text)")
    g.add_argument("--max-rows", type=int, default=None,
                   help="continuous batching: decode at most N prompts at once, a finished row's place taken by the "
                        "next prompt (default: every prompt in one batch; the same outputs)")
    g.add_argument("--escapes", action="store_true", help=r"interpret backslash escapes such as \n in prompts")
    g.add_argument("--json", action="store_true", help="print sequences, texts, nfe and timing as JSON")
    g.add_argument("--trace-out", metavar="FILE", default=None,
                   help="draw the decoding trajectory to FILE.png, FILE.gif or FILE.html (one file per prompt: "
                        "FILE-0.png, ... when there are several)")
    g.add_argument("--compare", metavar="SAMPLER", default=None,
                   help="with --trace-out FILE.png|.html: also decode with SAMPLER (its defaults and its own "
                        "cache; the same lengths and seed) and draw both trajectories side by side")
    add_decode_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("samplers", help="list samplers with their parameters and defaults")
    s.set_defaults(func=cmd_samplers)
