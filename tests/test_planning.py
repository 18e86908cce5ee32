"""Planning's pieces on their own: the settled rows' lookups and the launch views."""

from __future__ import annotations

import numpy as np
import pytest

from lora_cupy.planning import LaunchViews, RowSlots


def test_row_slots_keep_their_key_set_and_look_up_again_after_any_change():
    rs = RowSlots()
    rs["a"], rs["b"] = 1, 2
    rs.update({"c": 0, "a": 3})
    assert rs.rids == {"a", "b", "c"} and dict(rs) == {"a": 3, "b": 2, "c": 0}
    first = rs.slots_of(("a", "b", "c"), np.dtype(np.int16))
    assert first.tolist() == [3, 2, 0] and not first.flags.writeable
    assert rs.slots_of(("a", "b", "c"), np.dtype(np.int16)) is first  # nothing changed: the same lookup
    assert rs.slots_of(("b", "a"), np.dtype(np.int16)).tolist() == [2, 3]  # other rows: looked up
    rs["b"] = 5
    assert rs.slots_of(("a", "b", "c"), np.dtype(np.int16)).tolist() == [3, 5, 0]
    assert rs.pop("b") == 5 and rs.rids == {"a", "c"} and rs.pop("zz", None) is None
    with pytest.raises(ValueError, match="'b' was not admitted"):
        rs.slots_of(("a", "b", "c"), np.dtype(np.int16))


def test_launch_views_hash_by_identity_and_unpack_as_a_pair():
    to, ip = np.arange(16, dtype=np.int32), np.zeros(5, np.int32)
    v, w = LaunchViews(16, 0, to, ip), LaunchViews(16, 0, to, ip)
    assert v != w and len({v, w, v}) == 2
    order, indptr = v
    assert order is to and indptr is ip


def test_planned_rank_takes_the_smallest_class_narrower_than_the_pool():
    from lora_cupy.backends.cupy import planned_rank

    assert [planned_rank(128, b) for b in (None, 0, 1, 16, 17, 64, 65, 128, 500)] == [128, 16, 16, 16, 64, 64, 128,
                                                                                       128, 128]
    assert [planned_rank(64, b) for b in (8, 16, 17, 63)] == [16, 16, 64, 64]
    assert [planned_rank(20, b) for b in (16, 17)] == [16, 20]  # 16 is narrower than 20's width of 32
    assert [planned_rank(16, b) for b in (1, 16)] == [16, 16] and planned_rank(13, 4) == 13  # nothing narrower
    with pytest.raises(ValueError, match="negative"):
        planned_rank(128, -1)
