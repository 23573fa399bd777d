"""Answer extraction and normalisation for the standard benchmarks (GSM8K, MATH, HumanEval, MBPP).

Pure functions on strings; no model, no I/O. The scorers follow the usual public protocols:

* GSM8K: the reference is the number after ``####``; a prediction's answer is, in order of preference, the
  number after ``####``, after "the answer is", inside ``\\boxed{}``, else the last number in the text.
  Numbers compare exactly (commas, ``$`` and trailing zeros ignored; no tolerance: ``1000001`` is not
  ``1000000``).
* MATH: the answer is the content of the last ``\\boxed{...}`` (or ``\\fbox``), else the text after
  "final answer is"; both sides are normalised (Hendrycks-style string clean-up: ``\\dfrac`` -> ``\\frac``,
  ``\\left``/``\\right``, units in ``\\text{}``, degrees, ``x = `` prefixes, ``\\frac12`` -> ``\\frac{1}{2}``,
  spaces) and then compared as strings, or as exact numbers when both parse (``0.5`` == ``\\frac{1}{2}``,
  ``0.333`` != ``\\frac{1}{3}``).
* Code: the program is taken from the first fenced code block (or between ``[BEGIN]`` and ``[DONE]``), else
  the whole text.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

__all__ = [
    "extract_code",
    "extract_gsm8k_answer",
    "extract_math_answer",
    "gsm8k_reference",
    "last_boxed",
    "math_equiv",
    "normalize_math_answer",
    "normalize_number",
    "numbers_equal",
    "truncate_at",
]

_MAX_EXPONENT = 400  # larger or smaller magnitudes are not answers (and would spell out hundreds of digits)
_NUMBER = r"-?\$?\s?\d[\d,]*(?:\.\d+)?|-?\$?\s?\.\d+"


def truncate_at(text: str, stops) -> tuple[str, bool]:
    """Cut ``text`` at the earliest occurrence of any stop string. Returns ``(text, was_cut)``."""
    cut = min((i for i in (text.find(s) for s in stops or () if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def normalize_number(s: str | None) -> str | None:
    """``"$1,234.50"`` -> ``"1234.5"``; ``"72.00"`` -> ``"72"``; ``None`` when ``s`` holds no number. Exact: the
    decimal digits are kept as written (no rounding through a float)."""
    if s is None:
        return None
    t = s.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    v = _decimal(t)
    if v is None:
        return None
    if v == v.to_integral_value():
        return str(int(v))
    return format(v, "f").rstrip("0")  # every digit as written (Decimal.normalize would round to 28 digits)


def _decimal(s: str) -> Decimal | None:
    """``s`` as a finite decimal of a sane exponent (``None`` when it is not one)."""
    try:
        v = Decimal(s)
    except InvalidOperation:
        return None
    return v if v.is_finite() and abs(v.adjusted()) <= _MAX_EXPONENT else None


def _exact(s: str) -> Fraction | None:
    """The exact value of a normalised integer / decimal string (``None`` when it is not one)."""
    v = _decimal(s)
    return None if v is None else Fraction(v)


def numbers_equal(a: str | None, b: str | None) -> bool:
    """Whether two numbers are exactly equal (``"2.50"`` == ``"2.5"``, ``"$1,000"`` == ``"1000"``; ``"1000001"`` !=
    ``"1000000"``)."""
    na, nb = normalize_number(a), normalize_number(b)
    if na is None or nb is None:
        return False
    return _exact(na) == _exact(nb)


def gsm8k_reference(answer_field: str) -> str:
    """The reference number of a GSM8K ``answer`` field (text after the last ``####``)."""
    if "####" not in answer_field:
        raise ValueError(f"GSM8K answer field has no '####' final answer: {answer_field[-80:]!r}")
    ref = normalize_number(answer_field.rsplit("####", 1)[1])
    if ref is None:
        raise ValueError(f"GSM8K answer after '####' is not a number: {answer_field.rsplit('####', 1)[1]!r}")
    return ref


def extract_gsm8k_answer(text: str) -> str | None:
    """The final numeric answer of a GSM8K-style solution, normalised; ``None`` when there is no number."""
    if not text:
        return None
    for pattern in (r"####\s*(" + _NUMBER + ")", r"answer is[:\s]*\**\s*(" + _NUMBER + ")"):
        hits = re.findall(pattern, text, flags=re.IGNORECASE)
        if hits:
            return normalize_number(hits[-1])
    boxed = last_boxed(text)
    if boxed is not None:
        n = re.findall(_NUMBER, boxed)
        if n:
            return normalize_number(n[-1])
    nums = re.findall(_NUMBER, text)
    return normalize_number(nums[-1]) if nums else None


# ----------------------------------------------------------------------------------------------- MATH


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces handled; ``\\boxed 5`` form too)."""
    if not text:
        return None
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)", text)]
    for m in reversed(starts):
        i = m.end()
        if i < len(text) and text[i] == " ":  # "\boxed 5$": up to the next $ or whitespace
            rest = text[i + 1 :]
            return re.split(r"[\s$]", rest, maxsplit=1)[0] or None
        while i < len(text) and text[i] == " ":
            i += 1
        if i >= len(text) or text[i] != "{":
            continue
        depth = 0
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j]
        return None  # unbalanced: an unfinished answer
    return None


def extract_math_answer(text: str) -> str | None:
    """The final answer of a MATH-style solution (raw, not normalised)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    m = re.findall(r"final answer is\s*\$?(.+?)\$?(?:\.\s*I hope|\s*$|\.\s*$|\n)", text or "", flags=re.IGNORECASE)
    if m:
        return m[-1].strip()
    return None


def _fix_fracs(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2}, \frac{1}2 -> \frac{1}{2}
    out = []
    parts = s.split("\\frac")
    out.append(parts[0])
    for part in parts[1:]:
        out.append("\\frac")
        if part.startswith("{"):
            # numerator braced; fix an unbraced single-character denominator
            depth, end = 0, len(part) - 1
            for pos, ch in enumerate(part):
                depth += ch == "{"
                depth -= ch == "}"
                if depth == 0:
                    end = pos
                    break
            num, rest = part[: end + 1], part[end + 1 :]
            if rest and rest[0] != "{" and rest[0] not in " \\":
                rest = "{" + rest[0] + "}" + rest[1:]
            out.append(num + rest)
        elif len(part) >= 2:
            a, rest = part[0], part[1:]
            if rest[0] == "{":
                out.append("{" + a + "}" + rest)
            else:
                out.append("{" + a + "}{" + rest[0] + "}" + rest[1:])
        else:
            out.append(part)
    return "".join(out)


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def normalize_math_answer(ans: str | None) -> str | None:
    """Hendrycks-style string normalisation of a MATH answer (``None`` stays ``None``)."""
    if ans is None:
        return None
    s = ans.strip().replace("\n", "").replace("\\!", "")
    s = re.sub(r"\\\\+", r"\\", s)
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("°", "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    # a trailing unit written as text: "5 \text{ cm}" -> "5"; a whole answer in \text{}: keep its content
    s = re.sub(r"^\\(?:text|textbf|mbox|mathrm)\{(.*)\}$", r"\1", s)
    s = re.sub(r"(?<=\S)\s*\\(?:text|mbox|mathrm)\{\s*[a-zA-Z ]+\}(\^\d)?$", "", s)
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{(.*?)\}", r"\1", s)
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    # "x = 5" / "k=5" -> "5" (a short left-hand side only)
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if len(lhs.strip()) <= 2:
            s = rhs
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    s = s.rstrip(".")
    return s


def _as_number(s: str) -> Fraction | None:
    """The exact value of a normalised answer that is a number: an integer, a decimal or ``\\frac{a}{b}`` of
    those (``None`` otherwise)."""
    # commas only as thousands separators ("1,000"); "1,2" is a pair of answers, not 12
    t = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s) else s
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", t)
    if m:
        den = Fraction(m.group(3))
        return None if den == 0 else (-1 if m.group(1) else 1) * Fraction(m.group(2)) / den
    return _exact(t)


def math_equiv(pred: str | None, ref: str | None) -> bool:
    """``True`` when two MATH answers agree after normalisation: as strings, or as exactly equal numbers
    (``0.5`` == ``\\frac{1}{2}``; ``0.3333333`` != ``\\frac{1}{3}``)."""
    if pred is None or ref is None:
        return False
    a, b = normalize_math_answer(pred), normalize_math_answer(ref)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and y is not None and x == y


# ----------------------------------------------------------------------------------------------- code


def extract_code(text: str) -> str:
    """The program in a model's answer: the first fenced block (an unclosed fence runs to the end), or the
    text between ``[BEGIN]`` and ``[DONE]``, else the whole text."""
    if text is None:
        return ""
    m = re.search(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", text, flags=re.DOTALL)
    if m:
        return m.group(1)
    if "[BEGIN]" in text:
        body = text.split("[BEGIN]", 1)[1]
        return body.split("[DONE]", 1)[0].strip("\n")
    return text
