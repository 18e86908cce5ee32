"""``lora-cupy demo``: a Hugging Face model serving many PEFT adapters through one pool.

With no arguments: a small Llama-style model is built from a config (random weights, no
download), a dozen adapters of mixed ranks (one rsLoRA, some on attention or MLP only) are
written by PEFT itself (``save_pretrained``), and a few dozen requests arrive over the run,
each on an adapter (zipf-popular) or the base model, more adapters than the pool has slots:
requests wait at admission, slots are evicted and reused. Each request's greedy tokens are
then compared with PEFT's own generation with that adapter alone, and the run's throughput,
slot hit rate and evictions are printed. CPU where there is no GPU (float32); on a GPU the
decode steps replay CUDA graphs. ``--model DIR`` and ``--adapter NAME=DIR`` serve your own.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

#: The default model: Llama-shaped, small enough for a 2-core CPU.
DEMO_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION, MLP = ALL_MODULES[:4], ALL_MODULES[4:]


def write_adapter(path: Path, spec, rng: np.random.Generator, r: int, alpha: float,
                  modules: list[str], use_rslora: bool = False) -> None:
    """A PEFT-format adapter directory with random A and B for ``modules`` at every layer of
    ``spec``'s targets, written with NumPy alone (no model, no PEFT)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module in modules:
        target, j = spec.module_target(module)
        in_f, out_f = target.in_features, target.slices[j].out_features
        for layer in range(target.num_layers):
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((r, in_f)) / np.sqrt(in_f)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out_f, r)) / np.sqrt(r)).astype(np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": modules,
              "use_rslora": use_rslora, "bias": "none", "task_type": "CAUSAL_LM"}
    (path / "adapter_config.json").write_text(json.dumps(config))


def demo_model(num_layers: int, seed: int):
    """The default model: a random ``LlamaForCausalLM`` from :data:`DEMO_CONFIG` (float32)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**{**DEMO_CONFIG, "num_hidden_layers": num_layers})
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def write_peft_adapters(base, root: Path, count: int, rng: np.random.Generator) -> dict[str, Path]:
    """``count`` adapters written by PEFT from ``base`` (random A and B, PEFT's own
    ``init_lora_weights=False``): ranks 2-32, varied alphas, one rsLoRA, some on attention or
    MLP alone. Returns name -> directory."""
    import peft
    import torch

    out = {}
    for k in range(count):
        r = (2, 4, 8, 16, 32)[k % 5]
        modules = (ALL_MODULES, ATTENTION, ALL_MODULES, MLP)[k % 4]
        config = peft.LoraConfig(r=r, lora_alpha=float(rng.choice([r, 2 * r, 16])), target_modules=list(modules),
                                 use_rslora=(k == 1), init_lora_weights=False)
        torch.manual_seed(int(rng.integers(1 << 30)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(copy.deepcopy(base), config)
            out[f"adapter{k:02d}"] = root / f"adapter{k:02d}"
            model.save_pretrained(str(out[f"adapter{k:02d}"]))
    return out


def pick_device(choice: str) -> str:
    """``auto``: ``cuda:0`` when torch and CuPy both see a GPU, else ``cpu``."""
    if choice != "auto":
        return choice
    try:
        import cupy
        import torch

        return "cuda:0" if torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:
        return "cpu"


def parse_adapters(items: list[str]) -> dict[str, Path]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        path = Path(path if sep else name)
        name = name if sep else path.name
        if name in out:
            raise SystemExit(f"lora-cupy demo: adapter name {name!r} given twice")
        out[name] = path
    return out


def load_model(args, device: str):
    import torch

    if args.model:
        import transformers

        dtype = getattr(torch, args.dtype) if args.dtype else "auto"
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    else:
        model = demo_model(args.layers, args.seed)
        if args.dtype:
            model = model.to(getattr(torch, args.dtype))
    return model.to("cpu" if device == "cpu" else device).eval()


def serve_requests(gen, requests, arrivals: float, rng: np.random.Generator, quiet: bool) -> float:
    """Submit ``requests`` as they arrive (``arrivals`` per step on average) and run the
    generator until every one finished; returns the wall seconds taken."""
    from tqdm import tqdm

    pending = list(requests)
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=quiet)
    started = time.perf_counter()
    idle_since = None
    while pending or gen.pending:
        for _ in range(min(len(pending), int(rng.poisson(arrivals)) if gen.pending else 1)):
            gen.submit(pending.pop(0))
        events = gen.step()
        if not events:
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 60:
                raise RuntimeError("no request could run for 60 s")
            time.sleep(0.001)
            continue
        idle_since = None
        done = sum(ev.done for ev in events)
        if done:
            bar.update(done)
        bar.set_postfix(running=len(gen.running), waiting=len(gen.queue))
    bar.close()
    return time.perf_counter() - started


def run(args) -> dict:
    """Build (or load) the model, write (or take) the adapters, serve the requests, check them
    against PEFT; returns the per-request rows and the summary."""
    from .integrations import GenerationRequest, serve
    from .integrations.peft_reference import PeftReference

    device = pick_device(args.device)
    rng = np.random.default_rng(args.seed)
    model = load_model(args, device)
    tmp = tempfile.TemporaryDirectory(prefix="lora-cupy-demo-")
    try:
        adapters = parse_adapters(args.adapter) if args.adapter else \
            write_peft_adapters(model, Path(tmp.name), args.adapters, rng)
        names = sorted(adapters)
        gen = serve(model, adapters, num_slots=args.slots + 1, max_len=args.max_len, max_batch=args.max_batch,
                    cuda_graphs=None if device != "cpu" else False)
        pool = gen.pool
        try:
            vocab = model.config.vocab_size
            popularity = 1.0 / np.arange(1, len(names) + 1) ** 1.1
            popularity /= popularity.sum()
            order = rng.permutation(names)
            requests = []
            for i in range(args.requests):
                adapter = None if rng.random() < args.base_share else str(rng.choice(order, p=popularity))
                prompt = rng.integers(0, vocab, int(rng.integers(4, 17))).tolist()
                requests.append(GenerationRequest(f"req{i:02d}", prompt, adapter,
                                                  max_new_tokens=int(rng.integers(args.max_new_tokens // 2,
                                                                                  args.max_new_tokens + 1))))
            if not args.quiet:
                print(f"device {device} ({pool.spec.dtype}); {len(names)} adapters in {args.slots} slots; "
                      f"{len(requests)} requests; targets {', '.join(pool.spec.target_names)}; "
                      f"{pool.spec.device_bytes() / 2**20:.1f} MiB of slot weights")
            wall = serve_requests(gen, requests, args.arrivals, rng, args.quiet)
            stats = gen.stats()
            records = gen.records
            pool.check_valid()
            eos = gen.eos_token_id
        finally:
            gen.close()
            pool.close()
        rows = []
        reference = PeftReference(model, adapters) if args.check else None
        for r in requests:
            rec = records[r.rid]
            row = {"request": r.rid, "adapter": r.adapter or "-", "prompt": len(r.prompt),
                   "tokens": len(rec.tokens), "waited_steps": rec.admitted - rec.submitted,
                   "slot_hit": rec.hit}
            if reference is not None:
                c = reference.compare(r.prompt, r.adapter, rec.tokens, r.max_new_tokens, eos)
                row["matches_peft"], row["peft_near_tie"] = c.equal, c.near_tie
                row["parts_at"], row["peft_margin"] = c.index, c.margin
            rows.append(row)
    finally:
        tmp.cleanup()
    summary = {
        "device": device, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "requests": len(rows), "adapters": len(names), "slots": args.slots,
        "matching_peft": sum(r.get("matches_peft", False) for r in rows) if args.check else None,
        "near_ties": sum(r.get("peft_near_tie", False) for r in rows) if args.check else None,
        "tokens": stats["tokens"], "seconds": round(wall, 2),
        "tokens_per_second": round(stats["tokens"] / wall, 1), "steps": stats["steps"],
        "slot_loads": stats["slot_loads"], "slot_hit_rate": stats["slot_hit_rate"],
        "evictions": stats["evictions"], "graph_steps": stats["graph_steps"],
        "max_admission_wait_steps": max(r["waited_steps"] for r in rows),
    }
    return {"rows": rows, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lora-cupy demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda:0 when there is a GPU, else cpu), cpu, cuda:N")
    p.add_argument("--model", metavar="DIR", help="a Hugging Face causal LM directory (default: a small random "
                   "Llama-style model built from a config)")
    p.add_argument("--adapter", action="append", default=[], metavar="[NAME=]DIR",
                   help="a PEFT adapter directory to serve (repeat; default: write --adapters of them with PEFT)")
    p.add_argument("--adapters", type=int, default=12, help="adapters written when none is given (default 12)")
    p.add_argument("--slots", type=int, default=4, help="adapter slots, slot 0 aside (default 4)")
    p.add_argument("--requests", type=int, default=36, help="requests served (default 36)")
    p.add_argument("--max-new-tokens", type=int, default=12, help="most tokens a request generates (default 12)")
    p.add_argument("--arrivals", type=float, default=1.5, help="mean requests arriving per step (default 1.5)")
    p.add_argument("--base-share", type=float, default=0.15, help="share of requests on the base model")
    p.add_argument("--max-batch", type=int, default=16, help="requests running at once (default 16)")
    p.add_argument("--max-len", type=int, default=64, help="positions per request (default 64)")
    p.add_argument("--layers", type=int, default=2, help="layers of the default model (default 2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="model dtype (default: float32 for the default model, the checkpoint's for --model)")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the comparison with PEFT")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the rows and summary to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for what in ("adapters", "slots", "requests", "max_new_tokens", "layers", "max_batch"):
        if getattr(args, what) < 1:
            p.error(f"--{what.replace('_', '-')} must be at least 1")
    if args.max_len < 20 + args.max_new_tokens:
        p.error(f"--max-len must be at least 20 + --max-new-tokens ({20 + args.max_new_tokens})")
    out = run(args)
    for r in out["rows"]:
        match = ""
        if "matches_peft" in r:
            where = f" at token {r['parts_at']}" + ("" if r["peft_margin"] is None else
                                                    f" (PEFT's margin there {r['peft_margin']:.1e})")
            match = ("  tokens = PEFT's" if r["matches_peft"] else
                     f"  tokens = PEFT's up to a near-tie{where}" if r["peft_near_tie"] else f"  MISMATCH{where}")
        print(f"{r['request']}  adapter {r['adapter']:<10} prompt {r['prompt']:>2}  tokens {r['tokens']:>2}  "
              f"waited {r['waited_steps']:>2} steps{match}")
    s = out["summary"]
    width = max(len(k) for k in s)
    for k, v in s.items():
        print(f"{k:<{width}}  {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if not args.check:
        return 0
    bad = s["requests"] - s["matching_peft"] - s["near_ties"]
    ties = f" ({s['near_ties']} up to a near-tie of PEFT's own logits)" if s["near_ties"] else ""
    print(f"every request's tokens equal PEFT's generation with its adapter alone{ties}" if not bad else
          f"MISMATCH: {bad} of {s['requests']} requests differ from PEFT's generation")
    return 0 if not bad else 1
