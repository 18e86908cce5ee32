"""A small model that drives the worker: a decode chain on a LoRA pool and a KV cache, and a codec.

- The ``"llm"`` node decodes one token per request per step. Its state lives in the paged KV
  cache: token ``p`` reads the hidden row token ``p - 1`` wrote (the first reads its prompt's
  embedding), runs ``num_layers`` layers ``x = tanh(x @ W[l].T + delta_l(x))``, where ``delta_l``
  is the pool's ``down_proj`` delta at layer ``l``, writes its row to the cache and emits
  ``argmax(x[:vocab])``. A step reads and writes only fixed buffers per (capture bucket, parity),
  so it can be captured in a CUDA graph.
- The ``"codec"`` node turns a window of generated tokens (every ``window`` tokens of a
  request, at most ``max_window``) into a vector: ``v = mean_t C[token_t]``, then
  ``v = tanh(v @ Wc[l])`` for each of ``codec_layers``; fixed buffers per bucket of windows.

``Faults`` holds the controls the tests use on the cpu: a gate and a delay per lane (a host
stream's job waits on them) and failures to inject. Every output records whether its step's
device work had run before it was read, so a postprocess before landing shows.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..spec import LoraSpec, LoraTarget
from .scheduler import CHAIN_LANE, SIDE_LANE

CHAIN_NODE = "llm"
CODEC_NODE = "codec"
TARGET = "down_proj"


class InjectedFault(RuntimeError):
    """A failure the tests inject into a step's device work."""


def decode_spec(hidden: int = 32, num_layers: int = 2, num_slots: int = 4, max_rank: int = 8,
                dtype: str = "float32", buckets=(4, 16, 64)) -> LoraSpec:
    """The pool spec of the decode chain: one ``down_proj`` target per layer, ``hidden`` wide."""
    return LoraSpec((LoraTarget(TARGET, hidden, hidden, num_layers),), num_slots=num_slots, max_rank=max_rank,
                    dtype=dtype, capture_buckets=buckets, node=CHAIN_NODE)


class Faults:
    """Per lane: a gate the lane's device work waits on, a delay, and failures to inject."""

    def __init__(self):
        self.gates = {CHAIN_LANE: threading.Event(), SIDE_LANE: threading.Event()}
        for g in self.gates.values():
            g.set()
        self.delay = {CHAIN_LANE: 0.0, SIDE_LANE: 0.0}
        self.fail_next = {CHAIN_LANE: 0, SIDE_LANE: 0}
        self._lock = threading.Lock()

    def hold(self, lane: int) -> None:
        self.gates[lane].clear()

    def release(self, lane: int) -> None:
        self.gates[lane].set()

    def enter(self, lane: int) -> None:
        """What a lane's device job does first: wait at the gate, sleep, maybe fail."""
        if not self.gates[lane].wait(30):
            raise TimeoutError(f"lane {lane}'s gate stayed closed")
        if self.delay[lane]:
            time.sleep(self.delay[lane])
        with self._lock:
            if self.fail_next[lane] > 0:
                self.fail_next[lane] -= 1
                raise InjectedFault(f"injected failure on lane {lane}")


@dataclass
class StepOutput:
    """What a step wrote (device arrays) and whether its device work has run."""

    arrays: dict
    rows: int
    landed: bool = False
    extra: dict = field(default_factory=dict)


class DecodeModel:
    """The decode chain (``llm`` on ``pool`` and ``kv``) and the codec node, on ``pool.device``."""

    chain_node = CHAIN_NODE
    side_node = CODEC_NODE

    def __init__(self, pool, kv, vocab: int = 16, codec_width: int = 16, codec_layers: int = 1, max_window: int = 16,
                 torch_layers: bool = False, seed: int = 0, gain: float = 1.0):
        self.pool, self.kv = pool, kv
        self.device = pool.device
        self.xp = self.device.xp
        t = pool.spec.target(TARGET)
        self.hidden, self.num_layers = t.in_features, t.num_layers
        if kv.width != self.hidden:
            raise ValueError(f"the KV cache is {kv.width} wide, the model {self.hidden}")
        if not 1 <= vocab <= self.hidden:
            raise ValueError(f"vocab must be in [1, {self.hidden}], got {vocab}")
        self.vocab, self.codec_width, self.codec_layers = vocab, codec_width, codec_layers
        self.max_window = max_window
        rng = np.random.default_rng(seed)
        H = self.hidden
        # gain < 1 makes each tanh layer contract, so a kernel's rounding stays bounded over a
        # long decode instead of growing step by step (a float64 reference stays comparable)
        self.host_w = (gain * rng.standard_normal((self.num_layers, H, H)) / np.sqrt(H)).astype(np.float32)  # [L, out, in]
        self.host_embed = rng.standard_normal((vocab, H)).astype(np.float32)  # prompt embeddings
        self.host_codebook = rng.standard_normal((vocab, codec_width)).astype(np.float32)
        self.host_wc = (gain * rng.standard_normal((codec_layers, codec_width, codec_width)) /
                        np.sqrt(codec_width)).astype(np.float32)
        self.wt = [self._dev(np.ascontiguousarray(self.host_w[l].T)) for l in range(self.num_layers)]  # [in, out]
        self.codebook = self._dev(self.host_codebook)
        self.wc = [self._dev(self.host_wc[l]) for l in range(codec_layers)]
        self.deltas = [pool.layer_delta(TARGET, l) for l in range(self.num_layers)]
        self.buckets = pool.spec.capture_buckets
        self._bufs: dict[tuple, dict] = {}
        self._window_cols = np.arange(max_window)  # [K]
        self.faults = Faults()
        self.early_reads = 0
        # torch_layers: the matmuls (chain and codec) run in torch on the lane's stream, on views
        # of the same buffers (DLPack on cuda, shared memory on the cpu); the deltas stay the
        # pool's. Always so on cuda: CuPy refuses cuBLAS calls inside a stream capture.
        self.torch_layers = torch_layers or self.device.is_cuda
        self._torch_streams: dict[int, object] = {}
        self.wt_torch = [self._as_torch(w) for w in self.wt] if self.torch_layers else None
        self.wc_torch = [self._as_torch(w) for w in self.wc] if self.torch_layers else None

    def _dev(self, a: np.ndarray):
        return a.copy() if not self.device.is_cuda else self.device.xp.asarray(a)

    def _as_torch(self, a):
        """A torch view of a device array, no copy (made once, outside any capture)."""
        import torch

        return torch.from_dlpack(a) if self.device.is_cuda else torch.from_numpy(a)

    def _torch_matmul(self, x, w, y) -> None:
        """``y = x @ w`` in torch (views of device buffers), on the current CuPy stream (an
        ExternalStream on cuda)."""
        import torch

        if not self.device.is_cuda:
            torch.matmul(x, w, out=y)
            return
        ptr = self.xp.cuda.get_current_stream().ptr
        ext = self._torch_streams.get(ptr)
        if ext is None:
            ext = self._torch_streams[ptr] = torch.cuda.ExternalStream(ptr, device=x.device)
        with torch.cuda.stream(ext):
            torch.matmul(x, w, out=y)

    # -- the chain -------------------------------------------------------------------------------
    def buffers(self, bucket: int, parity: int) -> dict:
        """The fixed buffers of one (bucket, parity): inputs, work and outputs."""
        key = (bucket, parity)
        b = self._bufs.get(key)
        if b is None:
            H, z = self.hidden, self.device.zeros
            b = self._bufs[key] = {
                "rd": z(bucket * H, np.int64), "wr": z(bucket * H, np.int64),  # flat KV cells read / written
                "keep": z((bucket, 1), np.float32),  # 0 for a request's first token
                "x0": z((bucket, H), np.float32),  # its prompt's embedding there, else 0
                "x": z((bucket, H), np.float32), "y": z((bucket, H), np.float32),
                "tok": z(bucket, np.int64),
            }
            if self.torch_layers:
                b["torch"] = (self._as_torch(b["x"]), self._as_torch(b["y"]))
        return b

    def output(self, bufs: dict, rows: int) -> StepOutput:
        return StepOutput(bufs, rows)

    def stage(self, rows, bucket: int):
        """Host inputs of a step: ``rows`` = [(rid, position, prompt)], from the KV page tables.
        Padding rows read and write the null page's first row."""
        H, n = self.hidden, len(rows)
        rids = [r[0] for r in rows]
        pos = np.fromiter((r[1] for r in rows), np.int64, n)
        prompts = np.fromiter((r[2] for r in rows), np.int64, n)
        cols = np.arange(H, dtype=np.int64)
        rd = np.zeros((bucket, H), np.int64)
        wr = np.zeros((bucket, H), np.int64)
        keep = np.zeros((bucket, 1), np.float32)
        x0 = np.zeros((bucket, H), np.float32)
        wr[:n] = self.kv.slots_of(rids, pos)[:, None] * H + cols
        rd[:n] = self.kv.slots_of(rids, pos - 1)[:, None] * H + cols  # a first token reads the null row
        first = pos == 0
        keep[:n, 0] = ~first
        x0[:n][first] = self.host_embed[prompts[first] % self.vocab]
        return {"rd": rd.reshape(-1), "wr": wr.reshape(-1), "keep": keep, "x0": x0, "n": n}

    def load_inputs(self, bufs: dict, staged: dict, keys=("rd", "wr", "keep", "x0")) -> None:
        """Copy a step's staged inputs into its buffers, on the current stream."""
        for k in keys:
            if self.device.is_cuda:
                bufs[k].set(staged[k])
            else:
                np.copyto(bufs[k], staged[k])

    def forward(self, bufs: dict) -> None:
        """The chain step's device work: reads and writes only ``bufs``, the KV cache and the
        pool's current plan (capturable)."""
        xp, kv = self.xp, self.kv.kv.reshape(-1)
        x, y = bufs["x"], bufs["y"]
        xp.take(kv, bufs["rd"], out=x.reshape(-1))
        xp.multiply(x, bufs["keep"], out=x)
        xp.add(x, bufs["x0"], out=x)
        for layer in range(self.num_layers):
            if self.torch_layers:
                self._torch_matmul(*bufs["torch"][:1], self.wt_torch[layer], bufs["torch"][1])
            else:
                xp.matmul(x, self.wt[layer], out=y)
            self.deltas[layer](y, x)
            xp.tanh(y, out=x)
        xp.put(kv, bufs["wr"], x.reshape(-1))
        xp.argmax(x[:, :self.vocab], axis=1, out=bufs["tok"])

    def read(self, out: StepOutput) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens[n], hidden[n, H])`` of a landed chain step."""
        self._check_landed(out)
        n = out.rows
        tok, x = out.arrays["tok"][:n], out.arrays["x"][:n]
        if self.device.is_cuda:
            return tok.get(), x.get()
        return tok.copy(), x.copy()

    # -- the codec -----------------------------------------------------------------------------
    def codec_buffers(self, bucket: int, parity: int = 0) -> dict:
        """The codec's fixed buffers for up to ``bucket`` windows of up to ``max_window`` tokens:
        on the device, and their host side (pinned on cuda, so the copies in and out do not block):
        ``ids_host``/``mask_host`` staged inputs, ``v_host`` the landed output. A step of one key
        rewrites them only once the step before it of that key has landed (one side step in
        flight; the chain alternates parity two steps deep).

        The inputs are views of one block per side (``in`` on the device, ``in_host``: the ids,
        then the mask), so a step copies them in with one copy; on cuda the copies' addresses are
        taken once, here (``copy_ptrs``)."""
        key = ("codec", bucket, parity)
        b = self._bufs.get(key)
        if b is None:
            K, C, z, h = self.max_window, self.codec_width, self.device.zeros, self.device.host_zeros
            n_ids = bucket * K * 8  # bytes of the ids (int64); the mask (float32) follows
            raw, raw_host = z(n_ids + bucket * K * 4, np.uint8), h(n_ids + bucket * K * 4, np.uint8)
            b = self._bufs[key] = {"in": raw, "in_host": raw_host,
                                   "ids": raw[:n_ids].view(np.int64),
                                   "mask": raw[n_ids:].view(np.float32).reshape(bucket, K, 1),
                                   "emb": z((bucket * K, C), np.float32), "v": z((bucket, C), np.float32),
                                   "t": z((bucket, C), np.float32),
                                   "ids_host": raw_host[:n_ids].view(np.int64),
                                   "mask_host": raw_host[n_ids:].view(np.float32).reshape(bucket, K, 1),
                                   "v_host": h((bucket, C), np.float32)}
            b["ids_rows"], b["mask_rows"] = b["ids_host"].reshape(bucket, K), b["mask_host"][..., 0]
            if self.device.is_cuda:  # (in: device, host, bytes), (out: device, host, bytes a row)
                b["copy_ptrs"] = (raw.data.ptr, raw_host.ctypes.data, raw.nbytes,
                                  b["v"].data.ptr, b["v_host"].ctypes.data, C * 4)
            if self.torch_layers:
                b["torch"] = (self._as_torch(b["v"]), self._as_torch(b["t"]))
        return b

    def codec_stage(self, windows, bufs: dict) -> int:
        """Write a codec step's host inputs into ``bufs``: each window's token ids, left-aligned
        in its row of ``max_window`` (0 after), and its averaging weights (``1/len`` over its
        tokens, 0 after); the padding rows are zeroed. Returns the number of windows.

        Windows of one length (the usual case) take one conversion, and where the step before
        on these buffers had windows of that length too, only the rows whose count changed are
        rewritten besides the ids (``bufs["staged"]``: that step's ``(windows, length)``)."""
        K, n = self.max_window, len(windows)
        ids, mask = bufs["ids_rows"], bufs["mask_rows"]  # [bucket, K] views of the host inputs
        lens = list(map(len, windows))
        lo, hi = (min(lens), max(lens)) if lens else (1, 1)
        if lo < 1 or hi > K:
            raise ValueError(f"a codec window of {lo if lo < 1 else hi} tokens (at most {K})")
        staged, bufs["staged"] = bufs.get("staged"), None  # unknown until written through
        if lo == hi and staged is not None and staged[1] == hi:
            ids[:n, :hi] = windows  # the rest of these rows is 0 already, their weights 1/hi or set here
            m = staged[0]
            if n > m:
                mask[m:n, :hi] = 1.0 / hi
            elif n < m:
                ids[n:m] = 0
                mask[n:m] = 0
        else:
            if lo == hi:
                ids[:n, :hi] = windows
                mask[:n, :hi] = 1.0 / hi
                ids[:n, hi:] = 0
                mask[:n, hi:] = 0
            else:
                ln = np.array(lens)[:, None]  # [n, 1]
                valid = self._window_cols < ln  # [n, K]: a window's tokens
                ids[:n] = 0
                ids[:n][valid] = np.fromiter(itertools.chain.from_iterable(windows), np.int64, sum(lens))  # C order
                np.multiply(valid, 1.0 / ln, out=mask[:n])
            ids[n:] = 0
            mask[n:] = 0
        if lo == hi:
            bufs["staged"] = (n, hi)
        return n

    def codec_forward(self, bufs: dict) -> None:
        """The codec's device work: reads and writes only ``bufs`` (capturable)."""
        xp = self.xp
        n, K, C = bufs["v"].shape[0], self.max_window, self.codec_width
        emb, v, t = bufs["emb"], bufs["v"], bufs["t"]
        xp.take(self.codebook, bufs["ids"], axis=0, out=emb)
        e3 = emb.reshape(n, K, C)
        xp.multiply(e3, bufs["mask"], out=e3)
        xp.sum(e3, axis=1, out=v)
        for layer in range(self.codec_layers):
            if self.torch_layers:
                self._torch_matmul(bufs["torch"][0], self.wc_torch[layer], bufs["torch"][1])
            else:
                xp.matmul(v, self.wc[layer], out=t)
            xp.tanh(t, out=v)

    def codec(self, windows, parity: int = 0, graphs=None) -> StepOutput:
        """A codec step for ``windows`` (each a sequence of token ids) on the current stream:
        its inputs staged and copied in (one copy), its device work (under ``graphs``, keyed by
        bucket, if given), then its output copied to the host, all in stream order, so that once
        the step has landed :meth:`read_codec` reads host memory only."""
        n = len(windows)
        spec = self.pool.spec
        if n <= spec.max_tokens:
            bucket = spec.bucket_for(n)
        else:  # more windows than the largest bucket: eager, in buffers of the next power of two
            bucket, graphs = 1 << (n - 1).bit_length(), None  # (not a buffer set per count)
        bufs = self.codec_buffers(bucket, parity)
        self.codec_stage(windows, bufs)
        ptrs = bufs.get("copy_ptrs")
        if ptrs is None:
            np.copyto(bufs["in"], bufs["in_host"])
        else:
            self._memcpy_async(ptrs[0], ptrs[1], ptrs[2], True)
        if graphs is None:
            self.codec_forward(bufs)
        else:
            graphs.launch(("codec", bucket, parity), lambda: self.codec_forward(bufs))
        if ptrs is None:
            np.copyto(bufs["v_host"][:n], bufs["v"][:n])
        else:
            self._memcpy_async(ptrs[4], ptrs[3], n * ptrs[5], False)
        return StepOutput(bufs, n)

    def _memcpy_async(self, dst: int, src: int, nbytes: int, host_to_device: bool) -> None:
        """An asynchronous copy of ``nbytes`` on the current stream (cuda), between a device
        buffer and a pinned host one."""
        from cupy.cuda import runtime

        kind = runtime.memcpyHostToDevice if host_to_device else runtime.memcpyDeviceToHost
        runtime.memcpyAsync(dst, src, nbytes, kind, self.xp.cuda.get_current_stream().ptr)

    def read_codec(self, out: StepOutput) -> np.ndarray:
        """``v[n, codec_width]`` of a landed codec step: a copy of its host output (no device
        access, so any thread may read it; the next step of its key overwrites the buffer)."""
        self._check_landed(out)
        return out.arrays["v_host"][:out.rows].copy()

    def _check_landed(self, out: StepOutput) -> None:
        if not out.landed:
            self.early_reads += 1
            raise AssertionError("a step's outputs were read before its device work had run")

    # -- references (float64, on the host) ------------------------------------------------------
    def reference(self, weights, prompt: int, n: int) -> np.ndarray:
        """``hidden[n, H]`` of a request decoded alone, from its adapter's weights
        (``AdapterWeights``, or None for the base model)."""
        tw = None if weights is None else weights.targets.get(TARGET)
        x = self.host_embed[prompt % self.vocab].astype(np.float64)
        out = np.zeros((n, self.hidden))
        for p in range(n):
            for layer in range(self.num_layers):
                y = self.host_w[layer].astype(np.float64) @ x
                if tw is not None:
                    r = int(tw.ranks[layer, 0])
                    a, b = tw.a[layer, 0, :r].astype(np.float64), tw.b[layer, :, :r].astype(np.float64)
                    y += float(tw.scaling[layer, 0]) * (b @ (a @ x))
                x = np.tanh(y)
            out[p] = x
        return out

    def codec_reference(self, window) -> np.ndarray:
        v = self.host_codebook[np.asarray(window)].astype(np.float64).mean(axis=0)
        for layer in range(self.codec_layers):
            v = np.tanh(v @ self.host_wc[layer].astype(np.float64))
        return v


class RandomAdapters:
    """A reader of in-memory adapters for the decode chain: ``ranks[name]`` per adapter, weights
    random and seeded by name (no files; the pool's ``reader=``), ``B`` scaled by ``scale``.
    Unknown names fail to read."""

    def __init__(self, ranks: dict, seed: int = 0, scale: float = 1.0):
        self.ranks = dict(ranks)
        self.seed = seed
        self.scale = scale

    def __call__(self, path, spec: LoraSpec, name=None):
        from ..adapter import AdapterWeights, TargetWeights

        if name not in self.ranks:
            raise FileNotFoundError(f"no adapter {name!r} at {path}")
        t = spec.target(TARGET)
        r = int(self.ranks[name])
        rng = np.random.default_rng([self.seed, *map(ord, str(name))])
        L, H = t.num_layers, t.in_features
        tw = TargetWeights(a=(rng.standard_normal((L, 1, r, H)) / np.sqrt(H)).astype(np.float32),
                           b=(self.scale * rng.standard_normal((L, H, r)) / np.sqrt(r)).astype(np.float32),
                           ranks=np.full((L, 1), r, np.int32),
                           scaling=rng.uniform(0.5, 2.0, (L, 1)).astype(np.float32))
        return AdapterWeights(name, str(path), f"random-{name}", {TARGET: tw})


@dataclass
class DecodeEngine:
    """A worker with its pool, KV cache and model (:func:`decode_engine`)."""

    worker: object
    pool: object
    kv: object
    model: DecodeModel

    def close(self) -> None:
        self.worker.close()
        self.pool.close()


def decode_engine(pool, *, num_pages: int = 17, page_size: int = 4, side_lane: bool = True, graphs: bool = True,
                  codec_width: int = 16, codec_layers: int = 1, vocab: int = 16, max_window: int = 16,
                  torch_layers: bool = False, seed: int = 0, gain: float = 1.0, **worker_options) -> DecodeEngine:
    """The decode chain on ``pool`` (built on :func:`decode_spec`) and a KV cache of
    ``num_pages`` pages, with the codec on the side lane (``side_lane``) or on the chain, on the
    pool's device; built through ``EngineManager.build``."""
    from .kv import PagedKVCache
    from .manager import EngineManager

    kv = PagedKVCache(num_pages, page_size, pool.spec.target(TARGET).in_features, node=CHAIN_NODE,
                      device=pool.device)
    model = DecodeModel(pool, kv, vocab=vocab, codec_width=codec_width, codec_layers=codec_layers,
                        max_window=max_window, torch_layers=torch_layers, seed=seed, gain=gain)
    groups = [{"name": "codec", "nodes": [CODEC_NODE], "side_stream": side_lane}]
    worker = EngineManager.build(model, [pool, kv], pool.device, groups, graphs=graphs, **worker_options)
    return DecodeEngine(worker, pool, kv, model)
