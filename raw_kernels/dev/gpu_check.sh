#!/usr/bin/env bash
# One GPU session's whole check of the kernels, from the root of a checkout on a CUDA host (no
# registry needed: CuPy, torch and pytest installed there): the GPU tests, then the kernel bench's
# rows that the second kernel issue scores, then its goals, the short table last.
#
#   OUT=/tmp/gc bash raw_kernels/dev/gpu_check.sh [pytest args...]
#
# $OUT receives gpu-tests.log, k.json (the bench run) and goals.txt. LORA_CUPY_PREBUILT, where set,
# names CUBINs built ahead on a CPU machine (`lora-cupy check-kernels --prebuild DIR`), so the GPU's
# time is not spent in NVRTC. TESTS_S and BENCH_S bound the two parts (seconds; defaults 330 and 65; TESTS_S=0: no tests).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to a directory for the logs}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
git rev-parse --short HEAD 2>/dev/null || true
# the kernel sources themselves (a copied tree's git metadata may name another commit): each family's
# prebuilt-CUBIN stem, which hashes its source
python -c "from lora_cupy.kernels import FAMILIES, read_source, prebuilt_stem as p
print(' '.join(p(f, 'sm_90a', read_source(k.file)) for f, k in FAMILIES.items()))" || true
if [ "${TESTS_S:-330}" != 0 ]; then
    timeout "${TESTS_S:-330}" python -m pytest -m gpu tests/gpu -q --timeout=200 -p no:cacheprovider "$@" \
        > "$OUT/gpu-tests.log" 2>&1
    echo "pytest -m gpu: exit $?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | tail -15
fi
python -m lora_cupy.bench.kernels --groups layer,core,shapes,poolrank --deadline-s "${BENCH_S:-65}" \
    --json "$OUT/k.json" > "$OUT/bench.log" 2>&1
echo "bench: exit $?"
grep -A8 "^layer (Llama" "$OUT/bench.log" | head -8
python raw_kernels/dev/goals.py "$OUT/k.json" --misses-only > "$OUT/goals.txt" 2>&1
tail -40 "$OUT/goals.txt"
