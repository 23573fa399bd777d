"""Answer extraction and normalisation of the standard benchmarks, on hand-made cases."""

from pathlib import Path

import pytest

from dllm.evals.standard import answers as A
from dllm.evals.standard import get_standard_task, load_samples


@pytest.fixture
def fixtures():
    return Path(__file__).parent / "fixtures" / "eval"


@pytest.mark.parametrize("text,expected", [
    ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
    ("#### 1,234", "1234"),
    ("The total is $1,200.50 dollars.", "1200.5"),
    ("So the answer is 42. Then 7 more people came.", "42"),
    ("The answer is: **-3**", "-3"),
    ("We get \\boxed{18} in the end, 5 minutes", "18"),
    ("First 12, then 15, finally 72.00.", "72"),
    ("no digits here", None),
    ("", None),
])
def test_gsm8k_extraction(text, expected):
    assert A.extract_gsm8k_answer(text) == expected


def test_gsm8k_reference_and_numeric_compare():
    assert A.gsm8k_reference("5 * 6 = <<5*6=30>>30 pens.\n#### 30") == "30"
    assert A.gsm8k_reference("#### 1,000") == "1000"
    assert A.numbers_equal("72.0", "72") and A.numbers_equal("$1,000", "1000")
    assert not A.numbers_equal("71", "72") and not A.numbers_equal(None, "72")
    with pytest.raises(ValueError, match="####"):
        A.gsm8k_reference("no final answer")


@pytest.mark.parametrize("a,b,equal", [
    ("2.50", "2.5", True), ("1,000,000", "1000000", True), ("-0", "0", True), ("72.", "72", True),
    ("1000001", "1000000", False), ("0.3333333", "0.3333334", False), ("0.0000000001", "0", False),
    ("123456789012345678", "123456789012345679", False), ("0.1", "0.10000000000000001", False),
    ("0.12345678901234567890123456789012", "0.12345678901234567890123456789099", False),  # past 28 digits
    ("12345678901234567890123456789.5", "12345678901234567890123456790", False),
])
def test_numbers_compare_exactly(a, b, equal):
    assert A.numbers_equal(a, b) is equal and A.numbers_equal(b, a) is equal


@pytest.mark.parametrize("pred,ref,equal", [
    ("0.5", "\\frac12", True), ("1/2", "0.5", True), ("\\frac{10}{4}", "2.5", True), ("1.50", "\\frac32", True),
    ("0.3333333", "\\frac13", False), ("1000001", "1000000", False), ("1e-10", "0", False),
    ("0.0000000001", "0", False), ("\\frac{1}{3}", "0.333333", False),
])
def test_math_numbers_compare_exactly(pred, ref, equal):
    assert A.math_equiv(pred, ref) is equal


@pytest.mark.parametrize("text,expected", [
    ("so $x = \\boxed{5}$.", "5"),
    ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
    ("first \\boxed{1} then \\boxed{\\sqrt{2}+{1}}", "\\sqrt{2}+{1}"),
    ("answer \\fbox{7}", "7"),
    ("$\\boxed 9$", "9"),
    ("Final Answer: The final answer is $12$. I hope it is correct.", "12"),
    ("unfinished \\boxed{\\frac{1}{2", None),
    ("nothing", None),
])
def test_math_extraction(text, expected):
    assert A.extract_math_answer(text) == expected


@pytest.mark.parametrize("pred,ref", [
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("\\frac12", "\\frac{1}{2}"),
    ("0.5", "\\frac{1}{2}"),
    ("1/2", "\\frac{1}{2}"),
    ("x = 6", "6"),
    ("90^\\circ", "90"),
    ("5 \\text{ cm}", "5"),
    ("\\left(3, 4\\right)", "(3,4)"),
    ("\\sqrt2", "\\sqrt{2}"),
    ("\\$10", "10"),
    ("1,000", "1000"),
    ("\\text{(B)}", "(B)"),
    ("0.75", "\\frac{3}{4}"),
])
def test_math_equivalent(pred, ref):
    assert A.math_equiv(pred, ref), (A.normalize_math_answer(pred), A.normalize_math_answer(ref))


@pytest.mark.parametrize("pred,ref", [("\\frac{1}{3}", "\\frac{1}{2}"), ("(3,5)", "(3,4)"), ("7", "-7"),
                                      (None, "1"), ("\\sqrt{3}", "\\sqrt{2}"), ("12", "1,2"), ("1,2", "12")])
def test_math_not_equivalent(pred, ref):
    assert not A.math_equiv(pred, ref)


def test_code_extraction():
    assert A.extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone") == "def f():\n    return 1\n"
    assert A.extract_code("```\nx = 1\n```") == "x = 1\n"
    assert A.extract_code("```python\ndef g():\n    pass") == "def g():\n    pass"  # unclosed fence
    assert A.extract_code("[BEGIN]\ndef h(): return 2\n[DONE] extra") == "def h(): return 2"
    assert A.extract_code("    return a + b\n") == "    return a + b\n"


def test_truncate_at():
    assert A.truncate_at("42\nQuestion: next", ["Question:"]) == ("42\n", True)
    assert A.truncate_at("a b", ["x", "b", "a"]) == ("", True)
    assert A.truncate_at("abc", []) == ("abc", False)


def test_task_scoring_on_fixtures(fixtures):
    gsm = get_standard_task("gsm8k")
    samples, _ = load_samples(gsm, str(fixtures / "gsm8k.jsonl"))
    assert samples[0].reference == "7"
    assert gsm.score(samples[0], "3 + 4 = 7\n#### 7")["correct"]
    assert not gsm.score(samples[0], "#### 8")["correct"]
    math = get_standard_task("math")
    samples, _ = load_samples(math, str(fixtures / "math.jsonl"))
    assert samples[5].reference == "\\dfrac{1}{2}"
    assert math.score(samples[5], "It is $\\boxed{0.5}$")["correct"]
    assert not math.score(samples[5], "It is $\\boxed{2}$")["correct"]


def test_unknown_task_and_bad_data(tmp_path, fixtures):
    with pytest.raises(ValueError, match="known tasks: gsm8k, math, humaneval, mbpp"):
        get_standard_task("gsm9k")
    with pytest.raises(FileNotFoundError, match="data file not found"):
        load_samples(get_standard_task("gsm8k"), str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match=r"lacks field\(s\) \['answer'\]"):
        load_samples(get_standard_task("gsm8k"), str(bad))
    bad.write_text('{"question": "q", "answer": "#### 1"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        load_samples(get_standard_task("gsm8k"), str(bad))
    with pytest.raises(ValueError, match="pass --fewshot-data"):
        from dllm.evals.standard import build_prompts

        task = get_standard_task("gsm8k")
        samples, pool = load_samples(task, str(fixtures / "gsm8k.jsonl"), shots=8)
        build_prompts(task, samples, pool, 8)


def test_fewshot_prompts_exclude_the_sample(fixtures):
    from dllm.evals.standard import build_prompts

    task = get_standard_task("mbpp")
    samples, pool = load_samples(task, str(fixtures / "mbpp.jsonl"), shots=3)
    convs = build_prompts(task, samples, pool, 3)
    # the standard examples (task ids 2, 3, 4) for a test item; never the sample itself for the others
    assert [m["role"] for m in convs[3]] == ["user", "assistant"] * 3 + ["user"]
    assert "def add" in convs[3][1]["content"] and "def rev" in convs[3][5]["content"]
    assert all(samples[0].row["text"] not in m["content"] for m in convs[0][:-1])
    plain = build_prompts(get_standard_task("gsm8k"), *load_samples(get_standard_task("gsm8k"),
                          str(fixtures / "gsm8k.jsonl"), shots=1), 1, chat_template=False)
    assert plain[1].startswith("Question: Ann has 3 apples") and plain[1].endswith("Answer: ")
    assert "<<" not in plain[1]  # calculator annotations removed from the examples
