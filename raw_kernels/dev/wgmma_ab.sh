#!/usr/bin/env bash
# lora_chunk's chunks of 128 on warpgroup MMAs (chunk.cuh's WG, sm_90a), in one GPU call from the root of a
# checkout on a Hopper host: the T=4096 rows of each patched tree beside the shipped kernels (ab_trees.py, two
# rounds; it builds the trees), then each tree's bf16 GPU cases in chunks of 128 (the tests copied into it).
# Build the patched trees' CUBINs ahead on a CPU machine (for sm_90a, what Hopper runs), and point
# LORA_CUPY_PREBUILT there:
#
#   lora-cupy check-kernels --prebuild out/pb                                          # CPU, the shipped tree
#   python raw_kernels/dev/ab_trees.py --work /tmp/abw --prebuild out/pb $STACKS      # CPU, STACKS as below
#   LORA_CUPY_PREBUILT=$PWD/out/pb OUT=/tmp/wg bash raw_kernels/dev/wgmma_ab.sh        # GPU
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to a directory for the logs}
mkdir -p "$OUT"
D=raw_kernels/dev
# patches over the shipped tree; a stack's later patches apply over its first (ab_trees.py's a.patch+b.patch)
STACKS=${STACKS:-"$D/chunk_wgmma_defer.patch"}
nvidia-smi --query-gpu=name --format=csv,noheader || true
# shellcheck disable=SC2086
timeout 200 python $D/ab_trees.py --work /tmp/abw --rounds 2 $STACKS -- --layer "" --core "T4096 4096->4096" \
    --max-t 4096 > "$OUT/ab.txt" 2>&1
echo "ab: exit $?"
grep -E "^\| (row|core T)" "$OUT/ab.txt"
for s in $STACKS; do
  name=$(basename "${s##*+}" .patch)
  W=/tmp/abw/$name
  [ -d "$W/lora_cupy" ] || { echo "$name: no tree"; continue; }
  cp -r tests pyproject.toml "$W"/
  (cd "$W" && PYTHONPATH="$W" timeout 150 python -m pytest -m gpu tests/gpu/test_chunk_gpu.py -q -x -p no:cacheprovider \
      --timeout=120 -k "(T4096 or wide_ranks or chunks_of_128 or wideb) and (bfloat16 or not float16)" \
      > "$OUT/tests-$name.log" 2>&1)
  echo "$name pytest: exit $? ($(grep -E "passed|failed|skipped" "$OUT/tests-$name.log" | tail -1))"
done
