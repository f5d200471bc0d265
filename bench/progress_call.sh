#!/usr/bin/env bash
# Issue #38, one device call (from the repository root, .carry/ carried: scripts/gpu bundle):
#
#   bash bench/progress_call.sh OUT
#
# 1. `.carry/interference cecheck`: which same-device copies progress beside a kernel that holds
#    every SM (copy engine) and which wait for it (SM copies): OUT/cecheck.txt.
# 2. The bitwise engine tests (.carry/cuda_engine --ignored) under each CALL_BITWISE setting (a
#    line of VAR=V ...), so a launch setting is exact before anyone measures it: OUT/bitwise-K.txt.
# 3. bench/progress_sweep.sh OUT/sweep with SWEEP (its format; the caller's), SWEEP_ENGINE_MODES
#    default "engine progress" (issue #22's bars and the engine half of #38, each setting), SWEEP_OPS
#    default rs, REPS default 5, no ncu.
# Prints the lines that matter (the device call returns only the tail of its output); the files
# stay in OUT.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${1:?usage: bench/progress_call.sh OUT}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TIDE_MULTICAST=0
if [ "${CALL_CECHECK:-1}" = 1 ]; then
    TIDE_BENCH_SAMPLES=${CECHECK_SAMPLES:-5} TIDE_BENCH_OUT="$OUT/cecheck.json" timeout 240 .carry/interference cecheck \
        >"$OUT/cecheck.txt" 2>&1 </dev/null
    echo "progress_call: cecheck rc $?"
    grep -E "^(cecheck|upcast|NOTE|device)" "$OUT/cecheck.txt" | cut -c1-330
fi
k=0
while read -r settings; do
    [ -n "$settings" ] || continue
    k=$((k + 1))
    # shellcheck disable=SC2086
    timeout 200 env $settings .carry/cuda_engine --ignored --nocapture --test-threads=1 >"$OUT/bitwise-$k.txt" 2>&1 </dev/null
    echo "progress_call: bitwise under $settings rc $? | $(grep -c 'bitwise equal' "$OUT/bitwise-$k.txt") bitwise lines | $(grep -E '^test result' "$OUT/bitwise-$k.txt" | tail -1)"
done <<<"${CALL_BITWISE:-}"
[ -n "${SWEEP:-}" ] || exit 0
SWEEP_ENGINE_MODES=${SWEEP_ENGINE_MODES-engine progress} SWEEP_OPS=${SWEEP_OPS:-rs} REPS=${REPS:-5} SWEEP_NCU=0 \
    bash bench/progress_sweep.sh "$OUT/sweep" >"$OUT/sweep.txt" 2>&1
echo "progress_call: sweep rc $?"
# The summary: per setting, the JAX rows, the engine half and #22's bars (bench/progress_summary.py).
python3 bench/progress_summary.py "$OUT/sweep"
