"""A decode run's live state beside its store: who writes the store, what it is doing, how far it got.

    <store>.run/status.json   rewritten atomically on every event (cells done, current cell and phase, ETA)
    <store>.run/lock          flock-ed by the process writing the store, for as long as it writes it
    <store>.run/plan.yaml     a detached run's resolved plan (what it was started with)
    <store>.run/log.txt       a detached run's stderr: engine logs
    <store>.run/stdout.md     a detached run's stdout: the final tables

The lock makes a second run on the same store refuse while the first is alive, and lets it resume once the
first is gone (the kernel drops a dead process's lock; a reused pid cannot fake one). The store stays the
only source of results: status.json is progress, never data.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

STATUS_SCHEMA = "locks.bench.run-status/1"


class RunBusy(RuntimeError):
    """Another live process holds the store's lock."""

    def __init__(self, store: Path, holder: dict | None):
        pid = (holder or {}).get("pid", "?")
        super().__init__(f"another run (pid {pid}) is writing to {store}")
        self.store, self.holder = store, holder
        self.hint = (f"follow it with `locks bench status {store}`, stop it with `locks bench stop {store}`, "
                     "or pass another --out")


def run_dir(run: str | os.PathLike) -> Path:
    """The state folder of a run, given its store (`runs/bench.jsonl`) or the folder itself."""
    path = Path(run)
    if path.name.endswith(".run"):
        return path
    return path.with_name(path.name + ".run")


def store_of(run: str | os.PathLike) -> Path:
    folder = run_dir(run)
    return folder.with_name(folder.name[: -len(".run")])


class StoreLock:
    """Exclusive, non-blocking flock on `<store>.run/lock`, held by the process that appends to the store."""

    def __init__(self, store: str | os.PathLike):
        self.store = Path(store)
        self.path = run_dir(store) / "lock"
        self._fd: int | None = None

    def acquire(self) -> "StoreLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise RunBusy(self.store, read_status_file(self.store)) from None
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "StoreLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def store_is_locked(store: str | os.PathLike) -> bool:
    """Whether a live process holds the store's lock (probed by trying to take it)."""
    path = run_dir(store) / "lock"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return True
        raise
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _write_json_atomically(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)


def read_status_file(run: str | os.PathLike) -> dict | None:
    path = run_dir(run) / "status.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:  # written by rename, so only a foreign edit can tear it
        log.warning("%s is not valid JSON; ignoring it", path)
        return None


@dataclass(frozen=True)
class GroupCost:
    """What one finished engine job cost, for the time-left estimate."""

    context: int
    boot_s: float
    prefill_s: list[float]
    total_s: float


class RunStatus:
    """The status file of one run, updated from the runner's events (`on_event`)."""

    def __init__(self, store: str | os.PathLike, command: str | None, groups: list[dict]):
        self.path = run_dir(store) / "status.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.data: dict = {
            "schema": STATUS_SCHEMA,
            "store": str(store),
            "pid": os.getpid(),
            "command": command,
            "started": now,
            "updated": now,
            "state": "running",
            "cells_total": sum(len(g["batches"]) for g in groups),
            "cells_done": 0,
            "cells_resumed": 0,
            "statuses": {},
            "groups": groups,  # {context, arm, budget, batches}: every engine job of the plan, in run order
            "current": None,
            "finished_groups": [],
        }
        self._group_started: float | None = None
        self._phase_started: float | None = None
        self._phase: str | None = None
        self._prefills: list[float] = []
        self._boot_s: float | None = None
        self.write()

    def write(self) -> None:
        self.data["updated"] = time.time()
        self.data["eta_s"] = self._eta()
        _write_json_atomically(self.path, self.data)

    def on_event(self, kind: str, payload: dict) -> None:
        now = time.time()
        if kind == "job":
            self._close_group(now)
            self._group_started, self._prefills, self._boot_s = now, [], None
            self.data["current"] = {"arm": payload["arm"], "context": payload["context"], "budget": payload["budget"],
                                    "batches": payload["batches"], "phase": "starting", "phase_since": now,
                                    "log": payload.get("log")}
        elif kind == "phase" and self.data["current"] is not None:
            self._end_phase(now)
            self._phase, self._phase_started = payload["phase"], now
            detail = {k: payload[k] for k in ("batch", "index", "of") if k in payload}
            self.data["current"].update(phase=payload["phase"], phase_detail=detail, phase_since=now)
            if "pid" in payload:
                self.data["current"]["engine_pid"] = payload["pid"]
        elif kind == "record":
            self.data["cells_done"] += 1
            status = payload.get("status", "?")
            self.data["statuses"][status] = self.data["statuses"].get(status, 0) + 1
        elif kind == "skipped":
            self.data["cells_resumed"] += 1
        else:
            return
        self.write()

    def finish(self, state: str, error: str | None = None) -> None:
        self._close_group(time.time())
        self.data.update(state=state, current=None, error=error)
        self.write()

    def _end_phase(self, now: float) -> None:
        if self._phase_started is None:
            return
        took = now - self._phase_started
        if self._phase == "boot":
            self._boot_s = took
        elif self._phase in ("prefill", "warm-up prefill", "ttft"):
            self._prefills.append(took)

    def _close_group(self, now: float) -> None:
        current = self.data.get("current")
        if current is None or self._group_started is None:
            return
        self._end_phase(now)
        self._phase_started = None
        self.data["finished_groups"].append({"context": current["context"], "arm": current["arm"],
                                             "boot_s": self._boot_s, "prefill_s": self._prefills,
                                             "total_s": now - self._group_started})
        self._group_started = None

    def _eta(self) -> float | None:
        """Seconds left, estimated from this run's own finished engine jobs: per remaining job a boot, its
        prefills (measured at that context, else scaled quadratically from the nearest measured context:
        attention dominates long prefills) and the decode time seen so far. None until one job finished."""
        done = [GroupCost(g["context"], g["boot_s"] or 0.0, g["prefill_s"], g["total_s"])
                for g in self.data["finished_groups"]]
        if not done:
            return None
        boot = sum(g.boot_s for g in done) / len(done)
        rest = sum(max(g.total_s - g.boot_s - sum(g.prefill_s), 0.0) for g in done) / len(done)
        per_prefill: dict[int, list[float]] = {}
        counts: dict[int, int] = {}
        for g in done:
            if g.prefill_s:
                per_prefill.setdefault(g.context, []).extend(g.prefill_s)
                counts[g.context] = len(g.prefill_s)

        def prefill_cost(context: int) -> float:
            if not per_prefill:
                return 0.0
            if context in per_prefill:
                return sum(per_prefill[context]) / len(per_prefill[context]) * counts[context]
            nearest = min(per_prefill, key=lambda c: abs(c - context))
            mean = sum(per_prefill[nearest]) / len(per_prefill[nearest])
            return mean * (context / nearest) ** 2 * counts[nearest]

        finished = len(done)
        remaining = self.data["groups"][finished:]
        if self.data["current"] is not None and remaining:
            remaining = remaining[1:]  # the current job: counted below from its own progress
        left = sum(boot + prefill_cost(g["context"]) + rest for g in remaining)
        current = self.data["current"]
        if current is not None and self._group_started is not None:
            expected = boot + prefill_cost(current["context"]) + rest
            left += max(expected - (time.time() - self._group_started), 0.0)
        return left


def read_status(run: str | os.PathLike) -> dict | None:
    """The run's status file plus `alive`: whether a process still holds the store's lock."""
    data = read_status_file(run)
    if data is None:
        return None
    alive = store_is_locked(store_of(run))
    data["alive"] = alive
    if data.get("state") == "running" and not alive:
        data["state"] = "stopped"  # killed, crashed, or the machine went away: the store has what finished
    return data


def stop_run(run: str | os.PathLike, grace_s: float = 10.0) -> str:
    """SIGTERM the run's process group (a detached run leads its own), SIGKILL after `grace_s`; says what it did."""
    data = read_status_file(run)
    store = store_of(run)
    if data is None or not store_is_locked(store):
        return f"no live run writes to {store}"
    pid = int(data["pid"])
    target = os.getpgid(pid) if _leads_group(pid) else None
    _signal(pid, target, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not store_is_locked(store):
            return f"stopped run pid {pid} (SIGTERM); finished cells stay in {store}, rerun the command to resume"
        time.sleep(0.2)
    _signal(pid, target, signal.SIGKILL)
    return f"killed run pid {pid} (SIGKILL after {grace_s:.0f} s); finished cells stay in {store}"


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def _signal(pid: int, group: int | None, sig: int) -> None:
    try:
        if group is not None:
            os.killpg(group, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass
