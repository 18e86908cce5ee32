"""The bench's rows (``--json`` of ``lora_cupy.bench.kernels``) with lora_one's column beside the
default's and lora_chunk's, flushed us: ``python raw_kernels/dev/one_column.py k.json``."""

import json
import sys

d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    k = r["kernels"]
    if "one" not in k:
        continue

    def us(name):
        v = k.get(name)
        return f"{v['us']:.1f}" if v else "-"

    print(f"{r['label'][:42]:42s} default {us('default'):>6s}  one {us('one'):>6s}  chunk {us('chunk'):>6s}  "
          f"chunk_cl {us('chunk_cl'):>6s}")  # chunk_cl: runs before lora_chunk_cl was deleted
