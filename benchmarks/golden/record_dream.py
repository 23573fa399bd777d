"""Record golden trajectories of the Dream-family reference decoders (run locally; their code stays outside).

Each reference is a public repository; check it out at the commit named here and pass its root as
``--ref-dir``:

* ``dream``: Dream's ``diffusion_generate`` (``DreamGenerationMixin``; algorithms ``origin``, ``maskgit_plus``,
  ``topk_margin``, ``entropy``). The Dream repositories on GitHub (HKUNLP/Dream @ a1b4472, DreamLM/Dream @
  fac0a7f) ship no generation code: their demos load ``generation_utils.py`` from the model card
  (``Dream-org/Dream-v0-Instruct-7B``, ``trust_remote_code``). The file is run from a public verbatim copy,
  ZHZisZZ/dllm @ 03270de7d134f87244f1ffc2ff3653c809beb1d0, ``dllm/pipelines/dream/models/generation_utils.py``
  (its ``modeling_dream.py`` next to it is used for the logits check below).
* ``klass-dream``: shkim0116/KLASS @ ad87ecbe9fdef4a6e93701afbc150cb9213fbcd7, ``src/model/dream_klass.py``
  (``DreamGenerationMixin._sample`` with ``alg="klass"``).
* ``adablock-dream``: lgxi24/AdaBlock-dLLM @ 491b20580ad90f6019f29e045f484b538581101a,
  ``dream/model/generation_utils_adablock.py`` (``DreamGenerationMixin._sample_adablock``, bound as ``_sample``
  the way its ``dream/eval_dream_adablock.py`` does; ``alg="confidence_threshold"``).

Environment and commands: the transformers 4.49 venv of ``record_llada.py`` (the references subclass
transformers 4.x's ``GenerationConfig``); from the repository root, each command writes
``tests/fixtures/golden/<reference>_<model>.json``::

    export PYTHONPATH=. OMP_NUM_THREADS=1 PY=/path/to/refenv/bin/python
    $PY benchmarks/golden/record_dream.py dream --ref-dir /path/to/ZHZisZZ-dllm       # dream-generate_*
    $PY benchmarks/golden/record_dream.py klass-dream --ref-dir /path/to/KLASS        # klass-dream_*
    $PY benchmarks/golden/record_dream.py adablock-dream --ref-dir /path/to/AdaBlock-dLLM  # adablock-dream_*

Models: the bundled ``dream-tiny`` and the Dream-shaped random model of ``tests/golden_models.py`` (rebuilt from
its seed; for AdaBlock a variant whose active ids include Dream's newline ids, so that the reference's
hard-coded delimiters occur). The references call their model as ``self(x, attention_mask, tok_idx).logits``
and shift the logits themselves; they get dllm's Transformer behind a thin host class with the HF modeling
file's semantics (unshifted logits, ``tok_idx`` positions, the pairwise padding mask), after checking that its
logits equal those of the reference's own ``modeling_dream.py`` loaded with the same weights (a plain and a
left-padded batch). The host records the canvas before every forward; nothing changes the reference code.

Checks while recording (a failing one stops the script, so that no artefact enters a fixture): the reference
never commits the mask id (Dream's argmax / categorical draw may land on it, a no-op that dllm never makes):
for the confidence algorithms every forward commits exactly the schedule's ``int(m * (1 - s/t))`` tokens,
for ``origin`` exactly the positions its uniform draw revealed (replayed from the RNG state before the step).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import golden_common as gc  # noqa: E402
import golden_models as gm  # noqa: E402
import record_llada as rl  # noqa: E402

SHAPED_SEED = 0
# AdaBlock's Dream code hard-codes Qwen2 newline ids as delimiters; the shaped model for it proposes some of them
ADABLOCK_DREAM_DELIMITERS = (198, 271, 280, 319, 340, 382, 401, 532, 624, 630, 692, 698, 921, 1248, 1837, 1939, 2219,
                             2533, 3276, 3876, 4894, 5267, 14750, 68327)
ADABLOCK_SHAPED_ACTIVE = (198, 271, 280, 319, 340, 382)  # six: with three, no case adapted a block


def package(name: str, path: Path):
    """Register ``path`` as package ``name`` (the reference directory has no ``__init__.py`` of its own)."""
    if name not in sys.modules:
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)]
        sys.modules[name] = mod
    return sys.modules[name]


def dream_config(conf_mod, model):
    from dllm.models import DREAM

    hf = DREAM.config_to_hf(model.config, {"mask_id": model.mask_id, "eos_id": model.eos_id, "pad_id": model.pad_id})
    hf.pop("architectures", None)
    hf.pop("model_type", None)
    if conf_mod is None:  # a reference without a configuration file of its own
        from transformers import PretrainedConfig

        return PretrainedConfig(**hf)
    return conf_mod.DreamConfig(**hf)


def make_host(mixin, model, config, rows: int, sample=None):
    """A Dream "model" for the reference's generation mixin: ``self(x, attention_mask, tok_idx).logits`` as the
    HF modeling file computes it (logits at ``i`` from hidden row ``i``: the reference shifts them itself),
    with dllm's Transformer doing the work. Records the canvas before each forward; ``before_step(x, logits)``
    (shifted logits) runs right after each forward, before the reference samples."""

    class Host(mixin, torch.nn.Module):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.inner = model
            self.config = config
            self.rows = rows
            self.canvases: list[torch.Tensor] = []
            self.scores: list[torch.Tensor] = []
            self.before_step = None

        @property
        def device(self):
            return self.inner.device

        def forward(self, x, attention_mask=None, tok_idx=None, **_):
            self.canvases.append(x[: self.rows].detach().clone())
            B, T = x.shape
            if attention_mask is None or isinstance(attention_mask, str):
                am, pos = None, torch.arange(T).expand(B, T)
            else:  # [B, 1, T, T] pairwise mask; its last row (a generated position) is the key mask
                am, pos = attention_mask[:, 0, -1, :].bool(), tok_idx
            logits = self.inner(x, positions=pos, attn_mask=am, logits_idx=torch.arange(1, T + 1).expand(B, T))
            if self.before_step is not None:
                self.before_step(x, torch.cat([logits[:, :1], logits[:, :-1]], dim=1).detach())
            return SimpleNamespace(logits=logits)

    if sample is not None:
        Host._sample = sample
    return Host()


def check_logits(ref_pkg: str, model, host, padded: bool = True):
    """The host's logits equal the reference ``modeling_dream.DreamModel``'s on the same weights (a plain
    batch, and with ``padded`` the valid rows of a left-padded one), else stop."""
    from dllm.models import DREAM

    modeling = importlib.import_module(f"{ref_pkg}.modeling_dream")
    ref = modeling.DreamModel(host.config)
    km = DREAM.key_map(model.config)
    missing, unexpected = ref.load_state_dict({km[k]: v for k, v in model.state_dict().items() if k in km},
                                              strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k or not model.config.tie_embeddings]:
        raise SystemExit(f"loading our weights into the reference model: missing {missing}, unexpected {unexpected}")
    ref = ref.float().eval().requires_grad_(False)
    m = model.mask_id
    x = torch.tensor([[1, 2, 3, 4, m, m], [5, 6, 7, 8, 9, m]])
    rows, host.rows = host.rows, 2
    try:
        if not torch.equal(ref(x, "full", None).logits, host(x, "full", None).logits):
            raise SystemExit("the reference modeling file's logits differ from ours on the same weights")
        if not padded:
            return
        am = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        tok_idx = am.cumsum(-1) - 1
        tok_idx.masked_fill_(am == 0, 1)
        pair = torch.logical_and(am.bool()[:, None, None, :], am.bool()[:, None, :, None])
        a, b = ref(x, pair, tok_idx).logits, host(x, pair, tok_idx).logits
        if not (torch.equal(a[0, 2:], b[0, 2:]) and torch.equal(a[1], b[1])):
            raise SystemExit("the reference modeling file's logits differ from ours on a left-padded batch")
    finally:
        host.rows = rows
        host.canvases.clear()


# ------------------------------------------------------------------------------------ Dream diffusion_generate
def dream_schedule_check(mod, host, params, mask_id):
    """``before_step`` for ``diffusion_generate``: per forward, how many tokens each row must commit if the
    reference commits no mask id, and (tie check) the reference's confidence over the canvas. The uniform draw
    of ``origin`` and the categorical draws are replayed from a copy of the RNG state, which is restored."""
    alg, T = params["alg"], params.get("temperature", 0.0)
    top_p, top_k, S = params.get("top_p"), params.get("top_k"), params["steps"]
    eps = params.get("eps", 1e-3)
    ts = torch.linspace(1, eps, S + 1)
    expected: list[list[int]] = []

    def before(x, logits):
        i = len(expected)
        mi = x[: host.rows] == mask_id
        t, s = ts[i], ts[i + 1]
        state = torch.get_rng_state()
        try:
            if alg == "origin":
                p = 1 - s / t if i < S - 1 else 1
                reveal = torch.rand(int(mi.sum())) < p
                full = torch.zeros(mi.shape, dtype=torch.bool)
                full[mi] = reveal
                expected.append(full.sum(-1).tolist())
                return
            kw = dict(margin_confidence=alg == "topk_margin", neg_entropy=alg == "entropy")
            conf, _ = mod.sample_tokens(logits[: host.rows][mi], T, top_p=top_p, top_k=top_k, **kw)
        finally:
            torch.set_rng_state(state)
        m = mi.sum() / mi.shape[0]
        n = int(m * (1 - s / t)) if i < S - 1 else int(m)
        expected.append([n] * mi.shape[0])
        if not params.get("alg_temp"):
            full = torch.full(mi.shape, float("-inf"), dtype=conf.dtype)
            full[mi] = conf
            host.scores.append(full)

    return before, expected


def run_dream(mod, model, config, cid, rows, params):
    """One ``diffusion_generate`` call; ``params``: its keyword arguments (``max_new_tokens`` is the generation
    length) plus ``seed`` (global RNG) and ``attention_mask`` (pass the left-padding mask)."""
    host = make_host(mod.DreamGenerationMixin, model, config, len(rows))
    before, expected = dream_schedule_check(mod, host, params, model.mask_id)
    host.before_step = before
    ids, am = rl.left_pad(rows, model.pad_id)
    kw = {k: v for k, v in params.items() if k not in ("seed", "attention_mask")}
    torch.manual_seed(params.get("seed", 0))
    out = host.diffusion_generate(ids, attention_mask=am if params.get("attention_mask") else None,
                                  return_dict_in_generate=True, **kw)
    P = ids.shape[1]
    gen = out.sequences[:, P:]
    rl.check_no_mask(gen, model.mask_id, cid)
    rl.check_decoded_kept(host.canvases, gen, P, model.mask_id, cid)
    steps = gc.steps_from_canvases(host.canvases, gen, P, model.mask_id)
    got = [[len(r) for r in s] for s in steps]
    if got != expected:
        raise SystemExit(f"case {cid}: the reference committed {got} tokens per forward, its schedule {expected}: "
                         "it proposed the mask id somewhere (a no-op commit); choose another seed or prompt")
    G = params["max_new_tokens"]
    return rl.case_record(cid, rows, params, gen, host, P, model.mask_id, regions=[(0, G)] * len(steps))


def dream_cases(model, prompts, shaped: bool):
    G, S = (32, 16) if shaped else (16, 8)
    """Every case passes ``temperature``, ``top_p``, ``top_k`` and ``alg_temp`` explicitly: without them the
    reference takes them from ``DreamGenerationConfig.from_model_config(config)``, and under transformers 4.x
    a model config carries ``PretrainedConfig``'s generation defaults (``top_k=50``, ``top_p=1.0``)."""
    b = dict(max_new_tokens=G, steps=S, temperature=0.0, top_p=None, top_k=None, alg_temp=None)
    return [
        ("maskgit_plus", [prompts[0]], dict(b, alg="maskgit_plus")),
        ("topk_margin", [prompts[1]], dict(b, alg="topk_margin")),
        ("entropy", [prompts[2]], dict(b, alg="entropy")),
        ("origin_t0", [prompts[3]], dict(b, alg="origin", seed=5)),
        ("entropy_uneven", [prompts[0]], dict(b, max_new_tokens=G - 2, steps=S // 2 - 1, alg="entropy")),
        ("maskgit_plus_one_per_step", [prompts[1]], dict(b, max_new_tokens=G - 8, steps=G - 8, alg="maskgit_plus")),
        ("maskgit_plus_top_k_default", [prompts[3]], dict(b, alg="maskgit_plus", top_k=50)),
        ("origin_t07_top_p", [prompts[2]], dict(b, alg="origin", temperature=0.7, top_p=0.9, seed=3)),
        ("maskgit_plus_t09_top_p", [prompts[3]], dict(b, alg="maskgit_plus", temperature=0.9, top_p=0.95, seed=4)),
        ("topk_margin_t08_top_k", [prompts[0]], dict(b, alg="topk_margin", temperature=0.8, top_k=20, seed=6)),
        ("entropy_t04", [prompts[1]], dict(b, alg="entropy", temperature=0.4, seed=7)),
        ("maskgit_plus_alg_temp", [prompts[2]], dict(b, alg="maskgit_plus", alg_temp=0.5, seed=8)),
        ("topk_margin_alg_temp_t06", [prompts[3]], dict(b, alg="topk_margin", temperature=0.6, alg_temp=0.3, seed=9)),
        ("entropy_alg_temp", [prompts[0]], dict(b, alg="entropy", alg_temp=0.2, seed=10)),
        ("batch2_left_pad", [prompts[1], prompts[2]], dict(b, alg="maskgit_plus", attention_mask=True)),
        ("batch2_left_pad_t05", [prompts[3], prompts[0]], dict(b, alg="entropy", temperature=0.5, alg_temp=0.4,
                                                              attention_mask=True, seed=11)),
    ]


def record_dream(ref_dir: Path):
    root = ref_dir / "dllm" / "pipelines" / "dream" / "models"
    package("ref_dream", root)
    mod = importlib.import_module("ref_dream.generation_utils")
    conf = importlib.import_module("ref_dream.configuration_dream")
    reference = {"repo": "ZHZisZZ/dllm", "commit": "03270de7d134f87244f1ffc2ff3653c809beb1d0",
                 "file": "dllm/pipelines/dream/models/generation_utils.py (Dream-org model card's generation_utils.py)",
                 "function": "DreamGenerationMixin.diffusion_generate"}
    for label, model, prompts, shaped in models():
        config = dream_config(conf, model)
        check_logits("ref_dream", model, make_host(mod.DreamGenerationMixin, model, config, 1))
        cases = [run_dream(mod, model, config, cid, rows, params) for cid, rows, params in dream_cases(model, prompts, shaped)]
        save("dream-generate", label, reference, model, cases)


# ------------------------------------------------------------------------------------------------ KLASS (Dream)
def argmax_not_mask(host, mask_id, cid):
    """``before_step`` stopping the recording when the reference's greedy proposal at a masked position is the
    mask id: it would commit it as a no-op, which dllm never does."""
    def before(x, logits):
        mi = x[: host.rows] == mask_id
        if bool((logits[: host.rows].argmax(-1)[mi] == mask_id).any()):
            raise SystemExit(f"case {cid}: the reference proposes the mask id at a masked position (a no-op commit); "
                             "choose another prompt")
    return before


def run_klass_dream(mod, model, config, cid, rows, params):
    """One ``diffusion_generate`` call of KLASS's Dream code (``alg="klass"``; batch 1)."""
    host = make_host(mod.DreamGenerationMixin, model, config, len(rows))
    host.before_step = argmax_not_mask(host, model.mask_id, cid)
    ids = torch.tensor(rows)
    out = host.diffusion_generate(ids, return_dict_in_generate=True, **params)
    P = ids.shape[1]
    gen = out.sequences[:, P:]
    rl.check_no_mask(gen, model.mask_id, cid)
    rl.check_decoded_kept(host.canvases, gen, P, model.mask_id, cid)
    # used_steps: the forwards before it found no mask left, or its initial 256 when the loop ran to the end
    if out.used_steps != len(host.canvases) and not (out.used_steps == 256 and len(host.canvases) == params["steps"]):
        raise SystemExit(f"case {cid}: the reference counted {out.used_steps} steps, its model ran {len(host.canvases)}")
    return rl.case_record(cid, rows, params, gen, host, P, model.mask_id)


def klass_dream_cases(model, prompts, shaped: bool):
    """KLASS's Dream script settings (conf 0.9, KL 0.001, history 2, ``unmask_strategy="all"``) and the LLaDA
    script's (0.6 / 0.015); ``steps`` below the generation length where the rule finishes within them.
    ``temperature``, ``top_p`` and ``top_k`` are passed explicitly (see :func:`dream_cases`)."""
    G = 32 if shaped else 16
    b = dict(max_new_tokens=G, steps=G, temperature=0.0, top_p=None, top_k=None, alg="klass", conf_threshold=0.9,
             kl_threshold=0.001, kl_history_length=2, unmask_strategy="all", save_steps=False)
    return [
        ("dream_script", [prompts[0]], dict(b)),
        ("llada_thresholds", [prompts[1]], dict(b, conf_threshold=0.6, kl_threshold=0.015)),
        ("loose", [prompts[2]], dict(b, conf_threshold=0.3, kl_threshold=0.05)),
        ("history3", [prompts[3]], dict(b, conf_threshold=0.5, kl_threshold=0.02, kl_history_length=3)),
        ("steps_below_length", [prompts[0]], dict(b, steps=G * 3 // 4, conf_threshold=0.3, kl_threshold=0.05)),
    ]


def record_klass_dream(ref_dir: Path):
    package("ref_klass", ref_dir / "src" / "model")
    mod = importlib.import_module("ref_klass.dream_klass")
    reference = {"repo": "shkim0116/KLASS", "commit": "ad87ecbe9fdef4a6e93701afbc150cb9213fbcd7",
                 "file": "src/model/dream_klass.py", "function": "DreamGenerationMixin.diffusion_generate (alg='klass')"}
    for label, model, prompts, shaped in models():
        config = dream_config(None, model)  # KLASS ships no Dream configuration or modeling file
        cases = [run_klass_dream(mod, model, config, cid, rows, params)
                 for cid, rows, params in klass_dream_cases(model, prompts, shaped)]
        save("klass-dream", label, reference, model, cases)


# ------------------------------------------------------------------------------------------- AdaBlock (Dream)
def run_adablock_dream(mod, model, config, cid, rows, params):
    """One ``diffusion_generate`` call of AdaBlock's Dream code with ``_sample = _sample_adablock`` (batch 1);
    ``params``: its keyword arguments plus ``delimiter_ids`` (the ids its ``_compute_block_length`` hard-codes,
    recorded for the replay, not passed)."""
    host = make_host(mod.DreamGenerationMixin, model, config, len(rows), sample=mod.DreamGenerationMixin._sample_adablock)
    host.before_step = argmax_not_mask(host, model.mask_id, cid)
    ids = torch.tensor(rows)
    kw = {k: v for k, v in params.items() if k != "delimiter_ids"}
    out = host.diffusion_generate(ids, return_dict_in_generate=True, **kw)
    P = ids.shape[1]
    gen = out.sequences[:, P:]
    rl.check_no_mask(gen, model.mask_id, cid)
    rl.check_decoded_kept(host.canvases, gen, P, model.mask_id, cid)
    if sum(out.nfe_history) != len(host.canvases):
        raise SystemExit(f"case {cid}: the reference counted {sum(out.nfe_history)} forwards, its model ran "
                         f"{len(host.canvases)}")
    case = rl.case_record(cid, rows, params, gen, host, P, model.mask_id)
    case["blocks"] = list(out.block_history)  # the block lengths the reference chose (for the replay's check)
    return case


def adablock_dream_cases(model, prompts, shaped: bool):
    """The paper's Dream setting (threshold 0.9, delimiter threshold 0.5, B0 32 scaled down to the short
    generations), lower thresholds, and one that disables adaptive blocks (delimiter threshold 1.0)."""
    G = 32
    b = dict(max_new_tokens=G, temperature=0.0, top_p=None, top_k=None, alg="confidence_threshold", threshold=0.9,
             block_length=8, delimiter_threshold=0.5, delimiter_ids=list(ADABLOCK_DREAM_DELIMITERS))
    return [
        ("paper", [prompts[0]], dict(b)),
        ("threshold07", [prompts[1]], dict(b, threshold=0.7, delimiter_threshold=0.3)),
        ("b0_16", [prompts[2]], dict(b, block_length=16, delimiter_threshold=0.2)),
        ("delimiter_low", [prompts[3]], dict(b, threshold=0.8, delimiter_threshold=0.05, block_length=4)),
        ("fixed_blocks", [prompts[0]], dict(b, delimiter_threshold=1.0)),
    ]


def record_adablock_dream(ref_dir: Path):
    package("ref_adablock_dream", ref_dir / "dream" / "model")
    mod = importlib.import_module("ref_adablock_dream.generation_utils_adablock")
    reference = {"repo": "lgxi24/AdaBlock-dLLM", "commit": "491b20580ad90f6019f29e045f484b538581101a",
                 "file": "dream/model/generation_utils_adablock.py",
                 "function": "DreamGenerationMixin._sample_adablock (alg='confidence_threshold')"}
    conf = importlib.import_module("ref_adablock_dream.configuration_dream")
    for label, model, prompts, shaped in models(ADABLOCK_SHAPED_ACTIVE):
        config = dream_config(conf, model)
        # batch 1 only (the reference's sampler indexes row 0): the plain batch is what it runs
        check_logits("ref_adablock_dream", model, make_host(mod.DreamGenerationMixin, model, config, 1), padded=False)
        cases = [run_adablock_dream(mod, model, config, cid, rows, params)
                 for cid, rows, params in adablock_dream_cases(model, prompts, shaped)]
        save("adablock-dream", label, reference, model, cases, ADABLOCK_SHAPED_ACTIVE)


# ---------------------------------------------------------------------------------------------------- common
def models(active=()):
    tiny = rl.tiny_model("dream-tiny")
    yield "dream-tiny", tiny, rl.puzzle_prompts(tiny), False
    shaped = gm.shaped_model("dream", SHAPED_SEED, active=active) if active else gm.shaped_dream(SHAPED_SEED)
    yield "shaped-dream", shaped, gm.shaped_prompts("dream", [14, 9, 21, 17], SHAPED_SEED), True


def save(ref_name, label, reference, model, cases, active=()):
    model_field = label
    if label == "shaped-dream":
        model_field = {"shaped": "dream", "seed": SHAPED_SEED, **({"active": list(active)} if active else {})}
    data = {"reference": reference, "model": model_field, "weights_sha256": gc.state_sha256(model), "cases": cases}
    path = gc.save_fixture(f"{ref_name}_{label}", data)
    print(f"wrote {path} ({path.stat().st_size // 1024} KB, {len(cases)} cases)")


RECORDERS = {"dream": record_dream, "klass-dream": record_klass_dream, "adablock-dream": record_adablock_dream}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reference", choices=sorted(RECORDERS))
    p.add_argument("--ref-dir", type=Path, required=True, help="root of a checkout of the reference repository")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with torch.no_grad():
        RECORDERS[args.reference](args.ref_dir)


if __name__ == "__main__":
    main()
