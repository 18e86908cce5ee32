"""The second kernel issue's goals 1-4 scored on a saved bench run (``--json`` of
``python -m lora_cupy.bench.kernels``), no GPU: each of the issue's 48 rows against vLLM's Triton
figure of the issue's table (goal 1, 5% allowance), the rows from T=256 against torch bmm of the
same run (goal 2, 1.15x) and their share of the byte floor from T=1024 (60%), slot counts against
the one-slot twin (goal 3), rank 64 against rank 16 and the rank-128 pool (goal 4). Goal 5 is the
bench's own layer table.

    python raw_kernels/dev/goals.py k.json [--misses-only]
"""

from __future__ import annotations

import argparse
import json

#: vLLM's lora_shrink + lora_expand (Triton, default configs, metadata prepared outside the timed
#: call), us, as the issue's table gives them: row label (bf16) -> us.
VLLM_US = {
    "core T1 4096->4096 r16 s1": 9.9, "core T1 4096->4096 r64 s1": 11.3,
    "core T16 4096->4096 r16 s1": 9.2, "core T16 4096->4096 r16 s8": 11.0,
    "core T16 4096->4096 r64 s1": 10.3, "core T16 4096->4096 r64 s8": 17.0,
    "core T64 4096->4096 r16 s1": 9.6, "core T64 4096->4096 r16 s8": 11.7,
    "core T64 4096->4096 r16 s32": 24.2, "core T64 4096->4096 r64 s1": 11.6,
    "core T64 4096->4096 r64 s8": 18.2, "core T64 4096->4096 r64 s32": 50.9,
    "core T256 4096->4096 r16 s1": 19.7, "core T256 4096->4096 r16 s8": 21.8,
    "core T256 4096->4096 r16 s32": 30.7, "core T256 4096->4096 r64 s1": 20.3,
    "core T256 4096->4096 r64 s8": 23.6, "core T256 4096->4096 r64 s32": 38.7,
    "core T1024 4096->4096 r16 s1": 25.2, "core T1024 4096->4096 r16 s8": 28.7,
    "core T1024 4096->4096 r16 s32": 47.0, "core T1024 4096->4096 r64 s1": 25.3,
    "core T1024 4096->4096 r64 s8": 33.1, "core T1024 4096->4096 r64 s32": 60.1,
    "core T4096 4096->4096 r16 s1": 48.7, "core T4096 4096->4096 r16 s8": 63.0,
    "core T4096 4096->4096 r16 s32": 119.0, "core T4096 4096->4096 r64 s1": 72.2,
    "core T4096 4096->4096 r64 s8": 87.8, "core T4096 4096->4096 r64 s32": 160.3,
    "shapes T1 4096->14336 r16 s1": 9.8, "shapes T1 4096->14336 r64 s1": 13.6,
    "shapes T1 14336->4096 r16 s1": 10.0, "shapes T1 14336->4096 r64 s1": 11.8,
    "shapes T1 4096->6144/3 r16 s1": 14.9, "shapes T1 4096->6144/3 r64 s1": 22.7,
    "shapes T64 4096->14336 r16 s8": 18.0, "shapes T64 4096->14336 r64 s8": 25.1,
    "shapes T64 14336->4096 r16 s8": 12.8, "shapes T64 14336->4096 r64 s8": 22.7,
    "shapes T64 4096->6144/3 r16 s8": 40.5, "shapes T64 4096->6144/3 r64 s8": 83.9,
    "shapes T1024 4096->14336 r16 s8": 49.6, "shapes T1024 4096->14336 r64 s8": 52.6,
    "shapes T1024 14336->4096 r16 s8": 61.3, "shapes T1024 14336->4096 r64 s8": 66.3,
    "shapes T1024 4096->6144/3 r16 s8": 87.5, "shapes T1024 4096->6144/3 r64 s8": 99.2,
}
NOISE, BMM_BAR, FLOOR_SHARE = 1.05, 1.15, 0.60


def score(run: dict) -> dict:
    """Goals 1-4 of a saved run: per goal the rows checked, those met and the misses with figures."""
    by = {r["label"].removesuffix(" bf16"): r for r in run["rows"] if r["label"].endswith(" bf16")}
    missing = sorted(set(VLLM_US) - set(by))
    g1 = [(k, by[k]["us"], v) for k, v in VLLM_US.items() if k in by]
    g2 = []
    for k in VLLM_US:
        r = by.get(k)
        if r is None or r["row"]["T"] < 256:
            continue
        bmm = r["baselines"].get("bmm")
        share = r["share_of_floor"] if r["row"]["T"] >= 1024 else None
        g2.append((k, r["us"], bmm, share))
    g3 = []
    for k in VLLM_US:
        for s, bar in (("s8", 1.3), ("s32", 1.5)):
            if k.endswith(" " + s) and k.startswith("core") and k.replace(" " + s, " s1") in by and k in by:
                g3.append((k, by[k]["us"] / by[k.replace(" " + s, " s1")]["us"], bar))
    g4 = []
    for k in VLLM_US:
        if k.startswith("core") and " r64 " in k and by.get(k) and int(k.split()[1][1:]) >= 1024:
            twin = k.replace(" r64 ", " r16 ")
            if twin in by:
                g4.append((k, by[k]["us"] / by[twin]["us"], 1.3))
    for r in run["rows"]:  # the bench's own ratio of a rank-128 pool to its rank-16 twin
        if "vs_pool16" in r:
            g4.append((r["label"], r["vs_pool16"], 1.2))
    return {"missing": missing, "g1": g1, "g2": g2, "g3": g3, "g4": g4}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", help="a bench run's --json file")
    ap.add_argument("--misses-only", action="store_true")
    args = ap.parse_args()
    s = score(json.load(open(args.run)))
    if s["missing"]:
        print(f"rows not in this run: {', '.join(s['missing'])}")
    met1 = [(k, us, v) for k, us, v in s["g1"] if us <= NOISE * v]
    print(f"goal 1 (at most {NOISE}x vLLM): {len(met1)} of {len(s['g1'])}")
    for k, us, v in s["g1"]:
        ok = us <= NOISE * v
        if not (ok and args.misses_only):
            print(f"  {'   ' if ok else 'MISS'} {k:34s} {us:6.1f} us  vLLM {v:6.1f}  ({us / v:.2f}x)")
    bmm_ok = [x for x in s["g2"] if x[2] and x[1] <= BMM_BAR * x[2]]
    shares = [x[3] for x in s["g2"] if x[3] is not None]
    floor_ok = [x for x in shares if x >= FLOOR_SHARE]
    print(f"goal 2: {len(bmm_ok)} of {len(s['g2'])} rows from T=256 within {BMM_BAR}x bmm; "
          f"{len(floor_ok)} of {len(shares)} from T=1024 at {FLOOR_SHARE:.0%} of the byte floor or more "
          f"(shares {min(shares, default=0):.2%}-{max(shares, default=0):.2%})")
    for k, us, bmm, share in s["g2"]:
        ok = bmm and us <= BMM_BAR * bmm and (share is None or share >= FLOOR_SHARE)
        if not (ok and args.misses_only):
            sh = f"  floor {share:.2%}" if share is not None else ""
            vs = f"bmm {bmm:6.1f}  ({us / bmm:.2f}x)" if bmm else "bmm not timed"
            print(f"  {'   ' if ok else 'MISS'} {k:34s} {us:6.1f} us  {vs}{sh}")
    for name, rows in (("goal 3 (slots against one)", s["g3"]), ("goal 4 (rank)", s["g4"])):
        met = [x for x in rows if x[1] <= x[2]]
        print(f"{name}: {len(met)} of {len(rows)}")
        for k, ratio, bar in rows:
            if not (ratio <= bar and args.misses_only):
                print(f"  {'   ' if ratio <= bar else 'MISS'} {k:38s} {ratio:.2f}x  (bar {bar}x)")


if __name__ == "__main__":
    main()
