"""AR-guided unmasking (dllm/samplers/guided.py): exactness against transformers' greedy decoding, the top-k
relative rule, EOS stop, batch invariance, tokenizer checks, block policies and caches, bundled models."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import refused
from conftest import EOS, EOT, MASK, VOCAB, ragged_prompts, random_model

from dllm import generate
from dllm.samplers import get_sampler
from dllm.samplers.guided import GuidedSampler, check_tokenizers, guided_summary

G = 24


def random_guide(vocab: int = VOCAB, seed: int = 0, std: float = 0.3):
    """A random-weight LlamaForCausalLM over the test vocabulary, with peaked (tie-free) distributions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, eos_token_id=EOS, pad_token_id=EOS, bos_token_id=0)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return m.eval().requires_grad_(False)


def hf_greedy(guide, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy decoding of one prompt, cut after the first stop token (mask id suppressed:
    generate never writes it)."""
    out = guide.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, eos_token_id=[EOS, EOT], pad_token_id=EOS,
                         suppress_tokens=[MASK])[0, len(prompt):].tolist()
    cut = next((i + 1 for i, t in enumerate(out) if t in (EOS, EOT)), len(out))
    return out[:cut]


def check_against_greedy(seqs: torch.Tensor, refs: list[list[int]]) -> None:
    for row, ref in zip(seqs.tolist(), refs):
        assert row[: len(ref)] == ref
        if ref and ref[-1] in (EOS, EOT):  # stopped: EOS everywhere after the stop
            assert all(t == EOS for t in row[len(ref):])
        else:
            assert len(ref) == len(row)


class Oracle:
    """A guided sampler whose dLLM drafts ``ref`` (the guide's own text) wherever the canvas is masked."""

    name = "oracle"

    def __init__(self, inner, ref):
        self.inner, self.ref = inner, ref

    def step(self, logits, ctx):
        want = torch.full((1, ctx.canvas_len), EOS)
        want[0, ctx.gen_lo : ctx.gen_lo + len(self.ref)] = torch.tensor(self.ref)
        cols = want[:, ctx.win_lo : ctx.win_lo + logits.shape[1]]
        fake = torch.full_like(logits, -10.0).scatter(-1, cols[..., None], 10.0)
        return self.inner.step(fake, ctx)

    def bind_model(self, m):
        self.inner.bind_model(m)


@pytest.mark.parametrize("batch", [1, 3])
def test_deterministic_reproduces_hf_greedy(family, batch):
    model = random_model(family)
    guide = random_guide()
    prompts = ragged_prompts(batch, seed=1)
    sampler = GuidedSampler((guide, None), mode="deterministic", chunk=5)
    out = generate(model, prompts, sampler=sampler, gen_length=G)
    check_against_greedy(out.sequences, [hf_greedy(guide, p, G) for p in prompts])
    s = guided_summary(out.stats)
    assert s["dllm_forwards"] == out.stats.nfe and s["ar_forwards"] >= out.stats.nfe
    assert 0.0 <= s["acceptance_rate"] <= 1.0 and s["drafts_verified"] >= s["drafts_accepted"]


def test_deterministic_accepts_guide_drafts_in_chunks():
    """A dLLM that drafts exactly the guide's greedy text gets it all accepted: one dLLM forward, one guide
    forward per chunk, no correction."""
    model = random_model("llada")
    guide = random_guide(seed=3)
    prompt = ragged_prompts(1, seed=4)[0]
    ref = hf_greedy(guide, prompt, G)
    n = len(ref)

    inner = GuidedSampler((guide, None), chunk=8)
    out = generate(model, [prompt], sampler=Oracle(inner, ref), gen_length=G)
    check_against_greedy(out.sequences, [ref])
    s = guided_summary(out.stats)
    assert s["corrections"] == 0 and s["dllm_forwards"] == 1
    assert s["ar_forwards"] == -(-n // 8)  # ceil: chunks of 8 up to the stop (or the end)
    assert s["acceptance_rate"] == 1.0


@pytest.mark.parametrize("cache,block", [("dual", 8), ("prefix", 8), (None, 8), ("dkv-decode", None)])
def test_deterministic_with_blocks_and_caches(cache, block):
    model = random_model("llada", seed=2)
    guide = random_guide(seed=2)
    prompts = ragged_prompts(3, seed=5)
    out = generate(model, prompts, sampler=GuidedSampler((guide, None), chunk=4), cache=cache, gen_length=G,
                   block_length=block)
    check_against_greedy(out.sequences, [hf_greedy(guide, p, G) for p in prompts])
    if block:  # regions never cross a block boundary
        for rec in out.stats.trace:
            assert all(h - lo <= block for lo, h in zip(rec["lo"], rec["hi"]) if h - lo < G)


def _guide_probs(guide, prompt: list[int], gen: list[int]) -> torch.Tensor:
    """p_guide over the vocabulary (mask excluded) for every generated position, from one full forward."""
    ids = torch.tensor([prompt + gen])
    lg = guide(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + len(gen) - 1].float()
    lg[:, MASK] = float("-inf")
    return torch.softmax(lg, -1)


class SecondChoiceDrafts:
    """Test dLLM stand-in: at each row's first mask it drafts the guide's *second* choice, then the guide's
    greedy continuation, so the top-k relative rule (not the guide's argmax) decides what is committed."""

    name = "second-choice"

    def __init__(self, inner, guide, prompts):
        self.inner, self.guide, self.lens = inner, guide, [len(p) for p in prompts]

    def bind_model(self, m):
        self.inner.bind_model(m)

    def step(self, logits, ctx):
        fake = torch.full_like(logits, -10.0)
        P = ctx.gen_lo
        for b in range(logits.shape[0]):
            if not bool(ctx.cand[b].any()):
                continue
            f = ctx.win_lo + int(ctx.cand[b].long().argmax())
            prefix = ctx.canvas[b, P - self.lens[b] : f].tolist()
            lg = self.guide(input_ids=torch.tensor([prefix])).logits[0, -1]
            lg[MASK] = float("-inf")
            second = int(torch.topk(lg, 2).indices[1])
            rest = ctx.win_lo + logits.shape[1] - f - 1
            cont = self.guide.generate(torch.tensor([prefix + [second]]), do_sample=False, max_new_tokens=max(rest, 1),
                                       min_new_tokens=max(rest, 1), pad_token_id=EOS, suppress_tokens=[MASK])
            drafts = [second] + cont[0, len(prefix) + 1 :].tolist()
            for j, t in enumerate(drafts[: rest + 1]):
                fake[b, f - ctx.win_lo + j, t] = 10.0
        return self.inner.step(fake, ctx)


@pytest.mark.parametrize("k,r,oracle", [(2, 0.5, True), (6, 0.05, False), (2, 0.5, False)])
def test_topk_commits_only_rule_satisfying_drafts_or_corrections(k, r, oracle):
    model = random_model("dream", seed=1)
    guide = random_guide(seed=1, std=0.1 if oracle else 0.15)  # flatter: drafts pass the rule often enough
    prompts = ragged_prompts(3, seed=2)
    sampler = GuidedSampler((guide, None), mode="topk", k=k, r=r, chunk=6, record=True)
    if oracle:
        sampler = SecondChoiceDrafts(sampler, guide, prompts)
    out = generate(model, prompts, sampler=sampler, gen_length=G)
    P = max(len(p) for p in prompts)
    n_drafts = n_non_argmax = n_corr = 0
    for b, prompt in enumerate(prompts):
        row = out.sequences[b].tolist()
        stop = next((i + 1 for i, t in enumerate(row) if t in (EOS, EOT)), len(row))
        probs = _guide_probs(guide, prompt, row[:stop])
        kinds = {}
        for rec in out.stats.trace:  # the recorded decision of every committed column
            lo = rec["win_lo"]
            for j, (kd, dr) in enumerate(zip(rec["guide_kind"][b], rec["guide_draft"][b])):
                if kd:
                    assert lo + j not in kinds, "a column was committed twice"
                    kinds[lo + j] = (kd, dr)
        assert all(P + i in kinds for i in range(stop))
        for i in range(stop):
            kd, dr = kinds[P + i]
            p = probs[i]
            tok = row[i]
            if kd == 1:  # accepted draft: the dLLM's draft, in the guide's top-k with p >= r * p_top1
                assert tok == dr
                assert tok in torch.topk(p, k).indices.tolist()
                assert p[tok] >= r * p.max() - 1e-6
                n_drafts += 1
                n_non_argmax += int(tok != int(p.argmax()))
            else:  # correction: the guide's argmax
                assert kd == 2 and tok == int(p.argmax())
                n_corr += 1
        assert all(t == EOS for t in row[stop:])
    assert n_drafts + n_corr > 0
    if not oracle and r == 0.5:  # random drafts mostly fail the default rule: the guide corrects them
        assert n_corr > 0
    if oracle or r < 0.5:  # drafts that are not the guide's argmax get accepted: the rule decides, not greedy
        assert n_drafts > 0 and n_non_argmax > 0


def test_stops_at_eos():
    """A guide that always predicts EOS: the first token is EOS, everything after is EOS, one guide forward."""
    model = random_model("llada")
    guide = random_guide()

    class AlwaysEOS(torch.nn.Module):
        def __init__(self, g):
            super().__init__()
            self.g, self.config = g, g.config

        @property
        def device(self):
            return self.g.device

        def forward(self, **kw):
            out = self.g(**kw)
            out.logits[..., EOS] = 1e4
            return out

    for block in (None, 8):
        out = generate(model, ragged_prompts(2), sampler=GuidedSampler((AlwaysEOS(guide), None)), gen_length=G,
                       block_length=block)
        assert (out.sequences == EOS).all()
        s = guided_summary(out.stats)
        assert s["ar_forwards"] == 1 and out.stats.nfe <= 2


def test_batch_invariance():
    model = random_model("dream", seed=3)
    guide = random_guide(seed=4, std=0.15)
    prompts = ragged_prompts(4, seed=6)
    for mode in ("deterministic", "topk"):
        kw = {"mode": mode, "chunk": 3, "k": 3, "r": 0.2}
        both = generate(model, prompts, sampler=GuidedSampler((guide, None), **kw), gen_length=G, block_length=8)
        for b, p in enumerate(prompts):
            one = generate(model, [p], sampler=GuidedSampler((guide, None), **kw), gen_length=G, block_length=8)
            assert one.sequences[0].tolist() == both.sequences[b].tolist(), (mode, b)


def test_preset_and_generate_guide_argument():
    model = random_model("llada")
    guide = random_guide()
    prompts = ragged_prompts(2, seed=7)
    a = generate(model, prompts, guide=(guide, None), gen_length=G)
    b = generate(model, prompts, sampler=get_sampler("guided", guide=(guide, None), chunk=3), gen_length=G)
    assert a.sequences.tolist() == b.sequences.tolist()
    check_against_greedy(a.sequences, [hf_greedy(guide, p, G) for p in prompts])
    with pytest.raises(ValueError, match="guide=... works with the guided sampler"):
        generate(model, prompts, sampler="llada", guide=(guide, None), gen_length=G)
    with pytest.raises(ValueError, match="unknown guide mode"):
        get_sampler("guided", mode="greedy")


def test_tokenizer_mismatch_is_a_clear_error():
    from transformers import AutoTokenizer

    from dllm.assets import model_path
    from dllm.models import load_model

    model = load_model(model_path("llada-tiny"))
    tok = AutoTokenizer.from_pretrained(str(model_path("llada-tiny")))
    guide = random_guide(vocab=len(tok) + 1)
    check_tokenizers(model, guide, tok)  # same tokenizer: fine
    other = AutoTokenizer.from_pretrained(str(model_path("llada-tiny")))
    other.add_tokens(["<|extra|>"])
    n = len(tok)
    with pytest.raises(ValueError, match=f"does not match the dLLM's.*vocabulary sizes {n} .dLLM. vs {n + 1}"):
        check_tokenizers(model, guide, other)
    with pytest.raises(ValueError, match="does not match"):
        generate(model, "Please copy the list exactly: [\"Ann Lee\"]", guide=(guide, other), gen_length=8)
    small = random_guide(vocab=100)  # a guide that cannot predict the whole vocabulary
    with pytest.raises(ValueError, match="predicts 100 token ids"):
        check_tokenizers(model, small, None)


def test_guide_cache_shares_loaded_guides_and_drops_the_oldest(monkeypatch):
    """GuideCache: one load per (guide, dtype); beyond max_size the guide loaded first is dropped (a sampler
    holding it keeps it); samplers taking their guide from the cache share the model, the tokenizer and the
    tokenizer check (once per dLLM); a guide given as a loaded model is not taken from the cache."""
    from types import SimpleNamespace

    from dllm.samplers import guided

    loads, checks = [], []

    def load(guide, dtype=None):
        loads.append((str(guide), dtype))
        return torch.nn.Linear(1, 1), "tok"

    monkeypatch.setattr(guided, "load_guide", load)
    monkeypatch.setattr(guided, "check_tokenizers", lambda model, g, tok: checks.append(id(model)))
    cache = guided.GuideCache(max_size=2)
    a = cache.get("a")
    assert cache.get("a") is a and a.tokenizer == "tok" and loads == [("a", None)]
    a16 = cache.get("a", "bfloat16")  # the dtype is part of the key
    assert a16.model is not a.model
    b = cache.get("b")  # a third guide: "a" (loaded first) is dropped
    assert cache.get("a", "bfloat16") is a16 and cache.get("b") is b and len(loads) == 3
    assert cache.get("a").model is not a.model and len(loads) == 4  # loaded again; now "a" in bfloat16 went
    assert cache.get("a", "bfloat16") is not a16 and len(loads) == 5

    s1, s2 = GuidedSampler("c"), GuidedSampler("c", mode="topk", chunk=4)
    assert s1.use_guide_cache(cache) and s2.use_guide_cache(cache) and len(loads) == 6
    assert s1.guide_model() == s2.guide_model() == (cache.get("c").model, "tok")
    dllm_model = SimpleNamespace()  # no device: nothing to move
    s1.bind_model(dllm_model)
    s2.bind_model(dllm_model)
    assert checks == [id(dllm_model)]  # the tokenizer check ran once for both
    own = GuidedSampler((b.model, None))
    assert not own.use_guide_cache(cache) and own.guide_model() == (b.model, None)
    with pytest.raises(ValueError, match="max_size"):
        guided.GuideCache(0)


def test_ar_training_batch_labels_cover_answer_and_end_of_turn():
    from dllm.tiny.train_ar import IGNORE, make_batch

    ids, att, labels = make_batch([([5, 6, 7], [10, 11]), ([8], [12, 13, 14])], pad_id=0, eot_ids=[4, 7])
    assert ids.tolist() == [[5, 6, 7, 10, 11, 4], [8, 12, 13, 14, 7, 0]]
    assert att.tolist() == [[1] * 6, [1] * 5 + [0]]
    assert labels.tolist() == [[IGNORE] * 3 + [10, 11, 4], [IGNORE, 12, 13, 14, 7, IGNORE]]


# ---- bundled checkpoints: llada-tiny / dream-tiny drafting, ar-tiny verifying --------------------------------


def _bundled():
    from dllm.assets import model_path
    from dllm.evals import tasks as T
    from dllm.models import load_model
    from dllm.samplers.guided import load_guide

    guide, gtok = load_guide("ar-tiny")
    exs = T.generate("waiting_line/copy", 2, 12345) + T.generate("arithmetic/addition", 1, 12345)
    return load_model, model_path, guide, gtok, [ex.messages for ex in exs]


@pytest.mark.parametrize("family,cache,block", [("llada", None, None), ("llada", "dual", 8), ("dream", "prefix", 16)])
def test_bundled_guided_equals_guide_greedy(family, cache, block):
    load_model, model_path, guide, gtok, convs = _bundled()
    model = load_model(model_path(f"{family}-tiny"))
    from dllm.generate import prepare_prompts

    prompts = prepare_prompts(model, convs)
    assert len({len(p) for p in prompts}) > 1  # ragged
    stops = [model.eos_id, model.eot_id]
    out = generate(model, convs, sampler=get_sampler("guided", guide="ar-tiny"), cache=cache, gen_length=32,
                   block_length=block)
    for row, p in zip(out.sequences.tolist(), prompts):
        ref = guide.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                             max_new_tokens=32, eos_token_id=stops, pad_token_id=model.eos_id,
                             suppress_tokens=[model.mask_id])[0, len(p):].tolist()
        cut = next((i + 1 for i, t in enumerate(ref) if t in stops), len(ref))
        assert row[:cut] == ref[:cut]
        assert all(t == model.eos_id for t in row[cut:])
    s = guided_summary(out.stats)
    assert s["ar_forwards"] > 0 and s["dllm_forwards"] == out.stats.nfe


def test_cli_generate_with_guide(capsys):
    import json

    from dllm.cli import main

    rc = main(["generate", "--guide", "ar-tiny", "--guide-mode", "topk", "--gen-length", "16", "--json",
               'Please copy the list exactly: ["Alice Baker", "Henry Quinn", "Nora Walsh"]'])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["guided"]["ar_forwards"] >= 1 and out["guided"]["dllm_forwards"] == out["nfe"]
    assert 0 <= out["guided"]["acceptance_rate"] <= 1
    refused(capsys, ["generate", "--sampler", "llada", "--guide", "ar-tiny", "x"], "need the guided sampler")


@pytest.mark.parametrize("compact", [False, True])
def test_guide_cache_with_holes_matches_clean_forward(compact):
    """The shared guide cache with masked-out slots (rejected drafts, ragged feeds), cropped or packed, gives
    each row the logits of a clean forward over its own tokens."""
    from transformers import DynamicCache

    from dllm.models.hf import cache_argument
    from dllm.samplers.guided import _compact, _crop

    guide = random_guide(seed=9)
    kv = cache_argument(guide)  # the cache's argument name in this transformers version
    g = torch.Generator().manual_seed(0)
    r0, r1 = torch.randint(3, 90, (9,), generator=g), torch.randint(3, 90, (11,), generator=g)
    st = {"cache": DynamicCache(config=guide.config)}
    # feed 1: row 0 has 5 real tokens then 3 rejected drafts (junk); row 1 has 8 real tokens
    ids = torch.stack([torch.cat([r0[:5], torch.tensor([7, 8, 9])]), r1[:8]])
    slots = torch.tensor([[1] * 5 + [0] * 3, [1] * 8], dtype=torch.bool)
    pos = torch.stack([torch.tensor([0, 1, 2, 3, 4, 0, 0, 0]), torch.arange(8)])
    guide(input_ids=ids, attention_mask=slots.long(), position_ids=pos, use_cache=True, **{kv: st["cache"]})
    # feed 2: row 0 continues (2 tokens), row 1 feeds 1 token + 1 junk slot
    ids2 = torch.stack([r0[5:7], torch.tensor([r1[8], 5])])
    new = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    att = torch.cat([slots, new], 1)
    guide(input_ids=ids2, attention_mask=att.long(), position_ids=torch.tensor([[5, 6], [8, 0]]), use_cache=True,
          **{kv: st["cache"]})
    st["slots"] = att
    if compact:
        _compact(st, force=True)
        assert st["slots"].shape[1] == 9 and st["cache"].get_seq_length() == 9
    else:
        _crop(st["cache"], 10)  # a no-op crop keeps everything
    # feed 3: the next two tokens of each row
    ids3 = torch.stack([r0[7:9], r1[9:11]])
    att3 = torch.cat([st["slots"], torch.ones(2, 2, dtype=torch.bool)], 1)
    out = guide(input_ids=ids3, attention_mask=att3.long(), position_ids=torch.tensor([[7, 8], [9, 10]]),
                use_cache=True, **{kv: st["cache"]}).logits
    for b, r in enumerate((r0, r1)):
        clean = guide(input_ids=r[None]).logits[0, -2:]
        torch.testing.assert_close(out[b], clean, atol=1e-5, rtol=1e-5)


def test_train_tiny_ar_writes_a_transformers_guide(tmp_path):
    """`dllm train-tiny --family ar`: a few steps (on streamed fresh examples, --examples-per-task 0) write a
    LlamaForCausalLM with the dLLMs' tokenizer, usable as a guide; --init-from continues from its weights."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import dllm.tiny.train_ar as train_ar
    from dllm.assets import model_path
    from dllm.cli import main
    from dllm.models import load_model

    rc = main(["train-tiny", "--family", "ar", "--out", str(tmp_path / "ar"), "--steps", "2", "--batch-size", "2",
               "--d-model", "16", "--layers", "1", "--heads", "2", "--mlp", "32", "--threads", "1",
               "--examples-per-task", "0", "--tokenizer-layout", "list-items"])  # the bundled dLLMs' tokenizer layout
    assert rc == 0
    summary = json.loads((tmp_path / "ar" / "training.json").read_text())
    assert summary["steps_done"] == 2 and summary["final_loss"] > 0
    guide = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ar"))
    assert guide.config.model_type == "llama" and guide.config.num_hidden_layers == 1
    model = load_model(model_path("llada-tiny"))
    check_tokenizers(model, guide, AutoTokenizer.from_pretrained(str(tmp_path / "ar")))
    out = generate(model, ["What is 1 + 2?"], guide=str(tmp_path / "ar"), gen_length=8)
    assert out.sequences.shape == (1, 8)
    cont = train_ar.train(train_ar.ARTrainConfig(d_model=16, n_layers=1, n_heads=2, mlp_hidden=32, steps=1, batch_size=2, lr=0.0,
                               examples_per_task=2, init_from=str(tmp_path / "ar"), list_item_tokens=True),
                          tmp_path / "cont")
    assert cont["steps_done"] == 1
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "cont"))
    for (n, a), (_, b) in zip(guide.state_dict().items(), again.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6), n


def test_train_tiny_ar_save_every_and_dllm_only_options(tmp_path, monkeypatch, capsys):
    """The ar trainer writes its checkpoint every --save-every steps (not only at the end), and the options that
    only the dLLM trainer reads are refused for --family ar instead of being ignored."""
    import dllm.tiny.train_ar as train_ar

    saved = []
    real_save = train_ar._save

    def spy(model, tok, out_dir, cfg, step, *rest):
        saved.append(step)
        return real_save(model, tok, out_dir, cfg, step, *rest)

    monkeypatch.setattr(train_ar, "_save", spy)
    summary = train_ar.train(train_ar.ARTrainConfig(d_model=16, n_layers=1, n_heads=2, mlp_hidden=32, steps=5,
                                                    batch_size=2, examples_per_task=0, list_item_tokens=True,
                                                    save_every=2), tmp_path / "ar")
    assert saved == [2, 4, 5] and summary["steps_done"] == 5
    assert (tmp_path / "ar" / "model.safetensors").exists()
    for extra in (["--eval-every", "5"], ["--task-mix", "adaptive"], ["--no-curriculum"], ["--loss", "mean"],
                  ["--eval-n", "3"], ["--tasks", "waiting_line/copy"], ["--curriculum", "chat"], ["--init-from-ar", "p"],
                  ["--shuffle-targets", "rotation"], ["--edit-targets", "last"]):
        refused(capsys, ["train-tiny", "--family", "ar", "--out", str(tmp_path / "x"), "--steps", "1", *extra], extra[0])
    assert not (tmp_path / "x").exists()


def test_guide_loads_and_runs_silently_on_the_current_transformers_api(capfd):
    """Library code prints nothing: loading a guide shows no transformers progress bar (and leaves the caller's
    setting as it was); the guide's forward takes its KV cache under the name this transformers version
    expects (no deprecation warning)."""
    import warnings

    from transformers.utils import logging as hf_logging

    from dllm.models import load_model
    from dllm.samplers.guided import load_guide

    model = load_model("llada-tiny")
    capfd.readouterr()
    for enabled in (True, False):
        (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
        guide, gtok = load_guide("ar-tiny")
        assert hf_logging.is_progress_bar_enabled() is enabled
    hf_logging.enable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        out = generate(model, ["Please copy the list exactly: [\"Alice Baker\"]"], gen_length=16, block_length=8,
                       sampler=GuidedSampler(guide=(guide, gtok)))
    assert guided_summary(out.stats)["ar_forwards"] > 0
    assert capfd.readouterr() == ("", "")


@pytest.mark.parametrize("oracle", [False, True])
def test_the_guided_sampler_synchronises_once_per_verification_round(oracle):
    """The guided sampler's own host synchronisations (on the path a CUDA run takes): one read per guide forward
    (whether a row verifies on, the widths of the feed and of the chunk, the guide cache's slots to keep) and one
    to end the step (the last of those and whether a row finished), in either mode, with drafts rejected at once
    and with drafts accepted chunk after chunk (several rounds in a step); nothing else but the guide's own mask
    checks."""
    from sync_counter import syncs_per_step

    model = random_model("llada")
    guide = random_guide(seed=3)
    prompt = ragged_prompts(1, seed=4)[0]
    ref = hf_greedy(guide, prompt, G)
    for mode in ("deterministic", "topk"):
        inner = GuidedSampler((guide, None), mode=mode, chunk=4)
        sampler = Oracle(inner, ref) if oracle else inner
        out = {}

        def run(sampler=sampler, out=out):
            out["r"] = generate(model, [prompt], sampler=sampler, gen_length=G)

        _, where, steps = syncs_per_step(run)
        reads = sum(n for (op, path, _), n in where.items() if path == "samplers/guided.py" and op == "tolist")
        forwards = guided_summary(out["r"].stats)["ar_forwards"]
        assert steps > 0 and (forwards > 2 * steps if oracle else forwards == steps), (forwards, steps)
        assert reads == forwards + steps, (mode, reads, forwards, steps, where.most_common(4))
        assert not [k for k in where if k[1] == "samplers/guided.py" and k[0] not in ("tolist", "__bool__")]
