"""train-tiny: a few steps on a toy configuration write a checkpoint that loads and generates."""

from __future__ import annotations

import json

import pytest
import torch

import dllm
from dllm.tiny.train import TrainConfig, train


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_train_tiny_writes_a_loadable_checkpoint(tmp_path, family):
    torch.set_num_threads(1)
    cfg = TrainConfig(family=family, d_model=32, n_layers=1, n_heads=2, mlp_hidden=64, steps=3, batch_size=4,
                      examples_per_task=2, warmup=1)
    summary = train(cfg, tmp_path / "ckpt")
    assert summary["steps_done"] == 3 and summary["final_loss"] > 0
    hf = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert hf["model_type"] == ("llada" if family == "llada" else "Dream")
    model = dllm.load_model(tmp_path / "ckpt", dtype=torch.float32)
    assert model.shift_logits == (family == "dream")
    assert model.tokenizer.convert_ids_to_tokens(model.mask_id) == ("<|mdm_mask|>" if family == "llada" else "<|mask|>")
    out = dllm.generate(model, ["What is 1 + 2?"], gen_length=8, steps=8)
    assert out.sequences.shape == (1, 8) and isinstance(out.texts[0], str)
    # continuing from the checkpoint starts from its weights
    cont = train(TrainConfig(**{**cfg.__dict__, "steps": 1, "lr": 0.0, "init_from": str(tmp_path / "ckpt")}),
                 tmp_path / "cont")
    assert cont["steps_done"] == 1
    again = dllm.load_model(tmp_path / "cont", dtype=torch.float32)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6), n


def test_masked_diffusion_loss_kinds():
    from dllm.tiny.train import masked_diffusion_loss

    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1]], [[0.2, 0.8], [0.5, 0.5]]]))
    target = torch.tensor([[0, 0], [1, 1]])
    masked = torch.tensor([[True, True], [False, True]])
    t = torch.tensor([0.5, 0.25])
    ce = -torch.log(torch.tensor([[0.5, 0.9], [0.8, 0.5]]))
    want_mean = (ce[0, 0] + ce[0, 1] + ce[1, 1]) / 3
    want_weighted = ((ce[0, 0] + ce[0, 1]) / 0.5 + ce[1, 1] / 0.25) / 4
    assert torch.allclose(masked_diffusion_loss(logits, target, masked, t, "mean"), want_mean)
    assert torch.allclose(masked_diffusion_loss(logits, target, masked, t), want_weighted)
    with pytest.raises(ValueError, match="unknown loss 'sum'.*weighted, mean"):
        masked_diffusion_loss(logits, target, masked, t, "sum")


def test_train_mean_loss_and_list_item_tokens(tmp_path):
    torch.set_num_threads(1)
    cfg = TrainConfig(family="llada", d_model=32, n_layers=1, n_heads=2, mlp_hidden=64, steps=2, batch_size=4,
                      examples_per_task=2, warmup=1, loss="mean", list_item_tokens=True)
    summary = train(cfg, tmp_path / "ckpt")
    assert summary["steps_done"] == 2 and summary["train_config"]["loss"] == "mean"
    model = dllm.load_model(tmp_path / "ckpt", dtype=torch.float32)
    assert model.tokenizer.convert_ids_to_tokens(model.tokenizer.encode('["Alice Adams"]', add_special_tokens=False)) \
        == ['["Alice', 'ĠAdams"]']
    with pytest.raises(ValueError, match="unknown loss"):
        train(TrainConfig(loss="sum", steps=1), tmp_path / "bad")


def test_task_sampler_family_mix_balances_families():
    import random

    from dllm.evals import tasks as T
    from dllm.tiny.train import task_sampler

    names = T.task_names()
    draws = [task_sampler(names, "family")(random.Random(0)) for _ in range(1)]
    assert draws[0] in names
    rng = random.Random(0)
    family, uniform = task_sampler(names, "family"), task_sampler(names, "uniform")
    fam_counts, uni_counts = {}, {}
    for _ in range(6000):
        f = family(rng).split("/")[0]
        u = uniform(rng).split("/")[0]
        fam_counts[f] = fam_counts.get(f, 0) + 1
        uni_counts[u] = uni_counts.get(u, 0) + 1
    # family: a third each; uniform: 10 of the 13 tasks are waiting-line operations
    assert all(abs(c / 6000 - 1 / 3) < 0.03 for c in fam_counts.values()) and len(fam_counts) == 3
    assert abs(uni_counts["waiting_line"] / 6000 - 10 / 13) < 0.03
    with pytest.raises(ValueError, match="unknown task mix 'even'.*uniform, family"):
        task_sampler(names, "even")


def test_train_chat_curriculum_family_mix_and_periodic_saves(tmp_path, monkeypatch):
    import dllm.tiny.train as tr

    torch.set_num_threads(1)
    saved = []
    real_save = tr.save_pretrained
    monkeypatch.setattr(tr, "save_pretrained", lambda model, out, **kw: (saved.append(model.training),
                                                                          real_save(model, out, **kw)))
    cfg = TrainConfig(family="dream", d_model=32, n_layers=1, n_heads=2, mlp_hidden=64, steps=5, batch_size=4,
                      examples_per_task=2, warmup=1, curriculum_name="chat", task_mix="family", save_every=2)
    summary = train(cfg, tmp_path / "ckpt")
    # saves after steps 2 and 4 and at the end, always in eval mode; training resumes in train mode in between
    assert saved == [False, False, False] and summary["steps_done"] == 5
    assert summary["train_config"]["curriculum_name"] == "chat" and summary["train_config"]["task_mix"] == "family"
    with pytest.raises(ValueError, match="unknown curriculum 'fast'.*bare, chat"):
        train(TrainConfig(curriculum_name="fast", steps=1), tmp_path / "bad")


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_train_tied_embeddings_checkpoint(tmp_path, family):
    """--tie-embeddings: the checkpoint says so in the family's own config field, stores no separate output
    matrix, loads back tied, and has one vocabulary matrix fewer than the untied model."""
    from safetensors import safe_open

    torch.set_num_threads(1)
    cfg = TrainConfig(family=family, d_model=32, n_layers=1, n_heads=2, mlp_hidden=64, steps=2, batch_size=4,
                      examples_per_task=2, warmup=1, tie_embeddings=True, list_item_tokens=True)
    summary = train(cfg, tmp_path / "ckpt")
    hf = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert hf["weight_tying" if family == "llada" else "tie_word_embeddings"] is True
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    head = "model.transformer.ff_out.weight" if family == "llada" else "lm_head.weight"
    assert head not in keys and len(keys) > 0
    model = dllm.load_model(tmp_path / "ckpt", dtype=torch.float32)
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    out = dllm.generate(model, ["What is 1 + 2?"], gen_length=8, steps=8)
    assert out.sequences.shape == (1, 8)
    untied = train(TrainConfig(**{**cfg.__dict__, "tie_embeddings": False}), tmp_path / "untied")
    assert untied["parameters"] == summary["parameters"] + model.config.vocab_size * model.config.d_model


def test_example_stream_gives_fresh_examples_and_never_the_eval_seeds(monkeypatch):
    """Streamed training data: chunks come from new seeds (>= STREAM_SEED_BASE, so never the evaluation seeds
    777 / 12345), a drawn example is never repeated across chunks, and the stream is deterministic."""
    from transformers import AutoTokenizer

    from dllm.assets import BUNDLED
    from dllm.evals import tasks as T
    from dllm.tiny import train as tr

    tok = AutoTokenizer.from_pretrained(str(BUNDLED["llada-tiny"]))
    seeds = []
    real = T.generate
    monkeypatch.setattr(T, "generate", lambda name, n, seed: seeds.append(seed) or real(name, n, seed))
    a = tr.ExampleStream(tok, "waiting_line/copy", seed=0, chunk=4)
    draws = [a.draw(i % 2) for i in range(10)]  # 3 chunks
    assert seeds == [tr.STREAM_SEED_BASE, tr.STREAM_SEED_BASE + 1, tr.STREAM_SEED_BASE + 2]
    answers = [tuple(ans) for _, ans in draws]
    assert len(set(answers)) == len(answers)
    # turn 1 carries the worked example: a longer prompt with the same answer as turn 0 would have
    single, multi = draws[0][0], draws[1][0]
    assert len(multi) > len(single)
    b = tr.ExampleStream(tok, "waiting_line/copy", seed=0, chunk=4)
    assert [b.draw(i % 2) for i in range(10)] == draws
    # the bare-copy stage: the list then end-of-turn as the prompt, the list as the answer
    bare = tr.ExampleStream(tok, tr.BARE_COPY, seed=0, chunk=4, eot_id=7).draw(0)
    assert bare[0] == bare[1] + [7]


def test_rotation_shuffle_targets(tmp_path):
    """--shuffle-targets rotation: the shuffle training targets are rotations of the input by 1..n-1 places
    (valid shuffles: the task's own scorer accepts them), every rotation occurs, the prompt is unchanged, other
    tasks are untouched; the streams and the pools use them; an unknown choice is refused."""
    from transformers import AutoTokenizer

    import dllm.tiny.train as tr
    from dllm.assets import BUNDLED
    from dllm.evals import tasks as T

    exs = T.generate("waiting_line/shuffle", 60, 5) + T.generate("waiting_line/copy", 3, 5)
    rot = tr.rotation_targets(exs, 0)
    seen = set()
    for a, b in zip(exs, rot):
        assert a.messages == b.messages
        if a.task != "waiting_line/shuffle":
            assert b is a
            continue
        names = a.answer["input"]
        r = next(r for r in range(1, len(names)) if T.list_to_str(names[r:] + names[:r]) == b.target)
        seen.add((len(names), r))
        assert T.TASKS["waiting_line/shuffle"].score(b.target, a) == 1.0
        assert T.parse_list(b.target) == names[r:] + names[:r] != names
    assert {(n, r) for n in range(3, 7) for r in range(1, n)} <= seen
    assert tr.rotation_targets(exs, 0) == rot and tr.rotation_targets(exs, 1) != rot
    tok = AutoTokenizer.from_pretrained(str(BUNDLED["llada-tiny"]))
    plain = tr.ExampleStream(tok, "waiting_line/shuffle", seed=0, chunk=8)
    rotated = tr.ExampleStream(tok, "waiting_line/shuffle", seed=0, chunk=8, shuffle_targets="rotation")
    p0, a0 = plain.draw(0)
    p1, a1 = rotated.draw(0)
    ex = T.generate("waiting_line/shuffle", 8, tr.STREAM_SEED_BASE)[0]
    assert p0 == p1 and a1 == tok(tr.rotation_targets([ex], tr.STREAM_SEED_BASE)[0].target,
                                  add_special_tokens=False)["input_ids"]
    pools = tr.build_pools(tok, 8, seed=3, shuffle_targets="rotation")
    want = [tok(e.target, add_special_tokens=False)["input_ids"]
            for e in tr.rotation_targets(T.generate("waiting_line/shuffle", 8, 3), 3)]
    assert [a for _, a in pools["waiting_line/shuffle"][0]] == want
    with pytest.raises(ValueError, match="unknown shuffle_targets"):
        tr.train(tr.TrainConfig(steps=1, shuffle_targets="cyclic"), tmp_path / "bad")


def test_last_edit_targets(tmp_path):
    """--edit-targets last: the random edits' training targets edit the last position (append, drop the last,
    replace the last), which the task's own scorer accepts; the prompt is unchanged, other tasks (the by-index
    edits included) are untouched; the streams and the pools use them; an unknown choice is refused."""
    from transformers import AutoTokenizer

    import dllm.tiny.train as tr
    from dllm.assets import BUNDLED
    from dllm.evals import tasks as T

    ops = ("insert_random", "remove_random", "replace_random")
    exs = [e for op in ops for e in T.generate(f"waiting_line/{op}", 20, 5)]
    others = T.generate("waiting_line/insert_index", 3, 5) + T.generate("waiting_line/shuffle", 3, 5)
    out = tr.last_edit_targets(exs + others)
    for a, b in zip(exs, out):
        names, op = a.answer["input"], a.task.split("/")[1]
        assert a.messages == b.messages
        want = {"insert_random": names + [a.answer.get("word")], "remove_random": names[:-1],
                "replace_random": names[:-1] + [a.answer.get("word")]}[op]
        assert T.parse_list(b.target) == want
        assert T.TASKS[a.task].score(b.target, a) == 1.0
    assert sum(a.target != b.target for a, b in zip(exs, out)) > len(exs) // 2  # most targets did change
    assert all(b is a for a, b in zip(others, out[len(exs):]))
    tok = AutoTokenizer.from_pretrained(str(BUNDLED["llada-tiny"]))
    stream = tr.ExampleStream(tok, "waiting_line/remove_random", seed=0, chunk=8, edit_targets="last")
    _, a0 = stream.draw(0)
    ex = T.generate("waiting_line/remove_random", 8, tr.STREAM_SEED_BASE)[0]
    assert a0 == tok(T.list_to_str(ex.answer["input"][:-1]), add_special_tokens=False)["input_ids"]
    pools = tr.build_pools(tok, 8, seed=3, shuffle_targets="rotation", edit_targets="last")
    want = [tok(e.target, add_special_tokens=False)["input_ids"]
            for e in tr.last_edit_targets(T.generate("waiting_line/insert_random", 8, 3))]
    assert [a for _, a in pools["waiting_line/insert_random"][0]] == want
    rot = [tok(e.target, add_special_tokens=False)["input_ids"]
           for e in tr.rotation_targets(T.generate("waiting_line/shuffle", 8, 3), 3)]
    assert [a for _, a in pools["waiting_line/shuffle"][0]] == rot  # both options at once
    with pytest.raises(ValueError, match="unknown edit_targets"):
        tr.train(tr.TrainConfig(steps=1, edit_targets="first"), tmp_path / "bad")


def test_task_sampler_adaptive_mix_weights_unsolved_tasks():
    import random

    from dllm.tiny.train import task_sampler

    names = ["waiting_line/copy", "waiting_line/sort", "puzzle/sudoku", "arithmetic/addition"]
    scores = {"waiting_line/copy": 1.0, "waiting_line/sort": 0.0, "puzzle/sudoku": 0.5}
    draw = task_sampler(names, "adaptive", scores, floor=0.1)
    rng = random.Random(0)
    n = 30000
    counts = {k: 0 for k in names}
    for _ in range(n):
        counts[draw(rng)] += 1
    frac = {k: v / n for k, v in counts.items()}
    # each family a third; inside waiting_line, copy (solved) 0.1 : sort (unsolved) 1.1
    assert abs(frac["puzzle/sudoku"] - 1 / 3) < 0.02 and abs(frac["arithmetic/addition"] - 1 / 3) < 0.02
    assert abs(frac["waiting_line/copy"] - (1 / 3) * 0.1 / 1.2) < 0.01
    assert abs(frac["waiting_line/sort"] - (1 / 3) * 1.1 / 1.2) < 0.02
    with pytest.raises(ValueError, match="unknown task mix"):
        task_sampler(names, "bogus")


def test_train_tasks_filter_stream_and_periodic_eval(tmp_path):
    """--tasks restricts training, --examples-per-task 0 streams, --eval-every records greedy held-out scores
    (per task, per family, family mean) in training.json; the adaptive mix needs the periodic evaluation."""
    torch.set_num_threads(1)
    cfg = TrainConfig(family="llada", d_model=32, n_layers=1, n_heads=2, mlp_hidden=64, steps=4, batch_size=4,
                      warmup=1, examples_per_task=0, tasks="waiting_line/c*", eval_every=2, eval_n=2,
                      task_mix="adaptive", list_item_tokens=True)
    summary = train(cfg, tmp_path / "ckpt")
    assert [e["step"] for e in summary["evals"]] == [2, 4]
    ev = summary["evals"][-1]
    assert set(ev["tasks"]) == {"waiting_line/copy"} and set(ev["families"]) == {"waiting_line"}
    assert 0.0 <= ev["family_mean"] <= 1.0 and ev["family_mean"] == ev["tasks"]["waiting_line/copy"]
    saved = json.loads((tmp_path / "ckpt" / "training.json").read_text())
    assert saved["evals"] == summary["evals"] and saved["train_config"]["tasks"] == "waiting_line/c*"
    with pytest.raises(ValueError, match="no task matches"):
        train(TrainConfig(**{**cfg.__dict__, "tasks": "nope/*"}), tmp_path / "bad")
    with pytest.raises(ValueError, match="eval_every"):
        train(TrainConfig(**{**cfg.__dict__, "eval_every": 0}), tmp_path / "bad2")


def test_init_from_ar_takes_the_causal_lm_weights(tmp_path):
    """--init-from-ar: a Dream-format model starts from a causal LM's tensors (Qwen2-style names, zero QKV biases,
    its key/value head count), and so does a LLaDA-format one; at the last position, where causal and
    bidirectional attention see the same keys, the first layer's output equals the causal LM's; wrong shape or
    tying are refused."""
    from transformers import AutoModelForCausalLM

    import dllm.tiny.train_ar as train_ar
    from dllm.models.loading import load_model
    from dllm.models.transformer import rope_tables
    from dllm.tiny.train import TrainConfig, train

    small = dict(d_model=16, n_layers=1, n_heads=2, mlp_hidden=32, batch_size=2, examples_per_task=2, list_item_tokens=True)
    train_ar.train(train_ar.ARTrainConfig(steps=3, **small), tmp_path / "ar")
    ar = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ar"), dtype=torch.float32).eval()
    base = dict(family="dream", steps=1, lr=0.0, warmup=1, task_curriculum=False, **small)
    train(TrainConfig(init_from_ar=str(tmp_path / "ar"), tie_embeddings=True, **base), tmp_path / "dream")
    m = load_model(tmp_path / "dream", dtype=torch.float32)
    assert m.config.n_kv_heads == ar.config.num_key_value_heads == 2 and m.config.tie_embeddings
    sd = ar.state_dict()
    assert torch.equal(m.layers[0].q.weight, sd["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(m.embed.weight, sd["model.embed_tokens.weight"])
    assert not m.layers[0].q.bias.any() and not m.layers[0].v.bias.any()
    x = torch.tensor([[5, 17, 300, 42]])
    with torch.no_grad():
        want = ar.model.layers[0](ar.model.embed_tokens(x), position_embeddings=ar.model.rotary_emb(
            ar.model.embed_tokens(x), torch.arange(4)[None]), attention_mask=None)
        want = want[0] if isinstance(want, tuple) else want
        got = m.layers[0](m.embed(x), *rope_tables(torch.arange(4)[None], m.config.head_dim, m.config.rope_theta), None, 0)
    assert torch.allclose(got[0, -1], want[0, -1], atol=1e-3)  # rms eps 1e-6 here, 1e-5 in the Llama
    train(TrainConfig(init_from_ar=str(tmp_path / "ar"), tie_embeddings=True, **{**base, "family": "llada"}), tmp_path / "llada")
    ml = load_model(tmp_path / "llada", dtype=torch.float32)
    assert ml.spec.family == "llada" and ml.config.n_kv_heads == 2 and not ml.config.qkv_bias
    assert torch.equal(ml.layers[0].k.weight, sd["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(ml.layers[0].down.weight, sd["model.layers.0.mlp.down_proj.weight"])
    with torch.no_grad():
        got = ml.layers[0](ml.embed(x), *rope_tables(torch.arange(4)[None], ml.config.head_dim, ml.config.rope_theta), None, 0)
    assert torch.allclose(got[0, -1], want[0, -1], atol=1e-5)  # the same rms eps (1e-5) as the Llama
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        train(TrainConfig(init_from_ar=str(tmp_path / "ar"), **base), tmp_path / "y")
    with pytest.raises(ValueError, match="shape differs"):
        train(TrainConfig(init_from_ar=str(tmp_path / "ar"), tie_embeddings=True, **{**base, "mlp_hidden": 64}), tmp_path / "z")


def test_init_from_keeps_the_checkpoints_key_value_heads(tmp_path):
    """A continuation (--init-from) of a Dream checkpoint without GQA (as the AR-initialised dream-tiny) keeps its
    key/value head count instead of the Dream default of half the heads, by path or by bundled name."""
    from dllm.models.loading import load_model

    small = dict(family="dream", d_model=16, n_layers=1, n_heads=2, mlp_hidden=32, batch_size=2, examples_per_task=2,
                 list_item_tokens=True, steps=1, warmup=1, task_curriculum=False)
    train(TrainConfig(n_kv_heads=2, **small), tmp_path / "a")
    train(TrainConfig(init_from=str(tmp_path / "a"), **small), tmp_path / "b")
    assert load_model(tmp_path / "b", dtype=torch.float32).config.n_kv_heads == 2
    with pytest.raises(ValueError, match="differs"):  # an explicit different count is still refused
        train(TrainConfig(init_from=str(tmp_path / "a"), n_kv_heads=1, **small), tmp_path / "c")
    from dllm.assets import model_path

    bundled = load_model(model_path("dream-tiny"), dtype=torch.float32).config
    cfg = TrainConfig(family="dream", d_model=bundled.d_model, n_layers=bundled.n_layers, n_heads=bundled.n_heads,
                      mlp_hidden=bundled.mlp_hidden, batch_size=2, examples_per_task=2, list_item_tokens=True,
                      steps=1, warmup=1, lr=0.0, task_curriculum=False, tie_embeddings=bundled.tie_embeddings,
                      init_from="dream-tiny")
    train(cfg, tmp_path / "d")
    assert load_model(tmp_path / "d", dtype=torch.float32).config == bundled


def test_cli_target_choices_are_the_trainers():
    """The train-tiny parser lists its --shuffle-targets / --edit-targets choices itself (it does not import
    dllm.tiny.train, which imports torch): they must stay the trainer's own."""
    import argparse

    import dllm.tiny.train as tr
    from dllm.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    choices = {a.dest: tuple(a.choices) for a in sub.choices["train-tiny"]._actions if a.choices}
    assert choices["shuffle_targets"] == tr.SHUFFLE_TARGETS
    assert choices["edit_targets"] == tr.EDIT_TARGETS
