"""Serving engine: step-level continuous batching over :class:`dllm.generate.Decoder`.

Requests join a running batch at a step boundary and leave it as soon as they finish; nothing a row computes
depends on the other rows (per-row random streams keyed by the seed and the prompt's tokens, per-row regions and
schedules), so every response is token-identical to ``dllm.generate`` of the same request alone with the same seed
and cache (float32; tested), whenever it arrives and whatever else runs.

* A *group* is one batch: requests whose decoding settings one batch can hold (the same sampler and
  parameters, ``gen_length``, ``block_length``, ``steps``, ``eos_early_stop``, ``seed``, the log-probabilities
  recorded). Groups with different settings are stepped in turn, one forward each per engine tick.
* Joining: the newcomers get their own :meth:`Decoder.start`, then both states are re-padded on the left to
  the longer prompt (region bounds shift with them) and concatenated along the batch; the running rows are
  not recomputed. Leaving: finished rows are answered and removed from every per-row tensor
  (``index_select``); the canvas is cropped when the longest prompt left.
* Caches: every registered cache is served (a preset's own by default: ``fast-dllm`` runs with ``dual``,
  ``elastic`` with Elastic-Cache). The cache's ``move_rows`` moves its K/V buffers with the rows (re-padded,
  selected, extended with the newcomers' rows, which their first forward recomputes in full) and its own per-row
  state: FreeCache's last region starts, Elastic-Cache's stored layer inputs, queries and tracked tokens; the
  exact ``block`` cache of block-diffusion checkpoints, their default: its per-row count of final columns, a
  joining row has none.
* Samplers: every registered sampler is served; the sampler's ``move_rows`` moves its per-row scratch state
  with the rows like the K/V buffers (a composed sampler's stages and a wrapped sampler's own included):
  CreditDecoding's credit tables, KLASS's kept steps (a joining row has no history), the AR guide's cache and
  cursors (a joining row gets the state its first step would build). Progress-driven samplers (``prophet``,
  ``eoser``, ``ascending``) read each row's own forward count. ``noise_scope`` must be ``"row"``.

Use: ``engine.submit(prompt, gen_length=...)`` returns a :class:`RequestHandle` (``.result()``, ``.delta_ids()``
for the left-to-right final prefix as it becomes final, ``.events()`` with the per-step canvas, ``.cancel()``); :meth:`Engine.step` runs one tick,
:meth:`Engine.start` a background thread that ticks while there is work. ``submit(..., logprobs=k)`` also records
each generated token's log-probability under the step that committed it and that step's top k
(``Result.logprobs``, ``.delta_logprobs()``); the record's tensors move with the rows like the canvas.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from dllm.config import GenerateConfig, check_graphs
from dllm.generate import (
    Decoder,
    DecodeState,
    _joined,
    _read_back,
    _reads,
    _without,
    decode_texts,
    decoding,
    prepare_prompts,
    row_keys,
)
from dllm.graphs import GraphRunner
from dllm.ops import shown
from dllm.recipes import baseline_name, check_cache_fits, model_block_size, resolve
from dllm.samplers import get_sampler
from dllm.samplers import guided as _guided
from dllm.samplers.registry import SAMPLERS
from dllm.samplers.transforms import with_top_p

log = logging.getLogger(__name__)

# every registered cache: the K/V buffers and a cache's own per-row state move with the rows
SERVED_CACHES = ("none", "prefix", "dual", "dkv-decode", "dkv-greedy", "block", "freecache", "elastic")
SEED_MAX = 2**63 - 1  # seeds are 0 .. 2**63 - 1
MAX_TOP_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's bound)


def check_positive(name: str, value, note: str = "") -> None:
    """``value`` is a positive integer (a bool is not); else a ValueError naming ``name`` (``note``: what it counts)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer{note}")


def _frozen(v):
    """``v`` hashable: a dict as its sorted ``(key, value)`` pairs, a list as a tuple, recursively (a sampler
    parameter that takes a list, such as Prophet's ``span``, arrives from JSON as a list)."""
    if isinstance(v, dict):
        return tuple(sorted((k, _frozen(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    return v


class QueueFull(RuntimeError):
    """The engine's queue holds ``max_queue`` requests already."""


class RequestError(ValueError):
    """A request the engine cannot run (the message names the field and the fix; ``param``: that field, an
    argument of :meth:`Engine.submit`, where one is to blame)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class Result:
    """A finished request: generated ids (``gen_length``, EOS padding included), the answer's text (cut at the
    first EOS/EOT; ``None`` without a tokenizer), forwards the row took part in, prompt length, why it ended."""

    request_id: str
    tokens: list[int]
    text: str | None
    nfe: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (EOS/EOT before gen_length) | "length" | "cancelled" | "error"
    error: str | None = None
    seconds: float = 0.0
    # with submit(logprobs=k), aligned with ``tokens``: each token's log-probability under the distribution of the
    # step that committed it, and that step's k most probable tokens there as (id, log-probability), descending
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class RequestHandle:
    """What :meth:`Engine.submit` returns: ``result(timeout)``, ``delta_ids()`` (the token ids of the final
    left-to-right prefix, in pieces as they become final), ``events()``, ``cancel()``; for asyncio code
    ``await aresult()`` and ``async for ids in adelta_ids()`` / ``aevents()`` (the engine's loop runs in its
    thread, :meth:`Engine.start`). Async waiters are woken by the engine thread through their event loop, so
    waiting holds no worker thread."""

    def __init__(self, request_id: str, canvas: bool = False):
        self.request_id = request_id
        self.canvas = canvas  # also stream each step's committed positions (``events()``: ("canvas", ...))
        self._done = threading.Event()
        self._result: Result | None = None
        self._log: list[tuple[str, Any]] = []  # every event in order; each consumer keeps its own position
        self._cond = threading.Condition()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.cancelled = False
        self.finishes = 0  # how many times the engine answered the request (exactly once)

    def result(self, timeout: float | None = None) -> Result:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        return self._result

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Free the request's row at the next step (its result has ``finish_reason="cancelled"`` unless it had
        finished already)."""
        self.cancelled = True

    def delta_logprobs(self):
        """With ``submit(logprobs=k)``: the entries of the tokens :meth:`delta_ids` yields, in the same pieces,
        each ``(log-probability, [(id, log-probability)] * k)`` (see :class:`Result`)."""
        for kind, value in self.events():
            if kind == "logprobs":
                yield value

    def delta_ids(self):
        """Token ids of the final left-to-right prefix, in pieces as they become final, until the request ends."""
        for kind, value in self.events():
            if kind == "ids":
                yield value

    def events(self):
        """``("ids", [token ids])`` as the final prefix grows (with ``submit(logprobs=k)`` each one preceded by
        ``("logprobs", entries)`` for the same tokens, see :meth:`delta_logprobs`) and, with ``canvas=True``,
        ``("canvas", {"step", "committed": {generation offset: token id}})`` after each of the request's steps,
        until it ends."""
        i = 0
        while True:
            with self._cond:
                while i >= len(self._log):
                    self._cond.wait()
                kind, value = self._log[i]
            i += 1
            if kind == "end":
                return
            yield kind, value

    async def aresult(self) -> Result:
        """:meth:`result`, awaited (no thread is held while waiting)."""
        async for _ in self.aevents():
            pass
        return self._result

    async def aevents(self):
        """:meth:`events` as an async iterator."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        entry = (loop, wake)
        with self._cond:
            self._async_waiters.append(entry)
        i = 0
        try:
            while True:
                wake.clear()
                with self._cond:
                    ready = self._log[i:]
                if not ready:
                    await wake.wait()
                    continue
                for kind, value in ready:
                    i += 1
                    if kind == "end":
                        return
                    yield kind, value
        finally:
            with self._cond:
                if entry in self._async_waiters:
                    self._async_waiters.remove(entry)

    async def adelta_ids(self):
        """:meth:`delta_ids` as an async iterator."""
        async for kind, value in self.aevents():
            if kind == "ids":
                yield value

    def _put(self, kind: str, value) -> None:
        with self._cond:
            self._log.append((kind, value))
            self._cond.notify_all()
            waiters = list(self._async_waiters)
        for loop, wake in waiters:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # that loop has closed: its consumer is gone
                pass

    def _emit(self, ids: list[int]) -> None:
        if ids:
            self._put("ids", ids)

    def _finish(self, result: Result) -> None:
        self.finishes += 1
        if self._done.is_set():  # answered already: the first answer stands
            log.error("request %s answered twice; the second answer (%s) is dropped", self.request_id,
                      result.finish_reason)
            return
        self._result = result
        self._done.set()
        self._put("end", None)


@dataclass
class _Request:
    request_id: str
    rows: list[int]
    config: GenerateConfig
    sampler_spec: tuple
    handle: RequestHandle
    t_submit: float
    recipe: Any = None
    emitted: int = 0  # generated positions already streamed
    sample: int = 0  # which answer to the same prompt (keys the random stream with the seed)
    isolated: bool = False  # retried alone after its batch failed: it gets a batch of its own


@dataclass
class _Group:
    key: tuple
    decoder: Decoder
    state: DecodeState
    requests: list[_Request] = field(default_factory=list)


class Engine:
    """Continuous-batching decoder for one model (see the module docstring). ``max_rows``: rows per group;
    ``max_running``: rows decoding at once, all groups together (requests whose settings differ, e.g. by ``seed``
    or ``max_tokens``, decode in groups of their own: without it each would add its rows, and its canvas and cache,
    up to ``max_queue`` rows; default ``4 * max_rows``); more wait in the queue; ``max_queue``: requests waiting or
    running before :meth:`submit` raises :class:`QueueFull`; ``sampler`` and
    ``params``: the sampler of requests that name none (default: the model family's baseline), and its
    parameters (a request naming no sampler, or this one, adds its own ``params`` over them); ``graphs``: the
    cached steps through CUDA graphs (``GenerateConfig.graphs``: ``"auto"`` on CUDA; ``"on"`` on the CPU runs the
    graph path's static buffers without capture; ``stats()["graphs"]`` counts how the cached forwards ran);
    ``guides``: the AR guide checkpoint directories (``guided`` sampler) requests may name besides the bundled
    guides, each by its path as given here or by its directory's name (a guide in the default ``params`` is allowed
    too). A request's ``params`` come from a client: a guide the operator did not allow is refused without touching
    the filesystem (a client cannot make the server load, or probe, any path).

    No request can stop the engine: when serving a batch raises, the batch is dropped and its requests are
    retried alone (a request that fails alone ends with finish reason ``error``); an exception in the loop's
    tick fails the requests it held; the loop goes on."""

    def __init__(self, model, *, max_rows: int = 8, max_queue: int = 256, sampler: str | None = None,
                 params: dict | None = None, graphs: str = "auto", guides=(), max_running: int | None = None):
        check_graphs(graphs)
        check_positive("max_rows", max_rows)
        max_running = 4 * max_rows if max_running is None else max_running
        check_positive("max_running", max_running, " (rows decoding at once)")
        check_positive("max_queue", max_queue)
        self.model = model
        self.sampler = sampler or baseline_name(getattr(model.spec, "family", "llada"))
        self.params = dict(params or {})
        self._guide_names = self._allowed_guides(list(guides or ()) + (
            [self.params["guide"]] if isinstance(self.params.get("guide"), (str, os.PathLike)) else []))
        self._check_sampler(self.sampler, self.params)
        try:
            get_sampler(self.sampler, **self.params)
        except (ValueError, TypeError, KeyError) as exc:
            raise RequestError(str(exc)) from None
        self.max_rows, self.max_running, self.max_queue, self.graphs = max_rows, max_running, max_queue, graphs
        self.groups: dict[tuple, _Group] = {}
        self.waiting: deque[_Request] = deque()
        self._lock = threading.Lock()
        self._guides = _guided.GuideCache(self.MAX_GUIDES)  # loaded AR guides, shared by requests
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._ids = itertools.count()
        self._token_bytes: int | None = None  # the longest token's UTF-8 length (a lower bound of prompt tokens)
        self.last_tick: float | None = None  # time.monotonic() of the loop's last finished tick
        self.metrics = {"requests": {"stop": 0, "length": 0, "cancelled": 0, "error": 0}, "forwards": 0,
                        "tokens": 0, "step_seconds": 0.0, "steps": 0, "joins": 0, "request_nfe": 0,
                        "request_positions": 0, "engine_errors": 0, "retried": 0,
                        # (row, column) logits the steps computed (rows x their windows: each row's own, or the
                        # union of the rows' where the sampler does not take per-row windows), and those in
                        # each row's own window (a row's region; Prophet's wider window): their ratio is the share of
                        # the output head's and the samplers' work the rows read
                        "logits_columns": 0, "own_logits_columns": 0}

    # ------------------------------------------------------------------------------------------ requests
    def submit(self, prompt, *, gen_length: int = 64, block_length: int | None = None, steps: int | None = None,
               sampler: str | None = None, params: dict | None = None, seed: int = 0,
               eos_early_stop: bool = False, chat_template: bool = True, request_id: str | None = None,
               cache: str | None = None, canvas: bool = False, sample: int = 0,
               logprobs: int | None = None, top_p: float | None = None,
               content_specials: bool = False) -> RequestHandle:
        """Queue one request (a string, a chat conversation or token ids); returns its handle. Bad settings
        raise :class:`RequestError` here, before anything runs and before the prompt is tokenised (every check of
        the settings comes first); a prompt that cannot fit the context with ``gen_length`` is refused before it
        is tokenised too.

        The request's random stream is keyed by ``seed`` and its prompt tokens, as ``dllm.generate`` keys a
        prompt by default: the answer equals ``dllm.generate(model, [prompt] * (sample + 1), seed=seed, ...)``'s
        row ``sample`` (``sample``: which of several answers to the same prompt, e.g. the OpenAI ``n``).

        A special token's text inside a chat message's content (``"<|eot_id|>"`` typed by a user) is text, as in
        OpenAI's API, so that no content can end its turn or open another role's; ``content_specials=True`` parses
        it as the special token, as :func:`dllm.generate` does. Prompts without such text give the same ids either
        way (:func:`dllm.generate.encode_prompt`). A string through no chat template is the caller's own format and
        keeps its special tokens.

        ``logprobs=k`` (0 to :data:`MAX_TOP_LOGPROBS`; ``None``: off) records each generated token's
        log-probability under the distribution (full-vocabulary softmax) of the step that committed it and that
        step's ``k`` most probable tokens at its position (:attr:`Result.logprobs`,
        :meth:`RequestHandle.delta_logprobs`): ``dllm.generate(..., record_confidence=True)``'s
        ``stats.commit_logprob`` and its ``record_top_logprobs=k`` record (alone exactly; in a batch up to float32
        rounding). The tokens are the same with or without it."""
        with self._lock:
            if len(self.waiting) + sum(len(g.requests) for g in self.groups.values()) >= self.max_queue:
                raise QueueFull(f"the engine holds {self.max_queue} requests; retry later")
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
            raise RequestError(f"seed={seed!r} is out of range; use an integer from 0 to 2**63 - 1", "seed")
        if isinstance(sample, bool) or not isinstance(sample, int) or not 0 <= sample < 1024:
            raise RequestError(f"sample={sample!r} must be an integer from 0 to 1023", "sample")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(f"logprobs={logprobs!r} must be an integer from 0 to {MAX_TOP_LOGPROBS} (or None: off)",
                               "logprobs")
        name = sampler or self.sampler
        if not isinstance(name, str):
            raise RequestError(f"sampler={name!r} must be a sampler name (a string)", "sampler")
        if not isinstance(params or {}, dict):
            raise RequestError(f"params={params!r} must be a dict of the sampler's parameters", "params")
        params = {**(self.params if name == self.sampler else {}), **(params or {})}
        self._check_sampler(name, params)
        if "guide" in params and name in SAMPLERS and "guide" in SAMPLERS[name].params():
            # before the sampler is built: an AR guide the operator allowed, by name
            params = {**params, "guide": self._guide(params["guide"])}
        try:
            config = GenerateConfig(gen_length=gen_length, block_length=block_length, steps=steps, seed=seed,
                                    eos_early_stop=eos_early_stop, chat_template=chat_template,
                                    record_confidence=logprobs is not None, record_top_logprobs=logprobs or 0,
                                    graphs=self.graphs)
        except (ValueError, TypeError) as exc:
            raise RequestError(str(exc)) from None
        least = self._least_tokens(prompt)  # before tokenising: a prompt already too long costs nothing
        if least + gen_length > self.model.max_seq_len:
            if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
                what = f"{len(prompt)} messages, at least {least} tokens: every message takes one at least"
                fix = "send fewer or shorter messages, or lower gen_length (max_tokens)"
            else:
                what, fix = f"at least {least} tokens", "shorten the prompt or lower gen_length (max_tokens)"
            raise RequestError(f"prompt ({what}) + gen_length ({gen_length}) exceeds the model's context of "
                               f"{self.model.max_seq_len} tokens; {fix}", "prompt")
        cut = top_p if top_p is not None and top_p < 1 else None
        own_cut = cut is not None and name in SAMPLERS and "top_p" in SAMPLERS[name].params()
        if own_cut:  # the sampler's own nucleus cut (Dream's, as its reference applies it)
            params = {**params, "top_p": cut}
        try:
            recipe = get_sampler(name, **params)
        except (ValueError, TypeError, KeyError) as exc:
            raise RequestError(str(exc), "sampler" if "unknown sampler" in str(exc) else "params") from None
        try:
            self._share_guide(recipe)
        except (OSError, ValueError) as exc:  # e.g. a guide directory that does not exist
            raise RequestError(str(exc), "params") from None
        if cut is not None and not own_cut:  # any other sampler: the nucleus cut as a logits transform in front
            try:
                recipe = with_top_p(recipe, cut)
            except (ValueError, TypeError) as exc:
                raise RequestError(str(exc), "top_p") from None
        if cache is None:  # the preset's own cache (fast-dllm: dual), where the engine can move it; block-diffusion
            # checkpoints: their exact block cache, as in generate
            cache = "block" if model_block_size(self.model) else (getattr(recipe, "cache", None) or "none")
            if isinstance(cache, (list, tuple)) and cache and isinstance(cache[0], str):  # (name, its parameters)
                cache = cache[0]
            if not isinstance(cache, str):  # e.g. a preset's params.cache of another type
                raise RequestError(f"the sampler's cache {shown(cache)} is not a cache name; its params.cache takes "
                                   f"one of {', '.join(SERVED_CACHES)}", "params")
        if cache not in SERVED_CACHES:
            raise RequestError(f"cache {cache!r} is not served; served caches: {', '.join(SERVED_CACHES)}", "cache")
        try:  # else it fails at the request's first forward
            check_cache_fits(cache, model_block_size(self.model))
        except ValueError as exc:
            raise RequestError(str(exc), "cache") from None
        spec = (name, _frozen(params), cache, None if cut is None or own_cut else cut)  # the batch key: hashable
        try:  # lengths, block layout and context checked before queueing
            resolve(self.model, recipe, cache, None, config)
            hash(spec)
        except (ValueError, TypeError) as exc:
            raise RequestError(str(exc)) from None
        try:  # tokenising last: a request refused for its settings costs no tokenising
            rows = prepare_prompts(self.model, [prompt], None, chat_template, content_specials)
        except (ValueError, TypeError, KeyError) as exc:
            raise RequestError(str(exc), "prompt") from None
        if len(rows[0]) + gen_length > self.model.max_seq_len:
            raise RequestError(f"prompt ({len(rows[0])} tokens) + gen_length ({gen_length}) exceeds the model's "
                               f"context of {self.model.max_seq_len} tokens; shorten the prompt or lower gen_length "
                               f"(max_tokens)", "prompt")
        handle = RequestHandle(rid, canvas)
        req = _Request(rid, rows[0], config, spec, handle, time.perf_counter(), recipe, sample=sample)
        with self._lock:
            self.waiting.append(req)
        self._wake.set()
        return handle

    MAX_GUIDES = 2  # loaded guides kept for later requests

    def _share_guide(self, recipe) -> None:
        """AR-guided requests naming the same guide checkpoint (and dtype) share one loaded guide from the engine's
        :class:`~dllm.samplers.guided.GuideCache` (loaded at the first such request), instead of each request
        loading its own copy."""
        s = getattr(recipe, "sampler", recipe)
        if isinstance(s, _guided.GuidedSampler):
            s.use_guide_cache(self._guides)

    def _allowed_guides(self, guides: list) -> dict[str, str]:
        """Name (a bundled guide's name; an allowed checkpoint directory's path as given and its directory's name)
        -> what the guided sampler loads. Each allowed directory must exist now (an operator's mistake stops the
        engine before it serves)."""
        names = {name: name for name in _guided.bundled_guides()}
        for g in guides:
            g = os.fspath(g)
            if g in names:
                continue
            path = _guided.checked_guide_path(g).resolve()
            names[g] = g
            short = os.path.basename(os.path.normpath(g))
            if not short:
                continue
            if short in names and _guided.guide_path(names[short]).resolve() != path:
                raise ValueError(f"two allowed guides are both named {short!r}; allow one of them, or rename its "
                                 "directory")
            names.setdefault(short, g)
        return names

    def _guide(self, guide) -> str:
        """The guide a request names (a key of the allowed guides) as the guided sampler loads it; refuses any other
        without touching the filesystem and without naming the operator's paths."""
        if isinstance(guide, str) and guide in self._guide_names:
            return self._guide_names[guide]
        allowed = ", ".join(sorted(n for n in self._guide_names if os.sep not in n))
        named = repr(guide) if isinstance(guide, str) and len(guide) <= 200 else f"of type {type(guide).__name__}"
        raise RequestError(f"guide {named} is not one this server allows; allowed guides: {allowed} (the "
                           f"operator allows more with `dllm serve --guide PATH`)", "params")

    def _least_tokens(self, prompt) -> int:
        """A lower bound of the prompt's token count without tokenising it: its UTF-8 length over the longest
        token's (token ids: their count); a conversation adds one token per message (whatever its content, every
        message's turn takes at least one token of the chat template)."""
        extra = 0
        if isinstance(prompt, str):
            texts = [prompt]
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            texts = [m.get("content") for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str)]
            extra = len(prompt)
        elif isinstance(prompt, (list, tuple)):
            return len(prompt)
        else:
            return 0
        if self._token_bytes is None:
            tok = getattr(self.model, "tokenizer", None)
            try:
                vocab = tok.get_vocab() if tok is not None else {}
                self._token_bytes = max((len(str(k).encode("utf-8", "replace")) for k in vocab), default=0)
            except Exception:  # a tokenizer without a vocabulary listing: no bound
                self._token_bytes = 0
        if self._token_bytes <= 0:
            return extra
        n = sum(len(t.encode("utf-8", "replace")) for t in texts)
        return extra + -(-n // self._token_bytes)

    @staticmethod
    def _check_sampler(name: str, params: dict) -> None:
        if params.get("noise_scope", "row") != "row":
            raise RequestError("noise_scope must be 'row' when serving (per-request random streams)", "params")

    # ------------------------------------------------------------------------------------------ the loop
    @decoding  # no autograd (the engine's thread starts with it on), whatever the caller's inference mode
    def step(self) -> bool:
        """One tick: admit waiting requests into their groups, then one forward for every group. Returns
        whether any request is still waiting or running. A batch whose serving raises fails its own requests."""
        self._admit()
        for key in list(self.groups):
            group = self.groups.get(key)
            if group is None:  # removed during this tick
                continue
            try:
                self._step_group(group)
            except Exception as exc:
                log.exception("serving a batch failed; its requests are retried alone, the engine goes on")
                self.metrics["engine_errors"] += 1
                self._retry_or_fail(self._drop(group), f"{type(exc).__name__}: {exc}")
        self.last_tick = time.monotonic()
        with self._lock:
            return bool(self.waiting or self.groups)

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def start(self) -> None:
        """Run the loop in a background thread (idle waits cost nothing)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = False
        self.last_tick = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="dllm-engine", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """Whether the background loop is running (started, not stopped, its thread alive)."""
        th = self._thread
        return th is not None and th.is_alive() and not self._stop

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the background loop; with ``drain`` after every queued request has finished (while the loop is
        alive, at most ``timeout`` seconds). Requests left queued stay queued for a later :meth:`start`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if drain:
            while self.pending() and self.alive() and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.01)
        self._stop = True
        self._wake.set()
        th = self._thread
        if th is not None:
            th.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if th.is_alive():
                log.warning("the engine thread did not stop within %s s (a step still running)", timeout)
            else:
                self._thread = None

    def pending(self) -> int:
        with self._lock:
            return len(self.waiting) + sum(len(g.requests) for g in self.groups.values())

    def _loop(self) -> None:
        try:
            while not self._stop:
                try:
                    busy = self.step()
                except Exception:  # the loop's own bookkeeping: fail what it held, keep serving
                    log.exception("engine tick failed; the requests it held fail, the engine goes on")
                    self.metrics["engine_errors"] += 1
                    self._fail_all("internal error while serving the request")
                    busy = False
                if not busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException:  # pragma: no cover - the thread is ending: nobody may wait on it
            log.exception("engine thread ended")
            self._fail_all("the engine stopped")
            raise

    def _fail_group(self, group: _Group, message: str) -> None:
        for req in self._drop(group):
            self._answer(req, None, "error", message)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            waiting, self.waiting = list(self.waiting), deque()
        for req in waiting:
            self._answer(req, None, "error", message)
        with self._lock:
            groups = list(self.groups.values())
        for group in groups:
            self._fail_group(group, message)

    def _key(self, req: _Request) -> tuple:
        c = req.config
        key = (req.sampler_spec, c.gen_length, c.block_length, c.steps, c.eos_early_stop, c.seed, c.chat_template,
               c.record_confidence, c.record_top_logprobs)
        return key + (("alone", req.request_id),) if req.isolated else key

    def _retry_or_fail(self, reqs: list[_Request], message: str) -> None:
        """Requests whose batch failed: one that was alone (or already retried alone) fails; the others are
        retried, each alone and from the start, so one request's failure ends only that request. A restarted
        request's answer is the same (it does not depend on when it starts), so what it streamed stays valid."""
        retry = []
        for req in reqs:
            if req.handle.done():
                continue
            if req.isolated or len(reqs) == 1:
                self._answer(req, None, "error", message)
            else:
                req.isolated = True
                retry.append(req)
        if retry:
            log.warning("retrying %d request(s) alone after their batch failed", len(retry))
            self.metrics["retried"] += len(retry)
            with self._lock:
                self.waiting.extendleft(reversed(retry))

    def _drop(self, group: _Group) -> list[_Request]:
        """Remove the batch; returns its requests. Its cache's K/V buffers go back to the graph path's pool."""
        reqs, group.requests = group.requests, []
        with self._lock:
            if self.groups.get(group.key) is group:
                del self.groups[group.key]
        group.decoder.release()
        return reqs

    def _admit(self) -> None:
        with self._lock:
            waiting, self.waiting = list(self.waiting), deque()
        later = []
        by_key: dict[tuple, list[_Request]] = {}
        for req in waiting:
            if req.handle.cancelled:
                self._answer(req, None, "cancelled")
                continue
            by_key.setdefault(self._key(req), []).append(req)
        free = self.max_running - sum(len(g.requests) for g in self.groups.values())  # rows all groups may add
        for key, reqs in by_key.items():
            group = self.groups.get(key)
            room = max(min(self.max_rows - (len(group.requests) if group else 0), free), 0)
            take, rest = reqs[:room], reqs[room:]
            free -= len(take)
            later += rest
            if not take:
                continue
            try:
                dec, st = self._start(take)
            except Exception as exc:  # requests that cannot start: retried alone, then failed
                log.exception("requests could not start")
                self._retry_or_fail(take, f"{type(exc).__name__}: {exc}")
                continue
            try:
                self._join(key, group, take, dec, st)
            except Exception as exc:  # the batch may be left half-joined: it is dropped, its requests retried
                log.exception("requests could not join a batch")
                self.metrics["engine_errors"] += 1
                self._retry_or_fail((self._drop(group) if group is not None else []) + take,
                                    f"{type(exc).__name__}: {exc}")
        with self._lock:
            self.waiting.extendleft(reversed(later))

    def _start(self, reqs: list[_Request]) -> tuple[Decoder, DecodeState]:
        """The newcomers' own decoder and state (their first forward is their own full forward)."""
        recipe = reqs[0].recipe
        sampler, cache, policy, config = resolve(self.model, recipe, reqs[0].sampler_spec[2], None, reqs[0].config)
        dec = Decoder(self.model, sampler, cache, policy, config)
        dec.rows_move = True  # rows join and leave between steps
        dec.reads = functools.partial(_reads, dec=dec)  # what _step_group reads, in the step's own synchronisation
        if dec.graphed:  # the graph path: the K/V buffers sized for a batch bucket, rows move within
            dec.cache.batch_buckets = True
        st = dec.start([r.rows for r in reqs], None)
        # after start, which sets the limit of one batch decoded from start to end (Decoder.step_limit of the
        # batch's forwards): a served batch lives as long as requests keep joining it, so its forward count
        # passes any such limit; rows come and go, each row's own progress is checked in _step_group
        dec.max_iters = float("inf")
        # each row's random stream keyed by (seed, its prompt, its sample index), as generate keys a prompt
        st.row_key = torch.cat([row_keys([r.rows] * (r.sample + 1), None, r.config.seed)[r.sample:]
                                for r in reqs]).to(st.row_key.device)
        return dec, st

    def _join(self, key: tuple, group: _Group | None, reqs: list[_Request], dec: Decoder, st: DecodeState) -> None:
        if group is None:
            with self._lock:
                self.groups[key] = _Group(key, dec, st, list(reqs))
            return
        self.metrics["joins"] += len(reqs)
        group.state = _joined(group.decoder, group.state, st)
        group.requests += reqs

    def _step_group(self, group: _Group) -> None:
        st, dec = group.state, group.decoder
        keep = []
        for i, req in enumerate(group.requests):  # a disconnected client frees its row now
            if req.handle.cancelled:
                self._answer(req, (group, i), "cancelled")
            else:
                keep.append(i)
        if len(keep) < len(group.requests):
            self._remove(group, keep)
            if not group.requests:
                return
            st = group.state
        t0 = time.perf_counter()
        n0 = dec.logits_columns
        try:
            dec.step(st)
        except Exception as exc:  # the batch is dropped: a request alone fails, the others are retried alone
            log.exception("decode step failed")
            self._retry_or_fail(self._drop(group), f"{type(exc).__name__}: {exc}")
            return
        self.metrics["step_seconds"] += time.perf_counter() - t0
        self.metrics["steps"] += 1
        self.metrics["forwards"] += 1
        st.trace.clear()  # per-request statistics come from the per-row tensors
        rows, done, row_nfe, own = _read_back(st)
        n = dec.logits_columns - n0
        self.metrics["logits_columns"] += n
        self.metrics["own_logits_columns"] += own  # read in the step's own transfer (Decoder.reads)
        self._stream(group, rows, row_nfe)
        limit = dec.step_limit
        keep = []
        for i, req in enumerate(group.requests):
            if done[i]:
                self._answer(req, (group, i), "done")
            elif row_nfe[i] > limit:
                self._answer(req, None, "error", f"no progress after {row_nfe[i]} forwards")
            else:
                keep.append(i)
        if len(keep) < len(group.requests):
            self._remove(group, keep)

    def _remove(self, group: _Group, keep: list[int]) -> None:
        if not keep:  # the batch is empty: it is dropped (nothing of it is stepped again)
            self._drop(group)
            return
        group.requests = [group.requests[i] for i in keep]
        group.state = _without(group.decoder, group.state, keep)

    def _stream(self, group: _Group, rows: list[list[int]], row_nfe: list[int]) -> None:
        """Each request's new final prefix (``rows``, ``row_nfe``: the batch's generated tokens and forwards after the
        step, on the host); the canvas and the logprobs of the requests that ask for them (read from the device)."""
        st = group.state
        mask_id = self.model.mask_id
        if any(r.handle.canvas for r in group.requests):
            committed = st.committed[:, st.P:].tolist()
            for i, req in enumerate(group.requests):
                if req.handle.canvas:
                    cols = {j: rows[i][j] for j, c in enumerate(committed[i]) if c}
                    req.handle._put("canvas", {"step": row_nfe[i], "committed": cols})
        record = None  # the logprobs record on the host, read once per tick when some row emits
        for i, req in enumerate(group.requests):
            row = rows[i]  # committed tokens stay: the final prefix only grows, searched from where it ended
            final = next((j for j in range(req.emitted, len(row)) if row[j] == mask_id), len(row))
            if final > req.emitted:
                if st.commit_logprob is not None:
                    if record is None:
                        record = self._record(st)
                    req.handle._put("logprobs", self._logprobs(record, i, req.emitted, final))
                req.handle._emit(rows[i][req.emitted:final])
                req.emitted = final

    def _answer(self, req: _Request, where, outcome: str, error: str | None = None) -> None:
        """Answer the request (exactly once: a request already answered is left alone); never raises."""
        if req.handle.done():  # answered already (a bug if it happens): counted, the first answer stands
            req.handle.finishes += 1
            log.error("request %s answered twice (%s after %s)", req.request_id, outcome,
                      req.handle._result.finish_reason)
            return
        try:
            result, counted = self._result(req, where, outcome, error)
        except Exception as exc:  # e.g. the tokenizer failed on this answer: the request fails alone
            log.exception("answering request %s failed", req.request_id)
            result = Result(req.request_id, [], None, 0, len(req.rows), 0, "error", f"{type(exc).__name__}: {exc}",
                            time.perf_counter() - req.t_submit)
            counted = ("error", 0, 0, 0)
        outcome, n, nfe, positions = counted
        self.metrics["requests"][outcome] += 1
        self.metrics["tokens"] += n
        self.metrics["request_nfe"] += nfe  # finished requests' forwards and generated positions: their ratio is
        self.metrics["request_positions"] += positions  # the served tokens per forward
        req.handle._finish(result)

    def _result(self, req: _Request, where, outcome: str, error: str | None):
        tokens, nfe, entries = [], 0, None
        if where is not None:
            group, i = where
            st = group.state
            rows, _, row_nfe, _ = _read_back(st)
            tokens, nfe = rows[i], row_nfe[i]
            if st.commit_logprob is not None:
                entries = self._logprobs(self._record(st, slice(i, i + 1)), 0, 0, len(tokens))
        if outcome == "cancelled":  # what the client has seen: the final prefix streamed so far
            final = next((j for j, t in enumerate(tokens) if t == self.model.mask_id), len(tokens))
            tokens = tokens[:min(req.emitted, final)]
        stops = {t for t in (self.model.eos_id, self.model.eot_id) if t is not None}
        n = next((j for j, t in enumerate(tokens) if t in stops), len(tokens))
        if entries is not None:
            entries = entries[:len(tokens)]
        if outcome == "done":
            outcome = "stop" if n < len(tokens) else "length"
            if req.emitted < len(tokens):
                if entries is not None:
                    req.handle._put("logprobs", entries[req.emitted:])
                req.handle._emit(tokens[req.emitted:])
                req.emitted = len(tokens)
        text = None
        if tokens:
            texts = decode_texts(self.model, [tokens])
            text = texts[0] if texts is not None else None
        result = Result(req.request_id, tokens, text, nfe, len(req.rows), n, outcome, error,
                        time.perf_counter() - req.t_submit)
        if req.config.record_confidence:
            result.logprobs = [lp for lp, _ in entries or []]
            result.top_logprobs = [top for _, top in entries or []]
        positions = len(tokens) if outcome in ("stop", "length") else 0
        return result, (outcome, n, nfe if outcome in ("stop", "length") else 0, positions)

    @staticmethod
    def _record(st: DecodeState, rows: slice = slice(None)) -> list:
        """The logprobs record of ``rows`` over the generation on the host: ``commit_logprob``, ``commit_top_ids``,
        ``commit_top_logprobs`` (the last two None without top logprobs), one transfer each."""
        return [None if t is None else t[rows, st.P:].tolist()
                for t in (st.commit_logprob, st.commit_top_ids, st.commit_top_logprobs)]

    @staticmethod
    def _logprobs(record: list, i: int, a: int, b: int) -> list[tuple[float, list[tuple[int, float]]]]:
        """Row ``i``'s entries for generation offsets ``a`` to ``b`` from ``record`` (:meth:`_record`):
        ``(log-probability of the token under its committing step, [(id, log-probability)] of that
        step's top k)``; NaN for a position no step committed (the EOS early-stop fill)."""
        lps, ids, tops = record
        lps = lps[i][a:b]
        if ids is None:
            return [(lp, []) for lp in lps]
        return [(lp, list(zip(d, t))) for lp, d, t in zip(lps, ids[i][a:b], tops[i][a:b])]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            waiting = len(self.waiting)
            groups = list(self.groups.values())
        running = sum(len(g.requests) for g in groups)
        runner = GraphRunner.of(self.model)  # how the cached forwards ran (GraphRunner.stats)
        return {**self.metrics, "waiting": waiting, "running": running, "groups": len(groups),
                "alive": self.alive(),
                "last_tick_age": None if self.last_tick is None else time.monotonic() - self.last_tick,
                "graphs": dict(runner.stats) if runner is not None else {},
                # how the steps' work after their forwards ran (GraphRunner.tail_stats: the step graphs)
                "step_graphs": dict(runner.tail_stats) if runner is not None else {},
                # bytes of free K/V buffers the graph path's pool keeps for later batches (GraphRunner.clear frees)
                "graph_pool_bytes": runner.buffers.nbytes if runner is not None and runner.buffers is not None else 0}
