#!/usr/bin/env bash
# The whole GPU check in one go, from the repository root on a CUDA host: every `pytest -m gpu`
# test, the demo on the GPU, and the pool's host-side benchmark; a short summary last.
# Results go to $OUT (default /tmp/lora-cupy-out). BENCH_KERNELS=1 also runs `bench kernels`;
# PYTEST=0 leaves the tests out.
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lora-cupy-out}
mkdir -p "$OUT"
# At most 8 files under $OUT: a copy of the tree sent to a GPU host may carry no .git, so the
# commit is given by whoever runs this (COMMIT=...), next to the GPU's name.
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"; } | tee "$OUT/gpu.txt"
start=$(date +%s)
if [ "${PYTEST:-1}" = 1 ]; then  # PYTEST=0 leaves the tests out (run them in a call of their own)
  timeout 540 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -rf --timeout=120 > "$OUT/pytest.log" 2>&1
  echo "pytest -m gpu rc=$? in $(( $(date +%s) - start ))s"
fi
timeout 120 python3 -m lora_cupy.cli demo --device cuda:0 --quiet > "$OUT/demo.txt" 2>&1
echo "demo rc=$?"
timeout 120 python3 -m lora_cupy.bench.pool --device cuda:0 --steps 2000 --json "$OUT/bench_pool.json" > "$OUT/bench_pool.txt" 2>&1
echo "bench pool rc=$?"
if [ "${BENCH_KERNELS:-0}" = 1 ]; then
  timeout 330 python3 -m lora_cupy.bench.kernels --json "$OUT/bench_kernels.json" > "$OUT/bench_kernels.txt" 2>&1
  echo "bench kernels rc=$?"
fi
[ -f "$OUT/pytest.log" ] && { echo "---- pytest"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -25; }
echo "---- demo"; tail -12 "$OUT/demo.txt"
echo "---- bench pool"; cat "$OUT/bench_pool.txt"
if [ "${BENCH_KERNELS:-0}" = 1 ]; then echo "---- bench kernels"; tail -40 "$OUT/bench_kernels.txt"; fi
