"""Train the bundled tiny masked diffusion models on the project's synthetic tasks.

``dllm train-tiny --family llada|dream --out DIR`` builds the project tokenizer, trains a small LLaDA- or
Dream-format model with the masked-diffusion SFT objective (LLaDA's: mask each response token with
probability ``t ~ U(eps, 1)``, cross-entropy on masked tokens weighted by ``1/t``; Dream-format models
predict token ``i`` from hidden row ``i - 1``) and writes a checkpoint in the real format.

The response is the answer, the end-of-turn token, then EOS padding up to the response length, so decoding
learns to close the answer with EOT and fill the tail with EOS, as LLaDA's SFT data does.

``--family sdar|llada2|fastdllm2`` trains a block-diffusion checkpoint instead (SDAR's, LLaDA2's or Fast-dLLM v2's
layout, usually from the bundled autoregressive model with ``--init-from-ar``): the objective of
:mod:`dllm.tiny.block`.
"""

from __future__ import annotations

import json
import logging
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from dllm.blockdiff import two_copy_inputs
from dllm.evals import tasks as T
from dllm.models.loading import save_pretrained
from dllm.models.spec import SPECS
from dllm.models.transformer import Transformer, TransformerConfig
from dllm.models.weights import init_weights
from dllm.tiny import block

log = logging.getLogger(__name__)

RESPONSE_LENGTHS = (32, 32, 32, 64)


@dataclass(frozen=True)
class TrainConfig:
    family: str = "llada"
    d_model: int = 192
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # default: n_heads (LLaDA) / n_heads // 2 (Dream, GQA like the real model)
    mlp_hidden: int = 512
    steps: int = 4000
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    examples_per_task: int = 4000  # fixed pool per task; 0: fresh examples streamed from new seeds (ExampleStream)
    multi_turn: float = 0.6  # fraction of prompts that carry the worked example turn (stages may lower it)
    seed: int = 0
    threads: int | None = None
    time_budget_s: float | None = None  # stop early (cosine schedule still spans `steps`)
    eps: float = 1e-3
    task_curriculum: bool = True  # CURRICULUM: copy, then copy/reverse, then list operations, then every task
    loss: str = "weighted"  # "weighted": LLaDA's 1/t-weighted sum over masked tokens; "mean": plain masked mean
    list_item_tokens: bool = False  # tokenizer layout with one token per list item (tokenizer.SPLIT_PATTERN)
    tokenizer_layout: str | None = None  # "gpt2" | "list-items" | "names" (tokenizer.LAYOUTS); None: from list_item_tokens
    decay_from: float = 0.75  # learning rate constant after warmup until this progress, then cosine decay
    init_from: str | None = None  # continue from an existing checkpoint of the same family and shape
    shuffle_targets: str = "random"  # training target of waiting_line/shuffle: "random" | "rotation" (rotation_targets)
    edit_targets: str = "random"  # training target of the *_random edits: "random" | "last" (last_edit_targets)
    init_from_ar: str | None = None  # start from a causal LM checkpoint of the same shape (train_ar)
    block_size: int | None = None  # block-diffusion families (sdar, llada2, fastdllm2): the block size; None: the family's
    task_mix: str = "uniform"  # "uniform": every task of a stage equally; "family": each family equally, then its
    # tasks; "adaptive": like "family", each task weighted by adaptive_floor + (1 - its last periodic eval score)
    adaptive_floor: float = 0.1
    curriculum_name: str = "bare"  # which staged curriculum (CURRICULA) when task_curriculum is on
    save_every: int = 0  # also write the checkpoint every this many steps (0: only at the end)
    tie_embeddings: bool = False  # output head shares the input embedding (LLaDA weight_tying / Dream tie_word_embeddings)
    tasks: str | None = None  # fnmatch pattern: train on these tasks only (no curriculum); None: every task
    eval_every: int = 0  # greedy one-token-per-step evaluation on held-out examples every N steps (0: never)
    eval_n: int = 8  # examples per task in that evaluation
    eval_seed: int = 777  # its data seed (the reported evaluation uses 12345, training data never these)


def encode_example(tok, ex: T.Example, with_example: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids); ``with_example=False`` drops the worked example turn (single-turn prompt)."""
    from dllm.tiny.tokenizer import chat_text

    messages = ex.messages if with_example else ex.messages[-1:]
    prompt = tok(chat_text(tok, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    answer = tok(ex.target, add_special_tokens=False)["input_ids"]
    return prompt, answer


SHUFFLE_TARGETS = ("random", "rotation")


def rotation_targets(exs: list[T.Example], seed: int) -> list[T.Example]:
    """``waiting_line/shuffle`` examples with the training target replaced by a cyclic rotation of the input
    list by ``r`` places, ``r`` drawn uniformly from ``1 .. n - 1`` (seeded): still a valid shuffle (same names,
    a different order), and still a multi-answer target (``n - 1`` modes: parallel decoding can mix two
    rotations), but one that a committed name pins down, unlike a uniformly random permutation. The prompt
    (and its worked example) is unchanged; other tasks' examples are returned as they are."""
    rng = random.Random(seed)
    out = []
    for ex in exs:
        if ex.task == "waiting_line/shuffle":
            names = list(ex.answer["input"])
            r = rng.randint(1, len(names) - 1)
            ex = replace(ex, answer={**ex.answer, "example": T.list_to_str(names[r:] + names[:r])})
        out.append(ex)
    return out


EDIT_TARGETS = ("random", "last")


def last_edit_targets(exs: list[T.Example]) -> list[T.Example]:
    """``waiting_line/{insert,remove,replace}_random`` examples with the training target replaced by the edit
    at the last position (the new name appended, the last name removed, the last name replaced): one of the
    answers the task's scorer accepts, always the same one, so the target is no longer multi-answer. The
    prompt (and its worked example) is unchanged; other tasks' examples are returned as they are."""
    out = []
    for ex in exs:
        if ex.task in ("waiting_line/insert_random", "waiting_line/remove_random", "waiting_line/replace_random"):
            names = list(ex.answer["input"])
            if ex.task == "waiting_line/insert_random":
                edited = names + [ex.answer["word"]]
            elif ex.task == "waiting_line/remove_random":
                edited = names[:-1]
            else:
                edited = names[:-1] + [ex.answer["word"]]
            ex = replace(ex, answer={**ex.answer, "example": T.list_to_str(edited)})
        out.append(ex)
    return out


def training_examples(name: str, n: int, seed: int, shuffle_targets: str = "random",
                      edit_targets: str = "random") -> list[T.Example]:
    """``n`` seeded examples of task ``name`` with the training targets ``shuffle_targets`` and
    ``edit_targets`` ask for."""
    exs = T.generate(name, n, seed)
    if shuffle_targets == "rotation":
        exs = rotation_targets(exs, seed)
    return last_edit_targets(exs) if edit_targets == "last" else exs


BARE_COPY = "bare/copy"
STREAM_SEED_BASE = 1_000_000  # streamed chunks use seeds >= this, never the evaluation seeds


class ExampleStream:
    """Fresh encoded training examples of one task: seeded chunks generated on demand, each chunk seed used
    once (``STREAM_SEED_BASE * (seed + 1) + k`` for the k-th chunk). ``draw(turn)`` returns the next example
    without (turn 0) or with (turn 1) the worked example turn, like a pool entry of :func:`build_pools`."""

    def __init__(self, tok, name: str, seed: int, chunk: int = 256, eot_id: int | None = None,
                 shuffle_targets: str = "random", edit_targets: str = "random"):
        self.tok, self.name, self.chunk, self.eot_id = tok, name, chunk, eot_id
        self.shuffle_targets, self.edit_targets = shuffle_targets, edit_targets
        self.seed0 = STREAM_SEED_BASE * (seed + 1)
        self.k, self.buf, self.pos = 0, [], 0

    def _refill(self):
        source = "waiting_line/copy" if self.name == BARE_COPY else self.name
        self.buf = training_examples(source, self.chunk, self.seed0 + self.k, self.shuffle_targets, self.edit_targets)
        self.pos = 0
        self.k += 1

    def draw(self, turn: int) -> tuple[list[int], list[int]]:
        if self.pos >= len(self.buf):
            self._refill()
        ex = self.buf[self.pos]
        self.pos += 1
        if self.name == BARE_COPY:
            _, a = encode_example(self.tok, ex, with_example=False)
            return a + [self.eot_id], a
        return encode_example(self.tok, ex, with_example=bool(turn))


def build_pools(tok, n_per_task: int, seed: int, eot_id: int | None = None,
                shuffle_targets: str = "random", edit_targets: str = "random") -> dict[str, tuple[list, list]]:
    """Per task, encoded training examples once without and once with the worked example turn (the
    evaluation prompts carry it; plain one-turn prompts such as ``dllm generate "Please copy the list
    exactly: ..."`` work too). With ``eot_id``, also :data:`BARE_COPY`: the list alone, then end-of-turn, as
    the prompt, and the same list as the answer (no instruction, no chat template; the warm-up stage)."""
    pools = {}
    for name in T.task_names():
        exs = training_examples(name, n_per_task, seed, shuffle_targets, edit_targets)
        pools[name] = ([encode_example(tok, ex, with_example=False) for ex in exs],
                       [encode_example(tok, ex, with_example=True) for ex in exs])
    if eot_id is not None:
        bare = [(a + [eot_id], a) for _, a in pools["waiting_line/copy"][0]]
        pools[BARE_COPY] = (bare, bare)
    return pools


@dataclass(frozen=True)
class Stage:
    """One curriculum stage: the tasks in the mix, the share of prompts with the worked example turn (``None``:
    the config's ``multi_turn``), and when to move on: once the running accuracy on masked answer tokens
    reaches ``advance_acc``, or at progress ``until`` at the latest."""

    tasks: tuple[str, ...]
    multi_turn: float | None
    advance_acc: float | None
    until: float


# Copying from the prompt is an abrupt transition (masked answer-token accuracy jumps from the ~0.54 that the
# list format alone gives to ~0.9 within ~100 steps). In the 13-task mix, and even on chat-formatted copy
# prompts alone, it did not happen within ~1,000 steps on this CPU; on bare lists (the list, end-of-turn, the
# same list to recover) a small model gets there in ~1,300 steps (docs/tiny-models.md). So training starts
# on bare lists, then moves to chat-formatted copy, and each stage lasts until its tasks are learned (or
# its time is up).
CURRICULUM = (
    Stage((BARE_COPY,), 0.0, 0.85, 0.3),
    Stage(("waiting_line/copy",), 0.0, 0.85, 0.4),
    Stage(("waiting_line/copy", "waiting_line/reverse"), None, 0.85, 0.5),
    Stage(("waiting_line/*",), None, 0.8, 0.65),
    Stage(("*",), None, None, 1.0),
)
# Single-turn chat-formatted copy first (the setting where the copy transition came fastest, see
# docs/tiny-models.md), then the list operations, then every task.
CHAT_FIRST = (
    Stage(("waiting_line/copy",), 0.0, 0.9, 0.3),
    Stage(("waiting_line/copy", "waiting_line/reverse"), None, 0.85, 0.4),
    Stage(("waiting_line/*",), None, 0.8, 0.55),
    Stage(("*",), None, None, 1.0),
)
ALL_TASKS = (Stage(("*",), None, None, 1.0),)
CURRICULA = {"bare": CURRICULUM, "chat": CHAT_FIRST}
TASK_MIXES = ("uniform", "family", "adaptive")


def stage_tasks(stage: Stage) -> list[str]:
    return [n for pat in stage.tasks for n in ([pat] if pat == BARE_COPY else T.task_names(pat))]


def task_sampler(names: list[str], mix: str, scores: dict[str, float] | None = None, floor: float = 0.1):
    """A function of an RNG that draws a task name: uniformly; a family uniformly then one of its tasks
    (``family``); or ``adaptive``: each family the same total weight, split over its tasks in proportion to
    ``floor + 1 - score`` (``scores``: the last periodic evaluation, 0 for tasks not yet evaluated), so steps
    go to the tasks not yet solved while solved ones keep being rehearsed."""
    if mix not in TASK_MIXES:
        raise ValueError(f"unknown task mix {mix!r}; known: {', '.join(TASK_MIXES)}")
    if mix == "uniform":
        return lambda rng: rng.choice(names)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(n.split("/", 1)[0] if n != BARE_COPY else "waiting_line", []).append(n)
    fams = list(groups.values())
    if mix == "family":
        return lambda rng: rng.choice(rng.choice(fams))
    scores = scores or {}
    flat, weights = [], []
    for tasks in fams:
        w = [floor + 1.0 - scores.get(n, 0.0) for n in tasks]
        flat += tasks
        weights += [x / sum(w) / len(fams) for x in w]
    return lambda rng: rng.choices(flat, weights)[0]


def make_batch(pool, idx, *, mask_id, eot_id, eos_id, pad_id, rng: random.Random, eps: float,
               block_size: int | None = None):
    """A left-padded batch of prompts and responses (answer, end-of-turn, EOS padding to one of
    ``RESPONSE_LENGTHS``) with response tokens masked: each row at its own ratio ``t ~ U(eps, 1)`` (``t``:
    ``[B]``), or with ``block_size`` each block of each row at its own ratio (``t``: ``[B, R]``, per token;
    :func:`dllm.tiny.block.block_mask`). Returns ``(noisy, valid, target, masked, t, P)``."""
    items = [pool[i] for i in idx]
    need = max(len(a) + 1 for _, a in items)
    choices = [r for r in RESPONSE_LENGTHS if r >= need] or [need]
    R = rng.choice(choices)
    P = max(len(p) for p, _ in items)
    B = len(items)
    x = torch.full((B, P + R), pad_id, dtype=torch.long)
    valid = torch.ones((B, P + R), dtype=torch.bool)
    for b, (p, a) in enumerate(items):
        x[b, P - len(p) : P] = torch.tensor(p)
        valid[b, : P - len(p)] = False
        resp = a + [eot_id] + [eos_id] * (R - len(a) - 1)
        x[b, P:] = torch.tensor(resp)
    if block_size is not None:
        masked, t = block.block_mask(valid, P, block_size, eps)
    else:
        t = torch.rand(B) * (1 - eps) + eps
        masked = torch.rand(B, R) < t[:, None]
    target = x[:, P:].clone()
    noisy = x.clone()
    noisy[:, P:] = torch.where(masked, torch.full_like(target, mask_id), target)
    return noisy, valid, target, masked, t, P


def _check_init_from_ar(cfg: TrainConfig, tok) -> dict:
    """Validate ``cfg.init_from_ar`` against the run (family, shape, vocabulary); return the AR config."""
    if cfg.init_from:
        raise ValueError("give either init_from (a dLLM checkpoint) or init_from_ar (a causal LM), not both")
    from dllm.models.loading import read_config

    ar_dir = Path(cfg.init_from_ar)
    c = read_config(ar_dir)
    want = {"hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "intermediate_size": cfg.mlp_hidden, "vocab_size": len(tok)}
    bad = {k: (c.get(k), v) for k, v in want.items() if c.get(k) != v}
    if bad:
        raise ValueError(f"init_from_ar {ar_dir}: shape differs from this run ({', '.join(f'{k}: checkpoint {a}, run {b}' for k, (a, b) in bad.items())}); "
                         "train with the checkpoint's --d-model/--layers/--heads/--mlp and tokenizer layout")
    if cfg.n_kv_heads is not None and c.get("num_key_value_heads", cfg.n_heads) != cfg.n_kv_heads:
        raise ValueError(f"init_from_ar {ar_dir}: {c.get('num_key_value_heads')} key/value heads, the run asks {cfg.n_kv_heads}")
    if c.get("tie_word_embeddings", False) != cfg.tie_embeddings:
        raise ValueError(f"init_from_ar {ar_dir}: tie_word_embeddings is {c.get('tie_word_embeddings', False)}; "
                         f"train with{'' if c.get('tie_word_embeddings') else 'out'} --tie-embeddings to match")
    tok_file = ar_dir / "tokenizer.json"
    if tok_file.exists():
        ar_vocab = json.loads(tok_file.read_text())["model"]["vocab"]
        run_vocab = tok.get_vocab()
        if any(run_vocab.get(k) != v for k, v in ar_vocab.items()):
            raise ValueError(f"init_from_ar {ar_dir}: its tokenizer's vocabulary differs from this run's; use the "
                             "same tokenizer layout (--tokenizer-layout) for both")
    return c


def load_ar_weights(model: Transformer, ar_dir) -> None:
    """Initialise ``model`` from a Llama/Qwen2-style causal LM checkpoint of the same shape.

    Dream's own recipe: start from an autoregressive model, then adapt with the masked-diffusion loss; the
    shifted logits keep the next-token head. A LLaDA-format model takes the same tensors (the layer maps are
    the same; LLaDA has no QKV biases), but its unshifted head predicts the token at the position itself, so
    the adaptation must also learn to move the prediction one position right. The causal LM is read with
    Qwen2/Llama tensor names (the Dream spec's map); QKV biases it does not have start at zero; an untied run
    without ``lm_head.weight`` starts its head from the embedding."""
    from safetensors.torch import load_file

    from dllm.models.loading import weight_files

    sd: dict[str, torch.Tensor] = {}
    for f in weight_files(Path(ar_dir)):  # model.safetensors or the shards of its index
        sd.update(load_file(str(f)))
    state = model.state_dict()
    new = {}
    for ours, theirs in SPECS["dream"].key_map(model.config).items():
        if theirs in sd:
            t = sd[theirs]
        elif ours.endswith(".bias"):
            t = torch.zeros_like(state[ours])
        elif ours == "head.weight" and "model.embed_tokens.weight" in sd:
            t = sd["model.embed_tokens.weight"]
        else:
            raise ValueError(f"init_from_ar {ar_dir}: the checkpoint has no tensor {theirs!r}")
        if tuple(t.shape) != tuple(state[ours].shape):
            raise ValueError(f"init_from_ar {ar_dir}: {theirs} has shape {tuple(t.shape)}, the model needs "
                             f"{tuple(state[ours].shape)}")
        new[ours] = t.to(state[ours].dtype)
    model.load_state_dict(new, strict=not model.config.tie_embeddings)


def train(cfg: TrainConfig, out_dir, *, progress=None) -> dict:
    """Train and save; returns a summary dict (also written to ``out_dir/training.json``)."""
    from transformers import AutoTokenizer

    from dllm.tiny.tokenizer import build_tokenizer

    if cfg.loss not in LOSSES:
        raise ValueError(f"unknown loss {cfg.loss!r}; known: {', '.join(LOSSES)}")
    if cfg.curriculum_name not in CURRICULA:
        raise ValueError(f"unknown curriculum {cfg.curriculum_name!r}; known: {', '.join(CURRICULA)}")
    if cfg.task_mix not in TASK_MIXES:
        raise ValueError(f"unknown task mix {cfg.task_mix!r}; known: {', '.join(TASK_MIXES)}")
    if cfg.task_mix == "adaptive" and not cfg.eval_every:
        raise ValueError("task_mix 'adaptive' weights tasks by the periodic evaluation: set eval_every > 0")
    if cfg.shuffle_targets not in SHUFFLE_TARGETS:
        raise ValueError(f"unknown shuffle_targets {cfg.shuffle_targets!r}; known: {', '.join(SHUFFLE_TARGETS)}")
    if cfg.edit_targets not in EDIT_TARGETS:
        raise ValueError(f"unknown edit_targets {cfg.edit_targets!r}; known: {', '.join(EDIT_TARGETS)}")
    if cfg.tasks is not None and not T.task_names(cfg.tasks):
        raise ValueError(f"no task matches {cfg.tasks!r}; known tasks: {', '.join(T.task_names())}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    out_dir = Path(out_dir)
    spec = SPECS[cfg.family]
    blockwise = block.is_block_family(cfg.family)
    if cfg.block_size is not None and not blockwise:
        raise ValueError(f"block_size applies to the block-diffusion families ({', '.join(block.BLOCK_FAMILIES)}), "
                         f"not {cfg.family!r}")
    # the block-diffusion families use the Qwen-style (Dream) chat template and mask token of the tiny vocabulary;
    # built aside: out_dir is written only by the first save, after the checks of init_from / init_from_ar below
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = build_tokenizer(tmp, "dream" if blockwise else cfg.family, list_items=cfg.list_item_tokens,
                                  layout=cfg.tokenizer_layout)
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = {
        "mask_id": tok.mask_token_id if blockwise else tok.convert_tokens_to_ids(spec.mask_token),
        "eot_id": tok.convert_tokens_to_ids(spec.eot_token),
        "eos_id": tok.convert_tokens_to_ids("<|endoftext|>"),
    }
    if not isinstance(ids["eot_id"], int) or ids["eot_id"] == tok.unk_token_id:
        ids["eot_id"] = ids["eos_id"]  # LLaDA2's <|role_end|> is not in the tiny vocabulary: EOS ends the answer
    ar_config = _check_init_from_ar(cfg, tok) if cfg.init_from_ar else None
    start = None
    if cfg.init_from:  # read once: its key/value heads (unless given) and, below, its weights
        from dllm.assets import model_path
        from dllm.models.loading import load_model

        start = load_model(model_path(cfg.init_from), dtype=torch.float32, tokenizer=False)
    kv = cfg.n_kv_heads or (cfg.n_heads if cfg.family == "llada" else max(1, cfg.n_heads // 2))
    if cfg.n_kv_heads is None and ar_config is not None:
        kv = ar_config.get("num_key_value_heads", cfg.n_heads)
    if cfg.n_kv_heads is None and start is not None:  # a continuation keeps its checkpoint's key/value heads
        kv = start.config.n_kv_heads
    dense = TransformerConfig(
        vocab_size=len(tok), d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=kv,
        mlp_hidden=cfg.mlp_hidden, max_seq_len=512, rope_theta=10000.0,
        norm_eps=1e-5 if cfg.family == "llada" else 1e-6, qkv_bias=cfg.family == "dream",
        tie_embeddings=cfg.tie_embeddings,
    )
    mcfg = dense
    if blockwise:
        mcfg = block.model_config(cfg.family, vocab_size=len(tok), d_model=cfg.d_model, n_layers=cfg.n_layers,
                                  n_heads=cfg.n_heads, n_kv_heads=kv, mlp_hidden=cfg.mlp_hidden,
                                  tie_embeddings=cfg.tie_embeddings, block_size=cfg.block_size)
    model = Transformer(mcfg, spec)
    init_weights(model)
    if start is not None:
        def explicit(c):  # a loaded config names its head size (SDAR's head_dim); a fresh one may leave it implied
            return replace(c, head_size=c.head_dim)

        theirs, ours = asdict(explicit(start.config)), asdict(explicit(mcfg))
        diff = [f"{k}: checkpoint {theirs.get(k)!r}, run {v!r}" for k, v in ours.items() if theirs.get(k) != v]
        if start.spec.family != spec.family:
            diff.insert(0, f"family: checkpoint {start.spec.family!r}, run {spec.family!r}")
        if diff:
            raise ValueError(f"--init-from {cfg.init_from}: the checkpoint differs from this run ({'; '.join(diff)}); "
                             "train with the checkpoint's --family, --d-model/--layers/--heads/--mlp, "
                             "--tie-embeddings, --block-size and tokenizer layout")
        model.load_state_dict(start.state_dict())
    if cfg.init_from_ar and blockwise:  # the causal LM's weights through a dense twin, then upcycled
        twin = Transformer(dense, SPECS["dream"])
        load_ar_weights(twin, cfg.init_from_ar)
        block.upcycle_dense(model, twin.state_dict(), seed=cfg.seed)
    elif cfg.init_from_ar:
        load_ar_weights(model, cfg.init_from_ar)
    model.mask_id, model.eos_id, model.pad_id, model.eot_id = ids["mask_id"], ids["eos_id"], ids["eos_id"], ids["eot_id"]
    if cfg.examples_per_task > 0:
        pools = build_pools(tok, cfg.examples_per_task, seed=cfg.seed + 1000, eot_id=ids["eot_id"],
                            shuffle_targets=cfg.shuffle_targets, edit_targets=cfg.edit_targets)

        def draw_example(name, turn):
            pool = pools[name][turn]
            return pool[rng.randrange(len(pool))]
    else:
        streams = {n: ExampleStream(tok, n, cfg.seed, eot_id=ids["eot_id"], shuffle_targets=cfg.shuffle_targets,
                                    edit_targets=cfg.edit_targets)
                   for n in [*T.task_names(), BARE_COPY]}

        def draw_example(name, turn):
            return streams[name].draw(turn)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    t0 = time.perf_counter()
    losses = []
    step = 0
    model.train()
    if cfg.tasks is not None:
        stages = (Stage((cfg.tasks,), None, None, 1.0),)
    else:
        stages = CURRICULA[cfg.curriculum_name] if cfg.task_curriculum else ALL_TASKS
    evals = []
    si, stage_log, accs = 0, [], []
    last_scores: dict[str, float] = {}
    # the current stage's tasks, resolved once per stage (and after each evaluation for the adaptive mix)
    draw = task_sampler(stage_tasks(stages[0]), cfg.task_mix, last_scores, cfg.adaptive_floor)
    for step in range(1, cfg.steps + 1):
        # Progress drives the schedules: steps done, or time used when a budget is set (so a budgeted run
        # still warms up, follows the curriculum and anneals to the end).
        frac = step / cfg.steps
        if cfg.time_budget_s:
            frac = max(frac, (time.perf_counter() - t0) / cfg.time_budget_s)
        while si < len(stages) - 1 and (frac >= stages[si].until or (
                stages[si].advance_acc is not None and len(accs) >= 50
                and sum(accs[-50:]) / 50 >= stages[si].advance_acc)):
            si += 1
            accs.clear()
            stage_log.append({"stage": si, "tasks": list(stages[si].tasks), "step": step,
                              "seconds": round(time.perf_counter() - t0, 1)})
            log.info("curriculum stage %d (%s) from step %d", si, ", ".join(stages[si].tasks), step)
            draw = task_sampler(stage_tasks(stages[si]), cfg.task_mix, last_scores, cfg.adaptive_floor)
        stage = stages[si]
        decay = max(0.0, (frac - cfg.decay_from) / (1 - cfg.decay_from)) if cfg.decay_from < 1 else 0.0
        lr = cfg.lr * min(1.0, step / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(decay, 1.0)))
        for g in opt.param_groups:
            g["lr"] = max(lr, cfg.lr * 0.02)
        p_multi = cfg.multi_turn if stage.multi_turn is None else stage.multi_turn
        turn = 1 if rng.random() < p_multi else 0
        batch = [draw_example(draw(rng), turn) for _ in range(cfg.batch_size)]
        noisy, valid, target, masked, t, P = make_batch(
            batch, range(len(batch)), mask_id=ids["mask_id"], eot_id=ids["eot_id"], eos_id=ids["eos_id"], pad_id=ids["eos_id"],
            rng=rng, eps=cfg.eps, block_size=mcfg.block_size if blockwise else None)
        if blockwise:  # the noisy and the clean copy in one forward (dllm.tiny.block)
            clean = noisy.clone()
            clean[:, P:] = target
            logits = model(**two_copy_inputs(noisy, clean, valid, mcfg.block_size, P, model.shift_logits))
        else:
            cols = torch.arange(P, noisy.shape[1]).expand(noisy.shape[0], -1)
            logits = model(noisy, attn_mask=None if bool(valid.all()) else valid, logits_idx=cols)
        loss = masked_diffusion_loss(logits, target, masked, t, cfg.loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        answer = masked & (target != ids["eos_id"])  # masked answer tokens (the EOS padding is trivial)
        accs.append(float(((logits.argmax(-1) == target) & answer).sum()) / max(1, int(answer.sum())))
        if step % 50 == 0:
            if progress is not None:
                progress(step, sum(losses[-50:]) / 50, time.perf_counter() - t0)
            log.info("step %d stage %d masked answer accuracy %.3f lr %.2e", step, si, sum(accs[-50:]) / max(1, len(accs[-50:])), lr)
        if cfg.eval_every and step % cfg.eval_every == 0:
            evals.append(periodic_eval(model, tok, cfg, step, time.perf_counter() - t0))
            model.train().requires_grad_(True)
            last_scores = evals[-1]["tasks"]
            if cfg.task_mix == "adaptive":
                draw = task_sampler(stage_tasks(stages[si]), cfg.task_mix, last_scores, cfg.adaptive_floor)
        if cfg.save_every and step % cfg.save_every == 0 and frac < 1.0:
            _save(model, tok, out_dir, cfg, mcfg, step, t0, losses, accs, stage_log, evals)
            model.train().requires_grad_(True)
        if frac >= 1.0:
            break
    return _save(model, tok, out_dir, cfg, mcfg, step, t0, losses, accs, stage_log, evals)


def periodic_eval(model, tok, cfg: TrainConfig, step: int, seconds: float) -> dict:
    """Greedy one-token-per-step accuracy (the model's baseline sampler, gen 32) on ``cfg.eval_n`` held-out
    examples per task of seed ``cfg.eval_seed``; logged and returned as a record for training.json."""
    from dllm.config import GenerateConfig
    from dllm.evals.runner import evaluate_tasks, family_average

    model.eval()
    model.tokenizer = tok
    with torch.no_grad():
        res = evaluate_tasks(model, T.task_names(cfg.tasks), cfg.eval_n, cfg.eval_seed,
                             GenerateConfig(gen_length=32, block_length=32, steps=32), batch_size=64)
    fam = family_average(res)
    rec = {"step": step, "seconds": round(seconds, 1), "family_mean": round(fam["mean"], 4),
           "families": {k: round(v, 4) for k, v in fam.items() if k != "mean"},
           "tasks": {r.task: round(r.score, 4) for r in res}}
    log.info("eval step %d family mean %.3f %s | %s", step, fam["mean"],
             " ".join(f"{k} {v:.2f}" for k, v in rec["families"].items()),
             " ".join(f"{t.split('/')[-1]} {v:.2f}" for t, v in rec["tasks"].items()))
    return rec


def _save(model, tok, out_dir, cfg, mcfg, step, t0, losses, accs, stage_log, evals=()) -> dict:
    model.eval().requires_grad_(False)
    model.tokenizer = tok
    save_pretrained(model, out_dir, dtype=torch.float32)
    summary = {
        "train_config": asdict(cfg),
        "model_config": asdict(mcfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps_done": step,
        "train_seconds": round(time.perf_counter() - t0, 1),
        "final_loss": sum(losses[-50:]) / max(1, len(losses[-50:])),
        "final_masked_answer_accuracy": sum(accs[-50:]) / max(1, len(accs[-50:])),
        "curriculum": stage_log,
        "evals": list(evals),
    }
    (out_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


LOSSES = ("weighted", "mean")


def masked_diffusion_loss(logits, target, masked, t, kind: str = "weighted") -> torch.Tensor:
    """Cross-entropy on the masked response tokens. ``weighted``: LLaDA's estimator, each masked token's loss
    over its mask ratio ``t`` (``[B]`` per row or ``[B, R]`` per token), summed and divided by the number of response tokens (an upper bound on
    the negative log-likelihood; high variance at small ``t``). ``mean``: the plain mean over masked tokens."""
    if kind not in LOSSES:
        raise ValueError(f"unknown loss {kind!r}; known: {', '.join(LOSSES)}")
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    ce = ce.view_as(target) * masked
    if kind == "mean":
        return ce.sum() / masked.sum().clamp(min=1)
    return (ce / (t if t.dim() == 2 else t[:, None])).sum() / target.numel()
