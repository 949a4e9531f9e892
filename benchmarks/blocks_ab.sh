#!/bin/bash
# Blocks (config "blocks": true) against whole graphs, the default plan, one GPU: each mode cold on
# its own Inductor cache, then re-runs of its stored plan, modes alternating, one process per run
# (the step's host time wanders by more than blocks' cost between processes on one host, so a
# single pair decides nothing). With PROFILE=1 the re-runs' timed steps run under cProfile (BENCH_CPROFILE_STEPS), and
# the functions whose own time per step differs most between the modes are listed: where blocks'
# host time goes.
#
#   benchmarks/blocks_ab.sh LAYERS OUTDIR [PAIRS] [BUDGET_S]
#   PROFILE=1 benchmarks/blocks_ab.sh 32 $OUT 1 540
#   BENCH_ARGS="--tiny --device cpu --dtype float32" benchmarks/blocks_ab.sh 4 /tmp/ab 1   # smoke test
#
# PAIRS re-run pairs after the cold pair (default 2); no run starts after BUDGET_S seconds (default
# 500), so that the script fits a time-limited machine. Prints one line per run, then the diff.
# AB_KEY=trace_blocks: the same A/B for another boolean config key (runs named "<key>" / "no_<key>"
# instead of blocks / whole); AB_BASE='{"blocks": true}': config keys both modes share.
set -u
if [ $# -lt 2 ]; then
  sed -n '2,13p' "$0" >&2
  exit 2
fi
layers=$1 out=$2 pairs=${3:-2} budget=${4:-500}
key=${AB_KEY:-blocks} base=${AB_BASE:-"{}"}
on=blocks off=whole
[ "$key" != blocks ] && on=$key off=no_$key
here=$(dirname "$0")
mkdir -p "$out"
declare -A cache=([true]=$(mktemp -d) [false]=$(mktemp -d))
run() { # name on/off [profile]
  local c=${cache[$2]}
  TORCHINDUCTOR_CACHE_DIR=$c TRITON_CACHE_DIR=$c/triton \
    BENCH_DC_CONFIG=$(python -c "import json,sys; d=json.loads(sys.argv[1]); d[sys.argv[2]]=sys.argv[3]=='true'; print(json.dumps(d))" "$base" "$key" "$2") \
    BENCH_CPROFILE_STEPS=${3:-} timeout 300 python "$here/zero3.py" --layers "$layers" --systems dc_default \
    --warmup 5 --steps 15 --no-plot --out "$out/$1.json" ${BENCH_ARGS:-} > "$out/$1.log" 2>&1
  echo "$1 rc=$? t=$SECONDS"
}
run L${layers}_${off}_cold false
run L${layers}_${on}_cold true
for i in $(seq 1 "$pairs"); do
  for m in false true; do
    name=L${layers}_$([ $m = true ] && echo $on || echo $off)_$i
    [ $SECONDS -lt "$budget" ] && run "$name" $m "$([ "${PROFILE:-0}" = 1 ] && echo "$out/$name.prof")"
  done
done
python - "$out" "$layers" "$on" "$off" <<'PY'
import glob, json, os, pstats, sys
out, layers, on, off = sys.argv[1:5]
for f in sorted(glob.glob(f"{out}/L{layers}_*.json")):
    e = json.load(open(f))["systems"]["dc_default"]
    if e.get("error"):
        print(os.path.basename(f), "ERROR", str(e["error"])[:300]); continue
    ph = e.get("compile_phases_total_s") or {}
    print(f"{os.path.basename(f)[:-5]:22s} first {e.get('compile_s', 0) + e['median_step_s']:6.1f} s "
          f"(inductor {ph.get('inductor', 0):5.1f}) step {e['median_step_s'] * 1e3:7.2f} ms "
          f"host {(e.get('host_step_s') or 0) * 1e3:6.1f} cpu {(e.get('host_cpu_step_s') or 0) * 1e3:6.1f}")
def own(path, steps=15):  # own seconds per step by function, "file:line(name)" with the cache dir cut
    st = pstats.Stats(path).stats
    d = {}
    for (f, l, n), (cc, nc, tt, ct, _) in st.items():
        # Inductor's generated modules (one per region or graph) count as one
        k = f"<generated>:{n}" if "torchinductor" in f or f.startswith("/tmp/") else f"{f.split('site-packages/')[-1]}:{l}({n})"
        d[k] = d.get(k, 0.0) + tt / steps
    return d
profs = {m: sorted(glob.glob(f"{out}/L{layers}_{m}_*.prof")) for m in (on, off)}
if profs[on] and profs[off]:
    b, w = own(profs[on][-1]), own(profs[off][-1])
    print(f"cProfile own time per step (ms): {on} {sum(b.values()) * 1e3:.1f}, {off} {sum(w.values()) * 1e3:.1f}")
    diff = sorted(set(b) | set(w), key=lambda k: -abs(b.get(k, 0) - w.get(k, 0)))
    for k in diff[:25]:
        print(f"{(b.get(k, 0) - w.get(k, 0)) * 1e3:+8.3f} ms  {on} {b.get(k, 0) * 1e3:7.3f}  {off} {w.get(k, 0) * 1e3:7.3f}  {k[:110]}")
PY
