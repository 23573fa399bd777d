"""The OpenAI request bodies the server accepts, as pydantic models: every field is checked before anything runs,
and a field the server does not implement is refused with a message naming it (never silently ignored).

A failed check is a :class:`BadRequest` naming the field (``param``) and the fix; the server answers it with 400
in OpenAI's error shape. :data:`REFUSED` lists the OpenAI fields refused unless they hold their neutral value.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, model_validator

from dllm.ops import SHOWN_CHARS, shown

SEED_MAX = 2**63 - 1
MAX_N = 16
MAX_STOPS = 4
MAX_STOP_CHARS = 1000  # characters per stop string (the held-back tail is checked against each one as text arrives)
MAX_TOP_LOGPROBS = 20  # alternatives per token (top_logprobs; completions' logprobs)
ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name for system


_SURROGATE = re.compile("[\ud800-\udfff]")


class BadRequest(ValueError):
    """A request that fails a check: ``message`` names the field and the fix, ``param`` the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def _int(lo: int, hi: int | None = None, fix: str = ""):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"expected an integer, got {shown(v)}{fix}")
        if v < lo or (hi is not None and v > hi):
            bound = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
            raise ValueError(f"{v} is out of range: an integer {bound}{fix}")
        return v
    return Annotated[Any, AfterValidator(check)]


def _number(lo: float, hi: float, fix: str = ""):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"expected a number, got {shown(v)}{fix}")
        if not lo <= v <= hi:
            raise ValueError(f"{v} is out of range: a number from {lo} to {hi}{fix}")
        return float(v)
    return Annotated[Any, AfterValidator(check)]


def _typed(kind, name: str):
    def check(v):
        if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
            raise ValueError(f"expected {name}, got {shown(v)}")
        return v
    return Annotated[Any, AfterValidator(check)]


def _stop(v):
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ValueError(f"expected a string or a list of strings, got {shown(v)}")
    if not v:  # no stop strings: as if left out
        return None
    if len(v) > MAX_STOPS:
        raise ValueError(f"{len(v)} stop strings; at most {MAX_STOPS}")
    if any(not s for s in v):
        raise ValueError("stop strings must not be empty")
    longest = max(len(s) for s in v)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"a stop string of {longest} characters; at most {MAX_STOP_CHARS} characters each")
    return v


def _finite(v, where: str = ""):
    """Every number inside the sampler's ``params`` is finite: JSON's NaN / Infinity (which Python's parser
    accepts) never reach a sampler (each sampler checks its own ranges too; this is the net under them)."""
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{where or 'a value'} is {shown(v)}; every number in params must be finite")
    if isinstance(v, dict):
        for k, x in v.items():
            _finite(x, f"{where}.{k}" if where else str(k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _finite(x, f"{where}[{i}]")
    return v


def _neutral(name: str, neutral: tuple, fix: str):
    def check(v):
        if not any(v is n or (v == n and type(v) is type(n)) for n in neutral):
            raise ValueError(f"not supported by this server{fix}")
        return v
    return Annotated[Any, AfterValidator(check)]


Int = _typed(int, "an integer")
Bool = _typed(bool, "true or false")
Str = _typed(str, "a string")
Dict = _typed(dict, "an object")

# OpenAI fields refused unless they hold their neutral value (what leaving them out means)
REFUSED = {
    "presence_penalty": ((0, 0.0), "; only 0"),
    "frequency_penalty": ((0, 0.0), "; only 0"),
    "logit_bias": (({},), "; leave it out"),
    "best_of": ((1,), "; send n requests (or n) instead"),
    "suffix": (("",), "; diffusion infilling is not served, leave it out"),
    "tools": (([],), "; tool calling is not served"),
    "tool_choice": (("none",), "; tool calling is not served"),
    "parallel_tool_calls": ((False,), "; tool calling is not served"),
    "functions": (([],), "; function calling is not served"),
    "function_call": (("none",), "; function calling is not served"),
    "response_format": (({"type": "text"},), "; only {\"type\": \"text\"} (structured output is not served)"),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Str | None = None
    max_tokens: _int(1, fix="; max_tokens (-> gen_length) must be >= 1") | None = None
    temperature: _number(0.0, 100.0, "; use 0 for greedy decoding") | None = None
    n: _int(1, MAX_N, "; send several requests for more completions") | None = None
    stream: Bool | None = None
    stream_options: Dict | None = None
    stop: Annotated[Any, AfterValidator(_stop)] | None = None
    seed: _int(0, SEED_MAX) | None = None
    user: Str | None = None
    # dLLM fields (extra_body with the openai client)
    sampler: Str | None = None
    params: Annotated[Dict, AfterValidator(_finite)] | None = None
    steps: _int(1) | None = None
    block_length: _int(1) | None = None
    eos_early_stop: Bool | None = None
    cache: Str | None = None
    dllm_canvas: Bool | None = None
    # refused unless neutral
    top_p: _number(0.0, 1.0, "; the nucleus mass, 0 < top_p <= 1 (1: no cut)") | None = None
    presence_penalty: _neutral("presence_penalty", *REFUSED["presence_penalty"]) | None = None
    frequency_penalty: _neutral("frequency_penalty", *REFUSED["frequency_penalty"]) | None = None
    logit_bias: _neutral("logit_bias", *REFUSED["logit_bias"]) | None = None

    @model_validator(mode="after")
    def _options(self):
        if self.top_p is not None and self.top_p <= 0:
            raise BadRequest("top_p: 0 is out of range; the nucleus mass, 0 < top_p <= 1 (1: no cut)", "top_p")
        if self.stream_options is not None:
            unknown = sorted(set(self.stream_options) - {"include_usage"})
            if unknown:
                raise BadRequest(f"stream_options.{unknown[0]} is not supported; only include_usage",
                                 "stream_options")
            if not isinstance(self.stream_options.get("include_usage", True), bool):
                raise BadRequest("stream_options.include_usage: expected true or false", "stream_options")
            if not self.stream:
                raise BadRequest("stream_options needs stream: true", "stream_options")
        if self.dllm_canvas and not self.stream:
            raise BadRequest("dllm_canvas needs stream: true (the per-step canvas is streamed)", "dllm_canvas")
        return self


def _text_part(v):
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v:
        texts = []
        for i, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str) \
                    or set(part) - {"type", "text"}:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"part {i} ({shown(kind)}) is not supported: content is a string or a list of "
                                 f"{{\"type\": \"text\", \"text\": ...}} parts")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"expected a string or a non-empty list of text parts, got {shown(v)}")


def _role(v):
    if v not in ROLES:
        raise ValueError(f"role {shown(v)} is not served; one of {', '.join(ROLES)}")
    return v


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Annotated[Any, AfterValidator(_role)]
    content: Annotated[Any, AfterValidator(_text_part)]
    name: Str | None = None


class ChatRequest(_Body):
    messages: list[Message]
    logprobs: Bool | None = None
    top_logprobs: _int(0, MAX_TOP_LOGPROBS, " (the alternatives per token)") | None = None
    max_completion_tokens: _int(1, fix="; max_completion_tokens (-> gen_length) must be >= 1") | None = None
    tools: _neutral("tools", *REFUSED["tools"]) | None = None
    tool_choice: _neutral("tool_choice", *REFUSED["tool_choice"]) | None = None
    parallel_tool_calls: _neutral("parallel_tool_calls", *REFUSED["parallel_tool_calls"]) | None = None
    functions: _neutral("functions", *REFUSED["functions"]) | None = None
    function_call: _neutral("function_call", *REFUSED["function_call"]) | None = None
    response_format: _neutral("response_format", *REFUSED["response_format"]) | None = None

    @model_validator(mode="after")
    def _chat(self):
        if not self.messages:
            raise BadRequest("messages: a non-empty list of {role, content} objects", "messages")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise BadRequest("max_tokens and max_completion_tokens differ; send one of them", "max_tokens")
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return self

    @property
    def top_k(self) -> int | None:
        """Alternatives per token to return (``None``: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        """The messages as the chat template takes them (``developer`` is ``system``; names are not templated)."""
        if any(m.name for m in self.messages):
            raise BadRequest("messages[].name is not supported (the chat template has no speaker names)",
                             "messages")
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.content}
                for m in self.messages]

    @property
    def gen_length(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 64


def _prompt(v):
    if isinstance(v, list) and len(v) == 1 and (isinstance(v[0], str) or isinstance(v[0], list)):
        v = v[0]  # one prompt in a list
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return v
    raise ValueError("expected a string or a list of token ids (one prompt per request; send several requests "
                     "for several prompts)")


class CompletionRequest(_Body):
    prompt: Annotated[Any, AfterValidator(_prompt)]
    echo: Bool | None = None
    logprobs: _int(0, MAX_TOP_LOGPROBS, " (the alternatives per token)") | None = None
    best_of: _neutral("best_of", *REFUSED["best_of"]) | None = None
    suffix: _neutral("suffix", *REFUSED["suffix"]) | None = None

    @model_validator(mode="after")
    def _completion(self):
        if self.echo and self.logprobs is not None:
            raise BadRequest("echo with logprobs is not served: the prompt's tokens have no log-probabilities under "
                             "diffusion decoding; leave one of them out", "echo")
        return self

    @property
    def top_k(self) -> int | None:
        """Alternatives per token to return (``None``: no log-probabilities)."""
        return self.logprobs

    @property
    def gen_length(self) -> int:
        return self.max_tokens or 64


def _lone_surrogate(body: dict) -> tuple[str, str, str] | None:
    """``(field, where, character)`` of the first string (value or key) holding a lone UTF-16 surrogate (JSON's
    ``"\\ud800"`` unpaired: no Unicode character; a tokenizer cannot encode it), ``None`` if there is none. Walks
    the body without recursion (json.loads bounds its depth); the place is worked out only when there is one."""
    try:  # the common case at C speed: the body encodes as UTF-8 (a lone surrogate cannot)
        json.dumps(body, ensure_ascii=False, check_circular=False).encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    except (TypeError, ValueError, RecursionError):  # not JSON's own values: walked below
        pass
    stack = [(body, None)]  # (value, its place: (the parent's place, key or index), None at the top)
    while stack:
        v, at = stack.pop()
        kind = type(v)
        if kind is str:
            m = _SURROGATE.search(v)
            if m:
                return _found(at, m.group())
        elif kind is dict:
            for k, x in v.items():
                m = _SURROGATE.search(k)
                if m:
                    return _found((at, k), m.group(), key=True)
                stack.append((x, (at, k)))
        elif kind is list:
            stack.extend((x, (at, i)) for i, x in enumerate(v))
    return None


def _found(at, ch: str, key: bool = False) -> tuple[str, str, str]:
    """:func:`_lone_surrogate`'s answer for the place ``at`` (a chain of ``(parent's place, key or index)``)."""
    loc = []
    while at is not None:
        at, k = at
        loc.append(k)
    loc.reverse()
    return str(loc[0]), _where(loc) + (" (a key)" if key else ""), ch


def escaped(text: str) -> str:
    """``text`` with each lone surrogate written as its escape (``\\ud800``): a message or ``param`` naming a
    client's key must still encode as UTF-8."""
    return _SURROGATE.sub(lambda m: ascii(m.group())[1:-1], text)


def _where(loc) -> str:
    """A field's place in the body as a message names it (``messages[0].content``), cut to a readable length."""
    loc = [escaped(str(p)) for p in loc]
    where = loc[0] + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc[1:]) if loc else "body"
    return where if len(where) <= SHOWN_CHARS else f"{where[:SHOWN_CHARS]}..."


def parse(body: Any, chat: bool) -> ChatRequest | CompletionRequest:
    """The request body checked; :class:`BadRequest` naming the first wrong field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    bad = _lone_surrogate(body)
    if bad is not None:
        param, where, ch = bad
        param = escaped(param) if len(param) <= SHOWN_CHARS else None
        raise BadRequest(f"{where}: holds a lone UTF-16 surrogate ({ascii(ch)}), which is no Unicode character (a "
                         f"tokenizer cannot encode it); send valid Unicode (an escaped character outside the BMP is a "
                         f"high-low pair such as \\ud83d\\ude00)", param)
    try:
        return (ChatRequest if chat else CompletionRequest).model_validate(body)
    except BadRequest:
        raise
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        param = loc[0] if loc and len(loc[0]) <= SHOWN_CHARS else None
        where = _where(loc)
        ctx_err = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_err, BadRequest):
            raise ctx_err from None
        kind = err.get("type")
        if kind == "extra_forbidden":
            msg = (f"{where}: unknown field; the fields this server accepts and refuses are listed in "
                   f"docs/serving.md")
        elif kind == "missing":
            msg = f"{where} is required"
        else:
            text = err.get("msg", "invalid").removeprefix("Value error, ")
            msg = f"{where}: {text}"
        raise BadRequest(msg, param) from None
