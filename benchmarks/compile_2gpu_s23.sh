#!/usr/bin/env bash
# Session 23's device call (issue 18): the default plan's compile time at one depth, process sets
# cold (fresh Inductor/Triton cache, no stored plan) then warm (same job again on that cache), as
# many sets as fit in BUDGET_S seconds; the archive is rewritten after every run, so a call cut by
# its deadline still returns what finished. Prints each set's table (benchmarks/compile_time.sh).
#   BUDGET_S=380 bash benchmarks/compile_2gpu_s23.sh OUT.tgz LAYERS [SETS]
set -u
cd "$(dirname "$0")/.."
arc=$1; L=$2; SETS=${3:-3}
start=$(date +%s); budget=${BUDGET_S:-380}
R=$(mktemp -d /tmp/dc_s23.XXXX)
export PYTHONUNBUFFERED=1 OUTDIR=$R
source benchmarks/device_prelude.sh && device_prelude "$R"
left() { echo $(( budget - ($(date +%s) - start) )); }
for r in $(seq 1 "$SETS"); do
  [ "$(left)" -lt 110 ] && { echo "set r$r skipped: $(left) s left"; break; }
  runs="cold"; [ "$(left)" -ge 170 ] && runs="cold warm"
  TAG=r$r RUNS="$runs" PER_RUN_TIMEOUT=150 bash benchmarks/compile_time.sh "$L" > "$R/sets_r$r.txt" 2>&1
  tar czf "$arc" -C "$R" .
  cat "$R/sets_r$r.txt"
done
tar czf "$arc" -C "$R" .
