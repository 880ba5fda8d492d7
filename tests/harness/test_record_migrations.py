"""Version 1 decode records read as version 2: what each migration derives, and what it leaves alone."""

import copy
import json
from pathlib import Path

import pytest
from locks_toolkit.harness import record_migrations as rm
from locks_toolkit.harness.presets import load_preset_config
from locks_toolkit.harness.record_schemas import DECODE, FLOOR_KV_ONLY, FLOOR_PRESET, FLOOR_RECORDED
from locks_toolkit.harness.weights import weights_from_config

FIXTURES = Path(__file__).parents[1] / "fixtures"


def v1(**over) -> dict:
    record = {
        "schema": "locks.bench.decode/1", "status": "ok",
        "cell": {"arm": "locks", "model": "glm-4-9b-chat-1m", "num_layers": 40, "context_tokens": 131072,
                 "batch_size": 1, "budget_tokens": 2048, "dtype": "bfloat16"},
        "tpot_ms": {"mean": 8.0, "sd": 0.4, "n": 30},
        "ttft_ms": {"steady_mean": 100.0, "steady_sd": 5.0, "build_counters": {"build_ms": 12.5}},
        "build_ms": 40.0,
        "bytes_per_step": {"dense": 10_000_000_000, "locks": 1_000_000_000, "bandwidth_bytes_per_s": 4.2e12},
        "floor_ms": 1_000_000_000 / 4.2e12 * 1e3,
    }
    record.update(over)
    return record


def test_a_v1_sparse_record_gains_the_v2_fields_derived_as_the_old_reader_did():
    old = v1()
    new = rm.upgrade(old)
    assert new["schema"] == DECODE and new["sparse"] is True
    assert new["tpot_ms"]["cv"] == pytest.approx(0.4 / 8.0)
    assert new["ttft_ms"]["build_counters_each"] == [{"build_ms": 12.5}]
    assert new["build_ms"] == 40.0 and "above 3 sd" in new["build_method"]  # 40 > 3 x 5
    weights = weights_from_config(load_preset_config("glm-4-9b-chat-1m"), "bfloat16")["read_per_step"]
    assert new["step_floor_basis"] == FLOOR_PRESET and new["bytes_per_step"]["weights"] == weights
    assert new["step_floor_ms"] == pytest.approx((weights + 1_000_000_000) / 4.2e12 * 1e3)
    assert old["schema"] == "locks.bench.decode/1" and "sparse" not in old  # the input is not modified
    assert new["cell"] == old["cell"]  # the identity resume matches on is untouched


def test_a_dense_v1_record_is_not_sparse_and_its_build_difference_within_noise_is_dropped():
    record = v1(build_ms=9.0)
    record["cell"] = {**record["cell"], "arm": "fa3", "budget_tokens": None}
    new = rm.upgrade(record)
    assert new["sparse"] is False
    assert new["build_ms"] is None and "not significant" in new["build_method"]  # 9 < 3 x 5


def test_a_local_model_without_weight_bytes_keeps_the_attention_floor_and_says_why():
    new = rm.upgrade(v1(cell={**v1()["cell"], "model": "/models/mine"}))
    assert new["step_floor_basis"] == FLOOR_KV_ONLY and new["step_floor_ms"] == pytest.approx(v1()["floor_ms"])
    assert "not a preset" in new["step_floor_why"]
    bare = rm.upgrade(v1(bytes_per_step={"dense": 1, "locks": 1}))
    assert bare["step_floor_basis"] == FLOOR_KV_ONLY and "no copy bandwidth" in bare["step_floor_why"]


def test_a_recorded_step_floor_is_kept_as_recorded():
    new = rm.upgrade(v1(step_floor_ms=5.0))
    assert new["step_floor_ms"] == 5.0 and new["step_floor_basis"] == FLOOR_RECORDED


def test_current_and_unknown_records_pass_through_as_the_same_object():
    current = rm.upgrade(v1())
    assert rm.upgrade(current) is current
    other = {"schema": "locks.bench.prefill/0"}
    assert rm.upgrade(other) is other


def test_a_migration_that_does_not_advance_the_version_is_caught(monkeypatch):
    monkeypatch.setitem(rm.MIGRATIONS, rm.DECODE_V1, lambda record: record)
    with pytest.raises(RuntimeError, match="did not change the schema"):
        rm.upgrade(v1())


def test_every_stored_v1_fixture_upgrades_to_a_record_the_reports_read_without_branches():
    for path in FIXTURES.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line) if line.strip().startswith("{") else None
            if not record or record.get("schema") != rm.DECODE_V1:
                continue
            new = rm.upgrade(copy.deepcopy(record))
            assert isinstance(new["sparse"], bool) and "build_method" in new, path.name
            if new.get("status") == "ok" and new.get("bytes_per_step"):
                assert new["step_floor_basis"] in (FLOOR_RECORDED, FLOOR_PRESET, FLOOR_KV_ONLY), path.name
