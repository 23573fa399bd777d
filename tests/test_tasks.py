"""Tests for the synthetic tasks, their scorers and the project tokenizer."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from dllm.evals import tasks as T
from dllm.evals.tasks import Example, parse_list

ALL_TASKS = T.task_names()


def _ex(name: str, seed: int = 0, i: int = 0, **options) -> Example:
    return T.generate(name, i + 1, seed, **options)[i]


# ---------------------------------------------------------------------------------------------------------
# Registry


def test_registry_and_families():
    assert len(ALL_TASKS) == 13
    assert T.task_names("waiting_line/*") == [f"waiting_line/{op}" for op in T.WAITING_LINE_OPS]
    assert T.task_names("puzzle/*") == ["puzzle/latin_square", "puzzle/sudoku"]
    assert T.task_names("puzzle") == T.FAMILIES["puzzle"]
    assert T.task_names("*/sudoku") == ["puzzle/sudoku"]
    assert T.task_names("nothing*") == []
    assert set(T.FAMILIES) == {"waiting_line", "puzzle", "arithmetic"}
    assert sorted(itertools.chain(*T.FAMILIES.values())) == sorted(ALL_TASKS)
    for name in ALL_TASKS:
        task = T.get_task(name)
        assert task.name == name and name.startswith(task.family + "/")
        assert T.get_task(task) is task


def test_one_task_table_serves_both_suites():
    from dllm.evals import parallelbench as PB

    # ParallelBench's 17 and the synthetic 13 are views of one table: the same Task objects, 12 shared.
    assert len(T.TASKS) == 18 and len(T.task_names(suite="all")) == 18
    assert all(T.TASKS[t.name] is t for t in PB.TASKS.values())
    shared = [n for n in ALL_TASKS if T.TASKS[n].pb_name]
    assert len(shared) == 12 and "arithmetic/addition" not in shared
    assert PB.get_task("puzzle/sudoku") is T.get_task("puzzle/sudoku_n4_12") is T.TASKS["puzzle/sudoku"]
    assert T.TASKS["puzzle/latin_square"].pb_name == "puzzle/latin_square_n4"
    assert PB.task_names("puzzle") == ["puzzle/latin_square_n4", "puzzle/sudoku_n4_12"]
    assert T.task_names("puzzle/sudoku_n4_12") == ["puzzle/sudoku"]
    assert PB.get_task("summarization") is T.TASKS["paraphrase_summarize/samsum"]
    with pytest.raises(KeyError, match="unknown parallelbench task 'arithmetic/addition'"):
        PB.get_task("arithmetic/addition")
    with pytest.raises(KeyError, match="unknown synthetic task 'words_to_sentence/easy'"):
        T.get_task("words_to_sentence/easy", suite="synthetic")
    with pytest.raises(ValueError, match="no chat-example generator"):
        T.generate("words_to_sentence/easy", 1, 0)
    with pytest.raises(ValueError, match="known suites"):
        T.task_names(suite="nope")
    # The synthetic suite's short prompt is ParallelBench's short wording of the same task.
    ex = T.generate("waiting_line/copy", 1, 0)[0]
    assert T.TASKS["waiting_line/copy"].short_prompt.format(context=ex.metadata["input"]["context"]) == ex.prompt


def test_parse_list_rules_are_explicit():
    assert T.parse_list('x ["A B", "C"]') == T.parse_list('x ["A B", "C"]', rules="parallelbench") == ["A B", "C"]
    assert T.parse_list("[\u201cA B\u201d]") == ["A B"]  # curly quotes stripped by the project's rules only
    assert T.parse_list("[\u201cA B\u201d]", rules="parallelbench") == ["\u201cA B\u201d"]
    with pytest.raises(ValueError, match="known: dllm, parallelbench"):
        T.parse_list("[]", rules="hf")


def test_get_task_unknown_lists_names():
    with pytest.raises(KeyError) as info:
        T.get_task("waiting_line/teleport")
    assert "waiting_line/copy" in str(info.value) and "puzzle/sudoku" in str(info.value)


def test_name_lists():
    assert 35 <= len(T.FIRST_NAMES) <= 50 and 35 <= len(T.LAST_NAMES) <= 50
    assert len(set(T.FIRST_NAMES)) == len(T.FIRST_NAMES)
    assert len(set(T.LAST_NAMES)) == len(T.LAST_NAMES)
    assert not set(T.FIRST_NAMES) & set(T.LAST_NAMES)
    assert all(n.isalpha() and n[0].isupper() for n in T.FIRST_NAMES + T.LAST_NAMES)


# ---------------------------------------------------------------------------------------------------------
# Generation


@pytest.mark.parametrize("name", ALL_TASKS)
def test_generation_deterministic_and_distinct(name):
    a = T.generate(name, 30, 7)
    b = T.generate(name, 30, 7)
    assert a == b
    assert len(a) == 30
    keys = [(e.prompt, e.target) for e in a]
    assert len(set(keys)) == len(keys), "duplicates within one call"
    c = T.generate(name, 30, 8)
    assert {e.prompt for e in a} != {e.prompt for e in c}
    assert len({e.prompt for e in a} & {e.prompt for e in c}) <= 3
    # a prefix of a longer call from the same seed is the same examples
    assert T.generate(name, 10, 7) == a[:10]


@pytest.mark.parametrize("name", ALL_TASKS)
def test_example_structure_and_reference_scores(name):
    task = T.get_task(name)
    for ex in task.generate(60, 3):
        assert ex.task == name
        assert [m["role"] for m in ex.messages] == ["user", "assistant", "user"]
        assert all(isinstance(m["content"], str) and m["content"] for m in ex.messages)
        assert ex.messages[0]["content"] != ex.messages[2]["content"]
        target = ex.target
        assert task.score(target, ex) == 1.0
        assert task.score_strict(target, ex) == 1.0
        assert T.score(target, ex) == 1.0 and T.score_strict(target, ex) == 1.0
        # the worked example's answer is valid for the worked example's question, i.e. scorers agree
        assert task.score("", ex) == 0.0 and task.score_strict("", ex) == 0.0
        if task.multi_answer:
            assert isinstance(ex.answer, dict) and "example" in ex.answer
        else:
            assert isinstance(ex.answer, str)


def test_generators_use_no_global_state():
    random.seed(1)
    a = T.generate("waiting_line/shuffle", 5, 2)
    random.seed(2)
    state = random.getstate()
    b = T.generate("waiting_line/shuffle", 5, 2)
    assert a == b
    assert random.getstate() == state


def test_waiting_line_lengths_balanced():
    exs = T.generate("waiting_line/copy", 40, 0)
    lengths = [e.metadata["length"] for e in exs]
    assert sorted(set(lengths)) == [3, 4, 5, 6]
    assert all(lengths.count(n) == 10 for n in (3, 4, 5, 6))
    for e in exs:
        names = parse_list(e.answer)
        assert len(names) == e.metadata["length"] == len(set(names))
        assert len({n.split()[1] for n in names}) == len(names)
        assert all(n.split()[0] in T.FIRST_NAMES and n.split()[1] in T.LAST_NAMES for n in names)


def test_waiting_line_prompt_format():
    ex = _ex("waiting_line/copy", seed=0)
    context = ex.metadata["input"]["context"]
    assert ex.prompt == "Please copy the list exactly:\n" + context
    assert context == T.list_to_str(parse_list(context))
    assert ex.answer == context
    assert context.startswith('["') and context.endswith('"]') and '", "' in context
    full = _ex("waiting_line/copy", seed=0, style="full")
    assert full.prompt.startswith("You are managing a waiting line at a customer service desk.")
    assert full.prompt.endswith("Please copy the list exactly and provide only the final list.")


def test_sort_by_last_name_and_bug_option():
    for ex in T.generate("waiting_line/sort", 40, 1):
        names = parse_list(ex.answer)
        lasts = [n.split()[1] for n in names]
        assert lasts == sorted(lasts)
        assert "by last name" in ex.prompt
    bugged = T.generate("waiting_line/sort", 40, 1, sort_by="first")
    assert [e.prompt for e in bugged] == [e.prompt for e in T.generate("waiting_line/sort", 40, 1)]
    differ = 0
    for ex in bugged:
        names = parse_list(ex.answer)
        assert names == sorted(names)
        differ += names != sorted(names, key=lambda n: n.split()[1])
    assert differ > 20
    with pytest.raises(ValueError):
        T.generate("waiting_line/sort", 1, 1, sort_by="middle")


@pytest.mark.parametrize("base", [0, 1])
def test_index_ops_follow_index_base(base):
    for op in ("insert_index", "remove_index", "replace_index"):
        for ex in T.generate(f"waiting_line/{op}", 30, 4, index_base=base):
            names = parse_list(ex.metadata["input"]["context"])
            shown = ex.metadata["index"]
            assert f"position {shown} " in ex.prompt.replace(":", " ") and ex.metadata["index_base"] == base
            i = shown - base
            out = parse_list(ex.answer)
            if op == "insert_index":
                assert 0 <= i <= len(names) and out == names[:i] + [ex.metadata["word"]] + names[i:]
                assert f'"{ex.metadata["word"]}"' in ex.prompt
            elif op == "remove_index":
                assert 0 <= i < len(names) and out == names[:i] + names[i + 1:]
            else:
                assert 0 <= i < len(names) and out == names[:i] + [ex.metadata["word"]] + names[i + 1:]
                assert ex.metadata["word"] not in names
    with pytest.raises(ValueError):
        T.generate("waiting_line/remove_index", 1, 0, index_base=2)


def test_default_index_base_is_one():
    assert T.INDEX_BASE == 1
    positions = {e.metadata["index"] for e in T.generate("waiting_line/remove_index", 80, 0)}
    assert min(positions) == 1 and 0 not in positions


# ---------------------------------------------------------------------------------------------------------
# List parsing and waiting-line scorers


def test_parse_list_lenient():
    assert parse_list('["Ann Lee", "Bob Stone"]') == ["Ann Lee", "Bob Stone"]
    assert parse_list("['Ann Lee', 'Bob Stone']") == ["Ann Lee", "Bob Stone"]
    assert parse_list('[“Ann Lee”, “Bob Stone”]') == ["Ann Lee", "Bob Stone"]
    assert parse_list('[ "Ann  Lee" ,"Bob Stone" ]') == ["Ann Lee", "Bob Stone"]
    assert parse_list('Sure! The final list is: ["Ann Lee", "Bob Stone"]. Done.') == ["Ann Lee", "Bob Stone"]
    assert parse_list('[Ann Lee, Bob Stone]') == ["Ann Lee", "Bob Stone"]
    assert parse_list('["Ann Lee", "Bob Stone"') == ["Ann Lee", "Bob Stone"]  # cut off before ]
    assert parse_list('["Ann Lee", "Bob Stone",]') == ["Ann Lee", "Bob Stone"]
    assert parse_list("[]") == []
    assert parse_list("") is None
    assert parse_list(None) is None
    assert parse_list("Ann Lee, Bob Stone") is None


def test_parse_list_strict():
    assert parse_list('["Ann Lee", "Bob Stone"]', strict=True) == ["Ann Lee", "Bob Stone"]
    assert parse_list('  ["Ann Lee"]\n', strict=True) == ["Ann Lee"]
    assert parse_list("[]", strict=True) == []
    for bad in ("['Ann Lee', 'Bob Stone']", '["Ann Lee","Bob Stone"]', 'List: ["Ann Lee"]',
                '["Ann Lee", "Bob Stone"] ok', "[Ann Lee]", '["Ann Lee", "Bob Stone"', ""):
        assert parse_list(bad, strict=True) is None, bad


def _wl(op: str, names: list[str], out: list[str], word: str | None = None) -> Example:
    """A hand-made waiting-line example."""
    name = f"waiting_line/{op}"
    if op == "shuffle" or op.endswith("_random"):
        answer: str | dict = {"input": names, "example": T.list_to_str(out)}
        if word:
            answer["word"] = word
    else:
        answer = T.list_to_str(out)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
            {"role": "user", "content": T.list_to_str(names)}]
    return Example(task=name, messages=msgs, answer=answer, metadata={"word": word})


NAMES = ["Ann Lee", "Bob Stone", "Cid Moss", "Dee Park"]


def test_copy_scorer_edge_cases():
    ex = _wl("copy", NAMES, NAMES)
    task = T.get_task("waiting_line/copy")
    ref = T.list_to_str(NAMES)
    assert task.score(ref, ex) == 1.0 and task.score_strict(ref, ex) == 1.0
    assert task.score("Here you go:\n" + ref + "\nThanks", ex) == 1.0
    assert task.score_strict("Here you go:\n" + ref, ex) == 0.0
    assert task.score("['Ann Lee', 'Bob Stone', 'Cid Moss', 'Dee Park']", ex) == 1.0
    assert task.score_strict("['Ann Lee', 'Bob Stone', 'Cid Moss', 'Dee Park']", ex) == 0.0
    assert task.score('["Ann Lee", "Bob Stone", "Cid Moss", "Dee Park", "Dee Park"]', ex) == 0.0
    assert task.score('["Ann Lee", "Bob Stone", "Dee Park", "Cid Moss"]', ex) == 0.0
    assert task.score('["Ann Lee", "Bob Stone", "Cid Moss"]', ex) == 0.0
    assert task.score("", ex) == 0.0 and task.score("[]", ex) == 0.0
    assert task.score("no list here", ex) == 0.0


def test_shuffle_scorer():
    task = T.get_task("waiting_line/shuffle")
    ex = _wl("shuffle", NAMES, NAMES[::-1])
    assert task.score(T.list_to_str(NAMES), ex) == 0.0  # identical to the input
    assert task.score(T.list_to_str(NAMES[1:] + NAMES[:1]), ex) == 1.0
    assert task.score(T.list_to_str(["Bob Stone", "Ann Lee", "Cid Moss", "Cid Moss"]), ex) == 0.0
    assert task.score(T.list_to_str(["Bob Stone", "Ann Lee", "Cid Moss"]), ex) == 0.0
    assert task.score(T.list_to_str(["Bob Stone", "Ann Lee", "Cid Moss", "Eve Roy"]), ex) == 0.0
    for perm in itertools.permutations(NAMES):
        assert task.score(T.list_to_str(list(perm)), ex) == float(list(perm) != NAMES)


def test_insert_random_scorer():
    task = T.get_task("waiting_line/insert_random")
    word = "Eve Roy"
    ex = _wl("insert_random", NAMES, NAMES + [word], word)
    for i in range(len(NAMES) + 1):
        assert task.score(T.list_to_str(NAMES[:i] + [word] + NAMES[i:]), ex) == 1.0
    assert task.score(T.list_to_str(NAMES[:2] + ["Zed Fox"] + NAMES[2:]), ex) == 0.0  # wrong word
    assert task.score(T.list_to_str(NAMES), ex) == 0.0
    assert task.score(T.list_to_str([word] + NAMES + [word]), ex) == 0.0
    assert task.score(T.list_to_str([word] + NAMES[::-1]), ex) == 0.0  # order changed
    assert task.score(T.list_to_str([word] + NAMES[1:]), ex) == 0.0  # replaced, not inserted


def test_remove_random_scorer():
    task = T.get_task("waiting_line/remove_random")
    ex = _wl("remove_random", NAMES, NAMES[1:])
    for i in range(len(NAMES)):
        assert task.score(T.list_to_str(NAMES[:i] + NAMES[i + 1:]), ex) == 1.0
    assert task.score(T.list_to_str(NAMES[2:]), ex) == 0.0
    assert task.score(T.list_to_str(NAMES), ex) == 0.0
    assert task.score(T.list_to_str(["Cid Moss", "Bob Stone", "Dee Park"]), ex) == 0.0
    assert task.score(T.list_to_str(["Bob Stone", "Bob Stone", "Dee Park"]), ex) == 0.0


def test_replace_random_scorer():
    task = T.get_task("waiting_line/replace_random")
    word = "Eve Roy"
    ex = _wl("replace_random", NAMES, [word] + NAMES[1:], word)
    for i in range(len(NAMES)):
        assert task.score(T.list_to_str(NAMES[:i] + [word] + NAMES[i + 1:]), ex) == 1.0
    assert task.score(T.list_to_str(NAMES), ex) == 0.0
    assert task.score(T.list_to_str(["Zed Fox"] + NAMES[1:]), ex) == 0.0
    assert task.score(T.list_to_str([word, word] + NAMES[2:]), ex) == 0.0
    assert task.score(T.list_to_str([word] + NAMES), ex) == 0.0
    assert task.score(T.list_to_str([word] + NAMES[1:][::-1]), ex) == 0.0


def test_generated_random_ops_accept_other_valid_answers():
    for ex in T.generate("waiting_line/remove_random", 20, 5):
        src = ex.answer["input"]
        for i in range(len(src)):
            assert T.score(T.list_to_str(src[:i] + src[i + 1:]), ex) == 1.0
    for ex in T.generate("waiting_line/insert_random", 20, 5):
        src, word = ex.answer["input"], ex.answer["word"]
        assert f'"{word}"' in ex.prompt
        assert T.score(T.list_to_str([word] + src), ex) == 1.0
        assert T.score(T.list_to_str(src + [word]), ex) == 1.0
        assert T.score(T.list_to_str(src + ["Zed Fox"]), ex) == 0.0


# ---------------------------------------------------------------------------------------------------------
# Puzzles


def _brute_force_sudoku(cells: list[str]) -> list[str]:
    """Independent backtracking solver: all solutions of a 16-cell puzzle ('.' = blank)."""
    sols = []

    def ok(c, d):
        r, k = divmod(c, 4)
        for j in range(4):
            if cells[r * 4 + j] == d or cells[j * 4 + k] == d:
                return False
        br, bk = r // 2 * 2, k // 2 * 2
        return all(cells[(br + a) * 4 + bk + b] != d for a in (0, 1) for b in (0, 1))

    def rec():
        try:
            c = cells.index(".")
        except ValueError:
            sols.append("".join(cells))
            return
        for d in "1234":
            if ok(c, d):
                cells[c] = d
                rec()
                cells[c] = "."

    rec()
    return sols


def test_sudoku_unique_and_given_counts():
    exs = T.generate("puzzle/sudoku", 45, 11)
    counts = [e.metadata["length"] for e in exs]
    assert set(counts) == set(range(4, 13))
    for ex in exs:
        puzzle = ex.metadata["puzzle"]
        assert ex.prompt == "Solve this 4x4 sudoku:\n" + puzzle
        cells = list(puzzle.replace("\n", ""))
        assert len(cells) == 16 and set(cells) <= set("1234.")
        n_given = sum(c != "." for c in cells)
        assert 4 <= n_given <= 12 and n_given == ex.metadata["length"] == len(ex.metadata["givens"])
        sols = _brute_force_sudoku(list(cells))
        assert sols == [ex.answer.replace("\n", "")]
        assert T.count_sudoku_solutions({int(k): v for k, v in ex.metadata["givens"].items()}) == 1
        shot = ex.messages[0]["content"].split("\n", 1)[1].replace("\n", "")
        assert _brute_force_sudoku(list(shot)) == [ex.messages[1]["content"].replace("\n", "")]


def test_sudoku_solution_count():
    assert len(T.sudoku_solutions()) == 288
    assert all(T.is_sudoku_solution(T._grid_rows(list(s))) for s in T.sudoku_solutions())
    assert T.count_sudoku_solutions({}) == 288


def test_sudoku_scorer():
    ex = _ex("puzzle/sudoku", seed=2)
    task = T.get_task("puzzle/sudoku")
    sol = ex.answer
    assert task.score(sol, ex) == 1.0 and task.score_strict(sol, ex) == 1.0
    spaced = "\n".join(" ".join(row) for row in sol.split("\n"))
    assert task.score("Output:\n" + spaced + "\n", ex) == 1.0
    assert task.score_strict(spaced, ex) == 0.0
    # a valid grid that ignores the givens
    givens = {int(k): v for k, v in ex.metadata["givens"].items()}
    other = next(s for s in T.sudoku_solutions() if any(s[c] != v for c, v in givens.items()))
    other_txt = "\n".join(other[i:i + 4] for i in range(0, 16, 4))
    assert T.is_sudoku_solution(T._grid_rows(list(other)))
    assert task.score(other_txt, ex) == 0.0
    # a Latin square that breaks the boxes
    bad = "1234\n2341\n3412\n4123"
    assert T.is_latin_square(T._grid_rows(list(bad.replace("\n", ""))), "1234")
    assert not T.is_sudoku_solution(T._grid_rows(list(bad.replace("\n", ""))))
    assert task.score(bad, ex) == 0.0
    assert task.score(sol + "\n" + sol, ex) == 0.0  # two grids: ambiguous
    assert task.score(sol.split("\n", 1)[1], ex) == 0.0
    assert task.score("", ex) == 0.0


def test_latin_square_generation():
    exs = T.generate("puzzle/latin_square", 40, 6)
    for ex in exs:
        symbols = ex.answer["symbols"]
        assert len(set(symbols)) == 4 and set(symbols) <= set(T.LATIN_SYMBOLS)
        assert ex.prompt == "Generate a 4x4 Latin square with the symbols " + ", ".join(symbols) + ":"
        grid = T.parse_grid(ex.target, 4, "".join(symbols))
        assert T.is_latin_square(grid, symbols)
    assert len({tuple(e.answer["symbols"]) for e in exs}) > 30


def test_latin_square_scorer():
    ex = _ex("puzzle/latin_square", seed=3)
    task = T.get_task("puzzle/latin_square")
    a, b, c, d = ex.answer["symbols"]
    square = [[a, b, c, d], [b, c, d, a], [c, d, a, b], [d, a, b, c]]
    text = "\n".join(" ".join(r) for r in square)
    assert task.score(text, ex) == 1.0 and task.score_strict(text, ex) == 1.0
    csv = "\n".join(",".join(r) for r in square)
    assert task.score("Here it is:\n" + csv + "\n", ex) == 1.0
    assert task.score_strict(csv, ex) == 0.0
    assert task.score("\n".join("".join(r) for r in square), ex) == 1.0
    broken = [list(r) for r in square]
    broken[1] = [a, c, d, b]  # column 0 repeats `a`
    assert task.score("\n".join(" ".join(r) for r in broken), ex) == 0.0
    other = next(s for s in "ABCDEFGHIJ" if s not in (a, b, c, d))
    relabeled = "\n".join(" ".join(other if x == a else x for x in r) for r in square)
    assert task.score(relabeled, ex) == 0.0  # right shape, wrong symbol set
    assert task.score("\n".join(" ".join(r) for r in square[:3]), ex) == 0.0
    assert task.score("", ex) == 0.0
    assert not T.is_latin_square(None)
    assert not T.is_latin_square(((a, a, b, c),) * 4, [a, b, c, d])


def test_latin_square_with_givens():
    exs = T.generate("puzzle/latin_square", 20, 2, givens=(3, 6))
    task = T.get_task("puzzle/latin_square")
    for ex in exs:
        givens = ex.answer["givens"]
        assert 3 <= len(givens) <= 6
        grid_text = ex.prompt.split("\n", 1)[1]
        assert sum(ch != "." for ch in grid_text.replace(" ", "").replace("\n", "")) == len(givens)
        assert task.score(ex.target, ex) == 1.0
        # a valid square that contradicts a given cell
        symbols = ex.answer["symbols"]
        cell, value = next(iter(givens.items()))
        wrong = next(s for s in T._all_latin_squares()
                     if symbols[s[int(cell)]] != value)
        text = "\n".join(" ".join(symbols[v] for v in wrong[r * 4:(r + 1) * 4]) for r in range(4))
        assert task.score(text, ex) == 0.0


# ---------------------------------------------------------------------------------------------------------
# Arithmetic


def test_addition():
    exs = T.generate("arithmetic/addition", 100, 0)
    task = T.get_task("arithmetic/addition")
    for ex in exs:
        a, b = ex.metadata["a"], ex.metadata["b"]
        assert 10 <= a <= 9999 and 10 <= b <= 9999
        assert ex.prompt == f"What is {a} + {b}?"
        assert ex.answer == str(a + b)
    assert {len(str(e.metadata["a"])) for e in exs} == {2, 3, 4}
    ex = exs[0]
    s = int(ex.answer)
    assert task.score(f"The answer is {s}.", ex) == 1.0
    assert task.score(f"{ex.metadata['a']} + {ex.metadata['b']} = {s}", ex) == 1.0
    assert task.score(f"{s:,}", ex) == 1.0
    assert task.score_strict(f"The answer is {s}.", ex) == 0.0
    assert task.score_strict(f" {s}\n", ex) == 1.0
    assert task.score(str(s + 1), ex) == 0.0 and task.score("", ex) == 0.0


# ---------------------------------------------------------------------------------------------------------
# Tokenizer


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    from dllm.tiny.tokenizer import build_tokenizer

    root = tmp_path_factory.mktemp("tok")
    return {fam: build_tokenizer(root / fam, fam) for fam in ("llada", "dream")}


@pytest.fixture(scope="module")
def toks(tok_dirs):
    from transformers import AutoTokenizer

    return {fam: AutoTokenizer.from_pretrained(str(d)) for fam, d in tok_dirs.items()}


def test_tokenizer_files_and_determinism(tok_dirs, tmp_path):
    from dllm.tiny.tokenizer import build_tokenizer

    for d in tok_dirs.values():
        assert {p.name for p in d.iterdir()} >= {"tokenizer.json", "tokenizer_config.json",
                                                  "special_tokens_map.json"}
    again = build_tokenizer(tmp_path / "again", "llada")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (again / f).read_bytes() == (tok_dirs["llada"] / f).read_bytes()
    # same vocabulary for both families
    assert (tok_dirs["llada"] / "tokenizer.json").read_bytes() == (tok_dirs["dream"] / "tokenizer.json").read_bytes()
    vocab = json.loads((again / "tokenizer.json").read_text())["model"]["vocab"]
    assert 512 <= len(vocab) <= 2048


def test_special_tokens(toks):
    from dllm.tiny.tokenizer import SPECIAL_TOKENS

    for tok in toks.values():
        ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
        assert ids == list(range(len(SPECIAL_TOKENS)))
        for s in SPECIAL_TOKENS:
            assert tok.encode(s, add_special_tokens=False) == [SPECIAL_TOKENS.index(s)]
    llada, dream = toks["llada"], toks["dream"]
    assert llada.bos_token == "<|startoftext|>" and llada.eos_token == "<|endoftext|>"
    assert llada.pad_token == "<|endoftext|>" and llada.mask_token == "<|mdm_mask|>"
    assert dream.bos_token is None and dream.eos_token == "<|endoftext|>"
    assert dream.pad_token == "<|endoftext|>" and dream.mask_token == "<|mask|>"
    assert llada.get_vocab() == dream.get_vocab()
    assert llada.encode("hello", add_special_tokens=False) == dream.encode("hello", add_special_tokens=False)
    assert llada("hi")["input_ids"] == llada.encode("hi", add_special_tokens=False)  # no automatic bos


def test_tokenizer_round_trip(toks):
    tok = toks["llada"]
    texts = ['["Ann Lee", "Bob Stone"]', "What is 1234 + 987?\n", "  tabs\tand   spaces  ",
             "Unicode: café – naïve 日本語 🙂", "A B C D\nB C D A", "x" * 50, ""]
    texts += [m["content"] for e in T.generate("waiting_line/insert_random", 3, 0) for m in e.messages]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok.encode("12345", add_special_tokens=False)) == list("12345")


def test_names_and_prompt_words_are_single_tokens(toks):
    tok = toks["dream"]

    def n_tokens(s):
        return len(tok.encode(s, add_special_tokens=False))

    for first in T.FIRST_NAMES:
        assert n_tokens(first) == 1, first
    for last in T.LAST_NAMES:
        assert n_tokens(" " + last) == 1, last
    for word in T.prompt_words():
        assert n_tokens(" " + word) == 1 or n_tokens(word) == 1, word
    # every pre-token of every generated text is exactly one token
    backend = tok.backend_tokenizer
    variants = [(name, {}) for name in ALL_TASKS]
    variants += [(name, {"style": "full"}) for name in T.task_names("waiting_line/*") + T.task_names("puzzle/*")]
    variants += [("puzzle/latin_square", {"givens": (2, 8)}), ("puzzle/sudoku", {"blank": "0"})]
    for name, options in variants:
        for ex in T.generate(name, 20, 123, **options):
            for text in [m["content"] for m in ex.messages] + [ex.target]:
                for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text):
                    assert len(backend.model.tokenize(piece)) == 1, (name, piece)


def test_list_item_tokenizer_layout(tmp_path):
    """``list_items``: every token of a name list is one whole item with its punctuation, names alone stay
    single tokens, every pre-token of the task texts is one token, and text round-trips."""
    from transformers import AutoTokenizer

    from dllm.tiny.tokenizer import build_tokenizer

    tok = AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path / "items", "llada", list_items=True)))
    ex = T.generate("waiting_line/copy", 1, 5)[0]
    names = T.parse_list(ex.target)
    pieces = tok.convert_ids_to_tokens(tok.encode(ex.target, add_special_tokens=False))
    assert len(pieces) == 2 * len(names)
    assert pieces[0] == '["' + names[0].split()[0] and pieces[-1] == "Ġ" + names[-1].split()[1] + '"]'
    for first in T.FIRST_NAMES:
        assert len(tok.encode(first, add_special_tokens=False)) == 1, first
    backend = tok.backend_tokenizer
    for name in ALL_TASKS:
        for ex in T.generate(name, 10, 7):
            for text in [m["content"] for m in ex.messages] + [ex.target]:
                assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
                for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text):
                    assert len(backend.model.tokenize(piece)) == 1, (name, piece)


def test_names_tokenizer_layout(tmp_path):
    """``layout="names"``: each name is one token, the very same token in every list position and in the
    instruction that names it (so copying, moving or inserting a name never changes its token); the list
    structure is ``[``, ``, `` and ``]``; every pre-token of the task texts is one token; text round-trips."""
    from transformers import AutoTokenizer

    from dllm.tiny.tokenizer import build_tokenizer

    tok = AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path / "names", "llada", layout="names")))

    def pieces(text):
        return tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))

    ex = T.generate("waiting_line/insert_index", 1, 5)[0]
    word = ex.metadata["word"] if "word" in ex.metadata else ex.answer["word"]
    first, last = word.split()
    target = pieces(ex.target)
    names = T.parse_list(ex.target)
    assert len(target) == 3 * len(names) + 1  # "[" + (first, last, ", ") per name, "]" instead of the last ", "
    assert target[0] == "[" and target[-1] == "]" and target[3] == ",Ġ"
    question = pieces(ex.prompt)
    assert f'"{first}' in question and f'Ġ{last}"' in question  # the inserted name as the instruction writes it
    assert f'"{first}' in target and f'Ġ{last}"' in target  # ... is the same two tokens in the answer list
    for f, l in zip(T.FIRST_NAMES, T.LAST_NAMES):
        assert pieces(f'["{f} {l}"]') == ["[", f'"{f}', f"Ġ{l}" + '"', "]"]
        assert pieces(f'Insert "{f} {l}" at') == ["Insert", "Ġ", f'"{f}', f"Ġ{l}" + '"', "Ġat"]
    backend = tok.backend_tokenizer
    for name in ALL_TASKS:
        for ex in T.generate(name, 10, 7):
            for text in [m["content"] for m in ex.messages] + [ex.target]:
                assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
                for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text):
                    assert len(backend.model.tokenize(piece)) == 1, (name, piece)
    with pytest.raises(ValueError, match="unknown tokenizer layout"):
        build_tokenizer(tmp_path / "bad", "llada", layout="words")


def test_chat_templates(toks):
    from dllm.tiny.tokenizer import chat_text

    msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"}]
    llada = chat_text(toks["llada"], msgs)
    assert llada == ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nQ1<|eot_id|>"
                     "<|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|>"
                     "<|start_header_id|>user<|end_header_id|>\n\nQ2<|eot_id|>"
                     "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert toks["llada"].apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False) == (
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nQ1<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert chat_text(toks["llada"], msgs, add_generation_prompt=False).endswith("Q2<|eot_id|>")
    dream = chat_text(toks["dream"], msgs)
    assert dream == ("<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
                     "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n")
    assert "system" not in dream and "system" not in llada
    assert chat_text(toks["dream"], msgs, add_generation_prompt=False).endswith("Q2<|im_end|>\n")
    ids = toks["llada"].apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert ids[0] == toks["llada"].bos_token_id
    assert toks["llada"].decode(ids) == llada


def test_max_token_lengths(toks, capsys):
    report = {}
    for fam, tok in toks.items():
        for name in ALL_TASKS:
            longest = 0
            for ex in T.generate(name, 200, 17):
                msgs = ex.messages + [{"role": "assistant", "content": ex.target}]
                text = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
                longest = max(longest, len(tok.encode(text, add_special_tokens=False)))
            report[(fam, name)] = longest
    with capsys.disabled():
        print("\nmax tokens of a full chat + answer (llada / dream):")
        for name in ALL_TASKS:
            print(f"  {name:28s} {report[('llada', name)]:4d} {report[('dream', name)]:4d}")
    assert max(report.values()) < 160, report
