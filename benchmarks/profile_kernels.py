"""Profile the tensor-core delta under Nsight Compute: one delta per configuration, then a summary.

    ncu --clock-control none -k regex:lora_ --csv --page raw --metrics ... \\
        python3 benchmarks/profile_kernels.py > ncu.csv
    python3 benchmarks/profile_kernels.py --summarize ncu.csv

Kernels appear in CONFIGS order: a fused configuration launches one kernel, the others two.
"""

from __future__ import annotations

import csv
import sys

METRICS = (
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sectors_op_red.sum",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
    "launch__occupancy_limit_registers",
    "launch__occupancy_limit_shared_mem",
    "launch__grid_size",
    "smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio",
    "smsp__average_warp_latency_issue_stalled_barrier.ratio",
    "smsp__average_warp_latency_issue_stalled_lg_throttle.ratio",
    "smsp__average_warp_latency_issue_stalled_membar.ratio",
    "smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio",
    "smsp__average_warp_latency_issue_stalled_wait.ratio",
)


def configs():
    from lora_cupy.bench.kernels import Row

    core = lambda T, r, s: Row("core", T, 4096, (4096,), (r,) * s, r)  # noqa: E731
    return [
        ("T4096 r16 s32", core(4096, 16, 32), {}),
        ("T4096 r64 s32", core(4096, 64, 32), {}),
        ("T1024 r16 s32", core(1024, 16, 32), {}),
        ("T256 r16 s32", core(256, 16, 32), {}),
        ("T64 r16 s32 fused", core(64, 16, 32), dict(fused=True)),
        ("T64 r16 s32 two", core(64, 16, 32), dict(fused=False)),
        ("T1 r16 fused", core(1, 16, 1), dict(fused=True)),
        ("T1 r16 two", core(1, 16, 1), dict(fused=False)),
    ]


def run() -> None:
    import torch

    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.backends.cupy import CupyBackend
    from lora_cupy.bench.kernels import build

    for label, row, kw in configs():
        d = build(row, 0)
        w = LayerWeights(d.a, d.b, d.scaling, d.ranks, d.offsets)
        be = CupyBackend(d.spec, **kw)
        plan = be.plan(d.token_order.shape[0], w, row.dtype)
        torch.cuda.synchronize()
        be.delta(d.y, d.x, w, d.token_order, d.slot_indptr)
        torch.cuda.synchronize()
        print(f"# {label}: {plan}", file=sys.stderr)


def summarize(path: str) -> None:
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    rows = list(csv.DictReader(lines))
    rows = [r for r in rows if r.get("Kernel Name", "").startswith("lora_") or "lora_" in r.get("Kernel Name", "")]
    short = {m: m.split("__", 1)[1].replace("average_warp_latency_issue_stalled_", "stall_")
             .replace(".ratio", "").replace(".avg.pct_of_peak_sustained_elapsed", "%")
             .replace(".avg.pct_of_peak_sustained_active", "%").replace(".sum", "") for m in METRICS}
    for r in rows:
        name = r["Kernel Name"].split("(")[0]
        vals = []
        for m in METRICS:
            v = r.get(m, "")
            try:
                x = float(v.replace(",", ""))
                v = f"{x / 1e3:.1f}us" if m == "gpu__time_duration.sum" else (
                    f"{x / 1e6:.1f}MB" if "bytes" in m else f"{x:.3g}")
            except ValueError:
                pass
            vals.append(f"{short[m]}={v}")
        print(name, " ".join(vals))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--summarize":
        summarize(sys.argv[2])
    else:
        run()
