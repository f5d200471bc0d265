#!/usr/bin/env bash
# Issue #38 on a GPU machine: what the victims of bench/progress.py are made of, and how tide's
# reduce-scatter progresses beside them under each launch setting the engine has today.
#
#   bash bench/progress_sweep.sh OUT        (from the repository root, .carry/ carried: scripts/gpu bundle)
#
# 1. ncu (launch metrics only: no counters, no replay) on one step of each victim
#    (bench/victim_shapes.py): grid, block, registers, shared memory, waves per SM, the occupancy
#    limits, so a persistent grid (about one CTA per SM, one wave) shows as such. OUT/victims.csv.
# 2. bench/progress.py --ops rs under each SWEEP setting (a line "name VAR=V ..."), REPS rounds
#    (default 7): OUT/progress-<name>.txt and .json. SWEEP_PROGRESS=0 skips it.
# 3. With SWEEP_ENGINE_MODES (e.g. "engine progress"): .carry/interference in each mode under the same
#    setting, rows filtered by TIDE_BENCH_ROWS as set (issue #22's bars: `engine`; the engine-level
#    half of issue #38: `progress`): OUT/interference-<mode>-<name>.txt (not OUT/<mode>-<name>.txt:
#    the progress mode's would be the JAX run's name).
# The wheel in .carry/ is installed as scripts/gpu run does (--target $TIDE_SITE on PYTHONPATH).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${1:?usage: bench/progress_sweep.sh OUT}
mkdir -p "$OUT"
PY=${PY:-python3}
SITE=${TIDE_SITE:-/tmp/tide-site}
export NCCL_NVLS_ENABLE=0 TIDE_MULTICAST=0
"$PY" -m pip install --quiet --no-deps --target "$SITE" .carry/tide_jax-*.whl >"$OUT/pip.log" 2>&1 ||
    { echo "progress_sweep: the wheel did not install (OUT/pip.log)"; exit 1; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
unset TIDE_LIBRARY

if [ "${SWEEP_NCU:-1}" = 1 ] && command -v ncu >/dev/null; then
    timeout 240 ncu --profile-from-start off --csv --log-file "$OUT/victims.csv" --metrics \
launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic,\
launch__shared_mem_per_block_static,launch__waves_per_multiprocessor,launch__occupancy_limit_registers,\
launch__occupancy_limit_shared_mem,launch__occupancy_limit_warps,launch__occupancy_limit_blocks,launch__thread_count \
        env JAX_PLATFORMS=cuda "$PY" bench/victim_shapes.py >"$OUT/victims.log" 2>&1
    echo "progress_sweep: ncu rc $? ($(wc -l <"$OUT/victims.csv" 2>/dev/null || echo 0) csv lines)"
    grep -E "victim_shapes|ERR|rror" "$OUT/victims.log" | head -20
    "$PY" - "$OUT/victims.csv" <<'PY'
import csv, sys, collections
rows = collections.OrderedDict()
try:
    lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
except OSError:
    sys.exit(0)
for r in csv.DictReader(lines):
    key = (r["ID"], r["Kernel Name"][:90])
    rows.setdefault(key, {})[r["Metric Name"]] = r["Metric Value"]
for (i, name), m in rows.items():
    print(f"kernel {i} {name}: grid {m.get('launch__grid_size')} block {m.get('launch__block_size')} "
          f"regs {m.get('launch__registers_per_thread')} smem dyn {m.get('launch__shared_mem_per_block_dynamic')} "
          f"static {m.get('launch__shared_mem_per_block_static')} waves {m.get('launch__waves_per_multiprocessor')} "
          f"limits regs/smem/warps/blocks {m.get('launch__occupancy_limit_registers')}/"
          f"{m.get('launch__occupancy_limit_shared_mem')}/{m.get('launch__occupancy_limit_warps')}/"
          f"{m.get('launch__occupancy_limit_blocks')}")
PY
fi

LIBS=$("$PY" - <<'PY' 2>/dev/null
import glob, os, site
dirs = []
for root in site.getsitepackages():
    dirs += sorted(d for d in glob.glob(os.path.join(root, "nvidia", "*", "lib")) if glob.glob(os.path.join(d, "libcublas*.so*")))
print(":".join(dirs))
PY
)

SWEEP=${SWEEP:-"default TIDE_HIGH_PRIORITY=0
hp TIDE_HIGH_PRIORITY=1
hp-8ctas TIDE_HIGH_PRIORITY=1 TIDE_RS_MAX_CTAS=8
hp-8long TIDE_HIGH_PRIORITY=1 TIDE_RS_MAX_CTAS=8 TIDE_RS_CTA_BYTES=0
lo-8long TIDE_HIGH_PRIORITY=0 TIDE_RS_MAX_CTAS=8 TIDE_RS_CTA_BYTES=0
hp-fullshort TIDE_HIGH_PRIORITY=1 TIDE_RS_MAX_CTAS=132
hp-fulllong TIDE_HIGH_PRIORITY=1 TIDE_RS_MAX_CTAS=132 TIDE_RS_CTA_BYTES=0"}
while read -r name settings; do
    [ -n "$name" ] || continue
    mkdir -p "$OUT/$name"
    for mode in ${SWEEP_ENGINE_MODES:-}; do
        # shellcheck disable=SC2086
        timeout 300 env LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" $settings \
            TIDE_BENCH_OUT="$OUT/$name/interference-$mode.json" .carry/interference "$mode" >"$OUT/interference-$mode-$name.txt" 2>&1 </dev/null
        echo "progress_sweep: $name ($settings) interference $mode rc $?"
        grep -E "^(RS|AG|progress|kernel|engine:|NOTE)" "$OUT/interference-$mode-$name.txt" | cut -c1-400 | head -40
    done
    [ "${SWEEP_PROGRESS:-1}" = 1 ] || continue
    # shellcheck disable=SC2086
    timeout 300 env JAX_PLATFORMS=cuda TIDE_WORLD1_NATIVE=1 REPS="${REPS:-7}" $settings \
        "$PY" bench/progress.py --ops "${SWEEP_OPS:-rs}" ${SWEEP_ARGS:-} --out "$OUT/$name" >"$OUT/progress-$name.txt" 2>&1 </dev/null
    echo "progress_sweep: $name ($settings) rc $?"
    grep -E "^progress: [a-z_0-9]+ +(rs|ag) \||alone|rror" "$OUT/progress-$name.txt" |
        sed -E 's/ \| TIDE_HIGH.*//; s/^progress: //' | head -12
done <<<"$SWEEP"
