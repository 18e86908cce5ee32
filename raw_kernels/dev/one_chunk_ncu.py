"""The bench's layer of T positions over ADAPTERS adapters with one kernel forced (``--expand``, e.g.
one), each target called once (eagerly, before any timing) and then timed once, for Nsight Compute
to take one launch of it:

    ncu --kernel-name regex:lora_one --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python raw_kernels/dev/one_chunk_ncu.py --layer 64x32 --expand one

(launch-skip 0 / 1 / 2 / 3: the q/k/v, o, gate_up and down calls of the layer, in that order).
"""

from __future__ import annotations

import argparse

from lora_cupy.bench.kernels import Timer, run_layer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layer", default="64x32", help="TxADAPTERS")
    ap.add_argument("--expand", default="one")
    args = ap.parse_args()
    T, adapters = (int(v) for v in args.layer.split("x"))
    t = Timer(1, "diff", "none")
    r = run_layer(T, adapters, t, t, 1000, {"expand": args.expand} if args.expand else None)
    print(f"layer {T}x{adapters} [{args.expand}] warm {r['warm_us']:.1f} us, ok {r['ok']}, plans {r['plans']}")


if __name__ == "__main__":
    main()
