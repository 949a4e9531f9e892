# Sourced by the device scripts (compile_2gpu.sh): into directory $1, the
# GPUs, torch and Python versions and the commit, then the native runtime's one-time build (kept
# out of every timed run). On the device machine the copy's git log can name the commit before
# uncommitted changes: the result files say which tree ran where that matters.
device_prelude() {
  local R=$1
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$R/gpus.txt" 2>&1
  python -c "import torch, sys; print(torch.__version__, sys.version.split()[0])" >> "$R/gpus.txt"
  git log --oneline -1 >> "$R/gpus.txt" 2>/dev/null
  python -c "from deepcompile.runtime import ops; ops.ensure_registered()" > "$R/build.log" 2>&1
}
