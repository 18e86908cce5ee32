"""EngineManager.build: the side lane goes to the side_stream node group's node, and what the lane
cannot serve is refused with an error naming the node and the reason."""

from __future__ import annotations

import pytest

from lora_cupy.engine.manager import EngineConfigError, EngineManager, NodeGroup
from lora_cupy.engine.scheduler import SIDE_LANE
from lora_cupy.errors import LoraError
from tests.test_worker import make_engine


class Model:
    chain_node, side_node = "llm", "codec"
    nodes = ("llm", "codec", "vocoder")


class Pool:
    class spec:
        node = "llm"


class Pages:
    node = "llm"


def lanes(*groups, resources=(Pool(), Pages())):
    return EngineManager.plan_lanes(Model(), list(resources), list(groups))


def test_the_side_stream_group_gets_the_lane():
    audio = {"name": "audio", "nodes": ["codec"], "side_stream": True}
    assert lanes(audio, {"name": "lm", "nodes": ["llm"]}) == "codec"
    assert lanes({"name": "audio", "nodes": ["codec"]}) is None
    assert lanes() is None
    assert lanes(NodeGroup("audio", ("codec",), side_stream=True)) == "codec"


@pytest.mark.parametrize("group, node, reason", [
    ({"name": "lm", "nodes": ["llm"], "side_stream": True}, "llm", "resourced node"),
    ({"name": "a", "nodes": ["codec", "vocoder"], "side_stream": True}, "vocoder", "second side node"),
    ({"name": "a", "nodes": ["codec"], "side_stream": True, "speculate": True}, "codec", "speculation"),
    ({"name": "a", "nodes": ["codec"], "side_stream": True, "plan_ahead": True}, "codec", "planning ahead"),
    ({"name": "a", "nodes": ["codec"], "side_stream": True, "lockstep": True}, "codec", "lockstep"),
    ({"name": "a", "nodes": ["piano"], "side_stream": True}, "piano", "no such node"),
    ({"name": "a", "nodes": ["codec"], "side_stream": "yes"}, "codec", "true or false"),
    ({"name": "a", "nodes": ["codec"], "side_stream": True, "stream_priority": 1}, "codec", "unknown settings"),
])
def test_refusals_name_the_node_and_the_reason(group, node, reason):
    with pytest.raises(EngineConfigError, match=reason) as e:
        lanes(group)
    assert e.value.node == node and f"node {node!r}" in str(e.value)
    assert isinstance(e.value, LoraError)


def test_a_second_side_group_is_refused():
    with pytest.raises(EngineConfigError, match="second side node") as e:
        lanes({"name": "a", "nodes": ["codec"], "side_stream": True},
              {"name": "b", "nodes": ["vocoder"], "side_stream": True})
    assert e.value.node == "vocoder"


def test_a_node_in_two_groups_is_refused():
    with pytest.raises(EngineConfigError, match="two node groups"):
        lanes({"name": "a", "nodes": ["codec"]}, {"name": "b", "nodes": ["codec"], "side_stream": True})


def test_a_resource_on_the_side_node_is_refused():
    class CodecCache:
        node = "codec"

    with pytest.raises(EngineConfigError, match="resourced node") as e:
        lanes({"name": "a", "nodes": ["codec"], "side_stream": True}, resources=(Pool(), CodecCache()))
    assert e.value.node == "codec"


def test_build_attaches_the_lane_only_where_asked():
    for side in (True, False):
        eng = make_engine(side_lane=side)
        try:
            assert (SIDE_LANE in eng.worker.side_lanes) is side
            assert eng.worker.scheduler.lane_of(("r", "codec")) == (SIDE_LANE if side else 0)
        finally:
            eng.close()
