"""The table of ``ab_bench.sh``: each row's time in every run given (``bench kernels --json``
files), and the layer rows (warm, and each call alone)."""

import json
import sys


def main(paths: list[str]) -> None:
    found = []
    for p in paths:
        try:
            with open(p) as f:
                found.append((p, json.load(f)))
        except (OSError, ValueError) as e:  # a run that failed or ran out of time: its .err says why
            print(f"{p}: no table ({e})")
    if not found:
        return
    runs = [d for _, d in found]
    names = [p.rsplit("/", 1)[-1].removesuffix(".json") for p, _ in found]
    rows = [{r["label"]: r["us"] for r in d["rows"]} for d in runs]
    print(f"{'row (us)':44s}" + "".join(f"{n:>10s}" for n in names))
    for label in rows[0]:
        print(f"{label:44s}" + "".join(f"{r[label]:10.1f}" if label in r else f"{'-':>10s}" for r in rows))
    layers = [{(x["T"], x["adapters"]): x for x in d.get("layer", [])} for d in runs]
    for key in layers[0]:
        for what in ("warm", "qkv", "o", "gate_up", "down"):
            cells = []
            for lay in layers:
                x = lay.get(key)
                v = None if x is None else x["warm_us"] if what == "warm" else x["calls_warm_us"].get(what)
                cells.append(f"{v:10.1f}" if v is not None else f"{'-':>10s}")
            print(f"{f'layer T={key[0]} {key[1]} adapters {what}':44s}" + "".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
