"""Generation through the pool: every request of mixed prefill/decode batches gets, token for
token, what PEFT generates with that request's adapter alone (float32, CPU); more requests and
adapters than slots wait at admission, slots are evicted and reused, and every request finishes.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

from lora_cupy.bench import wait_host_copies
from lora_cupy.errors import AdapterNotFoundError
from lora_cupy.integrations import GenerationRequest, serve
from lora_cupy.integrations.kv_cache import step_inputs
from lora_cupy.integrations.peft_reference import PeftReference
from tests.peft_helpers import make_peft_adapter
from tests.test_integration_attach import VOCAB, modules_of, tiny


def adapters_for(kind, base, root, ranks):
    mods = modules_of(kind)
    dirs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, r in enumerate(ranks):
            targets = mods if k % 2 == 0 else mods[:1] + mods[-2:]
            dirs[f"ad{k}"], _ = make_peft_adapter(root / f"ad{k}", r=r, lora_alpha=2 * r, target_modules=targets,
                                                  model=copy.deepcopy(base), seed=7 * k + 1,
                                                  use_rslora=(k == 1))
    return dirs


def assert_equal_to_peft(ref, reqs, served, eos) -> None:
    """Each request's served tokens equal PEFT's greedy generation with its adapter alone; at
    most one may part from it, and only at a near-tie of PEFT's own logits (float32 rounding:
    a margin below NEAR_TIE, where a wrong delta parts by orders of magnitude more)."""
    got = {r.rid: ref.compare(r.prompt, r.adapter, served[r.rid], r.max_new_tokens, eos) for r in reqs}
    assert all(c.ok for c in got.values()), {rid: c for rid, c in got.items() if not c.ok}
    assert sum(not c.equal for c in got.values()) <= 1, got


def random_requests(rng, names, n, max_new=(3, 8)):
    return [GenerationRequest(f"r{i}", rng.integers(0, VOCAB, int(rng.integers(1, 9))).tolist(),
                              None if i % 5 == 4 else names[i % len(names)],
                              max_new_tokens=int(rng.integers(*max_new)))
            for i in range(n)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen2-window", "mistral", "phi3"])
def test_tokens_equal_peft_per_request_with_more_adapters_than_slots(kind, tmp_path):
    base = tiny(kind)
    dirs = adapters_for(kind, base, tmp_path, [4, 8, 2, 6, 3] if kind == "llama" else [4, 8, 3])
    ref = PeftReference(base, dirs)
    rng = np.random.default_rng()
    reqs = random_requests(rng, sorted(dirs), 14 if kind == "llama" else 7)
    slots = 3 if kind == "llama" else 2  # fewer slots than adapters
    gen = serve(base, dirs, num_slots=slots + 1, max_len=32, max_batch=4, max_prefill=3)
    try:
        streamed: dict = {}
        assert not list(gen.stream())  # nothing submitted: the stream ends at once
        for r in reqs:
            gen.submit(r)
        for ev in gen.stream():
            assert ev.error is None
            assert ev.index == len(streamed.setdefault(ev.rid, []))  # in order, per request
            streamed[ev.rid].append(ev.token)
            assert ev.done == (len(streamed[ev.rid]) == len(gen.records[ev.rid].tokens)
                               and gen.records[ev.rid].finished is not None)
        stats = gen.stats()
        gen.pool.check_valid()
        assert not any(gen.pool.snapshot().refcounts), "a finished request still holds its slot"
        history = gen.history
    finally:
        gen.close()
        gen.pool.close()
    assert_equal_to_peft(ref, reqs, streamed, gen.eos_token_id)
    # the batches mixed prefill with decode, and ran more than one request at once
    assert any(h.prefill_rows and h.decode_rows for h in history)
    assert max(h.prefill_rows + h.decode_rows for h in history) > 1
    assert stats["slot_loads"] > slots and stats["evictions"] > 0  # slots were reused
    assert stats["tokens"] == sum(len(t) for t in streamed.values())


def test_requests_wait_at_admission_and_all_finish(tmp_path):
    base = tiny("llama")
    dirs = adapters_for("llama", base, tmp_path, [4, 4, 4, 4])
    rng = np.random.default_rng()
    # every request on its own adapter run, one slot: requests on other adapters must wait
    reqs = [GenerationRequest(f"r{i}", rng.integers(0, VOCAB, 3).tolist(), f"ad{i % 4}", max_new_tokens=4)
            for i in range(8)]
    gen = serve(base, dirs, num_slots=2, max_len=16, max_batch=8)
    try:
        out = gen.run(reqs)
        waits = [rec.admitted - rec.submitted for rec in gen.records.values()]
        assert all(len(out[r.rid]) == 4 or out[r.rid][-1] == gen.eos_token_id for r in reqs)
        assert max(waits) > 0 and max(h.waiting for h in gen.history) > 0
        # one slot: never two adapters at once
        assert all(sum(c > 0 for c in h.refcounts[1:]) <= 1 for h in gen.history)
        assert gen.stats()["evictions"] >= 3
    finally:
        gen.close()
        gen.pool.close()


def test_rows_finishing_together_move_only_the_rows_that_go_on(tmp_path):
    """Six requests prefilled in one step; rows 0, 2 and 4 finish together at the next one. The
    survivors past the new batch size (rows 3 and 5) move into rows 0 and 2, row 4's finished
    request is not copied, and every request's tokens still equal PEFT's."""
    base = tiny("llama")
    dirs = adapters_for("llama", base, tmp_path, [4, 8, 3])
    names = sorted(dirs)
    rng = np.random.default_rng()
    reqs = [GenerationRequest(f"r{i}", rng.integers(0, VOCAB, int(rng.integers(2, 7))).tolist(),
                              None if i == 3 else names[i % 3], max_new_tokens=n)
            for i, n in enumerate([2, 5, 2, 6, 2, 4])]
    gen = serve(base, dirs, num_slots=4, max_len=24, max_batch=6, max_prefill=6, eos_token_id=None)
    moves = []
    move_row = gen.cache.move_row
    gen.cache.move_row = lambda src, dst: (moves.append((src, dst)), move_row(src, dst))
    try:
        for r in reqs:
            gen.submit(r)
        wait_host_copies(gen.pool, names)  # all six admitted at the first step
        out = gen.run()
        assert gen.history[0].prefill_rows == 6
        gen.pool.check_valid()
        assert not gen.running and not any(gen.pool.snapshot().refcounts)
    finally:
        gen.close()
        gen.pool.close()
    # step 2: r0, r2, r4 finish (rows 0, 2, 4), r3 moves to row 0 and r5 to row 2; the tree
    # before moved r5 to row 0, then r4 (finishing) to row 2, then r3 over it
    assert moves[:2] == [(3, 0), (5, 2)], moves
    assert all(len(out[r.rid]) == r.max_new_tokens for r in reqs)
    ref = PeftReference(base, dirs)
    assert_equal_to_peft(ref, reqs, out, None)


def test_a_long_running_generator_keeps_bounded_records_and_history(tmp_path):
    """``keep_finished=False`` drops each request's record once its last event is out and
    ``history_limit`` trims the step records, while ``run`` still returns every request's tokens
    (from the events: PEFT's, per request) and the stats' running totals equal what the kept
    records and steps say; ``forget`` drops one finished record (the rid may be submitted again)
    and refuses a running one. (How many steps a run takes depends on when the adapters' host
    copies land, so two runs are compared by their tokens, not their schedules.)"""
    base = tiny("llama")
    dirs = adapters_for("llama", base, tmp_path, [4, 4, 4])
    ref = PeftReference(base, dirs)
    rng = np.random.default_rng(5)
    reqs = random_requests(rng, sorted(dirs), 12)
    gen = serve(base, dirs, num_slots=3, max_len=24, max_batch=3, max_prefill=2, history_limit=None)
    try:
        gen.run(reqs)
        stats = gen.stats()
        admits = [r for r in gen.records.values() if r.hit is not None]
        assert stats["slot_hits"] == sum(r.hit for r in admits) > 0 and stats["evictions"] > 0
        assert stats["slot_hit_rate"] == round(sum(r.hit for r in admits) / len(admits), 3)
        assert stats["static_decode_steps"] == sum(h.graph for h in gen.history)
        assert len(gen.history) == stats["steps"] and len(gen.records) == len(reqs)
    finally:
        gen.close()
        gen.pool.close()
    gen = serve(base, dirs, num_slots=3, max_len=24, max_batch=3, max_prefill=2, keep_finished=False,
                history_limit=4)
    try:
        out = gen.run(reqs)
        steps = gen.stats()["steps"]
        assert gen.records == {} and steps > 5
        assert 4 <= len(gen.history) <= 4 + 4 // 8 + 1
        assert [h.step for h in gen.history] == list(range(steps - len(gen.history) + 1, steps + 1))
        assert gen.stats()["tokens"] == sum(len(t) for t in out.values())
    finally:
        gen.close()
        gen.pool.close()
    assert sorted(out) == sorted(r.rid for r in reqs)
    assert_equal_to_peft(ref, reqs, out, gen.eos_token_id)
    gen = serve(base, dirs, num_slots=3, max_len=24, max_batch=3)
    try:
        first = gen.run(reqs[:2])
        gen.submit(GenerationRequest("long", [1, 2, 3], "ad0", max_new_tokens=5))
        gen.step()
        with pytest.raises(ValueError, match="has not finished"):
            gen.forget("long")
        rec = gen.forget(reqs[0].rid)
        assert rec.tokens == first[reqs[0].rid] and reqs[0].rid not in gen.records
        with pytest.raises(KeyError):
            gen.forget(reqs[0].rid)
        again = gen.run([reqs[0]])  # a forgotten rid runs again, to PEFT's tokens
        assert_equal_to_peft(ref, [reqs[0]], again, gen.eos_token_id)
    finally:
        gen.close()
        gen.pool.close()


def test_submit_refusals(tmp_path):
    base = tiny("llama")
    dirs = adapters_for("llama", base, tmp_path, [4])
    gen = serve(base, dirs, num_slots=2, max_len=16)
    try:
        with pytest.raises(AdapterNotFoundError, match="nope"):
            gen.submit(GenerationRequest("x", [1, 2], "nope", max_new_tokens=2))
        with pytest.raises(ValueError, match="max_len"):
            gen.submit(GenerationRequest("y", list(range(10)), "ad0", max_new_tokens=10))
        with pytest.raises(ValueError, match="empty"):
            gen.submit(GenerationRequest("z", [], None))
        gen.submit(GenerationRequest("ok", [1, 2, 3], "ad0", max_new_tokens=2))
        with pytest.raises(ValueError, match="already"):
            gen.submit(GenerationRequest("ok", [1], None))
        assert len(gen.run()["ok"]) in (1, 2)
    finally:
        gen.close()
        gen.pool.close()


def test_step_inputs_mask_and_window():
    lengths = torch.tensor([0, 5, 2])
    si = step_inputs(lengths, 3, 9, 8, torch.float32, window=3, layer_types=("full_attention", "sliding_attention"))
    assert si.position_ids.tolist() == [[0, 1, 2], [5, 6, 7], [2, 3, 4]]
    assert si.write_cols.max() == 7  # clamped into the cache
    full, windowed = si.mask["full_attention"], si.mask["sliding_attention"]
    allowed = (full[:, 0] == 0).numpy()
    for b, n in enumerate(lengths.tolist()):
        for j in range(3):
            assert allowed[b, j].tolist() == [c <= n + j for c in range(9)]
            assert ((windowed[b, 0, j] == 0).numpy().tolist()
                    == [n + j - 3 < c <= n + j for c in range(9)])
    assert isinstance(step_inputs(lengths, 1, 9, 8, torch.float32, window=3).mask, torch.Tensor)


def test_static_decode_steps_equal_eager_and_peft(tmp_path):
    """Decode steps as a CUDA graph records them (static cache over max_len, batch buckets with
    padding rows, graphs keyed by bucket, addressing buffers and active), run eagerly here."""
    base = tiny("llama")
    dirs = adapters_for("llama", base, tmp_path, [4, 8, 2])
    ref = PeftReference(base, dirs)
    rng = np.random.default_rng()
    reqs = random_requests(rng, sorted(dirs), 11, max_new=(4, 10))
    out = {}
    for static in (True, False):
        gen = serve(base, dirs, num_slots=3, max_len=24, max_batch=8, max_prefill=2, static_decode=static)
        try:
            out[static] = gen.run(reqs)
            stats, keys = gen.stats(), (gen.graphs.keys if static else [])
        finally:
            gen.close()
            gen.pool.close()
        if static:
            assert stats["static_decode_steps"] > 0 and stats["graph_steps"] == 0
            buckets = {k[0] for k in keys}
            assert buckets <= {1, 2, 4, 8} and len(buckets) > 1  # batches of several sizes, padded
            active = [k for k in keys if k[2]]
            # the pool double-buffers its addressing: some bucket met both of its buffers
            assert any(len({k[1] for k in active if k[0] == b}) == 2 for b in buckets)
            assert all(not k[1] for k in keys if not k[2])  # a step with no adapter row reads none
    # the same tokens as eager steps (but where a near-tie of the logits parts one request)
    assert sum(out[True][r.rid] != out[False][r.rid] for r in reqs) <= 1
    assert_equal_to_peft(ref, reqs, out[True], gen.eos_token_id)


def test_a_request_whose_adapter_fails_to_read_is_refused_alone(tmp_path):
    """An adapter file broken after it was loaded: its requests end with the typed error at
    admission, holding nothing; every other request runs to its end."""
    from lora_cupy.errors import LoraError

    base = tiny("llama")
    dirs = adapters_for("llama", base, tmp_path, [4, 8])
    gen = serve(base, dirs, num_slots=3, max_len=16)
    try:
        weights = dirs["ad1"] / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])  # truncated
        reqs = [GenerationRequest(f"r{i}", [3, 4, 5], ("ad0", "ad1", None)[i % 3], max_new_tokens=3)
                for i in range(6)]
        errors = {}
        for r in reqs:
            gen.submit(r)
        for ev in gen.stream():
            if ev.error is not None:
                errors[ev.rid] = ev.error
        assert set(errors) == {"r1", "r4"}
        assert all(isinstance(e, LoraError) and "ad1" in str(e) for e in errors.values())
        for r in reqs:
            if r.rid not in errors:
                assert len(gen.records[r.rid].tokens) == 3 or gen.records[r.rid].tokens[-1] == gen.eos_token_id
        gen.pool.check_valid()
        assert not any(gen.pool.snapshot().refcounts)
    finally:
        gen.close()
        gen.pool.close()
    # a generator that drops finished records: run() still names the refused requests, with no tokens
    dirs = adapters_for("llama", base, tmp_path / "kept", [4, 8])
    gen = serve(base, dirs, num_slots=3, max_len=16, keep_finished=False)
    try:
        weights = dirs["ad1"] / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
        reqs = [GenerationRequest(f"s{i}", [3, 4, 5], ("ad0", "ad1", None)[i % 3], max_new_tokens=3)
                for i in range(6)]
        out = gen.run(reqs)
        assert sorted(out) == sorted(r.rid for r in reqs) and gen.records == {}
        assert out["s1"] == out["s4"] == [] and all(len(out[r]) in (1, 2, 3) for r in ("s0", "s2", "s3", "s5"))
    finally:
        gen.close()
        gen.pool.close()


def test_comparison_with_peft_finds_a_wrong_adapter(tmp_path):
    """The near-tie allowance cannot hide a wrong delta: tokens of another adapter part from
    PEFT's, mostly by a margin far above NEAR_TIE (on a random prompt two adapters' top logits can
    come close by chance: one run saw 8e-4, 8x NEAR_TIE, still told apart)."""
    from lora_cupy.integrations.peft_reference import NEAR_TIE

    base = tiny("llama")
    dirs = adapters_for("llama", base, tmp_path, [4, 8])
    ref = PeftReference(base, dirs)
    rng = np.random.default_rng()
    parted = far = 0
    for _ in range(8):
        prompt = rng.integers(0, VOCAB, 6).tolist()
        other = ref.generate(prompt, "ad1", 8)
        c = ref.compare(prompt, "ad0", other, 8)
        assert ref.compare(prompt, "ad0", ref.generate(prompt, "ad0", 8), 8).equal
        if not c.equal:
            parted += 1
            assert c.margin is None or c.margin > NEAR_TIE, c
            far += c.margin is None or c.margin > 10 * NEAR_TIE
    assert parted >= 3 and far >= parted - 1, (parted, far)


def test_static_decode_keys_its_graphs_by_the_steps_rank_class(tmp_path):
    """A pool of maximum rank 128 serving adapters of rank 4 and 40: decode steps holding only the
    rank-4 one are planned (and their graphs keyed) for rank 16, steps with the rank-40 one for 64;
    the tokens stay PEFT's."""
    base = tiny("llama")
    dirs = adapters_for("llama", base, tmp_path, [4, 40])
    ref = PeftReference(base, dirs)
    reqs = [GenerationRequest("a", [3, 4, 5], "ad0", max_new_tokens=4),
            GenerationRequest("b", [6, 7], "ad0", max_new_tokens=5),
            GenerationRequest("c", [5, 9, 2, 8], "ad1", max_new_tokens=3)]
    gen = serve(base, dirs, num_slots=3, max_len=24, max_batch=4, max_prefill=1, static_decode=True, max_rank=128)
    try:
        assert gen.pool.spec.max_rank == 128
        out = gen.run(reqs)
        bounds = {where[-1] for _, wheres, active in gen.graphs.keys if active for where in wheres}
    finally:
        gen.close()
        gen.pool.close()
    assert {16, 64} <= bounds, bounds
    assert_equal_to_peft(ref, reqs, out, gen.eos_token_id)
