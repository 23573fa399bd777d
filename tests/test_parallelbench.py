"""ParallelBench-compatible suite: generators, record schema, scorers, sweeps (resume), reports, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import random_model

from dllm.cli import main
from dllm.evals import parallelbench as PB
from dllm.evals import tasks as T
from dllm.evals.parallelbench import report as R
from dllm.evals.parallelbench import sweep as S

WL = [f"waiting_line/{op}" for op in T.WAITING_LINE_OPS]
GENERATED = [t for t in PB.TASKS if not PB.TASKS[t].needs_data]


def PL(text, strict=False):
    """The original's list parsing."""
    return T.parse_list(text, strict, rules="parallelbench")



@pytest.fixture
def backends():
    """Restore the automatic text backends after a test that plugs in fakes."""
    yield PB.set_text_backend
    for name in ("grammar", "rouge", "bertscore"):
        PB.set_text_backend(name, None)


def _rec(name: str, i: int = 0, **kw) -> dict:
    return PB.generate_task(name, **kw)[i]


def _target(record: dict) -> str:
    a = record["answer"]
    return a if isinstance(a, str) else a["example"]


def _score(name, record, pred, **kw):
    return PB.score_prediction(name, record, pred, **kw)


# ---------------------------------------------------------------------------------------------------------
# Registry and generators


def test_seventeen_tasks_and_patterns():
    assert len(PB.TASKS) == 17 and len(PB.task_names()) == 17
    assert PB.task_names("waiting_line") == WL
    assert PB.task_names("puzzle,words_to_sentence/hard") == ["puzzle/latin_square_n4", "puzzle/sudoku_n4_12",
                                                              "words_to_sentence/hard"]
    assert PB.task_names("*_random") == ["waiting_line/insert_random", "waiting_line/remove_random",
                                         "waiting_line/replace_random"]
    assert PB.task_names("puzzle/sudoku") == ["puzzle/sudoku_n4_12"]  # alias
    assert PB.task_names("nothing*") == []
    assert {t.max_tokens for n, t in PB.TASKS.items() if n in WL} == {32}
    with pytest.raises(KeyError, match="known tasks"):
        PB.get_task("waiting_line/nope")


@pytest.mark.parametrize("style", PB.STYLES)
def test_generation_is_deterministic_and_self_consistent(style, backends):
    backends("grammar", lambda text: True)
    for name in GENERATED:
        a = PB.generate_task(name, seed=3, style=style)
        assert a == PB.generate_task(name, seed=3, style=style), name
        assert a != PB.generate_task(name, seed=4, style=style), name
        assert len(a) == PB.TASKS[name].num_samples
        assert len({json.dumps(r["input"], sort_keys=True) for r in a}) == len(a), name  # distinct questions
        for r in a:
            s = _score(name, r, _target(r))
            assert s["score"] == 1.0, (name, r)
            if not name.startswith("words_to_sentence"):
                assert s["score_strict"] == 1.0, (name, r)


def test_waiting_line_records_follow_the_original_schema():
    for name in WL:
        recs = PB.generate_task(name)
        assert [r["metadata"]["length"] for r in recs] == [3] * 25 + [4] * 25 + [5] * 25 + [6] * 25
        for r in recs:
            assert set(r) == {"input", "answer", "output_format", "metadata"}
            icl = r["input"]["icl_examples"]
            assert len(icl) == 1 and set(icl[0]) == {"input", "answer", "output_format", "metadata"}
            assert r["output_format"] == T.list_to_str(["[MASK]"] * len(PL(_target(r))))
            names = PL(r["input"]["context"])
            assert r["input"]["context"] == T.list_to_str(names) and 3 <= len(names) <= 6
            op = name.split("/")[1]
            if op == "shuffle" or op.endswith("_random"):
                assert isinstance(r["answer"], dict) and r["answer"]["input"] == names
                assert ("word" in r["answer"]) == (op != "shuffle" and op != "remove_random")
            else:
                assert isinstance(r["answer"], str)
            if op.endswith("_index"):
                assert isinstance(r["input"]["index"], int) and r["metadata"]["index_base"] == 1
            if op.startswith(("insert", "replace")):
                assert r["input"]["word"] == r["metadata"]["word"] and r["input"]["word"] not in names


def test_puzzle_and_w2s_records():
    for r in PB.generate_task("puzzle/latin_square_n4"):
        syms = r["answer"]["symbols"]
        assert r["input"] == {"size": 4, "symbols": "[" + ", ".join(syms) + "]", "icl_examples": r["input"]["icl_examples"]}
        assert all(c in PB.LATIN_POOL_FULL for c in syms) and len(set(syms)) == 4
        assert all(len(line.split(",")) == 4 for line in r["answer"]["example"].split("\n"))
    recs = PB.generate_task("puzzle/sudoku_n4_12")
    assert sorted({r["metadata"]["length"] for r in recs}) == list(range(4, 13))
    for r in recs:
        givens = {i: c for i, c in enumerate(r["input"]["sudoku"].replace("\n", "")) if c != "0"}
        assert len(givens) == r["metadata"]["length"] and T.count_sudoku_solutions(givens) == 1
        assert all(r["answer"].replace("\n", "")[i] == c for i, c in givens.items())
    assert {r["metadata"]["length"] for r in PB.generate_task("puzzle/sudoku_n4_12", sudoku_givens=(12, 12))} == {12}
    theme_of = {w: (dom, th) for dom, themes in PB.W2S_THEMES.items() for th, ws in themes.items() for w in ws}
    for level, themes, domains in (("easy", 1, 1), ("medium", 2, 1), ("hard", 4, 4)):
        for r in PB.generate_task(f"words_to_sentence/{level}"):
            words = r["answer"]["words"]
            assert len(words) == 4 and r["input"]["words"] == ", ".join(words[:3]) + ", and " + words[3]
            assert len({theme_of[w] for w in words}) == themes and len({theme_of[w][0] for w in words}) == domains
            assert all(w in r["answer"]["example"] for w in words)


def test_short_style_matches_the_training_tasks():
    """style="short" gives exactly the chats of dllm.evals.tasks (what the tiny models are trained on)."""
    pairs = [(n, n) for n in WL] + [("puzzle/latin_square_n4", "puzzle/latin_square"), ("puzzle/sudoku_n4_12", "puzzle/sudoku")]
    for pb_name, t_name in pairs:
        n = PB.TASKS[pb_name].num_samples
        ours = {json.dumps(PB.messages_for(r, PB.prompt_for(pb_name, "short"))) for r in
                PB.generate_task(pb_name, n, 7, style="short")}
        theirs = {json.dumps(ex.messages) for ex in T.generate(t_name, n, 7)}
        assert ours == theirs, pb_name


def test_full_style_prompts_are_the_original_wording():
    r = _rec("waiting_line/copy")
    msgs = PB.messages_for(r, PB.prompt_for("waiting_line/copy"))
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[2]["content"] == ("You are managing a waiting line at a customer service desk.\nYou need to record "
                                  "the following people in the order they arrived:\n" + r["input"]["context"]
                                  + "\nPlease copy the list exactly and provide only the final list.\n")
    assert msgs[1]["content"] == r["input"]["icl_examples"][0]["answer"]
    s = _rec("puzzle/sudoku_n4_12")
    text = PB.messages_for(s, PB.prompt_for("puzzle/sudoku_n4_12"))[-1]["content"]
    assert text.endswith("\n\nInput:\n" + s["input"]["sudoku"] + "\nOutput:\n") and "values are 0" in text
    # a task_config prompt stored with escaped newlines (as the original's Sudoku entry) renders the same
    escaped = PB.prompt_for("puzzle/sudoku_n4_12").replace("\n", "\\n")
    assert PB.messages_for(s, escaped) == PB.messages_for(s, PB.prompt_for("puzzle/sudoku_n4_12"))
    w = _rec("words_to_sentence/easy")
    assert PB.messages_for(w, PB.prompt_for("words_to_sentence/easy")) == [
        {"role": "user", "content": f"Construct a single, coherent sentence using the words {w['input']['words']}."}]


def test_sort_bug_option():
    for r in PB.generate_task("waiting_line/sort", 40, 1):  # fixed: by last name
        out = PL(r["answer"])
        assert out == sorted(out, key=lambda n: (n.split()[1], n)) and r["metadata"]["sort_by"] == "last"
    bug = PB.generate_task("waiting_line/sort", 40, 1, sort_by="first")  # the original's labels
    assert all(PL(r["answer"]) == sorted(PL(r["input"]["context"])) for r in bug)
    assert any(PL(r["answer"]) != sorted(PL(r["answer"]), key=lambda n: n.split()[1]) for r in bug)
    assert "by last name" in PB.prompt_for("waiting_line/sort")  # the prompt is the same either way


@pytest.mark.parametrize("base", [0, 1])
def test_index_base(base):
    for op in ("insert_index", "remove_index", "replace_index"):
        recs = PB.generate_task(f"waiting_line/{op}", 60, 2, index_base=base)
        shown = set()
        for r in recs:
            names, out, word = PL(r["input"]["context"]), PL(r["answer"]), r["input"].get("word")
            i = r["input"]["index"] - base
            shown.add(r["input"]["index"])
            assert f"position {r['input']['index']}" in PB.messages_for(r, PB.prompt_for(f"waiting_line/{op}"))[-1]["content"]
            if op == "insert_index":
                assert out == names[:i] + [word] + names[i:]
            elif op == "remove_index":
                assert out == names[:i] + names[i + 1:]
            else:
                assert out == names[:i] + [word] + names[i + 1:]
            assert r["metadata"]["index_base"] == base
        assert min(shown) == base


# ---------------------------------------------------------------------------------------------------------
# Scorers


def test_list_parsing_rules():
    P = PL
    assert P('a, b') == ["a", "b"] and T.parse_list('a, b') is None  # the two rule sets differ here
    assert P('["Ann Lee", "Bob Stone"]') == ["Ann Lee", "Bob Stone"]
    assert P('Sure! Here it is: ["Ann Lee", "Bob Stone"]. Anything else?') == ["Ann Lee", "Bob Stone"]
    assert P('Sure! Here it is: ["Ann Lee", "Bob Stone"]. Anything else?', strict=True) == ["Ann Lee", "Bob Stone"]
    assert P('[Ann Lee, Bob Stone]') == ["Ann Lee", "Bob Stone"] and P('[Ann Lee, Bob Stone]', strict=True) is None
    assert P('"Ann Lee", "Bob Stone"') == ["Ann Lee", "Bob Stone"] and P('"Ann Lee", "Bob Stone"', strict=True) is None
    assert P('["Ann Lee", "Bob Stone"') == ["Ann Lee", "Bob Stone"] and P('["Ann Lee", "Bob Stone"', strict=True) is None
    assert P('["Ann Lee","Bob Stone"]', strict=True) is None  # separator must be ", "
    assert P('["a"] then ["Ann Lee"]') == ["Ann Lee"]  # the last list counts
    assert P("['Ann Lee']") == ["'Ann Lee'"]  # single quotes are not stripped (as the original)
    assert P("") == [] and P("", strict=True) is None and P(None) == []
    assert P("[]") == [] and P("[]", strict=True) is None


def test_list_scorers_edge_cases():
    r = _rec("waiting_line/copy", 30)  # a 4-name list
    names = PL(r["input"]["context"])
    ok = T.list_to_str(names)
    assert _score("waiting_line/copy", r, ok) == {"score": 1.0, "score_strict": 1.0}
    assert _score("waiting_line/copy", r, f"The final list is:\n{ok}\n")["score_strict"] == 1.0
    assert _score("waiting_line/copy", r, ok.replace('", "', '","')) == {"score": 1.0, "score_strict": 0.0}
    assert _score("waiting_line/copy", r, "") == {"score": 0.0, "score_strict": 0.0}
    assert _score("waiting_line/copy", r, T.list_to_str(names + names[-1:]))["score"] == 0.0  # duplicate
    assert _score("waiting_line/copy", r, T.list_to_str(names[::-1]))["score"] == 0.0

    sh = _rec("waiting_line/shuffle", 30)
    src = sh["answer"]["input"]
    assert _score("waiting_line/shuffle", sh, T.list_to_str(src))["score"] == 0.0  # equal to the input
    assert _score("waiting_line/shuffle", sh, T.list_to_str(src[1:] + src[:1]))["score"] == 1.0
    assert _score("waiting_line/shuffle", sh, T.list_to_str(src[1:] + src[1:2]))["score"] == 0.0  # duplicate
    assert _score("waiting_line/shuffle", sh, T.list_to_str(src[1:]))["score"] == 0.0

    ins = _rec("waiting_line/insert_random", 30)
    src, word = ins["answer"]["input"], ins["answer"]["word"]
    for i in range(len(src) + 1):
        assert _score("waiting_line/insert_random", ins, T.list_to_str(src[:i] + [word] + src[i:]))["score"] == 1.0
    wrong = next(f"{f} {l}" for f in T.FIRST_NAMES for l in T.LAST_NAMES if f"{f} {l}" not in src + [word])
    assert _score("waiting_line/insert_random", ins, T.list_to_str(src + [wrong]))["score"] == 0.0  # wrong word
    assert _score("waiting_line/insert_random", ins, T.list_to_str([word] + src + [word]))["score"] == 0.0
    assert _score("waiting_line/insert_random", ins, T.list_to_str([word] + src[::-1]))["score"] == 0.0

    rem = _rec("waiting_line/remove_random", 30)
    src = rem["answer"]["input"]
    for i in range(len(src)):
        assert _score("waiting_line/remove_random", rem, T.list_to_str(src[:i] + src[i + 1:]))["score"] == 1.0
    assert _score("waiting_line/remove_random", rem, T.list_to_str(src[1:][::-1]))["score"] == 0.0  # order
    assert _score("waiting_line/remove_random", rem, T.list_to_str(src[2:]))["score"] == 0.0  # two removed
    assert _score("waiting_line/remove_random", rem, T.list_to_str(src[1:-1] + src[1:2]))["score"] == 0.0

    rep = _rec("waiting_line/replace_random", 30)
    src, word = rep["answer"]["input"], rep["answer"]["word"]
    for i in range(len(src)):
        assert _score("waiting_line/replace_random", rep, T.list_to_str(src[:i] + [word] + src[i + 1:]))["score"] == 1.0
    assert _score("waiting_line/replace_random", rep, T.list_to_str([word, word] + src[2:]))["score"] == 0.0
    assert _score("waiting_line/replace_random", rep, T.list_to_str([wrong] + src[1:]))["score"] == 0.0
    assert _score("waiting_line/replace_random", rep, T.list_to_str(src))["score"] == 0.0


def test_grid_scorers():
    lat = _rec("puzzle/latin_square_n4")
    a, b, c, d = lat["answer"]["symbols"]
    square = f"{a},{b},{c},{d}\n{b},{c},{d},{a}\n{c},{d},{a},{b}\n{d},{a},{b},{c}"
    assert _score("puzzle/latin_square_n4", lat, square) == {"score": 1.0, "score_strict": 1.0}
    assert _score("puzzle/latin_square_n4", lat, "Here:\n" + square.replace(",", ", ") + "\nDone.")["score"] == 1.0
    assert _score("puzzle/latin_square_n4", lat, square.replace(f"{d},{a},{b},{c}", f"{d},{a},{c},{b}"))["score"] == 0.0
    assert _score("puzzle/latin_square_n4", lat, "\n".join(square.split("\n")[:3]))["score"] == 0.0
    assert _score("puzzle/latin_square_n4", lat, square.replace(",", " "))["score"] == 0.0  # CSV expected
    short = _rec("puzzle/latin_square_n4", style="short")
    a, b, c, d = short["answer"]["symbols"]
    grid = f"{a} {b} {c} {d}\n{b} {c} {d} {a}\n{c} {d} {a} {b}\n{d} {a} {b} {c}"
    assert _score("puzzle/latin_square_n4", short, grid)["score"] == 1.0

    sud = _rec("puzzle/sudoku_n4_12", 100)
    sol = sud["answer"]
    assert _score("puzzle/sudoku_n4_12", sud, sol) == {"score": 1.0, "score_strict": 1.0}
    assert _score("puzzle/sudoku_n4_12", sud, "Output:\n" + sol.replace("", " ").strip()) == {"score": 1.0, "score_strict": 0.0}
    assert _score("puzzle/sudoku_n4_12", sud, sol.replace("\n", ""))["score"] == 0.0  # one line
    assert _score("puzzle/sudoku_n4_12", sud, sol + "\n1234")["score"] == 0.0  # five rows
    swapped = "\n".join(sol.split("\n")[::-1])
    assert _score("puzzle/sudoku_n4_12", sud, swapped)["score"] == 0.0
    assert _score("puzzle/sudoku_n4_12", sud, "")["score"] == 0.0


def test_text_metrics_unavailable_is_not_zero(backends):
    backends("grammar", False)
    r = _rec("words_to_sentence/easy")
    w = r["answer"]["words"]
    good = f"The {w[0]} and the {w[1]} met the {w[2]} near the {w[3]}."
    s = _score("words_to_sentence/easy", r, good)
    assert s["score"] is None and s["unavailable"] == ["grammar"] and s["metrics"]["inclusion_score"] == 1.0
    missing = _score("words_to_sentence/easy", r, good.replace(w[3], "nothing"))  # fails inclusion: 0 anyway
    assert missing["score"] == 0.0 and "unavailable" not in missing
    assert _score("words_to_sentence/easy", r, good.replace(w[0], w[0].upper()))["score"] == 0.0  # case-sensitive
    partial = _score("words_to_sentence/easy", r, good, allow_partial=True)
    assert partial["score"] == 1.0 and partial["partial"] is True
    assert _score("words_to_sentence/easy", r, "")["score"] == 0.0  # empty text: ungrammatical, no checker needed
    backends("grammar", lambda text: text.endswith("."))
    assert _score("words_to_sentence/easy", r, good)["score"] == 1.0
    assert _score("words_to_sentence/easy", r, good[:-1])["score"] == 0.0
    assert PB.text_backend_status()["grammar"] == "available"


def test_summary_and_paraphrase_metrics(backends):
    summ = {"input": {"text": "A: hi\nB: bye"}, "answer": {"text": "A: hi\nB: bye", "summary": "A greets B."}}
    backends("rouge", False)
    backends("grammar", lambda t: True)
    s = _score("paraphrase_summarize/samsum", summ, "A says hi.")
    assert s["score"] is None and s["unavailable"] == ["rouge"]
    backends("rouge", lambda p, ref: {"rouge1": 0.5, "rouge2": 0.25, "rougeL": 0.4})
    s = _score("paraphrase_summarize/samsum", summ, "A says hi.")
    assert s["score"] == pytest.approx(0.4) and s["score_strict"] == s["score"] and s["metrics"]["rouge2_score"] == 0.25
    assert _score("paraphrase_summarize/samsum", summ, "  ")["score"] == 0.0

    para = {"input": {"text": "the cat sat on the mat today"}, "answer": {"text": "the cat sat on the mat today"}}
    assert PB.bleu("the cat sat on the mat today", ["the cat sat on the mat today"]) == pytest.approx(1.0)
    assert PB.bleu("a dog ran", ["the cat sat on the mat today"]) == 0.0
    assert 0 < PB.bleu("the cat sat on the mat", ["the cat sat on the mat today"]) < 1  # brevity penalty
    # short texts: smoothed sentence BLEU scores an exact copy 1; the original's unsmoothed BLEU scores it 0
    assert PB.bleu("hello world", ["hello world"]) == pytest.approx(1.0)
    assert PB.bleu("hello world", "hello world", smooth=False) == 0.0
    # unsmoothed: every n-gram precision is 1, so the score is the brevity penalty exp(1 - 7/6)
    assert PB.bleu("the cat sat on the mat", ["the cat sat on the mat today"], smooth=False) == pytest.approx(
        math.exp(1 - 7 / 6))
    backends("bertscore", False)
    s = _score("paraphrase_summarize/chatgpt-paraphrases", para, "a feline rested on the rug")
    assert s["score"] is None and s["unavailable"] == ["bertscore"]
    backends("bertscore", lambda p, ref: 0.9)
    s = _score("paraphrase_summarize/chatgpt-paraphrases", para, "a feline rested on the rug")
    assert s["score"] == pytest.approx(0.9 * (1 - PB.bleu("a feline rested on the rug", [para["answer"]["text"]])))
    assert _score("paraphrase_summarize/chatgpt-paraphrases", para, "the cat sat on the mat today")["score"] == 0.0
    assert _score("paraphrase_summarize/chatgpt-paraphrases", para, "")["score"] == 0.0
    short = {"input": {"text": "hello world"}, "answer": {"text": "hello world"}}
    assert _score("paraphrase_summarize/chatgpt-paraphrases", short, "hello world")["score"] == 0.0  # a copy


def test_text_tasks_need_user_data(tmp_path):
    with pytest.raises(PB.DataNeeded, match="no offline source"):
        PB.generate_task("paraphrase_summarize/samsum")
    flat = tmp_path / "samsum.jsonl"
    PB.write_jsonl(flat, [{"id": i, "dialogue": f"A: hello {i}\nB: hi", "summary": f"A greets B {i}."} for i in range(150)])
    recs = PB.generate_task("summarization", data=flat)
    assert len(recs) == 100 and recs == PB.load_text_data("paraphrase_summarize/samsum", flat)
    assert recs[0]["input"]["text"].startswith("A: hello") and recs[0]["answer"]["summary"].startswith("A greets")
    para = tmp_path / "para.jsonl"
    PB.write_jsonl(para, [{"text": "How old are you?", "paraphrases": ["What is your age?"]},
                          {"input": {"text": "Hi."}, "answer": {"text": "Hi."}, "metadata": {}}])
    recs = PB.generate_task("paraphrasing", data=para)
    assert recs[0]["answer"] == {"text": "How old are you?", "examples": "['What is your age?']"} and len(recs) == 2
    res = PB.write_suite(tmp_path / "suite", "paraphrase_summarize", text_data={"summarization": flat})
    assert isinstance(res["paraphrase_summarize/samsum"], Path)
    assert res["paraphrase_summarize/chatgpt-paraphrases"].startswith("needs data")
    with pytest.raises(PB.DataNeeded):
        PB.load_text_data("paraphrasing", tmp_path / "missing.jsonl")


# ---------------------------------------------------------------------------------------------------------
# Files: round trip, the original's layout


def test_suite_round_trip(tmp_path):
    res = PB.write_suite(tmp_path, "waiting_line/copy,puzzle,words_to_sentence/easy", n=12, index_base=0)
    assert sorted(res) == ["puzzle/latin_square_n4", "puzzle/sudoku_n4_12", "waiting_line/copy", "words_to_sentence/easy"]
    assert PB.available_tasks(tmp_path) == ["waiting_line/copy", "puzzle/latin_square_n4", "puzzle/sudoku_n4_12",
                                            "words_to_sentence/easy"]
    import yaml

    conf = yaml.safe_load((tmp_path / "puzzle" / "task_config.yaml").read_text())
    assert conf["puzzle/sudoku_n4_12"]["metric"] == "sudoku_score"
    for name in res:
        back = PB.load_records(tmp_path, name)
        assert back == PB.generate_task(name, 12, index_base=0)
        assert json.loads(json.dumps(back)) == back
        assert PB.load_task_config(tmp_path, name)["prompt"] == PB.prompt_for(name)
    PB.write_suite(tmp_path, "waiting_line/sort", n=4)  # a second call keeps the other entries
    conf = yaml.safe_load((tmp_path / "waiting_line" / "task_config.yaml").read_text())
    assert set(conf) == {"waiting_line/copy", "waiting_line/sort"}


def test_reads_the_original_layout(tmp_path):
    """A directory as the original ships it: YAML task_config, escaped newlines, extra tasks (n15)."""
    cat = tmp_path / "waiting_line_n15"
    cat.mkdir()
    names = [f"{f} {l}" for f, l in zip(T.FIRST_NAMES[:15], T.LAST_NAMES[:15])]
    rec = {"input": {"context": T.list_to_str(names), "icl_examples": []},
           "answer": {"input": names, "example": T.list_to_str(names[::-1])}, "metadata": {"length": 15}}
    PB.write_jsonl(cat / "shuffle.jsonl", [rec])
    (cat / "task_config.yaml").write_text(
        "waiting_line_n15/shuffle:\n  metric: list_shuffle_score\n  name: waiting_line_n15/shuffle\n"
        "  prompt: 'Shuffle:\\n{context}\\nOnly the list.'\n")
    assert PB.available_tasks(tmp_path) == ["waiting_line_n15/shuffle"]
    conf = PB.load_task_config(tmp_path, "waiting_line_n15/shuffle")
    assert PB.metric_for("waiting_line_n15/shuffle", conf) == "list_shuffle_score"
    assert PB.metric_for("waiting_line_n15/copy") == "list_match_score"  # inferred without a config
    assert PB.max_tokens_for("waiting_line_n15/shuffle") == 128
    msgs = PB.messages_for(rec, PB.prompt_for("waiting_line_n15/shuffle", config=conf))
    assert msgs == [{"role": "user", "content": f"Shuffle:\n{rec['input']['context']}\nOnly the list."}]
    assert _score("waiting_line_n15/shuffle", rec, rec["answer"]["example"], config=conf)["score"] == 1.0


# ---------------------------------------------------------------------------------------------------------
# Method specs


def test_method_specs():
    pts = S.parse_method("topk:k=1,2,4,8")
    assert [p.label for p in pts] == ["topk:k=1", "topk:k=2", "topk:k=4", "topk:k=8"]
    assert {p.method for p in pts} == {"topk"} and [p.k for p in pts] == [1, 2, 4, 8]
    assert S.parse_values("0.5,0.6,...,1.0") == [0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    assert S.parse_values("0.7,1.0,...,1.9") == [0.7, 1.0, 1.3, 1.6, 1.9]
    assert S.parse_values("1,2,...,4") == [1, 2, 3, 4]
    grid = S.parse_method("llada:remasking=low_confidence,random:temperature=0,0.5")
    assert [p.label for p in grid] == ["llada:remasking=low_confidence:temperature=0",
                                       "llada:remasking=low_confidence:temperature=0.5",
                                       "llada:remasking=random:temperature=0",
                                       "llada:remasking=random:temperature=0.5"]
    assert [p.method for p in grid] == ["llada:remasking=low_confidence"] * 2 + ["llada:remasking=random"] * 2
    assert dict(grid[3].params) == {"remasking": "random", "temperature": 0.5}
    dream = S.parse_method("dream:alg=entropy,maskgit_plus:steps=16")
    assert [(p.method, p.steps) for p in dream] == [("dream:alg=entropy:steps=16", 16), ("dream:alg=maskgit_plus:steps=16", 16)]
    base = S.parse_method("topk:k=2:sampler=llada-random")[0]
    assert base.base == "llada-random" and base.method == "topk:k=2:sampler=llada-random"
    both = S.parse_methods(["topk:k=1,2", "topk:k=2,4"])
    assert [p.label for p in both] == ["topk:k=1", "topk:k=2", "topk:k=4"]
    for bad, msg in (("topk", "needs k"), ("nope:x=1", "registered sampler"), ("llada:foo=1", "unknown parameter"),
                     ("topk:k=0", "positive integer"), ("topk:k=2:steps=4", "do not give steps"),
                     ("llada:temperature=0,0.3,...,1.0", "does not end"), ("llada:temperature", "KEY=VALUES"),
                     ("topk:k=1:sampler=nope", "unknown sampler")):
        with pytest.raises(ValueError, match=msg):
            S.parse_method(bad)


def test_every_registered_sampler_is_a_method():
    """Any sampler in the registry (threshold, factor, ... once registered) runs by name with its defaults."""
    from dllm.samplers import SAMPLERS

    model = random_model("llada")
    for name in SAMPLERS:
        (setting,) = S.parse_method(name)
        sampler, config = setting.resolve(model, 32)
        assert config.gen_length == 32 and getattr(sampler, "name", name) == name
    sampler, config = S.parse_method("topk:k=4")[0].resolve(model, 32)
    assert config.steps == 8 and sampler.name == "llada"
    with pytest.raises(ValueError, match="not a multiple"):
        S.parse_method("topk:k=3")[0].resolve(model, 32)


# ---------------------------------------------------------------------------------------------------------
# Sweeps: a real tokenizer and a tiny model (the bundled one when present, else random weights)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, checkpoint directory)."""
    from dllm.assets import model_path
    from dllm.models import LLADA, Transformer, TransformerConfig, load_model, save_pretrained
    from dllm.models.weights import init_weights
    from dllm.tiny import tokenizer as tb

    bundled = model_path("llada-tiny")
    if (bundled / "config.json").is_file():
        return load_model(bundled), bundled
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("pb-model")
    tok = AutoTokenizer.from_pretrained(str(tb.build_tokenizer(root / "tok", "llada")))
    cfg = TransformerConfig(vocab_size=len(tok), d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden=64,
                            max_seq_len=512)
    torch.manual_seed(0)
    model = Transformer(cfg, LLADA)
    init_weights(model, std=0.5)
    model.eval().requires_grad_(False)
    model.tokenizer = tok
    model.mask_id = tok.convert_tokens_to_ids("<|mdm_mask|>")
    model.eos_id = model.pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    model.eot_id = tok.convert_tokens_to_ids("<|eot_id|>")
    path = save_pretrained(model, root / "ckpt")
    return load_model(path), Path(path)


SWEEP = dict(tasks="waiting_line/copy,waiting_line/shuffle,puzzle/sudoku", n=3, style="short", batch_size=2)
METHODS = ["topk:k=1,4", "llada-random"]


def test_mini_sweep_end_to_end(tiny, tmp_path):
    model, _ = tiny
    res = S.run_sweep(model, tmp_path, METHODS, **SWEEP)
    assert res.written == 3 * 3 * 3 and res.already_done == 0 and res.needs_data == {}
    lines = S.load_samples(tmp_path)
    assert len(lines) == 27 and len({(x["setting"], x["task"], x["index"]) for x in lines}) == 27
    for x in lines:
        G = 32 if x["task"].startswith("waiting_line") else 64
        assert x["gen_length"] == G and x["tokens_per_step"] == G / x["nfe"]
        assert x["score"] in (0.0, 1.0) and x["score_strict"] in (0.0, 1.0)
        assert 0 <= x["output_length"] <= G and x["time_s"] >= 0 and isinstance(x["prediction"], str)
        assert {"input", "answer", "metadata"} <= set(x)  # re-scorable by `dllm parallelbench score`
        assert PB.score_prediction(x["task"], x, x["prediction"])["score"] == x["score"]
        if x["setting"] == "topk:k=4":
            assert x["nfe"] == G // 4
    assert sorted({x["index"] for x in lines if x["task"] == "puzzle/sudoku_n4_12"}) == [0, 36, 72]  # spread
    report = R.write_report(tmp_path)
    assert (tmp_path / "report.md").read_text() == report.markdown
    assert set(report.curves) == {"topk", "llada-random"}
    assert report.settings["topk:k=4"]["tps"] == pytest.approx(4.0)
    assert "| waiting_line/copy |" in report.markdown and "## Summary per method" in report.markdown


def test_a_continuous_sweep_predicts_the_same(tiny, tmp_path):
    """``continuous``: the samples decoded two rows at a time with continuous batching give the same lines."""
    model, _ = tiny
    kw = {**SWEEP, "tasks": "waiting_line/copy,puzzle/sudoku", "n": 5}
    got = {}
    for c in (False, True):
        lines = S.load_samples(S.run_sweep(model, tmp_path / str(c), ["threshold:tau=0.9"], **kw,
                                           continuous=c).samples_path)
        got[c] = {(x["task"], x["index"]): (x["prediction"], x["nfe"], x["score"]) for x in lines}
        assert all(x["batch_size"] <= 2 for x in lines)
    assert got[True] == got[False] and len(got[True]) == 10


def test_resume_after_interruption(tiny, tmp_path):
    model, _ = tiny
    clean = {(x["setting"], x["task"], x["index"]): x["prediction"]
             for x in S.load_samples(S.run_sweep(model, tmp_path / "clean", METHODS, **SWEEP).samples_path)}

    class Stop(Exception):
        pass

    seen = []

    def boom(line):
        seen.append(line)
        if len(seen) == 5:
            raise Stop

    with pytest.raises(Stop):
        S.run_sweep(model, tmp_path / "cut", METHODS, **SWEEP, on_sample=boom)
    assert len(S.load_samples(tmp_path / "cut")) == 5
    with open(tmp_path / "cut" / S.SAMPLES_FILE, "a") as f:  # a torn line, as a crash mid-write leaves
        f.write('{"task": "waiting_line/co')
    starts = []
    res = S.run_sweep(model, tmp_path / "cut", METHODS, **SWEEP, on_start=lambda todo, done: starts.append((todo, done)))
    assert starts == [(22, 5)] and res.written == 22 and res.already_done == 5
    lines = S.load_samples(tmp_path / "cut")
    keys = [(x["setting"], x["task"], x["index"]) for x in lines]
    assert len(keys) == len(set(keys)) == 27
    assert {k: x["prediction"] for k, x in zip(keys, lines)} == clean
    again = S.run_sweep(model, tmp_path / "cut", METHODS, **SWEEP)  # nothing left to do
    assert again.written == 0 and again.already_done == 27
    more = S.run_sweep(model, tmp_path / "cut", ["topk:k=2"], **SWEEP)  # a new setting extends the file
    assert more.written == 9 and len(S.load_samples(tmp_path / "cut")) == 36
    with pytest.raises(ValueError, match="different sweep settings \\(data.style: 'short' there, 'full' now\\)"):
        S.run_sweep(model, tmp_path / "cut", METHODS, **{**SWEEP, "style": "full"})


def test_threshold_and_factor_grids(tiny, tmp_path):
    """ParallelBench's adaptive grids: threshold over tau, factor over f (registry parameter names)."""
    model, _ = tiny
    tau = S.parse_method("threshold:tau=0.5,0.6,...,1.0")
    assert [dict(p.params)["tau"] for p in tau] == [0.5, 0.6, 0.7, 0.8, 0.9, 1.0] and {p.method for p in tau} == {"threshold"}
    fac = S.parse_method("factor:factor=0.7,1.0,...,1.9")
    assert [dict(p.params)["factor"] for p in fac] == [0.7, 1.0, 1.3, 1.6, 1.9]
    res = S.run_sweep(model, tmp_path, ["threshold:tau=0.5,1.0", "factor:factor=1.9"], "waiting_line/copy", n=2,
                      style="short", batch_size=2)
    lines = S.load_samples(res.samples_path)
    assert res.written == 6 and {x["setting"] for x in lines} == {"threshold:tau=0.5", "threshold:tau=1.0",
                                                                 "factor:factor=1.9"}
    assert all(1 <= x["nfe"] <= 32 and x["tokens_per_step"] == 32 / x["nfe"] for x in lines)


def test_sweep_on_a_data_dir_with_missing_text_data(tiny, tmp_path):
    model, _ = tiny
    PB.write_suite(tmp_path / "data", "waiting_line/reverse", n=4)
    res = S.run_sweep(model, tmp_path / "out", ["topk:k=8"], "waiting_line/reverse,paraphrase_summarize",
                      data_dir=tmp_path / "data", batch_size=4)
    assert res.tasks == ["waiting_line/reverse"] and res.written == 4
    assert set(res.needs_data) == {"paraphrase_summarize/samsum", "paraphrase_summarize/chatgpt-paraphrases"}
    report = R.write_report(tmp_path / "out", plot=False)
    assert "paraphrase_summarize/samsum: needs data" in report.markdown


# ---------------------------------------------------------------------------------------------------------
# Reports on hand-made results


def _line(setting, method, task, score, tps, n=32, **kw):
    return {"setting": setting, "method": method, "task": task, "index": kw.pop("index", 0), "score": score,
            "score_strict": score, "tokens_per_step": tps, "nfe": n / tps, "output_length": 10, "time_s": 0.01, **kw}


def test_pb_scores_and_aup():
    pts = [(1.0, 95.0), (2.0, 85.0), (4.0, 75.0), (8.0, 40.0)]
    assert R.pb_score(pts, 90) == 1.0 and R.pb_score(pts, 80) == 2.0 and R.pb_score(pts, 70) == 4.0
    assert R.pb_score(pts, 99) is None
    assert R.pb_score(pts, 90, interpolate=True) == pytest.approx(1.5)
    assert R.pb_score(pts, 80, interpolate=True) == pytest.approx(3.0)
    assert R.pb_score(pts, 70, interpolate=True) == pytest.approx(4 + 4 * 5 / 35)
    assert R.pb_score([(1.0, 60.0), (2.0, 95.0)], 90) == 2.0  # not monotone: the best qualifying point
    expected = 1 * 0.95 + 1 * (0.95 + 0.85) / 2 + 2 * (0.85 + 0.75) / 2 + 4 * (0.75 + 0.40) / 2
    assert R.aup(pts) == pytest.approx(expected)
    assert R.aup([(8.0, 100.0)]) == pytest.approx(8.0)  # perfect up to 8 tokens per step
    assert R.aup([(2.0, 50.0), (2.0, 80.0)]) == pytest.approx(1.6)  # equal TPS: the best score
    assert R.aup([]) is None


def test_report_tables_exclusions_and_plot(tmp_path):
    lines = []
    for k, copy, shuffle in ((1, 1.0, 1.0), (2, 1.0, 0.5), (4, 1.0, 0.0)):
        for i in range(2):
            lines.append(_line(f"topk:k={k}", "topk", "waiting_line/copy", copy, float(k), index=i))
            s = float(i == 0) if shuffle == 0.5 else shuffle  # k=2: one of the two samples right
            lines.append(_line(f"topk:k={k}", "topk", "waiting_line/shuffle", s, float(k), index=i))
            lines.append(_line(f"topk:k={k}", "topk", "words_to_sentence/easy", None, float(k), index=i,
                               metrics={"inclusion_score": 1.0, "grammar_score": None}, unavailable=["grammar"],
                               unavailable_reason="grammar: not installed"))
    lines.append(_line("threshold:tau=0.9", "threshold", "waiting_line/copy", 1.0, 3.0))
    lines.append(_line("threshold:tau=0.9", "threshold", "waiting_line/copy", 1.0, 3.0, index=1))
    lines.append(_line("threshold:tau=0.9", "threshold", "waiting_line/shuffle", 1.0, 1.0))
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rep = R.write_report(tmp_path)
    assert rep.common_tasks == ["waiting_line/copy", "waiting_line/shuffle"]
    assert rep.excluded_tasks["words_to_sentence/easy"].startswith("score unavailable: grammar")
    assert [rep.settings[f"topk:k={k}"]["score"] for k in (1, 2, 4)] == [100.0, 75.0, 50.0]
    assert rep.curves["topk"]["PB90"] == 1.0 and rep.curves["topk"]["PB70"] == 2.0
    assert rep.curves["topk"]["PB70_interp"] == pytest.approx(2.4)
    assert rep.settings["threshold:tau=0.9"]["tps"] == pytest.approx(2.0)  # mean over tasks of mean TPS
    md = rep.markdown
    assert "| topk | 1.00 | 1.00 | 2.00 |" in md and "| waiting_line/shuffle | 100.0 | 50.0 | 0.0 | 100.0* |" in md
    assert "| words_to_sentence/easy | n/a | n/a | n/a |  |" in md and "inclusion_score % - topk:k=1: 100.0" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert rep.plots == [] and "matplotlib is not installed" in md
    else:
        assert [p.name for p in rep.plots] == ["pb_curve.png", "pb_tasks.png"]
        assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in rep.plots)
        assert "![pb_curve](pb_curve.png)" in md
    with pytest.raises(ValueError, match="no samples"):
        R.build_report([])


# ---------------------------------------------------------------------------------------------------------
# CLI


def test_cli_generate_score_run_report(tiny, tmp_path, capsys):
    _, ckpt = tiny
    assert main(["parallelbench", "generate", "--out", str(tmp_path / "data"), "--n", "4", "--index-base", "0",
                 "--sort-by", "first"]) == 0
    out, err = capsys.readouterr()
    assert "waiting_line/copy: 4 records" in out and "paraphrase_summarize/samsum: needs data" in err
    assert len(list((tmp_path / "data").glob("*/*.jsonl"))) == 15
    sort = PB.load_records(tmp_path / "data", "waiting_line/sort")
    assert sort[0]["metadata"]["sort_by"] == "first"

    # predictions made elsewhere: record + task + prediction
    preds = []
    for name in ("waiting_line/copy", "waiting_line/shuffle"):
        for i, r in enumerate(PB.load_records(tmp_path / "data", name)):
            preds.append({**r, "task": name, "prediction": _target(r) if i % 2 == 0 else "no list"})
    PB.write_jsonl(tmp_path / "preds.jsonl", preds)
    assert main(["parallelbench", "score", str(tmp_path / "preds.jsonl"), "--out", str(tmp_path / "scored.jsonl")]) == 0
    out, _ = capsys.readouterr()
    assert "| waiting_line/copy | 4 | 50.0 | 50.0 |" in out and "| waiting_line/shuffle | 4 | 50.0 | 50.0 |" in out
    scored = PB.read_jsonl(tmp_path / "scored.jsonl")
    assert [x["score"] for x in scored] == [1.0, 0.0] * 4 and all(x["prediction"] for x in scored)

    run_dir = tmp_path / "run"
    args = ["parallelbench", "run", "--model", str(ckpt), "--tasks", "waiting_line/copy", "--method", "topk:k=2,8",
            "--method", "llada:temperature=0", "--out", str(run_dir), "--n", "2", "--style", "short", "--batch-size", "2"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "[6 samples written, 0 already there" in err and "## Summary per method" in out
    assert main(args) == 0  # resumes: nothing to do
    assert "[0 samples written, 6 already there" in capsys.readouterr()[1]
    assert main(["parallelbench", "report", str(run_dir), "--out", str(tmp_path / "rep" / "r.md"), "--no-plot"]) == 0
    out, _ = capsys.readouterr()
    assert (tmp_path / "rep" / "r.md").read_text() + "\n" == out
    assert "topk:k=8" in out and "plot not written" in out
    assert main(["parallelbench", "run", "--model", str(ckpt), "--method", "nope:x=1", "--out", str(run_dir)]) == 2
    assert "unknown method 'nope'" in capsys.readouterr()[1]


def test_resume_recomputes_rewritten_records_and_refuses_changed_settings(tiny, tmp_path):
    model, _ = tiny
    PB.write_suite(tmp_path / "data", "waiting_line/copy", n=3, style="short")
    kw = dict(data_dir=tmp_path / "data", batch_size=3)
    first = S.run_sweep(model, tmp_path / "out", ["topk:k=8"], "waiting_line/copy", **kw)
    assert first.written == 3
    old = {x["index"]: x for x in S.load_samples(tmp_path / "out")}
    # rewrite one record of the data file in place (same path, same index)
    path = tmp_path / "data" / "waiting_line" / "copy.jsonl"
    records = PB.read_jsonl(path)
    records[1] = {**records[1], "input": {**records[1]["input"], "context": "[\"Zed Quill\", \"Amy Bo\"]"},
                  "answer": "[\"Zed Quill\", \"Amy Bo\"]"}
    PB.write_jsonl(path, records)
    starts = []
    res = S.run_sweep(model, tmp_path / "out", ["topk:k=8"], "waiting_line/copy", **kw,
                      on_start=lambda todo, done: starts.append((todo, done)))
    assert starts == [(1, 2)] and res.written == 1
    lines = S.load_samples(tmp_path / "out")
    assert sorted(x["index"] for x in lines) == [0, 1, 2]  # the stale line is gone, nothing doubled
    new = {x["index"]: x for x in lines}
    assert new[1]["answer"] == "[\"Zed Quill\", \"Amy Bo\"]" and new[0] == old[0] and new[2] == old[2]
    # a changed decode configuration under the same directory: refused, naming the change and the fix
    with pytest.raises(ValueError, match=r"gen_seed: 0 there, 1 now.*--overwrite"):
        S.run_sweep(model, tmp_path / "out", ["topk:k=8"], "waiting_line/copy", **kw, gen_seed=1)
    again = S.run_sweep(model, tmp_path / "out", ["topk:k=8"], "waiting_line/copy", **kw, gen_seed=1, overwrite=True)
    assert again.written == 3 and again.already_done == 0 and len(S.load_samples(tmp_path / "out")) == 3


def test_check_run_file_reads_only_and_overwrite_discards_a_malformed_run_file(tmp_path):
    pinned = S.sweep_pinned("m", data_dir=None, seed=1, style="short", index_base=1, sort_by="last",
                            sudoku_givens=(4, 12), text_data=None, gen_length=16, cache=None, gen_seed=0)
    assert S.check_run_file(tmp_path, pinned, False) == (None, None)
    run = tmp_path / S.RUN_FILE
    run.write_text(json.dumps({"pinned": pinned, "tasks": ["t"], "settings": []}))
    assert S.check_run_file(tmp_path, pinned, False) == ("resume", json.loads(run.read_text()))
    with pytest.raises(ValueError, match=r"data.style: 'short' there, 'full' now.*--overwrite"):
        S.check_run_file(tmp_path, {**pinned, "data": {**pinned["data"], "style": "full"}}, False)
    for bad in ("{broken", "[1, 2]", '{"tasks": []}', '{"pinned": 3}'):
        run.write_text(bad)
        with pytest.raises(ValueError, match=r"not a sweep's run file; use another --out directory or --overwrite"):
            S.check_run_file(tmp_path, pinned, False)
        assert S.check_run_file(tmp_path, pinned, True) == ("discard", None)
        assert run.read_text() == bad  # nothing touched


def test_run_sweep_overwrite_replaces_a_malformed_run_file(tiny, tmp_path):
    model, _ = tiny
    out = tmp_path / "out"
    kw = dict(n=1, style="short", gen_length=16)
    assert S.run_sweep(model, out, ["topk:k=8"], "waiting_line/copy", **kw).written == 1
    (out / S.RUN_FILE).write_text("{broken")
    with pytest.raises(ValueError, match="not a sweep's run file"):
        S.run_sweep(model, out, ["topk:k=8"], "waiting_line/copy", **kw)
    again = S.run_sweep(model, out, ["topk:k=8"], "waiting_line/copy", **kw, overwrite=True)
    assert again.written == 1 and again.already_done == 0 and len(S.load_samples(out)) == 1
    assert json.loads((out / S.RUN_FILE).read_text())["pinned"]["gen_length"] == 16


def test_run_style_defaults_to_the_bundled_models_prompts(tmp_path, capsys, monkeypatch):
    import argparse

    from dllm.assets import BUNDLED
    from dllm.cli.parallelbench import _style

    ns = argparse.Namespace
    assert _style(ns(style=None, model=None)) == "short"  # the default model is llada-tiny
    assert _style(ns(style=None, model="dream-tiny")) == "short"
    assert _style(ns(style=None, model=str(BUNDLED["llada-tiny"]))) == "short"  # its path counts too
    assert "--style full" in capsys.readouterr().err
    assert _style(ns(style=None, model=str(tmp_path))) == "full"  # any other checkpoint: the original prompts
    assert _style(ns(style="full", model=None)) == "full"  # an explicit choice wins
    assert _style(ns(style=None)) == "full"  # `generate` (no model)
    # the documented command, small: meaningful scores with the default style on the bundled model
    out = tmp_path / "run"
    assert main(["parallelbench", "run", "--tasks", "waiting_line/copy", "--method", "threshold:tau=0.9",
                 "--method", "localleap", "--n", "4", "--no-report", "--out", str(out)]) == 0
    lines = S.load_samples(out)
    assert len(lines) == 8 and sum(x["score"] for x in lines) >= 6
    assert json.loads((out / "run.json").read_text())["pinned"]["data"]["style"] == "short"
    # several processes would each run the whole sweep into one file: refused
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["parallelbench", "run", "--method", "topk:k=1", "--out", str(tmp_path / "x")]) == 2
    assert "single-process" in capsys.readouterr().err
