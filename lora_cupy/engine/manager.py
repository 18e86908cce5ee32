"""EngineManager.build: a worker for a model, its resources and its node groups.

A node group is what a deployment's config says about some of the model's nodes, e.g.
``{"name": "codec", "nodes": ["codec"], "side_stream": true}``. The manager gives the side lane
to the node of the group that sets ``side_stream: true`` and refuses, naming the node and the
reason, what the lane cannot serve: a node with a resource (its admit and plan would have to run
on the lane's thread against its own stream), a second side node (a lane of its own), and a
group that asks for speculation, planning ahead or lockstep there (a side step is admitted and
planned inline, one at a time, on this rank alone).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from ..errors import LoraError
from .side_steps import SideStepLane
from .scheduler import SIDE_LANE
from .worker import Worker


class EngineConfigError(LoraError):
    """A node-group configuration the engine cannot serve; names the node and the reason."""

    def __init__(self, node: str, reason: str):
        self.node = node
        super().__init__(f"node {node!r}: {reason}")


@dataclass(frozen=True)
class NodeGroup:
    """Nodes that share settings: ``side_stream`` (run on a side lane), ``speculate``,
    ``plan_ahead`` and ``lockstep`` (what the chain may do with them)."""

    name: str
    nodes: tuple[str, ...]
    side_stream: bool = False
    speculate: bool = False
    plan_ahead: bool = False
    lockstep: bool = False

    @classmethod
    def of(cls, g) -> "NodeGroup":
        if isinstance(g, NodeGroup):
            return g
        if not isinstance(g, Mapping):
            raise TypeError(f"a node group is a NodeGroup or a mapping, got {type(g).__name__}")
        if "name" not in g:
            raise EngineConfigError("?", f"a node group needs a name: {dict(g)!r}")
        nodes = g.get("nodes", (g["name"],))
        nodes = (nodes,) if isinstance(nodes, str) else tuple(nodes)
        unknown = sorted(set(g) - {f.name for f in fields(cls)})
        if unknown:
            raise EngineConfigError(nodes[0] if nodes else g["name"],
                                    f"its node group {g['name']!r} has unknown settings {unknown}")
        flags = {k: g[k] for k in ("side_stream", "speculate", "plan_ahead", "lockstep") if k in g}
        for k, v in flags.items():
            if not isinstance(v, bool):
                raise EngineConfigError(nodes[0] if nodes else g["name"], f"{k} must be true or false, got {v!r}")
        return cls(g["name"], nodes, **flags)


def resource_node(resource) -> str | None:
    """The node a resource serves (a LoRA pool: its spec's node; a KV cache: its node)."""
    node = getattr(resource, "node", None)
    if node is None:
        node = getattr(getattr(resource, "spec", None), "node", None)
    return node


class EngineManager:
    """Builds workers: decides which node gets the side lane, refuses what it cannot serve."""

    @staticmethod
    def plan_lanes(model, resources: Sequence, node_groups: Sequence) -> str | None:
        """The node that gets the side lane (None: none does), or an :class:`EngineConfigError`."""
        groups = [NodeGroup.of(g) for g in node_groups]
        known = set(getattr(model, "nodes", (model.chain_node, model.side_node)))
        seen: dict[str, str] = {}
        for g in groups:
            for node in g.nodes:
                if node not in known:
                    raise EngineConfigError(node, f"node group {g.name!r} names it, but the model has no such node "
                                                  f"(its nodes: {sorted(known)})")
                if node in seen:
                    raise EngineConfigError(node, f"it is in two node groups, {seen[node]!r} and {g.name!r}")
                seen[node] = g.name
        served = {resource_node(r): r for r in resources}
        side = None
        for g in groups:
            if not g.side_stream:
                continue
            for node in g.nodes:
                if side is not None:
                    raise EngineConfigError(node, f"a second side node (node {side!r} has the side lane already); "
                                                  "each would need a lane of its own")
                if node in served:
                    raise EngineConfigError(node, f"a resourced node ({type(served[node]).__name__}) cannot run on "
                                                  "the side lane: its admit and plan would have to run there")
                if node == model.chain_node:
                    raise EngineConfigError(node, "the main chain's node cannot run on the side lane")
                for flag, what in (("speculate", "speculation"), ("plan_ahead", "planning ahead"),
                                   ("lockstep", "lockstep")):
                    if getattr(g, flag):
                        raise EngineConfigError(node, f"its node group {g.name!r} sets {flag}: {what} is not served "
                                                      "on the side lane (a side step is admitted and planned "
                                                      "inline, one at a time, on this rank)")
                side = node
        return side

    @classmethod
    def build(cls, model, resources: Sequence, device, node_groups: Sequence = (), **worker_options) -> Worker:
        """A :class:`Worker` for ``model`` whose side node (if a group sets ``side_stream``) runs
        on a :class:`SideStepLane`; its windows otherwise run on the chain."""
        side = cls.plan_lanes(model, resources, node_groups)
        worker = Worker(model, resources, device, side_nodes=() if side is None else (side,), **worker_options)
        if side is not None:
            worker.add_side_lane(SideStepLane(worker, SIDE_LANE))
        return worker
