"""Record golden trajectories of the LLaDA-family reference decoders (run locally; their code stays outside).

Each reference is a public repository; check it out anywhere and pass its root as ``--ref-dir``:

* ``llada``: ML-GSAI/LLaDA @ b7e6c3565f194352da44b38dd12b6970597309f3, ``generate.py`` (``generate``).
* ``fastdllm``: NVlabs/Fast-dLLM @ f6b35ec3f1b16e1b3d3357938046559ae2d350fa, ``llada/generate.py``
  (``generate``, ``generate_with_prefix_cache``, ``generate_with_dual_cache``) with its
  ``llada/model/modeling_llada.py`` (unchanged since 24cc59e75f20a6384bae8c905965bb090b96388e).
* ``fastdllm-2506``: NVlabs/Fast-dLLM @ 24cc59e75f20a6384bae8c905965bb090b96388e (June 2025), ``llada/generate.py``
  and ``llada/model/modeling_llada.py``: the same three generators before batch support and the factor rule.
* ``dkv``: horseee/dKV-Cache @ 49a76fcc43b744ec2d960137f216e419317138b1, ``generation_utils/llada_dkv_cache_decode.py``.
* ``dinfer``: inclusionAI/dInfer @ fce4e32804103baa5d55230dff0352da0cdd6ceb, ``python/dinfer/decoding/``.

Environment: the Fast-dLLM and dKV-Cache modeling files need transformers 4.x (Fast-dLLM pins 4.49.0); a venv
that shares the system torch is enough, and every reference runs in it::

    python -m venv --system-site-packages /path/to/refenv && /path/to/refenv/bin/pip install "transformers==4.49.0"

Commands (from the repository root, ``git -C <checkout> checkout <commit>`` first; each writes
``tests/fixtures/golden/<reference>_<model>.json``)::

    export PYTHONPATH=. OMP_NUM_THREADS=1 PY=/path/to/refenv/bin/python
    $PY benchmarks/golden/record_llada.py llada --ref-dir /path/to/LLaDA              # llada-generate_*
    $PY benchmarks/golden/record_llada.py fastdllm --ref-dir /path/to/Fast-dLLM       # at f6b35ec: fastdllm_*
    $PY benchmarks/golden/record_llada.py fastdllm-2506 --ref-dir /path/to/Fast-dLLM  # at 24cc59e: fastdllm-2506_*
    $PY benchmarks/golden/record_llada.py dkv --ref-dir /path/to/dKV-Cache            # dkv-decode_*
    $PY benchmarks/golden/record_llada.py dinfer --ref-dir /path/to/dInfer            # dinfer_*

Re-recording gives byte-identical files (checked for ``llada`` and ``dinfer`` under transformers 4.49 and 5.x;
with transformers 4.x the bundled tokenizer is read through ``PreTrainedTokenizerFast``, same prompt ids).
dInfer's decoders are decorated with ``torch.compile``; the script sets ``TORCHDYNAMO_DISABLE=1`` (eager).

Models: the bundled ``llada-tiny`` and the LLaDA-shaped random model of ``tests/golden_models.py`` (rebuilt
from its seed). References that only call ``model(x[, attention_mask]).logits`` (LLaDA, dInfer) get dllm's
Transformer behind a thin wrapper with the HF modeling file's semantics (absolute positions ``0..T-1``,
padded keys masked); the others get our weights loaded into their own modeling classes, after checking that
the logits are bit-identical. Hooks record the full canvas before every forward (a sliced canvas
``x[:, a:b]`` is a view, whose base is the canvas; dKV-Cache's gathered input is put back into the previous
canvas). Nothing here changes the reference code; hooks only observe it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # dInfer decorates its decoders with torch.compile: run eagerly

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import golden_common as gc  # noqa: E402
import golden_models as gm  # noqa: E402

SHAPED_SEED = 0


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def tiny_model(name: str = "llada-tiny"):
    """A bundled tiny checkpoint (``llada-tiny`` / ``dream-tiny``) in float32, with its tokenizer."""
    import dllm
    import dllm.assets

    path = dllm.assets.model_path(name)
    try:
        return dllm.load_model(str(path), dtype="float32")
    except ValueError:  # transformers 4.x (the references' pins) cannot read a transformers 5 tokenizer config
        from transformers import PreTrainedTokenizerFast

        model = dllm.load_model(str(path), dtype="float32", tokenizer=False)
        special = json.loads((path / "tokenizer_config.json").read_text())
        tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"),
                                      **{k: special[k] for k in ("bos_token", "eos_token", "pad_token")})
        tok.chat_template = (path / "chat_template.jinja").read_text()
        model.tokenizer = tok
        eot = tok.convert_tokens_to_ids(model.spec.eot_token)
        model.eot_id = eot if isinstance(eot, int) and eot >= 0 else model.eot_id
        return model


def tiny_llada():
    return tiny_model("llada-tiny")


def tiny_prompts(model, names=("waiting_line/sort", "arithmetic/addition", "puzzle/sudoku", "waiting_line/reverse")):
    from dllm.evals.tasks import TASKS
    from dllm.generate import prepare_prompts

    return [prepare_prompts(model, [TASKS[n].generate(1, 3)[0].messages])[0] for n in names]


def puzzle_prompts(model):
    """Chat prompts of bundled tasks whose answers outlast a short generation (4x4 puzzles). After a short
    answer the tiny models give EOS probability 1.0 (in float32) at every later position, and a selection
    among many such exact ties is ordered differently by ``torch.topk`` and by dllm (lower column first)."""
    from dllm.evals.tasks import TASKS
    from dllm.generate import prepare_prompts

    tasks = [("puzzle/sudoku", 3), ("puzzle/latin_square", 3), ("puzzle/sudoku", 5), ("puzzle/latin_square", 5)]
    return [prepare_prompts(model, [TASKS[n].generate(1, seed)[0].messages])[0] for n, seed in tasks]


class Recorder(torch.nn.Module):
    """``model(x, attention_mask=None).logits`` as the HF LLaDA file computes it, recording each canvas."""

    def __init__(self, model, rows: int, score=None):
        super().__init__()
        self.model = model
        self.rows = rows
        self.score = score  # logits [n, T, V] -> the reference's confidence [B, T] (for the tie check)
        self.canvases: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []

    @property
    def device(self):
        return self.model.device

    def forward(self, input_ids, attention_mask=None, **_):
        base = input_ids if input_ids._base is None else input_ids._base
        self.canvases.append(base[: self.rows].detach().clone())
        B, T = input_ids.shape
        pos = torch.arange(T).expand(B, T)
        am = None if attention_mask is None else attention_mask.bool()
        logits = self.model(input_ids, positions=pos, attn_mask=am)
        if self.score is not None:
            self.scores.append(self.score(logits.detach()))
        return SimpleNamespace(logits=logits)


def tie_forwards(steps, scores, canvases, P, mask_id, regions) -> list[int]:
    """Forwards whose selection was decided among exactly equal scores: the lowest committed score of a row
    equals the highest score of a candidate it left masked. ``regions[f]`` is ``(lo, hi)`` (generation
    offsets) of forward ``f``'s block; ``scores[f]`` is the reference's confidence over the full canvas."""
    ties = []
    for f, (step, sc, cv) in enumerate(zip(steps, scores, canvases)):
        lo, hi = regions[f]
        for b, committed in enumerate(step):
            gen = cv[b, P:]
            cand = [i for i in range(lo, hi) if int(gen[i]) == mask_id]
            rest = [i for i in cand if i not in committed]
            if committed and rest:
                s = sc[b, P:]
                if float(min(s[i] for i in committed)) == float(max(s[i] for i in rest)):
                    ties.append(f)
                    break
    return ties


def left_pad(rows: list[list[int]], pad: int):
    P = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (P - len(r)) + r for r in rows])
    am = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows])
    return ids, am


def same_len(a: list[int], b: list[int]) -> list[list[int]]:
    """Two prompts cut to the same length (their last ``n`` ids), for references without padding support."""
    n = min(len(a), len(b))
    return [a[-n:], b[-n:]]


def check_no_mask(out: torch.Tensor, mask_id: int, case: str):
    if bool((out == mask_id).any()):
        raise SystemExit(f"case {case}: the reference left a mask in its output (it committed a proposed mask id "
                         "as a no-op); choose another seed or prompt")


def check_decoded_kept(canvases, final, P: int, mask_id: int, cid: str):
    """No forward of the reference changed a generated position that was already decoded (a reference that
    selects non-candidates, e.g. KLASS's quota fallback when its quota exceeds the masks left, would)."""
    seq = [c[:, P:] for c in canvases] + [final]
    for i, (a, b) in enumerate(zip(seq[:-1], seq[1:])):
        if bool(((a != mask_id) & (a != b)).any()):
            raise SystemExit(f"case {cid}: after forward {i} the reference changed tokens it had already decoded; "
                             "choose other settings")


def case_record(cid, rows, params, out_gen, rec, P, mask_id, nfe=None, regions=None):
    steps = gc.steps_from_canvases(rec.canvases, out_gen, P, mask_id)
    case = {"id": cid, "prompt_ids": rows, "params": params, "output": out_gen.tolist(),
            "nfe": len(rec.canvases) if nfe is None else int(nfe), "steps": steps}
    if rec.scores and regions is not None:
        case["ties"] = tie_forwards(steps, rec.scores, rec.canvases, P, mask_id, regions)
    return case


def proposal_prob(dtype, cfg_scale=0.0, eos_inf=None, exclude=(), temperature=0.0):
    """Confidence of LLaDA-style low-confidence decoding: softmax probability (in ``dtype``) of the proposal.
    At temperature > 0 the proposal uses the Gumbel noise the reference is about to draw from the global RNG
    (drawn here from a copy of the RNG state, which is then restored)."""
    def score(logits):
        if cfg_scale > 0:
            cond, un = logits.chunk(2)
            logits = un + (cfg_scale + 1) * (cond - un)
        logits = logits.clone()
        if eos_inf is not None:
            logits[..., eos_inf] = float("-inf")
        if temperature == 0:
            x0 = logits.argmax(-1)
        else:
            state = torch.get_rng_state()
            noise = torch.rand_like(logits, dtype=torch.float64)
            torch.set_rng_state(state)
            x0 = (logits.to(torch.float64).exp() / (-torch.log(noise)) ** temperature).argmax(-1)
        if exclude:
            logits[..., list(exclude)] = float("-inf")
        return torch.softmax(logits.to(dtype), -1).gather(-1, x0[..., None])[..., 0]
    return score


def fixed_regions(n_forwards_per_block: list[int], block_length: int):
    out = []
    for b, n in enumerate(n_forwards_per_block):
        out += [(b * block_length, (b + 1) * block_length)] * n
    return out


# ------------------------------------------------------------------------------------------- LLaDA generate.py
def run_llada_generate(ref, model, cid, rows, params, pad_id):
    """One call of LLaDA's ``generate``; ``params`` are its keyword arguments plus ``seed`` (global RNG) and
    ``attention_mask`` (bool: pass the left-padding mask)."""
    kw = {k: v for k, v in params.items() if k not in ("seed", "attention_mask")}
    ids, am = left_pad(rows, pad_id)
    score = None
    if params["remasking"] == "low_confidence":
        T = params["temperature"]
        eos_eot = (126081, 126348) if T == 0 else (126348,)  # at T > 0 the reference only excludes EOT
        score = proposal_prob(torch.float32, params["cfg_scale"], 126081 if params.get("logits_eos_inf") else None,
                              eos_eot if params.get("confidence_eos_eot_inf") else (), T)
    rec = Recorder(model, len(rows), score)
    torch.manual_seed(params.get("seed", 0))
    out = ref.generate(rec, ids, am if params.get("attention_mask") else None, **kw)
    P = ids.shape[1]
    gen = out[:, P:]
    check_no_mask(gen, params["mask_id"], cid)
    nb = params["gen_length"] // params["block_length"]
    regions = fixed_regions([params["steps"] // nb] * nb, params["block_length"])
    return case_record(cid, rows, params, gen, rec, P, params["mask_id"], regions=regions)


def llada_cases(model, prompts, shaped: bool):
    m = model.mask_id
    base = dict(mask_id=m, cfg_scale=0.0, temperature=0.0, remasking="low_confidence")
    cases = [
        ("lowconf_b8", [prompts[0]], dict(base, steps=16, gen_length=32, block_length=8)),
        ("lowconf_uneven", [prompts[1]], dict(base, steps=12, gen_length=30, block_length=10)),
        ("lowconf_one_block", [prompts[2]], dict(base, steps=24, gen_length=32, block_length=32)),
        ("random_t0", [prompts[0]], dict(base, steps=16, gen_length=32, block_length=16, remasking="random", seed=7)),
        ("lowconf_t07", [prompts[1]], dict(base, steps=16, gen_length=32, block_length=8, temperature=0.7, seed=3)),
        ("random_t05", [prompts[2]], dict(base, steps=16, gen_length=32, block_length=16, temperature=0.5,
                                          remasking="random", seed=11)),
        ("cfg", [prompts[0]], dict(base, steps=16, gen_length=32, block_length=8, cfg_scale=1.5, attention_mask=True)),
        ("batch2_same_len", same_len(prompts[0], prompts[3]),
         dict(base, steps=16, gen_length=32, block_length=8, attention_mask=True)),
        ("batch2_left_pad", [prompts[1], prompts[2]], dict(base, steps=16, gen_length=32, block_length=8,
                                                          attention_mask=True)),
    ]
    if shaped:
        cases += [
            ("logits_eos_inf", [prompts[2]], dict(base, steps=16, gen_length=32, block_length=8, logits_eos_inf=True)),
            ("confidence_eos_eot_inf", [prompts[0]], dict(base, steps=16, gen_length=32, block_length=8,
                                                          confidence_eos_eot_inf=True)),
            ("confidence_eos_eot_inf_t08", [prompts[1]], dict(base, steps=16, gen_length=32, block_length=16,
                                                              temperature=0.8, confidence_eos_eot_inf=True, seed=5)),
        ]
    return cases


def record_llada(ref_dir: Path):
    ref = load_module(ref_dir / "generate.py", "ref_llada_generate")
    reference = {"repo": "ML-GSAI/LLaDA", "commit": "b7e6c3565f194352da44b38dd12b6970597309f3",
                 "file": "generate.py", "function": "generate"}
    for label, model, prompts, shaped in models():
        cases = [run_llada_generate(ref, model, cid, rows, params, model.pad_id)
                 for cid, rows, params in llada_cases(model, prompts, shaped)]
        save("llada-generate", label, reference, model, cases)


# ------------------------------------------------------------------------------------------------- Fast-dLLM
def reference_llada(pkg: str, model, modeling_name: str = "modeling_llada"):
    """Our weights in the reference's own LLaDA modeling classes (``<pkg>.configuration_llada`` /
    ``<pkg>.<modeling_name>``), fp32, eval mode."""
    from dllm.models import LLADA

    conf = importlib.import_module(f"{pkg}.configuration_llada")
    modeling = importlib.import_module(f"{pkg}.{modeling_name}")
    hf = LLADA.config_to_hf(model.config, {"mask_id": model.mask_id, "eos_id": model.eos_id, "pad_id": model.pad_id})
    ref = modeling.LLaDAModelLM(conf.LLaDAConfig(**hf), init_params=False)
    km = LLADA.key_map(model.config)
    missing, unexpected = ref.load_state_dict({km[k]: v for k, v in model.state_dict().items() if k in km},
                                              strict=False)
    if unexpected or [k for k in missing if "ff_out" not in k or not model.config.tie_embeddings]:
        raise SystemExit(f"loading our weights into the reference model: missing {missing}, unexpected {unexpected}")
    ref = ref.eval().requires_grad_(False)
    x = torch.tensor([[1, 2, 3, 4, model.mask_id, model.mask_id]])
    if not torch.equal(ref(x).logits, model(x)):
        raise SystemExit("the reference modeling file's logits differ from ours on the same weights")
    return ref


class Hooks:
    """Forward hooks on a reference model: the full canvas before each forward (a sliced canvas is a view
    of it), and optionally the reference's confidence scattered onto the canvas columns."""

    def __init__(self, model, rows: int, score=None):
        self.rows, self.score = rows, score
        self.canvases: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []
        self.cols: list[int] = []
        self.handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                        model.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, _m, args, kwargs):
        x = args[0] if args else kwargs["input_ids"]
        base = x if x._base is None else x._base
        self.canvases.append(base[: self.rows].detach().clone())
        self.cols.append(x.storage_offset() - base.storage_offset())

    def _post(self, _m, args, kwargs, output):
        if self.score is None:
            return
        sc = self.score(output.logits.detach())
        full = torch.full(self.canvases[-1].shape, float("-inf"), dtype=sc.dtype)
        c0 = self.cols[-1]
        full[:, c0 : c0 + sc.shape[1]] = sc
        self.scores.append(full)

    def remove(self):
        for h in self.handles:
            h.remove()


def regions_from_steps(steps, block_length: int):
    """Block (generation offsets) of each forward, from the first position it committed (Fast-dLLM's blocks
    commit at least one token per forward; an empty forward keeps the previous block)."""
    out, cur = [], (0, block_length)
    for s in steps:
        first = min((min(r) for r in s if r), default=None)
        if first is not None:
            lo = first // block_length * block_length
            cur = (lo, lo + block_length)
        out.append(cur)
    return out


FASTDLLM_FUNCS = {"none": "generate", "prefix": "generate_with_prefix_cache", "dual": "generate_with_dual_cache"}


def run_fastdllm(fd, ref_model, cid, rows, params):
    """``params``: the generator's keyword arguments plus ``cache`` (``none``/``prefix``/``dual``, which
    function ran) and ``seed`` (global RNG)."""
    kw = {k: v for k, v in params.items() if k not in ("seed", "cache")}
    ids = torch.tensor(rows)
    score = proposal_prob(torch.float64, temperature=params["temperature"])
    hooks = Hooks(ref_model, len(rows), score)
    torch.manual_seed(params.get("seed", 0))
    try:
        out, nfe = getattr(fd, FASTDLLM_FUNCS[params["cache"]])(ref_model, ids, **kw)
    finally:
        hooks.remove()
    P = ids.shape[1]
    gen = out[:, P:]
    check_no_mask(gen, params["mask_id"], cid)
    if nfe != len(hooks.canvases):
        raise SystemExit(f"case {cid}: the reference counted {nfe} forwards, its model ran {len(hooks.canvases)}")
    steps = gc.steps_from_canvases(hooks.canvases, gen, P, params["mask_id"])
    return case_record(cid, rows, params, gen, hooks, P, params["mask_id"],
                       regions=regions_from_steps(steps, params["block_length"]))


def fastdllm_cases(model, prompts):
    base = dict(mask_id=model.mask_id, temperature=0.0, remasking="low_confidence", threshold=None, factor=None)
    blk = dict(steps=32, gen_length=32, block_length=8)
    cases = []
    for cache in ("none", "prefix", "dual"):
        cases += [
            (f"{cache}_threshold", [prompts[0]], dict(base, **blk, cache=cache, threshold=0.9)),
            (f"{cache}_threshold_07", [prompts[1]], dict(base, **blk, cache=cache, threshold=0.7)),
            (f"{cache}_factor", [prompts[2]], dict(base, **blk, cache=cache, factor=1.0)),
            (f"{cache}_quota", [prompts[3]], dict(base, steps=16, gen_length=32, block_length=16, cache=cache)),
        ]
    cases += [
        ("none_threshold_one_block", [prompts[1]], dict(base, steps=32, gen_length=32, block_length=32, cache="none",
                                                        threshold=0.9)),
        ("none_threshold_t06", [prompts[2]], dict(base, **blk, cache="none", threshold=0.9, temperature=0.6, seed=4)),
        ("none_threshold_batch2", same_len(prompts[0], prompts[3]), dict(base, **blk, cache="none",
                                                                                     threshold=0.9)),
    ]
    return cases


def fastdllm_2506_cases(model, prompts):
    base = dict(mask_id=model.mask_id, temperature=0.0, remasking="low_confidence", threshold=None)
    blk = dict(steps=32, gen_length=32, block_length=8)
    cases = []
    for cache in ("none", "prefix", "dual"):
        cases += [
            (f"{cache}_threshold", [prompts[0]], dict(base, **blk, cache=cache, threshold=0.9)),
            (f"{cache}_threshold_05", [prompts[1]], dict(base, **blk, cache=cache, threshold=0.5)),
            (f"{cache}_quota", [prompts[3]], dict(base, steps=16, gen_length=32, block_length=16, cache=cache)),
        ]
    return cases


def record_fastdllm_2506(ref_dir: Path):
    """The pre-batch Fast-dLLM generators (24cc59e, June 2025): batch 1, no factor rule, and the cached
    generators check whether the block is done after their forward, not before it."""
    sys.path.insert(0, str(ref_dir / "llada"))
    fd = importlib.import_module("generate")
    reference = {"repo": "NVlabs/Fast-dLLM", "commit": "24cc59e75f20a6384bae8c905965bb090b96388e",
                 "file": "llada/generate.py",
                 "function": "generate / generate_with_prefix_cache / generate_with_dual_cache (params.cache)"}
    for label, model, prompts, _ in models():
        ref_model = reference_llada("model", model)
        cases = [run_fastdllm(fd, ref_model, cid, rows, params)
                 for cid, rows, params in fastdllm_2506_cases(model, prompts)]
        save("fastdllm-2506", label, reference, model, cases)


def record_fastdllm(ref_dir: Path):
    sys.path.insert(0, str(ref_dir))
    fd = importlib.import_module("llada.generate")
    reference = {"repo": "NVlabs/Fast-dLLM", "commit": "f6b35ec3f1b16e1b3d3357938046559ae2d350fa",
                 "file": "llada/generate.py",
                 "function": "generate / generate_with_prefix_cache / generate_with_dual_cache (params.cache)"}
    for label, model, prompts, _ in models():
        ref_model = reference_llada("llada.model", model)
        cases = [run_fastdllm(fd, ref_model, cid, rows, params) for cid, rows, params in fastdllm_cases(model, prompts)]
        save("fastdllm", label, reference, model, cases)


# ----------------------------------------------------------------------------------------- dKV-Cache-Decode
class DKVHooks(Hooks):
    """dKV-Cache-Decode's partial forward gets ``x[~prv_transfer_idx]`` (a copy, not a view) right after
    ``model.get_pos_rotary_embedding_cache(~prv_transfer_idx)``: that call is observed to know which canvas
    rows the forward computes; the canvas is the previous one with those rows taken from the input (the
    other rows were decoded two or more steps earlier and have not changed since)."""

    def __init__(self, model, rows: int, score=None):
        super().__init__(model, rows, score)
        self.pending = None
        self.computed: list[list[list[int]]] = []
        self.prompt_len = 0
        original = model.get_pos_rotary_embedding_cache

        def observe(transfer_idx):
            self.pending = transfer_idx.detach().clone()
            return original(transfer_idx)

        model.get_pos_rotary_embedding_cache = observe
        self._restore = lambda: delattr(model, "get_pos_rotary_embedding_cache")

    def _pre(self, _m, args, kwargs):
        x = args[0] if args else kwargs["input_ids"]
        if self.pending is None:
            self.canvases.append(x[: self.rows].detach().clone())
            T = x.shape[1]
            rows = [list(range(T - self.prompt_len))] * self.rows
        else:
            canvas = self.canvases[-1].clone()
            canvas[self.pending] = x.reshape(-1)
            self.canvases.append(canvas)
            rows = [(r[self.prompt_len:]).nonzero().flatten().tolist() for r in self.pending]
        self.computed.append(rows)
        self.cols.append(0)

    def _post(self, _m, args, kwargs, output):
        if self.score is not None:
            sc = self.score(output.logits.detach())
            full = torch.full(self.canvases[-1].shape, float("-inf"), dtype=sc.dtype)
            if self.pending is None:
                full = sc
            else:
                full[self.pending] = sc.reshape(-1)
            self.scores.append(full)
        self.pending = None

    def remove(self):
        super().remove()
        self._restore()


def run_dkv(dkv, ref_model, cid, rows, params):
    """``params``: the keyword arguments of dKV-Cache's LLaDA ``generate`` (``enable_cache`` always true)."""
    ids = torch.tensor(rows)
    score = proposal_prob(torch.float64, temperature=params["temperature"])
    hooks = DKVHooks(ref_model, len(rows), score)
    hooks.prompt_len = ids.shape[1]
    torch.manual_seed(params.get("seed", 0))
    try:
        out = dkv.generate(ref_model, None, ids, **{k: v for k, v in params.items() if k != "seed"})
    finally:
        hooks.remove()
    P = ids.shape[1]
    gen = out[:, P:]
    check_no_mask(gen, params["mask_id"], cid)
    nb = params["gen_length"] // params["block_length"]
    regions = fixed_regions([params["steps"] // nb] * nb, params["block_length"])
    case = case_record(cid, rows, params, gen, hooks, P, params["mask_id"], regions=regions)
    case["computed"] = hooks.computed
    return case


def dkv_cases(model, prompts):
    base = dict(mask_id=model.mask_id, temperature=0.0, cfg_scale=0.0, remasking="low_confidence", enable_cache=True)
    return [
        # steps per block not a multiple of cache_reloading_step: 10 per block, refresh every 4
        ("b16_s10_r4", [prompts[0]], dict(base, steps=20, gen_length=32, block_length=16, cache_reloading_step=4)),
        ("b8_s8_r3", [prompts[1]], dict(base, steps=32, gen_length=32, block_length=8, cache_reloading_step=3)),
        ("one_block_s12_r8", [prompts[2]], dict(base, steps=12, gen_length=24, block_length=24,
                                                cache_reloading_step=8)),
        ("b16_s6_r4_two_per_step", [prompts[3]], dict(base, steps=12, gen_length=32, block_length=16,
                                                      cache_reloading_step=4)),
    ]


def record_dkv(ref_dir: Path):
    sys.path.insert(0, str(ref_dir))
    dkv = importlib.import_module("generation_utils.llada_dkv_cache_decode")
    reference = {"repo": "horseee/dKV-Cache", "commit": "49a76fcc43b744ec2d960137f216e419317138b1",
                 "file": "generation_utils/llada_dkv_cache_decode.py (models/modeling_llada_dkv_cache_decode.py)",
                 "function": "generate"}
    for label, model, prompts, _ in models():
        ref_model = reference_llada("models", model, "modeling_llada_dkv_cache_decode")
        cases = [run_dkv(dkv, ref_model, cid, rows, params) for cid, rows, params in dkv_cases(model, prompts)]
        save("dkv-decode", label, reference, model, cases)


# ---------------------------------------------------------------------------------------------------- dInfer
def dinfer_modules(ref_dir: Path):
    """dInfer's decoding modules, imported without running ``dinfer/__init__.py`` (which pulls in the serving
    stack): the two packages are registered by path first."""
    root = ref_dir / "python" / "dinfer"
    for name, path in (("dinfer", root), ("dinfer.decoding", root / "decoding")):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [str(path)]
            sys.modules[name] = mod
    return tuple(importlib.import_module(f"dinfer.decoding.{m}") for m in ("parallel_strategy", "generate_uniform",
                                                                             "utils"))


def run_dinfer(mods, model, cid, rows, params):
    """``params``: ``decoder`` (``threshold`` / ``credit``) and the decoder's, ``BlockWiseDiffusionLLM``'s and
    ``generate``'s keyword arguments. dInfer stops after the first block in which every row holds EOS
    (``early_stop`` only decides whether the rest is filled with EOS), so every case uses ``early_stop=True``."""
    ps, gu, ut = mods
    dec_kw = dict(temperature=params["temperature"], threshold=params["threshold"], mask_id=model.mask_id,
                  eos_id=model.eos_id)
    if params["decoder"] == "credit":
        decoder = ps.CreditThresholdParallelDecoder(credit_alpha=params["credit_alpha"],
                                                    boost_gamma=params["boost_gamma"],
                                                    decay_beta=params["decay_beta"], **dec_kw)
        score = None  # the confidence comes from the credit-fused logits (no tie check)
    else:
        decoder = ps.ThresholdParallelDecoder(**dec_kw)
        score = proposal_prob(torch.float32, temperature=params["temperature"])
    arrays = []
    decode = decoder.decode

    def keep_array(logits, block_start, block_end, x, *a, **k):  # the TokenArray holding the canvas
        if not arrays:
            arrays.append(x)
        return decode(logits, block_start, block_end, x, *a, **k)

    decoder.decode = keep_array
    rec = Recorder(model, len(rows), score)
    llm = gu.BlockWiseDiffusionLLM(rec, decoder, ut.BlockIteratorFactory(), early_stop=params["early_stop"],
                                   maximum_unroll=params["maximum_unroll"], expected_tpf=params["expected_tpf"])
    ids = torch.tensor(rows)
    torch.manual_seed(params.get("seed", 0))
    llm.generate(ids, gen_length=params["gen_length"], block_length=params["block_length"])
    P = ids.shape[1]
    gen = arrays[0].data[:, P:]
    check_no_mask(gen, model.mask_id, cid)
    if llm.num_forwards != len(rec.canvases):
        raise SystemExit(f"case {cid}: dInfer counted {llm.num_forwards} forwards, its model ran {len(rec.canvases)}")
    steps = gc.steps_from_canvases(rec.canvases, gen, P, model.mask_id)
    return case_record(cid, rows, params, gen, rec, P, model.mask_id,
                       regions=regions_from_steps(steps, params["block_length"]))


def dinfer_cases(model, prompts):
    base = dict(decoder="threshold", temperature=0.0, threshold=0.9, early_stop=True, maximum_unroll=1,
                expected_tpf=8, gen_length=32, block_length=8)
    credit = dict(base, decoder="credit", credit_alpha=0.7, boost_gamma=0.2, decay_beta=0.8)
    return [
        ("threshold", [prompts[0]], dict(base)),
        ("threshold_07_b16", [prompts[1]], dict(base, threshold=0.7, block_length=16)),
        ("threshold_unroll4", [prompts[2]], dict(base, maximum_unroll=4)),
        ("threshold_b16", [prompts[3]], dict(base, block_length=16)),
        ("threshold_batch2", same_len(prompts[0], prompts[3]), dict(base)),
        ("credit", [prompts[0]], dict(credit)),
        ("credit_b32", [prompts[1]], dict(credit, block_length=32)),
        ("credit_tau07", [prompts[2]], dict(credit, threshold=0.7, block_length=16)),
    ]


def record_dinfer(ref_dir: Path):
    mods = dinfer_modules(ref_dir)
    reference = {"repo": "inclusionAI/dInfer", "commit": "fce4e32804103baa5d55230dff0352da0cdd6ceb",
                 "file": "python/dinfer/decoding/parallel_strategy.py (+ generate_uniform.py BlockWiseDiffusionLLM)",
                 "function": "ThresholdParallelDecoder / CreditThresholdParallelDecoder (params.decoder)"}
    for label, model, prompts, _ in models():
        cases = [run_dinfer(mods, model, cid, rows, params) for cid, rows, params in dinfer_cases(model, prompts)]
        save("dinfer", label, reference, model, cases)


# ---------------------------------------------------------------------------------------------------- common
def models():
    tiny = tiny_llada()
    yield "llada-tiny", tiny, tiny_prompts(tiny), False
    shaped = gm.shaped_llada(SHAPED_SEED)
    yield "shaped-llada", shaped, gm.shaped_prompts("llada", [14, 9, 21, 17], SHAPED_SEED), True


def save(ref_name, label, reference, model, cases):
    model_field = label if label != "shaped-llada" else {"shaped": "llada", "seed": SHAPED_SEED}
    data = {"reference": reference, "model": model_field, "weights_sha256": gc.state_sha256(model), "cases": cases}
    path = gc.save_fixture(f"{ref_name}_{label}", data)
    print(f"wrote {path} ({path.stat().st_size // 1024} KB, {len(cases)} cases)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reference", choices=["llada", "fastdllm", "fastdllm-2506", "dkv", "dinfer"])
    p.add_argument("--ref-dir", type=Path, required=True, help="root of a checkout of the reference repository")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with torch.no_grad():
        {"llada": record_llada, "fastdllm": record_fastdllm, "dkv": record_dkv, "fastdllm-2506": record_fastdllm_2506,
         "dinfer": record_dinfer}[args.reference](args.ref_dir)


if __name__ == "__main__":
    main()
