"""``lora-cupy demo``: many requests on many adapters served through one pool, step by step.

Adapters are written in PEFT's ``save_pretrained`` format (random weights, mixed ranks and
alphas, one with rslora), loaded at run time, and requests on them (and on the base model)
arrive faster than the pool has slots, so some wait at admission and slots are evicted and
reused. Every step runs the delta of every target at every layer and checks it against a
dense float64 ``scaling * B @ A`` per adapter, made from its files apart from the pool.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from .dtypes import numpy_dtype
from .spec import PEFT_MODULES, LoraSlice, LoraSpec, LoraTarget

HIDDEN, INTER, Q, KV = 256, 512, 256, 128


def demo_spec(num_slots: int, num_layers: int, dtype: str) -> LoraSpec:
    """A small Llama-style stack: fused qkv and gate_up targets, o_proj and down_proj."""
    targets = (
        LoraTarget("qkv_proj", HIDDEN, Q + 2 * KV, num_layers,
                   (LoraSlice("q_proj", Q), LoraSlice("k_proj", KV), LoraSlice("v_proj", KV))),
        LoraTarget("o_proj", Q, HIDDEN, num_layers),
        LoraTarget("gate_up_proj", HIDDEN, 2 * INTER, num_layers,
                   (LoraSlice("gate_proj", INTER), LoraSlice("up_proj", INTER))),
        LoraTarget("down_proj", INTER, HIDDEN, num_layers),
    )
    return LoraSpec(targets, num_slots=num_slots, max_rank=32, dtype=dtype, capture_buckets=(16, 64, 256, 1024))


def write_adapter(path: Path, spec: LoraSpec, rng: np.random.Generator, r: int, alpha: float,
                  modules: list[str], use_rslora: bool = False) -> None:
    """A PEFT-format adapter directory with random A and B for ``modules`` at every layer."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module in modules:
        target, j = spec.module_target(module)
        in_f, out_f = target.in_features, target.slices[j].out_features
        for layer in range(target.num_layers):
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((r, in_f)) / np.sqrt(in_f)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out_f, r)) / np.sqrt(r)).astype(np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": modules,
              "use_rslora": use_rslora, "bias": "none", "task_type": "CAUSAL_LM"}
    (path / "adapter_config.json").write_text(json.dumps(config))


class DenseOracle:
    """Each adapter's dense ``scaling * B @ A`` per target, layer and slice, in float64, from its files."""

    def __init__(self, spec: LoraSpec):
        self.spec = spec
        self.dense: dict[str, dict[tuple[str, int], np.ndarray]] = {}

    def add(self, name: str, path: Path) -> None:
        from .peft import read_peft_adapter

        w = read_peft_adapter(path, self.spec, name)
        mats = {}
        for tname, tw in w.targets.items():
            t = self.spec.target(tname)
            offs = t.out_offsets(self.spec.tp_size)
            for layer in range(t.num_layers):
                m = np.zeros((offs[-1], t.local_in_features(self.spec.tp_size)))
                for j in range(t.num_slices):
                    r = int(tw.ranks[layer, j])
                    m[offs[j]:offs[j + 1]] = float(tw.scaling[layer, j]) * (
                        tw.b[layer, offs[j]:offs[j + 1], :r].astype(np.float64) @ tw.a[layer, j, :r].astype(np.float64))
                mats[(tname, layer)] = m
        self.dense[name] = mats

    def delta(self, target: str, layer: int, x: np.ndarray, row_adapters: list[str | None]) -> np.ndarray:
        out = self.spec.target(target).local_out_features(self.spec.tp_size)
        d = np.zeros((x.shape[0], out))
        for t, name in enumerate(row_adapters):
            if name is not None and (target, layer) in self.dense[name]:
                d[t] = x[t].astype(np.float64) @ self.dense[name][(target, layer)].T
        return d


def to_device(device, a: np.ndarray):
    """A copy of ``a`` on the pool's device, once the copy has landed."""
    if not device.is_cuda:
        return a.copy()
    d = device.zeros(a.shape, a.dtype)
    device.copy_to_device(d, np.ascontiguousarray(a))
    device.synchronize()
    return d


def pick_device(choice: str) -> str:
    if choice != "auto":
        return choice
    try:
        import cupy

        return "cuda:0" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:
        return "cpu"


def run(args) -> dict:
    """Write the adapters, serve the requests, and return the summary; the pool and the
    temporary adapter folder are closed whatever happens."""
    from .pool import LoraAdapterPool

    device = pick_device(args.device)
    spec = demo_spec(args.slots + 1, args.layers, "float32" if device == "cpu" else "bfloat16")
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="lora-cupy-demo-")
    workdir = Path(tmp.name if tmp else tempfile.mkdtemp(prefix="lora-cupy-demo-"))
    pool = LoraAdapterPool(spec, device)
    try:
        return serve(args, pool, workdir)
    finally:
        pool.close()
        if tmp is not None:
            tmp.cleanup()


def serve(args, pool, workdir: Path) -> dict:
    from tqdm import tqdm

    from .delta import LoraLayerDelta
    from .engine.admission import AdmissionQueue
    from .engine.resource import LoraStep, ResourceReqConfig, StepContext

    spec, device, dtype = pool.spec, pool.device.name, pool.spec.dtype
    rng = np.random.default_rng(args.seed)
    all_modules = list(PEFT_MODULES)
    oracle = DenseOracle(spec)
    names = []
    for k in range(args.adapters):
        name = f"adapter{k}"
        r = int(rng.choice([4, 8, 16, 32]))
        modules = all_modules if k % 3 == 0 else list(rng.choice(all_modules, size=3, replace=False))
        write_adapter(workdir / name, spec, rng, r, alpha=float(2 * r if k % 2 else r), modules=modules,
                      use_rslora=(k == 1))
        pool.load_adapter_async(name, workdir / name).result()
        oracle.add(name, workdir / name)
        names.append(name)
    print(f"device {device} ({dtype}); {len(names)} adapters in {args.slots} slots; "
          f"{spec.device_bytes() / 2**20:.1f} MiB of slot weights"
          + (f"; adapter files kept in {workdir}" if args.keep else ""))

    popularity = 1.0 / np.arange(1, len(names) + 1) ** 1.2
    popularity /= popularity.sum()
    queue = AdmissionQueue([pool])
    adapter_of: dict[str, str | None] = {}
    left: dict[str, int] = {}  # rid -> decode steps left
    new: set[str] = set()
    running: list[str] = []
    deltas = {(t.name, layer): LoraLayerDelta(pool, t.name, layer)
              for t in spec.targets for layer in range(t.num_layers)}
    worst, waited_steps, served = 0.0, 0, 0
    started = time.perf_counter()
    arrivals = iter(range(args.requests))
    bar = tqdm(total=args.steps, desc="steps", unit="step", disable=args.quiet)
    step_no, idle_since = 0, None
    while step_no < args.steps:
        if idle_since is None or not len(queue):  # arrivals come per step, not per wait on a read
            for _ in range(int(rng.poisson(args.arrivals))):
                k = next(arrivals, None)
                if k is None:
                    break
                rid = f"req{k}"
                adapter_of[rid] = None if rng.random() < 0.2 else str(rng.choice(names, p=popularity))
                pool.ingest_request(rid, ResourceReqConfig(adapter_of[rid]))
                queue.submit(rid, spec.node)
        for g in queue.pump():
            running.append(g.rid)
            new.add(g.rid)
            left[g.rid] = int(rng.integers(2, 6))
        if not running:
            # Nothing to run: the queue's head waits for its adapter's host copy (read on the
            # pool's reader thread), or no request has arrived. An engine would block here.
            if not len(queue) and len(adapter_of) >= args.requests:
                break
            idle_since = idle_since or time.perf_counter()
            if time.perf_counter() - idle_since > 30:
                raise RuntimeError(f"no request could be admitted for 30 s: {queue.waiting[:3]}")
            time.sleep(0.001)
            continue
        idle_since = None
        waited_steps += len(queue)
        step_no += 1
        bar.update()
        tokens = [int(rng.integers(3, 9)) if rid in new else 1 for rid in running]
        step = LoraStep(running, tokens, node=spec.node, seq=step_no)
        ctx = StepContext(seq=step_no)
        outcome = pool.admit(step, ctx)
        if not outcome.ok:
            raise RuntimeError(f"step {step_no}: admit refused rows {dict(outcome.failed)}")
        pool.plan(step, ctx)
        row_adapters = [adapter_of[rid] for rid, n in zip(running, tokens) for _ in range(n)]
        for (target, layer), delta in deltas.items():
            t = spec.target(target)
            x = rng.standard_normal((len(row_adapters), t.in_features)).astype(numpy_dtype(dtype))
            y0 = rng.standard_normal((len(row_adapters), t.out_features)).astype(numpy_dtype(dtype))
            y = to_device(pool.device, y0)
            delta(y, to_device(pool.device, x))
            got = pool.device.to_host(y).astype(np.float64) - y0.astype(np.float64)
            want = oracle.delta(target, layer, x, row_adapters)
            worst = max(worst, float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)))
        pool.commit(step, ctx)
        new.clear()
        for rid in list(running):
            left[rid] -= 1
            if left[rid] == 0:
                running.remove(rid)
                pool.remove_request(rid)
                queue.cancel(rid)
                served += 1
        bar.set_postfix(running=len(running), waiting=len(queue), err=f"{worst:.1e}")
    bar.close()
    pool.check_valid()
    summary = {
        "device": device, "dtype": dtype, "steps": step_no, "requests_served": served,
        "requests_admitted": len(adapter_of), "slot_loads": int(pool.stats["loads"]),
        "admission_wait_request_steps": waited_steps, "worst_relative_error": worst,
        "seconds": round(time.perf_counter() - started, 2),
    }
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lora-cupy demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda:0 when there is a GPU, else cpu), cpu, cuda:N")
    p.add_argument("--adapters", type=int, default=8, help="adapters written and served (default 8)")
    p.add_argument("--slots", type=int, default=4, help="adapter slots, slot 0 aside (default 4)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--arrivals", type=float, default=2.0, help="mean new requests per step")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--keep", action="store_true", help="keep the adapter files written (a temporary folder)")
    args = p.parse_args(argv)
    for what in ("adapters", "slots", "layers", "steps"):
        if getattr(args, what) < 1:
            p.error(f"--{what} must be at least 1")
    summary = run(args)
    width = max(len(k) for k in summary)
    for k, v in summary.items():
        print(f"{k:<{width}}  {v:.2e}" if isinstance(v, float) and k.startswith("worst") else f"{k:<{width}}  {v}")
    ok = summary["worst_relative_error"] < (1e-5 if summary["dtype"] == "float32" else 2e-2)
    print("every step's delta matches the float64 computation from the adapter files" if ok
          else "MISMATCH against the float64 computation")
    return 0 if ok else 1
