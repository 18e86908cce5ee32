"""A layer's A bound into an array of the caller's (``pool.bind_a``), and the expand from a v the
base GEMM wrote (``LoraLayerDelta.expand_v``), on the CPU pool (NumPy reference backend)."""

from __future__ import annotations

import numpy as np
import pytest

from lora_cupy.backends.reference import dense_delta64
from lora_cupy.pool import LoraAdapterPool

from pool_helpers import (assert_slot_holds, check_delta, expected_image, make_adapters, planned_step,
                          small_spec)


def _extended(pool, target: str, layer: int, head: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """``[head + S*n*R, in]``: random base rows, then room for the layer's A (bound into it)."""
    t = pool.spec.target(target)
    S, n, R = pool.spec.num_slots, t.num_slices, pool.spec.max_rank
    ext = np.full((head + S * n * R, t.in_features), np.nan, np.float32)
    ext[:head] = rng.standard_normal((head, t.in_features))
    tail = ext[head:].reshape(S, n, R, t.in_features)
    pool.bind_a(target, layer, tail)
    return ext, tail


def _serve(pool, rows, seq):
    step, ctx = planned_step(pool, rows, 1, seq=seq)
    return step, ctx


def _settle(pool, step, ctx, rids):
    pool.commit(step, ctx)
    for rid in rids:
        pool.remove_request(rid)


def test_a_bound_layer_keeps_its_slots_takes_installs_and_comes_back(tmp_path):
    rng = np.random.default_rng(0)
    spec = small_spec(num_slots=4, max_rank=8)
    adapters = make_adapters(tmp_path, spec, 5)
    with LoraAdapterPool(spec, "cpu", adapters=adapters) as pool:
        rows = [("r0", "ad0"), ("r1", "ad1"), ("r2", None)]
        step, ctx = _serve(pool, rows, 1)
        slots = {name: pool._settled[rid] for rid, name in rows if name}
        _settle(pool, step, ctx, [r for r, _ in rows])
        ext_q, tail_q = _extended(pool, "qkv_proj", 0, 32, rng)
        _extended(pool, "qkv_proj", 1, 32, rng)
        ext_o, tail_o = _extended(pool, "o_proj", 1, 32, rng)  # o_proj's layer 0 stays in the pool's array
        w = pool._slot_weights.targets
        assert w["qkv_proj"].a is None, "every qkv layer bound: the pool's own A is freed"
        assert w["o_proj"].a is not None and set(w["o_proj"].bound) == {1}
        assert np.shares_memory(pool.layer_weights("qkv_proj", 0).a, ext_q)
        assert not np.isnan(tail_q).any() and not np.isnan(tail_o).any(), "the slots' A was not copied in"
        for name, slot in slots.items():
            assert_slot_holds(pool, slot, name)
        # installs after the bind land in the bound arrays (ad2..ad4 evict ad0 / ad1 from 3 slots)
        rows2 = [("s0", "ad2"), ("s1", "ad3"), ("s2", "ad4")]
        step, ctx = _serve(pool, rows2, 2)
        for rid, name in rows2:
            assert_slot_holds(pool, pool._settled[rid], name)
        check_delta(pool, [r for r, _ in rows2], None, rng)
        s = pool._settled["s1"]  # ad3's A at layer 0, as its file gives it, sits in the caller's array
        want = expected_image(pool, "ad3").targets["qkv_proj"].a[0]
        assert np.array_equal(ext_q[32:].reshape(tail_q.shape)[s], want) and want.any()
        _settle(pool, step, ctx, [r for r, _ in rows2])
        for target, layer in (("qkv_proj", 0), ("qkv_proj", 1), ("o_proj", 1), ("o_proj", 0)):
            pool.unbind_a(target, layer)  # o_proj's layer 0 was never bound: a no-op
        assert w["qkv_proj"].a is not None and not w["qkv_proj"].bound and not w["o_proj"].bound
        ext_q[32:] = np.nan  # no longer read
        ext_o[32:] = np.nan
        step, ctx = _serve(pool, rows2, 3)
        for rid, name in rows2:
            assert_slot_holds(pool, pool._settled[rid], name)
        check_delta(pool, [r for r, _ in rows2], None, rng)
        _settle(pool, step, ctx, [r for r, _ in rows2])


def test_bind_refuses_an_array_of_another_shape_or_dtype_or_a_bound_layer(tmp_path):
    spec = small_spec(num_slots=4, max_rank=8)
    with LoraAdapterPool(spec, "cpu", adapters=make_adapters(tmp_path, spec, 1)) as pool:
        with pytest.raises(ValueError, match="A of layer 0"):
            pool.bind_a("o_proj", 0, np.zeros((4, 1, 4, 32), np.float32))
        with pytest.raises(ValueError, match="A of layer 0"):
            pool.bind_a("o_proj", 0, np.zeros((4, 1, 8, 32), np.float64))
        assert not pool._slot_weights.targets["o_proj"].bound
        mine, other = np.zeros((4, 1, 8, 32), np.float32), np.zeros((4, 1, 8, 32), np.float32)
        pool.bind_a("o_proj", 0, mine)
        with pytest.raises(ValueError, match="another array already"):
            pool.bind_a("o_proj", 0, other)  # a second attachment's array: refused, the first kept
        with pytest.raises(ValueError, match="another array than"):
            pool.unbind_a("o_proj", 0, other)
        assert pool._slot_weights.targets["o_proj"].bound[0] is mine
        pool.unbind_a("o_proj", 0, mine)
        assert not pool._slot_weights.targets["o_proj"].bound


@pytest.mark.parametrize("target", ["qkv_proj", "o_proj"])
def test_expand_v_after_one_gemm_equals_the_delta(tmp_path, target):
    """One GEMM of x with [W; A of every slot] gives y and v; expand_v adds the rest: each slice's
    output on the float64 oracle, rows on the base model untouched."""
    rng = np.random.default_rng(1)
    spec = small_spec(num_slots=4, max_rank=8)
    adapters = make_adapters(tmp_path, spec, 3)
    with LoraAdapterPool(spec, "cpu", adapters=adapters) as pool:
        t = spec.target(target)
        offs = t.out_offsets(1)
        head = offs[1]
        ext, _tail = _extended(pool, target, 0, head, rng)
        rows = [("r0", "ad0"), ("r1", None), ("r2", "ad1"), ("r3", "ad2"), ("r4", "ad0")]
        step, ctx = _serve(pool, rows, 1)
        T = len(rows)
        pool.current_plan().wait_host()  # the admit's installs into the bound A: before the GEMM reads it
        x = rng.standard_normal((T, t.in_features)).astype(np.float32)
        others = [rng.standard_normal((offs[j + 1] - offs[j], t.in_features)).astype(np.float32)
                  for j in range(1, t.num_slices)]
        out = x @ ext.T
        ys = [out[:, :head]] + [x @ wj.T for wj in others]  # the first slice: a column range of out
        base = [y.copy() for y in ys]
        pool.layer_delta(target, 0).expand_v(ys, out[:, head:])
        row_slots = [pool._settled[r] for r, _ in rows]
        d = dense_delta64(x, pool.layer_weights(target, 0), row_slots)
        for j in range(t.num_slices):
            np.testing.assert_allclose(ys[j] - base[j], d[:, offs[j]:offs[j + 1]], atol=1e-4, rtol=1e-4)
        assert np.array_equal(ys[0][1], base[0][1]), "the base row was written"
        assert np.abs(d[[0, 2, 3, 4]]).max() > 0
        with pytest.raises(ValueError, match="outputs for"):
            pool.layer_delta(target, 0).expand_v(ys[:1] + ys, out[:, head:])
        with pytest.raises(ValueError, match=r"\[rows >= 5"):
            pool.layer_delta(target, 0).expand_v(ys, out[:, head + 1:])
        _settle(pool, step, ctx, [r for r, _ in rows])
