"""Detached decode runs: the ladder runs in its own session, so it survives the shell that started it.

`launch(plan, command)` writes the resolved plan to `<store>.run/plan.yaml` and starts
`python -m locks_toolkit.locks_cli.main bench decode <that plan>` as a session leader (setsid), with
stdin closed, stdout to `stdout.md` and stderr (engine logs) to `log.txt` in the same folder. The child
takes the store's lock (harness/run_state.py) like any run, so resume and refusal work unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import yaml

from .plan import DecodePlan
from .run_state import RunBusy, read_status_file, run_dir, store_is_locked

# Set in the detached child: the command the user typed (for records) and "no live terminal view".
COMMAND_ENV = "LOCKS_RUN_COMMAND"
DETACHED_ENV = "LOCKS_DETACHED"


class DetachError(RuntimeError):
    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def plan_yaml(plan: DecodePlan) -> str:
    """The plan as a YAML file `load_plan` reads back to an equal plan."""
    data = {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(plan).items()}
    return yaml.safe_dump(data, sort_keys=False)


def launch(plan: DecodePlan, command: str, wait_s: float = 60.0) -> tuple[int, Path]:
    """Start the plan detached; returns (pid, run folder) once the child holds the store, or raises."""
    store = Path(plan.output)
    if store_is_locked(store):
        raise RunBusy(store, read_status_file(store))
    folder = run_dir(store)
    folder.mkdir(parents=True, exist_ok=True)
    plan_file = folder / "plan.yaml"
    plan_file.write_text(plan_yaml(plan))
    for stale in ("status.json", "stdout.md"):
        (folder / stale).unlink(missing_ok=True)
    env = {**os.environ, COMMAND_ENV: command, DETACHED_ENV: "1", "PYTHONUNBUFFERED": "1"}
    with open(folder / "stdout.md", "wb") as out, open(folder / "log.txt", "ab") as err:
        child = subprocess.Popen(
            [sys.executable, "-m", "locks_toolkit.locks_cli.main", "bench", "decode", str(plan_file)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True, close_fds=True, env=env,
        )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        status = read_status_file(store)
        if status is not None and status.get("pid") == child.pid:
            return child.pid, folder
        code = child.poll()
        if code is not None:
            if code == 0:  # finished before we looked (every cell stored already, or a tiny plan)
                return child.pid, folder
            raise DetachError(f"the detached run exited with code {code} before starting:\n{_tail(folder / 'log.txt')}",
                              f"the whole log is {folder / 'log.txt'}")
        time.sleep(0.2)
    return child.pid, folder  # still importing: `locks bench status` will show it once it writes


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
