#!/usr/bin/env bash
# Where the host's time goes before the first fast step on the GPU: one cold default-plan
# run of benchmarks/zero3.py under py-spy (sampling, nonblocking: the ranks are not paused; idle
# stacks kept, so waits show), every process and thread, as a speedscope file.
#   bash benchmarks/pyspy_compile.sh OUTDIR LAYERS        (py-spy on PATH; 2 GPUs)
# Read it with benchmarks/pyspy_steps.py (time per step and per deepcompile phase, rank by rank).
set -u
cd "$(dirname "$0")/.."
out=$1; L=${2:-32}
mkdir -p "$out"
python -c "from deepcompile.runtime import ops; ops.ensure_registered()" > "$out/build.log" 2>&1
cache=$(mktemp -d /tmp/dc_spy_cache.XXXX)
export TORCHINDUCTOR_CACHE_DIR=$cache TRITON_CACHE_DIR=$cache/triton PYTHONUNBUFFERED=1
timeout "${SPY_TIMEOUT:-300}" py-spy record --subprocesses --nonblocking --idle -r "${SPY_RATE:-100}" -f speedscope \
  -o "$out/spy_L$L.json" -- python -m torch.distributed.run --nproc-per-node=2 benchmarks/zero3.py --layers "$L" \
  --systems dc_default --warmup 5 --steps 10 --no-plot --out "$out/spy_L${L}_run.json" > "$out/spy_L$L.log" 2>&1
echo "py-spy rc=$?"
gzip -f "$out/spy_L$L.json"
grep -E "deepcompile: step|step [0-4]:|dc_default:" "$out/spy_L$L.log" | cut -c1-220
