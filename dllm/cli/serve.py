"""``dllm serve``: the OpenAI-compatible HTTP server (docs/serving.md)."""

from __future__ import annotations

from dllm.cli.common import load_model_arg


def cmd_serve(args) -> int:
    from dllm.serve.server import serve

    model = load_model_arg(args)
    serve(model, host=args.host, port=args.port, model_name=args.served_name or args.model or "llada-tiny",
          api_key=args.api_key, max_rows=args.max_rows, max_queue=args.max_queue)
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching (docs/serving.md)")
    s.add_argument("--model", default=None, help="checkpoint directory or bundled name (default: llada-tiny)")
    s.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    s.add_argument("--device", default=None)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-name", default=None, help="model name in the API (default: --model)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    s.add_argument("--max-rows", type=int, default=8, help="rows per batch (default 8)")
    s.add_argument("--max-queue", type=int, default=256, help="requests waiting or running before 429 (default 256)")
    s.set_defaults(func=cmd_serve)
