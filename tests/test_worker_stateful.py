"""A hypothesis state machine over the worker: arrivals, removals, windows, held and delayed
streams, injected failures on both lanes. After every rule every pool's ``check_valid()``; at the
end, every request served exactly once (or failed, or removed), its outputs right, its windows
each processed once and in order, every refcount and KV page back to zero."""

from __future__ import annotations

from concurrent.futures import CancelledError

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

from lora_cupy.engine.decode_model import InjectedFault
from lora_cupy.engine.scheduler import CHAIN_LANE, SIDE_LANE
from lora_cupy.engine.worker import Request
from tests.test_worker import check_empty, check_result, make_engine

ADAPTERS = {"a0": 4, "a1": 2, "a2": 8, "a3": 1}
LANES = st.sampled_from([CHAIN_LANE, SIDE_LANE])


class WorkerMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        # two adapter slots, eight KV pages of two tokens: requests wait on both
        self.eng = make_engine(adapters=ADAPTERS, num_slots=3, num_pages=9, page_size=2)
        self.worker = self.eng.worker
        self.faults = self.eng.model.faults
        self.reqs: dict[str, Request] = {}
        self.futs = {}
        self.removed: set = set()

    @initialize(target=requests, adapter=st.sampled_from([None, *ADAPTERS]), n=st.integers(1, 6),
                window=st.integers(0, 3), prompt=st.integers(0, 15))
    def first(self, adapter, n, window, prompt):
        return self.arrive(adapter, n, window, prompt)

    @rule(target=requests, adapter=st.sampled_from([None, *ADAPTERS]), n=st.integers(1, 6),
          window=st.integers(0, 3), prompt=st.integers(0, 15))
    def arrive(self, adapter, n, window, prompt):
        rid = f"r{len(self.reqs)}"
        self.reqs[rid] = Request(rid, adapter, prompt=prompt, max_new_tokens=n, window=window)
        self.futs[rid] = self.worker.submit(self.reqs[rid])
        return rid

    @rule(rid=requests)
    def remove(self, rid):
        self.removed.add(rid)
        self.worker.remove(rid)

    @rule(passes=st.integers(1, 6))
    def run(self, passes):
        for _ in range(passes):
            self.worker.run_once(block=False)

    @rule(lane=LANES)
    def hold(self, lane):
        self.faults.hold(lane)

    @rule(lane=LANES)
    def release(self, lane):
        self.faults.release(lane)

    @rule(lane=LANES, seconds=st.sampled_from([0.0, 0.0005, 0.002]))
    def delay(self, lane, seconds):
        self.faults.delay[lane] = seconds

    @rule(lane=LANES)
    def fail_next_step(self, lane):
        self.faults.fail_next[lane] += 1

    @invariant()
    def every_pool_valid(self):
        self.worker.check_valid()
        assert self.eng.model.early_reads == 0, "a step was postprocessed before it landed"

    def teardown(self):
        try:
            self.faults.release(CHAIN_LANE)
            self.faults.release(SIDE_LANE)
            self.worker.drain(timeout=30)
            for rid, f in self.futs.items():
                assert f.done(), f"request {rid} was lost"
                err = f.exception()
                if err is None:
                    check_result(self.eng, self.reqs[rid], f.result())
                elif isinstance(err, CancelledError):
                    assert rid in self.removed
                else:
                    assert isinstance(err, InjectedFault), f"request {rid} failed with {err!r}"
            assert sorted(self.worker.removed) == sorted(self.futs), "a request removed twice, or never"
            check_empty(self.eng)
        finally:
            self.eng.close()


WorkerMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=50, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
TestWorkerMachine = WorkerMachine.TestCase


def test_windows_are_cut_every_k_tokens_and_at_the_end():
    eng = make_engine()
    try:
        f = eng.worker.submit(Request("r", "a0", max_new_tokens=7, window=3))
        eng.worker.drain()
        res = f.result()
        assert len(res.windows) == 3
        for w, cut in zip(res.windows, (res.tokens[0:3], res.tokens[3:6], res.tokens[6:7])):
            np.testing.assert_allclose(w, eng.model.codec_reference(cut), atol=1e-5)
    finally:
        eng.close()
