"""``lora-cupy bench tp [--json FILE]``: a tensor-parallel LoRA decode step against the same
step on the base model, and what the lockstep costs, on ``--world`` GPUs of one host (NCCL).

Two models, each rank a process holding its shard. A Hugging Face Llama (random weights, 4
layers of hidden 4096 by default) sharded as the integration serves it: q/k/v and gate/up
column-parallel, o and down row-parallel with an NCCL all-reduce after them, every projection's
delta added by :func:`~lora_cupy.integrations.attach` before the all-reduce; its rows time a
decode step with ``CACHED`` tokens cached per request. And a stack of Llama-shaped layers made of
column-parallel and row-parallel linears: ``qkv_proj`` (q, k, v slices) and ``gate_up_proj``
(gate, up slices) split by output, ``o_proj`` and ``down_proj`` split by input, an NCCL
all-reduce after each of those two. Attention is left out (q, k and v meet elementwise), so the
adapters' share of the step is larger than in a whole model. Every rank's pool serves
``--adapters`` random rank ``--rank`` adapters (in memory), one delta launch per target per
layer; the ranks run in lockstep (``LockstepRank``).

Rows, medians over ``--reps`` (the Llama's: its base and LoRA decode steps, as below):

- ``base``: a decode step (``--batch`` rows of one token) with every row on the base model: the
  pool plans no adapter row, so no delta launches. Device time between CUDA events on rank 0.
- ``lora``: the same step with the rows spread over the adapters. Its ratio to ``base``.
- ``lockstep step``: the host time of one steady-state step's lockstep on the leader: the
  order's broadcast (gloo), every rank's admit (a set check) and plan, and finish.
- ``agree``: one ``agree`` call with no copy in flight, i.e. one all-reduce MAX of a few bytes,
  on the NCCL group (what the pools use) and on the gloo group beside it.
- ``admit with a miss``: the leader's step whose one row misses: broadcast, the agreement,
  the victim's weights queued to the device, plan.

``--tiny`` runs the same code on small models over gloo on the CPU (a smoke run; its times
mean nothing); ``--model`` picks the Llama's rows, the stack's, or both (the default). The table goes to stdout, every number to the JSON file with the date, the
GPUs, the commit and the command.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import pickle
import statistics
import sys
import tempfile
import time
import traceback
import zlib
from datetime import timedelta

import numpy as np

from . import commit, emit, event_ms, parse, wait_host_copies

SHAPE = dict(hidden=4096, kv=1024, intermediate=14336, layers=4)
TINY = dict(hidden=128, kv=32, intermediate=256, layers=2)
#: The Llama rows' model (random weights, built from a config), and ``--tiny``'s.
LLAMA = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             num_hidden_layers=4, vocab_size=32000, max_position_embeddings=4096)
LLAMA_TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=256, max_position_embeddings=1024)
CACHED = 128  # tokens each request of the Llama rows has in its cache when a decode step runs
TIMEOUT = 300.0  # seconds any collective may take, and (times 3) the whole run


def make_spec(shape: dict, rank: int, world: int, adapters: int, max_rank: int, dtype: str, batch: int):
    from ..spec import LoraSlice, LoraSpec, LoraTarget

    H, KV, I, L = shape["hidden"], shape["kv"], shape["intermediate"], shape["layers"]
    targets = (
        LoraTarget("qkv_proj", H, H + 2 * KV, L, (LoraSlice("q_proj", H), LoraSlice("k_proj", KV),
                                                  LoraSlice("v_proj", KV)), sharding="column"),
        LoraTarget("o_proj", H, H, L, sharding="row"),
        LoraTarget("gate_up_proj", H, 2 * I, L, (LoraSlice("gate_proj", I), LoraSlice("up_proj", I)),
                   sharding="column"),
        LoraTarget("down_proj", I, H, L, sharding="row"))
    return LoraSpec(targets, num_slots=adapters + 1, max_rank=max_rank, dtype=dtype,
                    capture_buckets=(max(batch, 1),), tp_rank=rank, tp_size=world)


def memory_reader(rank: int):
    """Random adapters of ``rank`` at every target, this TP rank's shard, made in memory."""
    from ..adapter import AdapterWeights, TargetWeights
    from ..dtypes import numpy_dtype

    def read(path, spec, name=None):
        rng = np.random.default_rng([zlib.crc32(str(name).encode()), spec.tp_rank])
        dt = numpy_dtype(spec.dtype)
        targets = {}
        for t in spec.targets:
            L, n = t.num_layers, t.num_slices
            inl, outl = t.local_in_features(spec.tp_size), t.local_out_features(spec.tp_size)
            targets[t.name] = TargetWeights(
                a=(rng.standard_normal((L, n, rank, inl), np.float32) / np.sqrt(t.in_features)).astype(dt),
                b=(rng.standard_normal((L, outl, rank), np.float32) / np.sqrt(rank)).astype(dt),
                ranks=np.full((L, n), rank, np.int32), scaling=np.ones((L, n), np.float32))
        return AdapterWeights(str(name), str(path), f"bench-{name}", targets)

    return read


class ParallelStack:
    """This rank's shard of ``layers`` column/row-parallel blocks (see the module docstring)."""

    def __init__(self, shape: dict, rank: int, world: int, dtype, device, pool):
        import torch

        H, KV, I, L = shape["hidden"], shape["kv"], shape["intermediate"], shape["layers"]
        g = torch.Generator(device="cpu").manual_seed(1000 + rank)

        def w(out, inp):
            return (torch.randn(out, inp, generator=g) / inp ** 0.5).to(device=device, dtype=dtype)

        self.h, self.kv, self.i = H // world, KV // world, I // world
        self.layers = [dict(qkv=w(self.h + 2 * self.kv, H), o=w(H, self.h), gu=w(2 * self.i, H), down=w(H, self.i))
                       for _ in range(L)]
        self.deltas = [{t: pool.layer_delta(t, layer) for t in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
                       for layer in range(L)]
        self.rep = H // KV
        self.arr = (lambda t: t) if pool.device.is_cuda else (lambda t: t.numpy())  # what the backend takes

    def forward(self, x):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        h = x
        for W, d in zip(self.layers, self.deltas):
            qkv = h @ W["qkv"].T
            d["qkv_proj"](self.arr(qkv), self.arr(h))
            q, k, v = qkv.split((self.h, self.kv, self.kv), dim=1)
            a = (F.silu(q) * (1 + torch.tanh(k).repeat_interleave(self.rep, dim=1))
                 + v.repeat_interleave(self.rep, dim=1)).contiguous()
            o = a @ W["o"].T
            d["o_proj"](self.arr(o), self.arr(a))  # the delta before the all-reduce
            dist.all_reduce(o)
            h = F.rms_norm(h + o, (h.shape[1],))
            gu = h @ W["gu"].T
            d["gate_up_proj"](self.arr(gu), self.arr(h))
            gate, up = gu.split((self.i, self.i), dim=1)
            m = (F.silu(gate) * up).contiguous()
            down = m @ W["down"].T
            d["down_proj"](self.arr(down), self.arr(m))
            dist.all_reduce(down)
            h = F.rms_norm(h + down, (h.shape[1],))
        return h


def llama_rows(rank: int, world: int, args: dict, group, device: str, cuda: bool) -> dict:
    """A sharded Llama's decode step (``CACHED`` tokens cached per request) with every row on
    the base model, then spread over the adapters, the deltas added by ``attach``."""
    import torch
    import transformers

    from ..engine.resource import ResourceReqConfig
    from ..engine.tp import LockstepRank
    from ..integrations import attach
    from ..integrations.tensor_parallel import LLAMA_SHARDING, all_reduce_after, shard_llama
    from ..pool import LoraAdapterPool
    from ..spec import LoraSpec

    B, n_ad, reps = args["batch"], args["adapters"], args["reps"]
    tp = LockstepRank(group, ingest_timeout=TIMEOUT)
    cfg = transformers.LlamaConfig(**(LLAMA_TINY if args["tiny"] else LLAMA))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, args["dtype"])).eval()
    spec = LoraSpec.from_model(model, num_slots=n_ad + 1, max_rank=args["rank"], dtype=args["dtype"], fuse=True,
                               sharding=LLAMA_SHARDING, capture_buckets=(B, B * CACHED), tp_rank=rank, tp_size=world)
    shard_llama(model, rank, world)
    names = [f"l{i}" for i in range(n_ad)]
    pool = LoraAdapterPool(spec, device, reader=memory_reader(args["rank"]),
                           adapters={n: f"memory://{n}" for n in names}, **tp.pool_kwargs(read_timeout=TIMEOUT))
    tp.add_pool(pool)
    attach(model, pool)
    all_reduce_after(model)
    out = {}
    try:
        ids = torch.from_numpy(np.random.default_rng(3).integers(0, cfg.vocab_size, (B, CACHED + 1))).to(device)
        for kind in ("base", "lora"):
            rids = [f"{kind}{i}" for i in range(B)]
            for i, rid in enumerate(rids):
                tp.ingest_request(rid, ResourceReqConfig(None if kind == "base" else names[i % n_ad]))
            wait_host_copies(pool, names[:B] if kind == "lora" else (), TIMEOUT)
            if tp.is_leader:
                for rid in rids:
                    pool.reserve(rid, "llm", ("llm",), False)
            cache = transformers.DynamicCache(config=model.config)
            with torch.inference_mode():
                for tokens, x in ((CACHED, ids[:, :CACHED]), (1, ids[:, CACHED:])):
                    res = tp.lead(rids, [tokens] * B) if tp.is_leader else tp.follow()
                    if res.failed:
                        raise RuntimeError(f"rank {rank}: rows failed at admit: {res.failed}")
                    if tokens == 1:  # the decode step, timed; its cache goes back after each
                        def decode():
                            model(input_ids=x, past_key_values=cache, use_cache=True)
                            cache.crop(-1)  # back to the CACHED tokens

                        decode()
                        out[f"llama_{kind}_ms"] = event_ms(decode, reps, cuda)
                    else:
                        model(input_ids=x, past_key_values=cache, use_cache=True)
                    tp.finish()
            for rid in rids:
                if tp.is_leader:
                    tp.remove_request(rid)
        _end(tp)
        return out
    finally:
        pool.close()


def _end(tp) -> None:
    """The leader broadcasts the stop; a follower takes it (a step instead is an error). Not an
    ``assert``: under ``python -O`` the follower would skip ``follow()`` and never take the stop."""
    if tp.is_leader:
        tp.stop()
    elif tp.follow() is not None:
        raise RuntimeError(f"rank {tp.rank}: the leader sent a step where its stop was due")


def host_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def rank_main(rank: int, world: int, args: dict) -> dict:
    """One rank's part of the benchmark (every rank runs the same collectives in order)."""
    from ..engine.tp import TPGroup

    cuda = args["backend"] == "nccl"
    device = f"cuda:{rank}" if cuda else "cpu"
    group = TPGroup(timeout=TIMEOUT)
    out = {}
    if args["model"] in ("stack", "both"):
        out.update(stack_rows(rank, world, args, group, device, cuda))
    if args["model"] in ("llama", "both"):
        out.update(llama_rows(rank, world, args, group, device, cuda))
    return out


def stack_rows(rank: int, world: int, args: dict, group, device: str, cuda: bool) -> dict:
    """The stack's base and LoRA steps, the lockstep's cost per step, agree, misses."""
    import torch

    from ..engine.resource import ResourceReqConfig
    from ..engine.tp import LockstepRank, TPGroup
    from ..pool import LoraAdapterPool

    shape = TINY if args["tiny"] else SHAPE
    B, n_ad, reps = args["batch"], args["adapters"], args["reps"]
    tp = LockstepRank(group, ingest_timeout=TIMEOUT)
    spec = make_spec(shape, rank, world, n_ad, args["rank"], args["dtype"], B)
    names = [f"a{i}" for i in range(n_ad)]
    pool = LoraAdapterPool(spec, device, reader=memory_reader(args["rank"]),
                           adapters={n: f"memory://{n}" for n in names + [f"m{j}" for j in range(args["misses"])]},
                           **tp.pool_kwargs(read_timeout=TIMEOUT))
    tp.add_pool(pool)
    out: dict = {}
    try:
        dtype = getattr(torch, args["dtype"])
        stack = ParallelStack(shape, rank, world, dtype, device, pool)
        x = torch.randn(B, shape["hidden"], generator=torch.Generator().manual_seed(5)).to(device=device, dtype=dtype)
        base = [f"b{i}" for i in range(B)]
        lora = [f"l{i}" for i in range(B)]
        for i in range(B):
            tp.ingest_request(base[i], ResourceReqConfig(None))
            tp.ingest_request(lora[i], ResourceReqConfig(names[i % n_ad]))
        wait_host_copies(pool, names[:B], TIMEOUT)  # the adapters a row names
        if tp.is_leader:
            for rid in lora:
                pool.reserve(rid, "llm", ("llm",), False)

        def step(rows):
            res = tp.lead(rows) if tp.is_leader else tp.follow()
            if res.failed:
                raise RuntimeError(f"rank {rank}: rows failed at admit: {res.failed}")

        def timed(rows):
            step(rows)
            with torch.inference_mode():
                stack.forward(x)  # warm-up
                ms = event_ms(lambda: stack.forward(x), reps, cuda)
            tp.finish()
            return ms

        out["base_ms"] = timed(base)
        out["lora_ms"] = timed(lora)

        def lockstep_step():
            step(lora)
            tp.finish()

        lockstep_step()
        out["lockstep_step_us"] = host_us(lockstep_step, reps)
        outcomes = np.zeros(1, np.int8)
        tp.agree(outcomes)
        out["agree_nccl_us" if cuda else "agree_us"] = host_us(lambda: tp.agree(outcomes), reps)
        if cuda:
            gloo = LockstepRank(TPGroup(tp.group.control_group, timeout=TIMEOUT))
            gloo.agree(outcomes)
            out["agree_gloo_us"] = host_us(lambda: gloo.agree(outcomes), reps)
        for rid in lora:  # free the slots: each miss below evicts an unheld adapter
            if tp.is_leader:
                tp.remove_request(rid)
        miss = []
        for j in range(args["misses"]):
            rid = f"miss{j}"
            tp.ingest_request(rid, ResourceReqConfig(f"m{j}"))
            wait_host_copies(pool, [f"m{j}"], TIMEOUT)
            t0 = time.perf_counter()
            if tp.is_leader:
                pool.reserve(rid, "llm", ("llm",), False)
            step([rid])
            miss.append((time.perf_counter() - t0) * 1e6)
            tp.finish()
            if tp.is_leader:
                tp.remove_request(rid)
        if miss:
            out["admit_miss_us"] = statistics.median(miss)
        _end(tp)
        out["stats"] = dict(tp.stats)
        return out
    finally:
        pool.close()


def _entry(rank: int, world: int, args: dict, out_dir: str) -> None:
    result = {"rank": rank}
    try:
        import torch
        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: the gloo group on the loopback
        if args["backend"] == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(args["backend"], init_method=f"file://{out_dir}/store", rank=rank,
                                world_size=world, timeout=timedelta(seconds=TIMEOUT))
        result["value"] = rank_main(rank, world, args)
    except BaseException as e:  # noqa: BLE001  (reported by the launcher)
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    os._exit(0)


def run(args, argv: list[str]) -> dict:
    world = args.world
    opts = dict(vars(args), backend="gloo" if args.tiny else "nccl")
    if not args.tiny:
        import torch

        if torch.cuda.device_count() < world:
            raise SystemExit(f"bench tp needs {world} CUDA devices, found {torch.cuda.device_count()} (or --tiny)")
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_entry, args=(r, world, opts, d), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 3 * TIMEOUT
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world):
            path = os.path.join(d, f"rank{r}.pkl")
            if not os.path.exists(path):
                raise SystemExit(f"rank {r} left no result (exit code {procs[r].exitcode})")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    for res in results:
        if "error" in res:
            raise SystemExit(f"rank {res['rank']} failed: {res['error']}")
    lead = results[0]["value"]
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit(), "gpus": _gpus(world, args.tiny), "command": " ".join(["lora-cupy bench tp", *argv]),
           "shape": TINY if args.tiny else SHAPE, "llama": LLAMA_TINY if args.tiny else LLAMA, "world": world,
           "batch": args.batch, "adapters": args.adapters, "rank": args.rank, "dtype": args.dtype,
           "reps": args.reps, "leader": lead}
    if "lora_ms" in lead:
        out["ratio"] = lead["lora_ms"] / lead["base_ms"]
    if "llama_lora_ms" in lead:
        out["llama_ratio"] = lead["llama_lora_ms"] / lead["llama_base_ms"]
    return out


def _gpus(world: int, tiny: bool) -> list[str]:
    if tiny:
        return []
    import torch

    return [torch.cuda.get_device_name(i) for i in range(world)]


def markdown(r: dict) -> str:
    lead, sh, ll = r["leader"], r["shape"], r["llama"]
    lines = [f"TP={r['world']} decode steps, batch {r['batch']}, {r['adapters']} adapters of rank {r['rank']}, "
             f"{r['dtype']}; {', '.join(r['gpus']) or 'CPU (gloo, --tiny)'}; commit {r['commit']}",
             "", "| row | time |", "|---|---|"]
    if "llama_base_ms" in lead:
        what = (f"Llama {ll['num_hidden_layers']} layers (hidden {ll['hidden_size']}), {CACHED} cached tokens "
                "per request")
        lines += [f"| {what}: base step | {lead['llama_base_ms']:.3f} ms |",
                  f"| {what}: LoRA step | {lead['llama_lora_ms']:.3f} ms ({r['llama_ratio']:.2f}x base) |"]
    if "base_ms" in lead:
        what = f"stack {sh['layers']} layers (hidden {sh['hidden']}, intermediate {sh['intermediate']}, no attention)"
        lines += [f"| {what}: base step | {lead['base_ms']:.3f} ms |",
                  f"| {what}: LoRA step | {lead['lora_ms']:.3f} ms ({r['ratio']:.2f}x base) |",
                  f"| lockstep per step (host: broadcast, admit, plan, finish) | {lead['lockstep_step_us']:.0f} us |"]
    for key, label in (("agree_nccl_us", "one agree (NCCL all-reduce MAX)"), ("agree_gloo_us", "one agree (gloo)"),
                       ("agree_us", "one agree (gloo)"), ("admit_miss_us", "a step whose row misses (leader host)")):
        if key in lead:
            lines.append(f"| {label} | {lead[key]:.0f} us |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lora-cupy bench tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks (GPUs of this host)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16, help="the adapters' LoRA rank")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--misses", type=int, default=20, help="steps whose one row misses")
    p.add_argument("--model", choices=["stack", "llama", "both"], default="both",
                   help="the column/row-parallel stack's rows, the sharded Llama's, or both")
    p.add_argument("--tiny", action="store_true", help="small models over gloo on the CPU (a smoke run)")
    p.add_argument("--json", help="write every number here")
    args, _ = parse(p, argv)
    if args.tiny and args.dtype == "bfloat16":
        args.dtype = "float32"
    return emit(run(args, args.argv), markdown, args.json)


if __name__ == "__main__":
    sys.exit(main())
