"""Random-weight checkpoints with the real LLaDA / Dream vocabularies and special ids, for golden fixtures.

The weights are rebuilt from a seed on both sides (recording script and test) and never stored; a fixture
keeps :func:`golden_common.state_sha256` of them so a change of this builder is detected.

Shape: ``d_model`` 32, 2 layers, the published vocabulary sizes (LLaDA 126,464; Dream 152,064). To make
the decoding non-trivial the logits get a per-token bias through a constant feature: embedding column 0
holds a large constant, so after the final RMSNorm feature 0 is nearly constant and head column 0 acts as a
bias. Most of the vocabulary gets a strongly negative bias (so confidences are not spread over 126k ids),
a few hundred realistic ids are "active", and the mask and EOS/EOT (im_end) ids get biases that make
``p(mask)`` about 1e-3..1e-2 and EOS/EOT proposed at a fair share of positions.

Every random value comes from integers (:func:`_int_normal`: ``torch.randint`` sums times one constant;
``torch.randperm`` for the active ids), so the same seed gives the same bits on every CPU, whatever its SIMD
kernels (``torch.randn`` does not: its AVX2 and scalar kernels give other bits).
"""

from __future__ import annotations

import torch

from dllm.models import DREAM, LLADA, Transformer, TransformerConfig

N_ACTIVE = 400  # ids below the special range that the model proposes
CONST = 6.0  # embedding column 0 (the constant feature)
QK_SCALE = 3.0  # peaky, position-dependent attention so masked positions differ
OUT_SCALE = 1.5
EXTRA_BIAS = 6.0  # head bias of ``extra_active`` ids: the argmax at roughly one masked position in eight


def _active_ids(g: torch.Generator, n_regular: int) -> torch.Tensor:
    return torch.randperm(n_regular, generator=g)[:N_ACTIVE].sort().values


def _build(family: str, seed: int, extra_active: tuple[int, ...] = ()) -> Transformer:
    spec = LLADA if family == "llada" else DREAM
    vocab = 126464 if family == "llada" else 152064
    cfg = TransformerConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4,
                            n_kv_heads=4 if family == "llada" else 2, mlp_hidden=64,
                            qkv_bias=family == "dream", max_seq_len=1024, rope_theta=10000.0)
    g = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        model = Transformer(cfg, spec)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.copy_(_int_normal(g, p.shape, 0.1))
            elif name in ("embed.weight", "head.weight"):
                continue
            else:
                scale = QK_SCALE if name.split(".")[-2] in ("q", "k") else OUT_SCALE
                p.copy_(_int_normal(g, p.shape, scale / p.shape[1] ** 0.5))
        for layer in model.layers:  # keep feature 0 constant through the residual stream
            layer.o.weight[0].zero_()
            layer.down.weight[0].zero_()
        d = cfg.d_model
        emb = _int_normal(g, (vocab, d), 1.0)
        emb[:, 0] = CONST
        model.embed.weight.copy_(emb)
        first_special = min(spec.mask_id, spec.eos_id, spec.eot_id)
        if family == "llada":
            first_special = 126080  # <|startoftext|>; LLaDA's special ids start here
        active = _active_ids(g, first_special)
        if extra_active:  # these ids replace the last active ones (the random stream is unchanged)
            extra = torch.tensor(sorted(set(extra_active)), dtype=torch.long)
            if len(extra) > N_ACTIVE or not bool(((extra >= 0) & (extra < first_special)).all()):
                raise ValueError(f"extra active ids must be at most {N_ACTIVE} regular ids below {first_special}, "
                                 f"got {list(extra_active)}")
            rest = active[~torch.isin(active, extra)]
            active = torch.cat([rest[: N_ACTIVE - len(extra)], extra]).sort().values
        # Head: column 0 (bias through the constant feature) + random directions for the active ids.
        head = torch.zeros(vocab, d)
        head[:, 0] = -2.5  # background bias; the normalised constant feature is about 4
        head[active, 1:] = _int_normal(g, (N_ACTIVE, d - 1), 0.9)
        head[active, 0] = 0.0
        for tid, bias, scale in ((spec.mask_id, 6.0, 0.25), (spec.eos_id, 8.0, 0.7), (spec.eot_id, 7.0, 0.7)):
            head[tid, 1:] = _int_normal(g, (d - 1,), scale)
            head[tid, 0] = bias
        if extra_active:  # proposed at some positions, with a confidence that varies (a reference's delimiters)
            head[extra, 0] = EXTRA_BIAS
        model.head.weight.copy_(head)
    model.eval().requires_grad_(False)
    model.mask_id, model.eos_id, model.eot_id, model.pad_id = spec.mask_id, spec.eos_id, spec.eot_id, spec.pad_id
    return model


def shaped_llada(seed: int = 0) -> Transformer:
    """LLaDA-shaped random model: vocab 126,464, mask 126,336, EOS 126,081, EOT 126,348 (fp32, CPU)."""
    return _build("llada", seed)


def shaped_dream(seed: int = 0) -> Transformer:
    """Dream-shaped random model: vocab 152,064, mask 151,666, EOS 151,643, im_end 151,645 (fp32, CPU)."""
    return _build("dream", seed)


def shaped_model(family: str, seed: int = 0, active: tuple[int, ...] | list[int] = ()) -> Transformer:
    """The shaped model of ``family``. ``active``: regular ids the model must propose at some masked positions
    (e.g. a reference's hard-coded delimiter ids): they take the place of other active ids and get a head bias
    (:data:`EXTRA_BIAS`); without it the weights are those of :func:`shaped_llada` / :func:`shaped_dream`."""
    if family not in ("llada", "dream"):
        raise ValueError(f"unknown shaped family {family!r}; use 'llada' or 'dream'")
    return _build(family, seed, tuple(active))


def shaped_prompts(family: str, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Realistic prompt ids: random ids below the special range, one list per length."""
    limit = 126080 if family == "llada" else 151643
    g = torch.Generator().manual_seed(10_000 + seed)
    return [torch.randint(0, limit, (n,), generator=g).tolist() for n in lengths]


TINY_VOCAB = 1197  # the bundled tokenizer's (dream-tiny)


def sdar_tiny(seed: int = 0, block_size: int = 4, bias: bool = False) -> Transformer:
    """A random-weight SDAR-format model (Qwen3 block-diffusion layout: QK norms, head_dim 24 with d_model 64,
    GQA 4/2; QKV and output biases with ``bias``; :func:`_integer_block_model`). Save it with
    ``dllm.save_pretrained`` for a checkpoint in SDAR's published layout."""
    from dllm.models.spec import SDAR

    cfg = TransformerConfig(vocab_size=TINY_VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            mlp_hidden=128, max_seq_len=512, rope_theta=10000.0, norm_eps=1e-6, head_size=24,
                            qk_norm=True, block_size=block_size, qkv_bias=bias, out_bias=bias)
    return _integer_block_model(cfg, SDAR, seed, SDAR_EOS_LIKE, SDAR_MASK_LIKE)


# ------------------------------------------------------------------ block models without float-dependent steps
# The builders below make their weights from integers and single float multiplications only, so that the same
# seed gives the same bits on every CPU: torch.randn's kernels differ with the CPU's SIMD width (its AVX2 kernel and
# its scalar one give other bits), a mean is a reduction whose summation order differs with it, and a float
# forward's argmax may flip between the two.
_INT_NORMAL_SPREAD = (4 * (255**2 - 1) / 12) ** 0.5  # the standard deviation of a sum of 4 uniform ints in [-127, 127]


def _int_normal(g: torch.Generator, shape, std: float) -> torch.Tensor:
    """Normal-like float32 values (mean 0, standard deviation ``std``) from integers alone: the sum of four uniform
    integers in [-127, 127] (exact), times one constant (one correctly rounded multiplication per value)."""
    ints = torch.randint(-127, 128, (4, *shape), generator=g).sum(0)
    return ints.to(torch.float32) * (std / _INT_NORMAL_SPREAD)


def _integer_block_model(cfg: TransformerConfig, spec, seed: int, eos_like: int, mask_like: int,
                         expert_bias: bool = False) -> Transformer:
    """A random-weight model of ``spec`` on the bundled Qwen-style tokenizer of ``dream-tiny``, built without
    float-dependent steps (:func:`_int_normal`): the layout of ``init_weights(std=0.2)`` (residual projections
    scaled by ``1/sqrt(2 n_layers)``), norm weights ``1 + 0.1 N`` and biases ``0.1 N`` so that a misplaced norm or
    bias shows, an expert bias ``0.05 N`` (``expert_bias``); then EOS and the mask token made real contenders by an
    integer rule: EOS takes the head row of ``eos_like`` scaled by 1.02 (it wins where that token won), the mask token
    the row of ``mask_like`` scaled by 0.97. The builders pass ids that the model proposes often when it decodes the
    recording scripts' prompts (found once by decoding, then fixed here: choosing them from a float forward at build
    time would make the weights depend on the CPU's kernels)."""
    import dllm

    tok_model = dllm.load_model("dream-tiny", dtype="float32")
    assert cfg.vocab_size == tok_model.config.vocab_size, "TINY_VOCAB is the bundled tokenizer's vocabulary size"
    g = torch.Generator().manual_seed(seed)
    m = Transformer(cfg, spec)
    std, n = 0.2, cfg.n_layers
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + _int_normal(g, p.shape, 0.1))
            elif name.endswith(".bias"):
                p.copy_(_int_normal(g, p.shape, 0.1))
            elif name.endswith(("o.weight", "down.weight")):
                p.copy_(_int_normal(g, p.shape, std / (2 * n) ** 0.5))
            else:
                p.copy_(_int_normal(g, p.shape, std))
        if expert_bias:
            for layer in m.layers:
                if hasattr(layer, "moe"):
                    layer.moe.expert_bias.copy_(_int_normal(g, layer.moe.expert_bias.shape, 0.05))
        for like in (eos_like, mask_like):
            if like in (tok_model.eos_id, tok_model.mask_id):
                raise ValueError(f"{like} is a special id; EOS and the mask token take the rows of regular ids")
        m.head.weight[tok_model.eos_id] = 1.02 * m.head.weight[eos_like]
        m.head.weight[tok_model.mask_id] = 0.97 * m.head.weight[mask_like]
    m.tokenizer = tok_model.tokenizer
    m.mask_id, m.eos_id, m.pad_id, m.eot_id = tok_model.mask_id, tok_model.eos_id, tok_model.pad_id, tok_model.eot_id
    return m.eval().requires_grad_(False)


# the rows EOS and the mask token take (:func:`_integer_block_model`): ids that the greedy decoding of the recording
# prompts proposed most often before EOS and the mask token took them
LLADA2_EOS_LIKE, LLADA2_MASK_LIKE = 377, 1103
FASTDLLM2_EOS_LIKE, FASTDLLM2_MASK_LIKE = 936, 610
SDAR_EOS_LIKE, SDAR_MASK_LIKE = 634, 690


def llada2_tiny(seed: int = 0, block_size: int = 4) -> Transformer:
    """A random-weight LLaDA2-format model (``llada2_moe``: fused QKV, QK norms, half the head rotary, one dense
    layer then 8 sigmoid-routed experts in 4 groups, 2 per token, one shared expert, a random expert bias;
    :func:`_integer_block_model`). Save it with ``dllm.save_pretrained`` for a checkpoint in LLaDA2's published
    layout."""
    from dllm.models.spec import LLADA2

    cfg = TransformerConfig(vocab_size=TINY_VOCAB, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                            mlp_hidden=128, max_seq_len=512, rope_theta=10000.0, norm_eps=1e-6, head_size=16,
                            qk_norm=True, fused_qkv=True, rope_dim=8, block_size=block_size, n_experts=8,
                            experts_per_token=2, n_shared_experts=1, moe_hidden=32, dense_layers=1, n_groups=4,
                            topk_groups=2, routed_scaling=2.5)
    return _integer_block_model(cfg, LLADA2, seed, LLADA2_EOS_LIKE, LLADA2_MASK_LIKE, expert_bias=True)


def llada21_tiny(seed: int = 0, block_size: int = 4) -> Transformer:
    """:func:`llada2_tiny` (LLaDA2.1 has LLaDA2.0's architecture) with the head scaled by 3, so that its greedy
    proposals are confident enough for LLaDA2.1's thresholds to matter: some above 0.9 (the default thresholds
    commit several masks and edit tokens), most below. Save it with ``dllm.save_pretrained``."""
    m = llada2_tiny(seed, block_size)
    with torch.no_grad():
        m.head.weight.mul_(3.0)
    return m


FASTDLLM2_STOP_TWIN = 406  # an id fastdllm2_tiny proposes often in greedy decoding (head scaled)


def fastdllm2_tiny(seed: int = 0, block_size: int = 8) -> Transformer:
    """A random-weight Fast-dLLM v2-format model (``Fast_dLLM_Qwen``: Qwen2.5 layout with QKV biases, GQA 4/2, head
    size 16, token shift; :func:`_integer_block_model`). Fast-dLLM v2 decodes greedily on softmax confidences, so
    the head is scaled by 4 (proposals confident enough that a threshold of 0.9 commits several at once), and
    <|im_end|>, the reference decoders' stop token, takes the head row of :data:`FASTDLLM2_STOP_TWIN` plus noise
    (:func:`_int_normal` with a standard deviation of 0.2, about 0.3 times the mean magnitude of a scaled head entry:
    it wins at some of the positions where that token would, and ends about half the greedy rows). Save it with
    ``dllm.save_pretrained`` for a checkpoint in Fast-dLLM v2's published layout."""
    from dllm.models.spec import FASTDLLM2

    cfg = TransformerConfig(vocab_size=TINY_VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            mlp_hidden=128, max_seq_len=512, rope_theta=10000.0, norm_eps=1e-6, qkv_bias=True,
                            block_size=block_size)
    m = _integer_block_model(cfg, FASTDLLM2, seed, FASTDLLM2_EOS_LIKE, FASTDLLM2_MASK_LIKE)
    with torch.no_grad():
        m.head.weight.mul_(4.0)
        twin = m.head.weight[FASTDLLM2_STOP_TWIN]
        m.head.weight[m.eot_id] = twin + _int_normal(torch.Generator().manual_seed(seed + 1), twin.shape, 0.2)
    return m
