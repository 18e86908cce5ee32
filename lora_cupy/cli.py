"""The ``lora-cupy`` command: ``demo``, ``bench kernels | pool``, ``check-kernels``."""

from __future__ import annotations

import argparse
import importlib
import sys


def _check_kernels(argv: list[str]) -> int:
    from . import kernels

    p = argparse.ArgumentParser(prog="lora-cupy check-kernels",
                                description="Compile every raw_kernels/ source with NVRTC (no GPU needed).")
    p.add_argument("--arch", action="append", help="e.g. sm_90a (default: %s)" % ", ".join(kernels.CHECK_ARCHS))
    p.add_argument("--sizes", action="store_true",
                   help="also print each kernel's SASS instruction count (from the CUBIN NVRTC builds)")
    p.add_argument("--prebuild", metavar="DIR",
                   help=f"write every family's CUBIN for each --arch (default sm_90a, Hopper's) into DIR, for {kernels.PREBUILT_ENV}=DIR "
                        "on a GPU machine (no compile on first use)")
    p.add_argument("--jobs", type=int, default=0,
                   help="compile in this many processes at once (default: one per CPU; 1: one after another here)")
    args = p.parse_args(argv)
    if args.jobs < 0:
        p.error("--jobs must be 0 (one per CPU) or more")
    archs = args.arch or (["sm_90a"] if args.prebuild else list(kernels.CHECK_ARCHS))
    if args.jobs != 1:
        kernels.compile_ahead([(f, a) for a in archs for f in sorted(kernels.FAMILIES)], jobs=args.jobs or None)
    try:
        return _check_families(kernels, archs, args)  # each compile asked for in turn, so all are waited for
    except BaseException:
        kernels.cancel_ahead()  # stopped early: no wait at exit for compiles nothing will read
        raise


def _check_families(kernels, archs, args) -> int:
    if args.prebuild:
        for arch in archs:
            for path in kernels.prebuild(args.prebuild, arch):
                print(f"wrote   {path}")
        return 0
    failed = 0
    for arch in archs:
        for family in sorted(kernels.FAMILIES):
            try:
                kernels.compile_family(family, arch)
                print(f"ok      {family:<16} {arch}")
                if args.sizes:
                    for expr, n in kernels.code_sizes(family, arch).items():
                        print(f"        {n:7d} instructions  {expr}")
            except kernels.KernelCompileError as e:
                failed += 1
                print(f"FAILED  {family:<16} {arch}\n{e}")
    return 1 if failed else 0


_BENCHES = {"kernels": "lora_cupy.bench.kernels", "pool": "lora_cupy.bench.pool", "lane": "lora_cupy.bench.lane",
            "e2e": "lora_cupy.bench.e2e", "tp": "lora_cupy.bench.tp", "overlap": "lora_cupy.bench.overlap"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="lora-cupy", description=__doc__)
    p.add_argument("command", choices=["demo", "bench", "check-kernels"])
    p.add_argument("rest", nargs=argparse.REMAINDER)
    args = p.parse_args(argv[:1])
    rest = argv[1:]
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if args.command == "check-kernels":
        return _check_kernels(rest)
    if not rest or rest[0] not in _BENCHES:
        p.error(f"bench needs one of: {', '.join(_BENCHES)}")
    return importlib.import_module(_BENCHES[rest[0]]).main(rest[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
