#!/usr/bin/env bash
# Score-kernel candidates in one detached chain (kernel-only, no vLLM), most decisive first, so a lease cut short
# still returns the A/B: `locks bench kernel` over ARMS (select@tree, trees from `make tree`, carried) once, the
# GPU checks of CHECK_TREE, the score probe (harness/lab/score_probe.py) of PROBE_TREE with ncu at NCU_CELLS, the A/B again.
# Outputs land in /tmp/runs/{ab1,checks,probe,ab2}; poll with `WAIT=540 bash docs/lease/pollloop.sh`.
#   bash docs/lease/score-candidates.sh      (carry harness/build_info.json and the trees)
set -u
ARMS=${ARMS:-auto@. auto@.gpu/new} CHECK_TREE=${CHECK_TREE:-.gpu/new} PROBE_TREE=${PROBE_TREE:-.}
CONTEXTS=${CONTEXTS:-512k,1m} CELLS=${CELLS:-32k:16} PROBE_CELLS=${PROBE_CELLS:-32k:16}
NCU_CELLS=${NCU_CELLS:-524288:1}
R=$PWD
mkdir -p /tmp/runs/ab1 /tmp/runs/checks /tmp/runs/probe /tmp/runs/ab2
export ARMS CONTEXTS CELLS CHECK_TREE NCU_CELLS R PROBE_TREE
setsid nohup bash -c '
  cd "$R"
  OUT=/tmp/runs/ab1 RUNS=1 BATCH=1 CHECKS=none bash docs/lease/select-ab.sh
  (cd "$CHECK_TREE" && bash "$R/docs/lease/kernels.sh" checks) > /tmp/runs/checks/checks.txt 2>&1
  tail -n 3 /tmp/runs/checks/checks.txt
  OUT=/tmp/runs/probe TREE="$PROBE_TREE" CONTEXTS=512k BATCH=1 CELLS='"$PROBE_CELLS"' bash docs/lease/score-probe.sh
  mkdir -p /tmp/ncu && mv /tmp/runs/probe/*.ncu-rep /tmp/runs/probe/all.tgz /tmp/ncu/  # the poll tar stays < 16 MiB
  OUT=/tmp/runs/ab2 RUNS=1 BATCH=1 CHECKS=none bash docs/lease/select-ab.sh
  echo "CHAIN DONE"' > /tmp/runs/chain-score.log 2>&1 &
sleep 2
echo "chain started: $(date +%T)"
