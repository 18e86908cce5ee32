"""The host tier: reads on the reader thread, what it holds, its bound, its refusals."""

from __future__ import annotations

import threading
import weakref

import numpy as np
import pytest

from lora_cupy.errors import AdapterFileError, CapacityError, DigestMismatchError, LoraError
from lora_cupy.peft import digest_of, read_peft_adapter
from lora_cupy.store import FAILED, READING, READY, LoraAdapterStore
from tests.pool_helpers import GatedReader, make_adapters, small_spec


@pytest.fixture
def spec():
    return small_spec()


@pytest.fixture
def paths(tmp_path, spec):
    return make_adapters(tmp_path, spec, 3, seed=int(np.random.default_rng().integers(1 << 30)), ranks=(3, 8, 5))


def make_store(spec, reader, **kw):
    return LoraAdapterStore(spec, "cpu", reader=reader, **kw)


def test_acquire_reads_on_the_reader_thread_and_never_blocks_the_caller(spec, paths):
    reader = GatedReader(gated=["ad0"])
    store = make_store(spec, reader)
    try:
        e = store.acquire("ad0", paths["ad0"])
        assert e.outcome() == READING  # returned while the read is held at its gate
        reader.wait_started("ad0")
        assert e.outcome() == READING
        reader.open("ad0")
        assert e.wait(10) == READY
        assert [t for _, t in reader.calls] == ["lora-adapter-reader"]
        assert threading.current_thread().name not in {t for _, t in reader.calls}
    finally:
        store.close()


def test_image_is_the_adapter_padded_to_max_rank(spec, paths):
    store = make_store(spec, None)
    try:
        e = store.acquire("ad0", paths["ad0"])
        assert e.wait(10) == READY
        w = read_peft_adapter(paths["ad0"], spec, name="ad0")
        assert set(e.image.targets) == set(w.targets)
        for name, tw in w.targets.items():
            img = e.image.targets[name]
            r = tw.rank
            assert img.a.shape[2] == img.b.shape[2] == spec.max_rank
            np.testing.assert_array_equal(img.a[:, :, :r], tw.a)
            np.testing.assert_array_equal(img.b[:, :, :r], tw.b)
            assert not img.a[:, :, r:].any() and not img.b[:, :, r:].any()
            np.testing.assert_array_equal(img.ranks, tw.ranks)
            np.testing.assert_array_equal(img.scaling, tw.scaling)
        assert e.image.digest == w.digest == digest_of(paths["ad0"])
        assert store.nbytes == e.image.nbytes == store.image_bytes(w.targets)
    finally:
        store.close()


def test_tier_holds_what_live_requests_name(spec, paths):
    store = make_store(spec, None)
    try:
        a = store.acquire("ad1", paths["ad1"])
        b = store.acquire("ad1", paths["ad1"])
        assert a is b and store.users("ad1") == 2
        a.wait(10)
        held = store.nbytes
        assert held > 0
        store.release("ad1")
        assert store.nbytes == held and store.get("ad1") is a
        store.release("ad1")
        assert store.nbytes == 0 and store.get("ad1") is None and store.users("ad1") == 0
        store.release("ad1")  # no entry: a no-op
        c = store.acquire("ad1", paths["ad1"])  # read again
        assert c is not a and c.wait(10) == READY
    finally:
        store.close()


def test_failed_read_is_typed_and_names_adapter_and_file(spec, paths, tmp_path):
    store = make_store(spec, None)
    try:
        missing = tmp_path / "nowhere"
        e = store.acquire("ghost", missing)
        assert e.wait(10) == FAILED
        assert isinstance(e.error, LoraError) and "ghost" in str(e.error) and str(missing) in str(e.error)
        assert store.nbytes == 0
        # a reader raising something untyped is wrapped, naming adapter and file
        r = GatedReader(fail={"ad0": OSError("disk on fire")})
        s2 = make_store(spec, r)
        e2 = s2.acquire("ad0", paths["ad0"])
        assert e2.wait(10) == FAILED and isinstance(e2.error, AdapterFileError)
        assert "disk on fire" in str(e2.error) and "ad0" in str(e2.error)
        s2.close()
    finally:
        store.close()


def test_digest_is_checked_on_every_read(spec, paths):
    store = make_store(spec, None)
    try:
        good = digest_of(paths["ad0"])
        assert store.acquire("ad0", paths["ad0"], digest=good.upper()).wait(10) == READY
        e = store.acquire("ad1", paths["ad1"], digest=good)  # ad1's weights, ad0's digest
        assert e.wait(10) == FAILED and isinstance(e.error, DigestMismatchError)
        fut = store.read_async("ad2", paths["ad2"], digest="0" * 64)
        with pytest.raises(DigestMismatchError):
            fut.result(10)
    finally:
        store.close()


def test_a_dropped_image_is_freed_on_the_reader_thread_before_its_next_read(spec, paths):
    """The last release forgets the copy at once (bytes, entry) but does not free its arrays on the
    releasing thread (a serving loop's, between steps) or wake the idle reader for it: the reader
    frees them when it takes its next job, before that job reads (allocates another image)."""
    freed_on, seen_at_read = [], {}

    def reader(path, spec, name=None):
        seen_at_read[name] = list(freed_on)
        return read_peft_adapter(path, spec, name=name)

    store = make_store(spec, reader)
    try:
        a = store.acquire("ad0", paths["ad0"])
        assert a.wait(10) == READY
        weakref.finalize(a.image, lambda: freed_on.append(threading.current_thread().name))
        store.release("ad0")
        assert store.nbytes == 0 and store.get("ad0") is None and a.image is None
        assert not freed_on  # kept until the reader's next job, not freed by the releasing thread
        b = store.acquire("ad1", paths["ad1"])
        assert b.wait(10) == READY
        assert seen_at_read["ad1"] == ["lora-adapter-reader"]  # freed before ad1's read began
        assert store.nbytes == b.image.nbytes
    finally:
        store.close()


def test_bounded_tier_makes_later_reads_wait_for_room(spec, paths):
    reader = GatedReader()
    probe = make_store(spec, reader)
    one = probe.image_bytes(spec.target_names)
    probe.close()
    store = make_store(spec, reader, max_bytes=one + one // 2)  # room for one full image
    try:
        a = store.acquire("ad0", paths["ad0"])
        b = store.acquire("ad1", paths["ad1"])
        assert a.wait(10) == READY
        assert not b.done.wait(0.3) and b.outcome() == READING  # waits for room, unread
        assert [n for n, _ in reader.calls] == ["ad0"]
        assert store.nbytes <= store.max_bytes
        store.release("ad0")
        assert b.wait(10) == READY and store.nbytes <= store.max_bytes
        st = store.stats()
        assert st["ready"] == 1 and st["max_bytes"] == store.max_bytes and st["nbytes"] == store.nbytes
    finally:
        store.close()


def test_reads_released_before_their_turn_are_skipped(spec, paths):
    reader = GatedReader(gated=["ad0"])
    store = make_store(spec, reader)
    try:
        store.acquire("ad0", paths["ad0"])
        store.acquire("ad1", paths["ad1"])
        reader.wait_started("ad0")
        store.release("ad1")  # still queued behind ad0
        reader.open("ad0")
        store.get("ad0").wait(10)
        store.read_async("ad2", paths["ad2"]).result(10)  # the queue has drained past ad1
        assert [n for n, _ in reader.calls] == ["ad0", "ad2"]
    finally:
        store.close()


def test_a_copy_released_mid_read_counts_until_its_read_ends(spec, paths):
    reader = GatedReader(gated=["ad0"])
    store = make_store(spec, reader)
    try:
        e = store.acquire("ad0", paths["ad0"])
        reader.wait_started("ad0")
        store.release("ad0")  # the read is under way: its bytes stay counted, the entry goes
        assert store.nbytes == e.need > 0 and store.stats()["entries"] == 0
        reader.open("ad0")
        assert e.done.wait(10)
        assert store.nbytes == 0 and store.get("ad0") is None and e.image is None
    finally:
        store.close()


def test_a_copy_larger_than_the_tier_fails_at_once(spec, paths):
    store = make_store(spec, None, max_bytes=1000)
    try:
        e = store.acquire("ad0", paths["ad0"])
        assert e.done.is_set() and e.outcome() == FAILED and isinstance(e.error, CapacityError)
        assert "1000" in str(e.error) and "ad0" in str(e.error)
    finally:
        store.close()


def test_read_async_checks_but_does_not_keep(spec, paths):
    store = make_store(spec, None)
    try:
        w = store.read_async("ad2", paths["ad2"]).result(10)
        assert w.name == "ad2" and w.targets and store.nbytes == 0 and store.get("ad2") is None
    finally:
        store.close()


def test_close_fails_queued_work(spec, paths):
    reader = GatedReader(gated=["ad0"])
    store = make_store(spec, reader)
    store.acquire("ad0", paths["ad0"])
    reader.wait_started("ad0")
    queued = store.acquire("ad1", paths["ad1"])
    fut = store.read_async("ad2", paths["ad2"])
    threading.Timer(0.2, reader.open, ("ad0",)).start()
    store.close()
    assert queued.outcome() == FAILED
    with pytest.raises(RuntimeError):
        fut.result(1)
    with pytest.raises(RuntimeError):
        store.acquire("ad0", paths["ad0"])
