"""What a run records of its decoding settings, so that runs recorded before a setting existed still resume."""

from selfspec import DecodeConfig
from selfspec.eval.records import decode_record


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
