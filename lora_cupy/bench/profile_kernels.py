"""Profile the tensor-core delta under Nsight Compute: one delta per configuration, then a summary.

    ncu --clock-control none -k regex:lora_ --csv --page raw --metrics ... \\
        python3 lora_cupy/bench/profile_kernels.py [LABEL_TEXT ...] > ncu.csv
    python3 lora_cupy/bench/profile_kernels.py --summarize ncu.csv

Kernels appear in CONFIGS order (only those whose label holds one of the LABEL_TEXTs, when given):
a fused configuration launches one kernel, the others two.
"""

from __future__ import annotations

import csv
import sys

#: Metrics asked for by name; the sections (SpeedOfLight, LaunchStats, Occupancy, WarpStateStats,
#: MemoryWorkloadAnalysis) add the rest, and the summary picks columns by pattern.
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sectors_op_red.sum",
           "l1tex__t_sector_hit_rate.pct", "lts__t_sector_hit_rate.pct", "smsp__inst_executed.sum",
           "lts__t_bytes.sum")
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats", "MemoryWorkloadAnalysis")
SHOW = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sectors_op_red.sum",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed", "sm__warps_active.avg.pct_of_peak_sustained_active",
        "launch__registers_per_thread", "launch__occupancy_limit_registers", "launch__occupancy_limit_shared_mem",
        "launch__grid_size", "l1tex__t_sector_hit_rate.pct", "lts__t_sector_hit_rate.pct", "smsp__inst_executed.sum",
        "lts__t_bytes.sum")


def configs():
    from lora_cupy.bench.kernels import Row

    core = lambda T, r, s: Row("core", T, 4096, (4096,), (r,) * s, r)  # noqa: E731
    return [
        ("T4096 r16 s32", core(4096, 16, 32), {}),
        ("T4096 r64 s32", core(4096, 64, 32), {}),
        ("T1024 r16 s32", core(1024, 16, 32), {}),
        ("T256 r16 s32", core(256, 16, 32), {}),
        ("T256 r16 s32 expand", core(256, 16, 32), dict(expand="expand")),
        ("T16 r16 s8 fused chunks", core(16, 16, 8), {}),
        ("T16 r16 s8 fused tiles", core(16, 16, 8), dict(chunks=False)),
        ("T64 r16 s32 fused", core(64, 16, 32), dict(fused=True)),
        ("T64 r16 s32 two", core(64, 16, 32), dict(fused=False)),
        ("T64 r16 s32 two tiles", core(64, 16, 32), dict(fused=False, chunks=False)),
        ("T1 r16 fused", core(1, 16, 1), dict(fused=True)),
        ("T1 r16 two", core(1, 16, 1), dict(fused=False)),
        ("T16 r16 s1", core(16, 16, 1), {}),
        ("T1024 r64 s1", core(1024, 64, 1), {}),
        ("T256 r64 s1", core(256, 64, 1), {}),
        ("T64 r64 s32", core(64, 64, 32), {}),
        ("T1024 r16 s1", core(1024, 16, 1), {}),
        # the layer's gate_up (Llama-8B, 4096 -> 14336 / 14336) at 64 tokens over 32 adapters
        ("T64 gate_up r16 s32", Row("layer", 64, 4096, (14336, 14336), (16,) * 32, 16), {}),
        # lora_one (one position): the layer's o, down and q/k/v at rank 16, o at rank 64 (forced)
        ("T1 o r16 one", core(1, 16, 1), {}),
        ("T1 down r16 one", Row("shapes", 1, 14336, (4096,), (16,), 16), {}),
        ("T1 qkv r16 one", Row("shapes", 1, 4096, (4096, 1024, 1024), (16,), 16), {}),
        ("T1 o r64 one", core(1, 64, 1), dict(expand="one")),
    ]


def run(only: list[str]) -> None:
    import torch

    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.backends.cupy import CupyBackend
    from lora_cupy.bench.kernels import build
    from lora_cupy.spec import pool_layout_b

    for label, row, kw in configs():
        if only and not any(o in label for o in only):
            continue
        d = build(row, 0)
        w = LayerWeights(d.a, pool_layout_b(d.b, d.spec), d.scaling, d.ranks, d.offsets)
        be = CupyBackend(d.spec, **kw)
        plan = be.plan(d.token_order.shape[0], w, row.dtype)
        torch.cuda.synchronize()
        be.delta(d.y, d.x, w, d.token_order, d.slot_indptr)
        torch.cuda.synchronize()
        print(f"# {label}: {plan}", file=sys.stderr)


def summarize(path: str) -> None:
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    rows = [r for r in csv.DictReader(lines) if "lora_" in r.get("Kernel Name", "")]
    for r in rows:
        out = [r["Kernel Name"].split("(")[0]]
        for m in SHOW:
            v = r.get(m, "?")
            try:
                x = float(v.replace(",", ""))
                v = f"{x / 1e3:.1f}us" if m.startswith("gpu__time") else f"{x / 1e6:.1f}MB" if "bytes" in m else f"{x:.3g}"
            except ValueError:
                pass
            out.append(f"{m.split('__')[1].split('.')[0]}={v}")
        stalls = []
        for k, v in r.items():
            if "issue_stalled" in k and k.endswith(".ratio") and "not_issued" not in k:
                try:
                    stalls.append((float(v.replace(",", "")), k.split("stalled_")[1].split("_per")[0]))
                except ValueError:
                    pass
        out.append("stalls: " + ", ".join(f"{n} {x:.2g}" for x, n in sorted(stalls, reverse=True)[:5]))
        print(" ".join(out))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--summarize":
        summarize(sys.argv[2])
    else:
        run(sys.argv[1:])
