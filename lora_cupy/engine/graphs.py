"""CUDA graphs of the chain's steps: one per graph key, picked by the runner, never the user.

A chain step's device work reads only fixed buffers: the model's inputs and outputs per capture
bucket, and each resource's plan buffers, which a resource that sets ``force_double_buffer`` (or
is pre-planned) keeps per buffer parity, so that plan(N+1) never overwrites what step N still
reads. A graph records the buffers' addresses, so its key is ``(bucket, parity, active, ranks)``:
``active`` says which resources launch anything this step (a LoRA pool whose rows are all on the
base model launches nothing, and a graph captured then would skip its kernels for good), ``ranks``
the rank class each pool's launches were planned for (a pool of maximum rank 128 whose step holds
only rank-16 adapters runs a rank-16 pool's kernels; a step with a rank-64 adapter needs others).

On cuda the first step of a key runs eagerly (kernels compile and load outside any capture),
the second captures on the lane's stream and replays, and every later one replays. On cpu, and
where graphs are off, every step runs eagerly; the keys and what each read are still recorded,
so the runner's choice is checked on a machine with no GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any


class StepGraphs:
    """Graphs by key for one lane's stream (``LaneStream``); ``enabled=False``: always eager."""

    def __init__(self, lane_stream, enabled: bool = True):
        self.lane_stream = lane_stream
        # capture needs a stream of its own: never the null stream
        self.enabled = enabled and lane_stream.is_cuda and int(getattr(lane_stream.stream, "ptr", 0)) != 0
        self._graphs: dict[Hashable, Any] = {}
        self._seen: Counter = Counter()
        self.launches: Counter = Counter()  # key -> steps run under it
        self.captures: Counter = Counter()
        self.reads: dict[Hashable, Any] = {}  # key -> the buffers its first step read

    def launch(self, key: Hashable, fn: Callable[[], None], reads: Any = None) -> None:
        """Run ``fn`` (the step's device work) under ``key``: eagerly, or captured once and
        replayed. Called in stream order: on cuda with the lane's stream current, on the cpu
        from the lane's host-stream job. ``reads``: what ``fn`` reads (kept per key); a key
        whose buffers moved is refused, since its graph would read stale addresses."""
        if reads is not None:
            seen = self.reads.setdefault(key, reads)
            if seen != reads:
                raise RuntimeError(f"graph key {key!r} read buffers {seen!r} before, {reads!r} now")
        self.launches[key] += 1
        graph = self._graphs.get(key)
        if not self.enabled or (graph is None and self._seen[key] == 0):
            self._seen[key] += 1  # cuda: a warm-up compiles and loads kernels outside any capture
            fn()
            return
        stream = self.lane_stream.stream
        if graph is None:
            stream.begin_capture()
            try:
                fn()
            finally:
                graph = stream.end_capture()
            self._graphs[key] = graph
            self.captures[key] += 1
        graph.launch(stream)

    def __len__(self) -> int:
        return len(self._graphs)
