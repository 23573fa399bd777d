"""OpenAI-compatible HTTP server over :class:`dllm.serve.Engine` (FastAPI).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` as server-sent events in the
OpenAI chunk format: the final left-to-right prefix as it becomes final, then the finish reason and usage),
``GET /v1/models``, ``GET /health`` (503 when the engine is not stepping), ``GET /metrics`` (Prometheus text
format, ``prometheus-client``).

Every request body is checked by the pydantic models of :mod:`dllm.serve.protocol` before anything runs; the
body is read with a size limit (413), and parsing, checking and tokenising run in worker threads, never on the
event loop. Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad field
(named, with the fix) or malformed HTTP, 401 without the ``--api-key`` bearer key, 404 for an unknown model or path, 405, 408 for a
body that does not arrive within ``--read-timeout``, 413, 429 when the queue is full, 431 for headers over
``MAX_HEADER_BYTES`` (:func:`header_deadline`), 503 when the engine is not
running or when more connections are open, or requests in flight, than ``--limit-concurrency``. A client that disconnects (streaming or not, or while sending its body: 499, logged at debug level only)
frees its rows at the next step. docs/serving.md lists the fields that work and the ones refused.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import math
import time
import uuid
from typing import Any

from dllm.ops import shown
from dllm.serve.engine import Engine, QueueFull, RequestError, check_positive
from dllm.serve.protocol import BadRequest, escaped, parse

try:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError as exc:  # pragma: no cover - exercised only without the serve extra
    raise ImportError("the server's /metrics needs prometheus-client: pip install 'dllm[serve]'") from exc

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect
except ImportError as exc:  # pragma: no cover - exercised only without the serve extra
    raise ImportError("the server needs FastAPI and uvicorn: pip install 'dllm[serve]'") from exc

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024  # default request body limit (413 above it)
HEALTH_STALL_S = 60.0  # /health is 503 when requests are pending and the loop has not ticked for this long
_CONTEXT = 6  # ids decoded before a streamed answer's unfixed tail (``_Text._upto``)
INLINE_DECODE = 64  # answers up to this many tokens are detokenised on the event loop, longer ones in a thread
SHUTDOWN_TIMEOUT_S = 60  # on SIGTERM, connections still open after this long are closed
READ_TIMEOUT_S = 30.0  # a request's headers, then its body, must arrive within this long (closed / 408 after it)
MAX_HEADER_BYTES = 64 * 1024  # a request line and headers larger than this get 431 (uvicorn's httptools has no limit)
MAX_MESSAGE_CHARS = 1000  # an error message longer than this keeps its start and its end (the fix)
LIMIT_CONCURRENCY = 512  # open connections (and requests in flight) before a request gets 503: what slow clients can hold
_KINDS = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error"}


def _error(status: int, message: str, param: str | None = None, kind: str | None = None, code: str | None = None):
    """An error response in OpenAI's shape. The message is cut in its middle to :data:`MAX_MESSAGE_CHARS` (a
    library's check may repeat a client's value whole) and, like ``param``, has any lone surrogate of the client's
    escaped (the body must encode as UTF-8)."""
    kind = kind or _KINDS.get(status, "invalid_request_error" if status < 500 else "server_error")
    message = escaped(message)
    if len(message) > MAX_MESSAGE_CHARS:
        half = MAX_MESSAGE_CHARS // 2
        message = f"{message[:half]} [... {len(message) - 2 * half} characters cut ...] {message[-half:]}"
    param = escaped(param) if isinstance(param, str) else param
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _EngineCollector:
    """The engine's counters, read at each scrape (Prometheus client library)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        yield GaugeMetricFamily("dllm_queue_waiting", "requests waiting for a row", value=s["waiting"])
        yield GaugeMetricFamily("dllm_rows_running", "requests being decoded", value=s["running"])
        yield GaugeMetricFamily("dllm_engine_alive", "1 while the engine loop runs", value=int(s["alive"]))
        req = CounterMetricFamily("dllm_requests", "finished requests by outcome", labels=["outcome"])
        for k, v in s["requests"].items():
            req.add_metric([k], v)
        yield req
        yield CounterMetricFamily("dllm_requests_retried", "requests retried alone after their batch failed",
                                  value=s["retried"])
        yield CounterMetricFamily("dllm_engine_errors", "exceptions the engine caught while serving (each failed "
                                  "the requests it concerned)", value=s["engine_errors"])
        yield CounterMetricFamily("dllm_forwards", "model forwards (one per batch step)", value=s["forwards"])
        yield CounterMetricFamily("dllm_request_nfe", "forwards summed over finished requests (NFE)",
                                  value=s["request_nfe"])
        yield CounterMetricFamily("dllm_request_positions", "generated positions of finished requests "
                                  "(/ dllm_request_nfe: tokens per forward)", value=s["request_positions"])
        yield CounterMetricFamily("dllm_answer_tokens", "answer tokens (before EOS) of finished requests "
                                  "(rate: answer tokens/s)", value=s["tokens"])
        yield CounterMetricFamily("dllm_step_seconds", "seconds spent in decode steps", value=s["step_seconds"])
        yield CounterMetricFamily("dllm_logits_columns", "(row, column) logits the steps computed: each batch's rows "
                                  "times their windows (each row's own, or the union of the rows')",
                                  value=s["logits_columns"])
        yield CounterMetricFamily("dllm_own_logits_columns", "of dllm_logits_columns, those in each row's own window "
                                  "(the ratio: the share of the output head's and the samplers' work the rows read)",
                                  value=s["own_logits_columns"])
        yield _paths("dllm_forward_paths", "forwards by how they ran: CUDA graph replays and captures, eager and "
                     "why (full forwards included)", s["graphs"])
        yield _paths("dllm_step_paths", "steps' work after their forwards (sampler, commits, bookkeeping) by how it "
                     "ran: CUDA graph replays and captures, eager and why", s["step_graphs"])
        yield CounterMetricFamily("dllm_graphs_evicted", "CUDA graphs dropped to keep the most recently used (or "
                                  "because the model's weights moved)",
                                  value=s["graphs"].get("evicted", 0))
        yield GaugeMetricFamily("dllm_graph_pool_bytes", "free K/V buffers the graph path keeps for later batches",
                                value=s["graph_pool_bytes"])


def _paths(name: str, doc: str, counts: dict) -> CounterMetricFamily:
    """A graph runner's counts (:attr:`GraphRunner.stats` or ``tail_stats``) as a counter labelled ``how``; the
    evictions are a metric of their own."""
    family = CounterMetricFamily(name, doc, labels=["how"])
    for k, v in sorted(counts.items()):
        if k != "evicted":
            family.add_metric([k], v)
    return family


class _Auth:
    """``Authorization: Bearer KEY`` on ``/v1/*`` (a plain ASGI middleware: disconnects reach the endpoints)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                resp = _error(401, "missing or wrong API key (Authorization: Bearer KEY)")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Text:
    """One choice's answer text as its final token ids arrive: cut at the first EOS/EOT and at the first ``stop``
    string; the tail that may still grow into a stop string (or is an incomplete UTF-8 character, or the last
    ids' text where the decoder may rewrite it: :func:`_prefix_stable`) is held back until it cannot. Each piece
    decodes a bounded number of ids (:meth:`_upto`). With log-probabilities, ``entries`` holds each fed token's
    entry (the engine's ``logprobs`` events); :meth:`take` hands out those of the tokens whose text is all sent."""

    def __init__(self, tokenizer, eos: set, stops: list[str]):
        self.tok, self.eos, self.stops = tokenizer, eos, stops
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False
        self.text = ""
        self.entries: list = []  # (log-probability, top) per fed token
        self.taken = 0  # entries handed out
        self.covered = 0  # answer tokens whose text is all sent
        self.offset = 0  # text_offset of the next entry handed out (completions)
        self.end: int | None = None  # index of the first EOS/EOT among the ids
        self.fixed = 0  # answer tokens whose text, ``fixed_text``, no later token changes
        self.fixed_text = ""
        self.longest = max((len(s) for s in stops), default=0)
        self.rewrites = not _prefix_stable(tokenizer)  # only the fixed text is sent before the end (_prefix_stable)

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True) if self.tok is not None else ""

    def _upto(self, n: int) -> str:
        """The text of the first ``n`` ids, as one decode of them all gives it, from the fixed text and a decode of
        the ids after it (with ``_CONTEXT`` ids before them, so that a tokenizer's joins, such as a word's leading
        space, come out as in the whole text): each call decodes a bounded number of ids, not the whole answer.
        Where the window's text does not extend its context's (a decoder that rewrites across the join), the whole
        answer is decoded. The fixed point then moves to ``_CONTEXT`` ids before the end, where the text up to it
        ends in a whole character."""
        k = self.fixed
        c = max(0, k - _CONTEXT)
        head = self._decode(self.ids[c:k])
        whole = self._decode(self.ids[c:n])
        if not whole.startswith(head):
            text = self._decode(self.ids[:n])
            if not text.startswith(self.fixed_text):  # not even the fixed text holds: decode it all from now on
                self.fixed, self.fixed_text = 0, ""
            return text
        text = self.fixed_text + whole[len(head):]
        k2 = n - _CONTEXT
        if k2 > k:
            upto = self._decode(self.ids[c:k2])
            if upto.startswith(head) and not upto.endswith("\ufffd"):
                fixed = self.fixed_text + upto[len(head):]
                if text.startswith(fixed):
                    self.fixed, self.fixed_text = k2, fixed
        return text

    def feed(self, ids: list[int], final: bool = False) -> str:
        """The text to send now."""
        start = len(self.ids)
        self.ids += ids
        if self.end is None:
            self.end = next((i for i in range(start, len(self.ids)) if self.ids[i] in self.eos), None)
        n = len(self.ids) if self.end is None else self.end
        stable = len(self.fixed_text)  # searched for the stop strings before, none found
        text = self._upto(n)
        # a stop string not found before ends after the text that was fixed then (and still is)
        frm = max(0, min(stable, len(self.fixed_text)) - self.longest + 1)
        hits = [i for i in (text.find(s, frm) for s in self.stops) if i >= 0]
        if hits:
            text, self.stopped, final = text[: min(hits)], True, True
        self.text = text
        safe = text
        if not final:
            if n < len(self.ids):  # EOS reached: nothing more will come
                final = True
            else:
                hold = max((_overlap(text, s) for s in self.stops), default=0)
                safe = text[: len(text) - hold]
                safe = safe.rstrip("\ufffd")  # an incomplete multi-byte character
                if self.rewrites:
                    safe = safe[:len(self.fixed_text)]
        piece = ""
        if len(safe) > len(self.sent) and safe.startswith(self.sent):
            piece, self.sent = safe[len(self.sent):], safe
        if self.entries:
            if self.stopped:
                self.covered = self.tokens()
            elif self.sent == text:
                self.covered = n
        return piece

    def take(self) -> list[tuple[int, tuple]]:
        """``(token id, entry)`` of the answer tokens whose text is sent and whose entries are not handed out."""
        got = list(zip(self.ids[self.taken:self.covered], self.entries[self.taken:self.covered]))
        self.taken = max(self.taken, self.covered)
        return got

    def tokens(self) -> int:
        """Answer tokens up to the cut (the fewest whose text covers it)."""
        n = len(self.ids) if self.end is None else self.end
        if not self.stopped:
            return n
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(self.ids[:mid])) >= len(self.text):
                hi = mid
            else:
                lo = mid + 1
        return lo


def _prefix_stable(tok) -> bool:
    """Whether the text of fewer ids is always the start of the text of more (up to an incomplete character at its
    end): a byte-level decoder without clean-up (every checkpoint format the project loads). Others may rewrite the
    text of the last few ids (WordPiece's clean-up joins "do n't", a byte fallback turns invalid with the next
    byte): their streams send the text of all but the last ``_CONTEXT`` ids until the answer ends."""
    if tok is None:
        return True
    decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel" and not getattr(tok, "clean_up_tokenization_spaces", False)


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of ``text`` that is the start of ``stop`` (shorter than ``stop``): the tail that
    may still grow into it. Only the ends starting with ``stop``'s first character are tried, and none longer than
    the text, so the work is bounded by the text held, not by the stop string's square."""
    i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while i >= 0:
        if stop.startswith(text[i:]):
            return len(text) - i
        i = text.find(stop[0], i + 1)
    return 0


def _json_logprob(lp: float) -> float | None:
    """A log-probability for JSON: -inf (a token whose logit is -inf) is -9999.0 (OpenAI's floor), NaN (no step
    committed the position; never an answer token) is null."""
    if math.isnan(lp):
        return None
    return max(lp, -9999.0)


def create_app(engine: Engine, model_name: str = "dllm", api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, health_stall_s: float = HEALTH_STALL_S,
               read_timeout_s: float = READ_TIMEOUT_S) -> FastAPI:
    """The FastAPI app over a started (or later started) ``engine``. ``read_timeout_s``: the time a request's body
    may take to arrive (408 after it)."""
    check_positive("max_body_bytes", max_body_bytes)
    check_read_timeout(read_timeout_s)
    app = FastAPI(title="dllm", version="1")
    tokenizer = getattr(engine.model, "tokenizer", None)

    @functools.lru_cache(maxsize=65536)
    def token_text(tid: int) -> str:
        """A token's own text (``token_id:N`` without a tokenizer)."""
        return tokenizer.decode([tid]) if tokenizer is not None else f"token_id:{tid}"

    def chat_logprobs(got: list) -> dict:
        """Chat's ``logprobs`` object for ``(token id, entry)`` pairs."""
        def one(tid, lp):
            t = token_text(tid)
            return {"token": t, "logprob": _json_logprob(lp), "bytes": list(t.encode("utf-8"))}
        return {"content": [{**one(tid, lp), "top_logprobs": [one(a, alp) for a, alp in top]}
                            for tid, (lp, top) in got]}

    def completion_logprobs(got: list, text: _Text) -> dict:
        """The completions ``logprobs`` object for ``(token id, entry)`` pairs; ``text_offset`` goes on from the
        choice's tokens already sent (each token's offset: the summed length of the earlier tokens' texts)."""
        tokens = [token_text(tid) for tid, _ in got]
        offsets = []
        for t in tokens:
            offsets.append(text.offset)
            text.offset += len(t)
        return {"tokens": tokens, "token_logprobs": [_json_logprob(lp) for _, (lp, _) in got],
                "top_logprobs": [{token_text(a): _json_logprob(alp) for a, alp in top} for _, (_, top) in got],
                "text_offset": offsets}
    eos = {t for t in (engine.model.eos_id, engine.model.eot_id) if t is not None}
    if api_key:
        app.add_middleware(_Auth, api_key=api_key)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                             str(exc.detail))
        return _error(exc.status_code, message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        err = (exc.errors() or [{}])[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        return _error(400, f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}", loc[0] if loc else None)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):  # a bug of the server's: logged, shaped
        log.error("unhandled error serving %s", request.url.path, exc_info=exc)
        return _error(500, "internal server error", kind="server_error")

    def _alive() -> str | None:
        s = engine.stats()
        if not s["alive"]:
            return "the engine is not running"
        age = s["last_tick_age"]
        if (s["waiting"] or s["running"]) and age is not None and age > health_stall_s:
            return f"the engine has not finished a step for {age:.0f} s"
        return None

    @app.get("/health")
    async def health():
        s = engine.stats()
        problem = _alive()
        body = {"status": "ok" if problem is None else "unavailable", "waiting": s["waiting"],
                "running": s["running"]}
        if problem is not None:
            body["reason"] = problem
            return JSONResponse(body, status_code=503)
        return body

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "dllm", "created": 0}]}

    registry = CollectorRegistry()
    registry.register(_EngineCollector(engine))

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)

    def _prepare(raw: bytes, chat: bool):
        """Parse, check and submit (tokenising): runs in a worker thread. Returns (request, handles, id)."""
        try:
            body = json.loads(raw)
        except RecursionError:
            raise BadRequest("the body is nested too deeply") from None
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the body is not valid JSON") from None
        req = parse(body, chat)
        if req.model is not None and req.model != model_name:
            raise BadRequest(f"model {shown(req.model)} does not exist; this server serves {model_name!r} "
                             f"(GET /v1/models)", "model", 404, "model_not_found")
        prompt = req.conversation() if chat else req.prompt
        params = dict(req.params or {})
        if req.temperature:
            params["temperature"] = req.temperature
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        n = req.n or 1
        if n > engine.max_queue:  # never fits: a 429 would have the client retry for ever
            raise BadRequest(f"n={n} choices need {n} places in the queue, more than this server's --max-queue of "
                             f"{engine.max_queue}; ask for at most {engine.max_queue} choices (or send several "
                             f"requests)", "n")
        held = engine.pending()
        if held + n > engine.max_queue:  # refused before any choice is tokenised and queued
            raise BadRequest(f"the engine holds {held} of its {engine.max_queue} requests, too many for {n} more; "
                             f"retry later", None, 429)
        handles = []
        try:
            for i in range(n):
                handles.append(engine.submit(
                    prompt, gen_length=req.gen_length, block_length=req.block_length, steps=req.steps,
                    sampler=req.sampler, params=params, seed=req.seed or 0,
                    eos_early_stop=bool(req.eos_early_stop), chat_template=chat, cache=req.cache,
                    canvas=bool(req.dllm_canvas), sample=i, request_id=rid if n == 1 else f"{rid}-{i}",
                    logprobs=req.top_k, top_p=req.top_p))
        except BaseException as exc:
            for h in handles:
                h.cancel()
            if isinstance(exc, QueueFull):
                raise BadRequest(str(exc), None, 429) from None
            if isinstance(exc, RequestError):
                msg = str(exc)
                param = {"gen_length": "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens",
                         "prompt": "messages" if chat else "prompt"}.get(exc.param, exc.param)
                if param is None:  # the settings' own checks name the field first
                    first = msg.split(":")[0].split("=")[0].split(" ")[0]
                    param = {"gen_length": "max_tokens"}.get(first, first)
                raise BadRequest(msg, param if param in type(req).model_fields else None) from None
            if isinstance(exc, Exception):  # e.g. a sampler's own checks raising something unexpected
                log.warning("request refused: %s: %s", type(exc).__name__, exc)
                raise BadRequest(f"the request cannot run: {type(exc).__name__}: {exc}") from None
            raise
        return req, handles, rid

    async def _read(request: Request) -> bytes | Response:
        """The body, read within ``read_timeout_s`` (a client that sends it slowly, or never, gets 408 and its
        connection closed instead of holding it) and ``max_body_bytes`` (413); a client that hangs up while sending
        it gets 499 (nobody reads it; not a server error)."""
        length = request.headers.get("content-length")
        too_big = (f"the body is larger than the server's limit of {max_body_bytes} bytes (--max-body-bytes); "
                   f"send a shorter prompt")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            return _error(413, too_big, code="request_too_large")

        async def collect() -> bytes | Response:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    return _error(413, too_big, code="request_too_large")
                chunks.append(chunk)
            return b"".join(chunks)

        try:  # asyncio.wait_for, not asyncio.timeout: Python 3.10 has no asyncio.timeout
            return await asyncio.wait_for(collect(), read_timeout_s)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            resp = _error(408, f"the request body did not arrive within {read_timeout_s:g} s (the server's "
                          f"--read-timeout); send the whole body at once", code="request_timeout")
            resp.headers["connection"] = "close"  # the rest of the body is never read: the connection cannot go on
            return resp
        except ClientDisconnect:
            log.debug("client disconnected while sending the body of %s", request.url.path)
            return Response(status_code=499)

    def _usage(results: list, texts: list[_Text]) -> dict:
        prompt = results[0].prompt_tokens if results else 0
        completion = sum(t.tokens() for t in texts)
        nfe = sum(r.nfe for r in results)
        positions = sum(len(r.tokens) for r in results)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "nfe": nfe, "tokens_per_forward": positions / max(nfe, 1)}

    async def _choice(i: int, handle, text: _Text, out: asyncio.Queue) -> None:
        """Runs one choice: puts ("text", i, piece, [(token id, logprob entry)]), ("canvas", i, step) and finally
        ("end", i, result)."""
        try:
            async for kind, value in handle.aevents():
                if kind == "canvas":
                    await out.put(("canvas", i, value))
                    continue
                if kind == "logprobs":  # the entries of the ids that come next
                    text.entries += value
                    continue
                if len(text.ids) + len(value) > INLINE_DECODE:  # detokenising a long answer: off the event loop
                    piece = await asyncio.to_thread(text.feed, value)
                else:
                    piece = text.feed(value)
                got = text.take()
                if piece or got:
                    await out.put(("text", i, piece, got))
                if text.stopped:  # the stop string is found: the row is freed, nothing past it is sent
                    handle.cancel()
                    break
            r = await handle.aresult()
            if not text.stopped:
                piece = await asyncio.to_thread(text.feed, [], True)
                got = text.take()
                if piece or got:
                    await out.put(("text", i, piece, got))
            await out.put(("end", i, r))
        except asyncio.CancelledError:
            handle.cancel()
            raise
        except Exception as exc:  # never leave the response waiting
            log.exception("streaming choice %d of %s failed", i, handle.request_id)
            handle.cancel()
            await out.put(("fail", i, f"{type(exc).__name__}: {exc}"))

    def _reason(r, text: _Text) -> str:
        return "stop" if text.stopped else r.finish_reason

    async def _serve(request: Request, chat: bool):
        raw = await _read(request)
        if isinstance(raw, Response):
            return raw
        if _alive() is not None:
            return _error(503, f"{_alive()}; retry later", code="engine_unavailable")
        try:
            req, handles, rid = await asyncio.to_thread(_prepare, raw, chat)
        except BadRequest as exc:
            return _error(exc.status, exc.message, exc.param, code=exc.code)
        created = int(time.time())
        texts = [_Text(tokenizer, eos, list(req.stop or [])) for _ in handles]
        echo = ""
        if not chat and req.echo:
            echo = req.prompt if isinstance(req.prompt, str) else (
                tokenizer.decode(req.prompt) if tokenizer is not None else "")
        out: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(_choice(i, h, t, out)) for i, (h, t) in enumerate(zip(handles, texts))]

        def release():
            for h in handles:
                if not h.done():
                    h.cancel()
            for t in tasks:
                t.cancel()

        if req.stream:  # release() also as a background task: it runs even if the stream never starts
            return StreamingResponse(_events(req, chat, rid, created, handles, texts, echo, out, release),
                                     media_type="text/event-stream", background=BackgroundTask(release))
        results: dict[int, Any] = {}
        pieces = [[] for _ in handles]
        got = [[] for _ in handles]  # (token id, logprob entry) per answer token
        failed = None
        loop = asyncio.get_running_loop()
        next_check = loop.time() + 0.25
        try:
            while len(results) < len(handles) and failed is None:
                try:
                    event = await asyncio.wait_for(out.get(), 0.25)
                except asyncio.TimeoutError:
                    event = None
                if loop.time() >= next_check:
                    next_check = loop.time() + 0.25
                    if await request.is_disconnected():  # the client gave up (or timed out): its rows are freed
                        release()
                        return Response(status_code=499)
                if event is None:
                    continue
                if event[0] == "text":
                    pieces[event[1]].append(event[2])
                    got[event[1]] += event[3]
                elif event[0] == "end":
                    results[event[1]] = event[2]
                elif event[0] == "fail":
                    failed = event[2]
        finally:
            release()
        errors = [r.error or "decoding failed" for r in results.values() if r.finish_reason == "error"]
        if failed or errors:
            return _error(500, failed or errors[0], kind="server_error")
        choices = []
        for i in range(len(handles)):
            text = echo + "".join(pieces[i])
            c: dict[str, Any] = {"index": i, "finish_reason": _reason(results[i], texts[i]), "logprobs": None}
            if req.top_k is not None:
                c["logprobs"] = chat_logprobs(got[i]) if chat else completion_logprobs(got[i], texts[i])
            if chat:
                c["message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            choices.append(c)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": choices,
                "usage": _usage([results[i] for i in range(len(handles))], texts)}

    async def _events(req, chat: bool, rid: str, created: int, handles, texts, echo: str, out, release):
        obj = "chat.completion.chunk" if chat else "text_completion"
        started = [False] * len(handles)

        def chunk(i: int, piece: str | None, reason: str | None = None, extra: dict | None = None,
                  got: list | None = None) -> str:
            lp = None
            if got is not None and req.top_k is not None:  # the entries of the tokens this chunk sends
                lp = chat_logprobs(got) if chat else completion_logprobs(got, texts[i])
            if chat:
                delta = {} if piece is None else {"content": piece}
                if not started[i] and piece is not None:
                    delta["role"] = "assistant"
                    started[i] = True
                c = {"index": i, "delta": delta, "finish_reason": reason}
                if req.top_k is not None:
                    c["logprobs"] = lp
            else:
                c = {"index": i, "text": piece or "", "finish_reason": reason, "logprobs": lp}
            ev = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [c]}
            if extra:
                ev.update(extra)
            return _sse(ev)

        results: dict[int, Any] = {}
        try:
            if echo:
                for i in range(len(handles)):
                    yield chunk(i, echo)
            while len(results) < len(handles):
                event = await out.get()
                kind, i = event[0], event[1]
                if kind == "canvas":  # opt-in: this step's committed positions (generation offsets -> ids)
                    yield chunk(i, None if chat else "", extra={"dllm": event[2]})
                elif kind == "text":
                    yield chunk(i, event[2], got=event[3])
                elif kind == "fail" or (kind == "end" and event[2].finish_reason == "error"):
                    msg = event[2] if kind == "fail" else (event[2].error or "decoding failed")
                    yield _sse({"error": {"message": msg, "type": "server_error", "param": None, "code": None}})
                    results[i] = None
                else:
                    results[i] = event[2]
                    usage = _usage([event[2]], [texts[i]]) if len(handles) == 1 else None
                    yield chunk(i, None, _reason(event[2], texts[i]), {"usage": usage} if usage else None)
            done = [r for r in results.values() if r is not None]
            include = (req.stream_options or {}).get("include_usage", False)
            if include or len(handles) > 1:
                usage = _usage(done, [texts[i] for i, r in results.items() if r is not None])
                yield _sse({"id": rid, "object": obj, "created": created, "model": model_name, "choices": [],
                            "usage": usage})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): free the rows still running
            release()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    return app


def serve(model, *, host: str = "127.0.0.1", port: int = 8000, model_name: str = "dllm", api_key: str | None = None,
          max_rows: int = 8, max_queue: int = 256, sampler: str | None = None, params: dict | None = None,
          log_level: str = "info", max_body_bytes: int = MAX_BODY_BYTES,
          shutdown_timeout: int = SHUTDOWN_TIMEOUT_S, graphs: str = "auto", guides=(),
          read_timeout: float = READ_TIMEOUT_S, limit_concurrency: int = LIMIT_CONCURRENCY,
          max_running: int | None = None) -> None:
    """Run the server until SIGINT / SIGTERM (uvicorn stops accepting and finishes the requests in flight, at
    most ``shutdown_timeout`` seconds: a client that never reads its stream cannot hold the shutdown).
    ``sampler`` / ``params``: the default of requests that name no sampler; ``graphs``: CUDA graphs for the cached
    steps; ``guides``: AR guide checkpoints requests may name besides the bundled ones; ``max_rows`` /
    ``max_running``: rows per batch / decoding at once (:class:`Engine`).
    ``read_timeout``: seconds a request's headers may take to arrive on a connection (from its opening, or from
    the previous response on it; the connection is closed after it: :func:`header_deadline`) and then its body
    (408 after it); ``limit_concurrency``: the connections (and requests) served at once; one more gets 503 in
    OpenAI's error shape (how much clients that send slowly, or never, can hold)."""
    import uvicorn

    check_port(port)
    check_read_timeout(read_timeout)
    check_positive("limit_concurrency", limit_concurrency)
    engine = Engine(model, max_rows=max_rows, max_queue=max_queue, sampler=sampler, params=params, graphs=graphs,
                    guides=guides, max_running=max_running)
    app = create_app(engine, model_name, api_key, max_body_bytes=max_body_bytes, read_timeout_s=read_timeout)
    engine.start()
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                    http=header_deadline(read_timeout, limit_concurrency))
    finally:
        engine.stop(drain=True, timeout=60)


def header_deadline(seconds: float, limit_concurrency: int | None = None,
                    max_header_bytes: int = MAX_HEADER_BYTES) -> type:
    """uvicorn's HTTP protocol (httptools where installed, else h11: what its ``"auto"`` picks) with a deadline for a
    request's headers: a connection on which no request's headers have arrived ``seconds`` after it opened, or after
    its previous response, is closed. uvicorn has no such limit, and a connection limit counts connections, so
    without it a few hundred clients that send half a request line and wait hold every slot, and everyone else gets
    503 for as long as they like. (The body's deadline is the app's, :func:`create_app`; an idle keep-alive
    connection is closed sooner by uvicorn's own ``timeout_keep_alive``.)

    ``limit_concurrency``: with more open connections, or more requests in flight, than this, a request is answered
    503 in OpenAI's error shape and its connection closed (:func:`_concurrency_limited`; uvicorn's own limit answers
    in plain text).

    ``max_header_bytes``: a request whose request line and headers pass this many bytes is answered 431 in OpenAI's
    error shape and its connection closed (httptools, which uvicorn runs where installed, keeps every header a
    client sends: without it one connection can fill the server's memory with headers before the deadline; h11
    has a limit of its own)."""
    check_positive("max_header_bytes", max_header_bytes)
    too_large = _plain_response(431, "the request line and headers are larger than the server's limit of "
                                f"{max_header_bytes} bytes; send fewer or shorter headers", "headers_too_large")
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # pragma: no cover - httptools is optional
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class HeaderDeadline(base):
        _header_timer = None
        limit = limit_concurrency

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if limit_concurrency is not None:
                self.app = _concurrency_limited(self.app, self.connections, self.tasks, limit_concurrency)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def connection_lost(self, exc) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            self._disarm_header_deadline()
            self._header_timer = self.loop.call_later(seconds, self._header_deadline_passed)

        def _disarm_header_deadline(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        # httptools' callbacks (h11 calls none of these): the bytes of the request line and headers, counted from the
        # start of each request
        _header_bytes = 0
        _headers_refused = False

        def on_message_begin(self) -> None:
            self._header_bytes = 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count_header_bytes(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_header_bytes(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count_header_bytes(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > max_header_bytes and not self._headers_refused:
                self._headers_refused = True
                log.debug("refusing a request whose headers pass %d bytes", max_header_bytes)
                self.transport.write(too_large)
                self.transport.close()
            if self._headers_refused:
                raise _HeadersTooLarge()  # stops the parser (uvicorn's own 400 is not sent: send_400_response)

        def data_received(self, data: bytes) -> None:
            if not self._headers_refused:  # after the 431 nothing more is read
                super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request its parser refuses (malformed HTTP), in OpenAI's error shape instead of
            plain text; nothing when the parser was stopped by the header limit (the 431 is sent already)."""
            if self._headers_refused:
                return
            self.transport.write(_plain_response(
                400, f"the request is not valid HTTP/1.1 ({msg.rstrip('.')}); check the request line, the headers "
                "(Content-Length a number of bytes) and the body's framing", "invalid_http_request"))
            self.transport.close()

        def _header_deadline_passed(self) -> None:
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:  # no request's headers since: a stalled client
                log.debug("closing a connection whose request headers did not arrive within %g s", seconds)
                self.transport.close()

    return HeaderDeadline


class _HeadersTooLarge(Exception):
    """Raised in the HTTP parser's callback to stop parsing a request whose headers passed the limit."""


def _plain_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape, written by the protocol itself (the app never sees the
    request), with the connection closed after it."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    reason = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}.get(status, b"Error")
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, reason, len(body))) + body


def _concurrency_limited(app, connections, tasks, limit: int):
    """``app`` behind a limit: an HTTP request that arrives while more than ``limit`` connections are open (its own
    among them) or more than ``limit`` requests are in flight (its own among them) gets 503 in OpenAI's error shape,
    with ``Retry-After`` and its connection closed, before the app sees it. ``connections`` / ``tasks``: uvicorn's
    server-wide sets, which its protocols keep."""
    body = json.dumps({"error": {"message": f"the server is at its limit of {limit} open connections or requests "
                                            "in flight; retry later (dllm serve --limit-concurrency sets it)",
                                 "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"retry-after", b"1"), (b"connection", b"close")]

    async def limited(scope, receive, send):
        if scope["type"] == "http" and (len(connections) > limit or len(tasks) > limit):
            log.warning("refused a request: %d connections open, %d requests in flight (limit %d)",
                        len(connections), len(tasks), limit)
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    return limited


def check_read_timeout(seconds) -> None:
    """Seconds a request body may take to arrive: a positive, finite number."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ValueError(f"body timeout {seconds!r} must be a positive number of seconds (e.g. 30)")


def check_port(port) -> None:
    """A TCP port to listen on: 1-65535 (0 would listen on a random port)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port {port!r} is out of range; use a TCP port from 1 to 65535")
