#!/usr/bin/env bash
# One GPU call's whole look at a kernel patch, from the root of a checkout on a CUDA host: the patch's
# rows beside this tree (`ab_trees.py`, after / before in each round), then the patched tree's own
# `pytest -m gpu`, bench and goals (`gpu_check.sh` run from that tree's root), then this tree's bench and
# goals in the same session (no tests: the patch's tree is what changed), the A/B table last.
#
#   OUT=/tmp/pc LORA_CUPY_PREBUILT=$PWD/out/pb bash raw_kernels/dev/patch_check.sh raw_kernels/dev/X.patch
#
# Build the CUBINs ahead on a CPU machine into one folder: `lora-cupy check-kernels --prebuild DIR` (this
# tree) and `ab_trees.py --prebuild DIR --families changed X.patch` (the patched tree); each tree finds its own
# there. Knobs (seconds or texts): AB_CORES (';'-separated `--core` texts of the A/B), AB_LAYER (`--layer`
# of the A/B, empty: none), AB_ROUNDS (2), AB_S (the A/B's bound), TESTS_S and BENCH_S (the patched tree's
# tests, each tree's bench), BASE_BENCH (0: skip this tree's bench). The patch may be a stack, a.patch+b.patch.
set -u
cd "$(dirname "$0")/../.."
PATCH=${1:?name a patch}
OUT=${OUT:?set OUT to a directory for the logs}
WORK=${WORK:-/tmp/lora-cupy-ab}
mkdir -p "$OUT/ab"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
IFS=';' read -r -a CORES <<< "${AB_CORES:-T1024 4096->4096}"
for core in "${CORES[@]}"; do
    tag=$(echo "$core" | tr -c 'A-Za-z0-9' '_')
    timeout "${AB_S:-200}" python raw_kernels/dev/ab_trees.py --work "$WORK" --rounds "${AB_ROUNDS:-2}" "$PATCH" \
        -- --layer "${AB_LAYER:-}" --core "$core" > "$OUT/ab/$tag.log" 2>&1
    echo "A/B --core '$core': exit $?"
done
tree="$WORK/$(basename "${PATCH##*+}" .patch)"  # ab_trees names a stack a.patch+b.patch for its last patch
echo "== the patched tree: pytest -m gpu, bench, goals"
OUT="$OUT/patched" bash "$tree/raw_kernels/dev/gpu_check.sh"
if [ "${BASE_BENCH:-1}" != 0 ]; then
    echo "== this tree: bench, goals"
    OUT="$OUT/base" TESTS_S=0 bash raw_kernels/dev/gpu_check.sh
fi
echo "== A/B (warm (flushed) us; base is this tree)"
for f in "$OUT"/ab/*.log; do sed -n '/^warm (flushed)/,$p' "$f"; done
