"""The task quality scorers on fixed inputs: HumanEval's tests, GSM8K's answer, ROUGE-L."""

import pytest

from tests.helpers import HUMANEVAL_REF


def test_humaneval_scorer_runs_the_tests_in_a_subprocess():
    from selfspec.eval.quality import humaneval_passes

    good = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    body_only = "    return a + b\n"
    hangs = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    assert humaneval_passes(good, HUMANEVAL_REF) and humaneval_passes(body_only, HUMANEVAL_REF)
    assert not humaneval_passes(wrong, HUMANEVAL_REF)
    assert not humaneval_passes(hangs, HUMANEVAL_REF, timeout_s=2.0)
    assert not humaneval_passes("```python\ndef add(a, b):\n    return (a +\n```", HUMANEVAL_REF)  # cut off


def test_gsm8k_scorer_and_rouge_l():
    from selfspec.eval.quality import gsm8k_correct, quality, rouge_l

    ref = {"answer": "She sells 16 - 3 - 4 = 9 eggs.\n9 * 2 = 18\n#### 18"}
    assert gsm8k_correct("So she makes 9 * 2 = $18 every day.", ref)
    assert not gsm8k_correct("So she makes $20 a day.", ref) and not gsm8k_correct("no number", ref)
    assert gsm8k_correct("The total is 1,200.", {"answer": "#### 1200"})
    assert rouge_l("a b c d", "a b c d") == 1.0 and rouge_l("a b", "c d") == 0.0
    assert rouge_l("a b c d", "a c d e") == pytest.approx(0.75)  # LCS a c d: P = R = 3/4
    rows = [{"sample_id": "x", "output_text": ["= 18"], "reference": ref},
            {"sample_id": "y", "output_text": ["= 17"], "reference": ref}]
    base = [{"sample_id": "x", "output_text": ["= 18"]}, {"sample_id": "y", "output_text": ["= 18"]}]
    assert quality(rows, base) == {"accuracy": 0.5, "rouge_l_vs_baseline": 0.75}  # (1 + 1/2) / 2
