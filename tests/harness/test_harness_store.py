"""The result store: atomic appends, torn lines, kill mid-append, resume keys, pandas."""

import json
import logging
import signal
import subprocess
import sys
import time

from locks_toolkit.harness.store import (
    append_record,
    cell_key,
    finished_keys,
    read_records,
    to_frame,
)


def _record(i, status="ok"):
    return {"schema": "locks.bench.decode/1", "cell": {"arm": "fa3", "context_tokens": 1024 * (i + 1), "batch_size": 1},
            "status": status, "reason": "", "tpot_ms": {"mean": 1.0 + i, "sd": 0.1, "n": 64},
            "windows": [{"step_ms": [1.0] * 8}], "note": "line\nbreak and ünïcode"}


def test_round_trip_keeps_order_and_content(tmp_path):
    path = tmp_path / "sub" / "bench.jsonl"
    records = [_record(i) for i in range(5)]
    for record in records:
        append_record(path, record)
    assert read_records(path) == records
    assert path.read_bytes().count(b"\n") == 5  # one line per record, newlines inside strings escaped


def test_torn_last_line_is_skipped_with_a_warning_and_sealed_by_the_next_append(tmp_path, caplog):
    path = tmp_path / "bench.jsonl"
    append_record(path, _record(0))
    full = json.dumps(_record(1)).encode()
    with open(path, "ab") as handle:  # what a crash in the middle of a write would leave
        handle.write(full[: len(full) // 2])
    with caplog.at_level(logging.WARNING):
        assert read_records(path) == [_record(0)]
    assert "torn last line" in caplog.text
    append_record(path, _record(2))
    assert read_records(path) == [_record(0), _record(2)]


def test_a_gzipped_store_reads_as_its_jsonl(tmp_path):
    import gzip

    path = tmp_path / "bench.jsonl"
    records = [_record(i) for i in range(4)]
    for record in records:
        append_record(path, record)
    packed = tmp_path / "bench.jsonl.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert read_records(packed) == records


def test_missing_file_reads_as_empty(tmp_path):
    assert read_records(tmp_path / "nope.jsonl") == []


_WRITER = """
import sys
from locks_toolkit.harness.store import append_record
path = sys.argv[1]
blob = "x" * 200_000  # big records make a kill inside a write likely
i = 0
while True:
    append_record(path, {"cell": {"i": i}, "status": "ok", "blob": blob})
    i += 1
"""


def test_kill_mid_append_never_breaks_reading(tmp_path):
    path = tmp_path / "bench.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)])
    try:
        deadline = time.time() + 30
        while (not path.exists() or path.stat().st_size < 2_000_000) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    records = read_records(path)
    assert len(records) >= 5
    assert [r["cell"]["i"] for r in records] == list(range(len(records)))  # no gap, no duplicate
    append_record(path, {"cell": {"i": "after"}, "status": "ok"})
    assert read_records(path)[-1]["cell"]["i"] == "after"


def test_resume_keys_count_final_statuses_only(tmp_path):
    path = tmp_path / "bench.jsonl"
    for i, status in enumerate(["ok", "refused", "oom", "error"]):
        append_record(path, _record(i, status))
    keys = finished_keys(read_records(path))
    assert keys == {cell_key(_record(i)["cell"]) for i in range(3)}
    assert cell_key({"b": 1, "a": [1, 2]}) == cell_key({"a": [1, 2], "b": 1})


def test_to_frame_flattens_cells_and_measurements(tmp_path):
    frame = to_frame([_record(0), _record(1, "refused")])
    assert list(frame["cell.context_tokens"]) == [1024, 2048]
    assert list(frame["tpot_ms.mean"]) == [1.0, 2.0]
    assert list(frame["status"]) == ["ok", "refused"]


def test_non_finite_numbers_are_stored_as_null(tmp_path):
    append_record(tmp_path / "x.jsonl", {"cell": {}, "tpot": [float("nan"), 1.5, float("inf")]})
    assert b"NaN" not in (tmp_path / "x.jsonl").read_bytes()
    assert read_records(tmp_path / "x.jsonl") == [{"cell": {}, "tpot": [None, 1.5, None]}]


def test_git_state_outside_a_checkout_names_the_wheel_stamp_not_the_cwd(tmp_path, monkeypatch):
    import json as _json

    from locks_toolkit.harness import provenance

    stamp = tmp_path / "build_info.json"
    stamp.write_text(_json.dumps({"commit": "b133375", "dirty": False}))
    monkeypatch.setattr(provenance, "BUILD_INFO", stamp)
    monkeypatch.chdir(provenance.Path(__file__).resolve().parent)  # a checkout as cwd must not be used
    outside = tmp_path / "site"
    outside.mkdir()
    assert provenance.git_state(outside) == {"commit": "b133375", "dirty": False}
    # a stamp beside the package wins over the checkout that holds it (a copied checkout's .git can lag)
    assert provenance.git_state(provenance.Path(__file__).resolve().parent) == {"commit": "b133375", "dirty": False}
    monkeypatch.setattr(provenance, "BUILD_INFO", tmp_path / "absent.json")
    here = provenance.git_state(provenance.Path(__file__).resolve().parent)
    assert here["commit"] not in (None, "b133375") and len(here["commit"]) == 40


def test_provenance_names_the_schema_of_the_record_it_travels_with():
    from locks_toolkit.harness import provenance

    assert provenance.collect("cmd")["schema_version"] == provenance.SCHEMA_DECODE
    sweep = provenance.collect("cmd", schema="locks.score_sweep/1")
    assert sweep["schema_version"] == "locks.score_sweep/1" and sweep["command"] == "cmd"
