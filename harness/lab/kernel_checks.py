"""The kernel checks on this machine's device, from the command line: every check of kernels/checks.py
against the fp64/fp32 torch references on fresh random inputs (the GPU, or the interpreter with
TRITON_INTERPRET=1).

    python -m locks_toolkit.harness.lab.kernel_checks [--select chunked,one [--scorer NAME] [--long]] [--cuda] [--decode]
"""

from __future__ import annotations

import argparse
import sys

from ...kernels.checks import LONG_SELECT_CASES, available_devices, cuda_battery, decode_battery, full_battery, select_battery
from ...kernels.config import SELECT_PATHS
from ...kernels.score.pages import SCORER_KERNELS
from ...kernels.testing import fresh_seed

_SCORER_DEFAULT = next(iter(SCORER_KERNELS))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Kernel checks against the torch references.")
    parser.add_argument("--select", metavar="PATHS", help=f"only the select cases on bf16, for these paths "
                        f"(comma-separated, of {', '.join(SELECT_PATHS)})")
    parser.add_argument("--cuda", action="store_true", help="the CUDA score kernel's cases (CUDA_CASES), every selection path")
    parser.add_argument("--decode", action="store_true", help="the decode cases under each of DECODE_TUNINGS")
    parser.add_argument("--scorer", default=_SCORER_DEFAULT, choices=tuple(SCORER_KERNELS),
                        help="with --select: the score kernel's code path (score_select.SCORER_KERNELS)")
    parser.add_argument("--long", action="store_true",
                        help="with --select: the long cases (checks.LONG_SELECT_CASES, production launch shapes; GPU only)")
    args = parser.parse_args(argv)
    devices = available_devices()
    if not devices:
        print("error: no device: set TRITON_INTERPRET=1 (CPU) or run on a GPU", file=sys.stderr)
        return 2
    if args.cuda:
        battery = cuda_battery(devices[0], fresh_seed())
    elif args.decode:
        battery = decode_battery(devices[0], fresh_seed())
    elif args.select:
        paths = args.select.split(",")
        unknown = [p for p in paths if p not in SELECT_PATHS]
        if unknown:
            print(f"error: --select: unknown path(s) {unknown}; choose from {', '.join(SELECT_PATHS)}", file=sys.stderr)
            return 2
        cases = LONG_SELECT_CASES if args.long else None
        battery = select_battery(devices[0], fresh_seed(), paths, cases=cases, scorer=args.scorer)
    else:
        battery = full_battery(devices[0], fresh_seed())
    for result in battery:
        print(result)
    failed = [r for r in battery if not r.ok]
    print(f"{len(battery) - len(failed)} passed, {len(failed)} failed on {devices[0]}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
