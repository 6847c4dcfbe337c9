"""benchmarks/decode_floor.py splits an engine step into phases by wrapping the engine's functions by
name. A rename in the engine broke it unseen once (throughput.py calls it after its long workloads,
and died there); here a stale name fails a test instead."""

from __future__ import annotations

from pathlib import Path

from benchmarks import decode_floor

DEMO = Path(__file__).resolve().parents[1] / "sample_data" / "demo-model"


def test_every_phase_of_a_decode_step_is_found_and_timed() -> None:
    out = decode_floor.measure(DEMO, batch=4, context=16, steps=3)
    phases = out["breakdown_ms"]
    assert out["raw_forward_ms"] > 0 and out["native_step_ms"] > 0 and out["native_execute_ms"] > 0
    for phase in ("scheduling", "metadata", "attn_compute", "sampling", "detokenize_stop"):
        assert phases[phase] > 0, phase
    assert phases["step_total"] >= phases["scheduling"] + phases["attn_compute"]
