"""The pool on a CUDA device: slots evicted and reused many times while reads race the admits,
every step's delta against the float64 oracle; pinned host copies; addressing a captured graph
reads. The CPU twin of the stress test is tests/test_pool_concurrency.py."""

from __future__ import annotations

import numpy as np
import pytest

from lora_cupy.adapter import AdapterWeights
from lora_cupy.addressing import group_by_slot
from lora_cupy.backends.cupy import TOLERANCE
from lora_cupy.backends.reference import dense_delta64
from lora_cupy.engine.resource import LoraStep, StepContext
from lora_cupy.peft import read_peft_adapter
from lora_cupy.pool import LoraAdapterPool
from tests.pool_helpers import (assert_slot_holds, eviction_stress, ingest, make_adapters, oracle_weights,
                                reserve_all, small_spec, wait_reads)


def _cuda_devices() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, or no device
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_devices() == 0, reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eviction_stress_on_cuda(tmp_path, dtype):
    # an elementwise tolerance, scaled by the largest magnitude, from the kernels' own table
    got = eviction_stress("cuda:0", tmp_path, steps=60, dtype=dtype, rtol=4 * TOLERANCE[dtype])
    assert got["loads"] >= 12, got
    assert got["waited"] > 0, got
    assert got["checked"] == 60 * 4


def test_host_copies_are_pinned_and_slots_hold_exact_weights(tmp_path):
    import cupy

    spec = small_spec(num_slots=4)
    paths = make_adapters(tmp_path, spec, 3, seed=int(np.random.default_rng().integers(1 << 30)))
    pool = LoraAdapterPool(spec, "cuda:0", adapters=paths)
    try:
        assert pool.layer_weights("o_proj", 0).a.__class__ is cupy.ndarray
        for rid, name in enumerate(paths):
            ingest(pool, rid, name)
        wait_reads(pool, paths)
        for name in paths:
            img = pool.store.get(name).image
            for t in img.targets.values():
                attrs = cupy.cuda.runtime.pointerGetAttributes(t.a.ctypes.data)
                assert attrs.type == cupy.cuda.runtime.memoryTypeHost, "host copy is not page-locked"
        reserve_all(pool, list(range(3)))
        step, ctx = LoraStep([0, 1, 2], [3, 1, 2]), StepContext()
        assert pool.admit(step, ctx).ok
        pool.plan(step, ctx)
        snap = pool.snapshot()
        for rid, name in enumerate(paths):
            assert_slot_holds(pool, snap.holders[rid], name)
        assert_slot_holds(pool, 0, "zero", image=AdapterWeights("zero", "", "", {}))  # slot 0 holds nothing
        addr = pool.addressing()
        assert isinstance(addr.token_order, cupy.ndarray)
        want_order, want_indptr = group_by_slot(np.repeat([snap.holders[r] for r in range(3)], [3, 1, 2]),
                                                spec.num_slots)
        np.testing.assert_array_equal(pool.device.to_host(addr.token_order), want_order)
        np.testing.assert_array_equal(pool.device.to_host(addr.slot_indptr), want_indptr)
        # torch tensors cross without a copy and run on torch's current stream
        torch = pytest.importorskip("torch")
        images = {n: pool.store.build_image(read_peft_adapter(p, spec, name=n)) for n, p in paths.items()}
        xt = torch.randn(6, 32, device="cuda")
        yt = torch.randn(6, 48, device="cuda")
        y0 = yt.clone()
        pool.layer_delta("qkv_proj", 0)(yt, xt)
        torch.cuda.synchronize()
        slot_adapter = {snap.holders[r]: n for r, n in enumerate(paths)}
        want = dense_delta64(xt.cpu().numpy(), oracle_weights(spec, images, "qkv_proj", 0, slot_adapter),
                             np.repeat([snap.holders[r] for r in range(3)], [3, 1, 2]))
        got = (yt - y0).double().cpu().numpy()
        np.testing.assert_allclose(got, want, atol=4 * TOLERANCE["float32"] * (1 + np.abs(want).max()), rtol=0)
    finally:
        pool.close()


def test_captured_layer_replays_with_each_new_plan(tmp_path):
    """A graph captured per parity replays against whatever plan last wrote that parity's
    buffers: the launch reads only the fixed per-bucket addressing."""
    import cupy

    rng = np.random.default_rng()
    spec = small_spec(num_slots=4, buckets=(4, 16, 64))
    paths = make_adapters(tmp_path, spec, 3, seed=int(rng.integers(1 << 30)))
    stream = cupy.cuda.Stream(non_blocking=True)
    from lora_cupy.device import Device

    pool = LoraAdapterPool(spec, Device("cuda:0", stream=stream), adapters=paths)
    images = {n: pool.store.build_image(read_peft_adapter(p, spec, name=n)) for n, p in paths.items()}
    try:
        names = ["ad0", "ad1", None, "ad2", "ad0", None]
        for rid, n in enumerate(names):
            ingest(pool, rid, n)
        wait_reads(pool, paths)
        reserve_all(pool, list(range(len(names))))
        t = spec.target("qkv_proj")
        x = cupy.zeros((16, t.in_features), np.float32)
        y = cupy.zeros((16, t.out_features), np.float32)
        delta = pool.layer_delta("qkv_proj", 1)
        graphs = {}
        for k in range(8):
            rids = sorted(rng.choice(len(names), size=rng.integers(3, len(names) + 1), replace=False).tolist())
            tokens = rng.integers(1, 4, len(rids))
            while tokens.sum() <= 4:  # stay in the 16-row bucket the graphs were captured for
                tokens[np.argmin(tokens)] += 1
            while tokens.sum() > 16:
                tokens[np.argmax(tokens)] -= 1
            assert spec.bucket_for(int(tokens.sum())) == 16
            step, ctx = LoraStep(rids, tokens, seq=k), StepContext(seq=k)
            assert pool.admit(step, ctx).ok
            pool.plan(step, ctx)
            xh = rng.standard_normal(x.shape).astype(np.float32)
            yh = rng.standard_normal(y.shape).astype(np.float32)
            with stream:
                x.set(xh, stream=stream)
                y.set(yh, stream=stream)
                parity = ctx.plan_results[pool].launch[1].parity
                if parity not in graphs:
                    delta(y.copy(), x)  # an eager call first: kernels load outside the capture
                    stream.begin_capture()
                    delta(y, x)
                    graphs[parity] = stream.end_capture()
                graphs[parity].launch(stream)
            stream.synchronize()
            snap = pool.snapshot()
            row_slots = np.zeros(16, np.int64)
            row_slots[: tokens.sum()] = np.repeat([snap.holders.get(r, 0) for r in rids], tokens)
            slot_adapter = {snap.holders[r]: names[r] for r in rids if r in snap.holders}
            want = dense_delta64(xh, oracle_weights(spec, images, "qkv_proj", 1, slot_adapter), row_slots)
            got = y.get().astype(np.float64) - yh
            np.testing.assert_allclose(got, want, atol=4 * TOLERANCE["float32"] * (1 + np.abs(want).max()), rtol=0,
                                       err_msg=f"replay {k}")
            assert not got[tokens.sum():].any(), "padding rows were written"
        assert len(graphs) == 2  # one per parity: plans alternate the buffers
    finally:
        pool.close()
