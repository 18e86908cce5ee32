#!/usr/bin/env bash
# The A/B of the kernels' ALIGNED instantiations (NOTES.md, "Where the time goes", item 0) on one
# GPU, from the repository root, in under 5 minutes:
#   1. the kernel tests: python3 -m pytest -m gpu tests/gpu/test_kernels.py -q -x
#   2. decode_sweep.py's core rows (T 1/16/64, rank 16/64, 1/8/32 adapters), its large rows (T 256 to
#      4096, 32 adapters) and the layer rows,
#      on this tree, where each row runs both instantiations in the same process (aligned_off: the
#      kernels that read the flags, byte for byte the SASS of BASE; default: the ALIGNED ones), and
#      on a `before` tree (BASE: git archive, else out/ab-before-BASE.tar.gz), in rounds
#      after / before / before / after while the deadline (default 285 s) allows;
#   3. one table of every run last (medians per cell), all of it as JSON under $OUT.
# Usage: OUT=/tmp/ab bash raw_kernels/dev/ab_aligned.sh BASE [DEADLINE_S]
set -uo pipefail
BASE=${1:?base commit (the tree before the ALIGNED instantiations)}
DEADLINE=${2:-285}
OUT=${OUT:-/tmp/lora-cupy-ab}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
HERE=$PWD
T0=$(date +%s)
left() { echo $(( T0 + DEADLINE - $(date +%s) )); }
cap() { local l; l=$(left); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }  # min(limit, time left)

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "$(cap 200)" python3 -m pytest -m gpu tests/gpu/test_kernels.py -q -x > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? after $(( $(date +%s) - T0 ))s: $(tail -1 "$OUT/pytest.log")"

B=/tmp/lora-cupy-ab-before
rm -rf "$B" && mkdir -p "$B"
if git archive "$BASE" lora_cupy raw_kernels 2>/dev/null | tar -x -C "$B" 2>/dev/null; then
  echo "before: git archive $BASE"
elif [ -f "out/ab-before-$BASE.tar.gz" ] && tar -xzf "out/ab-before-$BASE.tar.gz" -C "$B"; then
  echo "before: out/ab-before-$BASE.tar.gz"
else
  echo "before: no tree for $BASE here (no git history, no out/ab-before-$BASE.tar.gz); in-process A/B only"
  B=
fi

SWEEP=(--pairs default --rows core,large --layer)
before() { [ -n "$B" ] && [ "$(left)" -gt 20 ] && (cd "$B" && timeout "$(cap 70)" python3 \
  "$HERE/raw_kernels/dev/decode_sweep.py" "${SWEEP[@]}" --label before --json "$OUT/before$1.json" > /dev/null \
  2>> "$OUT/sweep.log"); echo "before $1 rc=$? at $(( $(date +%s) - T0 ))s"; }
after() { [ "$(left)" -gt 20 ] && timeout "$(cap 90)" python3 raw_kernels/dev/decode_sweep.py "${SWEEP[@]}" \
  --aligned-off --label after --json "$OUT/after$1.json" > /dev/null 2>> "$OUT/sweep.log"
  echo "after $1 rc=$? at $(( $(date +%s) - T0 ))s"; }
after 1; before 1                                   # the in-process A/B first: it matters most
[ "$(left)" -gt 110 ] && { before 2; after 2; }     # a second round, the other way round, if time allows

python3 raw_kernels/dev/decode_sweep.py --compare "$OUT"/before*.json "$OUT"/after*.json --json "$OUT/ab.json"
