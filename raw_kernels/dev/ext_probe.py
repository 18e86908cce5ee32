"""Probe (outside the package): the decode delta with its shrink inside the base GEMM.

The first linear of each target gets its weight extended by the pool's A rows of every slot
(``[out + S*n*R, in]``, the layer's A bound there: ``pool.bind_a``), so one cuBLAS GEMM writes y
and v (x . A of every slot) side by side, and only the expand is left: ``lora_expand_v``
(expand_v.cu, through ``LoraLayerDelta.expand_v``). One layer of ``bench e2e``'s Llama-shaped model, bf16, rank 16, a
pool of 33 slots (as the e2e bench has), each way timed as a CUDA graph of 20 calls (median of 50
replays, us a call), warm:

- ``base``: the target's GEMMs (q, k, v separate as the model has them);
- ``ext_gemm``: the same with the first one extended; ``ext``: that plus ``lora_expand_v``;
- ``cur``: base plus the pool's delta into a scratch (what a forked decode step runs, less the add).

Then the layer's four targets in one graph each way. Every expand is first checked against a
float64 reference from x, A and B (v rounded by the GEMM as PEFT's lora_A output is).

    PYTHONPATH=. python raw_kernels/dev/ext_probe.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import cupy as cp
import numpy as np
import torch

from lora_cupy.bench import wait_host_copies
from lora_cupy.bench.e2e import MODEL, build_model, write_adapters
from lora_cupy.bench.overlap import graph_us
from lora_cupy.engine import LoraStep, ResourceReqConfig, StepContext
from lora_cupy.integrations.hf import spec_for_adapters
from lora_cupy.pool import LoraAdapterPool

HERE = Path(__file__).resolve().parent
TG = 8
CASES = ((1, 1), (64, 8), (64, 32))
MEMBERS = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o_proj": ("self_attn", ("o_proj",)),
           "gate_up_proj": ("mlp", ("gate_proj", "up_proj")), "down_proj": ("mlp", ("down_proj",))}


def main() -> int:
    torch.set_grad_enabled(False)
    model = build_model({**MODEL, "num_hidden_layers": 1}, "bfloat16", "cuda").requires_grad_(False)
    layer = model.model.layers[0]
    out_rows = []
    with tempfile.TemporaryDirectory(prefix="lora-cupy-ext-") as tmp:
        adapters = write_adapters(model, Path(tmp), 32, 16)
        names = sorted(adapters)
        spec = spec_for_adapters(model, adapters, num_slots=33)
        with LoraAdapterPool(spec, "cuda:0", adapters={k: str(v) for k, v in adapters.items()}) as pool:
            S = spec.num_slots
            for seq, (T, count) in enumerate(CASES, start=1):
                rids = [f"t{T}-{count}-{i}" for i in range(T)]
                for i, rid in enumerate(rids):
                    pool.ingest_request(rid, ResourceReqConfig(names[i % count]))
                wait_host_copies(pool, names[:count])
                step, ctx = LoraStep(rids, [1] * T, seq=seq), StepContext(seq=seq)
                assert pool.admit(step, ctx).ok
                pool.plan(step, ctx)
                plan = pool.current_plan()
                plan.wait_host()
                x = torch.randn(T, 4096, dtype=torch.bfloat16, device="cuda")
                xd = torch.randn(T, 14336, dtype=torch.bfloat16, device="cuda")
                ways_all = {"base": [], "ext": [], "cur": []}
                for target, (blk, mems) in MEMBERS.items():
                    lw = pool.layer_weights(target, 0)
                    views = plan.launch[spec.target(target).row_grouping]
                    token_order, slot_indptr = views
                    lins = [getattr(getattr(layer, blk), m) for m in mems]
                    xin = xd if target == "down_proj" else x
                    a = _bf16(lw.a)  # [S, n, R, in]
                    bw = _bf16(lw.b)  # [S, out, R]
                    n, R = a.shape[1], a.shape[2]
                    W0 = lins[0].weight
                    ext = torch.cat([W0, a.reshape(S * n * R, -1)]).contiguous()
                    N = ext.shape[0]
                    ext_out = torch.empty(T, N, dtype=torch.bfloat16, device="cuda")
                    ys = [None] + [torch.empty(T, l.weight.shape[0], dtype=torch.bfloat16, device="cuda") for l in lins[1:]]
                    offs = [0]
                    for l in lins:
                        offs.append(offs[-1] + l.weight.shape[0])
                    vptr = ext_out[:, W0.shape[0]:]
                    y0 = torch.empty(T, W0.shape[0], dtype=torch.bfloat16, device="cuda")
                    ranks = cp.asarray(lw.ranks)
                    scal = cp.asarray(lw.scaling)
                    pool.bind_a(target, 0, _pool_view(ext[W0.shape[0]:].view(S, n, R, -1), lw.a))
                    d = pool.layer_delta(target, 0)
                    y_list = [ext_out[:, :W0.shape[0]]] + ys[1:]

                    def gemms(first):
                        torch.mm(xin, first.t(), out=y0 if first is W0 else ext_out)
                        for j, l in enumerate(lins[1:], start=1):
                            torch.mm(xin, l.weight.t(), out=ys[j])

                    def expand():
                        d.expand_v(y_list, vptr)

                    # correctness: y after minus y before against float64
                    gemms(ext)
                    before = [ext_out[:, :W0.shape[0]].double()] + [y.double() for y in ys[1:]]
                    expand()
                    torch.cuda.synchronize()
                    after = [ext_out[:, :W0.shape[0]].double()] + [y.double() for y in ys[1:]]
                    order = torch.as_tensor(token_order, device="cuda").long().cpu().numpy()
                    ind = torch.as_tensor(slot_indptr, device="cuda").long().cpu().numpy()
                    rk = cp.asnumpy(ranks)
                    sc = cp.asnumpy(scal)
                    # v as the GEMM rounded it, then B in float64 (what the kernel computes)
                    vv = ext_out[:, W0.shape[0]:].double().cpu().numpy().reshape(T, S, n, R)
                    B64 = bw.double().cpu().numpy()
                    A64 = a.double().cpu().numpy()
                    X64 = xin.double().cpu().numpy()
                    worst, worst_x = 0.0, 0.0
                    for j in range(n):
                        want = np.zeros((T, offs[j + 1] - offs[j]))
                        want_x = np.zeros_like(want)
                        for s in range(1, S):
                            r = rk[s, j]
                            for p in range(ind[s], ind[s + 1]):
                                t = order[p]
                                want[t] = sc[s, j] * (vv[t, s, j, :r] @ B64[s, offs[j]:offs[j + 1], :r].T)
                                vx = X64[t] @ A64[s, j, :r].T
                                want_x[t] = sc[s, j] * (vx @ B64[s, offs[j]:offs[j + 1], :r].T)
                        got = (after[j] - before[j]).cpu().numpy()
                        scale = max(1e-6, np.abs(want).max())
                        worst = max(worst, np.abs(got - want).max() / scale)
                        worst_x = max(worst_x, np.abs(got - want_x).max() / scale)
                    print(f"T={T} adapters={count} {target}: expand_v rel err {worst:.2e} (vs v from x: "
                          f"{worst_x:.2e})", file=sys.stderr, flush=True)
                    assert worst < 3e-2, worst

                    scratch = torch.zeros(T, offs[-1], dtype=torch.bfloat16, device="cuda")
                    ways = {"base": lambda: gemms(W0), "ext_gemm": lambda: gemms(ext),
                            "ext": lambda: (gemms(ext), expand()), "expand": expand,
                            "cur": lambda: (gemms(W0), d(scratch, xin)), "delta": lambda: d(scratch, xin)}
                    got = {k: round(graph_us(fn), 2) for k, fn in ways.items()}
                    ways_all["base"].append(ways["base"])
                    ways_all["ext"].append(ways["ext"])
                    ways_all["cur"].append(ways["cur"])
                    out_rows.append((T, count, target, got))
                    print(f"T={T} adapters={count} {target}: " + "  ".join(f"{k} {v:.1f}" for k, v in got.items()),
                          file=sys.stderr, flush=True)
                lay = {k: round(graph_us(lambda fs=fs: [f() for f in fs]), 2) for k, fs in ways_all.items()}
                out_rows.append((T, count, "layer", lay))
                print(f"T={T} adapters={count} layer: " + "  ".join(f"{k} {v:.1f}" for k, v in lay.items()),
                      file=sys.stderr, flush=True)
                pool.commit(step, ctx)
                for rid in rids:
                    pool.remove_request(rid)
    cols = ("base", "ext_gemm", "expand", "ext", "delta", "cur")
    print("| T | adapters | target | " + " | ".join(f"{c} us" for c in cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for T, count, target, got in out_rows:
        print(f"| {T} | {count} | {target} | " + " | ".join(f"{got[c]:.1f}" if c in got else "" for c in cols) + " |")
    return 0


def _bf16(arr) -> torch.Tensor:
    """A bfloat16 device array of the pool (CuPy holds it as 2-byte void) as a torch tensor."""
    c = cp.asarray(arr)
    if c.dtype.kind == "V":
        return torch.as_tensor(c.view(cp.uint16), device="cuda").view(torch.bfloat16)
    return torch.as_tensor(c, device="cuda")


def _pool_view(t: torch.Tensor, like):
    """A torch tensor's memory as a CuPy array of the pool's dtype (bfloat16 through its bits)."""
    return cp.asarray(t.view(torch.int16)).view(like.dtype)


if __name__ == "__main__":
    sys.exit(main())
