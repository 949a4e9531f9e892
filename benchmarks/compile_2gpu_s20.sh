#!/usr/bin/env bash
# Session 20's one device call (issue 18): the compile benchmark on 2 GPUs, default plan (cold, then a
# warm re-run of its stored plan and Inductor cache) at 16 and 32 layers, then config blocks cold at
# both depths; all files into one archive ($1, default results.tgz), a table per set last.
#   bash benchmarks/compile_2gpu_s20.sh $OUT/results.tgz
set -u
cd "$(dirname "$0")/.."
arc=${1:-results.tgz}
R=$(mktemp -d /tmp/dc_s20.XXXX)
export PYTHONUNBUFFERED=1 OUTDIR=$R
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$R/gpus.txt" 2>&1
python -c "import torch, sys; print(torch.__version__, sys.version.split()[0])" >> "$R/gpus.txt"
# the native runtime's one-time build, outside every measurement
python -c "from deepcompile.runtime import ops; ops.ensure_registered()" > "$R/build.log" 2>&1
# every set under one deadline, so the archive is always written
timeout "${BUDGET_S:-430}" bash -c '
  PER_RUN_TIMEOUT=200 bash benchmarks/compile_time.sh 16 32 > "$OUTDIR/default.txt" 2>&1
  TAG=blocks RUNS=cold BENCH_DC_CONFIG="{\"blocks\": true}" PER_RUN_TIMEOUT=150 \
    bash benchmarks/compile_time.sh 16 32 > "$OUTDIR/blocks.txt" 2>&1'
echo "sets rc=$?"
tar czf "$arc" -C "$R" .
cat "$R/gpus.txt"; cat "$R/default.txt" "$R/blocks.txt" 2>/dev/null
