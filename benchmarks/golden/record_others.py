"""Record golden trajectories of the LLaDA-family method references (run locally; their code stays outside).

Each reference is a public repository; check it out at the commit named here and pass its root as
``--ref-dir``:

* ``klass``: shkim0116/KLASS @ ad87ecbe9fdef4a6e93701afbc150cb9213fbcd7, ``src/model/llada_klass.py``
  (``stable_confident_decode`` with ``alg="klass"``). It hard-codes LLaDA's mask id 126336, so it runs on the
  LLaDA-shaped model only.
* ``adablock``: lgxi24/AdaBlock-dLLM @ 491b20580ad90f6019f29e045f484b538581101a, ``llada/generate_adablock.py``
  (``generate_adablock``: its ``compute_block_length`` and its decoding loop).
* ``localleap``: friedrichor/LocalLeap ``llada/generate.py`` (``generate``). That repository cannot be fetched
  here; the file is run from the public snapshot ZitongWang018/dlm-seq @
  1e1b1433b989fdcae3def68dd7ce8233bdb1555d, ``experiments/localleap/generate.py`` (sha256
  1fe905a977ce1e2eedb46bccf6326f8f9194fd78dc1b94e0dd15835b4cb4a091: LocalLeap's file plus a
  ``generate_localleap = generate`` alias line); pass the directory holding it as ``--ref-dir``. Its
  ``from model.modeling_llada import LLaDAModelLM`` (used only by its ``main``) is satisfied by a stub module.
* ``prophet``: pixeli99/Prophet @ 460afe41c7063a29a9893675aca07b985997bb83, ``generate_earlyexit.py``
  (``generate`` with ``analyze_gap=True``; no ``constraints``: nothing is forced into the canvas).
* ``eb``: the EB-Sampler as yks23/Information-Gain-Sampler @ 0ae2da8ca1d710c0ca1590210e3f31496eaf2a94 carries it,
  ``src/generators/eb_sampler.py`` (``generate_with_eb_sampler``: the whole generation as one region, entropy
  of ``Categorical(logits=...)``, the sorted prefix with summed entropy less its largest ``<= gamma``); its
  ``src.generators.base`` helpers are loaded from the same checkout without the package's other imports.
* ``d3llm``: hao-ai-lab/d3LLM @ e5bfcac, ``d3llm/d3llm_LLaDA/d3llm_llada_generate_util.py`` (``generate`` with
  ``threshold``: d3LLM's entropy threshold in fixed blocks, ``get_transfer_index_entropy``); its
  ``utils.utils_LLaDA.model.modeling_llada`` import (used only by its ``main``) is satisfied by a stub module.
  ``d3llm-multiblock``: the same file's ``generate_multi_block`` (pipelined blocks, no cache, no early stop).
* ``eoser``: yjyddq/EOSER-ASS-RL @ 5affb4ec0db9d3819175c2011c94e38c74325624, ``eval/generate.py``
  (``eoser_generate``, ``ass_generate``, ``eoser_ass_generate``; ``params.function`` names the one that ran).
  Its loops call ``torch.distributed.get_rank()``: the script starts a one-process gloo group first.

Environment and commands: the transformers 4.49 venv of ``record_llada.py`` (AdaBlock imports its own
LLaDA modeling file); from the repository root, each command writes
``tests/fixtures/golden/<reference>_<model>.json``::

    export PYTHONPATH=. OMP_NUM_THREADS=1 PY=/path/to/refenv/bin/python
    $PY benchmarks/golden/record_others.py klass --ref-dir /path/to/KLASS                # klass-llada_shaped-llada
    $PY benchmarks/golden/record_others.py adablock --ref-dir /path/to/AdaBlock-dLLM     # adablock-llada_*
    $PY benchmarks/golden/record_others.py localleap --ref-dir /path/to/localleap-dir    # localleap_*
    $PY benchmarks/golden/record_others.py prophet --ref-dir /path/to/Prophet            # prophet_*
    $PY benchmarks/golden/record_others.py eoser --ref-dir /path/to/EOSER-ASS-RL         # eoser_*
    $PY benchmarks/golden/record_others.py eb --ref-dir /path/to/Information-Gain-Sampler  # eb_*
    $PY benchmarks/golden/record_others.py d3llm --ref-dir /path/to/d3LLM                 # d3llm_*
    $PY benchmarks/golden/record_others.py d3llm-multiblock --ref-dir /path/to/d3LLM      # d3llm-multiblock_*

Models: the bundled ``llada-tiny`` and the LLaDA-shaped random model of ``tests/golden_models.py`` (AdaBlock gets
delimiter ids that each model proposes: the tokenizer's newline tokens, three ids of the shaped model).
Every reference calls
``model(x).logits``; it gets dllm's Transformer behind ``record_llada.Recorder`` (the HF LLaDA file's
semantics), which records the canvas before every forward.

Checks while recording (a failing one stops the script): the output holds no mask; no forward changes a
position that was already decoded (KLASS's quota fallback can select non-candidates when its quota exceeds
the masks left, which would overwrite decoded tokens: such cases are not recorded); the reference's own
forward count equals the recorded one.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
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
# generate_adablock takes delimiter_ids (default [198], LLaDA's "\n"): on the shaped model, three ids it proposes at
# some masked positions with confidences between 0.2 and 0.7 (with these, every case but fixed_blocks adapts a
# block); on llada-tiny, its tokenizer's newline tokens
ADABLOCK_SHAPED_DELIMITERS = (6145, 6755, 41343)


class Host(rl.Recorder):
    """``record_llada.Recorder`` plus what these references read from their model: ``config.vocab_size``
    (KLASS) and ``dtype`` (EOSER's softmax)."""

    @property
    def config(self):
        return SimpleNamespace(vocab_size=self.model.config.vocab_size)

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype


def stub_modules(*names: str, **attrs) -> None:
    """Empty modules (packages) under ``names``, for a reference's imports that only its ``main`` uses; ``attrs``
    are set on the last one."""
    for name in names:
        stub = sys.modules.setdefault(name, types.ModuleType(name))
        stub.__path__ = []
    for k, v in attrs.items():
        setattr(sys.modules[names[-1]], k, v)


def blocks_regions(block_lengths, forwards_per_block):
    out, lo = [], 0
    for bl, n in zip(block_lengths, forwards_per_block):
        out += [(lo, lo + bl)] * n
        lo += bl
    return out


def finish(cid, rows, params, gen, rec, P, mask_id, nfe, regions=None):
    rl.check_no_mask(gen, mask_id, cid)
    rl.check_decoded_kept(rec.canvases, gen, P, mask_id, cid)
    if nfe != len(rec.canvases):
        raise SystemExit(f"case {cid}: the reference counted {nfe} forwards, its model ran {len(rec.canvases)}")
    return rl.case_record(cid, rows, params, gen, rec, P, mask_id, regions=regions)


# ------------------------------------------------------------------------------------------------ KLASS (LLaDA)
def run_klass(mod, model, cid, rows, params):
    """``stable_confident_decode`` (batch 1); ``params``: its keyword arguments."""
    rec = Host(model, 1, rl.proposal_prob(torch.float64))
    ids = torch.tensor(rows)
    x, used = mod.stable_confident_decode(rec, None, ids, **params)
    P = ids.shape[1]
    nb = params["gen_length"] // params["block_length"]
    steps = gc.steps_from_canvases(rec.canvases, x[:, P:], P, model.mask_id)
    per_block = [0] * nb
    for s in steps:  # forwards per block, from the block of the forward's first commit
        per_block[min(min(s[0], default=0) // params["block_length"], nb - 1)] += 1
    regions = rl.fixed_regions(per_block, params["block_length"])
    return finish(cid, rows, params, x[:, P:], rec, P, model.mask_id, used, regions)


def klass_cases(model, prompts):
    """The LLaDA script's settings (conf 0.6, KL 0.015, history 2, block 64 of 256 scaled to 8 / 16 of 32),
    the Dream script's thresholds, and steps below the generation length (the quota fallback commits two
    tokens per step)."""
    b = dict(gen_length=32, steps=32, block_length=8, temperature=0.0, mask_id=model.mask_id, conf_threshold=0.6,
             kl_threshold=0.015, kl_history_length=2, alg="klass", unmask_strategy="all")
    return [
        ("script", [prompts[0]], dict(b)),
        ("one_block", [prompts[1]], dict(b, block_length=32, conf_threshold=0.3, kl_threshold=0.05)),
        ("b16_loose", [prompts[2]], dict(b, block_length=16, conf_threshold=0.3, kl_threshold=0.05)),
        ("dream_thresholds", [prompts[3]], dict(b, conf_threshold=0.9, kl_threshold=0.001)),
        ("history3", [prompts[0]], dict(b, block_length=16, conf_threshold=0.3, kl_threshold=0.05,
                                        kl_history_length=3)),
        ("steps_half", [prompts[1]], dict(b, steps=16, block_length=16, conf_threshold=0.9, kl_threshold=0.001)),
    ]


def record_klass(ref_dir: Path):
    sys.path.insert(0, str(ref_dir / "src" / "model"))
    mod = importlib.import_module("llada_klass")
    reference = {"repo": "shkim0116/KLASS", "commit": "ad87ecbe9fdef4a6e93701afbc150cb9213fbcd7",
                 "file": "src/model/llada_klass.py", "function": "stable_confident_decode (alg='klass')"}
    model = gm.shaped_llada(SHAPED_SEED)  # the reference hard-codes mask id 126336: LLaDA's vocabulary only
    prompts = gm.shaped_prompts("llada", [14, 9, 21, 17], SHAPED_SEED)
    cases = [run_klass(mod, model, cid, rows, params) for cid, rows, params in klass_cases(model, prompts)]
    save("klass-llada", "shaped-llada", reference, model, cases)


# --------------------------------------------------------------------------------------------- AdaBlock (LLaDA)
def run_adablock(mod, model, cid, rows, params):
    """``generate_adablock`` (batch 1); ``params``: its keyword arguments plus ``seed`` (global RNG)."""
    rec = Host(model, 1, rl.proposal_prob(torch.float64, temperature=params["temperature"]))
    ids = torch.tensor(rows)
    torch.manual_seed(params.get("seed", 0))
    x, nfe_history, block_history = mod.generate_adablock(rec, ids, **{k: v for k, v in params.items() if k != "seed"})
    P = ids.shape[1]
    case = finish(cid, rows, params, x[:, P:], rec, P, model.mask_id, sum(nfe_history),
                  blocks_regions(block_history, nfe_history))
    case["blocks"] = list(block_history)
    return case


def adablock_cases(model, prompts, delimiters, shaped: bool):
    """The paper's LLaDA setting (threshold 0.9, delimiter threshold 0.3, B0 32 scaled to 8), variations, a
    fixed-block run (delimiter threshold above 1) and, on ``llada-tiny``, seeded temperature > 0 (Gumbel noise
    over the canvas). The reference looks for delimiters in its noisy proposal, dllm in the clean argmax: at
    temperature > 0 the two agree only where the noise changes no delimiter prediction (``llada-tiny``'s
    confident newlines; not the shaped model's, whose delimiters have confidences of 0.2 to 0.7)."""
    b = dict(gen_length=32, steps=4, init_block_length=8, temperature=0.0, remasking="low_confidence",
             mask_id=model.mask_id, threshold=0.9, delimiter_ids=list(delimiters), delimiter_threshold=0.3)
    return [
        ("paper", [prompts[0]], dict(b)),
        ("threshold07", [prompts[1]], dict(b, threshold=0.7, delimiter_threshold=0.2)),
        ("b0_16", [prompts[2]], dict(b, init_block_length=16, delimiter_threshold=0.1)),
        ("b0_4_low", [prompts[3]], dict(b, init_block_length=4, delimiter_threshold=0.05, threshold=0.8)),
        ("fixed_blocks", [prompts[0]], dict(b, delimiter_threshold=2.0)),
    ] + ([] if shaped else [("t05", [prompts[1]], dict(b, temperature=0.5, delimiter_threshold=0.1, seed=3))])


def record_adablock(ref_dir: Path):
    sys.path.insert(0, str(ref_dir / "llada"))
    mod = importlib.import_module("generate_adablock")
    reference = {"repo": "lgxi24/AdaBlock-dLLM", "commit": "491b20580ad90f6019f29e045f484b538581101a",
                 "file": "llada/generate_adablock.py", "function": "generate_adablock (compute_block_length)"}
    from dllm.blocks.adablock import tokenizer_delimiters

    tiny = rl.tiny_model("llada-tiny")
    delims = tokenizer_delimiters(tiny.tokenizer, "newline")
    cases = [run_adablock(mod, tiny, cid, rows, params)
             for cid, rows, params in adablock_cases(tiny, rl.puzzle_prompts(tiny), delims, False)]
    save("adablock-llada", "llada-tiny", reference, tiny, cases)
    shaped = gm.shaped_llada(SHAPED_SEED)
    prompts = gm.shaped_prompts("llada", [14, 9, 21, 17], SHAPED_SEED)
    cases = [run_adablock(mod, shaped, cid, rows, params)
             for cid, rows, params in adablock_cases(shaped, prompts, ADABLOCK_SHAPED_DELIMITERS, True)]
    save("adablock-llada", "shaped-llada", reference, shaped, cases)


# --------------------------------------------------------------------------------------------------- LocalLeap
def run_localleap(mod, model, cid, rows, params):
    """LocalLeap's ``generate`` (batch 1); ``params``: its keyword arguments plus ``seed`` (global RNG)."""
    rec = Host(model, 1, rl.proposal_prob(torch.float64, temperature=params["temperature"]))
    ids = torch.tensor(rows)
    torch.manual_seed(params.get("seed", 0))
    x, nfe = mod.generate(rec, ids, **{k: v for k, v in params.items() if k != "seed"})
    P = ids.shape[1]
    gen = x[:, P:]  # with early_stop, the EOS fill after the block holding EOS shows in the last forward's commits
    steps = gc.steps_from_canvases(rec.canvases, gen, P, model.mask_id)
    return finish(cid, rows, params, gen, rec, P, model.mask_id, nfe, rl.regions_from_steps(steps, params["block_length"]))


def localleap_cases(model, prompts):
    """The paper's setting (kappa 0.9, tau 0.75, radius 4, block 32 of 256 scaled to 8 / 16 of 32), the plain
    threshold rule (``relaxed_threshold=None``), radius and tau variations, EOS early stop (also past a block
    that holds EOT but no EOS) and seeded temperature > 0."""
    b = dict(steps=4, gen_length=32, block_length=8, temperature=0.0, remasking="low_confidence",
             mask_id=model.mask_id, eos_id=model.eos_id, early_stop=False, threshold=0.9, relaxed_threshold=0.75,
             radius=4)
    return [
        ("paper", [prompts[0]], dict(b)),
        ("threshold_only", [prompts[1]], dict(b, relaxed_threshold=None)),
        ("radius2_tau05", [prompts[2]], dict(b, radius=2, relaxed_threshold=0.5, threshold=0.8)),
        ("b16", [prompts[3]], dict(b, steps=2, block_length=16, relaxed_threshold=0.6)),
        ("one_block", [prompts[0]], dict(b, steps=1, block_length=32, relaxed_threshold=0.5, threshold=0.7)),
        ("early_stop", [prompts[1]], dict(b, early_stop=True, relaxed_threshold=0.5)),
        # on the shaped model a block finishes holding EOT (126348) but no EOS: the reference checks EOS only
        ("early_stop_eot_block", [prompts[3]], dict(b, early_stop=True)),
        ("t06", [prompts[2]], dict(b, temperature=0.6, seed=4)),
    ]


def record_localleap(ref_dir: Path):
    # its module-level `from model.modeling_llada import LLaDAModelLM` serves only its main(): a stub satisfies it
    stub_modules("model", "model.modeling_llada", LLaDAModelLM=None)
    path = ref_dir / "generate.py" if (ref_dir / "generate.py").exists() else ref_dir / "llada" / "generate.py"
    mod = rl.load_module(path, "ref_localleap_generate")
    reference = {"repo": "friedrichor/LocalLeap (as ZitongWang018/dlm-seq experiments/localleap/generate.py)",
                 "commit": "1e1b1433b989fdcae3def68dd7ce8233bdb1555d",
                 "file": "llada/generate.py (sha256 1fe905a977ce1e2eedb46bccf6326f8f9194fd78dc1b94e0dd15835b4cb4a091)",
                 "function": "generate"}
    for label, model, prompts in llada_models():
        cases = [run_localleap(mod, model, cid, rows, params) for cid, rows, params in localleap_cases(model, prompts)]
        save("localleap", label, reference, model, cases)


# ----------------------------------------------------------------------------------------------------- Prophet
def run_prophet(mod, model, cid, rows, params):
    """Prophet's ``generate`` (batch 1, ``analyze_gap=True``); ``params``: its keyword arguments with
    ``answer_start_pos`` as a generation offset (``answer_offset``; the call gets the absolute position)."""
    rec = Host(model, 1, rl.proposal_prob(torch.float32, temperature=params["temperature"]))
    ids = torch.tensor(rows)
    P = ids.shape[1]
    kw = {k: v for k, v in params.items() if k not in ("seed", "answer_offset")}
    torch.manual_seed(params.get("seed", 0))
    x, gap = mod.generate(rec, ids, analyze_gap=True, answer_start_pos=P + params["answer_offset"], **kw)
    info = gap["exit_info"]
    nfe = info["actual_steps"]
    nb = params["gen_length"] // params["block_length"]
    regions = rl.fixed_regions([params["steps"] // nb] * nb, params["block_length"])
    case = finish(cid, rows, params, x[:, P:], rec, P, model.mask_id, nfe, regions)
    case["early_exit"] = bool(info["early_exit_triggered"])
    return case


def prophet_cases(model, prompts, shaped: bool):
    """The reference thresholds (7.5 / 5.0 / 2.5) and lower ones so that the early exit fires in the early, mid
    and late phases on these models; the answer span at several offsets; two block lengths; one run where
    it never fires (thresholds out of reach). ``llada-tiny`` decodes 16 tokens (its puzzle answers outlast
    them: no ties among EOS positions at probability 1.0)."""
    G = 32 if shaped else 16
    b = dict(steps=G, gen_length=G, block_length=G // 4, temperature=0.0, cfg_scale=0.0, remasking="low_confidence",
             mask_id=model.mask_id, answer_offset=G * 5 // 8, early_exit_thresholds={"early": 7.5, "mid": 5.0, "late": 2.5})
    low = {"early": 4.0, "mid": 2.5, "late": 1.0}
    return [
        ("paper_thresholds", [prompts[0]], dict(b)),
        ("low", [prompts[1]], dict(b, early_exit_thresholds=low)),
        ("low_b16_span4", [prompts[2]], dict(b, block_length=G // 2, answer_offset=4, early_exit_thresholds=low)),
        ("mid_phase", [prompts[3]], dict(b, answer_offset=G - 5, early_exit_thresholds={"early": 50.0, "mid": 3.0,
                                                                                        "late": 1.0})),
        ("late_phase", [prompts[0]], dict(b, steps=G // 2, answer_offset=G // 4,
                                          early_exit_thresholds={"early": 50.0, "mid": 50.0, "late": 2.0})),
        ("never", [prompts[1]], dict(b, steps=G // 2, early_exit_thresholds={"early": 99.0, "mid": 99.0, "late": 99.0})),
    ]


def record_prophet(ref_dir: Path):
    mod = rl.load_module(ref_dir / "generate_earlyexit.py", "ref_prophet_generate")
    reference = {"repo": "pixeli99/Prophet", "commit": "460afe41c7063a29a9893675aca07b985997bb83",
                 "file": "generate_earlyexit.py", "function": "generate (analyze_gap=True)"}
    for label, model, prompts in llada_models():
        cases = [run_prophet(mod, model, cid, rows, params) for cid, rows, params in
                 prophet_cases(model, prompts, label != "llada-tiny")]
        save("prophet", label, reference, model, cases)


# ---------------------------------------------------------------------------------------------------- EOSER/ASS
def eos_score(eos_id: int, factor, cfg_scale: float = 0.0):
    """The reference's EOSER confidence: ``softmax(logits)[x0]`` (float32) times ``factor(forward)`` where
    ``x0`` is EOS (the forward index is the number of scores so far); CFG logits combined first."""
    scores: list = []

    def score(logits):
        if cfg_scale > 0:
            cond, un = logits.chunk(2)
            logits = un + (cfg_scale + 1) * (cond - un)
        p = torch.softmax(logits.float(), -1)
        x0 = logits.argmax(-1)
        conf = p.gather(-1, x0[..., None])[..., 0]
        conf = torch.where(x0 == eos_id, conf * factor(len(scores)), conf)
        scores.append(None)
        return conf
    return score


def ass_layout(G: int, block_num: int) -> tuple[list[int], list[list[int]]]:
    """Block sizes and each block's schedule steps as ``ass_generate`` builds them (the replay needs the sizes;
    they are also checked against the forwards' commits)."""
    import math

    S = int(math.log2(G))
    if block_num == 1:
        return [G], [list(range(S))]
    sizes, steps, remaining, power = [], [], G, S - 1
    for b in range(block_num - 1, -1, -1):
        if b == block_num - 1:
            size, st = 2 ** power + 1 + (G - 2 ** S), [power]
            power -= 1
        elif b == 0:
            size, st = remaining, list(range(power + 1))
        else:
            size, st = 2 ** power, [power]
            power -= 1
        remaining -= size
        sizes.insert(0, size)
        steps.insert(0, st)
    return sizes, steps


def run_eoser(mod, model, cid, rows, params):
    """``params["function"]`` (``eoser_generate`` / ``ass_generate`` / ``eoser_ass_generate``) with the other
    keys as its keyword arguments (``tokenizer`` is a stand-in whose ``eos_token_id`` is the model's EOS)."""
    fn = params["function"]
    kw = {k: v for k, v in params.items() if k != "function"}
    S, G = params["steps"], params["gen_length"]
    if fn == "eoser_generate":
        nb = G // params["block_length"]
        spb = max(1, S // nb)
        g0 = params["eos_min_gamma"]
        score = eos_score(model.eos_id, lambda f: g0 + (1 - g0) * (min(f % spb, S - 1) / (S - 1) if S > 1 else 1),
                          params["cfg_scale"])
        regions = rl.fixed_regions([spb] * nb, params["block_length"])
    else:
        sizes, block_steps = ass_layout(G, params["block_num"])
        order = [i for st in block_steps for i in st]
        if fn == "eoser_ass_generate":
            g0 = params["eos_min_gamma"]
            score = eos_score(model.eos_id, lambda f: g0 + (1 - g0) * (2 ** (order[f] + 1) - 1) / 2 ** S)
        else:
            score = eos_score(model.eos_id, lambda f: 1.0)
        regions = blocks_regions(sizes, [len(st) for st in block_steps])
    rec = Host(model, len(rows), score)
    ids = torch.tensor(rows)
    x = getattr(mod, fn)(rec, ids, SimpleNamespace(eos_token_id=model.eos_id), **kw)
    P = ids.shape[1]
    return finish(cid, rows, params, x[:, P:], rec, P, model.mask_id, len(rec.canvases), regions)


def eoser_cases(model, prompts, shaped: bool):
    """EOSER alone (gamma 0.4, one block; several blocks, where the reference's progress runs over the total
    steps; CFG), ASS one block and in the reference's multi-block layout (15 | 16 | 33 of 64), EOSER + ASS
    (gamma 0.01), a batch of two prompts of the same length (the references take no padding). ``llada-tiny``
    decodes shorter generations (its puzzle answers outlast them: no ties among EOS positions at
    probability 1.0)."""
    m = model.mask_id
    G = 32 if shaped else 16
    eo = dict(function="eoser_generate", gen_length=G, block_length=G, steps=G // 2, temperature=0.0, cfg_scale=0.0,
              remasking="low_confidence", mask_id=m, eos_min_gamma=0.4, eos_max_gamma=1.0)
    S = G.bit_length() - 1
    ass = dict(function="ass_generate", gen_length=G, block_num=1, steps=S, temperature=0.0, cfg_scale=0.0,
               remasking="low_confidence", mask_id=m)
    both = dict(ass, function="eoser_ass_generate", eos_min_gamma=0.01, eos_max_gamma=1.0)
    return [
        ("eoser", [prompts[0]], dict(eo)),
        ("eoser_one_per_step", [prompts[1]], dict(eo, steps=G)),
        ("eoser_blocks", [prompts[2]], dict(eo, block_length=G // 4, steps=G // 2)),
        ("eoser_cfg", [prompts[3]], dict(eo, cfg_scale=1.0)),
        ("eoser_batch2", rl.same_len(prompts[0], prompts[3]), dict(eo)),
        ("ass", [prompts[1]], dict(ass)),
        ("ass_uneven", [prompts[2]], dict(ass, gen_length=G * 3 // 2 if shaped else G + 4)),
        ("ass_blocks", [prompts[3]], dict(ass, gen_length=2 * G, block_num=3, steps=S + 1)),
        ("eoser_ass", [prompts[0]], dict(both)),
        ("eoser_ass_double", [prompts[1]], dict(both, gen_length=2 * G, steps=S + 1)),
    ]


def record_eoser(ref_dir: Path):
    import torch.distributed as dist

    if not dist.is_initialized():  # the reference's tqdm bars ask dist.get_rank()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=0, world_size=1)
    mod = rl.load_module(ref_dir / "eval" / "generate.py", "ref_eoser_generate")
    reference = {"repo": "yjyddq/EOSER-ASS-RL", "commit": "5affb4ec0db9d3819175c2011c94e38c74325624",
                 "file": "eval/generate.py", "function": "eoser_generate / ass_generate / eoser_ass_generate "
                                                         "(params.function)"}
    try:
        for label, model, prompts in llada_models():
            cases = [run_eoser(mod, model, cid, rows, params)
                     for cid, rows, params in eoser_cases(model, prompts, label != "llada-tiny")]
            save("eoser", label, reference, model, cases)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------- EB-Sampler
def run_eb(mod, model, cid, rows, params):
    """``generate_with_eb_sampler`` (batch 1); ``params``: its keyword arguments plus ``seed`` (global RNG)."""
    rec = Host(model, 1)
    ids = torch.tensor(rows)
    torch.manual_seed(params.get("seed", 0))
    x = mod.generate_with_eb_sampler(rec, ids, mask_id=model.mask_id,
                                     **{k: v for k, v in params.items() if k != "seed"})
    P = ids.shape[1]
    return finish(cid, rows, params, x[:, P:], rec, P, model.mask_id, len(rec.canvases))


def eb_cases(prompts):
    """gamma from one token per step in practice (0.001) to most of the answer at once (10), two lengths, and
    seeded temperature > 0 (the reference's float64 Gumbel-max over the whole canvas)."""
    b = dict(gamma=0.01, gen_length=32, temperature=0.0)
    return [
        ("g0.001", [prompts[0]], dict(b, gamma=0.001)),
        ("g0.01", [prompts[1]], dict(b)),
        ("g0.1", [prompts[2]], dict(b, gamma=0.1)),
        ("g1", [prompts[3]], dict(b, gamma=1.0)),
        ("g10", [prompts[0]], dict(b, gamma=10.0)),
        ("g0.1_len16", [prompts[1]], dict(b, gamma=0.1, gen_length=16)),
        ("g0.1_t07", [prompts[2]], dict(b, gamma=0.1, temperature=0.7, seed=3)),
    ]


def record_eb(ref_dir: Path):
    stub_modules("src", "src.generators")  # the package's __init__ files import every generator: not needed
    sys.modules["src.generators.base"] = rl.load_module(ref_dir / "src" / "generators" / "base.py", "src.generators.base")
    mod = rl.load_module(ref_dir / "src" / "generators" / "eb_sampler.py", "ref_eb_sampler")
    reference = {"repo": "yks23/Information-Gain-Sampler", "commit": "0ae2da8ca1d710c0ca1590210e3f31496eaf2a94",
                 "file": "src/generators/eb_sampler.py", "function": "generate_with_eb_sampler"}
    for label, model, prompts in llada_models():
        save("eb", label, reference, model, [run_eb(mod, model, cid, rows, params)
                                              for cid, rows, params in eb_cases(prompts)])


# ------------------------------------------------------------------------------------- d3LLM entropy threshold
def run_d3llm(mod, model, cid, rows, params, fn: str = "generate"):
    """d3LLM's ``generate`` with ``threshold`` (or ``fn``, e.g. ``generate_multi_block``; batch 1); ``params``: its
    keyword arguments plus ``seed``."""
    rec = Host(model, 1)
    ids = torch.tensor(rows)
    torch.manual_seed(params.get("seed", 0))
    x, nfe = getattr(mod, fn)(rec, ids, mask_id=model.mask_id, **{k: v for k, v in params.items() if k != "seed"})
    P = ids.shape[1]
    return finish(cid, rows, params, x[:, P:], rec, P, model.mask_id, nfe)


def d3llm_cases(prompts):
    """Thresholds from one token per step in practice (0.01) to most of a block at once (5), one block or
    blocks of 8 / 16, and seeded temperature > 0."""
    b = dict(steps=32, gen_length=32, block_length=32, temperature=0.0, remasking="low_confidence", threshold=0.5)
    return [
        ("t0.5", [prompts[0]], dict(b)),
        ("t0.01", [prompts[1]], dict(b, threshold=0.01)),
        ("t2_b8", [prompts[2]], dict(b, threshold=2.0, block_length=8)),
        ("t5_b16", [prompts[3]], dict(b, threshold=5.0, block_length=16)),
        ("t1_b8_t07", [prompts[0]], dict(b, threshold=1.0, block_length=8, temperature=0.7, seed=2)),
    ]


def record_d3llm(ref_dir: Path, multiblock: bool = False):
    """``generate`` with ``threshold`` (fixtures ``d3llm_*``), or ``generate_multi_block`` (``d3llm-multiblock_*``)."""
    stub_modules("utils", "utils.utils_LLaDA", "utils.utils_LLaDA.model", "utils.utils_LLaDA.model.modeling_llada",
                 LLaDAModelLM=None)
    mod = rl.load_module(ref_dir / "d3llm" / "d3llm_LLaDA" / "d3llm_llada_generate_util.py", "ref_d3llm_generate")
    fn = "generate_multi_block" if multiblock else "generate"
    reference = {"repo": "hao-ai-lab/d3LLM", "commit": "e5bfcaccb775ee75759c24ccc9a28218b8372b34",
                 "file": "d3llm/d3llm_LLaDA/d3llm_llada_generate_util.py",
                 "function": fn if multiblock else "generate (threshold)"}
    cases = d3llm_multiblock_cases if multiblock else d3llm_cases
    for label, model, prompts in llada_models():
        save("d3llm-multiblock" if multiblock else "d3llm", label, reference, model,
             [run_d3llm(mod, model, cid, rows, params, fn) for cid, rows, params in cases(prompts)])


def d3llm_multiblock_cases(prompts):
    """Blocks of 8 over 32 positions: the next block added at a quarter, a half or the whole of the last one,
    fully activated at a half or the whole of the previous one; thresholds from one token per step to most of
    a block; seeded temperature > 0."""
    b = dict(steps=32, max_new_tokens=32, block_size=8, temperature=0.0, remasking="low_confidence",
             threshold=0.5, block_add_threshold=0.5, decoded_token_threshold=0.5)
    return [
        ("t0.5", [prompts[0]], dict(b)),
        ("t0.01_add0.25", [prompts[1]], dict(b, threshold=0.01, block_add_threshold=0.25)),
        ("t2_add0.25_act1", [prompts[2]], dict(b, threshold=2.0, block_add_threshold=0.25,
                                               decoded_token_threshold=1.0)),
        ("t1_sequential", [prompts[3]], dict(b, threshold=1.0, block_add_threshold=1.0, decoded_token_threshold=1.0)),
        ("t0.3_b16", [prompts[0]], dict(b, threshold=0.3, block_size=16, block_add_threshold=0.75)),
        ("t1_t07", [prompts[1]], dict(b, threshold=1.0, temperature=0.7, seed=2)),
    ]


# ---------------------------------------------------------------------------------------------------- common
def llada_models():
    tiny = rl.tiny_model("llada-tiny")
    yield "llada-tiny", tiny, rl.puzzle_prompts(tiny)
    shaped = gm.shaped_llada(SHAPED_SEED)
    yield "shaped-llada", shaped, gm.shaped_prompts("llada", [14, 9, 21, 17], SHAPED_SEED)


def save(ref_name, label, reference, model, cases, active=()):
    model_field = label
    if label == "shaped-llada":
        model_field = {"shaped": "llada", "seed": SHAPED_SEED, **({"active": list(active)} if active else {})}
    data = {"reference": reference, "model": model_field, "weights_sha256": gc.state_sha256(model), "cases": cases}
    path = gc.save_fixture(f"{ref_name}_{label}", data)
    print(f"wrote {path} ({path.stat().st_size // 1024} KB, {len(cases)} cases)")


RECORDERS = {"klass": record_klass, "adablock": record_adablock, "localleap": record_localleap,
             "prophet": record_prophet, "eoser": record_eoser, "eb": record_eb,
             "d3llm": record_d3llm, "d3llm-multiblock": functools.partial(record_d3llm, multiblock=True)}


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
