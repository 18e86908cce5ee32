"""This tree against the same tree with kernel patches applied, in one GPU session (dev tool).

Each patch (a unified diff against this tree, as `git diff` writes it; `raw_kernels/dev/*.patch`;
or `a.patch+b.patch`, b applied over a, the tree named for the last) gets a tree of its own: `lora_cupy/` and `raw_kernels/` copied under `--work` and the patch applied
there (`git apply`, which needs no repository; `patch -p1` where git is missing). `layer_rows.py` then runs from each tree's root in
turn, `--rounds` times (this tree first in each round), with the arguments after `--`; its lines are
gathered into one table, a column a tree, each cell the warm and flushed figures of every round
(min-max where they differ).

A tree holds `tests/` and `pyproject.toml` too, so its GPU tests run against its own package from its root
(`cd <work>/<name> && python -m pytest -m gpu tests/gpu/...`); run from this checkout, pytest's `pythonpath = ["."]`
would import this checkout's package instead.

On a CPU machine, `--prebuild DIR` builds each patched tree's bf16 tensor-core family into DIR, or with
`--families changed` every family whose source, as the loader reads it, the patches change (all of them where a
`.cuh` changes: its digest heads every source), so the tree's whole `pytest -m gpu` and `dev/gpu_check.sh` run
from CUBINs too (the base tree's families: `lora-cupy check-kernels --prebuild DIR`). The GPU's time is then
not spent in NVRTC: point `LORA_CUPY_PREBUILT` at DIR there (a tree whose sources differ matches none of the
other trees' files, so each tree finds its own).

    python raw_kernels/dev/ab_trees.py --prebuild out/pb raw_kernels/dev/pair_one_slice_run.patch   # CPU
    LORA_CUPY_PREBUILT=$PWD/out/pb python raw_kernels/dev/ab_trees.py --rounds 2 \\
        raw_kernels/dev/pair_one_slice_run.patch raw_kernels/dev/chunk_red_quads.patch \\
        -- --layer 16x8,64x8,64x32,256x32 --core r64
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(\S+)\s+(.*?)\s+warm\s+([\d.]+)\s+flushed\s+([\d.]+)(.*)$")


def make_tree(stack: str, work: Path) -> Path:
    """``work``/<last patch's stem>: this tree's package and kernels with the patches of ``stack``
    (``a.patch+b.patch``: each over the ones before it) applied in turn."""
    patches = [Path(p) for p in stack.split("+")]
    tree = work / patches[-1].stem
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    for part in ("lora_cupy", "raw_kernels", "tests"):  # tests and pyproject: the tree's own tests run from its root
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy2(ROOT / "pyproject.toml", tree / "pyproject.toml")
    for patch in patches:
        cmd = ["git", "apply", str(patch.resolve())] if shutil.which("git") else ["patch", "-p1", "-i", str(patch.resolve())]
        r = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"ab_trees: {patch} does not apply to this tree:\n{r.stderr}")
    return tree


def run_rows(tag: str, tree: Path, args: list[str]) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(tree / "raw_kernels/dev/layer_rows.py"), "--tag", tag, *args]
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode:
        print(f"ab_trees: {tag} exited {r.returncode}:\n{r.stderr[-3000:]}", flush=True)
    return r.stdout.splitlines()


# a tree's prebuilt-CUBIN stem for sm_90a of each family, as Python run in that tree (k: lora_cupy.kernels)
STEMS = "{f: k.prebuilt_stem(f, 'sm_90a', k.read_source(v.file)) for f, v in k.FAMILIES.items()}"


def base_stems() -> list[str]:
    """This tree's prebuilt-CUBIN stems for sm_90a, one a family (what a patched tree's families are
    compared with)."""
    code = f"import lora_cupy.kernels as k; print(' '.join({STEMS}.values()))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, check=True)
    return r.stdout.split()


def table(lines: list[str], tags: list[str]) -> str:
    cells: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for line in lines:
        m = LINE.match(line)
        if m:
            tag, row, w, f, _ = m.groups()
            cells.setdefault(row, {}).setdefault(tag, []).append((float(w), float(f)))

    def span(v: list[float]) -> str:
        lo, hi = min(v), max(v)
        return f"{lo:.1f}" if hi - lo < 0.05 else f"{lo:.1f}-{hi:.1f}"

    out = ["| row | " + " | ".join(tags) + " |", "|---|" + "---|" * len(tags)]
    for row, by in cells.items():
        txt = [f"{span([w for w, _ in by[t]])} ({span([f for _, f in by[t]])})" if t in by else "-" for t in tags]
        out.append(f"| {row} | " + " | ".join(txt) + " |")
    bad = [line for line in lines if "ok False" in line or "refused" in line]
    return "\n".join(out + (["", "not ok or refused:", *bad] if bad else []))


def main() -> None:
    argv = sys.argv[1:]
    rows_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("patches", nargs="+", help="patches, or stacks of them: a.patch+b.patch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "lora-cupy-ab")
    ap.add_argument("--prebuild", type=Path, help="CPU: build each patched tree's bf16 family's CUBIN here, and stop")
    ap.add_argument("--families", choices=("bf16", "changed"), default="bf16",
                    help="with --prebuild: the bf16 tensor-core family only, or every family the patches change")
    args = ap.parse_args(argv)
    trees = {t.name: t for t in (make_tree(p, args.work) for p in args.patches)}  # named for each stack's last patch
    if args.prebuild:
        out = args.prebuild.resolve()
        base = base_stems() if args.families == "changed" else []  # this tree's, once for every patched tree
        for tag, tree in trees.items():
            code = ("import lora_cupy.kernels as k; "
                    f"print(k.prebuild({str(out)!r}, 'sm_90a', [k.mma_family('bfloat16')]))")
            if args.families == "changed":
                code = ("import lora_cupy.kernels as k\n"
                        f"base = {base!r}\n"
                        f"fams = [f for f, stem in {STEMS}.items() if stem not in base]\n"
                        "k.compile_ahead([(f, 'sm_90a') for f in fams], jobs=2)\n"
                        f"print(fams, k.prebuild({str(out)!r}, 'sm_90a', fams))")
            r = subprocess.run([sys.executable, "-c", code], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                               capture_output=True, text=True)
            print(f"{tag}: {r.stdout.strip() or r.stderr[-2000:]}", flush=True)
        return
    order = {"base": ROOT, **trees}
    lines = []
    for rnd in range(args.rounds):
        for tag, tree in order.items():
            got = run_rows(tag, tree, rows_args)
            print(f"round {rnd + 1}, {tag}: {len(got)} lines", *got, sep="\n", flush=True)  # kept if cut short
            lines += got
    print("\nwarm (flushed) us, each round:\n" + table(lines, list(order)))


if __name__ == "__main__":
    main()
