#!/usr/bin/env bash
# Compile time of the default plan: everything before the first step at training speed,
# per depth, with a cold and then a warm Inductor/Triton cache, one process per measurement.
#   bash benchmarks/compile_time.sh [LAYERS...]        (default: 16 32; 2 GPUs)
# Writes benchmarks/results/compile_L<L>_<cold|warm>_<device>_2gpu.json (zero3.py's JSON: compile_s,
# compile_phases_total_s per phase, trace_once, median_step_s) and prints a table.
# The native runtime's one-time build is outside the steps (initialize) and not counted.
# BENCH_DC_CONFIG='{"blocks": true}' adds config keys (zero3.py reads it); TAG=blocks names such
# runs' files (compile_L<L>_<run>_<device>_2gpu_<TAG>.json); RUNS="cold" skips the warm re-run.
set -u
cd "$(dirname "$0")/.."
OUTDIR=${OUTDIR:-benchmarks/results}
LAYERS=${*:-16 32}
NPROC=${NPROC:-2}
DEV=$(python -c "import torch;print(torch.cuda.get_device_name(0).split()[-1].lower() if torch.cuda.is_available() else 'cpu')")
files=()
for L in $LAYERS; do
  cache=$(mktemp -d /tmp/dc_compile_cache_L${L}.XXXX)
  export TORCHINDUCTOR_CACHE_DIR=$cache TRITON_CACHE_DIR=$cache/triton
  for run in ${RUNS:-cold warm}; do
    out=$OUTDIR/compile_L${L}_${run}_${DEV}_${NPROC}gpu${TAG:+_$TAG}.json
    timeout ${PER_RUN_TIMEOUT:-300} python -m torch.distributed.run --nproc-per-node=$NPROC benchmarks/zero3.py --layers $L \
      --systems dc_default --warmup 5 --steps 10 --no-plot --out "$out" > "${out%.json}.log" 2>&1
    echo "L=$L $run rc=$?"
    files+=("$out")
  done
done
python - "${files[@]}" <<'PY'
import json, sys
print(f"{'file':44s} {'first fast step s':>17s} {'median ms':>9s} {'host ms':>7s} {'reused':>6s}  phases (s, max over ranks)")
for f in sys.argv[1:]:
    try:
        e = json.load(open(f))["systems"]["dc_default"]
    except Exception as ex:  # noqa: BLE001
        print(f"{f:44s} unreadable: {ex}"); continue
    med = e.get("median_step_s") or 0
    first = (e.get("compile_s") or 0) + med
    reused = all(t.get("reused") for t in (e.get("trace_once") or [{}]))
    ph = " ".join(f"{k} {v:.1f}" for k, v in sorted((e.get("compile_phases_total_s") or {}).items()))
    host = (e.get("host_step_s") or 0) * 1e3
    print(f"{f.split('/')[-1]:44s} {first:17.1f} {med*1e3:9.1f} {host:7.1f} {str(reused):>6s}  {ph}")
PY
