"""The worker on a CUDA device: side steps really overlap chain steps (CUDA event times of side steps
fall inside chain steps), the chain's outputs match the float64 reference with graphs captured and
replayed, and the codec's windows match theirs."""

from __future__ import annotations

import numpy as np
import pytest

from lora_cupy.device import Device
from lora_cupy.engine.decode_model import RandomAdapters, decode_engine, decode_spec
from lora_cupy.engine.scheduler import CHAIN_LANE, SIDE_LANE
from lora_cupy.engine.streams import CHAIN_PRIORITY
from lora_cupy.engine.worker import Request
from lora_cupy.pool import LoraAdapterPool


def _cuda_devices() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, or no device
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_devices() == 0, reason="needs a CUDA device")]

ADAPTERS = {"a0": 16, "a1": 8, "a2": 3, "a3": 12}


def make(side_lane=True, graphs=True, codec_layers=24, hidden=256, num_layers=4, torch_layers=False, seed=0):
    import cupy

    dev = Device("cuda:0", stream=cupy.cuda.Stream(non_blocking=True, priority=CHAIN_PRIORITY))  # its own, for capture
    reader = RandomAdapters(ADAPTERS, seed=seed, scale=0.2)  # with gain 0.5 below: each layer contracts
    spec = decode_spec(hidden=hidden, num_layers=num_layers, num_slots=len(ADAPTERS) + 1, max_rank=16,
                       buckets=(8, 16, 32, 64))
    pool = LoraAdapterPool(spec, dev, reader=reader, adapters={n: f"memory:{n}" for n in ADAPTERS})
    eng = decode_engine(pool, num_pages=32 * 4 + 1, page_size=16, side_lane=side_lane, graphs=graphs,
                        codec_width=1024, codec_layers=codec_layers, vocab=64, torch_layers=torch_layers, seed=seed,
                        gain=0.5)  # contracting layers: float32 kernels' rounding does not grow over 48 tokens
    eng.reader = reader
    return eng


def requests(n=32, tokens=48, window=8, tag=""):
    names = [None, *ADAPTERS]
    return [Request(f"{tag}{i}", names[i % len(names)], prompt=i, max_new_tokens=tokens, window=window)
            for i in range(n)]


def check(eng, reqs, futs):
    for r, f in zip(reqs, futs):
        res = f.result()
        w = None if r.adapter is None else eng.reader("memory", eng.pool.spec, name=r.adapter)
        ref = eng.model.reference(w, r.prompt, r.max_new_tokens)
        np.testing.assert_allclose(np.array(res.hidden), ref, atol=2e-3, rtol=0, err_msg=f"request {r.rid}")
        for k, v in enumerate(res.windows):
            cut = res.tokens[k * r.window:(k + 1) * r.window]
            np.testing.assert_allclose(v, eng.model.codec_reference(cut), atol=2e-3)


def test_side_steps_run_inside_chain_steps():
    """Each side step's CUDA events against the chain steps': intervals on two streams intersect
    only where the device ran both at once (serialized streams would give disjoint intervals).

    The chain here has 96 layers in each step's graph, so its steps are long on the device next
    to the host work that issues them, and a side step issued behind the chain's next launch
    finds a chain step on the device. (With a chain of few layers, host-bound, a side step may
    instead fill the chain's idle gaps between steps, which is what the chain wants: at 8 layers
    on an H200, 5 of 16 side steps overlapped a chain step.)"""
    eng = make(hidden=256, num_layers=96, codec_layers=48)
    try:
        w = eng.worker
        for rep in range(2):  # the first run compiles and captures
            w.marks.clear()
            reqs = requests(tag=f"{rep}-")
            futs = [w.submit(r) for r in reqs]
            w.drain(timeout=120)
            check(eng, reqs, futs)
        chain = [(s, e) for lane, _q, s, e in w.marks if lane == CHAIN_LANE]
        side = [(s, e) for lane, _q, s, e in w.marks if lane == SIDE_LANE]
        assert side and chain and len(w.chain.graphs) > 0
        t0 = chain[0][0]
        spans = [(s.seconds_since(t0), e.seconds_since(t0)) for s, e in chain]
        last = spans[-1][1]
        overlapping = 0
        inside = total = 0.0
        for s, e in side:
            a, b = s.seconds_since(t0), e.seconds_since(t0)
            if b > last:
                continue  # after the chain's last step: nothing to overlap
            total += b - a
            both = sum(max(0.0, min(b, c1) - max(a, c0)) for c0, c1 in spans)
            inside += both
            overlapping += both > 0
        during = sum(1 for s, e in side if e.seconds_since(t0) <= last)
        print(f"side steps during the chain: {during}, {overlapping} of them overlap chain steps; "
              f"{total * 1e3:.2f} ms on the lane, {inside * 1e3:.2f} ms of it inside chain steps")
        assert during >= 4
        assert overlapping >= during // 2, "side steps did not run while chain steps were on the device"
        assert inside > 0
    finally:
        eng.close()


def test_graph_replays_match_eager_and_the_reference():
    outs = {}
    for graphs in (True, False):
        eng = make(side_lane=True, graphs=graphs, codec_layers=2)
        try:
            w = eng.worker
            for rep in range(3):
                reqs = requests(n=20, tokens=12, window=4, tag=f"{rep}-")
                futs = [w.submit(r) for r in reqs]
                w.drain(timeout=120)
                check(eng, reqs, futs)
            outs[graphs] = [np.array(f.result().hidden) for f in futs]
            if graphs:
                assert sum(w.chain.graphs.captures.values()) > 0, "no chain step was captured"
                assert all(n == 1 for n in w.chain.graphs.captures.values())
                side = w.side_lanes[SIDE_LANE].graphs
                assert sum(side.captures.values()) > 0, "no side step was captured on the lane's stream"
            else:
                assert not w.chain.graphs.captures
        finally:
            eng.close()
    for a, b in zip(outs[True], outs[False]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_torch_layers_on_the_chain_stream_through_dlpack():
    """Base matmuls in torch (ExternalStream on the chain's CuPy stream, DLPack views of its
    buffers), captured with the pool's kernels in one graph per key: outputs match the reference."""
    eng = make(torch_layers=True, codec_layers=2)
    try:
        w = eng.worker
        for rep in range(3):
            reqs = requests(n=16, tokens=10, window=5, tag=f"{rep}-")
            futs = [w.submit(r) for r in reqs]
            w.drain(timeout=120)
            check(eng, reqs, futs)
        assert sum(w.chain.graphs.captures.values()) > 0
    finally:
        eng.close()


def _pinned(arr) -> bool:
    from cupy.cuda import runtime

    attrs = runtime.pointerGetAttributes(arr.ctypes.data)
    kind = getattr(attrs, "type", None)
    if kind is None:  # older CuPy names it after the CUDA field
        kind = attrs.memoryType
    return kind == 1  # cudaMemoryTypeHost: page-locked, so the copies from and to it are asynchronous


def test_codec_copies_through_pinned_buffers_on_the_current_stream():
    """A codec step on a stream of its own: inputs staged in pinned host buffers and copied in,
    the output copied back, all on that stream; once its event has landed, read_codec (host memory
    only) matches the reference, and a smaller step after a larger one of a bucket reads no stale
    row."""
    import cupy

    eng = make(codec_layers=2)
    try:
        m = eng.model
        stream = cupy.cuda.Stream(non_blocking=True)
        rng = np.random.default_rng(3)
        for sizes in ([16] * 7, [3, 16, 1, 7, 16], [2], [16] * 70):  # buckets 8, 8, 8, then past the largest
            wins = [tuple(int(t) for t in rng.integers(0, m.vocab, k)) for k in sizes]
            with cupy.cuda.Device(0), stream:
                out = m.codec(wins)
                done = stream.record()
            done.synchronize()
            out.landed = True
            vecs = m.read_codec(out)
            assert vecs.shape == (len(wins), m.codec_width)
            for v, win in zip(vecs, wins):
                np.testing.assert_allclose(v, m.codec_reference(win), atol=2e-3)
        b = m.codec_buffers(8)
        assert all(_pinned(b[k]) for k in ("ids_host", "mask_host", "v_host"))
        assert (b["ids_host"].reshape(8, m.max_window)[1:] == 0).all()
        # the inputs are views of one block a side, copied in with one copy, at the addresses taken once
        assert b["ids"].data.ptr == b["in"].data.ptr and b["ids_host"].ctypes.data == b["in_host"].ctypes.data
        assert b["mask"].data.ptr == b["in"].data.ptr + b["ids"].nbytes
        assert b["copy_ptrs"] == (b["in"].data.ptr, b["in_host"].ctypes.data, b["in"].nbytes,
                                  b["v"].data.ptr, b["v_host"].ctypes.data, m.codec_width * 4)
        np.testing.assert_array_equal(b["ids"].get(), b["ids_host"])
        np.testing.assert_array_equal(b["mask"].get(), b["mask_host"])
    finally:
        eng.close()


def test_windows_on_the_chain_match_the_reference_with_graphs():
    """No side lane: codec steps run on the chain's stream, their buffers (host side included)
    alternating by parity two steps deep, under graphs captured there."""
    eng = make(side_lane=False, codec_layers=2)
    try:
        w = eng.worker
        assert not w.side_lanes
        for rep in range(3):
            reqs = requests(n=20, tokens=12, window=4, tag=f"{rep}-")
            futs = [w.submit(r) for r in reqs]
            w.drain(timeout=120)
            check(eng, reqs, futs)
        assert any(k[0] == "codec" for k in w.chain.graphs.captures), "no codec step was captured on the chain"
        assert eng.model.early_reads == 0
    finally:
        eng.close()


def test_run_marked_records_both_marks_on_the_lane_stream_around_its_work():
    """``LaneStream.run_marked`` on cuda: the work is launched now with the lane's stream current,
    between two timing events recorded on that stream, under one activation of the device."""
    import cupy

    from lora_cupy.engine.streams import LaneStream

    dev = Device("cuda:0")
    lane = LaneStream(dev, name="side-test")
    x = cupy.zeros(1 << 22, cupy.float32)
    cupy.cuda.get_current_stream().synchronize()  # the lane's stream does not wait for this one
    seen = []

    def work():
        seen.append(cupy.cuda.get_current_stream().ptr)
        for _ in range(20):
            cupy.add(x, 1, out=x)
    start, landed = lane.run_marked(work, notify=lambda: seen.append("notified"))
    assert seen == [lane.stream.ptr], "the work ran now, on the lane's stream, and nothing is notified on cuda"
    landed.synchronize()
    assert start.done and landed.done
    assert landed.seconds_since(start) > 0
    assert float(x[0]) == 20.0

    def fails():
        raise ValueError("launch failed")
    with pytest.raises(ValueError):
        lane.run_marked(fails)  # a launch that raises raises here, on the issuing thread
    lane.close()
