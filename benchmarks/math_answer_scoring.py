"""GSM8K / MATH answer scoring: the project's scorer against the published protocols and math-verify.

For each case (a model output, the reference solution, and whether the answer is mathematically right) it
asks four scorers for a verdict and counts agreements:

* ``dllm``: :mod:`dllm.evals.standard` (what ``dllm eval gsm8k|math`` records);
* ``hendrycks``: the MATH paper's protocol — the last ``\\boxed{}`` of each side, its ``strip_string``
  normalisation and string equality (lm-eval's ``hendrycks_math`` functions) — MATH only;
* ``minerva``: lm-eval's ``minerva_math`` exact match (answer normalisation + sympy equivalence) — MATH only;
  for GSM8K, lm-eval's ``gsm8k`` ``strict-match`` (the number after ``####``) and ``flexible-extract``
  (the last number) filters;
* ``math-verify``: ``math_verify.verify(parse(reference), parse(output))``.

Cases: every record of ``tests/fixtures/eval/{gsm8k,math}.jsonl`` scored against its own solution (right)
and against a wrong number (wrong), plus the hand-written tricky cases below.

    OMP_NUM_THREADS=1 python benchmarks/math_answer_scoring.py [--show]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "eval"

# (output, reference solution, right?)
MATH_CASES = [
    (r"so the answer is $\boxed{0.5}$", r"$\boxed{\frac{1}{2}}$", True),
    (r"$\boxed{\dfrac{3}{4}}$", r"$\boxed{\frac34}$", True),
    (r"$\boxed{x = 6}$", r"$\boxed{6}$", True),
    (r"$\boxed{6.0}$", r"$\boxed{6}$", True),
    (r"$\boxed{\sqrt{2}/2}$", r"$\boxed{\frac{\sqrt{2}}{2}}$", True),
    (r"$\boxed{(1,2)}$", r"$\boxed{(1, 2)}$", True),
    (r"$\boxed{10\%}$", r"$\boxed{10}$", True),
    (r"$\boxed{5 \text{ cm}}$", r"$\boxed{5}$", True),
    (r"$\boxed{90^\circ}$", r"$\boxed{90}$", True),
    (r"$\boxed{2x+1}$", r"$\boxed{1+2x}$", True),
    (r"$\boxed{\frac{2}{4}}$", r"$\boxed{\frac{1}{2}}$", True),
    (r"$\boxed{1,000}$", r"$\boxed{1000}$", True),
    (r"$\boxed{-\frac{1}{2}}$", r"$\boxed{-0.5}$", True),
    (r"$\boxed{x^2+2x+1}$", r"$\boxed{(x+1)^2}$", True),
    (r"$\boxed{\text{(B)}}$", r"$\boxed{\text{(B)}}$", True),
    (r"$\boxed{\infty}$", r"$\boxed{\infty}$", True),
    (r"$\boxed{2\sqrt{3}}$", r"$\boxed{\sqrt{12}}$", True),
    (r"The final answer is $5$. I hope it is correct.", r"$\boxed{5}$", True),
    (r"$\boxed{0.1}$", r"$\boxed{\frac{1}{10}}$", True),
    (r"$\boxed{\$18.90}$", r"$\boxed{18.90}$", True),
    (r"first $\boxed{3}$, then correcting: $\boxed{5}$", r"$\boxed{5}$", True),
    (r"$\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}$", r"$\boxed{\begin{pmatrix}1\\2\end{pmatrix}}$", True),
    (r"$\boxed{\pi}$", r"$\boxed{3.14}$", False),
    (r"$\boxed{1/3}$", r"$\boxed{0.333}$", False),
    (r"$\boxed{3}$", r"$\boxed{4}$", False),
    (r"$\boxed{[1,3)}$", r"$\boxed{[1,3]}$", False),
    (r"$\boxed{\frac{1}{2}}$", r"$\boxed{\frac{1}{3}}$", False),
    (r"$\boxed{x^2-1}$", r"$\boxed{(x-1)^2}$", False),
    (r"$\boxed{12}$", r"$\boxed{1,2}$", False),
    (r"$\boxed{-5}$", r"$\boxed{5}$", False),
]

GSM8K_CASES = [
    ("She has 6 + 12 = 18 apples.\n#### 18", "6 + 12 = 18\n#### 18", True),
    ("The answer is $1,234.", "#### 1,234", True),
    ("He pays 18.00 dollars.\n#### 18.00", "#### 18", True),
    ("#### 18\nNext week he buys 20 more.", "#### 18", True),
    (r"So he has $\boxed{72}$ marbles.", "#### 72", True),
    ("He pays 5*3=15 dollars.", "#### 15", True),
    ("#### -3", "#### -3", True),
    ("The answer is 42.5", "#### 42", False),
    ("She has 3 cats and 4 dogs, so 7 pets. #### 8", "#### 7", False),
    ("It costs $0.50 per pen, so 10 pens cost 5 dollars. #### 5", "#### 5", True),
]


def _fixture_cases(name: str, ref_of) -> list[tuple[str, str, bool]]:
    out = []
    for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines():
        row = json.loads(line)
        sol = row["solution" if name == "math" else "answer"]
        out.append((sol, sol, True))
        wrong = r"$\boxed{987654}$" if name == "math" else "#### 987654"
        out.append((wrong, sol, False))
    return out


def scorers(task: str) -> dict:
    from dllm.evals.standard import answers as A

    out = {}
    if task == "math":
        out["dllm"] = lambda o, r: A.math_equiv(A.extract_math_answer(o), A.extract_math_answer(r))
    else:
        out["dllm"] = lambda o, r: A.numbers_equal(A.extract_gsm8k_answer(o), A.gsm8k_reference(r))
    try:
        if task == "math":
            from lm_eval.tasks.hendrycks_math import utils as H

            def hendrycks(o, r):  # the MATH paper's protocol: last \\boxed{} of each, strip_string, equal strings
                a, b = H.last_boxed_only_string(o), H.last_boxed_only_string(r)
                return a is not None and b is not None and bool(H.is_equiv(H.remove_boxed(a), H.remove_boxed(b)))

            out["hendrycks"] = hendrycks
            try:
                from lm_eval.tasks.minerva_math import utils as M
            except (ImportError, AssertionError) as exc:  # it pins antlr4-python3-runtime 4.11
                print(f"(minerva_math not importable here: {str(exc)[:120]}; column skipped)")
            else:
                def minerva(o, r):
                    gold = M.normalize_final_answer(M.remove_boxed(M.last_boxed_only_string(r)))
                    return bool(M.is_equiv(M.normalize_final_answer(M.get_unnormalized_answer(o)), gold))

                out["minerva"] = minerva
        else:
            def strict(o, r):
                m = re.search(r"#### (\-?[0-9\.\,]+)", o)
                return m is not None and _gsm_clean(m.group(1)) == _gsm_clean(r.rsplit("####", 1)[1])

            def flexible(o, r):
                m = re.findall(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", o)
                last = [a or b for a, b in m][-1] if m else ""
                return _gsm_clean(last) == _gsm_clean(r.rsplit("####", 1)[1])

            out["lm-eval strict"], out["lm-eval flexible"] = strict, flexible
    except ImportError as exc:
        print(f"(lm-eval not importable: {exc}; published-protocol columns skipped)")
    try:
        from math_verify import parse, verify

        out["math-verify"] = lambda o, r: bool(verify(parse(r), parse(o)))
    except ImportError:
        print("(math-verify not installed: pip install math-verify)")
    return out


def _gsm_clean(s: str) -> str:
    # lm-eval gsm8k exact_match: regexes_to_ignore ",", "\$", "(?s).*#### ", "\.$"; ignore_case, strip
    s = re.sub(r"(?s).*#### ", "", s)
    for pat in (",", r"\$", r"\.$"):
        s = re.sub(pat, "", s)
    return s.strip().lower()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--show", action="store_true", help="print every case's verdicts")
    args = ap.parse_args(argv)
    for task, tricky in (("gsm8k", GSM8K_CASES), ("math", MATH_CASES)):
        cases = _fixture_cases(task, None) + tricky
        fns = scorers(task)
        verdicts = {name: [bool(fn(o, r)) for o, r, _ in cases] for name, fn in fns.items()}
        truth = [ok for _, _, ok in cases]
        print(f"\n{task}: {len(cases)} cases ({len(cases) - len(tricky)} from the fixtures, {len(tricky)} tricky)")
        names = list(verdicts)
        print("| scorer | agrees with the right verdict | " + " | ".join(f"agrees with {n}" for n in names[1:]) + " |")
        print("|---|---|" + "---|" * (len(names) - 1))
        for n in names:
            right = sum(v == t for v, t in zip(verdicts[n], truth))
            agree = [sum(a == b for a, b in zip(verdicts[n], verdicts[m])) for m in names[1:]]
            print(f"| {n} | {right}/{len(cases)} | " + " | ".join(f"{a}/{len(cases)}" for a in agree) + " |")
        if args.show:
            for i, (o, r, t) in enumerate(cases):
                row = " ".join(f"{n}={int(verdicts[n][i])}" for n in names)
                print(f"  right={int(t)} {row} | {o[-40:]!r} vs {r[-30:]!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
