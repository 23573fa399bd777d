"""AR-guided unmasking (Guided Diffusion / FlashDLM): a small causal LM verifies the dLLM's drafts.

At every step the dLLM drafts each still-masked position of the row's current region (argmax of this step's
logits). A causal LM with the same tokenizer (the *guide*, a ``transformers.AutoModelForCausalLM``) then
verifies the drafts left to right from the row's first masked position, ``chunk`` drafts per guide forward:

* ``mode="deterministic"``: a draft is accepted while it equals the guide's argmax; at the first mismatch the
  guide's argmax is written there and verification stops for this step. The committed text is therefore the
  guide's own greedy decoding, token for token, whatever the dLLM drafts.
* ``mode="topk"`` (top-k relative): a draft is accepted if it is among the guide's ``k`` most likely tokens and
  ``p_guide(draft) >= r * p_guide(top1)`` (defaults ``k = 2``, ``r = 0.5``); at the first rejection the guide's
  argmax is written.

When a whole chunk is accepted the next chunk of the same region is verified in the same step (one more guide
forward); the step ends at the first rejection or at the region's end. Every step commits at least one token
per row (the accepted drafts plus the correction), left to right.

The guide keeps its own KV cache (a ``transformers`` ``DynamicCache``) over the accepted prefix, so each
verification feeds only the tokens it has not seen: the tokens committed since its last forward and the
drafts to verify. Rows advance by different amounts, so the cache is a shared ``[B, heads, slots, d]`` tensor
with per-row slot validity: a row's rejected drafts (and the right padding of rows that feed fewer tokens)
become masked-out slots, the trailing slots no row needs are cropped (``cache.crop``), and every forward
passes the guide its own attention mask and per-row position ids (the dLLM canvas is left-padded; the guide
never sees the padding: position 0 is each prompt's first token). Masked-out slots contribute exact zeros
to the attention, so a row's result does not depend on the rest of the batch beyond floating-point
reduction order.

Stopping: once a row commits a stop token (the dLLM's EOS or end-of-turn id) every later position of its
generation is filled with EOS (an early commit, ``StepResult.finish``): the rest of its region at that step,
the rest of its generation at its next step (whatever other rows of a batch widen the window, so a row's
forwards are the same alone or in any batch), and the guide stops feeding it.

Requirements: the decode loop passes the full canvas (``StepContext.canvas``). Left padding is recognised as
the leading run of the pad id (``pad_id``, default the EOS id, which is what ``generate`` pads with for the
bundled, LLaDA and Dream models); a prompt that itself starts with that token loses those leading tokens in
the guide's view (the dLLM still sees them). The guide's tokenizer must equal the dLLM's
(:func:`check_tokenizers`, run by ``generate`` through :meth:`GuidedSampler.bind_model`).

Statistics, per step in ``GenerateStats.trace`` (``StepResult.info``): ``ar_forwards`` (guide forwards this
step), ``guide_verified`` / ``guide_accepted`` (drafts compared / accepted per row), ``guide_corrected``
(1 where the guide wrote its own token). :func:`guided_summary` aggregates them with the dLLM forwards.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dllm.models.hf import cache_argument, quiet_loading
from dllm.ops import ids_on, moved_rows
from dllm.samplers.base import (
    SamplerBase,
    StepContext,
    StepResult,
    check_choice,
    check_int,
    check_range,
    check_temperature,
    gumbel_argmax,
)

GUIDE_MODES = ("deterministic", "topk")
DEFAULT_GUIDE = "ar-tiny"


def bundled_guides() -> dict[str, Path]:
    from dllm.assets import ASSETS

    return {"ar-tiny": ASSETS / "ar-tiny"}


def guide_path(name_or_path) -> Path:
    """A bundled guide's directory by name (``ar-tiny``), or the given path."""
    return bundled_guides().get(str(name_or_path), Path(name_or_path))


def checked_guide_path(name_or_path) -> Path:
    """:func:`guide_path`, which must be a directory (else ``FileNotFoundError`` listing the bundled guides)."""
    path = guide_path(name_or_path)
    if not path.is_dir():
        known = ", ".join(sorted(bundled_guides()))
        raise FileNotFoundError(f"guide {str(name_or_path)!r} is neither a bundled guide ({known}) nor a checkpoint "
                                "directory (not a directory)")
    return path


def load_guide(name_or_path, *, dtype=None, device=None):
    """``(model, tokenizer)`` of a causal LM checkpoint directory (or bundled name) via ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dllm.models.loading import resolve_dtype

    path = checked_guide_path(name_or_path)
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype) or "auto")
    model.eval().requires_grad_(False)
    if device is not None:
        model = model.to(device)
    tok = AutoTokenizer.from_pretrained(str(path)) if (path / "tokenizer.json").is_file() or (
        path / "tokenizer_config.json").is_file() else None
    return model, tok


class SharedGuide(NamedTuple):
    """A loaded guide that samplers share (:class:`GuideCache`): the model, its tokenizer (or ``None``) and the
    ids of the dLLMs whose tokenizers were checked against it (:func:`check_tokenizers`, once per dLLM for every
    sampler sharing it)."""

    model: Any
    tokenizer: Any
    checked: set[int]


class GuideCache:
    """Loaded guides by checkpoint and dtype, for samplers that share them (the serving engine: requests naming
    the same guide load it once). :meth:`get` loads a guide at its first request; at most ``max_size`` guides
    are kept, the one loaded first dropped first (samplers already using it keep it). Safe to use from several
    threads (a guide loads once, under the cache's lock)."""

    def __init__(self, max_size: int = 2):
        if not isinstance(max_size, int) or isinstance(max_size, bool) or max_size < 1:
            raise ValueError(f"max_size={max_size!r} must be a positive integer (guides kept)")
        self.max_size = max_size
        self._guides: dict[tuple[str, str | None], SharedGuide] = {}
        self._lock = threading.Lock()

    def get(self, guide, dtype: str | None = None) -> SharedGuide:
        """The loaded guide ``guide`` (a bundled name or a checkpoint directory, :func:`load_guide`) in ``dtype``
        (``None``: the checkpoint's): the kept one, else loaded now (and the oldest dropped beyond
        ``max_size``). Raises what :func:`load_guide` raises (a missing directory: ``FileNotFoundError``)."""
        key = (str(guide), dtype)
        with self._lock:
            entry = self._guides.get(key)
            if entry is None:
                entry = self._guides[key] = SharedGuide(*load_guide(guide, dtype=dtype), set())
                while len(self._guides) > self.max_size:
                    self._guides.pop(next(iter(self._guides)))
            return entry


def vocab_fingerprint(tok) -> str:
    """Short SHA-256 of the tokenizer's token -> id map."""
    items = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


def _logit_width(model) -> int | None:
    for owner in (model, getattr(model, "hf", None)):
        size = getattr(getattr(owner, "config", None), "vocab_size", None)
        if isinstance(size, int):
            return size
    return None


def check_tokenizers(dllm_model, guide_model, guide_tok) -> None:
    """Raise ``ValueError`` unless the guide shares the dLLM's vocabulary (token -> id map, special ids).

    With both tokenizers present their full token -> id maps must be equal (compared by size, special ids
    and a hash). Without a dLLM tokenizer (a bare model) the guide's vocabulary must cover the dLLM's logit
    width and the guide's EOS / end-of-turn ids, where it has them, must match the dLLM's."""
    d_tok = getattr(dllm_model, "tokenizer", None)
    d_width, g_width = _logit_width(dllm_model), _logit_width(guide_model)
    problems = []
    if d_tok is not None and guide_tok is not None:
        dv, gv = d_tok.get_vocab(), guide_tok.get_vocab()
        if dv != gv:
            problems.append(f"vocabulary sizes {len(dv)} (dLLM) vs {len(gv)} (guide), hashes "
                            f"{vocab_fingerprint(d_tok)} vs {vocab_fingerprint(guide_tok)}")
            diff = [t for t in sorted(set(dv) | set(gv)) if dv.get(t) != gv.get(t)][:5]
            problems.append("differing tokens (token: dLLM id / guide id): "
                            + ", ".join(f"{t!r}: {dv.get(t)} / {gv.get(t)}" for t in diff))
    elif guide_tok is not None and d_width is not None and len(guide_tok) < d_width:
        problems.append(f"the guide's tokenizer has {len(guide_tok)} tokens, the dLLM predicts {d_width}")
    if d_width is not None and g_width is not None and g_width < min(d_width, len(d_tok) if d_tok is not None else d_width):
        problems.append(f"the guide predicts {g_width} token ids, fewer than the dLLM's vocabulary ({d_width})")
    if guide_tok is not None:
        for role, d_id in (("eos", getattr(dllm_model, "eos_id", None)), ("end-of-turn", getattr(dllm_model, "eot_id", None))):
            if d_id is None:
                continue
            d_token = d_tok.convert_ids_to_tokens(d_id) if d_tok is not None else None
            g_token = guide_tok.convert_ids_to_tokens(d_id) if d_id < len(guide_tok) else None
            if d_token is not None and g_token != d_token:
                problems.append(f"{role} id {d_id} is {d_token!r} for the dLLM but {g_token!r} for the guide")
    if problems:
        raise ValueError("the guide's tokenizer does not match the dLLM's: " + "; ".join(problems)
                         + ". A guide must use exactly the dLLM's tokenizer (for the bundled tiny models: the "
                         "bundled guide 'ar-tiny', or one trained by `dllm train-tiny --family ar`)")


def _crop(cache, new_len: int) -> None:
    cur = cache.get_seq_length()
    if new_len < cur:
        cache.crop(new_len - cur)  # negative: remove that many trailing slots (transformers 4.x and 5.x)


def _compact(st: dict, force: bool = False, keep: int | None = None) -> None:
    """Pack each row's valid guide-cache slots to the left (in order) when most slots are masked-out holes
    (batch > 1: rows advance by different amounts, so trailing holes of one row cannot be cropped). ``keep``: the
    most valid slots of a row, where the caller has read it (else read here)."""
    slots = st["slots"]
    count = slots.sum(-1)
    S = slots.shape[1]
    if keep is None:
        keep = int(count.max()) if slots.numel() else 0
    layers = getattr(st["cache"], "layers", None)
    if (S <= 2 * keep + 64 and not force) or S == keep or not layers or not all(hasattr(la, "keys") for la in layers):
        return
    order = torch.sort((~slots).long(), dim=-1, stable=True).indices[:, :keep]  # valid slots first, in order
    for la in layers:
        if getattr(la, "keys", None) is None or la.keys.dim() != 4:
            return
    for la in layers:
        idx = order[:, None, :, None].expand(-1, la.keys.shape[1], -1, la.keys.shape[-1])
        la.keys, la.values = la.keys.gather(2, idx), la.values.gather(2, idx)
    st["slots"] = torch.arange(keep, device=slots.device)[None] < count[:, None]


class GuidedSampler(SamplerBase):
    """AR-guided unmasking. See the module docstring.

    Args:
        guide: a bundled guide name (``ar-tiny``), a checkpoint directory, a loaded causal LM, or a
            ``(model, tokenizer)`` pair.
        mode: ``"deterministic"`` or ``"topk"``.
        k, r: top-k relative rule (``mode="topk"``): accept a draft in the guide's top ``k`` with
            ``p(draft) >= r * p(top1)``.
        chunk: drafts verified per guide forward (32).
        guide_dtype: dtype to load a guide checkpoint in (default: the checkpoint's).
        pad_id: the canvas's left-padding id (default: the EOS id).
        temperature: Gumbel-max temperature of the dLLM's drafts (0: argmax, the method's setting).
        record: add the per-position decisions to the trace (``guide_kind``: 1 accepted draft, 2 guide
            correction, 3 EOS fill after a stop; ``guide_draft``: the dLLM's drafts), for inspection and tests.
    """

    def __init__(self, guide=DEFAULT_GUIDE, mode: str = "deterministic", k: int = 2, r: float = 0.5, chunk: int = 32,
                 guide_dtype: str | None = None, pad_id: int | None = None, record: bool = False, temperature: float = 0.0, name: str = "guided"):
        check_choice("guide mode", mode, GUIDE_MODES)
        check_int("k", k, 1, fix=" (the guide's top-k)")
        check_range("r", r, 0.0, 1.0, fix=" (p(draft) >= r * p(top1))")
        check_int("chunk", chunk, 1, fix=" (drafts verified per guide forward)")
        if guide is None:
            raise ValueError("the guided sampler needs a guide: a bundled name ('ar-tiny'), a checkpoint directory "
                             "or a transformers causal LM")
        check_guide(guide)
        self.guide, self.mode, self.k, self.r, self.chunk = guide, mode, int(k), float(r), int(chunk)
        check_temperature("temperature", temperature)
        if guide_dtype is not None:  # a dtype name, checked now (not when the guide loads)
            from dllm.models.loading import resolve_dtype

            try:
                resolve_dtype(guide_dtype)
            except ValueError as exc:
                raise ValueError(f"guide_dtype: {exc}") from None
        self.guide_dtype, self.pad_id, self.record, self.name = guide_dtype, pad_id, record, name
        self.temperature = float(temperature)
        self._model = self._tok = None
        self._checked: set[int] = set()

    def __repr__(self) -> str:
        g = self.guide if isinstance(self.guide, (str, Path)) else type(self.guide).__name__
        return f"GuidedSampler(guide={str(g)!r}, mode={self.mode!r}, k={self.k}, r={self.r}, chunk={self.chunk})"

    # -- guide -------------------------------------------------------------------------------------------------

    def guide_model(self):
        """``(model, tokenizer)``, loaded once per sampler object."""
        if self._model is None:
            g = self.guide
            if isinstance(g, (str, Path)):
                self._model, self._tok = load_guide(g, dtype=self.guide_dtype)
            elif isinstance(g, tuple):
                self._model, self._tok = g
            else:
                self._model, self._tok = g, None
            self._model.eval().requires_grad_(False)
        return self._model, self._tok

    def use_guide_cache(self, cache: GuideCache) -> bool:
        """Take this sampler's guide from ``cache`` (:meth:`GuideCache.get`, shared with every sampler that names
        the same guide and ``guide_dtype``, its tokenizer check included) when the guide is a bundled name or a
        checkpoint directory; returns whether it did (a guide given as a loaded model stays this sampler's own).
        Raises what loading raises."""
        if not isinstance(self.guide, (str, Path)):
            return False
        self._model, self._tok, self._checked = cache.get(self.guide, self.guide_dtype)
        return True

    def bind_model(self, model) -> GuidedSampler:
        """Called by ``generate`` before decoding: load the guide, move it to the dLLM's device, check that
        both share one tokenizer."""
        g, tok = self.guide_model()
        dev = getattr(model, "device", None)
        if dev is not None and g.device != torch.device(dev):
            self._model = g = g.to(dev)
        if id(model) not in self._checked:
            check_tokenizers(model, g, tok)
            self._checked.add(id(model))
        return self

    # -- one step ----------------------------------------------------------------------------------------------

    def _init_state(self, canvas: torch.Tensor, gen_lo: int, pad, device) -> dict:
        from transformers import DynamicCache

        B = canvas.shape[0]
        head = canvas[:, :gen_lo]
        lead = (head == pad).long().cumprod(-1).sum(-1) if pad is not None else torch.zeros(B, dtype=torch.long)
        npad = torch.minimum(lead, torch.full_like(lead, gen_lo - 1))  # keep at least one prompt token
        g, _ = self.guide_model()
        try:
            cache = DynamicCache(config=g.config)
        except TypeError:  # transformers 4.x
            cache = DynamicCache()
        return {"cache": cache, "slots": torch.zeros((B, 0), dtype=torch.bool, device=device),
                "npad": npad.to(device), "fed": npad.clone().to(device),
                "stopped": torch.zeros(B, dtype=torch.bool, device=device)}

    def row_state(self, canvas: torch.Tensor, gen_lo: int, eos_id: int | None) -> dict:
        """The state of rows that have not stepped yet (``canvas``: theirs, generation from column ``gen_lo``),
        as their first step would start it (:meth:`move_rows` appends it for rows joining a running batch)."""
        pad = self.pad_id if self.pad_id is not None else eos_id
        return self._init_state(canvas, gen_lo, pad, canvas.device)

    def move_rows(self, state: dict, d: int, keep: torch.Tensor | None, n_new: int, *,
                  canvas: torch.Tensor | None = None, gen_lo: int = 0, eos_id: int | None = None) -> None:
        """Move the guided state (``state["guided"]``) with the rows of its batch (the serving engine,
        :meth:`~dllm.samplers.base.SamplerBase.move_rows`): ``keep`` rows selected, canvas columns shifted by ``d``
        (left padding added, or cropped when ``d < 0``; a row's guide positions do not change), then ``n_new``
        joining rows appended with the state their first step would start (:meth:`row_state` of their
        ``canvas``, ``gen_lo`` and ``eos_id``), with no valid slot in the guide's cache (masked-out slots, as a
        row's rejected drafts)."""
        st = state.get("guided")
        if st is None:
            return
        layers = getattr(st["cache"], "layers", None)
        if layers is None:
            raise TypeError("moving rows of the guide's cache needs a transformers cache with per-layer keys/values")
        if n_new and (canvas is None or canvas.shape[0] != n_new):
            raise ValueError(f"{n_new} joining rows need their canvas ([n_new, T]) to start their guide state")
        for la in layers:
            if getattr(la, "keys", None) is None or la.keys.dim() != 4:  # not written yet
                continue
            la.keys, la.values = moved_rows(la.keys, keep, n_new), moved_rows(la.values, keep, n_new)
        st["slots"] = moved_rows(st["slots"], keep, n_new, fill=False)
        st["stopped"] = moved_rows(st["stopped"], keep, n_new, fill=False)
        new = self.row_state(canvas, gen_lo, eos_id) if n_new else None
        for name in ("npad", "fed"):
            t = moved_rows(st[name], keep, d=d, shift=True)
            st[name] = torch.cat([t, new[name]]) if n_new else t

    def step(self, logits: torch.Tensor, ctx: StepContext) -> StepResult:
        g, gtok = self.guide_model()
        dev = logits.device
        if g.device != dev:
            self._model = g = g.to(dev)
        B, W, V = logits.shape
        if ctx.canvas is not None:
            canvas, win_lo, gen_lo = ctx.canvas, ctx.win_lo, ctx.gen_lo
            pad = self.pad_id if self.pad_id is not None else ctx.eos_id
        else:  # a direct step() call without the canvas: the guide sees a start token, then the window
            start = next((i for i in (getattr(gtok, "bos_token_id", None), getattr(g.config, "bos_token_id", None),
                                      ctx.eos_id, 0) if isinstance(i, int) and 0 <= i < V), 0)
            canvas = torch.cat([torch.full((B, 1), start, dtype=ctx.x.dtype, device=dev), ctx.x], 1)
            win_lo, gen_lo, pad = 1, 1, None
        T = canvas.shape[1]
        st = ctx.state.get("guided")
        if st is None:
            st = ctx.state["guided"] = self._init_state(canvas, gen_lo, pad, dev)
        cand = ctx.cand
        draft = gumbel_argmax(logits, self.temperature, ctx)  # argmax at temperature 0
        # stop tokens, never the mask id (a model whose EOS id is its mask id has no usable EOS)
        stops = [i for i in (ctx.eos_id, ctx.eot_id) if i is not None and i != ctx.mask_id]
        stop_ids = ids_on(tuple(stops), dev)  # made once per device
        eos = stops[0] if stops else 0  # fill after a stop (only used once a row has hit one)

        # The canvas with this step's drafts in the candidate positions (what the guide is fed).
        full = canvas.clone()
        full[:, win_lo : win_lo + W] = torch.where(cand, draft, ctx.x)
        has = cand.any(-1)
        stopped = st["stopped"]
        work = has & ~stopped
        first = torch.where(has, cand.long().argmax(-1), torch.zeros_like(has, dtype=torch.long))
        run = torch.where(torch.arange(W, device=dev)[None] >= first[:, None], cand.long(), torch.ones_like(cand.long()))
        run_len = run.cumprod(-1).sum(-1) - first  # consecutive candidates from the first one
        f = win_lo + first  # canvas column of the first mask
        end = torch.where(work, f + run_len, f)  # verify columns [f, end)
        v = f.clone()  # next column to verify
        open_ = work.clone()  # still verifying this step
        final = full.clone()  # canvas with accepted drafts / corrections written
        decided = torch.zeros((B, T), dtype=torch.bool, device=dev)  # columns committed this step
        kind = torch.zeros((B, T), dtype=torch.long, device=dev)
        verified = torch.zeros(B, dtype=torch.long, device=dev)
        accepted = torch.zeros(B, dtype=torch.long, device=dev)
        corrected = torch.zeros(B, dtype=torch.long, device=dev)
        hit_stop = torch.zeros(B, dtype=torch.bool, device=dev)
        ar_forwards = 0
        Vc = min(V, g.config.vocab_size if isinstance(getattr(g.config, "vocab_size", None), int) else V)
        kv = cache_argument(g)  # the name the guide's forward takes its KV cache under
        while True:
            u = torch.minimum(v + self.chunk, end)  # verify [v, u)
            fed = st["fed"]
            width = torch.where(open_, u - 1 - fed, torch.zeros_like(fed))
            n = (u - v).clamp_min(0)
            # One read of what the host decides on (one synchronisation per verification round, and one to end the
            # step): whether a row verifies on, the guide cache's slots to keep (after its last valid column), the
            # most valid slots of a row (_compact), the widths of the feed and of the chunk, whether a row finished.
            slots = st["slots"]
            S = slots.shape[1]
            last = torch.where(slots.any(0), torch.arange(1, S + 1, device=dev), 0).amax() if S else width.new_zeros(())
            finish = hit_stop | (stopped & has)
            go, keep, most, Wf, K, finished = torch.stack(
                [open_.any().long(), last, slots.sum(-1).amax(), width.amax(), n.amax(), finish.any().long()]).tolist()
            if keep < S:  # the slots after every row's last valid one (rejected drafts, padding): dropped
                _crop(st["cache"], keep)
                st["slots"] = slots[:, :keep]
            if not go:
                break
            _compact(st, keep=most)
            j = torch.arange(Wf, device=dev)
            feed_cols = (fed[:, None] + j[None]).clamp_max(T - 1)
            new_valid = j[None] < width[:, None]
            ids = torch.where(new_valid, full.gather(1, feed_cols), torch.full_like(feed_cols, int(eos)))
            pos = torch.where(new_valid, feed_cols - st["npad"][:, None], torch.zeros_like(feed_cols))
            att = torch.cat([st["slots"], new_valid], 1)
            out = g(input_ids=ids, attention_mask=att.long(), position_ids=pos, use_cache=True, **{kv: st["cache"]})
            ar_forwards += 1
            kk = torch.arange(K, device=dev)
            in_chunk = kk[None] < n[:, None]
            # Logits predicting column v + kk sit at fed index (v + kk - 1 - fed).
            idx = (v[:, None] + kk[None] - 1 - fed[:, None]).clamp(0, max(Wf - 1, 0))
            lg = out.logits[..., :Vc].gather(1, idx[..., None].expand(-1, -1, Vc)).float()
            if ctx.mask_id is not None and ctx.mask_id < Vc:
                lg[..., ctx.mask_id] = float("-inf")
            ar_top = lg.argmax(-1)
            vcols = (v[:, None] + kk[None]).clamp_max(T - 1)
            d = full.gather(1, vcols)
            if self.mode == "deterministic":
                ok = d == ar_top
            else:
                p = torch.softmax(lg, -1)
                top = torch.topk(p, min(self.k, Vc), dim=-1)
                pd = p.gather(-1, d.clamp_max(Vc - 1)[..., None]).squeeze(-1)
                ok = (d < Vc) & (top.indices == d[..., None]).any(-1) & (pd >= self.r * top.values[..., 0])
            ok = ok & in_chunk
            bad = ~ok & in_chunk
            m = torch.where(bad.any(-1), bad.long().argmax(-1), n)  # accepted drafts in this chunk
            rejected = open_ & (m < n)
            # Columns decided: accepted drafts [v, v+m), plus the correction at v+m on rejection.
            tok = torch.where(kk[None] < m[:, None], d, ar_top)
            take = open_[:, None] & ((kk[None] < m[:, None]) | (rejected[:, None] & (kk[None] == m[:, None])))
            # A stop token ends the row: nothing after the first stop is committed from the guide.
            is_stop = take & torch.isin(tok, stop_ids)
            stop_at = torch.where(is_stop.any(-1), is_stop.long().argmax(-1), torch.full_like(m, K))
            take = take & (kk[None] <= stop_at[:, None])
            new_stop = open_ & is_stop.any(-1)
            tcols = torch.where(take, vcols, torch.full_like(vcols, T))  # T: dropped by the scatter below
            final = torch.cat([final, final[:, :1]], 1).scatter(1, tcols, torch.where(take, tok, 0))[:, :T]
            decided = torch.cat([decided, decided[:, :1]], 1).scatter(1, tcols, take)[:, :T]
            kd = torch.where(kk[None] < m[:, None], 1, 2)
            kind = torch.cat([kind, kind[:, :1]], 1).scatter(1, tcols, torch.where(take, kd, 0))[:, :T]
            n_acc = (take & (kk[None] < m[:, None])).sum(-1)
            verified += torch.where(open_, torch.minimum(torch.where(rejected, m + 1, m), stop_at + 1), 0)
            accepted += n_acc
            corrected += (take & (kk[None] == m[:, None]) & rejected[:, None]).any(-1).long()
            hit_stop |= new_stop
            # Cache bookkeeping: slots of fed columns < good stay valid (good: first column whose fed token
            # is not final, i.e. the rejected draft, or the first unfed column).
            good = torch.where(rejected, v + m, u - 1)
            slot_ok = new_valid & (feed_cols < good[:, None])
            st["slots"] = torch.cat([st["slots"], slot_ok], 1)
            st["fed"] = torch.where(open_, torch.minimum(good, u - 1), fed)
            v = torch.where(open_, u, v)
            open_ = open_ & ~rejected & ~new_stop & (v < end)

        # Rows that stopped (now or earlier, ``finish``): EOS everywhere after the stop, and the row finishes.
        st["stopped"] = stopped | hit_stop
        win_final = final[:, win_lo : win_lo + W]
        win_dec = decided[:, win_lo : win_lo + W]
        fill = finish[:, None] & cand & ~win_dec
        # A finishing row's other columns of its own region are filled with EOS too; the decode loop fills every
        # mask of the batch's window (the union of the rows' regions), so beyond the row's region the proposal is
        # the mask id (the column stays masked) and the row fills the rest of its generation at its next step,
        # as alone: its forwards do not depend on the other rows' regions.
        wcols = ctx.win_lo + torch.arange(W, device=dev)[None]  # canvas columns of the window
        own = (wcols >= ctx.region_lo[:, None]) & (wcols < ctx.region_hi[:, None])
        after = finish[:, None] & ~win_dec & own
        beyond = finish[:, None] & ~own
        proposal = torch.where(win_dec, win_final, torch.where(after, torch.full_like(draft, int(eos)), draft))
        if ctx.mask_id is not None:
            proposal = torch.where(beyond, torch.full_like(draft, int(ctx.mask_id)), proposal)
        commit = (win_dec | fill) & cand
        info: dict[str, Any] = {"ar_forwards": ar_forwards, "guide_verified": verified, "guide_accepted": accepted,
                                "guide_corrected": corrected}
        if self.record:
            info["guide_kind"] = torch.where(fill, 3, kind[:, win_lo : win_lo + W])
            info["guide_draft"] = draft
            info["win_lo"] = ctx.win_lo  # canvas column of window position 0
        return StepResult(proposal, commit, info, finish=finish if finished else None)


def guided_summary(stats) -> dict[str, float]:
    """Aggregate a guided run's ``GenerateStats``: dLLM forwards, guide forwards, verifications (a row's
    verification round in one step), drafts verified / accepted, tokens accepted per verification and the
    acceptance rate (accepted / verified drafts)."""
    ar = sum(int(rec.get("ar_forwards", 0)) for rec in stats.trace)
    ver = [v for rec in stats.trace for v in rec.get("guide_verified", [])]
    acc = [a for rec in stats.trace for a in rec.get("guide_accepted", [])]
    cor = [c for rec in stats.trace for c in rec.get("guide_corrected", [])]
    rounds = sum(1 for x in ver if x > 0)
    return {"dllm_forwards": stats.nfe, "ar_forwards": ar, "verifications": rounds, "drafts_verified": sum(ver),
            "drafts_accepted": sum(acc), "corrections": sum(cor),
            "accepted_per_verification": sum(acc) / max(rounds, 1),
            "acceptance_rate": sum(acc) / max(sum(ver), 1)}


def guided(guide=DEFAULT_GUIDE, mode: str = "deterministic", k: int = 2, r: float = 0.5, chunk: int = 32,
           temperature: float = 0.0, guide_dtype: str | None = None, block_length: int | None = None,
           record: bool = False, name: str = "guided"):
    """AR-guided unmasking: the dLLM drafts, a causal LM (default: bundled ``ar-tiny``) verifies left to right
    (a :class:`~dllm.recipes.Recipe`: the sampler and its preferred ``block_length``)."""
    from dllm.samplers.recipe import Recipe

    return Recipe(GuidedSampler(guide, mode, k, r, chunk, guide_dtype=guide_dtype, record=record,
                                temperature=temperature, name=name), block_length=block_length, name=name)


def check_guide(guide) -> None:
    """``guide`` is a form the guided sampler loads: a checkpoint directory or bundled name, a transformers causal
    LM or a (model, tokenizer) pair; else ValueError naming them (a number failed inside the first step)."""
    ok = isinstance(guide, (str, Path)) or (isinstance(guide, tuple) and len(guide) == 2) or (
        callable(guide) and hasattr(guide, "config"))
    if not ok:
        raise ValueError(f"AR-guided decoding: guide must be a causal LM checkpoint directory, the bundled name "
                         f"'ar-tiny', a transformers causal LM or a (model, tokenizer) pair, not {type(guide).__name__}")


def with_guide(sampler, guide):
    """``generate(..., guide=...)``: the ``guided`` preset around ``guide`` (no sampler or ``"guided"``), or
    a copy of a :class:`GuidedSampler` with that guide."""
    check_guide(guide)
    from dllm.samplers.recipe import Recipe, as_recipe

    if sampler is None or sampler == "guided":
        return guided(guide)
    recipe = as_recipe(sampler)
    s = recipe.sampler
    if isinstance(s, GuidedSampler):
        return Recipe(GuidedSampler(guide, s.mode, s.k, s.r, s.chunk, guide_dtype=s.guide_dtype, pad_id=s.pad_id,
                                    record=s.record, temperature=s.temperature, name=s.name),
                      recipe.block_length, recipe.block_policy, recipe.cache, recipe.name)
    raise ValueError(f"guide=... works with the guided sampler (sampler=None or 'guided'), not with {sampler!r}")
