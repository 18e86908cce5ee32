#!/usr/bin/env bash
# lora_chunk's chunks of 128 on warpgroup MMAs, in one GPU call from the root of a checkout on a Hopper
# host: each dev patch's bf16 GPU cases in chunks of 128 (from a patched copy of the tree, with the tests),
# then the T=4096 rows beside the shipped kernels (ab_trees.py, two rounds). Build the patched trees' CUBINs
# ahead on a CPU machine (each patch's kernels.py builds them for sm_90a), and point LORA_CUPY_PREBUILT there:
#
#   python raw_kernels/dev/ab_trees.py --work /tmp/abw --prebuild out/pb raw_kernels/dev/chunk_wgmma*.patch  # CPU
#   LORA_CUPY_PREBUILT=$PWD/out/pb OUT=/tmp/wg bash raw_kernels/dev/wgmma_ab.sh                              # GPU
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to a directory for the logs}
mkdir -p "$OUT"
D=raw_kernels/dev
PATCHES=${PATCHES:-"$D/chunk_wgmma.patch $D/chunk_wgmma_pad.patch $D/chunk_wgmma_defer.patch"}
nvidia-smi --query-gpu=name --format=csv,noheader || true
for p in $PATCHES; do
  name=$(basename "$p" .patch)
  W=/tmp/wgmma-$name
  rm -rf "$W" && mkdir -p "$W" && cp -r lora_cupy raw_kernels tests pyproject.toml "$W"/
  (cd "$W" && git apply "$p") || { echo "$name: does not apply"; continue; }
  (cd "$W" && PYTHONPATH="$W" timeout 150 python -m pytest -m gpu tests/gpu/test_chunk_gpu.py -q -x -p no:cacheprovider \
      --timeout=120 -k "(T4096 or wide_ranks or chunks_of_128 or wideb) and (bfloat16 or not float16)" \
      > "$OUT/tests-$name.log" 2>&1)
  echo "$name pytest: exit $? ($(grep -E "passed|failed" "$OUT/tests-$name.log" | tail -1))"
done
# shellcheck disable=SC2086
timeout 200 python $D/ab_trees.py --work /tmp/abw --rounds 2 $PATCHES -- --layer "" --core "T4096 4096->4096" \
    --max-t 4096 > "$OUT/ab.txt" 2>&1
echo "ab: exit $?"
grep -E "^\| (row|core T)" "$OUT/ab.txt"
