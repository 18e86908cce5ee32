#!/usr/bin/env bash
# The A/B of the kernels' ALIGNED instantiations (NOTES.md, "Code size: ALIGNED instantiations chosen
# per call") on one GPU, from the root of a snapshot of the repository (no git history needed), in
# about two minutes: everything, the final table included, ends within DEADLINE_S (default 150).
# The GPU tests are not part of it: run `python3 -m pytest -m gpu tests/gpu` on their own.
#   0. the `before` tree (BASE, default 5430af5): out/ab-before-BASE.tar.gz, made where the history
#      is with `git archive BASE lora_cupy raw_kernels | gzip > out/ab-before-BASE.tar.gz` (else
#      `git archive BASE` where this copy has history); then both trees' bf16 modules compiled at
#      once (NVRTC, into CuPy's disk cache), so that no timed run waits for a compile;
#   1. decode_sweep.py's core rows (T 1/16/64, rank 16/64, 1/8/32 adapters) and the layer rows (the
#      four calls of a Llama-8B layer in one graph), one round after / before / after: on this tree
#      each row runs both instantiations in one process (aligned_off: the kernels that read the
#      flags, the SASS of BASE; default: the ALIGNED ones), the before tree its one kind;
#   2. one table of every run, printed last (medians per cell); the runs' JSON (after1, before1,
#      after2) and the merged table (ab.json) under $OUT, the sweeps' progress in $OUT/sweep.log.
# Usage: OUT=/tmp/ab PYTHONPATH=. bash raw_kernels/dev/ab_aligned.sh [BASE] [DEADLINE_S]
#   (ROWS=core,large adds decode_sweep's large rows, T 256-4096: give it a longer deadline)
set -uo pipefail
BASE=${1:-5430af5}
DEADLINE=${2:-150}
OUT=${OUT:-/tmp/lora-cupy-ab}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the before runs start in the before tree
rm -f "$OUT"/before*.json "$OUT"/after*.json "$OUT/ab.json" "$OUT/sweep.log"
export PYTHONPATH=. PYTHONUNBUFFERED=1
HERE=$PWD
T0=$(date +%s)
left() { echo $(( T0 + DEADLINE - $(date +%s) )); }
at() { echo "$(( $(date +%s) - T0 ))s"; }
cap() { local l; l=$(( $(left) - 5 )); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }  # min(limit, time left less the table's 5 s)

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

B=/tmp/lora-cupy-ab-before
rm -rf "$B" && mkdir -p "$B"
if [ -f "out/ab-before-$BASE.tar.gz" ] && tar -xzf "out/ab-before-$BASE.tar.gz" -C "$B" && [ -d "$B/lora_cupy" ]; then
  echo "before: out/ab-before-$BASE.tar.gz"
elif git archive "$BASE" lora_cupy raw_kernels 2>/dev/null | tar -x -C "$B" 2>/dev/null && [ -d "$B/lora_cupy" ]; then
  echo "before: git archive $BASE"
else
  echo "before: no tree for $BASE (no out/ab-before-$BASE.tar.gz, no git history); in-process A/B only"
  B=
fi

# both trees' bf16 modules at once (each process compiles its tree's module, or finds it cached)
WARM='from lora_cupy.backends.cupy import CupyBackend
from lora_cupy.spec import LoraSpec, LoraTarget
CupyBackend(LoraSpec((LoraTarget("t", 64, 64, 1),), num_slots=2, max_rank=16, dtype="bfloat16"))'
timeout "$(cap 75)" python3 -c "$WARM" 2>> "$OUT/sweep.log" & WA=$!
if [ -n "$B" ]; then (cd "$B" && timeout "$(cap 75)" python3 -c "$WARM" 2>> "$OUT/sweep.log") & WB=$!; fi
wait "$WA"; ra=$?; rb=-; [ -n "$B" ] && { wait "$WB"; rb=$?; }
echo "compiled: after rc=$ra, before rc=$rb at $(at)"

SWEEP=(--pairs default --rows "${ROWS:-core}" --layer)
before() { [ -n "$B" ] && [ "$(left)" -gt 20 ] && (cd "$B" && timeout "$(cap 40)" python3 \
  "$HERE/raw_kernels/dev/decode_sweep.py" "${SWEEP[@]}" --label before --json "$OUT/before$1.json" > /dev/null \
  2>> "$OUT/sweep.log"); echo "before $1 rc=$? at $(at)"; }
after() { [ "$(left)" -gt 20 ] && timeout "$(cap 45)" python3 raw_kernels/dev/decode_sweep.py "${SWEEP[@]}" \
  --aligned-off --label after --json "$OUT/after$1.json" > /dev/null 2>> "$OUT/sweep.log"
  echo "after $1 rc=$? at $(at)"; }
after 1; before 1; after 2

shopt -s nullglob
RUNS=("$OUT"/before*.json "$OUT"/after*.json)
[ ${#RUNS[@]} -gt 0 ] || { echo "no run left a JSON (see $OUT/sweep.log)"; exit 1; }
echo "table at $(at) (deadline ${DEADLINE}s):"
python3 raw_kernels/dev/decode_sweep.py --compare "${RUNS[@]}" --json "$OUT/ab.json"
