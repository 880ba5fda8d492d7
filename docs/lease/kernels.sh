#!/usr/bin/env bash
# Kernel-only GPU call (no vLLM): import the checkout as locks_toolkit, then run what is asked.
#   bash docs/lease/kernels.sh checks      fp64-reference checks of the CUDA scorer and both selection paths (merge, chunked)
#   bash docs/lease/kernels.sh CMD ...     any command with the package importable (e.g. python3 -m ...)
# Carry harness/build_info.json (`make stamp`) so records name the commit.
set -euo pipefail
R=$PWD
mkdir -p /tmp/lt/locks_toolkit && touch /tmp/lt/locks_toolkit/__init__.py
for d in kernels harness suites reports locks_cli; do ln -sfn "$R/$d" "/tmp/lt/locks_toolkit/$d"; done
export PYTHONPATH=/tmp/lt PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
if [ "${1:-}" = checks ]; then
    python3 -m locks_toolkit.harness.lab.kernel_checks --cuda
    python3 -m locks_toolkit.harness.lab.kernel_checks --select merge,chunked --scorer cuda
else
    "$@"
fi
