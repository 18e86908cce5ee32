"""The side-step lane on the cpu (its own host stream): never postprocessed before landing, windows
that come ready meanwhile batch into the next step, the chain never waits on it, a failing side
step fails only its requests."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from lora_cupy.engine.decode_model import InjectedFault
from lora_cupy.engine.scheduler import CHAIN_LANE, SIDE_LANE, MicroScheduler
from lora_cupy.engine.side_steps import SideStepLane
from lora_cupy.engine.worker import Request
from tests.test_worker import check_empty, check_result, make_engine, run_until


@pytest.fixture
def eng():
    e = make_engine()
    yield e
    e.model.faults.release(CHAIN_LANE)
    e.model.faults.release(SIDE_LANE)
    e.close()


def side_steps(w):
    return [t for t in w.trace if t[0] == "submit" and t[1] == SIDE_LANE]


def test_lane_of_hands_each_lane_only_its_keys():
    s = MicroScheduler(side_nodes=["codec"])
    assert s.lane_of(("r", "codec")) == SIDE_LANE and s.lane_of(("r", "llm")) == CHAIN_LANE
    s.put(("r", "codec"), 1)
    s.put(("q", "llm"), 2)
    s.put(("r", "codec"), 3)
    assert s.take(CHAIN_LANE) == [(("q", "llm"), [2])]
    assert s.take(SIDE_LANE) == [(("r", "codec"), [1, 3])]
    assert s.take(SIDE_LANE) == []
    s.put_many([(("r", "codec"), 4), (("q", "llm"), 5), (("r", "codec"), 6), (("p", "codec"), 7)])
    assert s.take(SIDE_LANE) == [(("r", "codec"), [4, 6]), (("p", "codec"), [7])], "in order, under their keys"
    assert s.take(CHAIN_LANE) == [(("q", "llm"), [5])]
    assert MicroScheduler().lane_of(("r", "codec")) == CHAIN_LANE, "no side lane: the chain runs it"


def test_finish_before_landing_never_postprocesses(eng):
    w = eng.worker
    lane = w.side_lanes[SIDE_LANE]
    eng.model.faults.hold(SIDE_LANE)
    f = w.submit(Request("r", "a0", max_new_tokens=2, window=2))
    run_until(w, lambda: lane.busy)
    gpu = ThreadPoolExecutor(1)
    for _ in range(20):
        lane.finish(block=False)
        lane.launch(gpu)  # one step in flight: a second launch does nothing
        w.run_once(block=False)
    gpu.shutdown()
    assert lane.busy and len(side_steps(w)) == 1
    assert not [t for t in w.trace if t[0] == "finish" and t[1] == SIDE_LANE]
    assert eng.model.early_reads == 0 and not f.done()
    eng.model.faults.release(SIDE_LANE)
    lane.finish(block=True)
    assert not lane.busy and eng.model.early_reads == 0
    w.drain()
    check_result(eng, Request("r", "a0", max_new_tokens=2, window=2), f.result())
    check_empty(eng)


def test_windows_that_arrive_while_a_step_is_in_flight_batch_into_the_next(eng):
    w = eng.worker
    lane = w.side_lanes[SIDE_LANE]
    eng.model.faults.hold(SIDE_LANE)
    reqs = [Request("x", "a1", prompt=1, max_new_tokens=6, window=1), Request("y", None, prompt=2, max_new_tokens=4,
                                                                             window=2)]
    futs = [w.submit(r) for r in reqs]
    run_until(w, lambda: lane.busy)
    first = side_steps(w)[0]
    # the side lane never blocks the chain: every token is decoded while its first step is held
    run_until(w, lambda: all(len(w._live[r.rid].tokens) == r.max_new_tokens for r in reqs))
    assert lane.busy and len(side_steps(w)) == 1
    assert w.scheduler.pending(SIDE_LANE) == 6 + 2 - len(first[3])
    eng.model.faults.release(SIDE_LANE)
    w.drain()
    steps = side_steps(w)
    assert len(steps) == 2, "everything that came ready meanwhile ran in one step"
    assert len(steps[1][3]) == 6 + 2 - len(first[3])
    for r, f in zip(reqs, futs):
        check_result(eng, r, f.result())
    # the lane's steps run under its own graphs, on its own stream, keyed by their bucket of windows
    assert lane.graphs.lane_stream is lane.stream
    assert {k[0] for k in lane.graphs.launches} == {"codec"} and sum(lane.graphs.launches.values()) == 2
    assert not any(k[0] == "codec" for k in w.chain.graphs.launches)
    check_empty(eng)


def test_windows_a_chain_step_cuts_go_to_the_side_lane_in_the_same_pass(eng):
    """run_once finishes and launches the chain first, then the side lane: the window a landed
    chain step completes is on the side lane when that pass returns, submitted after the chain's
    next step (the side lane's postprocess and launch never hold up the chain's)."""
    w = eng.worker
    lane = w.side_lanes[SIDE_LANE]
    eng.model.faults.hold(CHAIN_LANE)
    req = Request("r", "a1", prompt=3, max_new_tokens=3, window=1)
    f = w.submit(req)
    run_until(w, lambda: w.chain.busy)
    first = w.chain._steps[0]
    eng.model.faults.release(CHAIN_LANE)
    first.launched.result(timeout=10)
    first.landed.synchronize(10)
    assert not lane.busy and w.scheduler.pending(SIDE_LANE) == 0
    n = len(w.trace)
    w.run_once(block=False)
    events = [(e, lane_id) for e, lane_id, *_ in list(w.trace)[n:]]
    assert events[0] == ("finish", CHAIN_LANE), events
    assert lane.busy and w.scheduler.pending(SIDE_LANE) == 0, "the window waited for another pass"
    assert events.index(("submit", CHAIN_LANE)) < events.index(("submit", SIDE_LANE)), events
    w.drain()
    check_result(eng, req, f.result())
    check_empty(eng)


def test_codec_steps_reuse_their_host_buffers_and_read_copies(eng):
    """A codec step stages into its key's host buffers and copies its output back in stream
    order: a smaller step after a larger one of the same bucket leaves no stale row behind,
    windows of mixed lengths average over their own tokens, and what read_codec gives stays put
    when the buffer is reused."""
    m = eng.model
    rng = np.random.default_rng(7)
    kept = []
    for sizes in ([16, 16, 16], [3, 16, 1, 7, 16], [2], [5] * 70):  # buckets 4, 16, 4, then past the largest
        wins = [tuple(int(t) for t in rng.integers(0, m.vocab, k)) for k in sizes]
        out = m.codec(wins)
        with pytest.raises(AssertionError):
            m.read_codec(out)  # not landed: never read
        out.landed = True
        vecs = m.read_codec(out)
        assert vecs.shape == (len(wins), m.codec_width)
        assert not np.shares_memory(vecs, out.arrays["v_host"])
        kept.append((vecs.copy(), vecs, wins))
    for before, vecs, wins in kept:
        np.testing.assert_array_equal(vecs, before)
        for v, win in zip(vecs, wins):
            np.testing.assert_allclose(v, m.codec_reference(win), atol=1e-5)
    b = m.codec_buffers(4)
    ids, mask = b["ids_host"].reshape(4, m.max_window), b["mask_host"][..., 0]
    assert (ids[1:] == 0).all() and (mask[1:] == 0).all(), "padding rows of the last step are zero"
    assert (ids[0, 2:] == 0).all() and np.allclose(mask[0], [0.5, 0.5] + [0] * (m.max_window - 2))
    eng.model.early_reads = 0  # the unlanded reads above were this test's own
    with pytest.raises(ValueError, match="17 tokens"):
        m.codec([(1,) * 17])
    with pytest.raises(ValueError, match="0 tokens"):
        m.codec([(1, 2), ()])


def test_the_chain_runs_while_a_side_step_is_on_its_stream(eng):
    """Host-stream times: whole chain steps start and land inside one (slow) side step."""
    w = eng.worker
    eng.model.faults.delay[SIDE_LANE] = 0.2
    f = w.submit(Request("x", "a0", max_new_tokens=12, window=1))
    w.drain()
    f.result()
    side = [(s, e) for lane, _seq, s, e in w.marks if lane == SIDE_LANE]
    chain = [(s, e) for lane, _seq, s, e in w.marks if lane == CHAIN_LANE]
    start, end = side[0]
    assert end.seconds_since(start) >= 0.2
    inside = [1 for s, e in chain if s.seconds_since(start) >= 0 and end.seconds_since(e) >= 0]
    assert len(inside) >= 5, f"only {len(inside)} chain steps ran inside the first side step"
    check_empty(eng)


def test_a_side_step_that_raises_fails_its_requests_while_the_chain_carries_on(eng):
    w = eng.worker
    eng.model.faults.hold(SIDE_LANE)
    eng.model.faults.fail_next[SIDE_LANE] = 1
    a = w.submit(Request("a", "a0", max_new_tokens=3, window=3))
    run_until(w, lambda: w.side_lanes[SIDE_LANE].busy)
    b = w.submit(Request("b", "a1", prompt=4, max_new_tokens=5, window=0))
    c = w.submit(Request("c", "a2", prompt=7, max_new_tokens=4, window=2))
    run_until(w, lambda: b.done())  # the chain carries on while the failing step is held
    eng.model.faults.release(SIDE_LANE)
    w.drain()
    with pytest.raises(InjectedFault):
        a.result()
    check_result(eng, Request("b", "a1", prompt=4, max_new_tokens=5), b.result())
    check_result(eng, Request("c", "a2", prompt=7, max_new_tokens=4, window=2), c.result())
    check_empty(eng)


def test_without_a_side_lane_the_chain_runs_the_windows(eng):
    e = make_engine(side_lane=False)
    try:
        w = e.worker
        assert not w.side_lanes
        reqs = [Request(f"r{i}", ["a0", None][i % 2], prompt=i, max_new_tokens=5, window=2) for i in range(4)]
        futs = [w.submit(r) for r in reqs]
        w.drain()
        for r, f in zip(reqs, futs):
            check_result(e, r, f.result())
        lanes = {t[1] for t in w.trace if t[0] == "submit"}
        assert lanes == {CHAIN_LANE}
        assert w.stats["steps_codec"] >= 1 and w.stats["steps_llm"] >= 5
        assert sum(n for k, n in w.chain.graphs.launches.items() if k[0] == "codec") == w.stats["steps_codec"]
        assert w.stats["steps_lane0"] == w.stats["steps_llm"] + w.stats["steps_codec"], "codec steps on the chain"
        check_empty(e)
    finally:
        e.close()


def test_codec_stage_rewrites_only_what_changed_and_matches_a_fresh_staging(eng):
    """Steps of one length on one key's buffers rewrite only the rows whose count changed (the
    rest is as the step before left it): the host inputs always equal a fresh staging's."""
    m = eng.model
    K = m.max_window
    rng = np.random.default_rng(11)
    b = m.codec_buffers(8)
    for sizes in ([16] * 3, [16] * 2, [16] * 5, [16] * 5, [16] * 1, [5] * 3, [5] * 6, [3, 5], [5] * 2, [16] * 8):
        wins = [tuple(int(t) for t in rng.integers(0, m.vocab, k)) for k in sizes]
        assert m.codec_stage(wins, b) == len(wins)
        ids, mask = np.zeros((8, K), np.int64), np.zeros((8, K), np.float32)
        for i, win in enumerate(wins):
            ids[i, :len(win)] = win
            mask[i, :len(win)] = 1.0 / len(win)
        np.testing.assert_array_equal(b["ids_host"].reshape(8, K), ids)
        np.testing.assert_array_equal(b["mask_host"][..., 0], mask)
        # what the next step of one length rewrites from: this step's (windows, length), or
        # nothing known after windows of several lengths (then every row is written)
        assert b["staged"] == ((len(wins), sizes[0]) if len(set(sizes)) == 1 else None)


def test_run_marked_is_one_job_on_a_host_stream():
    """``LaneStream.run_marked`` on the cpu: the work queued between two marks as one job, the
    marks landing with it (the start's time before the work, the landing's after), ``notify``
    called once it has landed; an error in the work is kept for the stream's next sync."""
    import threading

    from lora_cupy.device import Device
    from lora_cupy.engine.streams import LaneStream

    lane = LaneStream(Device("cpu"), name="side-test")
    gate, order = threading.Event(), []
    start, landed = lane.run_marked(lambda: (gate.wait(10), order.append("work")),
                                    notify=lambda: order.append("notify"))
    assert not landed.done, "the work is held at its gate"  # its start may be marked already: the job runs
    gate.set()
    landed.synchronize(10)
    start.synchronize(10)
    assert start.done and landed.done and landed.seconds_since(start) >= 0
    lane.stream.synchronize()
    assert order == ["work", "notify"]

    def fails():
        raise ValueError("device work failed")
    _s, landed = lane.run_marked(fails)
    landed.synchronize(10)
    with pytest.raises(ValueError):
        lane.stream.synchronize()
    lane.close()


def test_take_with_a_limit_keeps_the_rest_in_order():
    s = MicroScheduler(["codec"])
    s.put_many([((r, "codec"), i) for i, r in enumerate("abcab")])
    assert s.take(SIDE_LANE, limit=1) == [(("a", "codec"), [0, 3])]
    assert s.take(SIDE_LANE, limit=5) == [(("b", "codec"), [1, 4]), (("c", "codec"), [2])]
    assert s.take(SIDE_LANE) == [] and s.pending(SIDE_LANE) == 0


def test_side_lane_api(eng):
    w = eng.worker
    lane = w.side_lanes[SIDE_LANE]
    assert isinstance(lane, SideStepLane) and lane.lane == SIDE_LANE
    assert lane.stream.stream is not w.chain.stream.stream, "the lane has a stream of its own"
    gpu = ThreadPoolExecutor(1)
    lane.launch(gpu)  # nothing ready: nothing queued
    lane.finish(block=True)  # nothing in flight: a no-op
    assert not lane.busy and not side_steps(w)
    gpu.shutdown()
    v = np.asarray(eng.model.codec_reference([1, 2, 3]))
    assert v.shape == (eng.model.codec_width,)


def test_side_host_cost_times_each_piece_of_a_side_step():
    from lora_cupy.bench.lane import side_host_cost

    cost = side_host_cost(windows=5, steps=20, warmup=2)
    assert set(cost) == {"cut", "launch", "execute", "finish", "total"}
    assert all(v > 0 for v in cost.values())
    assert cost["total"] >= max(cost["cut"], cost["launch"], cost["execute"], cost["finish"])


def test_bench_lane_runs_on_the_cpu(tmp_path):
    """The benchmark's three modes end to end on the cpu (its figures mean something on a GPU only)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "lane.json"
    cmd = [sys.executable, "-m", "lora_cupy.cli", "bench", "lane", "--device", "cpu", "--requests", "6",
           "--tokens", "12", "--window", "4", "--hidden", "32", "--layers", "2", "--rank", "4", "--adapters", "2",
           "--page-size", "4", "--codec-width", "32", "--json", str(out)]
    p = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "side lane keeps" in p.stdout
    data = json.loads(out.read_text())
    res = data["results"]
    assert res["alone"]["side_steps"] == 0 and res["alone"]["codec_steps"] == 0
    assert res["side"]["side_steps"] >= 1 and res["side"]["codec_steps"] == res["side"]["side_steps"]
    assert res["on_chain"]["side_steps"] == 0 and res["on_chain"]["codec_steps"] >= 1, "the windows ran on the chain"
    assert res["on_chain"]["chain_steps"] >= 12 + res["on_chain"]["codec_steps"]
    assert data["command"].startswith("lora-cupy bench lane") and data["device"] == "cpu"
    summary = data["summary"]
    for m in ("side", "on_chain"):
        rounds = summary[f"{m}_vs_alone_rounds"]
        assert len(rounds) == data["args"]["repeats"] == len(res[m]["runs"]) == 7
        assert summary[f"{m}_vs_alone_median_of_rounds"] == sorted(rounds)[3]
        assert summary[f"{m}_vs_alone"] == res[m]["chain_tokens_per_s"] / res["alone"]["chain_tokens_per_s"]
        assert sorted(res[m]["runs"])[3] == res[m]["chain_tokens_per_s"], "the median run"


def test_a_side_step_that_fails_as_it_launches_fails_its_requests(eng):
    """An error raised on the GPU thread while issuing the step (before any device work)."""
    w = eng.worker
    lane = w.side_lanes[SIDE_LANE]
    real = lane.execute
    calls = []

    def execute(batch, node_batch, plan_future):
        calls.append(batch.seq)
        if len(calls) == 1:
            raise RuntimeError("no room on the lane's stream")
        return real(batch, node_batch, plan_future)
    lane.execute = execute
    a = w.submit(Request("a", "a0", max_new_tokens=2, window=2))
    w.drain()
    b = w.submit(Request("b", "a1", max_new_tokens=3, window=2))
    w.drain()
    with pytest.raises(RuntimeError, match="no room"):
        a.result()
    check_result(eng, Request("b", "a1", max_new_tokens=3, window=2), b.result())
    assert len(calls) >= 2  # b's two windows run in one or two steps
    check_empty(eng)
