"""Loads, unloads, ingests and removes from several threads while steps admit, plan and run.

Bounded in time (a few seconds); every assertion is about invariants, never about timing:
after every step each row's slot holds exactly its adapter's weights (checksums), no live
request's slot changes, deltas match the float64 oracle; at the end check_valid holds and
every refcount is zero once every request is removed.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time

import numpy as np

from lora_cupy.backends.reference import dense_delta64
from lora_cupy.engine.admission import AdmissionQueue
from lora_cupy.engine.resource import LoraStep, StepContext
from lora_cupy.errors import AdapterNotFoundError, AdapterStateError
from lora_cupy.peft import read_peft_adapter
from lora_cupy.pool import LoraAdapterPool
from tests.pool_helpers import (GatedReader, eviction_stress, ingest, make_adapters, oracle_weights, slot_arrays,
                                small_spec)

DURATION_S = 3.0


def image_checksum(image, spec) -> str:
    h = hashlib.sha256()
    for t in spec.targets:
        img = image.targets.get(t.name)
        if img is None:
            h.update(b"none")
            continue
        for arr in (img.a, img.b, img.ranks, img.scaling):
            h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def slot_checksum(pool, slot: int) -> str:
    h = hashlib.sha256()
    for t in pool.spec.targets:
        a, b, ranks, scaling = slot_arrays(pool, t.name, slot)
        if not ranks.any() and not a.any() and not b.any():
            h.update(b"none")
            continue
        for arr in (a, b, ranks, scaling):
            h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def test_threads_load_unload_ingest_remove_while_steps_run(tmp_path):
    seed = random.randrange(1 << 30)
    spec = small_spec(num_slots=4, num_layers=2)
    base = make_adapters(tmp_path / "base", spec, 5, seed=seed)
    extra = make_adapters(tmp_path / "extra", spec, 3, seed=seed + 1, prefix="rt")
    pool = LoraAdapterPool(spec, adapters=base, reader=GatedReader(delay=0.001))
    every = {**base, **extra}
    images = {n: pool.store.build_image(read_peft_adapter(p, spec, name=n)) for n, p in every.items()}
    sums = {n: image_checksum(img, spec) for n, img in images.items()}
    q = AdmissionQueue([pool])
    mu = threading.Lock()  # guards the test's own bookkeeping and the queue
    live: dict[int, str | None] = {}
    in_step: set[int] = set()
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"ingest_refused": 0, "load_refused": 0, "loads": 0, "unloads": 0, "removed": 0, "steps": 0}
    next_rid = [0]

    def guard(fn):
        def run():
            r = random.Random(f"{seed}-{fn.__name__}")
            try:
                while not stop.is_set():
                    fn(r)
                    time.sleep(r.uniform(0, 0.004))
            except BaseException as e:  # surfaced by the main thread
                errors.append(e)
        return threading.Thread(target=run, name=fn.__name__, daemon=True)

    def ingester(r):
        name = r.choice([None, *sorted(pool.served)])
        with mu:
            rid = next_rid[0]
            next_rid[0] += 1
            try:
                ingest(pool, rid, name)
            except AdapterNotFoundError:  # unloaded since we looked
                counts["ingest_refused"] += 1
                return
            live[rid] = name
            q.submit(rid, "llm")

    def remover(r):
        with mu:
            idle = sorted(set(live) - in_step)
            if len(idle) < 4:
                return
            rid = r.choice(idle)
            pool.remove_request(rid)
            q.cancel(rid)
            del live[rid]
            counts["removed"] += 1

    def loader(r):
        name = r.choice(sorted(extra))
        if name in pool.served:
            pool.unload_adapter(name)
            counts["unloads"] += 1
            return
        try:
            pool.load_adapter_async(name, extra[name]).result(5)
            counts["loads"] += 1
        except AdapterStateError:  # still retiring, or loading already
            counts["load_refused"] += 1

    threads = [guard(f) for f in (ingester, remover, loader)]
    for t in threads:
        t.start()
    rng = np.random.default_rng(seed)
    running: set[int] = set()
    slot_of_rid: dict[int, int] = {}
    deadline = time.monotonic() + DURATION_S
    seq = 0
    try:
        while time.monotonic() < deadline and not errors:
            seq += 1
            with mu:
                running &= set(live)
                running |= {g.rid for g in q.pump(limit=max(0, 16 - len(running)))}
                rows = sorted(running)
                in_step.clear()
                in_step.update(rows)
                row_adapter = {r: live[r] for r in rows}
            if not rows:
                time.sleep(0.001)
                continue
            step, ctx = LoraStep(rows, rng.integers(1, 4, len(rows)), seq=seq), StepContext(seq=seq)
            out = pool.admit(step, ctx)
            assert out.ok, f"seed {seed}: a row the queue let through was refused: {out.failed}"
            pool.plan(step, ctx)
            pool.device.synchronize()
            snap = pool.snapshot()
            slot_adapter = {}
            for rid in rows:
                s = snap.holders.get(rid)
                if rng.random() < 0.1:
                    running.discard(rid)  # finished: idle until the remover takes it
                if s is None:
                    assert not pool.runs_adapters([rid])
                    continue
                assert slot_of_rid.setdefault(rid, s) == s, f"seed {seed}: request {rid} moved slots"
                assert snap.adapters[s] == row_adapter[rid]
                assert slot_checksum(pool, s) == sums[row_adapter[rid]], \
                    f"seed {seed}: slot {s} of live request {rid} does not hold {row_adapter[rid]}'s weights"
                slot_adapter[s] = row_adapter[rid]
            t = spec.targets[seq % len(spec.targets)]
            layer = seq % t.num_layers
            per = (np.asarray(step.rows_for("llm").num_tokens) + t.row_grouping - 1) // t.row_grouping
            x = rng.standard_normal((int(per.sum()), t.in_features)).astype(np.float32)
            y = rng.standard_normal((int(per.sum()), t.out_features)).astype(np.float32)
            y0 = y.copy()
            pool.layer_delta(t.name, layer)(y, x)
            want = dense_delta64(x, oracle_weights(spec, images, t.name, layer, slot_adapter),
                                 np.repeat([snap.holders.get(r, 0) for r in rows], per))
            np.testing.assert_allclose(y.astype(np.float64) - y0, want, atol=2e-4 * (1 + np.abs(want).max()), rtol=0)
            pool.commit(step, ctx)
            with mu:
                in_step.clear()
            counts["steps"] += 1
            pool.check_valid()
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert not errors, errors
    with mu:
        for rid in list(live):
            pool.remove_request(rid)
            q.cancel(rid)
        live.clear()
    pool.check_valid()
    snap = pool.snapshot()
    assert not any(snap.refcounts) and not snap.holders and not snap.reserved
    assert not pool.store.stats()["entries"]
    # a read of a copy released mid-read still counts its bytes until the reader thread finishes it
    # (LoraAdapterStore.nbytes): the tier must come back to zero, not be there at once
    settle = time.monotonic() + 10
    while pool.store.nbytes and time.monotonic() < settle:
        time.sleep(0.005)
    assert pool.store.nbytes == 0, pool.store.stats()
    assert counts["steps"] > 20 and counts["removed"] > 10 and counts["loads"] + counts["unloads"] > 2, counts
    pool.close()


def test_eviction_stress_cpu_twin_of_the_gpu_test(tmp_path):
    got = eviction_stress("cpu", tmp_path, steps=50)
    assert got["loads"] >= 12, got  # 3 slots: evicted and rewritten many times
    assert got["waited"] > 0, got  # admits met copies still being read
    assert got["checked"] == 50 * 4
