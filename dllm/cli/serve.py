"""``dllm serve``: the OpenAI-compatible HTTP server (docs/serving.md)."""

from __future__ import annotations

from dllm.cli.common import load_model_arg, parse_params


def cmd_serve(args) -> int:
    from dllm.serve.engine import RequestError
    from dllm.serve.server import check_port, check_read_timeout, serve

    params = parse_params(args.param, args.sampler)
    if params and not args.sampler:
        raise ValueError("--param needs --sampler")
    if args.sampler:  # the sampler and its parameters, before the model loads
        from dllm.samplers import get_sampler

        try:
            get_sampler(args.sampler, **params)
        except (ValueError, TypeError) as exc:
            msg = str(exc)  # named once: get_sampler's own messages start with the sampler's name
            raise ValueError(msg if msg.startswith(f"{args.sampler}:") else
                             f"--sampler {args.sampler}: {msg}") from None
    try:  # before the model loads
        check_port(args.port)
    except ValueError as exc:
        raise ValueError(f"--port: {exc}") from None
    for name in ("max_rows", "max_running", "max_queue", "max_body_bytes", "limit_concurrency"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        check_read_timeout(args.read_timeout)
    except ValueError as exc:
        raise ValueError(f"--read-timeout: {exc}") from None
    from dllm.cli import checks

    checks.dtype_name(args.dtype)  # before the model loads: its dtype, device, config.json, the guides allowed
    checks.device_name(args.device)
    checks.host_name(args.host)
    checks.model_dir(args.model)
    guides = list(args.guide or [])
    for g in guides:  # each a causal LM checkpoint directory, as `dllm generate --guide` requires
        checks.guide_dir(g)
    model = load_model_arg(args)
    try:
        serve(model, host=args.host, port=args.port, model_name=args.served_name or args.model or "llada-tiny",
              api_key=args.api_key, max_rows=args.max_rows, max_queue=args.max_queue, sampler=args.sampler,
              params=params, max_body_bytes=args.max_body_bytes, graphs=args.graphs, guides=guides,
              read_timeout=args.read_timeout, limit_concurrency=args.limit_concurrency, max_running=args.max_running)
    except RequestError as exc:
        raise ValueError(str(exc)) from None
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching (docs/serving.md)")
    s.add_argument("--model", default=None, help="checkpoint directory or bundled name (default: llada-tiny)")
    s.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    s.add_argument("--device", default=None)
    s.add_argument("--sampler", default=None, help="sampler of requests that name none (default: the family's "
                   "baseline, llada / dream); requests may name another with their 'sampler' field")
    s.add_argument("--param", action="append", metavar="K=V", help="parameter of --sampler, repeatable")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-name", default=None, help="model name in the API (default: --model)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    s.add_argument("--max-rows", type=int, default=8, help="rows per batch (default 8)")
    s.add_argument("--max-running", type=int, default=None,
                   help="rows decoding at once, every batch together (requests with other settings, e.g. another "
                        "seed, decode in batches of their own); more wait in the queue (default 4 x --max-rows)")
    s.add_argument("--max-queue", type=int, default=256, help="requests waiting or running before 429 (default 256)")
    s.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body in bytes; larger ones get 413 (default 4 MiB)")
    s.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a request's headers may take to arrive on a connection (else it is closed), then its "
                        "body (else 408) (default 30)")
    s.add_argument("--limit-concurrency", type=int, default=512,
                   help="open connections and requests before new ones get 503 (default 512): what clients that "
                        "send slowly, or never, can hold")
    s.add_argument("--guide", action="append", metavar="PATH",
                   help="an AR guide checkpoint directory requests of the 'guided' sampler may name (params.guide: "
                        "the path or its directory's name), repeatable; without it only the bundled guides (ar-tiny)")
    s.add_argument("--graphs", default="auto", choices=["auto", "on", "off"],
                   help="CUDA graphs for the cached decode steps (default auto: on CUDA devices); off runs every "
                        "forward eagerly (docs/serving.md: how often a served batch's shapes repeat)")
    s.set_defaults(func=cmd_serve)
