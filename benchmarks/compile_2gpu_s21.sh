#!/usr/bin/env bash
# Session 21's device calls (issue 18): the default plan's compile time, three process sets per depth,
# each cold (fresh Inductor/Triton cache, no stored plan) then warm (the same job again on that cache),
# then the physical limits (compute_bound, gpu_work_bound) at that depth; all files into one archive.
#   bash benchmarks/compile_2gpu_s21.sh OUT.tgz LAYERS [REPS] [RUNS]
set -u
cd "$(dirname "$0")/.."
arc=$1; L=$2; REPS=${3:-3}; RUNS=${4:-"cold warm"}
R=$(mktemp -d /tmp/dc_s21.XXXX)
export PYTHONUNBUFFERED=1 OUTDIR=$R
source benchmarks/device_prelude.sh && device_prelude "$R"
timeout "${BUDGET_S:-540}" bash -c '
  for r in $(seq 1 '"$REPS"'); do
    TAG=r$r RUNS="'"$RUNS"'" PER_RUN_TIMEOUT=200 bash benchmarks/compile_time.sh '"$L"' > "$OUTDIR/sets_r$r.txt" 2>&1
  done
  timeout 150 python -m torch.distributed.run --nproc-per-node=2 benchmarks/zero3.py --layers '"$L"' \
    --systems compute_bound,gpu_work_bound --warmup 5 --steps 10 --no-plot --out "$OUTDIR/bounds_L'"$L"'.json" \
    > "$OUTDIR/bounds_L'"$L"'.log" 2>&1; echo "bounds rc=$?"'
echo "sets rc=$?"
tar czf "$arc" -C "$R" .
cat "$R/gpus.txt" "$R"/sets_r*.txt 2>/dev/null
python - "$R/bounds_L$L.json" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))["systems"]
    for k, e in s.items():
        print(f"{k}: median {e.get('median_step_s', 0)*1e3:.1f} ms, host {(e.get('host_step_s') or 0)*1e3:.1f} ms")
except Exception as ex:  # noqa: BLE001
    print("bounds unreadable:", ex)
PY
