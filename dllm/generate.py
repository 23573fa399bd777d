"""THE decode loop: the only place where model, sampler, block policy and cache meet."""

from __future__ import annotations

import functools
import math
import numbers
import os
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from dllm.blocks.fixed import FixedBlocks
from dllm.caches.base import CacheState, KVCache, NoCache
from dllm.config import GenerateConfig
from dllm.graphs import GraphRunner
from dllm.kernels.device import on_device
from dllm.models.spec import vocab_size
from dllm.ops import cached_arange, ids_on, moved_rows, shape_bucket, shown
from dllm.recipes import resolve
from dllm.samplers.base import StepContext, declares_graph_safe, declares_row_windows, row_key_words


class NonFiniteLogitsError(ValueError):
    """The model returned NaN or infinite logits (or none finite) in the decoding window of an unfinished row.

    ``rows`` are the batch rows affected, ``step`` the decoding step (1-based), ``positions`` per row the
    generation offsets whose logits were not finite."""

    def __init__(self, message: str, rows: list[int], step: int, positions: list[list[int]]):
        super().__init__(message)
        self.rows, self.step, self.positions = rows, step, positions

    @classmethod
    def at(cls, bad: torch.Tensor, step0: int, offset, names: list[int] | None = None) -> NonFiniteLogitsError:
        """From the ``[B, W]`` mask of bad window positions (window column 0 = generation offset ``offset``: an int,
        or a ``[B]`` tensor where each row's window is its own); ``names``: each batch row's index among the
        caller's rows (None: its batch position)."""
        at = bad.any(-1).nonzero().flatten().tolist()
        positions = [(bad[r].nonzero().flatten() + (offset[r] if torch.is_tensor(offset) else offset)).tolist()
                     for r in at]
        rows = at if names is None else [names[r] for r in at]
        shown = ", ".join(f"row {r} at {pos[:8]}{' ...' if len(pos) > 8 else ''}" for r, pos in zip(rows, positions))
        return cls(f"the model returned non-finite logits (NaN, inf or no finite value) at step {step0 + 1}: {shown}; "
                   "this is usually a half-precision overflow: load the model with dtype='float32' (or check the "
                   "checkpoint and the inputs)", rows, step0 + 1, positions)


@dataclass
class GenerateStats:
    nfe: int  # model forward calls (a CFG forward counts once)
    row_nfe: list[int]  # forwards each row took part in before it finished
    tokens_per_forward: float  # mean over rows of gen_length / row_nfe
    finish_step: list[int]  # step at which each row finished (1-based)
    time_model: float
    time_sampler: float
    time_cache: float
    time_total: float
    trace: list[dict[str, Any]] = field(default_factory=list)  # per step: committed per row, region bounds,
    # early_commit per row, the sampler's / block policy's info, cache stats
    # [B][gen_length]: the step (1-based) at which each generated position was committed (EOS early-stop fill
    # included), -1 if never; what dllm.viz draws
    commit_step: list[list[int]] = field(default_factory=list)
    # [B][gen_length]: probability of the committed token under that step's logits (full-vocabulary softmax),
    # recorded with GenerateConfig(record_confidence=True); empty otherwise
    commit_conf: list[list[float]] = field(default_factory=list)
    # [B][gen_length]: the same token's log-probability, recorded as a log (a tiny probability does not underflow
    # to 0 as commit_conf's does); NaN where no step committed the position; empty without record_confidence
    commit_logprob: list[list[float]] = field(default_factory=list)
    # [B][gen_length][k]: the k most probable tokens of the committing step's distribution at each committed
    # position (descending) and their log-probabilities, recorded with GenerateConfig(record_top_logprobs=k);
    # ids -1 and log-probabilities NaN where no step committed the position; empty otherwise
    commit_top_ids: list[list[list[int]]] = field(default_factory=list)
    commit_top_logprobs: list[list[list[float]]] = field(default_factory=list)
    # how the cached steps ran (GenerateConfig.graphs): {"replays": n, "captures": n, "eager:<reason>": n, ...};
    # empty when graphs are off
    graphs: dict[str, int] = field(default_factory=dict)
    # how the steps' work after their forwards ran (the sampler, the commits, the regions' bookkeeping as one graph
    # per window: docs/architecture.md): {"replays": n, "captures": n, "eager:first sight": n, ...}; empty where it
    # ran eagerly
    step_graphs: dict[str, int] = field(default_factory=dict)
    # the (row, column) logits the steps computed (every row as wide as the widest row's region where the sampler
    # takes per-row windows, Decoder.row_windows; else every row over the union of the rows' windows: rows out of
    # step widen each other's) and those in each row's own window (its region; Prophet's wider one); their ratio is
    # the share of the output head's and the sampler's work the rows read
    logits_columns: int = 0
    own_logits_columns: int = 0
    # the rows the forwards computed, summed over forwards (a finished row still in its batch included: against
    # sum(row_nfe), the share of the batch's rows still decoding; generate's max_rows drops finished rows)
    row_forwards: int = 0
    # what ran, as resolved from the call (a block-diffusion model's default block cache, a preset's own cache):
    # the sampler's and the cache's names ("none": no cache); empty in stats built elsewhere
    sampler: str = ""
    cache: str = ""
    # bytes the cache's K/V buffers held at the end of decoding (0 without buffers; on the graph path they go back to
    # the runner's pool when the call ends)
    cache_bytes: int = 0
    # the run's fixed block length (fixed blocks: regions of this length from the generation's start, the layout
    # dllm.viz draws even where a step's region spans more, as in Prophet's early commit); 0 where the regions are
    # laid out otherwise (adaptive, aligned to the prompt, sliding) or unknown
    block_length: int = 0


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B, gen_length] generated token ids
    texts: list[str] | None  # decoded, cut at the first EOS/EOT (None without a tokenizer)
    prompt_lengths: list[int]
    stats: GenerateStats


def _host_check_free(t: torch.Tensor) -> bool:
    """Whether reading a value of ``t`` on the host costs no device synchronisation (CPU tensors)."""
    return t.device.type == "cpu"


class _Clock:
    """Time buckets (model / sampler / cache). On CUDA, events recorded on the stream: no synchronisation during
    decoding; the elapsed times are read at the end (:meth:`totals`), and along the way those of spans whose events
    have completed (``Event.query``, no synchronisation), so that a decoder stepped for hours (the serving
    engine's) holds at most about :attr:`MAX_SPANS` spans."""

    MAX_SPANS = 192

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t = {"model": 0.0, "sampler": 0.0, "cache": 0.0}
        self.spans: list[tuple[str, Any, Any]] = []

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def add(self, bucket: str, start, end) -> None:
        if self.cuda:
            self.spans.append((bucket, start, end))
            if len(self.spans) >= self.MAX_SPANS:
                self._fold()
        else:
            self.t[bucket] += end - start

    def _fold(self) -> None:
        """Add up the spans, oldest first, whose end event has completed (recorded in order on one stream, so
        their start has too), and drop them."""
        done = 0
        for bucket, a, b in self.spans:
            if not b.query():
                break
            self.t[bucket] += a.elapsed_time(b) / 1000.0
            done += 1
        del self.spans[:done]

    def totals(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            for bucket, a, b in self.spans:
                self.t[bucket] += a.elapsed_time(b) / 1000.0
            self.spans = []
        return self.t


def default_sampler(model):
    """The model family's baseline sampler (Dream-format: ``dream``, else ``llada``)."""
    from dllm.recipes import default_sampler as _default

    return _default(model)


PROMPT_FORMS = ("a string, a chat conversation (a list of {\"role\", \"content\"} messages) or a list of token "
                "ids")


def is_token_id(t) -> bool:
    """Whether ``t`` is a token id: an integer (Python, numpy, or a 0-d integer tensor), never a bool, a float or a
    string (``int()`` would turn 10.9, "10" and True into ids silently)."""
    if isinstance(t, torch.Tensor):
        return t.dim() == 0 and not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool
    return isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_))


def is_conversation(obj) -> bool:
    """Whether ``obj`` is meant as a chat conversation: a non-empty list whose first item is a dict (its messages
    are checked by :func:`check_conversation`)."""
    return isinstance(obj, list) and bool(obj) and isinstance(obj[0], dict)


def check_conversation(messages, where: str) -> None:
    """Every message of a conversation is a dict with a string ``role`` and a string ``content`` (what the chat
    template reads); else ``ValueError`` naming ``where`` and the message."""
    for j, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            shown = repr(m) if len(repr(m)) <= 60 else repr(m)[:57] + "..."
            raise ValueError(f'{where}: message {j} ({shown}) needs a string "role" and a string "content", e.g. '
                             '{"role": "user", "content": "Hello"}')


def _token_row(p, i: int) -> list[int]:
    """Prompt ``i`` given as token ids, checked (see :func:`is_token_id`)."""
    if is_token_id(p):
        raise ValueError(f"prompt {i} is the token id {p!r}, not a prompt: prompts is a list of prompts; wrap a "
                         "single prompt's ids in a list: [[1, 2, 3]]")
    if p is None or isinstance(p, (dict, numbers.Number)) or not isinstance(p, (Sequence, torch.Tensor, np.ndarray)):
        raise ValueError(f"prompt {i} is {p!r} ({type(p).__name__}); each prompt must be {PROMPT_FORMS}")
    ids = list(p)
    for j, t in enumerate(ids):
        if not is_token_id(t):
            hint = " (text goes in as one string prompt, not a list of strings)" if isinstance(t, str) else ""
            raise ValueError(f"prompt {i}: item {j} is {t!r} ({type(t).__name__}), not a token id; token ids must be "
                             f"integers (not bools, floats or strings){hint}")
    return [int(t) for t in ids]


def check_prompt_ids(rows: list[list[int]] | dict[int, list[int]], vocab: int | None, mask_id: int | None) -> None:
    """Token-id prompts (a list, or a dict from each prompt's index to its ids) are non-empty, inside the vocabulary
    ``vocab`` (``None``: unknown) and free of the mask token ``mask_id`` (``None``: unknown). :func:`prepare_prompts`
    runs it; the command line, before the model loads, with the vocabulary of config.json."""
    for i, r in (rows.items() if isinstance(rows, dict) else enumerate(rows)):
        if len(r) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if vocab is not None and not 0 <= min(r) <= max(r) < vocab:
            bad = next(t for t in r if not 0 <= t < vocab)
            raise ValueError(f"prompt {i} contains token id {bad}, outside the vocabulary (0..{vocab - 1}); "
                             "encode prompts with the model's own tokenizer")
        if mask_id is not None and mask_id in r:
            raise ValueError(
                f"prompt {i} contains the mask token (id {mask_id}); masks are appended by generate() - "
                "remove it from the prompt"
            )


def prepare_prompts(model, prompts, attention_mask=None, chat_template=True, content_specials=True) -> list[list[int]]:
    """Normalise any accepted prompt form into a list of token-id lists (validated). ``content_specials=False``: a
    special token's text inside a chat message's content is tokenised as text (:func:`encode_prompt`)."""
    tok = getattr(model, "tokenizer", None)
    if attention_mask is not None and not isinstance(prompts, torch.Tensor):
        raise ValueError("attention_mask is only used with a [B, L] tensor of prompts; pass ragged token-id "
                         "lists without it, or the prompts as a padded tensor")
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2 or prompts.shape[0] == 0:
            raise ValueError(f"a prompts tensor must be a non-empty [B, L] (or [L]) tensor of token ids, got "
                             f"shape {tuple(prompts.shape)}")
        if prompts.dtype.is_floating_point or prompts.dtype.is_complex or prompts.dtype == torch.bool:
            raise ValueError(f"a prompts tensor holds token ids: an integer dtype (torch.long), not {prompts.dtype}")
        if attention_mask is None:
            rows = [r.tolist() for r in prompts]
        else:
            if not isinstance(attention_mask, torch.Tensor) or not (
                    attention_mask.dtype == torch.bool or ((attention_mask == 0) | (attention_mask == 1)).all()):
                got = "values other than 0 and 1" if isinstance(attention_mask, torch.Tensor) else \
                    f"a {type(attention_mask).__name__}"
                raise ValueError(f"attention_mask must be a tensor of 0 / 1 (or bool) shaped as the prompts, 1 at each "
                                 f"prompt token; got {got}")
            if attention_mask.shape != prompts.shape:
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != prompts shape {tuple(prompts.shape)}")
            rows = [r[m.bool()].tolist() for r, m in zip(prompts, attention_mask)]
    else:
        if isinstance(prompts, str) or is_conversation(prompts):
            prompts = [prompts]
        if isinstance(prompts, (bytes, bytearray)) or (isinstance(prompts, Sequence) and any(
                isinstance(p, (bytes, bytearray)) for p in prompts)):
            raise ValueError("bytes prompts are not accepted: decode them to str first (b.decode('utf-8')), or pass "
                             "token ids as a list of ints")
        if not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty string, list of strings, list of token-id lists, "
                             "list of chat conversations or a 2-D tensor")
        rows = []
        for i, p in enumerate(prompts):
            if isinstance(p, str) and not p.strip():  # the chat template would make it a turn with nothing in it
                raise ValueError(f"prompt {i} is an empty string ({p!r}); give the text to answer")
            if isinstance(p, str) or is_conversation(p):
                if not isinstance(p, str):
                    check_conversation(p, f"prompt {i}")
                if tok is None:
                    raise ValueError("string prompts need a tokenizer: load the model with dllm.load_model(path) "
                                     "(tokenizer files present) or pass token ids")
                rows.append(encode_prompt(tok, p, chat_template, content_specials))
            else:
                rows.append(_token_row(p, i))
    check_prompt_ids(rows, vocab_size(model), model.mask_id)
    return rows


def encode_prompt(tok, p, chat_template: bool = True, content_specials: bool = True) -> list[int]:
    """A string or a conversation as token ids: through the tokenizer's chat template (with the generation
    prompt) when it has one and ``chat_template``, else the string as it is. ``content_specials=False``: a special
    token's text inside a message's content (``"<|eot_id|>"`` typed by a user) is text, as every other character
    of the content, not the special token (:func:`_content_as_text`); the template's own special tokens are special
    tokens either way. Without special-token text in the contents both ways give the same ids."""
    messages = [{"role": "user", "content": p}] if isinstance(p, str) else p
    if chat_template and getattr(tok, "chat_template", None):
        ids = None if content_specials else _content_as_text(tok, messages)
        if ids is not None:
            return ids
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    if not isinstance(p, str):
        raise ValueError("chat conversations need a tokenizer with a chat template")
    return tok(p)["input_ids"]


def _content_as_text(tok, messages) -> list[int] | None:
    """The chat template's ids with the special-token text inside the contents of ``messages`` tokenised as text
    (``split_special_tokens``); ``None`` where no content holds any (then the plain path's ids are the same). Each
    such content is wrapped in two characters found nowhere in the conversation before the template is applied, the
    text between them tokenised as text and the template's text around them as usual."""
    specials = [t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if t.special and t.content]
    specials += [t for t in getattr(tok, "all_special_tokens", []) if t not in specials]
    marked = {i for i, m in enumerate(messages)
              if isinstance(m.get("content"), str) and any(t in m["content"] for t in specials)}
    if not marked:
        return None
    seen = "".join(str(m.get("content", "")) + str(m.get("role", "")) for m in messages)
    a, b = [c for c in map(chr, range(0xE000, 0xF900)) if c not in seen][:2]  # private-use characters
    wrapped = [dict(m, content=a + m["content"] + b) if i in marked else m for i, m in enumerate(messages)]
    text = tok.apply_chat_template(wrapped, add_generation_prompt=True, tokenize=False)
    if text.count(a) != len(marked) or text.count(b) != len(marked):
        raise ValueError("a message's content holds a special token's text (e.g. '<|eot_id|>') that this "
                         "tokenizer's chat template does not keep as it is; remove it from the message")
    head, *rest = text.split(a)
    ids = tok(head, add_special_tokens=False)["input_ids"] if head else []
    for part in rest:
        content, _, after = part.partition(b)
        ids += tok(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if after:
            ids += tok(after, add_special_tokens=False)["input_ids"]
    return ids


def check_model(model) -> None:
    """``model`` is a loaded model (what :func:`generate` documents), not a name or path: ``TypeError`` pointing
    to :func:`dllm.load_model` (checked first, so a wrong argument is not reported as a missing attribute deep in
    the loop)."""
    if isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model is {str(model)!r}, a name or path, not a model: load it first, "
                        f"model = dllm.load_model({str(model)!r}), and pass the model")
    if not (callable(model) and hasattr(model, "mask_id")):
        raise TypeError(f"model is a {type(model).__name__}, not a dllm model: pass dllm.load_model(path) (a "
                        "checkpoint directory or bundled name), or a transformers model wrapped in "
                        "dllm.models.hf.HFModel")


def decoding(fn):
    """Run ``fn`` the way the decode loop runs: without autograd, and outside inference mode even under a caller's
    ``torch.inference_mode()`` (the loop and the graph path read tensors' version counters, which inference tensors
    do not keep; the tensors the loop makes are then ordinary ones, and the caller's are only read)."""
    return torch.inference_mode(False)(torch.no_grad()(fn))


@decoding
def generate(
    model,
    prompts,
    config: GenerateConfig | None = None,
    *,
    sampler=None,
    cache=None,
    block_policy=None,
    guide=None,
    attention_mask: torch.Tensor | None = None,
    row_ids=None,
    max_rows: int | None = None,
    **overrides,
) -> GenerateOutput:
    """Decode ``gen_length`` masked positions after each prompt.

    Args:
        model: a :class:`dllm.models.Transformer` (from :func:`dllm.load_model`) or a
            :class:`dllm.models.hf.HFModel`.
        prompts: a string or list of strings (chat template applied), chat conversations (lists of
            ``{"role", "content"}`` with string values), ragged lists of token ids (integers: Python, numpy or 0-d
            tensors; not bools, floats or strings; one prompt's ids still go in a list: ``[[1, 2, 3]]``), or a
            ``[B, L]`` integer tensor with ``attention_mask``.
        config: a :class:`GenerateConfig`; keyword ``overrides`` (``gen_length=...``) build or amend it.
        sampler: a registered name (a preset: a :class:`~dllm.recipes.Recipe` of sampler, block layout and
            cache), a recipe, or a sampler object (default: the model family's baseline).
        cache: a cache policy or registered name (default: the recipe's cache, e.g. ``dual`` for the
            ``fast-dllm`` preset, when the model supports caches; else :class:`~dllm.caches.NoCache`). A name or
            the recipe's choice builds a fresh cache per call.
        block_policy: default: the recipe's policy if it has one (e.g. AdaBlock), else
            :class:`~dllm.blocks.FixedBlocks` with ``config.block_length`` (when that is ``None``, the recipe's
            ``block_length``, e.g. 32 for ``fast-dllm``). :func:`dllm.recipes.resolve` is the whole rule.
        guide: AR-guided decoding (:mod:`dllm.samplers.guided`): a causal LM checkpoint directory, the bundled
            name ``ar-tiny`` or a loaded ``transformers`` causal LM. With no ``sampler`` (or ``"guided"``) it
            builds the ``guided`` preset around it; a :class:`~dllm.samplers.guided.GuidedSampler` gets it as
            its guide.
        row_ids: one identity per row (ints or strings, e.g. the sample ids of an evaluation) keying the row's
            random stream together with ``config.seed``: a row's draws depend on (seed, its id), never on the
            batch. Default: the row's prompt token ids plus how many identical prompts come before it in this
            call (the same prompt twice in one call gets two different streams).
        max_rows: continuous batching: at most this many rows decode at once, a row leaving the batch at the step
            it finishes and the next prompt taking its place (default ``None``: every prompt in one batch, where a
            finished row stays until the last finishes). Each row's tokens and statistics are the same either way
            (per-row random streams: the sampler's ``noise_scope`` must be ``"row"``); ``stats.nfe`` counts the
            batch's forwards, ``stats.row_forwards`` the rows they computed, and the per-step ``stats.trace`` is
            not kept (a step's rows change as they come and go).
    """
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, numbers.Integral)
                                 or max_rows < 1):
        raise ValueError(f"max_rows must be a positive integer (rows decoding at once) or None, got {max_rows!r}")
    check_model(model)
    unknown = sorted(set(overrides) - set(GenerateConfig.__dataclass_fields__))
    if unknown:
        raise TypeError(f"generate() got unknown option(s) {unknown}; GenerateConfig fields: "
                        f"{', '.join(GenerateConfig.__dataclass_fields__)}")
    if config is None:
        config = GenerateConfig(**overrides)
    elif overrides:
        config = GenerateConfig(**{**config.__dict__, **overrides})
    if guide is not None:
        from dllm.samplers.guided import with_guide

        sampler = with_guide(sampler, guide)
    sampler, cache, policy, config = resolve(model, sampler, cache, block_policy, config)
    if model.mask_id is None:
        raise ValueError("the model has no mask token id; set model.mask_id")
    if max_rows is not None and _shared_stream(sampler):
        raise ValueError("max_rows (rows joining and leaving the batch) needs each row's own random stream; the "
                         "sampler draws from the run's shared stream (noise_scope 'region' or 'canvas'), whose draws "
                         "depend on the batch: use noise_scope='row' or leave max_rows None")
    rows = prepare_prompts(model, prompts, attention_mask, config.chat_template)
    dec = Decoder(model, sampler, cache, policy, config)
    try:
        if max_rows is not None:
            return _continuous(dec, rows, row_ids, int(max_rows))
        st = dec.start(rows, row_ids)
        while dec.step(st):
            pass
        return dec.output(st)
    finally:
        dec.release()


def _shared_stream(sampler) -> bool:
    """Whether ``sampler`` (or a sampler it wraps) draws from the run's shared random stream (``noise_scope``
    ``"region"`` or ``"canvas"``), whose draws depend on the batch."""
    while sampler is not None:
        if getattr(sampler, "noise_scope", "row") != "row":
            return True
        sampler = getattr(sampler, "inner", None)
    return False


def _continuous(dec: Decoder, rows: list[list[int]], row_ids, R: int) -> GenerateOutput:
    """:func:`generate` with ``max_rows=R``: at most ``R`` rows decode at once; a row leaves the batch at
    the step it finishes (its canvas, K/V rows and sampler state dropped: :func:`_select`, :func:`_move_rows`) and
    the next prompt joins in its place (:func:`_cat`; re-padded to the batch's longest prompt), as the serving engine
    batches requests. Each row keeps its own random stream (``row_ids``, as all rows at once), so its tokens are what
    the batch of every row gives; its commit steps and finishing step count its own forwards. The per-step trace is
    not kept (a step's rows change as they come and go)."""
    config = dec.config
    N = len(rows)
    dec.check_rows(rows)  # every prompt, before the first decodes
    keys = row_keys(rows, row_ids, config.seed)  # each prompt's stream, as in one batch of every row
    dec.rows_move = True
    dec.reads = functools.partial(_reads, dec=dec, tokens=False)  # finished rows, forwards: in the step's own sync
    if dec.graphed:  # the K/V buffers sized for a batch bucket, rows move within
        dec.cache.batch_buckets = True
    limit = dec.step_limit  # a row's forwards before it makes no progress
    out: list[tuple] = [()] * N  # each prompt's record once it finished
    nfe = own = 0  # the forwards and own logits columns of the batches before the current one
    t_start = time.perf_counter()

    def state(take: list[int], start: bool) -> DecodeState:
        st = dec.start([rows[i] for i in take]) if start else dec.new_state([rows[i] for i in take])
        st.row_key = keys[take].to(st.row_key.device)
        return st

    idx = list(range(min(R, N)))  # the prompt of each row of the batch
    st, nxt = state(idx, True), len(idx)
    joined = torch.zeros(len(idx), dtype=torch.long, device=st.x.device)  # the batch's forwards before each row
    while True:
        dec.max_iters, dec.row_names = float("inf"), idx  # each row's progress checked below
        dec.step(st)
        st.trace.clear()
        _, done, row_nfe, n_own = _read_back(st, tokens=False)
        own += n_own
        if max(row_nfe) > limit:
            raise RuntimeError(f"decoding made no progress after {max(row_nfe)} forwards of a row; sampler "
                               f"{dec.sampler!r} commits nothing")
        gone = [i for i in range(len(idx)) if done[i]]
        keep = [i for i in range(len(idx)) if not done[i]]
        if gone:  # the finished rows' records, their steps counted from when each joined
            at, P = torch.tensor(gone, device=st.x.device), st.P
            base = joined[at]
            step = st.commit_step[at, P:]
            rec = [st.x[at, P:], torch.where(step >= 0, step - base[:, None], step), st.finish[at] - base,
                   *(None if t is None else t[at, P:]
                     for t in (st.commit_logprob, st.commit_top_ids, st.commit_top_logprobs))]
            for j, i in enumerate(gone):
                out[idx[i]] = (row_nfe[i], *(None if t is None else t[j] for t in rec))
        take = list(range(nxt, min(nxt + R - len(keep), N)))
        nxt += len(take)
        if not keep:
            if not take:
                break
            nfe += st.nfe  # every row finished: the next prompts start a batch of their own
            dec.release()
            idx, st = take, state(take, True)
            joined = torch.zeros(len(take), dtype=torch.long, device=st.x.device)
            continue
        if not take:
            if gone:
                st, joined, idx = _without(dec, st, keep), joined[keep], [idx[i] for i in keep]
            continue
        moved = keep if gone else None  # the rows the cache and the sampler keep (None: all)
        if gone:
            st, joined, idx = _select(st, keep), joined[keep], [idx[i] for i in keep]
        st = _joined(dec, st, state(take, False), moved)  # the kept rows and the newcomers in one move
        joined = torch.cat([joined, joined.new_full((len(take),), st.nfe)])
        idx = idx + take
    if dec._bank is not None:  # the step graphs' bank free for the next decode
        dec._bank.release(st)
    dec.t_start = t_start
    seqs, commit_step, finish, *records = (None if out[0][k] is None else torch.stack([o[k] for o in out])
                                           for k in range(1, 7))
    return dec._result(rows, seqs, [o[0] for o in out], finish, commit_step, *records, nfe=nfe + st.nfe, trace=[],
                       own=own)


@dataclass
class DecodeState:
    """What one decode carries from step to step (all tensors on the model's device; ``[B, T]`` canvas-wide,
    ``[B]`` per row). :meth:`Decoder.step` advances it by one forward."""

    rows: list[list[int]]  # prompt token ids
    x: torch.Tensor  # [B, T] canvas: left padding, prompt, generation (masks until committed)
    positions: torch.Tensor  # [B, T] RoPE positions (left padding skipped)
    key_mask: torch.Tensor | None  # [B, T] real tokens (None: no padding)
    P: int  # canvas column where generation starts
    lo: torch.Tensor  # [B] region start
    hi: torch.Tensor  # [B] region end (exclusive)
    steps: torch.Tensor  # [B] schedule length of the current region
    step_in: torch.Tensor  # [B] steps taken in the current region
    n_start: torch.Tensor  # [B] masks in the region when it started
    active: torch.Tensor  # [B] unfinished
    finish: torch.Tensor  # [B] step at which the row finished (-1: not yet)
    row_nfe: torch.Tensor  # [B] forwards the row took part in
    committed: torch.Tensor  # [B, T] positions committed at the last step
    commit_step: torch.Tensor  # [B, T] step at which each position was committed (-1: never)
    commit_logprob: torch.Tensor | None  # [B, T] log-probability of the committed token (record_confidence)
    # [B, T, k] the committing step's k most probable tokens and their log-probabilities (record_top_logprobs)
    commit_top_ids: torch.Tensor | None
    commit_top_logprobs: torch.Tensor | None
    row_key: torch.Tensor  # [B, 2] per-row random stream keys
    generator: torch.Generator | None  # the run's generator (reference random streams)
    window: tuple[int, int]  # host copy of the next step's window (the union of the active rows' regions)
    # host copy of the next step's row window width where each row's logits are at its own window
    # (Decoder.row_windows: the widest active row's region), else 0
    width: int = 0
    # the cache's plan for the next step, read in the previous step's host sync: (canvas it was computed for, its
    # version, active-row mask, partial?, largest active set, KVCache.plan_rows's tensors); used only while the
    # canvas is that same tensor
    plan_hint: tuple | None = None
    # the next forward, planned and made ready before the last step's synchronisation (Decoder._prepare_next), used
    # while the canvas is that same tensor and the window the one it was planned for
    ahead: Any = None
    # from the last step's host sync on the pipelined graph path: (the fewest masks left in an active row's region,
    # the most tokens a row committed in that step, each row's steps in its region after it or -1 where the row is
    # finished); whether the next forward is launched before the sync (Decoder._launch_early)
    pace: tuple[int, int, list[int]] | None = None
    # the numbers of Decoder.reads, read in the last step's host sync (None: no reads, or its caller dropped them)
    read: list | None = None
    state: dict = field(default_factory=dict)  # sampler scratch space
    trace: list = field(default_factory=list)
    nfe: int = 0


def _versions(st: DecodeState) -> tuple:
    """The forward's inputs in ``st`` (canvas, positions, key mask) as (tensor, version) pairs: a plan made for them
    holds while each is the same tensor, unmodified."""
    return tuple((t, t._version) for t in (st.x, st.positions, st.key_mask) if t is not None)


@dataclass
class _Ahead:
    """A next forward made ready ahead (:meth:`Decoder._prepare_next`)."""

    ready: Any  # dllm.graphs.Prepared
    inputs: tuple  # _versions of the state it was planned on
    window: tuple[int, int]
    Q: int  # the active width and packed rows of its plan (rounded; N None: not packed)
    N: int | None
    query_idx: torch.Tensor
    guarded: bool = False  # its inputs filled under Decoder._guard: to be launched before the synchronisation
    logits: torch.Tensor | None = None  # launched before the step's synchronisation (Decoder._sync): its logits
    launched: bool = False  # ... whether it was (a speculative cache's first part returns no logits)
    stop: int | None = None  # a speculative cache's first part: up to this layer (None: every layer)
    extra: tuple = ()  # the policy's own plan numbers it was planned with (KVCache.plan_numbers)
    width: int = 0  # the logits columns per row it computes

    def matches(self, st: DecodeState, window: tuple[int, int], width: int) -> bool:
        """Whether ``st`` is the state it was planned on, for ``window`` and ``width`` logits columns per row."""
        now = _versions(st)
        return window == self.window and width == self.width and len(now) == len(self.inputs) and all(
            a is b and va == vb for (a, va), (b, vb) in zip(now, self.inputs))


class Decoder:
    """The decode loop's parts, resolved once: ``start`` builds a :class:`DecodeState`, ``step`` runs one forward
    and commits (one host synchronisation per step in the loop itself), ``output`` collects the result.
    :func:`generate` is ``start``, ``step`` until it returns False, ``output``."""

    #: whether a next forward made ready ahead may be launched before the step's synchronisation (:meth:`_sync`);
    #: False launches it after the synchronisation, as a step did before (the same tokens: ``bench_step.py``'s
    #: ``graph-late`` mode sets it to time the difference)
    launch_early = True
    #: whether rows may join and leave the batch between steps (the serving engine sets it): a speculative cache's
    #: next first part is then not launched before the synchronisation (:meth:`_prepare_next`)
    rows_move = False
    #: a forward launched before the synchronisation at this step's width, for a next step whose active set needs a
    #: narrower one (dKV-Cache-Decode's falls within a block), is kept where it computes at most this many rows over
    #: the batch: its rows are the next step's, more repeats of each row's first active row (written identically);
    #: at LLaDA-8B's shape on a GPU a partial forward of that many rows costs about what reading the weights costs, so
    #: the wait it spares is worth more than its padding. 0: only a forward at the next step's own width is kept
    wide_ahead = 128
    #: whether a step's work after its forward (the sampler, the commits, the regions' bookkeeping) may run as one
    #: CUDA graph (:meth:`_commit_graphed`); False runs it eagerly, as a step did before (the same tokens:
    #: ``bench_step.py``'s ``graph-eager-sampler`` mode sets it to time the difference)
    step_graphs = True
    #: ``reads(st)``: numbers of the state the caller reads after each step (a 1-d integer or bool tensor on the
    #: state's device, made after the step's commits), read in the step's own host synchronisation into
    #: :attr:`DecodeState.read`; None: none. The serving engine reads its rows' tokens, whether each row is finished
    #: and its forwards there, so that a served step synchronises once (and never waits for a forward launched
    #: before the synchronisation)
    reads = None
    #: each batch row's index among the caller's rows, named in a :class:`NonFiniteLogitsError` (None: its position
    #: in the batch); set where rows join and leave (:func:`generate`'s ``max_rows``)
    row_names = None

    def __init__(self, model, sampler, cache, policy, config: GenerateConfig):
        self.model, self.sampler, self.cache, self.policy, self.config = model, sampler, cache, policy, config
        # the declared hooks (docs/architecture.md); None: not used by this policy / sampler
        self.refine = policy.refine  # regions fixed after their first forward (AdaBlock)
        self.widen = sampler.window_columns  # logits beyond the regions (Prophet)
        self.slide = policy.slide  # regions recomputed before every forward (sliding window)
        # each row's logits at its own window's columns (a [B, W] logits_idx, every row as wide as the widest region),
        # where the sampler takes per-row windows (SamplerBase.row_windows), no hook widens a window (Prophet's) and a
        # policy's refine takes them (refine_rows): no row's logits computed at another row's columns, the step graphs
        # keyed by the window's width alone; at batch 1 a row's window is the batch's (Decoder.step)
        self.row_windows = self.widen is None and (self.refine is None or getattr(policy, "refine_rows", False)) \
            and declares_row_windows(sampler)
        self.step_stats = cache.step_stats
        self.shift = 1 if getattr(model, "shift_logits", False) else 0
        self.n_layers = getattr(getattr(model, "config", None), "n_layers", 1)
        self.device = model.device
        self.stop_ids = ids_on(tuple(i for i in (model.eos_id, model.eot_id) if i is not None), self.device)
        self.clock = _Clock(self.device)
        self.graphs = GraphRunner.for_model(model, config.graphs) if isinstance(cache, (KVCache, NoCache)) else None
        self._graph_stats0 = dict(self.graphs.stats) if self.graphs is not None else {}
        self._tail_stats0 = dict(self.graphs.tail_stats) if self.graphs is not None else {}
        # why every cached step runs eagerly, decided once (None: through the graphs); where they can replay at all
        # (not with guidance, per-layer hooks, mixtures of experts, other models) the graph path's shapes are rounded
        # up and its K/V buffers lent by the runner's pool
        self._eager_setting = None if self.graphs is None else self.graphs.setting_reason(cache, config.cfg_scale > 0)
        # why every full forward runs eagerly (None: through graphs, GraphRunner.full: every forward without a cache,
        # a cache's refreshes once it holds its buffers)
        self._eager_full = None if self.graphs is None else self.graphs.full_reason(cache, config.cfg_scale > 0)
        self.graphed = self.graphs is not None and self._eager_setting is None
        if self.graphed:
            cache.buckets, cache.pool = self.graphs.buckets, self.graphs.buffers
        if isinstance(cache, KVCache) and cache.can_speculate:
            # on the graph path its partial forwards run without host synchronisation, in parts (_speculate); a cache
            # object used again off the graph path decides inside its forwards again
            cache.speculative = self.graphed
        # the next partial forward planned and made ready before each step's synchronisation (_prepare_next): the graph
        # path, a cache that plans through KVCache.plan from the decode state alone, a window no sampler widens
        self._pipelined = (self.graphed and self.widen is None and type(cache).plan is KVCache.plan
                           and cache.plans_ahead)
        self._pinned: dict[int, torch.Tensor] = {}  # host memory the step's numbers are copied to (_sync)
        self._host_ready = None  # the event after that copy
        self._early = self.launch_early  # next forwards may be launched before the synchronisation (_launch_early)
        self._early_off = None  # the window within which a missed plan stopped them (_launch_early)
        self._bounds = None  # (key, [2, 7 + policy's numbers] bounds) of _guard
        self._relaunch = None  # a speculative cache's first part that may be launched again (_speculate)
        #: the (row, column) logits the steps computed: every row over its own window or the union of the rows'
        self.logits_columns = 0
        #: the rows the forwards computed, summed over forwards
        self.row_forwards = 0
        # the step's work after its forward as one graph (_commit_graphed), where the model's forwards can go through
        # graphs and the sampler's step is a function of its tensors alone (SamplerBase.graph_safe; a window widened
        # past the regions, Prophet's, is keyed by its ends as any window): the block policies' hooks are functions
        # of the decode state's tensors (AdaBlock's refined end of the window's logits, ops.dense_window; MultiBlock's
        # and the sliding window's regions of the canvas), their windows part of the graphs' keys. A speculative
        # cache's forward runs in parts and reads its drift tests, before the step: its logits are copied in as any
        # forward's. Its value is part of the graphs' keys.
        self._bank = None  # the step graphs' static state of the last step (_StepBank)
        self._commit_graph = (repr(sampler), repr(policy), repr(config), self._pipelined, self.shift) if (
            self.step_graphs and self.graphs is not None and self.graphs._model_reason(config.cfg_scale > 0) is None
            and declares_graph_safe(sampler)) else None

    @property
    def buckets(self) -> bool:
        """Whether the canvas is rounded up to a bucket (:meth:`prompt_width`): the runner buckets and a cache's partial
        forwards go through graphs, or rows join and leave (:attr:`rows_move`, a served batch) and the full forwards
        do (every forward without a cache). A generation without a cache keeps its exact canvas: each of its steps
        has one shape, where padding would cost every step of a full forward; a served batch changes its canvas
        whenever its longest prompt joins or leaves."""
        return self.graphs is not None and self.graphs.buckets and (
            self.graphed or (self.rows_move and self._eager_full is None))

    @property
    def pad_id(self) -> int:
        """The canvas's left-padding token id: the model's pad id, else its EOS id."""
        return self.model.pad_id if self.model.pad_id is not None else self.model.eos_id

    @property
    def step_limit(self) -> int:
        """The forwards a decode (or a row of a batch whose rows come and go) may take before it is said to make no
        progress: four times its positions and steps, and some."""
        return 4 * (self.config.gen_length + self.config.total_steps) + 8

    def prompt_width(self, longest: int) -> int:
        """The canvas column where generation starts for prompts of at most ``longest`` tokens: ``longest``, or where
        shapes are bucketed (:attr:`buckets`) the canvas length rounded up to a :func:`~dllm.ops.shape_bucket` size
        (within the model's context) less ``gen_length``: more left padding, masked out as every shorter prompt's
        is, so that a few canvas lengths (and their graphs) serve every prompt length."""
        G = self.config.gen_length
        if not self.buckets:
            return longest
        return shape_bucket(longest + G, self.model.max_seq_len) - G

    def release(self) -> None:
        """The end of a generation: a cache's K/V buffers lent by the graph path's pool go back to it."""
        if self.graphed:
            self.cache.release()

    def start(self, rows: list[list[int]], row_ids=None) -> DecodeState:
        """The decode state of ``rows`` (:meth:`new_state`), the cache reset for them."""
        self.t_start = time.perf_counter()
        st = self.new_state(rows, row_ids)
        self.cache.reset(*st.x.shape)
        self.cols_all = cached_arange(st.x.shape[1], self.device)
        self.host_window(st)
        self.max_iters = self.step_limit
        return st

    def check_rows(self, rows: list[list[int]]) -> None:
        """Refuse ``rows`` that cannot be decoded (a prompt too long for the context with ``gen_length``, more top
        log-probabilities asked for than the vocabulary holds) with a message naming the fix."""
        model, G, K = self.model, self.config.gen_length, self.config.record_top_logprobs
        if K and K > vocab_size(model):
            raise ValueError(f"record_top_logprobs={K} exceeds the vocabulary ({vocab_size(model)} tokens)")
        P = max(len(r) for r in rows)
        if P + G > model.max_seq_len:
            raise ValueError(
                f"longest prompt ({P} tokens) + gen_length ({G}) = {P + G} exceeds the model's context of "
                f"{model.max_seq_len} tokens; shorten the prompt or lower gen_length"
            )

    def new_state(self, rows: list[list[int]], row_ids=None) -> DecodeState:
        """A decode state for ``rows`` (prompt token ids), before their first forward; the decoder and its cache are
        left as they are (rows joining a batch: :func:`_cat`)."""
        model, config, device = self.model, self.config, self.device
        self.check_rows(rows)
        B, P, G = len(rows), max(len(r) for r in rows), config.gen_length
        K = config.record_top_logprobs
        P = self.prompt_width(P)
        T = P + G
        pad = self.pad_id
        x = torch.full((B, T), model.mask_id, dtype=torch.long, device=device)
        valid = torch.ones((B, T), dtype=torch.bool, device=device)
        for b, r in enumerate(rows):  # left padding, once, before decoding
            x[b, : P - len(r)] = pad
            valid[b, : P - len(r)] = False
            x[b, P - len(r) : P] = torch.tensor(r, device=device)
        all_valid = all(len(r) == P for r in rows)
        generator = None
        if config.seed is not None:
            generator = torch.Generator(device=device).manual_seed(config.seed)
        lo = torch.full((B,), P, dtype=torch.long, device=device)
        positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
        hi, steps = self._next_region(lo, T, P, positions)
        st = DecodeState(
            rows=rows, x=x, positions=positions,
            key_mask=None if all_valid else valid, P=P, lo=lo, hi=hi, steps=steps,
            step_in=torch.zeros(B, dtype=torch.long, device=device), n_start=hi - lo,
            active=torch.ones(B, dtype=torch.bool, device=device),
            finish=torch.full((B,), -1, dtype=torch.long, device=device),
            row_nfe=torch.zeros(B, dtype=torch.long, device=device),
            committed=torch.zeros((B, T), dtype=torch.bool, device=device),
            commit_step=torch.full((B, T), -1, dtype=torch.long, device=device),
            commit_logprob=torch.full((B, T), float("nan"), device=device) if config.record_confidence else None,
            commit_top_ids=torch.full((B, T, K), -1, dtype=torch.long, device=device) if K else None,
            commit_top_logprobs=torch.full((B, T, K), float("nan"), device=device) if K else None,
            row_key=row_keys(rows, row_ids, config.seed).to(device), generator=generator, window=(P, T),
        )
        if self.slide is not None:
            st.lo, st.hi = self.slide(x == model.mask_id, st.lo)
        return st

    def _next_region(self, lo, T: int, P: int, positions):
        """The policy's next regions; each row's canvas column of its position 0 (from the RoPE ``positions`` and the
        generation's start ``P``) for policies that declare ``row_offsets`` (blocks aligned to the model's grid)."""
        if self.policy.row_offsets:
            return self.policy.next_region(lo, T, self.config, offsets=P - positions[:, P])
        return self.policy.next_region(lo, T, self.config)

    def _no_rows(self, like: torch.Tensor) -> torch.Tensor:
        """An all-False ``[B]`` bool tensor shaped as ``like``, made once per shape and shared by the trace's records
        (read-only: a new tensor on every step would be a kernel each)."""
        z = getattr(self, "_false", None)
        if z is None or z.shape != like.shape or z.device != like.device:
            z = self._false = torch.zeros_like(like, dtype=torch.bool)
        return z

    def host_window(self, st: DecodeState) -> None:
        """The next step's window read onto the host, :attr:`DecodeState.window` (the union of the active rows'
        regions) and, with :attr:`row_windows`, :attr:`DecodeState.width`: one synchronisation (a batch's start, a
        served batch's rows regrouped; a step reads them in its own)."""
        v = torch.stack([*self._window_ends(st), *([self._width(st)] if self.row_windows else [])]).tolist()
        st.window = tuple(v[:2])
        if self.row_windows:
            st.width = v[2]

    def regroup(self, st: DecodeState) -> None:
        """After ``st``'s rows moved (:func:`_select`, :func:`_cat`, :func:`_repad`; their cache's buffers with
        :func:`_move_rows`): the decoder's canvas columns, the cache's batch and canvas length, the key mask (none
        where every column is real) and the next step's window read again."""
        T = st.x.shape[1]
        self.cols_all = cached_arange(T, st.x.device)
        if getattr(self.cache, "filled", False):  # its buffers were moved with the rows
            self.cache.batch, self.cache.canvas_len = st.x.shape[0], T
        else:
            self.cache.reset(st.x.shape[0], T)
        if st.key_mask is not None and bool(st.key_mask.all()):
            st.key_mask = None
        self.host_window(st)

    @staticmethod
    def _width(st: DecodeState) -> torch.Tensor:
        """0-d: the widest active row's region (at least 1), the logits columns per row of a step with per-row windows."""
        return torch.where(st.active, st.hi - st.lo, 0).max().clamp_min(1)

    def _row_cols(self, st: DecodeState, W: int) -> torch.Tensor:
        """``[B, W]``: each row's window columns (:attr:`row_windows`), from its region's start, moved left where
        they would pass the canvas end."""
        return st.lo.clamp_max(st.x.shape[1] - W)[:, None] + self.cols_all[:W]

    @staticmethod
    def _window_ends(st: DecodeState) -> list[torch.Tensor]:
        """:meth:`_window` as two 0-d tensors (the step's sync stacks them with its other numbers in one kernel)."""
        T = st.x.shape[1]
        return [torch.where(st.active, st.lo, T).min(), torch.where(st.active, st.hi, 0).max()]

    def step(self, st: DecodeState) -> bool:
        """One forward and its commits for every unfinished row; returns whether any row is still unfinished.
        The loop synchronises with the device once, at the end (the next window, whether rows are left, whether
        the logits were finite); caches and some samplers add their own (docs/architecture.md)."""
        model, config, sampler, cache, clock = self.model, self.config, self.sampler, self.cache, self.clock
        x, P = st.x, st.P
        B, T = x.shape
        win_lo, win_hi = st.window
        w_lo, w_hi = self.widen(win_lo, win_hi, P, T) if self.widen is not None else (win_lo, win_hi)
        per_row = self.row_windows and B > 1  # alone, a row's window is the batch's
        if per_row:  # each row at its own columns ([B, W])
            W = st.width
            cols = lidx = self._row_cols(st, W)
        else:  # every row over the window
            W, cols = w_hi - w_lo, self.cols_all[w_lo:w_hi]
            lidx = cols.expand(B, -1)
        self.logits_columns += B * W
        self.row_forwards += B
        tc = clock.mark()
        runner = self.graphs
        ahead, st.ahead = st.ahead, None
        logits = None
        matched = ahead is not None and ahead.matches(st, (w_lo, w_hi), W)
        if ahead is not None and ahead.launched and not matched:
            runner.ahead["discarded"] += 1  # launched, but the state changed since (the serving engine's regrouping)
        held = False
        if matched:
            # planned and made ready before the last step's synchronisation, whose numbers confirmed the plan: the
            # cache holds this step's plan, the graph its inputs; only the launch is left (not held: the runner
            # dropped that graph since, the step plans again)
            t0 = clock.mark()
            if ahead.launched:  # launched before the last step's synchronisation (_sync)
                held, logits = True, ahead.logits
                runner.stats["replays"] += 1
            else:
                held = runner.holds(ahead.ready)
                logits = runner.replay(ahead.ready) if held else None
            if held:
                query_idx, eager = ahead.query_idx, None
                st.plan_hint = None
                if cache.speculative:  # its first part ran: the drift tests read, the forward resumed or redone
                    logits = self._speculate(st, lidx, query_idx, cache.query_tokens, first=(logits, ahead.stop))
        if not held:
            cstate = self._cache_state(st, (w_lo, w_hi))
            hint = st.plan_hint
            if hint is not None and hint[0] is x and hint[1] == x._version:  # the plan read in the last step's sync
                query_idx, _ = cache.plan(cstate, hint=hint[2:])
            else:
                query_idx, _ = cache.plan(cstate)
            st.plan_hint = None
            t0 = clock.mark()
            eager = None if runner is None else ("full forward" if query_idx is None else self._eager_setting)
            # the rows of a partial forward without their padding (rows out of step: one refreshing its block, the
            # others reading their cache), known from the plan's host numbers
            n_query = cache.query_tokens if query_idx is not None else None
            if runner is not None and query_idx is None and self._eager_full is None:
                # a full forward through a graph (None: the cache takes its buffers now, eagerly)
                logits = runner.full(x, st.positions, st.key_mask, lidx, cache)
            if logits is None and runner is not None and eager is None:
                if query_idx is not None and cache.speculative:
                    logits = self._speculate(st, lidx, query_idx, n_query)
                else:
                    logits = runner(x, st.positions, st.key_mask, lidx, cache, query_idx, n_query)
            elif logits is None:
                if eager is not None:
                    runner.stats["eager:" + eager] += 1
                logits = _forward(model, x, st.positions, st.key_mask, lidx, config, cache, query_idx, n_query)
        t1 = clock.mark()
        cstats = self.step_stats(self.n_layers) if self.step_stats is not None else {}
        if per_row:
            win_hi = None  # read by a sampler that widens the window alone (Prophet's)
        if self._commit_graph:
            bad, record, head, pace = self._commit_graphed(st, logits, w_lo, w_hi, win_hi, cols)
        else:
            bad, record, head, pace = self._commit(st, logits, w_lo, w_hi, win_hi, cols, st.nfe + 1)
        wid = []
        if per_row:  # the next step's width, the head's last number: read last of all
            if len(head) == 1:  # the step graph's numbers in one tensor
                head = [head[0][:-1], head[0][-1:]]
            head, wid = head[:-1], head[-1:]
        t2 = clock.mark()
        clock.add("cache", tc, t0)
        clock.add("model", t0, t1)
        clock.add("sampler", t1, t2)
        st.nfe += 1
        st.trace.append({**record, **cstats})
        # the next step's cache plan (active rows, partial or full, largest active set), read in this sync
        nxt = self._plan_next(st)
        more = [self.reads(st)] if self.reads is not None else []
        host = torch.cat([*head, *(t.view(1) for t in (nxt[1] if nxt is not None else ())), *pace, *more, *wid])
        # a partial forward replayed from a graph: the next one is expected alike (same shapes and window), so it is
        # planned and its graph's inputs filled now, while the device still works on this step
        # (and, where the regions look far from their end, launched now: _sync)
        ahead = None
        if self._pipelined and nxt is not None and query_idx is not None and eager is None and \
                not self._refresh_next(st):
            tp = clock.mark()
            ahead = self._prepare_next(st, nxt, w_lo, w_hi, W if per_row else None,
                                       host if self._launch_early(st) else None)
            clock.add("cache", tp, clock.mark())  # the next step's plan, made now
        synced = self._sync(host, ahead if ahead is not None and ahead.guarded else None)
        if wid:
            st.width, synced = synced[-1], synced[:-1]
        if more:
            n = more[0].numel()
            synced, st.read = synced[:len(synced) - n], synced[len(synced) - n:]
        running, nonfinite, n_lo, n_hi = synced[:4]
        st.window = (n_lo, n_hi)
        if nxt is not None:
            extra = synced[7:7 + len(nxt[1]) - 3]  # the policy's own numbers (KVCache.plan_mask)
            st.plan_hint = (st.x, st.x._version, nxt[0], synced[4], synced[5], synced[6], nxt[2], extra)
        if self._pipelined:
            st.pace = (synced[-B - 2], synced[-B - 1], synced[-B:])
        if ahead is not None:
            how = self._confirmed(ahead, synced, st.x.shape) if running and (not wid or st.width == W) else None
            if how is not None:
                st.ahead = ahead
                runner.ahead["confirmed"] += 1
                if how == "wider":
                    runner.ahead["wider"] += 1
            else:  # the plan differs (a region ended, the active width changed): the next step plans again
                runner.ahead["missed"] += 1
                if ahead.launched:  # launched: its logits are dropped (its writes: _prepare_next)
                    runner.ahead["discarded"] += 1
                if running and synced[4] and tuple(synced[2:4]) == ahead.window:
                    self._early_off = ahead.window  # a width past what wide_ahead keeps: none more in this window
        if nonfinite:
            raise NonFiniteLogitsError.at(bad, st.nfe - 1, lidx[:, 0] - P if per_row else w_lo - P, self.row_names)
        if running and st.nfe >= self.max_iters:
            raise RuntimeError(f"decoding made no progress after {st.nfe} steps; sampler {sampler!r} commits nothing")
        return bool(running)

    def _commit(self, st: DecodeState, logits, w_lo: int, w_hi: int, win_hi: int, cols, done):
        """A step's work after its forward: the non-finite check, the sampler, the commits into the canvas and
        their records, the regions' bookkeeping (:meth:`_advance`) and the numbers the step's synchronisation reads.
        Advances ``st``'s tensors (not ``st.nfe`` or its trace); ``done``: the forwards done with this one (an int,
        or on the step graph's path a 0-d tensor on the device, :meth:`_commit_graphed`). Returns the ``[B, W]``
        non-finite mask, the step's trace record (without the cache's statistics), and the synchronisation's numbers
        before the cache's plan (rows left, non-finite logits, the next window's ends) and after it (the pipelined
        path's pace), as 1-d tensors."""
        model, config, sampler = self.model, self.config, self.sampler
        x, lo, hi, P = st.x, st.lo, st.hi, st.P
        B, T = x.shape
        mask_id = model.mask_id
        rows = cols.dim() == 2  # each row's own window ([B, W] columns), else the batch's w_lo:w_hi
        xw = x.gather(1, cols) if rows else x[:, w_lo:w_hi]
        c = cols if rows else cols[None]
        pinfo = {}
        in_region = (c >= lo[:, None]) & (c < hi[:, None])
        # Non-finite logits (NaN anywhere, +inf, or no finite entry) at a window position of an unfinished row: the
        # position's logits are zeroed so no sampler trips over them, and the step's host sync raises.
        top = logits.amax(-1)
        bad = st.active[:, None] & ((top - top) != 0)  # not finite (NaN or inf), in two kernels where isfinite takes five
        if not _host_check_free(logits) or bool(bad.any()):  # on CPU the check spares a pass over the logits
            logits.masked_fill_(bad[..., None], 0.0)
        if self.refine is not None:
            fresh = st.active & (st.step_in == 0)
            hi, st.steps, pinfo = self.refine(logits, cols[:, :1] if rows else w_lo, lo, hi, st.steps, fresh, config)
            in_region = (c >= lo[:, None]) & (c < hi[:, None])
            st.n_start = torch.where(fresh, ((xw == mask_id) & in_region).sum(-1), st.n_start)
        cand = (xw == mask_id) & in_region & st.active[:, None]
        ctx = StepContext(
            x=xw, cand=cand, step=st.step_in, steps=st.steps, n_region_start=st.n_start, region_lo=lo,
            region_hi=hi, win_lo=cols[:, :1] if rows else w_lo, canvas_len=T, gen_lo=P, global_step=st.nfe,
            total_steps=config.total_steps,
            generator=st.generator, mask_id=mask_id, eos_id=model.eos_id, eot_id=model.eot_id, state=st.state,
            win_hi=win_hi, canvas=x, row_key=st.row_key, row_step=st.row_nfe,
        )
        res = sampler.step(logits, ctx)
        commit = res.commit & cand
        if res.finish is not None:  # early commit: the row takes the proposal at every mask left, and stops
            commit = commit | (res.finish[:, None] & st.active[:, None] & (xw == mask_id))
            hi = torch.where(res.finish & st.active, torch.full_like(hi, T), hi)
        prop = res.proposal
        committed = torch.zeros_like(st.committed)
        if rows:  # written back by scatter: each row's columns are distinct
            x.scatter_(1, cols, torch.where(commit, prop, xw))
            committed.scatter_(1, cols, commit)
            _put(st.commit_step, committed, done)
        else:
            if prop.shape == xw.shape and prop.dtype == x.dtype and \
                    prop.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
                torch.where(commit, prop, xw, out=xw)  # the canvas's window in place: one kernel, no copy back
            else:  # a proposal that broadcasts, casts or reads the canvas itself: computed apart, then copied
                x[:, w_lo:w_hi] = torch.where(commit, prop, xw)
            committed[:, w_lo:w_hi] = commit
            _put(st.commit_step[:, w_lo:w_hi], commit, done)
        if st.commit_logprob is not None or st.commit_top_ids is not None:
            lf = logits.float()
            lse = torch.logsumexp(lf, -1)
            if st.commit_logprob is not None:
                lp = lf.gather(-1, res.proposal[..., None]).squeeze(-1) - lse
                _window_where(st.commit_logprob, cols, w_lo, w_hi, commit, lp)
            if st.commit_top_ids is not None:
                top, ids = lf.topk(st.commit_top_ids.shape[-1], -1)
                keep = commit[..., None]
                _window_where(st.commit_top_ids, cols, w_lo, w_hi, keep, ids)
                _window_where(st.commit_top_logprobs, cols, w_lo, w_hi, keep, top - lse[..., None])
        st.row_nfe.add_(st.active)
        st.step_in += 1
        # early commit (Prophet's all-in step, a guided row's EOS fill): recorded on every step, False when none
        early = res.finish & st.active if res.finish is not None else self._no_rows(st.active)
        # lo and hi are kept, not copied: the loop replaces its per-row tensors, it never writes into them
        record = {"committed": commit.sum(-1), "lo": lo, "hi": hi, "early_commit": early, **pinfo, **res.info}
        x, hi, committed, left = self._advance(st, x, lo, hi, committed, done)
        st.x, st.committed = x, committed
        if self.slide is not None:
            st.lo, st.hi = self.slide(x == mask_id, st.lo)
        # the bools count as 0 / 1; with per-row windows the next step's width last
        head = [t.view(1) for t in (st.active.any(), bad.any(), *self._window_ends(st),
                                    *([self._width(st)] if rows else []))]
        # the pipelined graph path also reads how far the regions are from their end and each row's steps in its
        # region (_launch_early)
        pace = [torch.where(st.active, left, T).min().view(1), record["committed"].max().view(1),
                torch.where(st.active, st.step_in, -1)] if self._pipelined else []
        return bad, record, head, pace

    def _commit_graphed(self, st: DecodeState, logits, w_lo: int, w_hi: int, win_hi: int, cols):
        """:meth:`_commit` as one CUDA graph (:meth:`GraphRunner.tail`: keyed by the window, captured the second time
        its key is seen), on static copies of the decode state's tensors (:class:`_StepBank`): ``st``'s tensors are
        the bank's, advanced in place by each replay, the logits copied into the bank's, the forwards counted on the
        device. The trace record is copied out of the graph's outputs (one copy per dtype), as the next replay
        overwrites them. On the CPU (``capture=False``) the same body runs on the same static memory."""
        runner = self.graphs
        bank = self._bank = _StepBank.of(runner, st, logits)
        bank.bind(st, logits)
        self._false = bank.no_rows  # the trace's all-False record, read by the graph: the bank's, not this call's
        before = _layout(st.state)  # the sampler's scratch state, bound to the bank
        # per-row windows: keyed by their width alone, each row's columns computed in the graph from its region
        per_row = cols.dim() == 2
        where = ("rows", cols.shape[1]) if per_row else (w_lo, w_hi, win_hi)
        key = ("step", bank.serial, *where, st.P, self._commit_graph, repr(before) if before else None)
        T, device = st.x.shape[1], st.x.device
        self.cols_all = cached_arange(T, device)  # the shared columns (made anew only where the cache dropped them)
        W = cols.shape[-1]
        cols = None if per_row else self.cols_all[w_lo:w_hi]

        def body():
            # the scratch state as the key saw it: a capture runs this body again after its warm-up, and a step that
            # makes a table must be captured making it
            bank.restore(st, before)
            cached_arange(T, device)  # in a capture: kept for as long as the graph may replay its reads of them
            done = bank.nfe + 1
            c = self._row_cols(st, W) if cols is None else cols  # the bank's regions
            bad, record, head, pace = self._commit(st, bank.logits, w_lo, w_hi, win_hi, c, done)
            layout, packed = _pack(record)  # before the state is written back: the record reads lo and hi
            bank.write_back(st, done)
            return bad, torch.cat(head), torch.cat(pace) if pace else None, packed, layout, _layout(st.state)

        with on_device(bank.logits):  # a capture records the model's device
            bad, head, pace, packed, layout, after = runner.tail(key, body, keep=bank)
        bank.restore(st, after)  # a replay runs no Python: the scratch state's layout after the step, as captured
        bank.stepped(st)
        record = _unpack(layout, [t.clone() for t in packed])
        return bad, record, [head], [pace] if pace is not None else []

    def _speculate(self, st: DecodeState, logits_idx, query_idx, n_query, first=None) -> torch.Tensor:
        """The logits of a speculative cache's partial forward (Elastic-Cache on the graph path): run without host
        synchronisation up to where the cache expects its drift test to fail (``speculate_until``; else every layer),
        its tests read (one synchronisation), then resumed where a row's tests did not fail (and read again), and
        redone from the layer after the first failure where one did. Each part is a graph of its own. ``first``:
        ``(logits, stop)`` of a first part already run (made ready and launched ahead: :meth:`_prepare_next`).

        Records in :attr:`_relaunch` the first part's graph when running it again would write what this step wrote
        (no later part rewrote a layer below its stop): :meth:`_prepare_next` may then launch the next step's
        first part before the synchronisation under a guard, which may replay this step's."""
        runner, cache = self.graphs, self.cache
        args = (st.x, st.positions, st.key_mask, logits_idx, cache, query_idx)
        if first is None:
            stop = cache.speculate_until()
            logits = runner(*args, n_query, stop=stop)
        else:
            logits, stop = first
        part = runner.last[1] if runner.last is not None else None
        start = cache.redo_plan(stop)
        if start is None and stop is not None:  # a row's tests did not fail up to the stop: the rest of the forward
            logits = runner.segment(*args, start=stop)
            start = cache.redo_plan()
        if start is not None:
            logits = runner.segment(*args, start=start)
        self._relaunch = part if start is None or start >= (stop if stop is not None else self.n_layers) else None
        return logits

    def _prepare_next(self, st: DecodeState, nxt, w_lo: int, w_hi: int, W: int | None,
                      host: torch.Tensor | None = None) -> _Ahead | None:
        """The next step's partial forward planned with this step's shapes and window (``nxt``: :meth:`_plan_next`'s
        mask and rows; ``W``: each row's logits columns with per-row windows, at the rows' regions after this step's
        commits, None: the window's) and its graph's inputs filled (:meth:`GraphRunner.prepare`), or None where no
        captured graph has that key. Planning is the cache's :meth:`~dllm.caches.base.KVCache.plan` with this step's
        numbers in place of those the synchronisation will read: where they differ, the next step plans again, and
        this plan (a function of the decode state alone, ``KVCache.pipelined``) is replaced.

        With ``host`` (the step's numbers, still on the device) the forward is to be launched before the
        synchronisation (:meth:`_sync`), so the graph's inputs are filled under a guard computed on the device
        (:meth:`_guard`): where the numbers say this plan is not a valid forward of the next step (a region ended, an
        active set grew past the width), the inputs keep this step's, and the launch computes this step's forward
        again, writing what it wrote. A forward that is launched is thus always the next step's or this step's, and
        every row it writes is written again, with the same values or before it is read."""
        cache, B = self.cache, st.x.shape[0]
        Q, N = cache._rows.shape[1], cache.query_tokens  # this step's, as the plan rounded them
        extra = tuple(cache.plan_numbers)  # this step's numbers of the policy's own (Elastic-Cache's window)
        mask, _, rows = nxt
        query_idx, _ = cache.plan(self._cache_state(st, (w_lo, w_hi)),
                                  hint=(mask, True, Q, B * Q if N is None else N, rows, list(extra)))
        stop = cache.speculate_until() if cache.speculative else None
        relaunch = self._relaunch if cache.speculative else None
        if host is not None and cache.speculative and (relaunch is None or relaunch.stop != stop or self.rows_move):
            # a speculative cache's first part is launched ahead only where, the guard failing, it replays this
            # step's and writes what this step wrote (another stop: another graph, whose inputs are an older step's),
            # and where no row can join or leave before the next step: a first part launched for rows that then
            # move runs again after, its drift tests finding their old keys and queries overwritten by the first run
            host = None
        # a speculative cache's forward is launched only for the plan itself, not one at a larger width: a first part
        # that the next step plans again and runs once more would find its drift tests' old keys and queries
        # overwritten by the first run
        guard = None if host is None else self._guard(host, w_lo, w_hi, Q, N, extra,
                                                      exact=st.x.shape if cache.speculative else None)
        # the logits columns of this step's window, or this step's width at the rows' regions as they now stand
        lidx = self._row_cols(st, W) if W is not None else self.cols_all[w_lo:w_hi].expand(B, -1)
        args = (st.x, st.positions, st.key_mask, lidx, cache, query_idx, cache.query_tokens)
        ready = self.graphs.prepare(*args, guard=guard, stop=stop)
        if ready is None:
            return None
        if guard is not None and cache.speculative and ready.g is not relaunch:  # not this step's graph after all
            ready, guard = self.graphs.prepare(*args, stop=stop), None  # filled again, launched after
        return _Ahead(ready, _versions(st), (w_lo, w_hi), Q, N, query_idx, guarded=guard is not None, stop=stop,
                      extra=extra, width=w_hi - w_lo if W is None else W)

    def _guard(self, host: torch.Tensor, w_lo: int, w_hi: int, Q: int, N: int | None, extra: tuple = (),
               exact: tuple[int, int] | None = None) -> torch.Tensor:
        """0-d bool on the device: the step's numbers (``host``: rows left, non-finite logits, the next window's ends,
        the next plan's three counts, ...) make the plan :meth:`_prepare_next` made with this step's window, width
        ``Q`` and packed rows ``N`` a valid forward of the next step: rows left, finite logits, the same window, a
        partial forward whose largest active set fits ``Q`` (no row's active rows cut) and whose active rows fit
        ``N``, and the policy's own numbers (``extra``, after those seven: Elastic-Cache's window) those it was
        planned with. Every row it computes is then a row the next step computes (or a full forward rewrites).
        ``exact`` (the canvas's ``(B, T)``): the largest active set and active rows must also round to ``Q`` and ``N``
        (the plan the synchronisation confirms, :meth:`_confirmed`), not merely fit. Three kernels; the bounds are
        made once per window and shape."""
        key = (w_lo, w_hi, Q, N, extra, exact, host.device)
        if self._bounds is None or self._bounds[0] != key:
            big = torch.iinfo(torch.int64).max
            q_lo = n_lo = 0
            if exact is not None:  # the smallest numbers the cache rounds to Q and N (rounding only goes up)
                shape = self.cache.forward_shape
                q_lo = _least(Q, lambda q: shape(q, N or 1, *exact)[0] >= Q)
                n_lo = 0 if N is None else _least(N, lambda n: shape(Q, n, *exact)[1] >= N)
            # from pinned memory without blocking: a plain copy to the device would wait for the device's work
            lims = torch.tensor([[1, 0, w_lo, w_hi, 1, q_lo, n_lo, *extra],
                                 [1, 0, w_lo, w_hi, 1, Q, big if N is None else N, *extra]], pin_memory=host.is_cuda)
            self._bounds = (key, lims.to(host.device, non_blocking=True))
        lims = self._bounds[1]
        v = host[:lims.shape[1]]
        return (v.clamp(lims[0], lims[1]) == v).all()

    def _refresh_next(self, st: DecodeState) -> bool:
        """Whether the cache recomputes an active row in full at the next forward, so that no forward is made ready
        for it (the next step plans again): :meth:`KVCache.refreshes_at` at each row's next step in its region (the
        last synchronisation read each row's step for this step's forward: :attr:`DecodeState.pace`) and the forwards
        done, which a row that took part in every forward shares (the rows of a served batch that joined later may
        refresh at other steps; a forward launched for them is discarded or, under the guard, still valid)."""
        return st.pace is not None and any(self.cache.refreshes_at(s + 1, st.nfe) for s in set(st.pace[2]) if s >= 0)

    def _launch_early(self, st: DecodeState) -> bool:
        """Whether the next forward, made ready, is launched before this step's synchronisation: where the last
        synchronisation's numbers (:attr:`DecodeState.pace`) say that every active row's region keeps masks after
        this step if it commits what the last step committed, and not in a window within which a plan made ahead
        missed (a width that grew, or fell past :attr:`wide_ahead`: at most one such miss per window). Where the
        next step plans again (a region ended: a refresh or another width) a forward launched for it is discarded, a
        forward's time spent for nothing (a refresh the policy schedules is not even made ready:
        :meth:`_refresh_next`)."""
        return self._early and st.window != self._early_off and st.pace is not None and st.pace[0] > st.pace[1]

    def _sync(self, host: torch.Tensor, ahead: _Ahead | None) -> list:
        """The step's host synchronisation: ``host``'s numbers, read on the host. With ``ahead`` (a next forward made
        ready under a guard, :meth:`_prepare_next`), that forward is launched first: on CUDA the numbers are copied
        to pinned host memory, the graph is replayed, and the host waits for the copy alone, so the device goes on
        from this step's last kernel to the next forward without waiting for the host. Its logits are kept in
        ``ahead``; where the numbers do not confirm its plan they are dropped (the next step plans again). On the CPU
        the forward runs there and then."""
        if ahead is None:
            return host.tolist()
        pinned = None
        if host.is_cuda:
            pinned = self._pinned.get(host.shape[0])
            if pinned is None:
                if len(self._pinned) >= 16:  # lengths vary with the caller's reads (a served batch's rows)
                    self._pinned.clear()
                pinned = self._pinned[host.shape[0]] = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
            if self._host_ready is None:
                self._host_ready = torch.cuda.Event()
            pinned.copy_(host, non_blocking=True)
            self._host_ready.record(torch.cuda.current_stream(host.device))  # the stream the numbers are on
        tm = self.clock.mark()
        ahead.launched = self.graphs.holds(ahead.ready)
        ahead.logits = self.graphs.replay(ahead.ready, count=False) if ahead.launched else None  # counted where used
        self.clock.add("model", tm, self.clock.mark())
        if pinned is None:
            out = host.tolist()
        else:
            self._host_ready.synchronize()
            out = pinned.tolist()
        if ahead.launched:
            self.graphs.ahead["launched"] += 1
        return out

    def _confirmed(self, ahead: _Ahead, synced: list, shape) -> str | None:
        """Whether the numbers of the step's synchronisation make the plan :meth:`_prepare_next` made the next
        step's forward: ``"exact"`` where they give that plan (a partial forward, the same window, the same active
        width and packed rows once rounded as the cache rounds them), ``"wider"`` where a forward launched under the
        guard computes the next step's rows at a larger width than they round to, kept where it is small
        (:attr:`wide_ahead`; a speculative cache's is planned exactly), else None."""
        partial, Q, N = synced[4:7]
        if not partial or tuple(synced[2:4]) != ahead.window or tuple(synced[7:7 + len(ahead.extra)]) != ahead.extra:
            return None
        if self.cache.forward_shape(Q, N, *shape) == (ahead.Q, ahead.N):
            return "exact"
        rows = shape[0] * ahead.Q if ahead.N is None else ahead.N
        fits = Q <= ahead.Q and (ahead.N is None or N <= ahead.N)  # the guard's test, which these numbers passed
        wider = ahead.launched and ahead.guarded and not self.cache.speculative and fits and rows <= self.wide_ahead
        return "wider" if wider else None

    def _cache_state(self, st: DecodeState, cols: tuple[int, int]) -> CacheState:
        """What the cache is told before a forward on ``st`` (``cols``: the window's canvas columns)."""
        lo, hi = st.lo, st.hi
        r_lo, r_hi = self.own_windows(lo, hi, st.active, st.P, st.x.shape[1])
        return CacheState(st.x, lo, hi, st.active, st.step_in, cols, st.P, self.model.mask_id, self.shift,
                          st.committed, st.nfe, st.key_mask, st.row_nfe, r_lo, r_hi)

    def own_windows(self, lo: torch.Tensor, hi: torch.Tensor, active: torch.Tensor | None, P: int, T: int):
        """``(lo, hi)`` ``[B]``: the canvas columns each row's own step reads, its region (``lo``, ``hi``) or the
        sampler's wider window (``window_columns``: Prophet's; none for a row not ``active``, default: a row whose
        region is not empty); a step computes every row's logits at its own window, as wide as the widest
        (:attr:`row_windows`), or over the union of the rows' windows (:attr:`logits_columns`)."""
        if self.widen is None:
            return lo, hi
        r_lo, r_hi = self.widen(lo, hi, P, T)
        if not torch.is_tensor(r_hi):  # a column for every row (Prophet's: the canvas end), on the canvas's device
            r_hi = torch.full_like(lo, r_hi)
        # a finished row reads nothing (no cache computes its rows; Prophet's fixed span would otherwise keep its
        # columns in a finished row's window)
        return torch.where(hi > lo if active is None else active, r_lo, r_hi), r_hi.expand(lo.shape[0])

    def own_columns(self, lo: torch.Tensor, hi: torch.Tensor, P: int, T: int) -> torch.Tensor:
        """0-d: the logits columns in each row's own window (:meth:`own_windows`) for the regions ``lo`` / ``hi`` (a
        step's ``[B]``, or any number of steps' flattened), summed; a row whose region is empty (finished) has none."""
        r_lo, r_hi = self.own_windows(lo, hi, None, P, T)
        return (r_hi - r_lo).clamp_min(0).sum()

    def _plan_next(self, st: DecodeState):
        """The cache's plan for the next step computed now (``KVCache.plan_mask``: no host sync), so that its
        numbers (partial, largest active set, active rows, the policy's own) travel in this step's one host
        synchronisation; None for caches without it (or not yet filled).
        The columns are a placeholder: the cache reads each row's own window (``read_lo`` / ``read_hi``)."""
        cache = self.cache
        if not isinstance(cache, KVCache) or not cache.filled or type(cache).plan is not KVCache.plan:
            return None
        cstate = self._cache_state(st, (0, st.x.shape[1]))
        mask, counts = cache.plan_mask(cstate)
        # the rows at full width too (sliced to the largest active set after the sync): the work between the sync
        # and the next forward's launch, while the device waits, is host work only
        return mask, counts, cache.plan_rows(cstate, mask)

    def _advance(self, st: DecodeState, x, lo, hi, committed, forwards):
        """Region bookkeeping after a step's commits, vectorised over rows: finished regions, EOS early stop,
        the next region of each row (``forwards``: the forwards done with this step, :meth:`_commit`). Updates ``st`` and
        returns the canvas, region ends, last commits and each row's masks left in its region (pipelined path)."""
        model, config, cols_all, P, T = self.model, self.config, self.cols_all, st.P, x.shape[1]
        masked = x == model.mask_id
        # a sliding window's row is done only when no mask is left anywhere after its start
        region_end = hi if self.slide is None else torch.full_like(hi, T)
        region_left = (masked & (cols_all[None] >= lo[:, None]) & (cols_all[None] < region_end[:, None])).sum(-1)
        done = st.active & (region_left == 0)
        if config.eos_early_stop:
            gen_part = (cols_all[None] >= P) & (cols_all[None] < region_end[:, None])
            is_stop = torch.isin(x, self.stop_ids) & gen_part
            first = torch.where(is_stop, cols_all[None], T).min(-1).values
            if self.slide is None:  # a finished region holding EOS (dInfer, LocalLeap: EOS only, not EOT)
                stopped = done & ((x == model.eos_id) & gen_part).any(-1)
            else:  # a stop token with every position before it decoded
                first_mask = torch.where(masked & (cols_all[None] >= P), cols_all[None], T).min(-1).values
                stopped = st.active & (first < first_mask)
                done = done | stopped
            # dInfer's early stop: the finished region keeps its tokens, everything after it becomes EOS (a sliding
            # window has no region end: everything after the stop token)
            fill_from = first if self.slide is not None else hi - 1
            fill = stopped[:, None] & (cols_all[None] > fill_from[:, None])
            x = torch.where(fill, torch.full_like(x, model.eos_id), x)
            _put(st.commit_step, fill & (st.commit_step < 0), forwards)
            committed = committed | fill
            hi = torch.where(stopped, torch.full_like(hi, T), hi)
        new_lo = torch.where(done, hi if self.slide is None else torch.full_like(hi, T), lo)
        finished_now = done & (new_lo >= T)
        st.finish = _put(st.finish, finished_now, forwards, inplace=False)
        unfinished = ~finished_now
        st.active = st.active & unfinished
        advance = done & unfinished
        nhi, nsteps = self._next_region(new_lo, T, st.P, st.positions)
        st.lo = new_lo
        hi = torch.where(advance, nhi, hi)
        st.hi = hi
        st.steps = torch.where(advance, nsteps, st.steps)
        st.step_in = st.step_in.masked_fill(advance, 0)
        new_masks = (masked & (cols_all[None] >= new_lo[:, None]) & (cols_all[None] < hi[:, None])).sum(-1)
        st.n_start = torch.where(advance, new_masks, st.n_start)
        # masks left in each row's region after this step (a new region's: all of them), for the pipelined path's pace
        left = torch.where(advance, new_masks, region_left) if self._pipelined else None
        return x, hi, committed, left

    def output(self, st: DecodeState) -> GenerateOutput:
        if self._bank is not None:  # the result's tensors are the state's own, not the step graphs' bank
            self._bank.release(st)
        trace = _trace_lists(st.trace)
        # the steps' regions, read with the trace, as one flat list of rows
        regions = [torch.tensor([c for r in trace for c in r[k]], dtype=torch.long) for k in ("lo", "hi")]
        own = int(self.own_columns(*regions, st.P, st.x.shape[1]))
        P = st.P
        return self._result(st.rows, st.x[:, P:], st.row_nfe.tolist(), st.finish, st.commit_step[:, P:],
                            *(None if t is None else t[:, P:]
                              for t in (st.commit_logprob, st.commit_top_ids, st.commit_top_logprobs)),
                            nfe=st.nfe, trace=trace, own=own)

    def _result(self, rows: list[list[int]], seqs: torch.Tensor, row_nfe: list[int], finish: torch.Tensor,
                commit_step: torch.Tensor, commit_logprob, commit_top_ids, commit_top_logprobs, *, nfe: int,
                trace: list[dict], own: int) -> GenerateOutput:
        """The output of a decode of ``rows``: each row's generated tokens ``seqs`` (``[B, gen_length]``), forwards,
        finishing step and commit records (over the generation's columns), the loop's forwards, trace and logits
        columns in the rows' own windows."""
        t = self.clock.totals()
        time_total = time.perf_counter() - self.t_start
        B, G = len(rows), self.config.gen_length
        stats = GenerateStats(
            nfe=nfe,
            row_nfe=row_nfe,
            tokens_per_forward=sum(G / max(n, 1) for n in row_nfe) / B,
            finish_step=finish.tolist(),
            time_model=t["model"],
            time_sampler=t["sampler"],
            time_cache=t["cache"],
            time_total=time_total,
            trace=trace,
            logits_columns=self.logits_columns,
            own_logits_columns=own,
            row_forwards=self.row_forwards,
            commit_step=commit_step.tolist(),
            commit_conf=commit_logprob.exp().tolist() if commit_logprob is not None else [],
            commit_logprob=commit_logprob.tolist() if commit_logprob is not None else [],
            commit_top_ids=commit_top_ids.tolist() if commit_top_ids is not None else [],
            commit_top_logprobs=commit_top_logprobs.tolist() if commit_top_logprobs is not None else [],
            graphs=_since(self.graphs.stats, self._graph_stats0) if self.graphs is not None else {},
            step_graphs=_since(self.graphs.tail_stats, self._tail_stats0) if self.graphs is not None else {},
            sampler=_name_of(self.sampler),
            cache=_name_of(self.cache),
            cache_bytes=int(getattr(self.cache, "nbytes", 0) or 0),
            block_length=_fixed_block_length(self.policy, self.config),
        )
        return GenerateOutput(seqs, decode_texts(self.model, seqs), [len(r) for r in rows], stats)


_BANKED = ("x", "positions", "lo", "hi", "steps", "step_in", "n_start", "active", "finish", "row_nfe", "committed",
           "commit_step", "commit_logprob", "commit_top_ids", "commit_top_logprobs", "row_key")
_bank_serial = iter(range(1 << 62))


def _scratch(state, path: tuple = ()):
    """The sampler's scratch state (:attr:`DecodeState.state`: dicts, dict subclasses and lists, nested) as
    ``(path, container, key, value)`` per leaf, in order."""
    for k, v in (state.items() if isinstance(state, dict) else enumerate(state)):
        if isinstance(v, (dict, list)):
            yield from _scratch(v, (*path, k))
        else:
            yield (*path, k), state, k, v


class _Slot(NamedTuple):
    """A tensor of the scratch state in a layout (:func:`_layout`): the key of its copy in a :class:`_StepBank`."""

    key: tuple  # (path, shape, dtype): _slot_key


def _slot_key(path: tuple, t: torch.Tensor) -> tuple:
    """The key of the bank's copy of the scratch state's tensor ``t`` at ``path``."""
    return path, tuple(t.shape), t.dtype


def _mapped(v, leaf, path: tuple = ()):
    """The scratch state ``v`` (or a layout of it) with ``leaf(path, value)`` in place of each leaf, in containers of
    the same types (dicts, dict subclasses, lists)."""
    if isinstance(v, dict):
        out = type(v).__new__(type(v))
        dict.update(out, ((k, _mapped(x, leaf, (*path, k))) for k, x in v.items()))
        return out
    if isinstance(v, list):
        return [_mapped(x, leaf, (*path, i)) for i, x in enumerate(v)]
    return leaf(path, v)


def _layout(state: dict) -> dict:
    """The scratch state with each tensor replaced by its :class:`_Slot` (other values as they are): what a step
    graph's key holds of it (its ``repr``) and what :meth:`_StepBank.restore` rebuilds it from."""
    return _mapped(state, lambda p, v: _Slot(_slot_key(p, v)) if isinstance(v, torch.Tensor) else v)


class _StepBank:
    """Static copies of a decode state's tensors (:data:`_BANKED`), of the tensors of its sampler's scratch state
    (``slots``: one per path, shape and dtype; CreditDecoding's tables, KLASS's kept steps), its logits and its
    forwards' count: the memory the step graphs (:meth:`Decoder._commit_graphed`) read and write. One per shape, kept
    by the model's :class:`GraphRunner` (``banks``), so that a graph captured in one call replays in the next. A
    state is bound to it (its tensors are the bank's) while its steps run on it; another state of the same shape
    taking it over gives the last one copies of them."""

    def __init__(self, st: DecodeState, logits: torch.Tensor):
        self.t = {f: torch.empty_like(getattr(st, f)) for f in _BANKED if getattr(st, f) is not None}
        self.slots: dict[tuple, torch.Tensor] = {}
        self.logits = torch.empty_like(logits)
        self.nfe = torch.zeros((), dtype=torch.long, device=logits.device)
        self.no_rows = torch.zeros_like(st.active)
        self.serial = next(_bank_serial)
        self.owner = None  # weakref to the bound state
        self.nfe_host = None  # the state's forwards the device's count holds (None: not known)

    @classmethod
    def of(cls, runner: GraphRunner, st: DecodeState, logits: torch.Tensor) -> _StepBank:
        key = (tuple((f, tuple(t.shape), t.dtype) for f in _BANKED if (t := getattr(st, f)) is not None),
               tuple(logits.shape), logits.dtype, logits.device)
        bank = runner.banks.get(key)
        if bank is None:
            bank = runner.banks[key] = cls(st, logits)
            while len(runner.banks) > runner.max_banks:
                runner.drop_tails(runner.banks.popitem(last=False)[1])
        else:
            runner.banks.move_to_end(key)
        return bank

    def bind(self, st: DecodeState, logits: torch.Tensor) -> None:
        """Make ``st``'s tensors the bank's (copying those that are not) and copy ``logits`` in."""
        owner = self.owner() if self.owner is not None else None
        if owner is not None and owner is not st:  # the last state keeps its values, in tensors of its own
            self.release(owner)
        self.owner = weakref.ref(st)
        self.write_back(st)
        self.logits.copy_(logits)
        if self.nfe_host != st.nfe:
            self.nfe.fill_(st.nfe)

    def release(self, st: DecodeState) -> None:
        """Give ``st`` copies of the bank's tensors it holds (its output is read from them; the bank's are the next
        decode's)."""
        for f, b in self.t.items():
            if getattr(st, f) is b:
                setattr(st, f, b.clone())
        for p, d, k, v in list(_scratch(st.state)):
            if isinstance(v, torch.Tensor) and self.slots.get(_slot_key(p, v)) is v:
                d[k] = v.clone()
        if self.owner is not None and self.owner() is st:
            self.owner, self.nfe_host = None, None

    def write_back(self, st: DecodeState, done: torch.Tensor | None = None) -> None:
        """Copy into the bank each of ``st``'s tensors that is not the bank's (the step's new ones), and make it the
        bank's; ``done``: the forwards' count after the step."""
        if done is not None:
            self.nfe.copy_(done)
        for f, b in self.t.items():
            live = getattr(st, f)
            if live is not b:
                b.copy_(live)
                setattr(st, f, b)
        for p, d, k, v in list(_scratch(st.state)):
            if not isinstance(v, torch.Tensor):
                continue
            key = _slot_key(p, v)
            b = self.slots.get(key)
            if b is None:  # a path (or shape) first seen: its copy, kept from now on
                b = self.slots[key] = v.clone()
            elif v is not b:
                b.copy_(v)
            d[k] = b

    def restore(self, st: DecodeState, layout: dict) -> None:
        """Make ``st``'s scratch state the one ``layout`` describes (:func:`_layout` of a state bound to the bank), in
        place: its tensors the bank's slots. A replayed step graph advanced the slots without the Python that made or
        replaced the state's entries; a capture runs its body a second time after the warm-up, which must start
        where the warm-up did."""
        if not layout and not st.state:
            return
        st.state.clear()
        st.state.update(_mapped(layout, lambda p, v: self.slots[v.key] if isinstance(v, _Slot) else v))

    def stepped(self, st: DecodeState) -> None:
        """After a step on the bank (``st.nfe`` not yet counted up): a replay wrote its tensors in place without
        their version counters knowing (the graph path's inputs are copied again where a tensor's version moved)."""
        self.nfe_host = st.nfe + 1
        for b in (*self.t.values(), *self.slots.values()):
            torch.autograd.graph.increment_version(b)


def _since(counts, before: dict) -> dict[str, int]:
    """The counts added since ``before`` (a runner's counters are the model's, across calls)."""
    return {k: v - before.get(k, 0) for k, v in counts.items() if v != before.get(k, 0)}


def _put(t: torch.Tensor, mask: torch.Tensor, value, inplace: bool = True) -> torch.Tensor:
    """``t`` with ``value`` where ``mask`` (in place, or a new tensor), in one kernel: ``value`` an int, or on the step
    graphs' path a 0-d tensor on the device (read there: ``masked_fill`` may read a tensor value on the host)."""
    if isinstance(value, torch.Tensor):
        return torch.where(mask, value, t, out=t) if inplace else torch.where(mask, value, t)
    return t.masked_fill_(mask, value) if inplace else t.masked_fill(mask, value)


def _window_where(t: torch.Tensor, cols: torch.Tensor, w_lo: int, w_hi: int, keep: torch.Tensor, new: torch.Tensor
                  ) -> None:
    """``t`` (``[B, T, ...]``) set to ``new`` at a step's window columns where ``keep``: the batch's ``w_lo:w_hi``
    (``cols`` 1-d), or each row's own (``cols`` ``[B, W]``, by gather and scatter)."""
    if cols.dim() == 1:
        t[:, w_lo:w_hi] = torch.where(keep, new, t[:, w_lo:w_hi])
        return
    idx = cols.view(*cols.shape, *(1,) * (t.dim() - 2)).expand(-1, -1, *t.shape[2:])
    t.scatter_(1, idx, torch.where(keep, new, t.gather(1, idx)))


def _pack(record: dict) -> tuple[tuple, list[torch.Tensor]]:
    """A trace record's tensors flattened into one per dtype, and the layout :func:`_unpack` rebuilds it from."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    layout = []
    for k, v in record.items():
        if isinstance(v, torch.Tensor):
            ts = groups.setdefault(v.dtype, [])
            layout.append((k, list(groups).index(v.dtype), sum(t.numel() for t in ts), tuple(v.shape)))
            ts.append(v)
        else:
            layout.append((k, None, v, None))
    return tuple(layout), [torch.cat([t.reshape(-1) for t in ts]) for ts in groups.values()]


def _unpack(layout: tuple, flat: list[torch.Tensor]) -> dict:
    return {k: v if g is None else flat[g][v:v + math.prod(shape)].view(shape) for k, g, v, shape in layout}


def _trace_lists(trace: list[dict]) -> list[dict]:
    """The trace's records with each tensor as ``tensor.tolist()`` gives it, read from the device in one copy per
    dtype and device, each a host synchronisation (the records hold a few tensors per step: read one by one, a few
    synchronisations per step at the end of every generation): the tensors of a dtype are flattened into one (a
    tensor held by several records, once), read, and cut back into nested lists of their shapes on the host."""
    tensors: dict[int, torch.Tensor] = {}
    for rec in trace:
        for v in rec.values():
            if isinstance(v, torch.Tensor):
                tensors.setdefault(id(v), v)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors.values():
        groups.setdefault((t.dtype, t.device), []).append(t)
    lists: dict[int, Any] = {}
    for ts in groups.values():
        flat = torch.cat([t.reshape(-1) for t in ts]).tolist()
        at = 0
        for t in ts:
            lists[id(t)] = _nested(flat, at, tuple(t.shape))
            at += t.numel()
    return [{k: (lists[id(v)] if isinstance(v, torch.Tensor) else v) for k, v in rec.items()} for rec in trace]


def _nested(flat: list, at: int, shape: tuple[int, ...]):
    """The elements of ``flat`` from ``at`` as a tensor of ``shape`` lists them (a 0-d one: its element)."""
    if not shape:
        return flat[at]
    if len(shape) == 1:
        return flat[at:at + shape[0]]
    inner = math.prod(shape[1:])
    return [_nested(flat, at + i * inner, shape[1:]) for i in range(shape[0])]


# ---- rows that join and leave a batch between steps (the serving engine; generate's max_rows) ----


def _pad_left(t: torch.Tensor | None, d: int, value) -> torch.Tensor | None:
    """``[B, T, ...]`` -> ``[B, T + d, ...]`` with ``d`` columns of ``value`` on the left (``d < 0``: crop ``-d``
    columns)."""
    return t if t is None or d == 0 else moved_rows(t, None, d=d, dim=1, pad=value)


def _repad(st: DecodeState, d: int, pad_id: int) -> DecodeState:
    """The state with ``d`` more (or ``-d`` fewer) left-padding columns; column positions shift by ``d``."""
    if d == 0:
        return st
    key_mask = st.key_mask if st.key_mask is not None else torch.ones_like(st.x, dtype=torch.bool)
    st.x = _pad_left(st.x, d, pad_id)
    st.positions = _pad_left(st.positions, d, 0)
    st.key_mask = _pad_left(key_mask, d, False)
    st.committed = _pad_left(st.committed, d, False)
    st.commit_step = _pad_left(st.commit_step, d, -1)
    st.commit_logprob = _pad_left(st.commit_logprob, d, float("nan"))
    st.commit_top_ids = _pad_left(st.commit_top_ids, d, -1)
    st.commit_top_logprobs = _pad_left(st.commit_top_logprobs, d, float("nan"))
    st.P += d
    st.lo, st.hi = st.lo + d, st.hi + d
    st.read = None
    return st


def _reads(st: DecodeState, dec: Decoder | None = None, tokens: bool = True) -> torch.Tensor:
    """What the engine reads of a batch after each step, in the step's own host synchronisation (``Decoder.reads``):
    each row's generated tokens (``tokens=False``: none), whether it is finished, its forwards (:func:`_read_back`);
    with ``dec``, the step's decoder, also how many of the logits columns the step computed lie in each row's own
    window (summed over rows: the rest is the other rows' windows, ``metrics["logits_columns"]``)."""
    nums = [st.x[:, st.P:].reshape(-1)] if tokens else []
    nums += [~st.active, st.row_nfe]
    if dec is not None and st.trace:
        rec = st.trace[-1]  # the step's record: its regions
        nums.append(dec.own_columns(rec["lo"], rec["hi"], st.P, st.x.shape[1]).view(1))
    return torch.cat(nums)


def _read_back(st: DecodeState, tokens: bool = True) -> tuple[list[list[int]], list, list, int | None]:
    """:func:`_reads`' numbers as ``(rows' generated tokens, finished, forwards, own logits columns)``: those read in
    the state's last step, or read now where the rows moved since (one more synchronisation, kept until the rows move
    or step again; without the step's own columns, None). ``tokens``: as the reads were made (False: no tokens, the
    rows' lists empty)."""
    if st.read is None:
        st.read = _reads(st, tokens=tokens).tolist()
    r = st.read
    B = st.x.shape[0]
    G = st.x.shape[1] - st.P if tokens else 0
    n = B * G + 2 * B
    return [r[i * G:(i + 1) * G] for i in range(B)], r[B * G:B * G + B], r[B * G + B:n], \
        (r[n] if len(r) > n else None)


_PER_ROW = ("x", "positions", "key_mask", "lo", "hi", "steps", "step_in", "n_start", "active", "finish",
            "row_nfe", "committed", "commit_step", "commit_logprob", "commit_top_ids", "commit_top_logprobs", "row_key")


def _cat(a: DecodeState, b: DecodeState) -> DecodeState:
    """Rows of ``b`` appended to ``a`` (same width: re-padded first)."""
    merged = {}
    for name in _PER_ROW:
        ta, tb = getattr(a, name), getattr(b, name)
        if ta is None and tb is None:
            continue
        if name == "key_mask":  # no mask: every column real
            ta = ta if ta is not None else torch.ones_like(a.x, dtype=torch.bool)
            tb = tb if tb is not None else torch.ones_like(b.x, dtype=torch.bool)
        merged[name] = torch.cat([ta, tb])
    for name, t in merged.items():
        setattr(a, name, t)
    a.rows = a.rows + b.rows
    a.read = None
    for k, v in b.state.items():  # deterministic tables (Dream's schedule) are the same for both
        a.state.setdefault(k, v)
    return a


def _select(st: DecodeState, keep: list[int]) -> DecodeState:
    idx = torch.tensor(keep, dtype=torch.long, device=st.x.device)
    for name in _PER_ROW:
        t = getattr(st, name)
        if t is not None:
            setattr(st, name, t.index_select(0, idx))
    st.rows = [st.rows[i] for i in keep]
    st.read = None
    return st


def _move_rows(dec: Decoder, st: DecodeState, d: int, keep: list[int] | None,
               joining: DecodeState | None = None) -> None:
    """Move what the decoder keeps per row beside the decode state ``st`` with the rows of its batch: the ``keep``
    rows selected (``None``: all), ``d`` canvas columns of left padding added (``d < 0``: cropped), then the rows
    of ``joining`` appended (their own state, re-padded to the batch's width). A filled cache moves its K/V
    buffers and its own per-row state (:meth:`dllm.caches.base.KVCache.move_rows`; the joining rows' first
    forward recomputes them in full), the sampler its scratch state in ``st.state``
    (:meth:`dllm.samplers.base.SamplerBase.move_rows`: a joining row starts with the state its first step would
    build)."""
    idx = None if keep is None else torch.tensor(keep, dtype=torch.long, device=st.x.device)
    n_new = 0 if joining is None else joining.x.shape[0]
    if getattr(dec.cache, "filled", False):
        dec.cache.move_rows(d, idx, n_new)
    move = getattr(dec.sampler, "move_rows", None)
    if move is not None and joining is None:
        move(st.state, d, idx, 0)
    elif move is not None:
        move(st.state, d, idx, n_new, canvas=joining.x, gen_lo=joining.P, eos_id=dec.model.eos_id)


def _joined(dec: Decoder, st: DecodeState, new: DecodeState, keep: list[int] | None = None) -> DecodeState:
    """``st``'s rows with the rows of ``new`` (a state of :meth:`Decoder.new_state`) appended: both re-padded to the
    longer prompt, the cache's buffers and the sampler's state moved in one move (``keep``: the rows of theirs kept,
    already selected from ``st`` by :func:`_select`; None: all), the decoder regrouped."""
    P = max(st.P, new.P)
    d = P - st.P
    st, new = _repad(st, d, dec.pad_id), _repad(new, P - new.P, dec.pad_id)
    _move_rows(dec, st, d, keep, new)
    st = _cat(st, new)
    dec.regroup(st)
    return st


def _without(dec: Decoder, st: DecodeState, keep: list[int]) -> DecodeState:
    """``st``'s ``keep`` rows alone (the others left the batch): selected, the padding no row needs cropped where the
    longest prompt left (to the bucketed width on the graph path), the cache's buffers and the sampler's state moved,
    the decoder regrouped."""
    st = _select(st, keep)
    d = min(dec.prompt_width(max(len(r) for r in st.rows)) - st.P, 0)
    st = _repad(st, d, dec.pad_id)
    _move_rows(dec, st, d, keep)
    dec.regroup(st)
    return st


def _least(hi: int, ok) -> int:
    """The least ``n`` in ``[1, hi]`` with ``ok(n)`` (``ok`` monotone, ``ok(hi)`` true): a binary search."""
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _fixed_block_length(policy, config) -> int:
    """:attr:`GenerateStats.block_length`: the fixed blocks' length, else 0."""
    if type(policy) is not FixedBlocks or policy.slide is not None:
        return 0
    return int(policy.size(config))


def _name_of(part) -> str:
    """A sampler's or cache's ``name``, else its class name (an object that implements only the protocol)."""
    name = getattr(part, "name", None)
    return name if isinstance(name, str) and name else type(getattr(part, "_obj", part)).__name__


def row_keys(rows: list[list[int]], row_ids, seed: int | None) -> torch.Tensor:
    """``[B, 2]`` key words of the rows' random streams (see ``generate(row_ids=...)``)."""
    if row_ids is None:
        seen: dict[tuple, int] = {}
        row_ids = []
        for r in rows:
            k = tuple(r)
            row_ids.append(f"p{seen.get(k, 0)}:{','.join(map(str, r))}")
            seen[k] = seen.get(k, 0) + 1
    else:
        ids = list(row_ids) if isinstance(row_ids, (Sequence, np.ndarray)) and not isinstance(row_ids, (str, bytes)) \
            else None
        if ids is None or any(isinstance(r, bool) or not isinstance(r, (numbers.Integral, str)) for r in ids):
            raise ValueError(f"row_ids must be a list of ints or strings, one per prompt, got {shown(row_ids)}")
        row_ids = ids
        if len(row_ids) != len(rows):
            raise ValueError(f"row_ids has {len(row_ids)} entries for {len(rows)} prompts; give one id per prompt")
        row_ids = [f"i:{r}" for r in row_ids]
    if seed is None:  # unseeded: a fresh key from torch's global generator
        seed = int(torch.randint(0, 2**62, ()).item())
    return row_key_words(seed, row_ids)


def cfg_forward(model, x: torch.Tensor, prompt_len: int, scale: float, dtype: torch.dtype | None = None, **kw):
    """Classifier-free guidance, LLaDA's rule: ``un + (scale + 1) * (cond - un)``, where the unconditional
    batch is ``x`` with its first ``prompt_len`` columns masked. ``x`` and every ``[B, ...]`` tensor keyword
    (positions, masks, indices) are stacked with their unconditional copy for one forward; ``dtype``: combine
    in that dtype (default: the logits')."""
    un = x.clone()
    un[:, :prompt_len] = model.mask_id
    both = {k: torch.cat([v, v]) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    logits = model(torch.cat([x, un]), **both)
    cond, unc = (logits if dtype is None else logits.to(dtype)).chunk(2)
    return unc + (scale + 1) * (cond - unc)


def _forward(model, x, positions, key_mask, logits_idx, config: GenerateConfig, cache, query_idx=None,
             query_tokens=None):
    kw = dict(positions=positions, attn_mask=key_mask, logits_idx=logits_idx, cache=cache)
    if query_idx is not None:
        kw["query_idx"] = query_idx
    if query_tokens is not None:
        kw["query_tokens"] = query_tokens * (2 if config.cfg_scale > 0 else 1)  # guidance stacks a second copy
    if config.cfg_scale > 0:
        return cfg_forward(model, x, x.shape[1] - config.gen_length, config.cfg_scale, **kw)
    return model(x, **kw)


def answer_lengths(model, seqs) -> list[int]:
    """Generated tokens of each row before its first EOS/EOT (the whole row when it has none): the answer."""
    stops = {i for i in (model.eos_id, model.eot_id) if i is not None}
    rows = seqs.tolist() if isinstance(seqs, torch.Tensor) else seqs
    return [next((i for i, t in enumerate(row) if t in stops), len(row)) for row in rows]


def decode_texts(model, seqs) -> list[str] | None:
    """Each row's answer (cut at its first EOS/EOT), decoded; ``None`` without a tokenizer. ``seqs``: a tensor or
    lists of token ids."""
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return None
    rows = seqs.tolist() if isinstance(seqs, torch.Tensor) else seqs
    return [tok.decode(row[:n], skip_special_tokens=True) for row, n in zip(rows, answer_lengths(model, rows))]
