"""``lora-cupy bench e2e [--json FILE]``: a Llama-shaped model's step with adapters against the same
step with none, in the same run, on a CUDA device.

The model is built from a config (random weights, no download): hidden 4096, intermediate
14336, 32 heads, 8 KV heads, 4 layers, bfloat16 by default. Adapters are rank 16 on all seven
projections (q/k/v and gate/up served as fused targets of slices: four launches per layer).
Every row serves its requests through :class:`~lora_cupy.integrations.LoraGenerator` and times
one step on the device with CUDA events, median over ``--reps``; the base row is the same step
with every request on the base model (the pool plans no adapter row, so no delta launches).

Rows (goals from the project's issue):

- decode, batch 64, ~128 cached tokens, CUDA graphs, 8 (then 32) distinct adapters: the decode
  graph's replay; the static cache spans ``max_len`` (the prompts' 128 tokens plus the decode
  margin), read whole by every replay, base and adapters alike.
- decode, batch 1, CUDA graphs, 1 adapter.
- prefill, 8 requests x 512 tokens, 8 adapters: one eager step that prefills all eight.
- decode, batch 64, eager (no graphs), 8 adapters: one eager step, host work included; beside it
  PEFT's own eager mixed batch (``adapter_names``) on a 128-token ``DynamicCache``.

Each row with adapters runs the attachment's default (on CUDA, each delta beside its linear on a
side stream inside CUDA graph captures, in line in eager steps: the ratio against the goal) and,
in the same run, every delta in line on the main stream (the "in line" column); the base step is
timed again after them ("base again"), so a base figure that moved over the row shows. The
prefill row alternates its steps with base steps in one generator instead (its base and "base
again" are the base steps beside the default and the in-line variant): a long compute-bound step
drifts with the device's clocks more than a decode replay does. Beside
each decode row with adapters: the time the adapters add, and the step's deltas alone (every
target at every layer on the decode bucket, one graph): what the kernels cost by themselves
against what they add inside the step.

Progress goes to stderr, the table to stdout, every number to the JSON file (with the date,
GPU, commit and command).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from . import commit, emit, event_ms, parse, wait_host_copies

MODEL = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             num_hidden_layers=4, vocab_size=32000, max_position_embeddings=4096)
#: ``--tiny``: the same code on a model small enough for a CPU (a smoke run; its times mean nothing).
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, vocab_size=256, max_position_embeddings=1024)
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: (case, goal as a ratio to base or None when only reported)
GOALS = {
    "decode b64 graphs 8 adapters": 1.10,
    "decode b64 graphs 32 adapters": 1.25,
    "decode b1 graphs 1 adapter": 1.10,
    "prefill 8x512 8 adapters": 1.10,
    "decode b64 eager 8 adapters": None,
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_model(shape: dict, dtype: str, device: str):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(getattr(torch, dtype)).eval()


def write_adapters(model, root: Path, count: int, rank: int) -> dict[str, Path]:
    """``count`` random rank-``rank`` adapters on all seven projections (PEFT's file layout)."""
    from ..demo import write_adapter
    from ..spec import LoraSpec

    spec = LoraSpec.from_model(model, MODULES, num_slots=2, max_rank=rank, dtype="float32")
    rng = np.random.default_rng(0)
    out = {}
    for k in range(count):
        out[f"a{k:02d}"] = root / f"a{k:02d}"
        write_adapter(out[f"a{k:02d}"], spec, rng, rank, 2.0 * rank, MODULES)
    return out


def generator(model, pool, **kw):
    from ..integrations import LoraGenerator

    return LoraGenerator(model, pool, eos_token_id=None, **kw)  # every request runs its full length


def fill(gen, batch: int, prompt: int, adapters: list, max_new: int) -> None:
    """Submit ``batch`` requests of ``prompt`` tokens (adapters round-robin) and step until all run."""
    from ..integrations import GenerationRequest

    rng = np.random.default_rng(1)
    vocab = gen.model.config.vocab_size
    base = len(gen.records)
    for i in range(batch):
        gen.submit(GenerationRequest(f"r{base + i}", rng.integers(0, vocab, prompt).tolist(),
                                     adapters[i % len(adapters)], max_new_tokens=max_new))
    wait_host_copies(gen.pool, adapters)  # every copy in first: no request finishes while a later one waits
    while len(gen.queue) or any(gen.records[r].admitted is None for r in gen.records):
        gen.step()


def deltas_alone_ms(gen, batch: int, reps: int) -> float:
    """Device ms of the step's LoRA deltas alone: every target at every layer on random rows of
    the decode bucket, under the last step's plan, captured in one CUDA graph (on the CPU: run
    eagerly). Set beside a row's added time, it tells the kernels' own cost from what they cost
    inside the step. These are the pool's whole deltas (shrink and expand), what a step runs
    with ``shrink_in_base=False``."""
    import torch

    from ..integrations.attach import as_backend_array

    pool = gen.pool
    bucket = pool.spec.bucket_for(batch)
    param = next(gen.model.parameters())
    tp = pool.spec.tp_size
    calls = [(pool.layer_delta(t.name, layer),
              torch.randn(bucket, t.local_in_features(tp), dtype=param.dtype, device=param.device),
              torch.zeros(bucket, t.local_out_features(tp), dtype=param.dtype, device=param.device))
             for t in pool.spec.targets for layer in range(t.num_layers)]
    cuda = pool.device.is_cuda

    calls = [(delta, as_backend_array(x, cuda), as_backend_array(y, cuda)) for delta, x, y in calls]

    def run():
        for delta, x, y in calls:
            delta(y, x)

    assert pool.current_plan() is not None, "the last step's plan has no adapter row"
    run()
    if not cuda:
        return event_ms(run, reps)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        run()
    return event_ms(graph.replay, reps)


def decode_row(model, pool, batch: int, adapters: list, graphs: bool, reps: int, overlap: bool = True,
               base_shrink: bool | None = None, compact: bool = True) -> dict:
    """Device ms of one decode step of ``batch`` requests on ``adapters`` (None: base) and, with
    adapters and ``overlap``, of the step's deltas alone. ``overlap``: the attachment's default (on CUDA the deltas
    beside their linears on a side stream inside graph captures), else in line everywhere.
    ``base_shrink``: the attachment's ``shrink_in_base`` (None: its default, the shrink inside each
    target's first GEMM inside graph captures where it fits; False: the pool's whole delta per
    target). ``compact=False``: that GEMM reads every slot's A even in a step of a few rows
    (``Attachment.compact_rows = 0``)."""
    import torch

    cuda = pool.device.is_cuda
    gen = generator(model, pool, max_batch=max(batch, 1), max_len=192, max_prefill=8,
                    cuda_graphs=graphs and cuda, static_decode=graphs and not cuda, overlap=None if overlap else False,
                    shrink_in_base=base_shrink)
    if not compact:
        gen.attachment.compact_rows = 0
    try:
        fill(gen, batch, 128, adapters, max_new=60)
        for _ in range(3 + batch):  # until 3 steps in a row decode the whole batch: both parities'
            gen.step()              # graphs captured, slots loaded, every prompt prefilled
            if len(gen.running) == batch and len(gen.history) >= 3 and \
                    all(h.decode_rows == batch for h in gen.history[-3:]):
                break
        else:
            raise RuntimeError(f"{batch} requests did not come to decode together: {len(gen.running)} running, "
                               f"last steps decoded {[h.decode_rows for h in gen.history[-3:]]}")
        if graphs and cuda:
            out = {"ms": event_ms(gen.graphs.last.replay, reps)}
        else:
            if cuda:
                torch.cuda.synchronize()
            out = {"ms": event_ms(gen.step, min(reps, 40))}
        # the in-line and whole-delta variants' would be the same calls
        if overlap and base_shrink is None and compact and any(a is not None for a in adapters):
            out["deltas_alone_ms"] = deltas_alone_ms(gen, batch, reps)
        return out
    finally:
        gen.close()
        for rid in list(gen.running):
            pool.remove_request(rid)


def prefill_row(model, pool, adapters: list, reps: int, overlap: bool = True, in_place: bool = True,
                glu: bool = True, hold: bool = True) -> dict:
    """Device ms of one eager step prefilling 8 requests of 512 tokens on ``adapters`` (``ms``)
    and of the same step on the base model (``base_ms``), medians over ``reps`` (at most 20)
    steps of each, and the median over the rounds of each adapter step over the base step after
    it (``paired_ratio``). The two alternate in one generator (adapters, base, adapters, ...), so a drift
    of the device's clocks over the run moves both alike: a prefill step is long and
    compute-bound, and timed in separate phases its base moved by up to 10% within one run.
    ``in_place=False``: the q/k/v and gate/up groups through one launch into a shared scratch,
    as decode steps run them, rather than each member's slice into its own output (what a step
    this large runs). ``glu=False``: each gated MLP runs the model's own forward (gate and up
    expands in place, then its SiLU and product), base steps too, where the default folds the
    expands into one fused activation (``Attachment.glu``) in both.

    ``hold`` (default): one more request per adapter, ingested by the pool and never admitted,
    keeps every adapter's host copy for the whole row (a server's steady state), so the steps run
    back to back, as a serving loop runs them. ``hold=False``: each round's eight requests are the
    only ones naming their adapters, so the host tier drops each copy with them and reads all eight
    again before the next adapter step. The process then waits on those reads (0.4-0.5 s on an
    H200's host) before every adapter step and before no base step; on that host a step after
    such a pause reached its first layer 1.4-1.7x later, base steps alike (raw_kernels/NOTES.md,
    "The prefill row's pause"): the two kinds of step then meet different hosts."""
    from ..engine import ResourceReqConfig
    from ..integrations import GenerationRequest

    gen = generator(model, pool, max_batch=8, max_len=520, max_prefill=8, cuda_graphs=False,
                    overlap=None if overlap else False)
    if not in_place:
        gen.attachment.members_in_place_rows = 1 << 62
    gen.attachment.glu = gen.attachment.glu and glu
    rng = np.random.default_rng(2)
    vocab = model.config.vocab_size
    n = [0]

    def submit_eight(names: list):
        """Eight new requests, their adapters' host copies in (without ``hold``, the tier dropped
        each copy with its last request, so each round reads them again): the timed step then
        prefills all eight."""
        for i in range(8):
            gen.submit(GenerationRequest(f"p{n[0]}", rng.integers(0, vocab, 512).tolist(), names[i % len(names)],
                                         max_new_tokens=1))
            n[0] += 1
        wait_host_copies(gen.pool, names)

    def timed(names: list) -> float:
        submit_eight(names)
        ms = event_ms(gen.step, 1)
        if gen.history[-1].prefill_rows != 8:
            raise RuntimeError(f"the timed step prefilled {gen.history[-1].prefill_rows} requests, not 8")
        return ms

    holders = [(f"hold-{name}", name) for name in dict.fromkeys(adapters) if name is not None] if hold else []
    try:
        for rid, name in holders:
            pool.ingest_request(rid, ResourceReqConfig(adapter=name))
        for names in (adapters, [None]):  # slots loaded, both kinds of step met once
            submit_eight(names)
            gen.step()
        times: dict[str, list] = {"ms": [], "base_ms": []}
        for _ in range(min(reps, 20)):
            times["ms"].append(timed(adapters))
            times["base_ms"].append(timed([None]))
        got = {k: statistics.median(v) for k, v in times.items()}
        got["paired_ratio"] = statistics.median(a / b for a, b in zip(times["ms"], times["base_ms"]))
        return got
    finally:
        for rid, _name in holders:
            pool.remove_request(rid)
        gen.close()


def peft_eager_row(model, adapters: dict, batch: int, reps: int) -> float:
    """Device ms of PEFT's eager mixed batch: ``batch`` rows, one token each, 8 adapters, on a
    128-token DynamicCache (cropped back after each step)."""
    import copy
    import warnings

    import peft
    import torch
    import transformers

    names = sorted(adapters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(copy.deepcopy(model), str(adapters[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            pm.load_adapter(str(adapters[name]), adapter_name=name)
    pm.eval()
    rows = [names[i % len(names)] for i in range(batch)]
    kw = "cache" if "cache" in inspect.signature(model.get_decoder().forward).parameters else "past_key_values"
    ids = torch.randint(0, model.config.vocab_size, (batch, 128), device=next(model.parameters()).device)
    with torch.inference_mode():
        cache = transformers.DynamicCache(config=model.config)
        pm(input_ids=ids, use_cache=True, adapter_names=rows, **{kw: cache})
        step_ids = ids[:, -1:]

        def step():
            pm(input_ids=step_ids, use_cache=True, adapter_names=rows, **{kw: cache})
            cache.crop(-1)  # back to the 128 cached tokens

        step()
        return event_ms(step, min(reps, 40))


def run(args) -> dict:
    import torch

    from ..integrations.hf import spec_for_adapters
    from ..pool import LoraAdapterPool

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    shape = {**(TINY if args.tiny else MODEL), **({"num_hidden_layers": args.layers} if args.layers else {})}
    model = build_model(shape, args.dtype, "cuda" if device != "cpu" else "cpu")
    log(f"model: {shape['num_hidden_layers']} layers, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B "
        f"parameters, {args.dtype}, on {device}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lora-cupy-e2e-") as tmp:
        adapters = write_adapters(model, Path(tmp), 32, args.rank)
        spec = spec_for_adapters(model, adapters, num_slots=33)
        pool = LoraAdapterPool(spec, device, adapters={k: str(v) for k, v in adapters.items()})
        names = sorted(adapters)
        try:
            def decode(batch: int, graphs: bool):
                return lambda a, o, w=None, c=True: decode_row(model, pool, batch, a, graphs, args.reps, o, w, c)

            cases = [
                ("decode b64 graphs 8 adapters", decode(64, True), names[:8]),
                ("decode b64 graphs 32 adapters", decode(64, True), names),
                ("decode b1 graphs 1 adapter", decode(1, True), names[:1]),
                ("prefill 8x512 8 adapters", lambda a, o: prefill_row(model, pool, a, args.reps, o), names[:8]),
                ("decode b64 eager 8 adapters", decode(64, False), names[:8]),
            ]
            for case, fn, ads in cases:
                if args.only and args.only not in case:
                    continue
                if "eager" in case:
                    # attention's first call at each cache length costs ~12 ms of host time a layer
                    # (on an H200 the first eager pass over lengths 129-200 took 49 ms a step, the
                    # next 6 ms): one untimed pass meets them all before any timed one
                    log(f"{case}: warm-up pass (eager attention meets each cache length once)")
                    fn([None], True)
                if case.startswith("prefill"):  # base steps alternate with each variant's steps
                    log(f"{case}: adapters (the attachment's default), alternating with base steps")
                    got = fn(ads, True)
                    base, lora = got["base_ms"], got["ms"]
                    log(f"{case}: adapters, deltas in line, alternating with base steps")
                    inline = fn(ads, False)
                    serial, base2 = inline["ms"], inline["base_ms"]
                else:
                    log(f"{case}: base")
                    base = fn([None], True)["ms"]
                    log(f"{case}: adapters, the attachment's default (on CUDA, forked inside graph captures)")
                    got = fn(ads, True)
                    lora = got["ms"]
                    log(f"{case}: adapters, deltas in line")
                    serial = fn(ads, False)["ms"]
                    whole = None
                    if case.startswith("decode"):
                        log(f"{case}: adapters, the pool's whole delta per target (shrink_in_base=False)")
                        whole = fn(ads, True, False)["ms"]
                    every = None
                    if case.startswith("decode b1") and device != "cpu":
                        log(f"{case}: adapters, the GEMM over every slot's A (compact_rows=0)")
                        every = fn(ads, True, None, False)["ms"]
                    log(f"{case}: base again")
                    base2 = fn([None], True)["ms"]
                goal = GOALS[case]
                row = {"case": case, "base_ms": round(base, 4), "lora_ms": round(lora, 4),
                       "ratio": round(lora / base, 3), "goal": goal,
                       "met": None if goal is None else lora / base <= goal,
                       "added_ms": round(lora - base, 4), "inline_ms": round(serial, 4),
                       "inline_ratio": round(serial / base, 3), "base_again_ms": round(base2, 4)}
                if case.startswith("prefill"):
                    row["inline_ratio"] = round(serial / base2, 3)  # against the base steps beside it
                    row["paired_ratio"] = round(got["paired_ratio"], 3)
                    log(f"{case}: adapters, their host copies read again before each adapter step, alternating "
                        "with base steps")
                    fresh = prefill_row(model, pool, ads, args.reps, True, hold=False)
                    row["fresh_ms"], row["fresh_base_ms"] = round(fresh["ms"], 4), round(fresh["base_ms"], 4)
                    row["fresh_ratio"] = round(fresh["ms"] / fresh["base_ms"], 3)
                    row["fresh_paired_ratio"] = round(fresh["paired_ratio"], 3)
                    log(f"{case}: adapters, fused groups through a shared scratch, alternating with base steps")
                    scratch = prefill_row(model, pool, ads, args.reps, True, in_place=False)
                    row["scratch_ms"] = round(scratch["ms"], 4)
                    row["scratch_ratio"] = round(scratch["ms"] / scratch["base_ms"], 3)
                    if device != "cpu":
                        log(f"{case}: adapters, each gated MLP's own forward (glu off), alternating with base steps")
                        own = prefill_row(model, pool, ads, args.reps, True, glu=False)
                        row["no_glu_ms"], row["no_glu_base_ms"] = round(own["ms"], 4), round(own["base_ms"], 4)
                        row["no_glu_ratio"] = round(own["ms"] / own["base_ms"], 3)
                elif whole is not None:
                    row["whole_ms"], row["whole_ratio"] = round(whole, 4), round(whole / base, 3)
                    if every is not None:
                        row["every_slot_ms"], row["every_slot_ratio"] = round(every, 4), round(every / base, 3)
                if "deltas_alone_ms" in got:
                    row["deltas_alone_ms"] = round(got["deltas_alone_ms"], 4)
                    row["lora_launches"] = sum(t.num_layers for t in spec.targets)
                if case.startswith("decode b64 eager") and not args.no_peft:
                    log(f"{case}: PEFT's eager mixed batch")
                    peft_ms = peft_eager_row(model, {n: adapters[n] for n in ads}, 64, args.reps)
                    row["peft_ms"] = round(peft_ms, 4)
                    row["peft_ratio"] = round(peft_ms / base, 3)
                    if device != "cpu":
                        torch.cuda.empty_cache()  # PEFT's copy of the model is gone
                rows.append(row)
                log(f"  {row}")
        finally:
            pool.close()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(0) if device != "cpu" else "none (cpu)", "commit": commit(),
        "command": "lora-cupy bench e2e " + " ".join(args.argv),
        "model": {**shape, "dtype": args.dtype, "rank": args.rank},
        "rows": rows,
    }


def markdown(result: dict) -> str:
    lines = [f"{result['date']}, {result['gpu']}, commit {result['commit']}: `{result['command']}`", "",
             "| case | base ms | with adapters ms | ratio | goal | met | added ms | deltas alone ms "
             "| in line ms (ratio) | whole delta ms (ratio) | base again ms | PEFT eager ms (ratio) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        goal = "reported" if r["goal"] is None else f"<= {r['goal']:.2f}x"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        peft = f"{r['peft_ms']:.3f} ({r['peft_ratio']:.1f}x)" if "peft_ms" in r else ""
        alone = f"{r['deltas_alone_ms']:.3f} ({r['lora_launches']} calls)" if "deltas_alone_ms" in r else ""
        added = f"{r['added_ms']:.3f}" if "added_ms" in r else ""
        inline = f"{r['inline_ms']:.3f} ({r['inline_ratio']:.3f}x)" if "inline_ms" in r else ""
        again = f"{r['base_again_ms']:.3f}" if "base_again_ms" in r else ""
        whole = f"{r['whole_ms']:.3f} ({r['whole_ratio']:.3f}x)" if "whole_ms" in r else ""
        lines.append(f"| {r['case']} | {r['base_ms']:.3f} | {r['lora_ms']:.3f} | {r['ratio']:.3f}x | {goal} | {met} "
                     f"| {added} | {alone} | {inline} | {whole} | {again} | {peft} |")
    if any("whole_ms" in r for r in result["rows"]):
        lines += ["", "with adapters / in line: the attachment's default, where it fits, inside graph captures, "
                      "each target's shrink inside its first GEMM (the pool's A rows appended to the base weight) "
                      "for steps of at most 64 rows, then `lora_expand_v` (an eager step runs the pool's whole "
                      "delta); whole delta: the same step with the pool's whole delta per target "
                      "(`shrink_in_base=False`, forked inside the graph capture); deltas alone: those whole "
                      "deltas by themselves."]
    for r in result["rows"]:
        if "every_slot_ms" in r:
            lines += ["", f"{r['case']}: with the extended GEMM over every slot's A (`compact_rows=0`) instead of "
                          f"the step's slots' gathered beside the weight: {r['every_slot_ms']:.3f} ms "
                          f"({r['every_slot_ratio']:.3f}x)."]
        if "scratch_ms" in r:
            lines += ["", f"{r['case']}: with q/k/v and gate/up each through one launch into a shared scratch "
                          f"(as a decode step runs them) instead of each member in place: {r['scratch_ms']:.3f} ms "
                          f"({r['scratch_ratio']:.3f}x the base steps beside it)."]
        if "no_glu_ms" in r:
            lines += ["", f"{r['case']}: with each gated MLP's own forward (`glu` off: gate and up expands in "
                          f"place, then the model's SiLU and product) in adapter and base steps alike: "
                          f"{r['no_glu_ms']:.3f} ms against base {r['no_glu_base_ms']:.3f} ms "
                          f"({r['no_glu_ratio']:.3f}x). The default runs one fused activation, with the deltas "
                          f"folded in, in both; its adapter step against this base (the model's own MLP): "
                          f"{r['lora_ms'] / r['no_glu_base_ms']:.3f}x."]
        if r["case"].startswith("prefill"):
            held = (" One more request per adapter, never admitted, holds the adapters' host copies for the "
                    "whole row (a server's steady state), so the steps run back to back.") if "fresh_ms" in r else ""
            lines += ["", f"{r['case']}: steps on adapters alternate with base steps in one generator; base and "
                          "base again are the base steps beside the default and the in-line variant, each "
                          f"variant's ratio is against its own.{held}"]
            if "paired_ratio" in r:
                lines += ["", f"{r['case']}: the default's median over its rounds of each adapter step over the "
                              f"base step after it: {r['paired_ratio']:.3f}x (the ratio above is of the two "
                              f"medians)."]
            if "fresh_ms" in r:
                lines += ["", f"{r['case']}: with no request holding the copies (the tier drops each with its "
                              f"round's requests and reads all eight again, so the process waits on the reads "
                              f"before every adapter step and before no base step): {r['fresh_ms']:.3f} ms "
                              f"against base {r['fresh_base_ms']:.3f} ms ({r['fresh_ratio']:.3f}x; paired "
                              f"{r['fresh_paired_ratio']:.3f}x). The two kinds of step then meet different "
                              f"hosts (raw_kernels/NOTES.md, \"The prefill row's pause\")."]
            if "held_ms" in r:  # runs before the row held its copies by default (cb8295e to f2d4685)
                lines += ["", f"{r['case']}: with one more request per adapter holding its host copy for the whole "
                              f"row (the ratios above are of the tier reading every copy again before each "
                              f"adapter step): {r['held_ms']:.3f} ms ({r['held_ratio']:.3f}x the base steps "
                              f"beside it; paired {r['held_paired_ratio']:.3f}x)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lora-cupy bench e2e", description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="FILE", help="write every number here")
    p.add_argument("--reps", type=int, default=200, help="timed repetitions per row (default 200)")
    p.add_argument("--layers", type=int, help=f"layers (default {MODEL['num_hidden_layers']})")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tiny", action="store_true",
                   help="a small model, runnable on the CPU: checks the benchmark's own code (times mean nothing)")
    p.add_argument("--only", help="run only the cases whose name contains this")
    p.add_argument("--no-peft", action="store_true", help="skip PEFT's eager mixed batch")
    p.add_argument("--report", metavar="FILE", help="print a saved run (--json) as markdown and exit (no GPU)")
    args, rc = parse(p, argv, markdown)
    if rc is not None:
        return rc
    import torch

    if not torch.cuda.is_available() and not args.tiny:
        p.error("bench e2e needs a CUDA device (or --tiny, a smoke run on the CPU)")
    return emit(run(args), markdown, args.json)
