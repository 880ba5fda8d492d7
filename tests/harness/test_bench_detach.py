"""Detached decode runs against the real vLLM 0.24 CPU engine: a run survives its launcher, `bench status`
shows what finished and what runs now, `bench stop` ends it, and the next launch on the store resumes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from locks_toolkit.harness.plan import default_plan_path
from locks_toolkit.harness.run_state import RunStatus, StoreLock, read_status, run_dir, stop_run, store_is_locked
from locks_toolkit.harness.store import cell_key, read_records
from locks_toolkit.locks_cli.main import app
from typer.testing import CliRunner

SMOKE = str(default_plan_path().parent / "smoke-cpu.yaml")
CLI = [sys.executable, "-m", "locks_toolkit.locks_cli.main"]


def _status(store) -> dict:
    result = CliRunner().invoke(app, ["bench", "status", str(store), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture
def stop_left_runs():
    """Stores whose detached run must not outlive a failing test (it would slow every test after it)."""
    stores = []
    yield stores.append
    for store in stores:
        stop_run(store, grace_s=2.0)


def _wait(store, predicate, timeout_s=300.0, poll_s=0.5) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_status(store)
        if state is not None and predicate(state):
            return state
        time.sleep(poll_s)
    raise AssertionError(f"timed out; last status {read_status(store)}; log:\n"
                         f"{(run_dir(store) / 'log.txt').read_text(errors='replace')[-3000:]}")


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_detached_run_survives_its_launcher_is_stopped_and_resumes(tmp_path, stop_left_runs):
    store = tmp_path / "bench.jsonl"
    stop_left_runs(store)
    args = ["bench", "decode", SMOKE, "--contexts", "128,256", "--batch", "1", "--out", str(store)]
    # The launcher runs like a shell's job: its own process group, which is SIGKILLed (a dropped shell) as
    # soon as the run has taken the store.
    launcher = subprocess.Popen(CLI + args + ["--detach"], cwd=tmp_path, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    state = _wait(store, lambda s: s["alive"])  # a fresh venv's first torch + vLLM import is slow
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it had returned already
    launcher.wait()
    run_pid = state["pid"]
    assert run_pid != launcher.pid and os.getpgid(run_pid) == run_pid  # a session of its own

    state = _wait(store, lambda s: s["cells_done"] >= 1 and s["alive"] and (s.get("current") or {}).get("context") == 256)
    shown = _status(store)
    assert shown["alive"] and shown["cells_total"] == 2 and shown["state"] == "running"
    assert [r["cell"]["context_tokens"] for r in shown["records"]] == [128]
    assert shown["current"]["context"] == 256 and shown["current"]["phase"]  # boot, prefill, window, ...
    text = CliRunner().invoke(app, ["bench", "status", str(store)])
    assert "1 of 2 done (1 ok)" in text.stdout and "cpu @ 256 tokens" in text.stdout, text.output

    stopped = CliRunner().invoke(app, ["bench", "stop", str(store), "--grace", "5"])
    assert stopped.exit_code == 0 and f"run pid {run_pid}" in stopped.stdout, stopped.output
    assert not store_is_locked(store)
    after = _status(store)
    assert after["alive"] is False and after["state"] == "stopped" and after["cells_done"] == 1
    text = CliRunner().invoke(app, ["bench", "status", str(store)])
    assert "no process holds the store" in text.stdout and "Rerun the same command to resume" in text.stdout
    assert [r["cell"]["context_tokens"] for r in read_records(store)] == [128]  # nothing half-written
    # the run's own log has the harness's lines; vLLM's went to one file per engine
    engine_logs = sorted((run_dir(store) / "engines").iterdir())
    assert engine_logs[0].name.endswith("-cpu-128.log") and "Initializing a V1 LLM engine" in engine_logs[0].read_text()
    assert "Initializing a V1 LLM engine" not in (run_dir(store) / "log.txt").read_text()

    again = CliRunner().invoke(app, args + ["--json"])
    assert again.exit_code == 0, again.output
    assert "resumed: 1 cell(s)" in again.stderr
    records = read_records(store)
    assert [(r["cell"]["context_tokens"], r["status"]) for r in records] == [(128, "ok"), (256, "ok")]
    assert len({cell_key(r["cell"]) for r in records}) == 2  # each cell once
    assert records[0]["command"] == "locks " + " ".join(args)  # what the user typed, less --detach
    final = _status(store)
    assert final["state"] == "finished" and final["cells_resumed"] == 1 and final["cells_done"] == 1


def test_a_second_run_on_a_store_in_use_is_refused_with_the_way_out(tmp_path, monkeypatch):
    from locks_toolkit.harness import runner

    monkeypatch.setattr(runner, "preflight", lambda plan: None)  # no engine is needed to be refused
    store = tmp_path / "bench.jsonl"
    with StoreLock(store):
        RunStatus(store, "locks bench decode ...", [])  # the holder's status names its pid
        for extra in ([], ["--detach"]):
            result = CliRunner().invoke(app, ["bench", "decode", SMOKE, "--out", str(store), *extra])
            assert result.exit_code == 2, result.output
            text = "".join(result.stderr.split())  # rich wraps long paths
            assert f"anotherrun(pid{os.getpid()})iswritingto{store}" in text
            assert f"locksbenchstatus{store}" in text
    assert not store_is_locked(store) and not store.exists()


def test_status_of_a_store_without_a_run_names_the_fix(tmp_path):
    result = CliRunner().invoke(app, ["bench", "status", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2 and "no run state at" in result.stderr and "--out store" in result.stderr


def test_a_run_whose_process_is_gone_reads_as_stopped(tmp_path):
    store = tmp_path / "bench.jsonl"
    lock = StoreLock(store).acquire()
    status = RunStatus(store, "cmd", [{"context": 1024, "arm": "cpu", "budget": None, "batches": [1]}])
    assert read_status(store)["state"] == "running" and read_status(store)["alive"]
    lock.release()  # what the kernel does when the process dies
    assert read_status(store)["state"] == "stopped" and not read_status(store)["alive"]
    status.finish("finished")
    assert read_status(store)["state"] == "finished"


def test_time_left_comes_from_this_runs_own_boots_and_prefills(tmp_path, monkeypatch):
    """One finished job at 1K (boot 10 s, two prefills of 2 s, 6 s of decode) predicts a 2K job as
    10 + 2 x (2 x 4) + 6 s: prefills scale quadratically from the nearest measured context."""
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    groups = [{"context": c, "arm": "cpu", "budget": None, "batches": [1]} for c in (1024, 2048)]
    status = RunStatus(tmp_path / "bench.jsonl", "cmd", groups)
    assert status.data["eta_s"] is None  # nothing measured yet

    def event(kind, after_s, **payload):
        clock[0] += after_s
        status.on_event(kind, payload)

    event("job", 0, arm="cpu", context=1024, budget=None, batches=[1])
    event("phase", 0, phase="boot")
    event("phase", 10, phase="warm-up prefill", batch=1)
    event("phase", 2, phase="clock ramp")
    event("phase", 1, phase="prefill", batch=1)
    event("phase", 2, phase="window", batch=1, index=1, of=1)
    event("record", 5, status="ok")
    event("job", 0, arm="cpu", context=2048, budget=None, batches=[1])
    assert status.data["finished_groups"] == [{"context": 1024, "arm": "cpu", "boot_s": 10, "prefill_s": [2, 2],
                                               "total_s": 20}]
    assert status.data["eta_s"] == pytest.approx(10 + 2 * 8 + 6)
    event("phase", 4, phase="boot")
    assert status.data["eta_s"] == pytest.approx(10 + 2 * 8 + 6 - 4)  # the current job's time is counted


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_an_engine_killed_mid_cell_is_recorded_with_its_signal_and_the_rerun_retries_it(tmp_path, stop_left_runs):
    """SIGKILL of the engine process (the host OOM killer's way) while a window is timed: the cell becomes an
    `error` record naming the signal, the ladder goes on to the next engine, and the same command retries
    only that cell."""
    store = tmp_path / "bench.jsonl"
    # 3 windows of 150 steps: seconds of timed decode on the tiny model, long enough to be caught in a window
    args = ["bench", "decode", SMOKE, "--contexts", "128,256", "--batch", "1", "--windows", "3", "--steps", "150",
            "--max-model-len", "2048", "--out", str(store)]
    stop_left_runs(store)
    launcher = subprocess.run(CLI + args + ["--detach"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert launcher.returncode == 0, launcher.stderr
    state = _wait(store, lambda s: (s.get("current") or {}).get("phase") == "window" and s["alive"], poll_s=0.05)
    assert state["current"]["context"] == 128
    os.kill(state["current"]["engine_pid"], signal.SIGKILL)
    state = _wait(store, lambda s: s["state"] == "finished")
    records = read_records(store)
    assert [(r["cell"]["context_tokens"], r["status"]) for r in records] == [(128, "error"), (256, "ok")]
    assert "signal 9" in records[0]["reason"] and state["statuses"] == {"error": 1, "ok": 1}
    again = CliRunner().invoke(app, args + ["--json"])
    assert again.exit_code == 0, again.output
    assert "resumed: 1 cell(s)" in again.stderr  # the ok cell; the error cell ran again
    assert [(r["cell"]["context_tokens"], r["status"]) for r in read_records(store)] == [
        (128, "error"), (256, "ok"), (128, "ok")]


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_ctrl_c_during_a_ladder_keeps_finished_cells_and_says_how_to_resume(tmp_path):
    """SIGINT to the foreground process group (a terminal's Ctrl-C reaches the engine processes too) while
    the second rung's engine runs: exit 130 with one line saying what happened and how to resume, the
    first rung's record intact and nothing half-written, the store unlocked, no engine left behind, and
    the same command then measures only the interrupted rung."""
    store = tmp_path / "bench.jsonl"
    args = ["bench", "decode", SMOKE, "--contexts", "128,256", "--batch", "1", "--out", str(store)]
    # As a terminal starts it: SIGINT at its default. (A background job of a non-interactive shell, as CI
    # scripts often are, inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.)
    run = subprocess.Popen(CLI + args, cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        state = _wait(store, lambda s: s["cells_done"] >= 1 and (s.get("current") or {}).get("context") == 256
                      and (s.get("current") or {}).get("engine_pid"), poll_s=0.1)
        engine_pid = state["current"]["engine_pid"]
        os.killpg(run.pid, signal.SIGINT)
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 130, (out, err)
    said = " ".join(err.split())
    assert "interrupted" in said and "1 cell(s) of this run are stored" in said and "rerun the same command" in said, said
    assert "Traceback" not in err
    assert [(r["cell"]["context_tokens"], r["status"]) for r in read_records(store)] == [(128, "ok")]
    assert not store_is_locked(store) and read_status(store)["state"] == "interrupted"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(engine_pid):
        time.sleep(0.2)
    assert not _alive(engine_pid), "the engine process outlived the interrupted run"
    again = CliRunner().invoke(app, args + ["--json"])
    assert again.exit_code == 0, again.output
    assert "resumed: 1 cell(s)" in again.stderr
    assert [(r["cell"]["context_tokens"], r["status"]) for r in read_records(store)] == [(128, "ok"), (256, "ok")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
