"""``lora-cupy bench e2e --tiny``: the end-to-end benchmark's own code, run on the CPU on a small
model (its times mean nothing here; on a GPU the same code times the Llama-shaped model)."""

from __future__ import annotations

import json

from lora_cupy.cli import main


def test_e2e_bench_runs_its_rows_on_a_small_model(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--tiny", "--reps", "2", "--only", "b1 graphs", "--json", str(out)]) == 0
    assert main(["bench", "e2e", "--tiny", "--reps", "2", "--only", "eager", "--json", str(tmp_path / "b.json")]) == 0
    rows = json.loads(out.read_text())["rows"] + json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["decode b1 graphs 1 adapter", "decode b64 eager 8 adapters"]
    for r in rows:
        assert r["base_ms"] > 0 and r["lora_ms"] > 0 and abs(r["ratio"] - r["lora_ms"] / r["base_ms"]) < 1e-2
    assert rows[1]["peft_ms"] > 0  # PEFT's eager mixed batch beside the eager row
    assert rows[0]["deltas_alone_ms"] > 0 and rows[0]["lora_launches"] == 4 * 2  # 4 targets x 2 layers
    for r in rows:  # the same step with the pool's whole delta per target, beside the default
        assert r["whole_ms"] > 0 and abs(r["whole_ratio"] - r["whole_ms"] / r["base_ms"]) < 1e-2
    capsys.readouterr()
    assert main(["bench", "e2e", "--report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| decode b1 graphs 1 adapter |" in text and "whole delta ms (ratio)" in text


def test_e2e_bench_prefill_row_alternates_with_base_steps(tmp_path, capsys, monkeypatch):
    """The prefill row (8 x 512 tokens, as on a GPU) times each variant's steps alternating with
    base steps in one generator: the steps the row times run adapters and base in turn, and the
    ratios are against the base steps beside each variant."""
    from lora_cupy.integrations import LoraGenerator

    kinds = []
    real_step = LoraGenerator.step

    def step(self):  # whether the eight requests this step prefills are on adapters
        kinds.append(any(self.records[w.rid].request.adapter is not None for w in self.queue.waiting))
        return real_step(self)

    monkeypatch.setattr(LoraGenerator, "step", step)
    out = tmp_path / "p.json"
    assert main(["bench", "e2e", "--tiny", "--reps", "3", "--only", "prefill", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["case"] == "prefill 8x512 8 adapters"
    for k in ("base_ms", "lora_ms", "inline_ms", "base_again_ms", "scratch_ms"):
        assert row[k] > 0, k
    assert abs(row["ratio"] - row["lora_ms"] / row["base_ms"]) < 1e-2
    assert abs(row["inline_ratio"] - row["inline_ms"] / row["base_again_ms"]) < 1e-2
    assert row["paired_ratio"] > 0 and row["fresh_ms"] > 0 and row["fresh_paired_ratio"] > 0
    assert abs(row["fresh_ratio"] - row["fresh_ms"] / row["fresh_base_ms"]) < 1e-2
    # four variants (the default, in line, copies read again, shared scratch), each: two untimed steps
    # (adapters, base), then 3 x (adapters, base)
    assert kinds == [True, False] * (4 * (1 + 3))
    capsys.readouterr()
    assert main(["bench", "e2e", "--report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "alternate with base steps" in text and "over the base step after it" in text
    assert "holds the adapters' host copies" in text and "reads all eight again" in text


def test_e2e_report_renders_a_prefill_row_saved_before_the_copies_were_held():
    """A run saved before the row held its copies by default (``held_*``, no ``fresh_*``) still
    shows its held variant, and says its headline ratio is of the copies read again."""
    from lora_cupy.bench import e2e

    row = {"case": "prefill 8x512 8 adapters", "base_ms": 16.5, "lora_ms": 19.0, "ratio": 1.152, "goal": 1.1,
           "met": False, "added_ms": 2.5, "inline_ms": 19.1, "inline_ratio": 1.15, "base_again_ms": 16.6,
           "paired_ratio": 1.145, "held_ms": 17.816, "held_ratio": 1.081, "held_paired_ratio": 1.088}
    text = e2e.markdown({"date": "d", "gpu": "g", "commit": "c", "command": "x", "rows": [row]})
    assert "17.816 ms (1.081x the base steps beside it; paired 1.088x)" in text
    assert "reading every copy again" in text and "holds the adapters' host copies" not in text


def test_prefill_row_with_held_copies_reads_each_adapter_once(tmp_path, monkeypatch):
    """By default the row holds the copies (one more request per adapter, never admitted, removed
    at the end): one read each, however many rounds. With ``hold=False`` each round's requests
    are the only ones naming their adapters, so the host tier reads every adapter again for each
    adapter round."""
    from lora_cupy.bench import e2e
    from lora_cupy.integrations.hf import spec_for_adapters
    from lora_cupy.pool import LoraAdapterPool
    from lora_cupy.store import LoraAdapterStore

    reads = []
    real = LoraAdapterStore._read
    monkeypatch.setattr(LoraAdapterStore, "_read", lambda self, e: (reads.append(e.name), real(self, e))[1])
    model = e2e.build_model(e2e.TINY, "float32", "cpu")
    adapters = e2e.write_adapters(model, tmp_path, 2, 4)
    names = sorted(adapters)
    with LoraAdapterPool(spec_for_adapters(model, adapters, num_slots=3), "cpu",
                         adapters={k: str(v) for k, v in adapters.items()}) as pool:
        for hold, want in ((True, 1), (False, 1 + 2)):  # the untimed adapter round, then 2 timed ones
            reads.clear()
            got = e2e.prefill_row(model, pool, names, 2, hold=hold)
            assert got["ms"] > 0 and got["paired_ratio"] > 0
            assert sorted(reads) == sorted(names * want), (hold, reads)
            assert not any(str(r).startswith("hold-") for r in pool._requests)  # the holders are gone
            pool.check_valid()


def test_overlap_bench_needs_a_gpu_and_renders_a_saved_run(tmp_path, capsys):
    import pytest
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            main(["bench", "overlap"])
        assert e.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err
    saved = {"date": "d", "gpu": "g", "commit": "c", "command": "lora-cupy bench overlap",
             "rows": [{"rows": 1, "adapters": 1, "target": "o_proj", "gemm": 10.4, "delta": 8.4, "add": 1.4,
                       "serial": 19.6, "forked_high": 18.7, "forked_default": 18.7}]}
    (tmp_path / "o.json").write_text(json.dumps(saved))
    assert main(["bench", "overlap", "--report", str(tmp_path / "o.json")]) == 0
    assert "| 1 | 1 | o_proj | 10.4 | 8.4 | 1.4 | 19.6 | 18.7 | 18.7 |" in capsys.readouterr().out
