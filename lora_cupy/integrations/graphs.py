"""DecodeGraphs: a generator's decode steps replayed as CUDA graphs.

A decode step (every running request feeds one token) of ``B`` rows runs in the batch bucket
``spec.bucket_for(B)``, the pool's own capture bucket for ``B`` tokens, so the step's
addressing lands in the fixed device buffer of that bucket that a graph captured on an
earlier step of the bucket reads. Static inputs (each row's token and cache length, padding
rows at length 0 writing into free cache rows) are refilled before each replay; positions,
write columns and the attention mask are computed inside the graph from them, over the
cache's whole ``max_len`` (a static shape). The graph ends with each row's greedy token.

Graphs are keyed by the bucket, by the addressing buffers the step's plan launches with (the
pool alternates two per bucket when it double-buffers, so this is the parity, read from the
plan rather than chosen by the user) with the rank class the step's launches are planned for
(``LaunchViews.rank_bound``: a graph of rank-16 kernels must not replay a step holding a rank-64
adapter), and by whether any row has an adapter (a step with none launches no delta, so its graph
records none). Captures share one memory pool.
"""

from __future__ import annotations

from .kv_cache import step_inputs


def buffer_address(a) -> int:
    """Where an addressing view's memory starts (CuPy, torch or NumPy)."""
    if hasattr(a, "data_ptr"):
        return int(a.data_ptr())
    data = getattr(a, "data", None)
    if hasattr(data, "ptr"):
        return int(data.ptr)
    return int(a.ctypes.data)


def buffers_key(views) -> tuple:
    """Which fixed addressing buffers one grouping's launch views are, and what their launches are
    planned for: their capture bucket, parity and rank bound where the views say so, else where
    their arrays start."""
    if hasattr(views, "parity"):
        return (views.bucket, views.parity, getattr(views, "rank_bound", None))
    return tuple(buffer_address(a) for a in views)


class DecodeGraphs:
    """CUDA graphs of ``gen``'s decode step, one per (bucket, addressing buffers, active).

    ``capture=False`` runs the same static step eagerly instead of replaying it (any device):
    what a graph would record, checked where no graph can be captured.
    """

    def __init__(self, gen, capture: bool = True):
        import torch

        self.gen = gen
        n = gen.max_batch
        spec = gen.pool.spec
        self.rows = spec.bucket_for(n)
        if self.rows > gen.cache.rows:
            raise ValueError(f"max_batch {n} falls in capture bucket {self.rows}, but the cache has "
                             f"{gen.cache.rows} rows: pick a max_batch that is one of {spec.capture_buckets}")
        dev = gen.torch_device
        # a step's tokens (row 0) and cache lengths (row 1): staged in host memory (pinned on CUDA)
        # and copied in with one asynchronous copy
        self._staged = torch.zeros((2, self.rows), dtype=torch.long, pin_memory=torch.device(dev).type == "cuda")
        self._inputs = torch.zeros((2, self.rows), dtype=torch.long, device=dev)
        self.ids = self._inputs[0].unsqueeze(1)
        self.lengths = self._inputs[1]
        self.dtype = next(gen.model.parameters()).dtype
        self.out = torch.zeros(self.rows, dtype=torch.long, device=dev)
        self._graphs: dict[tuple, object] = {}
        self.capture = capture
        self.captures = 0
        self.replays = 0
        self.last = None  # the graph replayed last (the e2e benchmark times its replays)

    def _decode(self, bucket: int) -> None:
        """The step as captured: the forward of rows ``0..bucket-1`` and their greedy tokens."""
        import torch

        gen = self.gen
        si = step_inputs(self.lengths[:bucket], 1, gen.max_len, gen.max_len, self.dtype, window=gen.window,
                         layer_types=gen.layer_types)
        gen.cache.begin(si.write_cols, gen.max_len)
        with torch.inference_mode(), gen.adding():
            out = gen.decoder(input_ids=self.ids[:bucket], attention_mask=si.mask, position_ids=si.position_ids,
                              use_cache=True, **{gen._cache_kw: gen.cache})
            logits = gen.lm_head(out.last_hidden_state[:, -1])
            self.out[:bucket].copy_(logits.argmax(-1))

    def _capture(self, bucket: int):
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: workspaces, kernel loads; the writes repeat the step's own
            for _ in range(2):
                self._decode(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the pool's reader thread may be reading an adapter meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._decode(bucket)
        self.captures += 1
        return graph

    def run(self, B: int, tokens: list[int], lengths: list[int], ctx) -> list[int]:
        """Replay (capturing first if new) the decode graph of ``B`` rows; their greedy tokens."""
        import torch

        pool = self.gen.pool
        bucket = pool.spec.bucket_for(B)
        staged = self._staged.numpy()  # free to rewrite: the last step's copy ended before its tokens were read
        staged[:, B:] = 0
        staged[0, :B] = tokens
        staged[1, :B] = lengths
        self._inputs.copy_(self._staged, non_blocking=True)
        plan = ctx.plan_results.get(pool)
        active = plan is not None and plan.active
        where = tuple(buffers_key(plan.launch[g]) for g in sorted(plan.launch)) if active else ()
        key = (bucket, where, active)
        if not self.capture:
            self._graphs.setdefault(key, None)
            self._decode(bucket)
            self.replays += 1
            return self.out[:B].tolist()
        pool.close_halves()  # v left by a forward that raised mid-group: zeroed before a replay reads it
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(bucket)
        graph.replay()
        self.last = graph
        self.replays += 1
        return self.out[:B].tolist()

    @property
    def keys(self) -> list[tuple]:
        """The (bucket, addressing buffers, active) keys met so far: one graph each."""
        return list(self._graphs)

    def close(self) -> None:
        self._graphs.clear()
