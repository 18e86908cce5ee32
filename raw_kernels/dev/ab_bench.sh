#!/usr/bin/env bash
# `bench kernels` rows on this tree and on another, in one GPU session: after / before / after, each
# run started from its own tree's root (`python -m` puts the working directory ahead of PYTHONPATH,
# so a tree must be run from where it is), then one table of the three runs and the layer rows.
# Usage, from this tree's root: OUT=/tmp/ab bash raw_kernels/dev/ab_bench.sh BEFORE_DIR [bench args]
#   BEFORE_DIR: the other tree (`git archive BASE lora_cupy raw_kernels | tar -x -C before`);
#   bench args: default `--groups core,shapes,layer --max-tokens 64`.
set -uo pipefail
BEFORE=$(cd "${1:?the other tree, a directory}" && pwd)
shift
ARGS=${*:---groups core,shapes,layer --max-tokens 64}
OUT=${OUT:-/tmp/lora-cupy-ab}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
HERE=$PWD
export PYTHONUNBUFFERED=1
run() {  # run NAME DIR: the tree's own package, from its own root
  local t0 pkg
  t0=$(date +%s)
  pkg=$(cd "$2" && PYTHONPATH=. python3 -c "import lora_cupy, os; print(os.path.dirname(lora_cupy.__file__))")
  (cd "$2" && PYTHONPATH=. python3 -m lora_cupy.bench.kernels $ARGS --json "$OUT/$1.json" > /dev/null 2> "$OUT/$1.err")
  echo "$1: rc=$? in $(( $(date +%s) - t0 )) s, package $pkg"
}
run after1 "$HERE"
run before "$BEFORE"
run after2 "$HERE"
python3 "$HERE/raw_kernels/dev/ab_table.py" "$OUT/after1.json" "$OUT/before.json" "$OUT/after2.json"
