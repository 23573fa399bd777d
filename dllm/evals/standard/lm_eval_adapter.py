"""lm-evaluation-harness (``lm-eval`` 0.4.x) model adapter, registered as ``dllm``.

Command line (lm_eval only knows the models it ships, so the adapter must be imported first; both commands
register it and then run lm_eval's own CLI with the remaining arguments)::

    dllm lm-eval --model dllm --model_args pretrained=PATH,sampler=llada,gen_length=256,block_length=32 \\
        --tasks gsm8k --num_fewshot 5 --apply_chat_template
    python -m dllm.evals.standard.lm_eval_adapter --model dllm --model_args ... --tasks ...
    accelerate launch --num_processes 8 -m dllm.evals.standard.lm_eval_adapter --model dllm ...   # one model per GPU

From Python: ``import dllm.evals.standard.lm_eval_adapter`` then ``lm_eval.simple_evaluate(model="dllm", ...)``.
Importing it also routes lm_eval's code tasks (``evaluate.load("code_eval")``) to the dllm sandbox
(:mod:`dllm.evals.standard.code_eval`).

``model_args``: ``pretrained`` (a checkpoint directory or a bundled name), ``sampler`` (a registered sampler;
default: the family baseline), ``gen_length``, ``block_length``, ``steps``, ``cfg_scale``, ``cache``,
``eos_early_stop``, ``seed``, ``dtype``, ``device``, ``batch_size`` (prompts per generate call), ``continuous``
(``true``: ``batch_size`` rows decode at once with continuous batching, a finished row's place taken by the next
prompt, :data:`~dllm.evals.runner.CONTINUOUS_CHUNK` times ``batch_size`` prompts per generate call; the same
answers), ``mc_num`` (Monte-Carlo samples per log-likelihood, default 128), ``mc_batch_size`` (default 32),
``check_greedy``; any other key is a parameter of the sampler (``threshold=0.9``).

* ``generate_until``: prompts are batched ``batch_size`` at a time through :func:`dllm.generate` (the context
  string as lm_eval formatted it, tokenised without a second chat template); each answer is cut at the first
  of the request's ``until`` strings. The answer length is ``gen_length`` (masked-diffusion decoding has a
  fixed canvas; ``max_gen_toks`` only shortens it when smaller).
* ``loglikelihood``: LLaDA's Monte-Carlo estimate of the log-likelihood lower bound of the continuation given
  the context. Each of ``mc_num`` draws masks ``k`` of the ``L`` continuation tokens — within a batch of
  ``b`` draws the ``k`` are stratified (``k0, k0 + L/b, ...`` wrapped into ``1..L`` with a random ``k0``) —
  and scores the cross-entropy of the masked tokens weighted by ``L / k`` (the ``1/t`` weight with ``t = k/L``).
  The estimate is minus the mean over draws. ``cfg_scale > 0`` uses classifier-free guidance (the context is
  masked for the unconditional pass). ``is_greedy`` is computed only with ``check_greedy=True`` (one-by-one
  most-confident unmasking of the continuation, compared with it); otherwise it is ``False``.
* Block-diffusion checkpoints (SDAR, LLaDA2.x, Fast-dLLM v2: ``config.block_size``): the bound is the sum over the
  continuation's blocks of each block's bound given the clean blocks before it, the factorisation these models
  decode by. Each draw masks, in every block, ``k`` of its ``n`` continuation tokens (``k`` uniform in ``1..n``,
  weight ``n / k``); one forward over a noisy and a clean copy (:func:`dllm.blockdiff.two_copy_inputs`) scores
  every block. With blocks of one token this is the exact autoregressive log-likelihood. ``check_greedy``
  unmasks one token at a time within the first block that still holds masks. No ``cfg_scale``.
* ``loglikelihood_rolling`` is not supported (no exact perplexity for masked diffusion models).

Multi-process: under ``accelerate launch``/``torchrun`` each process loads the model on its own device and
lm_eval splits the requests by ``rank``/``world_size``.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys

import torch
import torch.nn.functional as F

from dllm.blockdiff import two_copy_inputs
from dllm.evals.runner import batching
from dllm.generate import answer_lengths, cfg_forward, generate

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - exercised only without the eval extra
    raise ImportError("the lm-eval adapter needs lm-evaluation-harness: pip install 'lm-eval>=0.4' "
                      "(or pip install -e '.[eval]')") from exc

log = logging.getLogger(__name__)

_OWN_ARGS = {"pretrained", "sampler", "gen_length", "block_length", "steps", "cfg_scale", "cache", "eos_early_stop",
             "seed", "dtype", "device", "batch_size", "max_batch_size", "mc_num", "mc_batch_size", "check_greedy",
             "continuous"}


def _bool(v) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "y")
    return bool(v)


class DLLMLM(LM):
    """lm_eval model wrapping a dllm checkpoint and a sampler."""

    def __init__(self, pretrained: str = "llada-tiny", sampler: str | None = None, gen_length: int = 256,
                 block_length: int | None = None, steps: int | None = None, cfg_scale: float = 0.0,
                 cache: str | None = None, eos_early_stop: bool = False, seed: int = 0, dtype: str | None = None,
                 device: str | None = None, batch_size: int | str = 1, max_batch_size: int | None = None,
                 mc_num: int = 128, mc_batch_size: int = 32, check_greedy: bool = False, continuous: bool = False,
                 **sampler_params):
        super().__init__()
        from dllm.assets import model_path
        from dllm.config import GenerateConfig
        from dllm.models import load_model
        from dllm.samplers import get_sampler

        if sampler_params and not sampler:
            raise ValueError(f"model_args {sorted(sampler_params)} are not adapter options ({', '.join(sorted(_OWN_ARGS))}) "
                             "and there is no sampler= to pass them to")
        self.mc_num, self.mc_batch_size = int(mc_num), int(mc_batch_size)
        if self.mc_num < 1 or self.mc_batch_size < 1:
            raise ValueError(f"mc_num and mc_batch_size must be >= 1, got {mc_num}, {mc_batch_size}")
        self.batch_size_ = 1 if batch_size in (None, "auto") or str(batch_size).startswith("auto") else int(batch_size)
        self.check_greedy = _bool(check_greedy)
        self.continuous = _bool(continuous)
        self.cache = cache
        self.seed = int(seed)

        self.accelerator = None
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=device == "cpu" or not torch.cuda.is_available())
            device = device if device not in (None, "cuda") else str(self.accelerator.device)
        self._rank = self.accelerator.process_index if self.accelerator else 0
        self._world_size = self.accelerator.num_processes if self.accelerator else 1
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            if device is not None:  # lm_eval passes device="cuda" by default
                log.warning("device %r requested but CUDA is not available; using the CPU", device)
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.path = model_path(pretrained)
        self.model = load_model(self.path, dtype=dtype, device=device)
        self._device = self.model.device
        self.tokenizer = self.model.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"{self.path}: no tokenizer files; the lm-eval adapter needs one")
        self.config = GenerateConfig(gen_length=int(gen_length), block_length=None if block_length is None else int(block_length),
                                     steps=None if steps is None else int(steps), cfg_scale=float(cfg_scale),
                                     eos_early_stop=_bool(eos_early_stop), seed=self.seed, chat_template=False)
        self.cfg_scale = float(cfg_scale)
        self._block_size = getattr(getattr(self.model, "config", None), "block_size", None)
        self.sampler = get_sampler(sampler, **sampler_params) if sampler else None
        self.stats = {"nfe": 0, "answer_tokens": 0, "gen_seconds": 0.0}

    # ------------------------------------------------------------------ lm_eval plumbing
    @property
    def tokenizer_name(self) -> str:
        return str(self.path).replace("/", "__")

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def all_gather(self, tensor):
        return self.accelerator.gather(tensor) if self.accelerator else tensor

    def gather_object(self, obj, dst=0):
        if not self.accelerator:
            return [obj]
        from accelerate.utils import gather_object

        got = gather_object([obj])
        return got if self._rank == dst else None

    def barrier(self) -> None:
        if self.accelerator:
            self.accelerator.wait_for_everyone()

    def _encode(self, text: str) -> list[int]:
        bos = getattr(self.tokenizer, "bos_token", None)
        special = not (bos and text.startswith(bos))  # a chat-templated context already holds BOS
        return self.tokenizer(text, add_special_tokens=special)["input_ids"]

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request decoded as it would be alone, whatever else is in its batch: its own generation length
        (:meth:`_request_config`; a batch holds requests of one length) and its own random stream, keyed by its
        context and its occurrence among identical contexts in ``requests`` (lm-eval's ``repeats``: each repeat
        draws anew), never by the batch it falls in."""
        from dllm.evals.standard.answers import truncate_at

        out: list[str | None] = [None] * len(requests)
        seen: dict[str, int] = {}
        items = []
        for i, req in enumerate(requests):
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            occurrence = seen[context] = seen.get(context, -1) + 1
            cfg = self._request_config(kwargs.get("max_gen_toks"))
            items.append((i, self._encode(context), until, cfg, f"{occurrence}:{context}"))
        # one generation length per batch; similar prompt lengths together: less padding
        items.sort(key=lambda t: (t[3].gen_length, -len(t[1])))
        for _, group in itertools.groupby(items, key=lambda t: t[3].gen_length):
            group = list(group)
            step, max_rows = batching(self.batch_size_, self.continuous)
            for b in range(0, len(group), step):
                chunk = group[b : b + step]
                res = generate(self.model, [ids for _, ids, _, _, _ in chunk], chunk[0][3], sampler=self.sampler,
                               cache=self.cache, row_ids=[key for *_, key in chunk],
                               max_rows=max_rows)
                lengths = answer_lengths(self.model, res.sequences)
                self.stats["nfe"] += res.stats.nfe
                self.stats["gen_seconds"] += res.stats.time_total
                for (i, _, until, _, _), text, n in zip(chunk, res.texts, lengths):
                    kept, _ = truncate_at(text, until)
                    out[i] = kept
                    self.stats["answer_tokens"] += n
        return out  # type: ignore[return-value]

    def _request_config(self, max_gen_toks):
        """The decoding config of a request: the adapter's, with a smaller ``max_gen_toks`` shortening the canvas
        where that keeps the block structure valid (the steps scaled with it)."""
        cfg = self.config
        if max_gen_toks and max_gen_toks < cfg.gen_length and cfg.gen_length % cfg.block == 0:
            if cfg.block_length is None or max_gen_toks % cfg.block_length == 0:
                from dataclasses import replace

                steps = None if cfg.steps is None else max(1, cfg.steps * max_gen_toks // cfg.gen_length)
                cfg = replace(cfg, gen_length=max_gen_toks, steps=steps)
        return cfg

    # ------------------------------------------------------------------ log-likelihood
    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # The context is kept whole (a chat-templated context ends with the template's "\n\n"; moving it into
        # the continuation as causal-LM adapters do would score template tokens as part of the answer).
        whole = self._encode(context + continuation)
        ctx = self._encode(context) if context else whole[:0]
        if whole[: len(ctx)] == ctx and len(whole) > len(ctx):
            return ctx, whole[len(ctx) :]
        cont = self.tokenizer(continuation, add_special_tokens=False)["input_ids"]
        return ctx, cont

    def _logits(self, x: torch.Tensor, n_prefix: int, cols: torch.Tensor) -> torch.Tensor:
        idx = cols.expand(x.shape[0], -1)
        if self.cfg_scale > 0:
            return cfg_forward(self.model, x, n_prefix, self.cfg_scale, torch.float32, logits_idx=idx)
        return self.model(x, logits_idx=idx).float()

    @torch.no_grad()
    def mc_loglikelihood(self, prefix: list[int], target: list[int], generator: torch.Generator | None = None) -> float:
        """Monte-Carlo estimate of ``log p(target | prefix)`` (LLaDA's ELBO; see the module docstring)."""
        dev = self._device
        L, P = len(target), len(prefix)
        if L == 0:
            return 0.0
        if P + L > self.model.max_seq_len:
            raise ValueError(f"context ({P}) + continuation ({L}) tokens exceed the model's context of "
                             f"{self.model.max_seq_len}")
        if self._block_size:
            return self._block_mc_loglikelihood(prefix, target, generator)
        seq = torch.tensor(prefix + target, device=dev)
        tgt = seq[P:]
        cols = torch.arange(P, P + L, device=dev)[None]
        total, draws = 0.0, 0
        while draws < self.mc_num:
            b = min(self.mc_batch_size, self.mc_num - draws)
            k0 = int(torch.randint(1, L + 1, (1,), generator=generator))
            ks = torch.round(torch.linspace(float(k0), k0 + (b - 1) * L / b, b)).long()
            ks = ((ks - 1) % L) + 1  # masked tokens per draw, in 1..L
            ranks = torch.argsort(torch.rand(b, L, generator=generator), dim=-1).argsort(dim=-1)
            masked = (ranks < ks[:, None]).to(dev)  # a uniformly random subset of size k per draw
            x = seq.expand(b, -1).clone()
            x[:, P:] = torch.where(masked, torch.full_like(masked, self.model.mask_id, dtype=torch.long), tgt.expand(b, -1))
            logits = self._logits(x, P, cols)  # [b, L, V]
            ce = F.cross_entropy(logits.reshape(b * L, -1), tgt.repeat(b), reduction="none").view(b, L)
            weight = (L / ks.to(dev).float())[:, None]
            total += float((ce * masked * weight).sum())
            draws += b
        return -total / self.mc_num

    @torch.no_grad()
    def _block_mc_loglikelihood(self, prefix: list[int], target: list[int], generator: torch.Generator | None) -> float:
        """The block-diffusion bound: the sum over the continuation's blocks of each block's masked-diffusion
        bound given the clean blocks before it (the module docstring), one two-copy forward per batch of draws."""
        if self.cfg_scale > 0:
            raise ValueError("cfg_scale > 0: classifier-free guidance of log-likelihoods is not defined for "
                             "block-diffusion checkpoints; use cfg_scale=0")
        dev, bs = self._device, self._block_size
        P, L = len(prefix), len(target)
        seq = torch.tensor(prefix + target, device=dev)
        blocks = torch.arange(P, P + L) // bs  # the block of each continuation column
        total, draws = 0.0, 0
        while draws < self.mc_num:
            b = min(self.mc_batch_size, self.mc_num - draws)
            masked = torch.zeros(b, L, dtype=torch.bool)
            weight = torch.zeros(b, L)
            for u in blocks.unique().tolist():
                cols = (blocks == u).nonzero()[:, 0]
                n = len(cols)
                ks = torch.randint(1, n + 1, (b,), generator=generator)  # masked tokens of this block per draw
                ranks = torch.argsort(torch.rand(b, n, generator=generator), dim=-1).argsort(dim=-1)
                masked[:, cols] = ranks < ks[:, None]
                weight[:, cols] = (n / ks.float())[:, None]
            masked, weight = masked.to(dev), weight.to(dev)
            clean = seq.expand(b, -1)
            noisy = clean.clone()
            noisy[:, P:] = torch.where(masked, torch.full_like(noisy[:, P:], self.model.mask_id), clean[:, P:])
            valid = torch.ones_like(clean, dtype=torch.bool)
            logits = self.model(**two_copy_inputs(noisy, clean, valid, bs, P, self.model.shift_logits)).float()
            ce = F.cross_entropy(logits.reshape(b * L, -1), clean[:, P:].reshape(-1), reduction="none").view(b, L)
            total += float((ce * masked * weight).sum())
            draws += b
        return -total / self.mc_num

    @torch.no_grad()
    def _greedy_matches(self, prefix: list[int], target: list[int]) -> bool:
        dev = self._device
        P, L = len(prefix), len(target)
        x = torch.tensor([prefix + [self.model.mask_id] * L], device=dev)
        cols = torch.arange(P, P + L, device=dev)[None]
        for _ in range(L):
            logits = self._logits(x, P, cols)[0]
            logits[:, self.model.mask_id] = -float("inf")
            conf, pred = logits.softmax(-1).max(-1)
            still = x[0, P:] == self.model.mask_id
            if self._block_size:  # block by block: only the first block that still holds masks
                first = (P + int(still.nonzero()[0, 0])) // self._block_size
                still = still & (torch.arange(P, P + L, device=dev) // self._block_size == first)
            conf = torch.where(still, conf, torch.full_like(conf, -1.0))
            j = int(conf.argmax())
            x[0, P + j] = pred[j]
        return x[0, P:].tolist() == list(target)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            prefix, target = self._split(context, continuation)
            if not prefix:
                bos = getattr(self.tokenizer, "bos_token_id", None)
                prefix = [bos if bos is not None else self.model.eos_id]
            gen = torch.Generator().manual_seed(self.seed)  # the same draws for every request: fair comparisons
            ll = self.mc_loglikelihood(prefix, target, gen)
            greedy = self._greedy_matches(prefix, target) if self.check_greedy else False
            out.append((ll, greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("loglikelihood_rolling (perplexity tasks) is not supported by the dllm adapter: "
                                  "masked diffusion models give only a Monte-Carlo bound per continuation")


if __name__ != "__main__":  # run as a script, the module below registers itself under its real name
    register_model("dllm")(DLLMLM)
    from dllm.evals.standard.code_eval import route_code_eval_to_sandbox

    route_code_eval_to_sandbox()  # lm_eval's code tasks execute programs in the dllm sandbox


def run_lm_eval_cli(argv: list[str] | None = None) -> int:
    """Run lm_eval's own command line (``lm_eval ...``) with the ``dllm`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    old = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = old
    return 0


if __name__ == "__main__":  # python -m dllm.evals.standard.lm_eval_adapter <lm_eval arguments>
    from dllm.evals.standard.lm_eval_adapter import run_lm_eval_cli as _run  # registers `dllm`

    sys.exit(_run())
