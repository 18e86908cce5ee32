"""``layer_rows.py`` with plan constants of the CuPy backend set first (dev tool, not shipped): an A/B
of the planner's choices (blocks a multiprocessor, splits, where a kernel takes over) in one process,
no kernel rebuilt.

    PYTHONPATH=. python raw_kernels/dev/plan_knobs.py PAIR_EXPAND_PER_SM=3 -- --tag per3 --layer 64x32 --core "T64 4096->4096 r64"

Each ``NAME=VALUE`` before ``--`` sets ``lora_cupy.backends.cupy.NAME`` (an existing int, float or
bool constant, VALUE converted to its type); the arguments after ``--`` go to ``layer_rows.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path


def set_knobs(knobs: list[str]) -> None:
    from lora_cupy.backends import cupy as cb

    for knob in knobs:
        name, sep, value = knob.partition("=")
        old = getattr(cb, name, None)
        if not sep or not isinstance(old, (bool, int, float)):
            raise SystemExit(f"plan_knobs: {knob!r} is not NAME=VALUE of a number constant of lora_cupy.backends.cupy")
        setattr(cb, name, (value.lower() in ("1", "true")) if isinstance(old, bool) else type(old)(value))


def main(argv: list[str]) -> None:
    cut = argv.index("--") if "--" in argv else len(argv)
    set_knobs(argv[:cut])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import layer_rows

    sys.argv = [sys.argv[0], *argv[cut + 1:]]
    layer_rows.main()


if __name__ == "__main__":
    main(sys.argv[1:])
