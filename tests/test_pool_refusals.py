"""Every refusal the pool makes: typed, naming adapter and file, and changing nothing else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from lora_cupy.engine.resource import LoraStep, StepContext
from lora_cupy.errors import (AdapterFileError, AdapterNotFoundError, AdapterStateError, CapacityError,
                              DigestMismatchError, LoraError, PickleRefusedError, RankTooLargeError,
                              TargetMismatchError, UnsupportedAdapterError)
from lora_cupy.peft import digest_of
from lora_cupy.pool import LoraAdapterPool
from tests.peft_helpers import write_random_adapter
from tests.pool_helpers import (GatedReader, assert_slot_holds, ingest, make_adapters, reserve_all, run_step,
                                small_spec, wait_reads)


@pytest.fixture
def spec():
    return small_spec(num_slots=3)


@pytest.fixture
def paths(tmp_path, spec):
    return make_adapters(tmp_path, spec, 3, seed=int(np.random.default_rng().integers(1 << 30)))


@pytest.fixture
def pool(spec, paths):
    p = LoraAdapterPool(spec, adapters=paths)
    yield p
    p.close()


def held_state(pool):
    """The slots live requests hold, with their weights: must survive any refusal unchanged."""
    snap = pool.snapshot()
    return snap.holders, snap.entries, {s: pool.snapshot().adapters[s] for s in set(snap.holders.values())}


def serve_one(pool, rid="live", name="ad0"):
    ingest(pool, rid, name)
    wait_reads(pool, [name])
    reserve_all(pool, [rid])
    assert run_step(pool, [rid])[0].ok
    return pool.snapshot().holders[rid]


def test_ingest_of_an_adapter_not_served(pool):
    with pytest.raises(AdapterNotFoundError, match="nope") as e:
        ingest(pool, 1, "nope")
    assert e.value.adapter == "nope" and "not served" in str(e.value)
    assert not pool.runs_adapters([1])
    ingest(pool, 1, "ad0")  # the rid was never opened: it can be ingested now
    pool.check_valid()


def test_ingest_of_an_adapter_still_loading_or_retiring(spec, paths, tmp_path):
    reader = GatedReader()
    pool = LoraAdapterPool(spec, adapters=paths, reader=reader)
    try:
        extra = make_adapters(tmp_path / "x", spec, 1, prefix="late")
        reader.close("late0")
        fut = pool.load_adapter_async("late0", extra["late0"])
        with pytest.raises(AdapterNotFoundError, match="still loading"):
            ingest(pool, 1, "late0")
        reader.open("late0")
        fut.result(10)
        ingest(pool, 1, "late0")
        assert pool.unload_adapter("late0") is False
        with pytest.raises(AdapterNotFoundError, match="retiring"):
            ingest(pool, 2, "late0")
        pool.check_valid()
    finally:
        pool.close()


def test_load_refusals_visible_now_raise_at_once(spec, paths, tmp_path):
    reader = GatedReader()
    pool = LoraAdapterPool(spec, adapters=paths, reader=reader)
    try:
        with pytest.raises(AdapterStateError, match="served already") as e:
            pool.load_adapter_async("ad0", paths["ad0"])
        assert e.value.adapter == "ad0" and e.value.path == paths["ad0"]
        extra = make_adapters(tmp_path / "x", spec, 1, prefix="late")
        reader.close("late0")
        fut = pool.load_adapter_async("late0", extra["late0"])
        with pytest.raises(AdapterStateError, match="being loaded"):
            pool.load_adapter_async("late0", extra["late0"])
        reader.open("late0")
        fut.result(10)
        ingest(pool, "r", "late0")
        pool.unload_adapter("late0")
        with pytest.raises(AdapterStateError, match="retiring"):
            pool.load_adapter_async("late0", extra["late0"])
        pool.remove_request("r")  # the unload completes
        assert pool.load_adapter_async("late0", extra["late0"]).result(10).name == "late0"
        pool.check_valid()
    finally:
        pool.close()


def _break(path: Path, how: str, spec) -> type[LoraError]:
    """Make the adapter at ``path`` bad in one way; the error class the load must fail with."""
    cfg_file = path / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    if how == "missing":
        shutil.rmtree(path)
        return LoraError
    if how == "corrupt":
        data = (path / "adapter_model.safetensors").read_bytes()
        (path / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
        return AdapterFileError
    if how == "pickle":
        (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
        return PickleRefusedError
    if how == "dora":
        cfg["use_dora"] = True
        cfg_file.write_text(json.dumps(cfg))
        return UnsupportedAdapterError
    if how == "rank":
        shutil.rmtree(path)
        write_random_adapter(path, spec, r=spec.max_rank + 3)
        return RankTooLargeError
    if how == "target":
        other = small_spec()
        from lora_cupy.spec import LoraSpec, LoraTarget

        wide = LoraSpec((*other.targets, LoraTarget("down_proj", 64, 32, 2)), num_slots=3, max_rank=8,
                        dtype="float32")
        shutil.rmtree(path)
        write_random_adapter(path, wide, r=2, modules=("down_proj",))
        return TargetMismatchError
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["missing", "corrupt", "pickle", "dora", "rank", "target"])
def test_load_of_a_bad_adapter_fails_its_future_and_changes_nothing(pool, tmp_path, how):
    slot = serve_one(pool)
    before = held_state(pool)
    path = Path(make_adapters(tmp_path / "bad", pool.spec, 1, prefix="bad")["bad0"])
    want = _break(path, how, pool.spec)
    fut = pool.load_adapter_async("bad0", path)
    with pytest.raises(want) as e:
        fut.result(10)
    assert e.value.adapter == "bad0" and str(path) in str(e.value)
    assert "bad0" not in pool.served and held_state(pool) == before
    assert_slot_holds(pool, slot, "ad0")
    assert run_step(pool, ["live"])[0].ok
    with pytest.raises(AdapterNotFoundError):
        ingest(pool, "x", "bad0")
    pool.check_valid()


def test_load_with_a_digest_mismatch(pool, paths, tmp_path):
    extra = make_adapters(tmp_path / "x", pool.spec, 1, prefix="late")
    fut = pool.load_adapter_async("late0", extra["late0"], digest=digest_of(paths["ad1"]))
    with pytest.raises(DigestMismatchError, match="late0"):
        fut.result(10)
    assert "late0" not in pool.served
    ok = pool.load_adapter_async("late0", extra["late0"], digest=digest_of(extra["late0"]))
    assert ok.result(10).digest == digest_of(extra["late0"])


def test_load_of_a_copy_larger_than_the_host_tier(spec, paths):
    pool = LoraAdapterPool(spec, max_host_bytes=4096)
    try:
        with pytest.raises(CapacityError, match="host tier"):
            pool.load_adapter_async("ad0", paths["ad0"]).result(10)
        assert not pool.served
    finally:
        pool.close()


def test_unload_cancels_a_load_in_flight(spec, paths, tmp_path):
    reader = GatedReader()
    pool = LoraAdapterPool(spec, reader=reader)
    try:
        reader.close("ad0")
        fut = pool.load_adapter_async("ad0", paths["ad0"])
        assert pool.unload_adapter("ad0") is True
        reader.open("ad0")
        with pytest.raises(AdapterStateError, match="unloaded while it loaded"):
            fut.result(10)
        assert "ad0" not in pool.served
        assert pool.unload_adapter("ad0") is False  # not served: a no-op
    finally:
        pool.close()


def test_read_failing_at_ingest_fails_only_its_rows_before_any_slot(pool, paths):
    slot = serve_one(pool)
    shutil.rmtree(paths["ad1"])  # the file went away after the load
    ingest(pool, 1, "ad1")
    ingest(pool, 2, "ad2")
    wait_reads(pool, ["ad1", "ad2"])
    o = pool.ask(1, "llm", ("llm",))
    assert o.failed and isinstance(o.failed[1], LoraError) and "ad1" in str(o.failed[1])
    assert pool.reserve(1, "llm", ("llm",), False) is None  # let through, uncounted
    assert pool.reserve(2, "llm", ("llm",), False) == 1
    step, ctx = LoraStep(["live", 1, 2]), StepContext()
    out = pool.admit(step, ctx)
    assert set(out.failed) == {1} and isinstance(out.failed[1], LoraError)
    after = pool.snapshot()
    assert 1 not in after.holders and "ad1" not in after.entries
    # ad1's miss came first and failed: ad2 took the one free slot, which the counted row was promised
    assert after.holders[2] == after.entries["ad2"] != slot
    assert_slot_holds(pool, after.holders[2], "ad2")
    assert_slot_holds(pool, slot, "ad0")
    pool.rollback_admit(step, ctx)
    pool.remove_request(1)
    pool.check_valid()


def test_file_replaced_after_load_fails_on_its_digest(pool, paths, tmp_path):
    shutil.rmtree(paths["ad2"])
    shutil.copytree(paths["ad1"], paths["ad2"])  # other weights under the same name
    ingest(pool, 1, "ad2")
    wait_reads(pool, ["ad2"])
    out, _, _ = run_step(pool, [1])
    assert isinstance(out.failed[1], DigestMismatchError) and "ad2" in str(out.failed[1])
    assert pool.snapshot().holders == {}


def test_full_pool_refuses_a_miss_at_admit_without_change(pool, paths):
    serve_one(pool, "a", "ad0")
    serve_one(pool, "b", "ad1")  # both slots held
    ingest(pool, "c", "ad2")
    wait_reads(pool, ["ad2"])
    assert pool.reserve("c", "llm", ("llm",), False) == 0  # backpressure at admission
    before = held_state(pool)
    out, _, _ = run_step(pool, ["c"])  # admitted anyway (outside the protocol): the backstop
    err = out.failed["c"]
    assert isinstance(err, CapacityError) and err.adapter == "ad2" and err.path == paths["ad2"]
    assert held_state(pool) == before
    pool.remove_request("a")
    assert pool.reserve("c", "llm", ("llm",), False) == 1
    assert run_step(pool, ["c"])[0].ok
    pool.check_valid()


def test_unreserved_miss_takes_a_slot_and_sheds_the_promise_it_broke(pool):
    """The backstop reads only the slot table, as every rank of an instance does: a row admitted
    without asking takes the slot a reservation counted on, and the leader takes that promise
    back (the row asks again) rather than refuse it where a follower would not."""
    serve_one(pool, "a", "ad0")  # one slot left
    ingest(pool, "r", "ad1")
    ingest(pool, "u", "ad2")
    wait_reads(pool, ["ad1", "ad2"])
    assert pool.reserve("r", "llm", ("llm",), False) == 1
    assert pool.reserve("u", "llm", ("llm",), False) == 0
    assert run_step(pool, ["u"])[0].ok
    assert "r" not in pool.slots.reserved and pool.reserve("r", "llm", ("llm",), False) == 0
    pool.check_valid()
    out, _, _ = run_step(pool, ["r"])  # admitted anyway: no slot is left, on every rank alike
    assert isinstance(out.failed["r"], CapacityError)
    pool.remove_request("u")
    assert pool.reserve("r", "llm", ("llm",), False) == 1 and run_step(pool, ["r"])[0].ok
    pool.check_valid()


def test_protocol_misuse_is_refused(pool):
    ingest(pool, 1, "ad0")
    with pytest.raises(ValueError, match="ingested already"):
        ingest(pool, 1, "ad1")
    with pytest.raises(ValueError, match="never ingested"):
        pool.ask(99, "llm", ("llm",))
    ctx = StepContext(seq=4)
    with pytest.raises(ValueError, match="not admitted"):
        pool.plan(LoraStep([1]), ctx)
    out = pool.admit(LoraStep([42]), StepContext())
    assert isinstance(out.failed[42], LoraError)
    with pytest.raises(KeyError):
        pool.layer_delta("down_proj", 0)
    with pytest.raises(IndexError):
        pool.layer_delta("o_proj", 5)
    pool.check_valid()


def test_a_startup_adapter_that_fails_fails_the_build(spec, paths, tmp_path):
    bad = dict(paths, broken=str(tmp_path / "missing"))
    with pytest.raises(LoraError, match="broken"):
        LoraAdapterPool(spec, adapters=bad)
    with pytest.raises(DigestMismatchError):
        LoraAdapterPool(spec, adapters={"ad0": (paths["ad0"], "f" * 64)})
    ok = LoraAdapterPool(spec, adapters={"ad0": (paths["ad0"], digest_of(paths["ad0"]))})
    assert ok.served == {"ad0"}
    ok.close()
