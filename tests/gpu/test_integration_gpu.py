"""A Hugging Face model served through the pool on a CUDA device: the kernels inside the model's
forward against PEFT, generation with CUDA-graph decode against PEFT and against eager steps.

Tolerances: each row's bfloat16 logits, against PEFT's float32 logits for that row's adapter
alone (relative norm); over the adapter rows, their mean errs at most ``BF16_ERROR_FACTOR`` times
as much as PEFT's own bfloat16 logits do with the adapter weights in bfloat16 as the pool holds
them (its rounding is the yardstick: the delta here rounds v and the sum differently, once each.
PEFT's default keeps a bf16 model's adapter weights in float32: against that, on the CPU over 30
random inputs, the pool's two paths erred up to 5.5x and 9.8x as much on a rank-16 rsLoRA
adapter, against 2.3x and 2.2x with PEFT's weights in bf16), and no row more than
``BF16_ROW_FACTOR`` times. Per row the
ratio swings with the random inputs (measured on an H200: 0.66x to 2.85x, PEFT's own error from
5e-3 to 0.16), so the tight bar is on the mean. Token agreement of bf16 greedy generation is
reported (printed), float32 generation must agree token for token.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

from lora_cupy.integrations import GenerationRequest, attach, serve, spec_for_adapters
from lora_cupy.integrations.peft_reference import PeftReference
from lora_cupy.pool import LoraAdapterPool
from tests.peft_helpers import make_peft_adapter, tiny_llama
from tests.pool_helpers import planned_step


def _cuda_devices() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() if torch.cuda.is_available() else 0
    except Exception:
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_devices() == 0, reason="needs a CUDA device")]

#: ||ours - peft32|| / ||peft32||, over the adapter rows' mean, at most this many times PEFT's own bf16 error.
BF16_ERROR_FACTOR = 2.0
#: ... and on any one row at most this many times.
BF16_ROW_FACTOR = 4.0
VOCAB = 64


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_integration")
    base = tiny_llama(2, 0)
    dirs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, r in enumerate([4, 8, 16, 2]):
            dirs[f"ad{k}"], _ = make_peft_adapter(root / f"ad{k}", r=r, lora_alpha=2 * r, model=copy.deepcopy(base),
                                                  seed=5 * k + 3, use_rslora=(k == 2))
    return base, dirs


def on_cuda(model, dtype):
    return copy.deepcopy(model).to(device="cuda", dtype=dtype).eval()


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("base_shrink", ["always", False])
@pytest.mark.parametrize("overlap", [True, False])
def test_bf16_logits_within_tolerance_of_peft(adapters, overlap, base_shrink, glu):
    """``base_shrink`` "always": the shrink inside the extended first GEMM of each target in this
    eager forward too (54 rows), so nothing forks; False: the pool's whole delta per target.
    ``glu``: every gated MLP runs its activation with the gate / up delta folded in
    (``lora_expand_glu``, what a prefill of 512 rows or more runs), its base row the plain fused
    activation."""
    base, dirs = adapters
    model = on_cuda(base, torch.bfloat16)
    ref16 = PeftReference(model, dirs, autocast_adapter_dtype=False)  # adapter weights in bf16, as the pool's
    ref32 = PeftReference(on_cuda(base, torch.float32), dirs)
    rows = [("a", "ad0"), ("b", None), ("c", "ad1"), ("d", "ad2"), ("e", "ad3"), ("f", "ad0")]
    ids = torch.randint(0, VOCAB, (len(rows), 9), device="cuda")
    spec = spec_for_adapters(model, dirs, num_slots=5)
    with LoraAdapterPool(spec, "cuda:0", adapters={k: str(v) for k, v in dirs.items()}) as pool, \
            attach(model, pool, overlap=overlap, shrink_in_base=base_shrink) as att:
        assert len(att.glu_mlps) == 2, att.glu_mlps  # both layers' LlamaMLP fit
        att.glu_rows = 1 if glu else 1 << 30
        planned_step(pool, rows, ids.shape[1])
        with torch.inference_mode():
            got = model(input_ids=ids).logits.float()
        assert att.shrink_in_base == (base_shrink == "always")
        forked = overlap and not att.shrink_in_base
        assert att.overlap == overlap and (att.side.forks > 0 if forked else (att.side is None or att.side.forks == 0))
    agree = 0
    errs = []
    for i, (_rid, adapter) in enumerate(rows):
        want32 = ref32.logits(ids[i:i + 1], adapter)[0].float()
        want16 = ref16.logits(ids[i:i + 1], adapter)[0].float()
        ours = float((got[i] - want32).norm() / want32.norm())
        theirs = float((want16 - want32).norm() / want32.norm())
        print(f"row {i} ({adapter}): ours {ours:.2e}, PEFT bf16 {theirs:.2e} against PEFT fp32")
        # a base row takes no delta: it errs as PEFT's own bf16 does (1.0x measured on an H200)
        assert ours <= (BF16_ROW_FACTOR if adapter is not None else BF16_ERROR_FACTOR) * theirs + 1e-4
        if adapter is not None:
            errs.append((ours, theirs))
        agree += int((got[i].argmax(-1) == want16.argmax(-1)).sum())
    ours_mean, theirs_mean = (float(np.mean(e)) for e in zip(*errs))
    print(f"adapter rows' mean: ours {ours_mean:.2e}, PEFT bf16 {theirs_mean:.2e}; "
          f"greedy agreement with PEFT bf16: {agree}/{ids.numel()} positions")
    assert ours_mean <= BF16_ERROR_FACTOR * theirs_mean + 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_decode_generation_against_peft_and_eager(adapters, dtype):
    base, dirs = adapters
    model = on_cuda(base, dtype)
    rng = np.random.default_rng()
    reqs = [GenerationRequest(f"r{i}", rng.integers(0, VOCAB, int(rng.integers(1, 12))).tolist(),
                              None if i % 5 == 4 else f"ad{i % 4}", max_new_tokens=int(rng.integers(3, 12)))
            for i in range(20)]
    out = {}
    for graphs in (True, False):
        gen = serve(model, dirs, num_slots=3, max_len=32, max_batch=8, cuda_graphs=graphs)
        try:
            out[graphs] = gen.run(reqs)
            eos = gen.eos_token_id
            if graphs:
                assert gen.graphs.replays > 0 and gen.stats()["graph_steps"] == gen.graphs.replays
                # one graph per (bucket, addressing buffers, active): at most 4 buckets x 2 parities x 2
                assert 0 < gen.graphs.captures <= 16
            assert gen.stats()["evictions"] > 0
            gen.pool.check_valid()
        finally:
            gen.close()
            gen.pool.close()
    ref = PeftReference(model, dirs)
    peft = {r.rid: ref.generate(r.prompt, r.adapter, r.max_new_tokens, eos) for r in reqs}
    for what, other in (("eager steps", out[False]), ("PEFT", peft)):
        same = sum(out[True][r.rid] == other[r.rid] for r in reqs)
        prefix = np.mean([_common_prefix(out[True][r.rid], other[r.rid]) / max(len(other[r.rid]), 1) for r in reqs])
        print(f"{dtype}: graph decode against {what}: {same}/{len(reqs)} requests equal token for token, "
              f"{prefix:.0%} of tokens before the first difference")
        if dtype == torch.float32:  # a near-tie of the logits may part one request
            assert same >= len(reqs) - 1
        else:  # bf16: rounding may flip a near-tie, and the sequence diverges after it
            assert prefix >= 0.5
    if dtype == torch.float32:
        got = [ref.compare(r.prompt, r.adapter, out[True][r.rid], r.max_new_tokens, eos) for r in reqs]
        assert all(c.ok for c in got), [c for c in got if not c.ok]


def test_overlap_matches_in_line_float32(adapters):
    """The deltas on a side stream beside their linears are as exact as the in-line deltas,
    eagerly and replayed from a CUDA graph captured with the fork and join inside, for
    ``overlap=True`` and for the default ``"graphs"`` (in line when eager, forked in a capture);
    fused q/k/v and gate/up groups too, and their members each run in place (a large step's way). Yardstick: each row's float32 logits against PEFT's float32 logits for
    that row's adapter alone (relative norm); the side stream's delta is rounded once more (into
    its scratch) and the split-K sums are not ordered, so it may differ from in line by rounding."""
    base, dirs = adapters
    model = on_cuda(base, torch.float32)
    ref = PeftReference(model, dirs)
    rows = [("a", "ad0"), ("b", None), ("c", "ad1"), ("d", "ad2"), ("e", "ad3")]
    ids = torch.randint(0, VOCAB, (len(rows), 7), device="cuda")
    spec = spec_for_adapters(model, dirs, num_slots=5)
    got = {}
    with LoraAdapterPool(spec, "cuda:0", adapters={k: str(v) for k, v in dirs.items()}) as pool:
        planned_step(pool, rows, ids.shape[1])
        with torch.inference_mode():
            for overlap in (False, True, "graphs"):
                with attach(model, pool, overlap=overlap) as att:
                    eager = model(input_ids=ids).logits.clone()
                    if overlap is False:
                        got[False] = eager
                        continue
                    forks = len({(s.target, s.layer) for s in att.sites})  # one per target and layer
                    assert att.fused_groups > 0  # q/k/v and gate/up: one fork per group
                    # True forks in eager forwards too; "graphs" (the default) only in a capture
                    assert att.side.forks == (forks if overlap is True else 0)
                    got[overlap] = eager
                    graph = torch.cuda.CUDAGraph()
                    static = torch.empty_like(eager)
                    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                        static.copy_(model(input_ids=ids).logits)
                    assert att.side.forks == (2 if overlap is True else 1) * forks
                    static.zero_()
                    graph.replay()
                    torch.cuda.synchronize()
                    got[f"graph {overlap}"] = static.clone()
            with attach(model, pool, overlap=False) as att:  # each q/k/v and gate/up member in place
                att.members_in_place_rows = 1
                got["members in place"] = model(input_ids=ids).logits.clone()
    for i, (_rid, adapter) in enumerate(rows):
        want = ref.logits(ids[i:i + 1], adapter)[0].float()
        err = {k: float((got[k][i] - want).norm() / want.norm()) for k in got}
        print(f"row {i} ({adapter}): against PEFT float32: " + ", ".join(f"{k}: {v:.2e}" for k, v in err.items()))
        assert err[False] < 1e-3
        for k in got:
            assert err[k] <= 2 * err[False] + 1e-6, k


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_attach_detach_bit_identical_on_cuda(adapters):
    base, dirs = adapters
    model = on_cuda(base, torch.bfloat16)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, VOCAB, (3, 5), device="cuda")
    with torch.inference_mode():
        before = model(input_ids=ids).logits.clone()
    gen = serve(model, dirs, num_slots=3, max_len=16)
    gen.run([GenerationRequest("x", [1, 2, 3], "ad1", max_new_tokens=3)])
    gen.close()
    gen.pool.close()
    with torch.inference_mode():
        after = model(input_ids=ids).logits
    assert torch.equal(before.view(torch.int16), after.view(torch.int16))
    for k, v in model.state_dict().items():
        assert torch.equal(v.view(torch.uint8) if v.dtype != torch.bool else v,
                           params[k].view(torch.uint8) if v.dtype != torch.bool else params[k]), k
