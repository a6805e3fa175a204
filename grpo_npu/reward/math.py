r"""MATH-style rule rewards: the last ``\boxed{...}`` answer, normalised, compared with the truth.

``compute_score`` (MATH, MATH-500 data sources): 1.0 when the last ``\boxed{}`` / ``\fbox{}`` of the
response is equivalent to the ground truth (itself unboxed if boxed), else 0.0.
``compute_score_dapo`` (DAPO-Math, AIME data sources, as in the DAPO recipe): the answer is the last
``Answer: ...`` line of the last ``DAPO_CLIP_CHARS`` characters (else the last box there); score
+1.0 right / -1.0 wrong, with ``acc`` and ``pred``.

Equivalence: both sides are normalised (``normalize_answer``: ``\text{}``/``\left``/spacing/``$``/
degree/percent markup dropped, ``\dfrac``/``\tfrac`` -> ``\frac``, ``\frac12`` -> ``\frac{1}{2}``,
``x = 5`` -> ``5``, thousands commas and trailing units removed); two answers that both read as
exact numbers (integers, decimals, ``a/b``, ``\frac{a}{b}``) compare as numbers, others as text.
"""

from __future__ import annotations

import re
from fractions import Fraction

DAPO_CLIP_CHARS = 300  # the DAPO recipe's rule: the longest MATH-500 answer is ~160 characters
BOX_COMMANDS = ("\\boxed", "\\fbox")

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DROP = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "^{\\circ}", "^\\circ",
         "\\%", "%", "\\$", "$")
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox|mathbf)\{([^{}]*)\}")
_TRAILING_UNITS = re.compile(r"^(.*?[0-9}])\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z ]*\}$")
_SHORT_LHS = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?$")  # "x", "y_1", "k_{2}": a variable name
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_FRAC_HALF_SHORT = re.compile(r"\\frac(\d)\{")
_FRAC_HALF_SHORT2 = re.compile(r"\\frac\{([^{}]*)\}(\d)")
_SQRT_SHORT = re.compile(r"\\sqrt(\w)")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_LATEX_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_PLAIN_FRAC = re.compile(r"^(-?\d+)/(\d+)$")


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` / ``\fbox{...}`` (braces balanced) or ``\boxed x``."""
    start = max(text.rfind(cmd) for cmd in BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + len(cmd):]
    if rest.startswith(" "):  # "\boxed 5": up to the next space or "$"
        return re.split(r"[\s$]", rest.lstrip(), maxsplit=1)[0] or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return rest[1:i]
    return None  # unbalanced: the box was cut off


def normalize_answer(answer: str) -> str:
    """A canonical text form of a final answer (see the module docstring)."""
    s = answer.strip()
    s = _TRAILING_UNITS.sub(r"\1", s)
    for _ in range(3):  # nested wrappers, innermost first
        s = _WRAPPERS.sub(r"\1", s)
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace(" ", "").rstrip(".")
    if s.count("=") == 1 and _SHORT_LHS.match(s.split("=")[0]):
        s = s.split("=")[1]
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_HALF_SHORT.sub(r"\\frac{\1}{", s)
    s = _FRAC_HALF_SHORT2.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if s.startswith("."):
        s = "0" + s
    elif s.startswith("-."):
        s = "-0" + s[1:]
    return s


def as_number(normalized: str) -> Fraction | None:
    """An exact value for integers, decimals, ``a/b`` and ``\\frac{a}{b}``; None for anything else."""
    m = _LATEX_FRAC.match(normalized) or _PLAIN_FRAC.match(normalized)
    try:
        if m is None:
            return Fraction(normalized) if re.fullmatch(r"-?\d*\.?\d+", normalized) else None
        if len(m.groups()) == 3:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        return Fraction(int(m.group(1)), int(m.group(2)))
    except ZeroDivisionError:
        return None


def is_equiv(answer: str, ground_truth: str) -> bool:
    """Whether two final answers are the same after normalisation (numerically when both are numbers)."""
    a, b = normalize_answer(answer), normalize_answer(ground_truth)
    x, y = as_number(a), as_number(b)
    if x is not None and y is not None:
        return x == y
    return a == b


def _truth(ground_truth) -> str:
    text = str(ground_truth)
    boxed = last_boxed(text)
    return text if boxed is None else boxed


def score_details(solution_str: str, ground_truth) -> dict:
    r"""{"score": 1.0/0.0, "acc", "pred"} for the last ``\boxed{}`` of the response."""
    pred = last_boxed(solution_str)
    correct = pred is not None and is_equiv(pred, _truth(ground_truth))
    return {"score": float(correct), "acc": float(correct), "pred": pred}


def compute_score(solution_str: str, ground_truth) -> float:
    r"""1.0 when the last ``\boxed{}`` answer is equivalent to the ground truth, else 0.0."""
    return score_details(solution_str, ground_truth)["score"]


def compute_score_dapo(solution_str: str, ground_truth) -> dict:
    """DAPO-recipe reward: +1.0 right, -1.0 wrong or missing, from an ``Answer:`` line (else a box)."""
    tail = solution_str[-DAPO_CLIP_CHARS:]
    lines = _ANSWER_LINE.findall(tail)
    pred = lines[-1].strip() if lines else last_boxed(tail)
    if pred is not None and last_boxed(pred) is not None:
        pred = last_boxed(pred)
    correct = pred is not None and is_equiv(pred, _truth(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": pred}
