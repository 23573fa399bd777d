"""Intervals and significance of quality figures (dllm.evals.stats) and where the reports print them."""

from __future__ import annotations

import math

import pytest

from dllm.evals import stats
from dllm.evals.parallelbench.report import build_report
from dllm.evals.standard.runner import summarize, summary_markdown


def test_wilson_interval_matches_published_values():
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I: 81/263 and 0/10.
    lo, hi = stats.proportion_ci(81, 263)
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)
    lo, hi = stats.proportion_ci(0, 10)
    assert lo == pytest.approx(0.0, abs=1e-12) and round(hi, 4) == 0.2775
    assert all(math.isnan(v) for v in stats.proportion_ci(0, 0))
    with pytest.raises(ValueError, match="between 0 and n"):
        stats.proportion_ci(3, 2)


def test_mean_ci_is_wilson_for_binary_scores_and_a_bootstrap_otherwise():
    assert stats.mean_ci([1, 1, 0, 1]) == stats.proportion_ci(3, 4)
    lo, hi = stats.mean_ci([0.2, 0.4, 0.6, 0.8, 1.0])
    assert 0.2 <= lo < 0.6 < hi <= 1.0
    assert stats.mean_ci([0.5, 0.5]) == (0.5, 0.5)
    assert stats.mean_ci([0.3, 0.9], seed=1) == stats.mean_ci([0.3, 0.9], seed=1)  # fixed seed: reproducible


def test_paired_test_exact_sign_flip_p_value():
    # 8 of 10 pairs differ, all in favour of a: the exact two-sided sign-flip p-value is 2 / 2**8.
    res = stats.paired_test([1] * 8 + [0, 1], [0] * 8 + [0, 1])
    assert res["diff"] == pytest.approx(0.8) and res["p"] == pytest.approx(2 / 2 ** 8) and res["n"] == 10
    assert res["low"] <= 0.8 <= res["high"]
    same = stats.paired_test([1, 0, 1], [1, 0, 1])
    assert same["diff"] == 0 and same["p"] == 1.0
    with pytest.raises(ValueError, match="one length"):
        stats.paired_test([1, 0], [1])


def _lines(method: str, setting: str, scores: list[float], tps: float, task: str = "waiting_line/copy") -> list[dict]:
    return [{"method": method, "setting": setting, "task": task, "index": i, "score": s, "score_strict": s,
             "tokens_per_step": tps, "nfe": 32 / tps} for i, s in enumerate(scores)]


def test_report_prints_intervals_and_which_differences_are_significant():
    good = [1.0] * 40
    bad = [1.0] * 10 + [0.0] * 30
    lines = (_lines("a", "a:k=1", good, 1.0) + _lines("a", "a:k=4", good, 4.0)
             + _lines("b", "b:k=1", good, 1.0) + _lines("b", "b:k=4", bad, 4.0)
             + _lines("c", "c:k=1", good, 1.0) + _lines("c", "c:k=4", good, 4.0))
    rep = build_report(lines)
    assert rep.curves["a"]["AUP"] == pytest.approx(4.0)
    lo, hi = rep.curves["b"]["AUP_ci"]
    assert lo <= rep.curves["b"]["AUP"] <= hi < 4.0
    assert rep.settings["b:k=4"]["score_ci"][1] < 50  # 25 % scored, interval well below 50 %
    md = rep.markdown
    assert "AUP 95% CI" in md and "## Differences between methods" in md and "## Score 95% CI by task" in md
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in md.splitlines()
            if line.startswith("| a |") or line.startswith("| b |")}
    assert rows[("a", "b")].rstrip().endswith("| yes |")  # a keeps 100 % at k=4, b drops to 25 %
    assert rows[("a", "c")].rstrip().endswith("| 1.000 | no |")  # identical on every example


def test_eval_summary_has_the_accuracy_interval():
    rows = [{"id": str(i), "correct": i < 17, "nfe": 4, "tokens": 3, "time": 0.1, "tokens_per_forward": 8.0}
            for i in range(20)]
    s = summarize("gsm8k", rows)
    assert s.accuracy == 0.85 and s.accuracy_ci == stats.proportion_ci(17, 20)
    table = summary_markdown([s])
    assert "95% CI" in table.splitlines()[0] and "[64.0, 94.8]" in table
