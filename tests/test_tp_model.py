"""A Llama sharded over tensor-parallel ranks, LoRA on every projection, greedy tokens as TP=1's.

Each rank holds its shard of one tiny Hugging Face Llama: q/k/v and gate/up split by output
(column-parallel), o and down by input (row-parallel), an all-reduce after o and down. The
integration's :func:`~lora_cupy.integrations.attach` adds every projection's delta (q/k/v and
gate/up as fused targets of slices), on the rank's shard, before the all-reduce: a hook the
all-reduce registers after the pool's. The ranks run in lockstep (``LockstepRank``); every
rank's pool reads PEFT adapters written for the whole model and keeps its shard of them. A
mixed batch (three adapters and the base model) is prefilled and decoded greedily: every
rank's tokens must equal one unsharded model's with one pool, and the adapters must change
what the base model says. On the CPU with gloo here; ``tests/gpu/test_tp_gpu.py`` runs the
same on two GPUs with NCCL.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

from lora_cupy.integrations.tensor_parallel import LLAMA_SHARDING, all_reduce_after, shard_llama
from tests.test_tp_gloo import COLLECTIVE_TIMEOUT, assert_all_ok, launch

NUM_LAYERS = 2
ROWS = (("r0", "p0"), ("r1", None), ("r2", "p1"), ("r3", "p0"), ("r4", "p2"), ("r5", None))
PROMPT, DECODE = 5, 6


def model_spec(model, rank: int = 0, world: int = 1):
    from lora_cupy.spec import LoraSpec

    return LoraSpec.from_model(model, num_slots=5, max_rank=16, dtype="float32", fuse=True, sharding=LLAMA_SHARDING,
                               capture_buckets=(8, 32), tp_rank=rank, tp_size=world)


def greedy(model, prompt, run_step) -> list[list[int]]:
    """Prefill ``prompt`` ``[B, P]`` and decode ``DECODE`` tokens greedily; ``run_step(num_tokens)``
    admits and plans each step (every row is one request, ``num_tokens`` tokens each)."""
    import torch
    from transformers import DynamicCache

    cache, ids, out = DynamicCache(), prompt, []
    with torch.inference_mode():
        for s in range(DECODE):
            finish = run_step([ids.shape[1]] * ids.shape[0])
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            finish()
            ids = logits[:, -1].argmax(-1, keepdim=True)
            out.append(ids[:, 0].tolist())
    return [list(t) for t in zip(*out)]


def tp_model_worker(rank: int, world: int, dirs: list[str], device: str) -> dict:
    import torch

    from lora_cupy.engine.resource import LoraStep, ResourceReqConfig, StepContext
    from lora_cupy.engine.tp import LockstepRank, TPGroup
    from lora_cupy.integrations import attach
    from lora_cupy.pool import LoraAdapterPool
    from tests.peft_helpers import VOCAB, tiny_llama

    device = device.format(rank=rank)
    adapters = {f"p{i}": d for i, d in enumerate(dirs)}
    full = tiny_llama(NUM_LAYERS, seed=3)  # the same weights on every rank
    model = shard_llama(copy.deepcopy(full), rank, world).to(device)
    tp = LockstepRank(TPGroup(timeout=COLLECTIVE_TIMEOUT), ingest_timeout=COLLECTIVE_TIMEOUT)
    pool = LoraAdapterPool(model_spec(full, rank, world), device, adapters=adapters, **tp.pool_kwargs())
    tp.add_pool(pool)
    attachment = attach(model, pool)
    all_reduce_after(model)
    prompt = torch.from_numpy(np.random.default_rng(7).integers(0, VOCAB, (len(ROWS), PROMPT))).to(device)
    rids = [rid for rid, _ in ROWS]
    try:
        for rid, name in ROWS:
            tp.ingest_request(rid, ResourceReqConfig(name))
        if tp.is_leader:
            for rid, name in ROWS:
                if name is not None:
                    pool.store.get(name).wait(COLLECTIVE_TIMEOUT)
                    assert pool.reserve(rid, "llm", ("llm",), False) == 1

        def tp_step(num_tokens):
            res = tp.lead(rids, num_tokens) if tp.is_leader else tp.follow()
            assert not res.failed, res.failed
            tp.check_lockstep()
            return tp.finish

        tokens = greedy(model, prompt, tp_step)
        assert attachment.sites and len(attachment.sites) == 7 * NUM_LAYERS
        if tp.is_leader:
            tp.stop()
        else:
            assert tp.follow() is None
        got = {"tokens": tokens, "tables": tp.tables()}
        if rank == 0:  # the unsharded model with one pool, and with none
            single = LoraAdapterPool(model_spec(full), device, adapters=adapters)
            whole = full.to(device)
            base_attachment = attach(whole, single)
            for rid, name in ROWS:
                single.ingest_request(rid, ResourceReqConfig(name))
                single.reserve(rid, "llm", ("llm",), False)

            def single_step(num_tokens):
                step, ctx = LoraStep(rids, num_tokens), StepContext()
                assert single.admit(step, ctx).ok
                single.plan(step, ctx)
                return lambda: single.commit(step, ctx)

            got["single"] = greedy(whole, prompt, single_step)
            with base_attachment.paused():
                got["base"] = greedy(whole, prompt, single_step)
            single.close()
        return got
    finally:
        pool.close()


@pytest.fixture(scope="module")
def model_adapters(tmp_path_factory):
    from tests.peft_helpers import make_peft_adapter

    root = tmp_path_factory.mktemp("tp_model_adapters")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [str(make_peft_adapter(root / f"p{i}", r=r, lora_alpha=2 * r, num_layers=NUM_LAYERS, seed=20 + i,
                                      **kw)[0])
                for i, (r, kw) in enumerate([(4, {}), (8, {"rank_pattern": {"o_proj": 3}}),
                                             (6, {"target_modules": ["q_proj", "v_proj", "down_proj"]})])]


def check_tp_model(values: list[dict]) -> None:
    """Every rank's greedy tokens equal the unsharded model's; the adapters changed them."""
    single, base = values[0]["single"], values[0]["base"]
    for r, v in enumerate(values):
        assert v["tokens"] == single, f"rank {r}: TP tokens {v['tokens']} != TP=1 tokens {single}"
        assert v["tables"] == values[0]["tables"]
    for i, (_, name) in enumerate(ROWS):
        if name is None:
            assert single[i] == base[i], f"base row {i} changed: {single[i]} vs {base[i]}"
    assert any(single[i] != base[i] for i, (_, name) in enumerate(ROWS) if name is not None), \
        "no adapter changed a token: the comparison shows nothing"


def test_tp2_llama_greedy_tokens_equal_tp1_on_gloo(tmp_path, model_adapters):
    check_tp_model(assert_all_ok(launch(tp_model_worker, 2, tmp_path, model_adapters, "cpu")))


def test_shard_llama_refuses_biased_linears_and_leaves_the_model_whole():
    """A biased linear would shard wrongly (a column's bias not narrowed, a row's added on every
    rank before the all-reduce): refused, with no layer sharded."""
    import torch

    from tests.peft_helpers import tiny_llama

    model = tiny_llama(1)
    down = model.model.layers[0].mlp.down_proj  # the last linear sharded: every other one checked first
    down.bias = torch.nn.Parameter(torch.zeros(down.out_features))
    before = {k: v.shape for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="without biases"):
        shard_llama(model, 0, 2)
    assert {k: v.shape for k, v in model.state_dict().items()} == before
