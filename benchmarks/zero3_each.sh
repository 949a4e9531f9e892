#!/bin/bash
# Every system of benchmarks/zero3.py in a process of its own, into one JSON (--append), so that
# no system is measured after another in the same process (one measured after another ran
# measurably differently, benchmarks/README.md). A system that fails is recorded in the JSON and the next one still runs.
#
#   benchmarks/zero3_each.sh NPROC OUT SYSTEMS [more zero3.py options]
#   benchmarks/zero3_each.sh 2 benchmarks/results/zero3_h200_2gpu_each.json \
#       compute_bound,fsdp2_compiled,dc_zero3,dc_default,dc_prefetch
#
# dc_fsdp_budget reads fsdp2_compiled's and dc_zero3's peaks from the JSON: list it after them.
# The options after SYSTEMS go to every process: with --limit-from SYSTEM, dc_default_limit reads
# SYSTEM's peak from the JSON an earlier process wrote, so list SYSTEM before it, e.g.
#   benchmarks/zero3_each.sh 2 OUT fsdp2_compiled_ac,fsdp2_offload_ac,dc_default_limit --limit-from fsdp2_compiled_ac
set -u
if [ $# -lt 3 ]; then
  sed -n '2,13p' "$0" >&2
  exit 2
fi
nproc=$1 out=$2 systems=$3
shift 3
here=$(dirname "$0")
rm -f "$out"
status=0
for s in ${systems//,/ }; do
  torchrun --nproc-per-node="$nproc" "$here/zero3.py" --out "$out" --systems "$s" --append --no-plot "$@" || status=1
done
# the table and the plot of everything, from the JSON alone
python "$here/zero3.py" --replot "$out" || status=1
exit $status
