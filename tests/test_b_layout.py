"""B rank-blocked in a pool of max_rank above 16: its shape, the conversions, the host image, the
reference delta and a pool's deltas on the CPU (the kernels' strides: test_kernel_backend_cpu.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lora_cupy.backends.base import LayerWeights, b_columns, member_weights, unblocked_b
from lora_cupy.backends.reference import dense_delta64, reference_delta
from lora_cupy.peft import read_peft_adapter
from lora_cupy.pool import LoraAdapterPool
from lora_cupy.spec import blocked_b
from lora_cupy.store import READY, LoraAdapterStore
from tests.pool_helpers import (assert_slot_holds, check_delta, ingest, make_adapters, reserve_all, run_step,
                                slot_arrays, small_spec, step_alone, wait_reads)


@pytest.fixture
def rng():
    return np.random.default_rng()


@pytest.mark.parametrize("R, layout, b_shape", [
    (8, "blocked", (2, 5, 48, 8)), (16, "blocked", (2, 5, 48, 16)), (17, "blocked", (2, 5, 2, 48, 16)),
    (40, "blocked", (2, 5, 3, 48, 16)), (128, "blocked", (2, 5, 8, 48, 16)),
    (40, "auto", (2, 5, 48, 40)), (64, "auto", (2, 5, 48, 64)), (65, "auto", (2, 5, 5, 48, 16)),
    (128, "auto", (2, 5, 8, 48, 16)), (128, "plain", (2, 5, 48, 128))])
def test_b_is_rank_blocked_where_the_layout_says(R, layout, b_shape):
    spec = replace(small_spec(num_slots=5, max_rank=R), b_layout=layout)
    t = spec.target("qkv_proj")
    assert spec.b_blocked == (len(b_shape) == 5) and spec.b_shape(t) == b_shape
    assert spec.target_bytes(t) == (np.prod(spec.a_shape(t)) + np.prod(b_shape)) * 4 + 2 * 5 * 3 * 8
    assert small_spec(max_rank=R).b_blocked == (R > 64)  # the default, "auto"
    with pytest.raises(ValueError, match="b_layout"):
        replace(spec, b_layout="blocks")


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_blocked_b_holds_every_rank_in_its_block(lib, rng):
    S, out, r, R = 3, 40, 37, 48
    b = rng.standard_normal((S, out, r)).astype(np.float32)
    if lib == "torch":
        torch = pytest.importorskip("torch")
        b = torch.from_numpy(b)
    bb = blocked_b(b, R)
    assert tuple(bb.shape) == (S, 3, out, 16)
    host = np.asarray(bb)
    for k in (0, 15, 16, 17, 36):  # rank k of column c sits in block k // 16 at k % 16
        np.testing.assert_array_equal(host[:, k // 16, :, k % 16], np.asarray(b)[:, :, k])
    assert not host[:, 2, :, r - 32:].any()  # ranks 37..47: zero
    np.testing.assert_array_equal(np.asarray(unblocked_b(bb))[..., :r], np.asarray(b))
    for s in range(S):
        for c0, c1, rr in ((0, out, r), (5, 30, 1), (7, 8, 16), (3, 33, 17), (0, 40, 32)):
            np.testing.assert_array_equal(np.asarray(b_columns(bb, s, c0, c1, rr)), np.asarray(b)[s, c0:c1, :rr])
    for bad in (16, 30):  # not a blocked pool; fewer ranks than b holds
        with pytest.raises(ValueError, match="rank-blocked"):
            blocked_b(b, bad)


def test_reference_delta_reads_either_layout_alike(rng):
    S, n, R, in_f, T = 4, 3, 40, 24, 11
    offs = (0, 20, 28, 36)
    a = rng.standard_normal((S, n, R, in_f)).astype(np.float32)
    b = rng.standard_normal((S, offs[-1], R)).astype(np.float32)
    ranks = rng.integers(0, R + 1, (S, n)).astype(np.int32)
    ranks[0] = 0
    scaling = rng.uniform(0.5, 2, (S, n)).astype(np.float32)
    for s in range(S):
        for j in range(n):
            a[s, j, ranks[s, j]:] = np.nan  # past a rank: never read
            b[s, offs[j]:offs[j + 1], ranks[s, j]:] = np.nan
    plain = LayerWeights(a, b, scaling, ranks, offs)
    blocked = LayerWeights(a, blocked_b(np.nan_to_num(b, nan=0.0), R), scaling, ranks, offs)
    x = rng.standard_normal((T, in_f)).astype(np.float32)
    y0 = rng.standard_normal((T, offs[-1])).astype(np.float32)
    row_slots = rng.integers(0, S, T)
    order = np.argsort(row_slots, kind="stable").astype(np.int32)
    indptr = np.searchsorted(row_slots[order], np.arange(S + 1)).astype(np.int32)
    want = dense_delta64(x, plain, row_slots)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(dense_delta64(x, blocked, row_slots), want)
    ys = []
    for w in (plain, blocked):
        y = y0.copy()
        reference_delta(y, x, w, order, indptr)
        ys.append(y)
    np.testing.assert_array_equal(ys[1], ys[0])
    np.testing.assert_allclose(ys[0] - y0, want, atol=1e-4 * (1 + np.abs(want).max()))
    for j in range(n):  # one slice into its own output: B's view of its rows in either layout
        yj = [y0[:, offs[j]:offs[j + 1]].copy() for _ in range(2)]
        for y, w in zip(yj, (plain, blocked)):
            reference_delta(y, x, member_weights(w, j), order, indptr)
        np.testing.assert_array_equal(yj[1], yj[0])
        np.testing.assert_array_equal(yj[0], ys[0][:, offs[j]:offs[j + 1]])


def test_image_of_a_pool_above_16_ranks_is_rank_blocked(tmp_path, rng):
    spec = replace(small_spec(max_rank=40), b_layout="blocked")
    paths = make_adapters(tmp_path, spec, 4, seed=int(rng.integers(1 << 30)), ranks=(5, 16, 17, 40))
    store = LoraAdapterStore(spec, "cpu")
    try:
        for name, path in paths.items():
            e = store.acquire(name, path)
            assert e.wait(10) == READY
            w = read_peft_adapter(path, spec, name=name)
            for tname, tw in w.targets.items():
                img, r = e.image.targets[tname], tw.rank
                assert img.b.shape == (*spec.b_shape(spec.target(tname))[:1], *spec.b_shape(spec.target(tname))[2:])
                dense = unblocked_b(img.b)
                np.testing.assert_array_equal(dense[..., :r], tw.b)
                assert not dense[..., r:].any()
                np.testing.assert_array_equal(img.b, blocked_b(tw.b, spec.max_rank))
    finally:
        store.close()


def check_against_file(pool, slot: int, path: str, rng) -> None:
    """Slot ``slot``'s B holds rank k of the adapter file's column c at block k // 16, k % 16 where
    rank-blocked (else at k), and o_proj's delta (one row, every layer) is the file's
    ``x @ (scaling * B @ A).T`` in float64: neither through the pool's image nor through b_columns."""
    w = read_peft_adapter(path, pool.spec)
    for tname, tw in w.targets.items():
        _, b, _, _ = slot_arrays(pool, tname, slot)
        for k in range(tw.rank):
            got = b[:, k // 16, :, k % 16] if pool.spec.b_blocked else b[:, :, k]
            np.testing.assert_array_equal(got, tw.b[:, :, k], err_msg=f"{tname} rank {k}")
        assert not (unblocked_b(b) if pool.spec.b_blocked else b)[..., tw.rank:].any()
    tw = w.targets["o_proj"]
    for layer in range(tw.a.shape[0]):
        x = rng.standard_normal((1, 32)).astype(np.float32)
        y = np.zeros((1, 32), np.float32)
        order, indptr = np.zeros(1, np.int32), np.array([0] * (slot + 1) + [1] * (pool.spec.num_slots - slot), np.int32)
        reference_delta(y, x, pool.layer_weights("o_proj", layer), order, indptr)
        r = int(tw.ranks[layer, 0])
        want = float(tw.scaling[layer, 0]) * (x.astype(np.float64) @ tw.a[layer, 0, :r].T.astype(np.float64)
                                                @ tw.b[layer, :, :r].T.astype(np.float64))
        np.testing.assert_allclose(y, want, atol=1e-4 * (1 + np.abs(want).max()), rtol=0)


@pytest.mark.parametrize("R, layout", [(40, "blocked"), (80, "auto"), (40, "auto")])
def test_pool_above_16_ranks_serves_correct_deltas(tmp_path, rng, R, layout):
    """A pool of max_rank above 16, B rank-blocked (40 asked for; 80 by default) or not (40 by
    default): slots hold the adapters' files, steps give the float64 oracle's deltas, and a slot
    written again after an eviction holds the new adapter only."""
    spec = replace(small_spec(num_slots=3, max_rank=R), b_layout=layout)
    assert spec.b_blocked == (layout == "blocked" or R > 64)
    paths = make_adapters(tmp_path, spec, 4, seed=int(rng.integers(1 << 30)), ranks=(3, 17, 40, 16))
    pool = LoraAdapterPool(spec, "cpu", adapters=paths)
    try:
        for k, name in enumerate(["ad0", "ad1", "ad2", "ad3", "ad1"]):
            slot = step_alone(pool, k, name, 3, seq=k)
            assert_slot_holds(pool, slot, name)
            check_against_file(pool, slot, paths[name], rng)
            check_delta(pool, [k], [3], rng)
            pool.remove_request(k)
        rids = list(range(10, 12))
        for rid, name in zip(rids, ["ad2", "ad3"]):
            ingest(pool, rid, name)
        wait_reads(pool, ["ad2", "ad3"])
        reserve_all(pool, rids)
        out, _, _ = run_step(pool, rids, [2, 5], seq=9)
        assert out.ok
        check_delta(pool, rids, [2, 5], rng)
        pool.check_valid()
    finally:
        pool.close()
