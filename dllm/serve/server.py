"""OpenAI-compatible HTTP server over :class:`dllm.serve.Engine` (FastAPI).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` as server-sent events in the
OpenAI chunk format: the final left-to-right prefix as it becomes final, then the finish reason and usage),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format, ``prometheus-client``).

OpenAI fields: ``max_tokens`` (-> ``gen_length``, default 64), ``temperature``, ``seed``, ``stream``, ``n`` (1
only), ``stop`` (strings: the text is cut at the first one). dLLM fields in the request body (``extra_body``
with the ``openai`` client): ``sampler`` and ``params`` (a dict of its parameters), ``steps``,
``block_length``, ``eos_early_stop``, ``cache`` (default: the preset's own), ``dllm_canvas`` (with ``stream``:
also a chunk per step with ``"dllm": {"step", "committed": {offset: token id}}``). ``usage`` adds ``nfe`` and ``tokens_per_forward`` to the token counts.
Errors are 400 with an OpenAI-style body naming the field, 401 without the ``--api-key`` bearer key, 429 when
the queue is full.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from dllm.serve.engine import Engine, QueueFull, RequestError

try:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError as exc:  # pragma: no cover - exercised only without the serve extra
    raise ImportError("the server's /metrics needs prometheus-client: pip install 'dllm[serve]'") from exc

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
except ImportError as exc:  # pragma: no cover - exercised only without the serve extra
    raise ImportError("the server needs FastAPI and uvicorn: pip install 'dllm[serve]'") from exc

DLLM_FIELDS = ("sampler", "params", "steps", "block_length", "eos_early_stop", "cache", "dllm_canvas")


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def _cut(text: str | None, stop) -> tuple[str, bool]:
    """``text`` cut at the first of the ``stop`` strings; whether it was cut."""
    text = text or ""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class _EngineCollector:
    """The engine's counters, read at each scrape (Prometheus client library)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        yield GaugeMetricFamily("dllm_queue_waiting", "requests waiting for a row", value=s["waiting"])
        yield GaugeMetricFamily("dllm_rows_running", "requests being decoded", value=s["running"])
        req = CounterMetricFamily("dllm_requests", "finished requests by outcome", labels=["outcome"])
        for k, v in s["requests"].items():
            req.add_metric([k], v)
        yield req
        yield CounterMetricFamily("dllm_forwards", "model forwards (one per batch step)", value=s["forwards"])
        yield CounterMetricFamily("dllm_request_nfe", "forwards summed over finished requests (NFE)",
                                  value=s["request_nfe"])
        yield CounterMetricFamily("dllm_request_positions", "generated positions of finished requests "
                                  "(/ dllm_request_nfe: tokens per forward)", value=s["request_positions"])
        yield CounterMetricFamily("dllm_answer_tokens", "answer tokens (before EOS) of finished requests "
                                  "(rate: answer tokens/s)", value=s["tokens"])
        yield CounterMetricFamily("dllm_step_seconds", "seconds spent in decode steps", value=s["step_seconds"])


class _Body:
    """A request body checked field by field (a wrong field is a 400 naming it)."""

    def __init__(self, body: dict):
        self.body = body

    def get(self, name: str, kind, default=None, check=None, fix: str = ""):
        v = self.body.get(name, default)
        if v is None:
            return default
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, kind) or (kind in (int, float) and isinstance(v, bool)):
            raise RequestError(f"{name}: expected {getattr(kind, '__name__', kind)}, got {v!r}{fix}", )
        if check is not None and not check(v):
            raise RequestError(f"{name}={v!r} is out of range{fix}")
        return v


def create_app(engine: Engine, model_name: str = "dllm", api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="dllm", version="1")
    tokenizer = getattr(engine.model, "tokenizer", None)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return _error(401, "missing or wrong API key (Authorization: Bearer KEY)", kind="authentication_error")
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", **{k: v for k, v in engine.stats().items() if k in ("waiting", "running")}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "dllm", "created": 0}]}

    registry = CollectorRegistry()
    registry.register(_EngineCollector(engine))

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)

    def _submit(body: dict, prompt, chat: bool):
        b = _Body(body)
        n = b.get("n", int, 1)
        if n != 1:
            raise RequestError("n: only n=1 is served; send n requests instead")
        temperature = b.get("temperature", float, 0.0, lambda v: 0 <= v < 100, "; use 0 for greedy decoding")
        params = dict(b.get("params", dict, {}))
        if temperature > 0:
            params["temperature"] = temperature
        return engine.submit(
            prompt, gen_length=b.get("max_tokens", int, 64, lambda v: v >= 1, "; max_tokens must be >= 1"),
            block_length=b.get("block_length", int, None), steps=b.get("steps", int, None),
            sampler=b.get("sampler", str, None), params=params, seed=b.get("seed", int, 0),
            eos_early_stop=b.get("eos_early_stop", bool, False), chat_template=chat, cache=b.get("cache", str, None),
            canvas=b.get("dllm_canvas", bool, False) and bool(body.get("stream")),
            request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}")

    def _usage(r) -> dict:
        return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                "total_tokens": r.prompt_tokens + r.completion_tokens, "nfe": r.nfe,
                "tokens_per_forward": len(r.tokens) / max(r.nfe, 1)}

    async def _serve(request: Request, chat: bool):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        key = "messages" if chat else "prompt"
        prompt = body.get(key)
        if chat and not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m
                                                                      for m in prompt)):
            return _error(400, "messages: a non-empty list of {role, content} objects", "messages")
        if not chat:
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                                and all(isinstance(t, int) for t in prompt))):
                return _error(400, "prompt: a string or a list of token ids (one prompt per request)", "prompt")
        unknown_dllm = [k for k in body if k in DLLM_FIELDS and body[k] is None]
        if unknown_dllm:
            return _error(400, f"{unknown_dllm[0]}: null is not allowed", unknown_dllm[0])
        try:
            handle = _submit(body, prompt, chat)
        except QueueFull as exc:
            return _error(429, str(exc), kind="rate_limit_error")
        except RequestError as exc:
            msg = str(exc)
            return _error(400, msg, msg.split(":")[0].split("=")[0] if msg[:1].isalpha() else None)
        created = int(time.time())
        stop = body.get("stop")
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            try:
                r = await asyncio.to_thread(handle.result)
            except asyncio.CancelledError:
                handle.cancel()
                raise
            if r.finish_reason == "error":
                return _error(500, r.error or "decoding failed", kind="server_error")
            text, cut = _cut(r.text, stop)
            reason = "stop" if cut else r.finish_reason
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return {"id": handle.request_id, "object": obj, "created": created, "model": model_name,
                    "choices": [choice], "usage": _usage(r)}
        return StreamingResponse(_events(handle, chat, created, stop), media_type="text/event-stream")

    async def _events(handle, chat: bool, created: int, stop):
        obj = "chat.completion.chunk" if chat else "text_completion"
        ids: list[int] = []
        sent = ""
        stops = {t for t in (engine.model.eos_id, engine.model.eot_id) if t is not None}

        def chunk(piece: str | None, reason: str | None, usage: dict | None = None, extra: dict | None = None) -> str:
            if chat:
                delta = {} if piece is None else {"content": piece}
                if not sent and piece is not None:
                    delta["role"] = "assistant"
                c = {"index": 0, "delta": delta, "finish_reason": reason}
            else:
                c = {"index": 0, "text": piece or "", "finish_reason": reason, "logprobs": None}
            out = {"id": handle.request_id, "object": obj, "created": created, "model": model_name, "choices": [c]}
            if usage is not None:
                out["usage"] = usage
            if extra is not None:
                out.update(extra)
            return f"data: {json.dumps(out)}\n\n"

        it = handle.events()
        cut = False
        try:
            while True:
                event = await asyncio.to_thread(next, it, None)
                if event is None:
                    break
                kind, piece = event
                if kind == "canvas":  # opt-in: this step's committed positions (generation offsets -> ids)
                    yield chunk(None if chat else "", None, extra={"dllm": piece})
                    continue
                ids += piece
                n = next((i for i, t in enumerate(ids) if t in stops), len(ids))
                text = tokenizer.decode(ids[:n], skip_special_tokens=True) if tokenizer is not None else ""
                text, cut = _cut(text, stop)
                if len(text) > len(sent) and text.startswith(sent):
                    yield chunk(text[len(sent):], None)
                    sent = text
            r = handle.result()
            reason = "stop" if cut else r.finish_reason
            yield chunk(None, reason, _usage(r))
            yield "data: [DONE]\n\n"
        finally:
            if not handle.done():  # the client went away: free its row at the next step
                handle.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    return app


def serve(model, *, host: str = "127.0.0.1", port: int = 8000, model_name: str = "dllm", api_key: str | None = None,
          max_rows: int = 8, max_queue: int = 256, sampler: str | None = None, params: dict | None = None,
          log_level: str = "info") -> None:
    """Run the server until SIGINT / SIGTERM (uvicorn stops accepting and finishes the requests in flight).
    ``sampler`` / ``params``: the default of requests that name no sampler (:class:`Engine`)."""
    import uvicorn

    engine = Engine(model, max_rows=max_rows, max_queue=max_queue, sampler=sampler, params=params)
    engine.start()
    try:
        uvicorn.run(create_app(engine, model_name, api_key), host=host, port=port, log_level=log_level)
    finally:
        engine.stop(drain=True)
