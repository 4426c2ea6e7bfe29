"""The stop rules' features and rules beyond the draft's probability, on hand-made rounds and a tiny model."""

import random

import pytest
import torch

from selfspec.engine.decoding import DecodeConfig, autoregressive
from selfspec.inspect.stop_features import (
    ALL,
    Logistic,
    Round,
    auc,
    by_copy,
    by_margin,
    by_round,
    copy_proposals,
    copy_signs,
    fitted_rules,
    held_out_auc,
    rising,
    target_probs,
)


def test_copy_proposals_follow_the_latest_longest_match():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2]
    props = copy_proposals(seq)
    assert len(props) == len(seq) + 1 and props[0] is None and props[1] is None
    assert props[5] is None  # "9 1" never occurred before: nothing down to two tokens
    assert props[7] == 9  # "1 2 3" was followed by 9
    assert props[10] == 3  # "1 2" was last followed by 3 (in "1 2 3 7")
    assert copy_signs(props, 6, [3, 4, 5]) == (1, -1, 0)  # "1 2" proposes 3; "1 2 3" proposes 9, not 4; "3 7", none


def test_auc_counts_ties_as_a_half():
    assert auc([0.9, 0.8, 0.1], [True, True, False]) == 1.0
    assert auc([0.1, 0.9], [True, False]) == 0.0
    assert auc([0.5, 0.5], [True, False]) == 0.5


def test_rules_on_copies_and_rounds_stop_where_their_thresholds_say():
    r = Round(conf=(0.9, 0.4, 0.4, 0.2), lead=2, margin=(0.8, 0.1, 0.1, 0.0), copy=(0, 1, -1, 0), start=0.5)
    assert by_copy(0.3, 0.5)(r) == 3  # the agreed 0.4 passes at 0.3, the next 0.4 stops under 0.5
    assert by_copy(0.0, 0.0)(r) == 4
    assert by_round("start", 0.4, 0.5, 0.0)(r) == 2 and by_round("start", 0.6, 0.5, 0.0)(r) == 4
    assert by_margin(0.5)(r) == 2 and by_margin(0.0)(r) == 4  # margins 0.8, 0.1: stops after the second
    assert rising(0.0, 0.05)(r) == 4 and rising(0.5, 0.0)(r) == 2
    assert rising(0.0, 0.25)(r) == 3  # thresholds 0, 0.25, 0.5: the second 0.4 is under the third


def _rounds(n: int, seed: int = 0) -> list[Round]:
    """Rounds whose misses come exactly where a copy lookup disagrees, whatever the draft's probability says."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        copy = tuple(rng.choice((0, 1, -1)) for _ in range(6))
        lead = next((j for j, s in enumerate(copy) if s < 0), 6)
        conf = tuple(rng.uniform(0.2, 1.0) for _ in range(6))
        out.append(Round(conf, lead, tuple(c / 2 for c in conf), copy, rng.uniform(0.3, 1.0), rng.uniform(0, 1)))
    return out


def test_a_learned_rule_finds_the_feature_that_tells_misses_apart():
    rounds = _rounds(200)
    assert held_out_auc(rounds, ALL, seed=0) > 0.95 > 0.7 > held_out_auc(rounds, None, seed=0)
    model = Logistic(rounds, ALL)
    assert model(rounds[0], 0) == model(rounds[0], 0)  # remembered
    # priced by tokens right a round less a cost per drafted token, the learned rule stops where the copy differs
    price = lambda rs, rule: sum(min(r.lead, rule(r)) - 0.3 * rule(r) for r in rs)  # noqa: E731
    fits = fitted_rules(price, [0.0, 0.5, 1.01], [0.1, 0.5, 0.9])
    learned = fits["learned, all"](rounds)
    assert all(learned(r) == r.lead + (r.lead < 6) for r in rounds[:50])
    assert price(rounds, learned) > price(rounds, fits["learned, the draft's own"](rounds))


@pytest.mark.parametrize("arch", ["llama"])
def test_target_probs_are_the_targets_probabilities_of_its_own_greedy_tokens(make_model, arch):
    model = make_model(arch)
    prompt = [3, 5, 7, 11, 13]
    cont = autoregressive(model, prompt, DecodeConfig(max_new_tokens=8), ()).tokens
    probs = target_probs(model, prompt, cont)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + cont[:-1]])).logits[0, len(prompt) - 1 :].float()
    want = logits.softmax(-1).max(-1).values.tolist()  # greedy: each token is its step's most likely
    assert len(probs) == len(cont) and probs == pytest.approx(want, rel=1e-4)


def test_whole_share_counts_the_model_rounds_the_target_accepts_whole():
    from selfspec.inspect.stop_rules import whole_share

    rounds = [Round(conf=(0.9, 0.9), lead=2), Round(conf=(0.9, 0.2), lead=1), Round(conf=(0.1,), lead=0)]
    assert whole_share(rounds, lambda r: len(r.conf)) == pytest.approx(1 / 3)  # only the first round's two are right
    assert whole_share(rounds, lambda r: 1) == pytest.approx(2 / 3)  # one token each: right in two rounds of three
    assert whole_share(rounds, lambda r: 2 if r.lead else 0) == 0.5  # a plain step is no model round
    assert whole_share(rounds, lambda r: 0) == 0.0
