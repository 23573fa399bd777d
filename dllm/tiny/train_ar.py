"""Train the bundled tiny autoregressive guide (``dllm train-tiny --family ar``).

A small ``transformers`` ``LlamaForCausalLM`` with the project tokenizer (same vocabulary and token ids as the
tiny dLLMs), trained with next-token cross-entropy on the answer tokens and the end-of-turn token of the same
synthetic tasks (:mod:`dllm.evals.tasks`) and prompt format as :mod:`dllm.tiny.train`. Prompts are rendered with
both chat templates of the project (LLaDA's and Dream's, half of the examples each) so one guide verifies the
drafts of either tiny dLLM; the saved tokenizer carries the LLaDA template (the default model's).

The checkpoint is written with ``save_pretrained`` (``config.json`` + ``model.safetensors`` + tokenizer files)
and loads with ``transformers.AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dllm.evals import tasks as T

IGNORE = -100


@dataclass(frozen=True)
class ARTrainConfig:
    d_model: int = 128
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int | None = None  # default: n_heads
    mlp_hidden: int = 384
    steps: int = 6000
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.01
    examples_per_task: int = 2000  # fixed pool per task; 0: fresh examples streamed from new seeds (dllm.tiny.train.ExampleStream)
    multi_turn: float = 0.6  # fraction of prompts with the worked example turn (the evaluation prompts have it)
    dream_template: float = 0.5  # fraction of prompts rendered with the Dream (Qwen-style) chat template
    seed: int = 0
    threads: int | None = None
    time_budget_s: float | None = None  # stop early; the cosine schedule follows the elapsed fraction
    max_seq_len: int = 512
    list_item_tokens: bool = False  # tokenizer layout with one token per list item (see dllm/train.py)
    tokenizer_layout: str | None = None  # "gpt2" | "list-items" | "names"; None: from list_item_tokens
    init_from: str | None = None  # continue from an AR checkpoint of the same shape
    save_every: int = 0  # also write the checkpoint (and training.json so far) every this many steps


def _tokenizers(list_items: bool = False, layout: str | None = None):
    """(LLaDA-template tokenizer, Dream-template tokenizer), both built in a scratch directory."""
    from transformers import AutoTokenizer

    from dllm.tiny.tokenizer import build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:  # built aside: out_dir is written only by the first save
        tok = AutoTokenizer.from_pretrained(str(build_tokenizer(Path(tmp) / "llada", "llada", list_items=list_items,
                                                                layout=layout)))
        tok_dream = AutoTokenizer.from_pretrained(str(build_tokenizer(Path(tmp) / "dream", "dream",
                                                                      list_items=list_items, layout=layout)))
    if tok.get_vocab() != tok_dream.get_vocab():  # pragma: no cover - guarded by tokenizer_build
        raise RuntimeError("the LLaDA and Dream tokenizer builds differ in vocabulary")
    return tok, tok_dream


def build_model(cfg: ARTrainConfig, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    mcfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=cfg.d_model, intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads or cfg.n_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.02,
        bos_token_id=tok.convert_tokens_to_ids("<|startoftext|>"), eos_token_id=eos, pad_token_id=eos,
    )
    model = LlamaForCausalLM(mcfg)
    model.generation_config.eos_token_id = [eos, eot, im_end]
    model.generation_config.pad_token_id = eos
    return model


def make_batch(items, pad_id: int, eot_ids: list[int]):
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (answer + end-of-turn only)."""
    seqs = [(p, a + [eot]) for (p, a), eot in zip(items, eot_ids)]
    L = max(len(p) + len(r) for p, r in seqs)
    B = len(seqs)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    att = torch.zeros((B, L), dtype=torch.long)
    labels = torch.full((B, L), IGNORE, dtype=torch.long)
    for b, (p, r) in enumerate(seqs):
        n = len(p) + len(r)
        ids[b, :n] = torch.tensor(p + r)
        att[b, :n] = 1
        labels[b, len(p) : n] = torch.tensor(r)
    return ids, att, labels


def train(cfg: ARTrainConfig, out_dir, *, progress=None) -> dict:
    """Train, save to ``out_dir`` and return a summary (also written to ``out_dir/training.json``)."""
    from dllm.tiny.train import ExampleStream, build_pools

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    out_dir = Path(out_dir)
    tok, tok_dream = _tokenizers(cfg.list_item_tokens, cfg.tokenizer_layout)
    start = None
    if cfg.init_from:  # read and checked before anything is written to out_dir
        from transformers import AutoModelForCausalLM

        start = AutoModelForCausalLM.from_pretrained(str(cfg.init_from), dtype=torch.float32)
        want = {"vocab_size": len(tok), "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden,
                "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
                "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads, "tie_word_embeddings": True}
        diff = [f"{k}: checkpoint {getattr(start.config, k, None)!r}, run {v!r}" for k, v in want.items()
                if getattr(start.config, k, None) != v]
        if diff:
            raise ValueError(f"--init-from {cfg.init_from}: the checkpoint differs from this run ({'; '.join(diff)}); "
                             "train with the checkpoint's --d-model/--layers/--heads/--mlp and tokenizer layout")
    toks = {"llada": tok, "dream": tok_dream}
    if cfg.examples_per_task > 0:
        pools = {fam: build_pools(t, cfg.examples_per_task, seed=cfg.seed + 1000) for fam, t in toks.items()}

        def draw_example(fam, name, turn):
            pool = pools[fam][name][turn]
            return pool[rng.randrange(len(pool))]
    else:  # each template its own stream of fresh examples (different seeds)
        streams = {(fam, n): ExampleStream(t, n, cfg.seed + i) for i, (fam, t) in enumerate(toks.items())
                   for n in T.task_names()}

        def draw_example(fam, name, turn):
            return streams[fam, name].draw(turn)
    eot = {"llada": tok.convert_tokens_to_ids("<|eot_id|>"), "dream": tok.convert_tokens_to_ids("<|im_end|>")}
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    model = build_model(cfg, tok)
    if start is not None:
        model.load_state_dict(start.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    names = T.task_names()
    t0 = time.perf_counter()
    losses: list[float] = []
    step = 0
    model.train()
    for step in range(1, cfg.steps + 1):
        frac = step / cfg.steps
        if cfg.time_budget_s:
            frac = max(frac, (time.perf_counter() - t0) / cfg.time_budget_s)
        lr = cfg.lr * min(1.0, step / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        for g in opt.param_groups:
            g["lr"] = max(lr, cfg.lr * 0.02)
        items, eots = [], []
        for _ in range(cfg.batch_size):
            fam = "dream" if rng.random() < cfg.dream_template else "llada"
            items.append(draw_example(fam, rng.choice(names), 1 if rng.random() < cfg.multi_turn else 0))
            eots.append(eot[fam])
        ids, att, labels = make_batch(items, pad, eots)
        logits = model(input_ids=ids, attention_mask=att).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if progress is not None and step % 50 == 0:
            progress(step, sum(losses[-50:]) / 50, time.perf_counter() - t0)
        if frac >= 1.0:
            break
        if cfg.save_every and step % cfg.save_every == 0:
            _save(model, tok, out_dir, cfg, step, time.perf_counter() - t0, losses)
    return _save(model, tok, out_dir, cfg, step, time.perf_counter() - t0, losses)


def _save(model, tok, out_dir: Path, cfg: ARTrainConfig, step: int, train_s: float, losses: list[float]) -> dict:
    """Write the checkpoint, the tokenizer and ``training.json``; return the summary."""
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    summary = {
        "train_config": asdict(cfg),
        "model_config": {k: getattr(model.config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")},
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps_done": step,
        "train_seconds": round(train_s, 1),
        "final_loss": sum(losses[-50:]) / max(1, len(losses[-50:])),
    }
    (out_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


@torch.no_grad()
def greedy_generate(model, tok, prompts: list[list[int]], max_new_tokens: int, stop_ids) -> list[list[int]]:
    """Greedy decoding of left-padded prompts with ``model.generate`` (tokens before the first stop id)."""
    P = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stop_ids[0]
    ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
    att = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=att, do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=list(stop_ids), pad_token_id=pad)[:, P:]
    rows = []
    for row in out.tolist():
        cut = next((i for i, t in enumerate(row) if t in stop_ids), len(row))
        rows.append(row[:cut])
    return rows


def evaluate(path, names: list[str] | None = None, n: int = 20, seed: int = 12345, max_new_tokens: int = 64,
             batch_size: int = 20, template: str = "llada") -> dict[str, dict]:
    """Greedy exact-match accuracy of an AR checkpoint on the held-out synthetic tasks.

    Returns ``{task: {"score", "score_strict", "n", "family"}}``; ``template`` picks the chat template
    (``"llada"``: the checkpoint's own; ``"dream"``: the Qwen-style one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dllm.tiny.tokenizer import CHAT_TEMPLATES
    from dllm.tiny.train import encode_example

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = CHAT_TEMPLATES[template]
    stop_ids = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|eot_id|>", "<|im_end|>")]
    results = {}
    for name in names or T.task_names():
        task = T.get_task(name)
        exs = task.generate(n, seed)
        scores, strict = [], []
        for i in range(0, len(exs), batch_size):
            chunk = exs[i : i + batch_size]
            prompts = [encode_example(tok, ex)[0] for ex in chunk]
            for ex, row in zip(chunk, greedy_generate(model, tok, prompts, max_new_tokens, stop_ids)):
                text = tok.decode(row, skip_special_tokens=True)
                scores.append(task.score(text, ex))
                strict.append(task.score_strict(text, ex))
        results[name] = {"family": task.family, "n": len(scores), "score": sum(scores) / len(scores),
                         "score_strict": sum(strict) / len(strict)}
    return results
