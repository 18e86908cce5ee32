#!/usr/bin/env bash
# One device call: the GPU tests of the CUDA backend, then `bench kernels`; a short table last.
# Run from the repository root; BENCH_ARGS adds options (e.g. "--sweep"), TESTS=0 skips the tests.
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lora-cupy-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"
if [ "${TESTS:-1}" != 0 ]; then
  start=$(date +%s)
  timeout 240 python3 -m pytest -m gpu tests/gpu/test_kernels.py -q -p no:cacheprovider --maxfail=30 -rf \
    --timeout=90 --timeout-method=thread \
    > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$? in $(( $(date +%s) - start ))s"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -40
fi
timeout ${BENCH_TIMEOUT:-330} python3 -m lora_cupy.bench.kernels --json "$OUT/bench.json" ${BENCH_ARGS:-} 2> "$OUT/bench.err" > "$OUT/bench.txt"
echo "bench rc=$?"; tail -5 "$OUT/bench.err"; cat "$OUT/bench.txt"
