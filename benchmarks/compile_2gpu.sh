#!/usr/bin/env bash
# The default plan's compile time on 2 GPUs at one depth, for a time-limited machine: process sets,
# each cold (fresh Inductor/Triton cache, no stored plan) then warm (the same job again on that
# cache), as many as fit in BUDGET_S seconds, then (BOUNDS=1) the physical limits at that depth
# (compute_bound, gpu_work_bound). Everything goes into one archive, rewritten after every set, so a
# call cut by its deadline still returns what finished; each set's table is printed
# (benchmarks/compile_time.sh).
#   BUDGET_S=560 bash benchmarks/compile_2gpu.sh OUT.tgz LAYERS [SETS]
#   BOUNDS=1 bash benchmarks/compile_2gpu.sh OUT.tgz 32 3
#   TAG=blocks RUNS=cold BENCH_DC_CONFIG='{"blocks": false}' bash benchmarks/compile_2gpu.sh OUT.tgz 16 1
# TAG names the files of a variant (compile_L<L>_<run>_<device>_2gpu_<TAG>_r<set>.json), RUNS="cold"
# skips the warm re-runs, BENCH_DC_CONFIG adds config keys (zero3.py reads it).
set -u
cd "$(dirname "$0")/.."
arc=$1; L=$2; SETS=${3:-3}
start=$(date +%s); budget=${BUDGET_S:-380}
R=$(mktemp -d /tmp/dc_compile.XXXX)
export PYTHONUNBUFFERED=1 OUTDIR=$R
source benchmarks/device_prelude.sh && device_prelude "$R"
left() { echo $(( budget - ($(date +%s) - start) )); }
for r in $(seq 1 "$SETS"); do
  [ "$(left)" -lt 110 ] && { echo "set r$r skipped: $(left) s left"; break; }
  runs=${RUNS:-cold warm}; [ "$(left)" -lt 170 ] && runs="cold"
  TAG=${TAG:+${TAG}_}r$r RUNS="$runs" PER_RUN_TIMEOUT=150 bash benchmarks/compile_time.sh "$L" > "$R/sets_r$r.txt" 2>&1
  tar czf "$arc" -C "$R" .
  cat "$R/sets_r$r.txt"
done
if [ "${BOUNDS:-0}" = 1 ] && [ "$(left)" -ge 150 ]; then
  DEV=$(python -c "import torch;print(torch.cuda.get_device_name(0).split()[-1].lower())")
  timeout 150 python -m torch.distributed.run --nproc-per-node=2 benchmarks/zero3.py --layers "$L" \
    --systems compute_bound,gpu_work_bound --warmup 5 --steps 10 --no-plot --out "$R/bounds_L${L}_${DEV}_2gpu.json" \
    > "$R/bounds_L$L.log" 2>&1
  echo "bounds rc=$?"
  python - "$R/bounds_L${L}_${DEV}_2gpu.json" <<'PY'
import json, sys
try:
    for k, e in json.load(open(sys.argv[1]))["systems"].items():
        print(f"{k}: median {e.get('median_step_s', 0)*1e3:.1f} ms, host {(e.get('host_step_s') or 0)*1e3:.1f} ms")
except Exception as ex:  # noqa: BLE001
    print("bounds unreadable:", ex)
PY
fi
tar czf "$arc" -C "$R" .
