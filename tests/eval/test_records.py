"""What a run records of its decoding settings, so that runs recorded before a setting existed still resume; the
paired ratio of timed repetitions."""

import pytest

from selfspec import DecodeConfig
from selfspec.eval.records import decode_record, seconds_ratio


def test_runs_recorded_before_packed_weights_resume_with_them_off(monkeypatch):
    from selfspec.eval import records

    monkeypatch.setattr(records, "pack_format", lambda: "bf16")  # as on a CPU that packs bf16 (tests/kernels/test_packed.py)
    assert "packed_weights" not in decode_record(DecodeConfig(packed_weights=False))
    rec = decode_record(DecodeConfig())
    assert rec["packed_weights"] is True and rec["k"] == DecodeConfig().k
    assert "packed_only" not in rec and decode_record(DecodeConfig(packed_only=True))["packed_only"] is True
    # the gate came later: runs recorded without it still resume; with it on, its settings are recorded
    assert "gate" not in rec and "gate_probe" not in rec
    assert decode_record(DecodeConfig(gate=True, gate_probe=4)) == {**rec, "gate": True, "gate_probe": 4}


def test_seconds_ratio_is_the_ratio_of_sums_with_a_paired_interval_around_it():
    base = [1.0, 2.0, 1.5, 1.2, 0.9, 1.1]
    assert seconds_ratio(base, [0.8 * t for t in base]) == pytest.approx((0.8, 0.8, 0.8))  # every pair alike
    other = [0.7, 1.9, 1.2, 1.2, 0.6, 1.0]
    ratio, lo, hi = seconds_ratio(base, other)
    assert ratio == pytest.approx(sum(other) / sum(base))  # of sums: the point inside its own interval
    assert min(o / b for b, o in zip(base, other)) <= lo < ratio < hi <= max(o / b for b, o in zip(base, other))
