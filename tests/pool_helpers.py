"""Helpers for the pool's tests: small specs, adapters on disk, controllable readers, steps.

Import as ``from tests.pool_helpers import ...``. Adapter directories come from
``tests.peft_helpers.write_random_adapter`` (PEFT layout, random weights); the pool reads them
with ``lora_cupy.peft.read_peft_adapter`` unless a test injects one of the readers here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from lora_cupy.adapter import AdapterWeights, TargetWeights
from lora_cupy.backends.reference import dense_delta64
from lora_cupy.dtypes import numpy_dtype
from lora_cupy.engine.resource import LoraStep, ResourceReqConfig, StepContext
from lora_cupy.peft import read_peft_adapter
from lora_cupy.spec import LoraSlice, LoraSpec, LoraTarget
from lora_cupy.store import READING
from tests.peft_helpers import write_random_adapter


def small_spec(num_slots: int = 4, max_rank: int = 8, dtype: str = "float32", num_layers: int = 2,
               buckets=(4, 16, 64), node: str = "llm", row_grouping: int = 1) -> LoraSpec:
    """A fused qkv target (three slices) and an o_proj, tiny features, a few layers."""
    return LoraSpec(
        (LoraTarget("qkv_proj", 32, 48, num_layers,
                    (LoraSlice("q_proj", 32), LoraSlice("k_proj", 8), LoraSlice("v_proj", 8))),
         LoraTarget("o_proj", 32, 32, num_layers, row_grouping=row_grouping)),
        num_slots=num_slots, max_rank=max_rank, dtype=dtype, capture_buckets=buckets, node=node)


def make_adapters(root, spec: LoraSpec, n: int, seed: int = 0, prefix: str = "ad",
                  ranks: Sequence[int] | None = None) -> dict[str, str]:
    """``n`` adapter directories under ``root`` with random weights and varied ranks; name -> path.
    Every third adapter covers only ``q_proj`` and ``o_proj`` (others: every module)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        r = int(ranks[i]) if ranks is not None else int(rng.integers(1, spec.max_rank + 1))
        modules = ("q_proj", "o_proj") if i % 3 == 2 else None
        name = f"{prefix}{i}"
        out[name] = str(write_random_adapter(Path(root) / name, spec, r=r, lora_alpha=float(rng.uniform(1, 16)),
                                             seed=int(rng.integers(1 << 30)), modules=modules))
    return out


class GatedReader:
    """A reader that records the thread of every call and, for gated names, waits until the
    test opens the gate; ``fail`` names raise the given error instead of reading."""

    def __init__(self, inner=read_peft_adapter, gated: Sequence[str] = (), fail: Mapping[str, Exception] | None = None,
                 delay: float = 0.0):
        self.inner = inner
        self.gates = {name: threading.Event() for name in gated}
        self.fail = dict(fail or {})
        self.delay = delay
        self.calls: list[tuple[str, str]] = []  # (adapter, thread name)
        self.started = threading.Condition()

    def open(self, name: str) -> None:
        self.gates[name].set()

    def close(self, name: str) -> None:
        """Hold the next reads of ``name`` until :meth:`open`."""
        self.gates[name] = threading.Event()

    def wait_started(self, name: str, count: int = 1, timeout: float = 5.0) -> None:
        """Block until ``name`` has been read ``count`` times (its read has begun)."""
        with self.started:
            ok = self.started.wait_for(lambda: sum(1 for n, _ in self.calls if n == name) >= count, timeout)
        assert ok, f"read of {name!r} never started"

    def __call__(self, path, spec, name=None):
        with self.started:
            self.calls.append((name, threading.current_thread().name))
            self.started.notify_all()
        gate = self.gates.get(name)
        if gate is not None:
            assert gate.wait(10), f"gate for {name!r} never opened"
        if self.delay:
            time.sleep(self.delay)
        if name in self.fail:
            raise self.fail[name]
        return self.inner(path, spec, name=name)


class SyntheticReader:
    """Adapters with no files: ``touches[name]`` lists the target names each has weights for;
    weights are random (seeded by name), ranks ``rank[name]`` (default: the spec's maximum)."""

    def __init__(self, touches: Mapping[str, Sequence[str]], rank: Mapping[str, int] | None = None, seed: int = 0):
        self.touches = {k: tuple(v) for k, v in touches.items()}
        self.rank = dict(rank or {})
        self.seed = seed

    def __call__(self, path, spec: LoraSpec, name=None) -> AdapterWeights:
        if name not in self.touches:
            raise FileNotFoundError(f"no adapter {name!r} at {path}")
        rng = np.random.default_rng([self.seed, sum(map(ord, name)), len(name)])
        dt = numpy_dtype(spec.dtype)
        targets = {}
        for tname in self.touches[name]:
            if tname not in spec.target_names:
                continue
            t = spec.target(tname)
            r = self.rank.get(name, spec.max_rank)
            L, n, inl, outl = t.num_layers, t.num_slices, t.local_in_features(spec.tp_size), \
                t.local_out_features(spec.tp_size)
            targets[tname] = TargetWeights(
                a=(rng.standard_normal((L, n, r, inl)) / np.sqrt(inl)).astype(dt),
                b=(rng.standard_normal((L, outl, r)) / np.sqrt(r)).astype(dt),
                ranks=np.full((L, n), r, np.int32),
                scaling=rng.uniform(0.5, 2.0, (L, n)).astype(np.float32))
        return AdapterWeights(name, str(path), f"synthetic-{name}", targets)


def ingest(pool, rid, adapter: str | None) -> None:
    pool.ingest_request(rid, ResourceReqConfig(adapter))


def wait_reads(pool, names, timeout: float = 10.0) -> None:
    """Wait (the test's thread, no lock held) until the host copies of ``names`` are read."""
    from lora_cupy.bench import wait_host_copies

    wait_host_copies(pool, names, timeout)


def reserve_all(pool, rids, node: str | None = None) -> dict:
    """ask + reserve each rid on the pool's node; rid -> reserve's answer (or the failing outcome)."""
    node = node or pool.spec.node
    out = {}
    for rid in rids:
        o = pool.ask(rid, node, (node,))
        if o is not None and o.failed:
            out[rid] = o
            continue
        out[rid] = pool.reserve(rid, node, (node,), False) if o is not None else None
    return out


def planned_step(pool, rows: list[tuple[str, str | None]], q: int, seq: int = 1):
    """Ingest, admit and plan one step of ``rows`` (rid, adapter), ``q`` tokens each."""
    for rid, adapter in rows:
        pool.ingest_request(rid, ResourceReqConfig(adapter))
    step, ctx = LoraStep([r for r, _ in rows], [q] * len(rows), seq=seq), StepContext(seq=seq)
    assert pool.admit(step, ctx).ok
    pool.plan(step, ctx)
    return step, ctx


def run_step(pool, rids, num_tokens=None, seq: int = 0):
    """admit, plan and commit one step; returns (admit outcome, plan addressing, ctx)."""
    step = LoraStep(rids, num_tokens, node=pool.spec.node, seq=seq)
    ctx = StepContext(seq=seq)
    out = pool.admit(step, ctx)
    if out.failed:
        pool.rollback_admit(step, ctx)
        return out, None, ctx
    addr = pool.plan(step, ctx)
    pool.commit(step, ctx)
    return out, addr, ctx


def step_alone(pool, rid, name: str, tokens: int, seq: int) -> int:
    """Request ``rid`` on adapter ``name`` opened, read, reserved and run alone for one step of
    ``tokens`` tokens; returns the slot it holds."""
    ingest(pool, rid, name)
    wait_reads(pool, [name])
    reserve_all(pool, [rid])
    out, _, _ = run_step(pool, [rid], [tokens], seq=seq)
    assert out.ok
    return pool.snapshot().holders[rid]


def expected_image(pool, name: str):
    """What slot weights an adapter should have: its file read again and padded."""
    info = pool.adapter_info(name)
    w = pool.store.reader(info.path, pool.spec, name=name)
    return pool.store.build_image(w)


def slot_arrays(pool, target: str, slot: int) -> tuple[np.ndarray, ...]:
    """(a, b, ranks, scaling) of one slot at one target, every layer, copied to the host."""
    w = pool._slot_weights.targets[target]
    dev = pool.device
    a = np.stack([dev.to_host(w.a_layer(l)[slot]) for l in range(len(w.layers))])  # a layer's A may be bound
    return (a, dev.to_host(w.b[:, slot]), dev.to_host(w.ranks[:, slot]),
            dev.to_host(w.scaling[:, slot]))


def assert_slot_holds(pool, slot: int, name: str, image=None) -> None:
    """Slot ``slot`` holds adapter ``name``'s weights exactly (zero where it has nothing)."""
    image = image or expected_image(pool, name)
    for t in pool.spec.targets:
        a, b, ranks, scaling = slot_arrays(pool, t.name, slot)
        img = image.targets.get(t.name)
        if img is None:
            assert not ranks.any() and not a.any() and not b.any(), f"{name}: slot {slot} not clear at {t.name}"
            continue
        np.testing.assert_array_equal(a, img.a, err_msg=f"{name}: A of slot {slot} at {t.name}")
        np.testing.assert_array_equal(b, img.b, err_msg=f"{name}: B of slot {slot} at {t.name}")
        np.testing.assert_array_equal(ranks, img.ranks)
        np.testing.assert_array_equal(scaling, img.scaling)


def check_delta(pool, rids, num_tokens, rng, targets=None, atol_scale: float = 2e-4) -> None:
    """Every layer's delta through the pool equals the float64 oracle for the planned step."""
    counts = np.ones(len(rids), np.int64) if num_tokens is None else np.asarray(num_tokens)
    slots = np.array([pool._settled[r] for r in rids], np.int64)
    for t in pool.spec.targets if targets is None else [pool.spec.target(n) for n in targets]:
        g = t.row_grouping
        per = (counts + g - 1) // g
        row_slots = np.repeat(slots, per)
        T = int(per.sum())
        inl, outl = t.local_in_features(pool.spec.tp_size), t.local_out_features(pool.spec.tp_size)
        dt = numpy_dtype(pool.spec.dtype)
        for layer in range(t.num_layers):
            x = rng.standard_normal((T, inl)).astype(dt)
            y0 = rng.standard_normal((T, outl)).astype(dt)
            y = pool.device.xp.asarray(y0.copy()) if pool.device.is_cuda else y0.copy()
            xd = pool.device.xp.asarray(x) if pool.device.is_cuda else x
            pool.layer_delta(t.name, layer)(y, xd)
            got = (pool.device.to_host(y) if pool.device.is_cuda else y).astype(np.float64) - y0.astype(np.float64)
            w = pool.layer_weights(t.name, layer)
            if pool.device.is_cuda:
                from lora_cupy.backends.base import LayerWeights

                w = LayerWeights(*(pool.device.to_host(v) for v in (w.a, w.b, w.scaling, w.ranks)), w.out_offsets)
            want = dense_delta64(x, w, row_slots)
            tol = atol_scale * (1 + np.abs(want).max())
            np.testing.assert_allclose(got, want, atol=tol, rtol=0,
                                       err_msg=f"{t.name} layer {layer}: delta differs from the float64 oracle")


def oracle_weights(spec: LoraSpec, images: Mapping, target: str, layer: int, slot_adapter: Mapping[int, str]):
    """Host LayerWeights with each slot holding the expected image of ``slot_adapter[slot]``:
    the reference a step's delta is checked against, independent of what the device holds."""
    from lora_cupy.backends.base import LayerWeights

    t = spec.target(target)
    dt = numpy_dtype(spec.dtype)
    S, n, R = spec.num_slots, t.num_slices, spec.max_rank
    inl = t.local_in_features(spec.tp_size)
    a, b = np.zeros((S, n, R, inl), dt), np.zeros(spec.b_shape(t)[1:], dt)  # B in the pool's layout
    ranks, scaling = np.zeros((S, n), np.int32), np.zeros((S, n), np.float32)
    for s, name in slot_adapter.items():
        img = images[name].targets.get(target)
        if img is not None:
            a[s], b[s], ranks[s], scaling[s] = img.a[layer], img.b[layer], img.ranks[layer], img.scaling[layer]
    return LayerWeights(a, b, scaling, ranks, t.out_offsets(spec.tp_size))


def eviction_stress(device: str, root, steps: int = 60, seed: int | None = None, dtype: str = "float32",
                    rtol: float = 2e-4) -> dict:
    """Requests come and go over 3 adapter slots and 7 adapters, so slots are evicted and reused
    many times; reads are slow and start at ingest, right before the admit that needs them (a
    follower pool: its admit waits for a copy in flight). Every step, every target and layer:
    the delta through the pool equals the float64 oracle built from the adapters' files, and
    no live request's slot ever changes. Returns counters for the caller to check."""
    import random

    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    spec = small_spec(num_slots=4, num_layers=2, dtype=dtype)
    names = make_adapters(root, spec, 7, seed=seed)
    from lora_cupy.pool import LoraAdapterPool

    pool = LoraAdapterPool(spec, device, adapters=names, reader=GatedReader(delay=0.003), decides=False)
    images = {n: pool.store.build_image(read_peft_adapter(p, spec, name=n)) for n, p in names.items()}
    xp = pool.device.xp
    live: dict[int, str | None] = {}
    slot_of_rid: dict[int, int] = {}
    nxt, waited, checked = 0, 0, 0
    try:
        for seq in range(steps):
            for _ in range(rng.randint(1, 3)):
                name = rng.choice([None, *names])
                ingest(pool, nxt, name)
                live[nxt] = name
                nxt += 1
            snap = pool.snapshot()
            held = {snap.adapters[s] for s in range(1, spec.num_slots) if snap.refcounts[s]}
            free = snap.refcounts.count(0) - 1
            rows, new = [], set()
            for rid in rng.sample(sorted(live), len(live)):
                name = live[rid]
                if rid in snap.holders or name is None or name in held or name in new:
                    rows.append(rid)
                elif len(new) < free:
                    new.add(name)
                    rows.append(rid)
            rows = rows[:12]
            waited += sum(1 for r in rows if live[r] and pool.store.get(live[r]).outcome() == READING)
            step, ctx = LoraStep(rows, nrng.integers(1, 4, len(rows)), seq=seq), StepContext(seq=seq)
            out = pool.admit(step, ctx)
            assert out.ok, f"seed {seed} step {seq}: {out.failed}"
            pool.plan(step, ctx)
            snap = pool.snapshot()
            for rid in rows:
                if rid in snap.holders:
                    s = snap.holders[rid]
                    assert slot_of_rid.setdefault(rid, s) == s, f"seed {seed}: request {rid} moved slots"
                    assert snap.adapters[s] == live[rid]
            slot_adapter = {snap.holders[r]: live[r] for r in rows if r in snap.holders}
            counts = np.asarray(step.rows_for(spec.node).num_tokens)
            slots = np.array([snap.holders.get(r, 0) for r in rows])
            for t in spec.targets:
                per = (counts + t.row_grouping - 1) // t.row_grouping
                T = int(per.sum())
                for layer in range(t.num_layers):
                    x = nrng.standard_normal((T, t.in_features)).astype(numpy_dtype(dtype))
                    y0 = nrng.standard_normal((T, t.out_features)).astype(numpy_dtype(dtype))
                    y = xp.asarray(y0.copy()) if pool.device.is_cuda else y0.copy()
                    pool.layer_delta(t.name, layer)(y, xp.asarray(x) if pool.device.is_cuda else x)
                    got = (pool.device.to_host(y) if pool.device.is_cuda else y).astype(np.float64) \
                        - y0.astype(np.float64)
                    want = dense_delta64(x, oracle_weights(spec, images, t.name, layer, slot_adapter),
                                         np.repeat(slots, per))
                    tol = rtol * (1 + np.abs(want).max() + np.abs(y0.astype(np.float64)).max())
                    np.testing.assert_allclose(got, want, atol=tol, rtol=0,
                                               err_msg=f"seed {seed} step {seq} {t.name}[{layer}]")
                    checked += 1
            pool.commit(step, ctx)
            for rid in rng.sample(sorted(live), rng.randint(len(live) // 4, max(1, len(live) // 2))):
                pool.remove_request(rid)
                live.pop(rid)
                slot_of_rid.pop(rid, None)
            pool.check_valid()
        for rid in list(live):
            pool.remove_request(rid)
        pool.check_valid()
        snap = pool.snapshot()
        assert not any(snap.refcounts) and not snap.holders
        return {"loads": pool.stats["loads"], "waited": waited, "checked": checked, "seed": seed}
    finally:
        pool.close()
