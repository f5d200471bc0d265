#!/bin/bash
# Bounded runs of the cuda_mp scenarios; every process group is killed at its deadline.
export TIDE_NCCL_LIB=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2 NCCL_NVLS_ENABLE=0
# Usage (repo root of the GPU machine, binary carried at target/gpump/cuda_mp):
#   bash tests/cuda_mp_run.sh all    # the whole test binary, bounded
#   bash tests/cuda_mp_run.sh kill   # the killed-peer children of the 2x1 (NCCL) case, traced
B=${CUDA_MP_BIN:-target/gpump/cuda_mp}
bounded() { # seconds name cmd...
  local s=$1 n=$2; shift 2
  setsid "$@" > /tmp/$n.log 2>&1 & local p=$!
  for i in $(seq 1 $((s*10))); do kill -0 $p 2>/dev/null || break; sleep 0.1; done
  if kill -0 $p 2>/dev/null; then echo "[$n] STILL RUNNING after ${s}s: killing"; kill -9 -$p; fi
  wait $p; echo "[$n] rc=$?"
}
kill_case() { # topo(nodes:g) ms
  local J=$((RANDOM*100000+RANDOM)); local n="kill_${1/:/x}_$2"
  for r in 0 1; do
    ( export CUDA_VISIBLE_DEVICES=$r TIDE_CUDA_MP_CHILD="kill:$1:$J:$r" TIDE_CUDA_MP_KILL_MS=$2 TIDE_RS_SLOT_BYTES=65536 TIDE_TIMEOUT_S=60 TIDE_DEBUG_MP=${DBG:-0}
      bounded 40 ${n}_r$r $B --exact child_entry --nocapture --test-threads=1 ) &
  done; wait
  grep -h "error after\|cuda_mp kill\|STILL\|rc=" /tmp/${n}_r0.log 2>/dev/null | cut -c1-400
  echo "-- $n r0 tail:"; grep -v "rail group" /tmp/${n}_r0.log | tail -4 | cut -c1-300
}
case "$1" in
  kill) DBG=1 kill_case 2:1 400; DBG=1 kill_case 2:1 2500 ;;
  all) bounded 150 all $B --ignored --nocapture --test-threads=1; grep -v "bitwise equal to the CPU engine$\|^ *at " /tmp/all.log | tail -40 | cut -c1-450 ;;
esac
