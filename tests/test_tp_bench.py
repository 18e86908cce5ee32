"""``lora-cupy bench tp --tiny``: the tensor-parallel benchmark's own code (the sharded Llama's rows
and the stack's) on two gloo ranks on the CPU (its times mean nothing here; on two GPUs the same
code times the NCCL steps)."""

from __future__ import annotations

import json

from lora_cupy.cli import main


def test_tp_bench_runs_its_rows_on_two_cpu_ranks(tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert main(["bench", "tp", "--tiny", "--reps", "2", "--misses", "2", "--batch", "6", "--adapters", "3",
                 "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    lead = got["leader"]
    assert got["world"] == 2 and lead["base_ms"] > 0 and lead["lora_ms"] > 0
    assert abs(got["ratio"] - lead["lora_ms"] / lead["base_ms"]) < 1e-9
    assert lead["llama_base_ms"] > 0 and lead["llama_lora_ms"] > 0  # the sharded Llama's rows
    assert abs(got["llama_ratio"] - lead["llama_lora_ms"] / lead["llama_base_ms"]) < 1e-9
    assert lead["agree_us"] > 0 and lead["lockstep_step_us"] > 0 and lead["admit_miss_us"] > 0
    # every agree of the run: the timed calls and their warm-up, one per miss, the LoRA step's first
    assert lead["stats"]["agrees"] == 2 + 1 + 2 + 1
    assert got["command"] == "lora-cupy bench tp --tiny --reps 2 --misses 2 --batch 6 --adapters 3 --json " + str(out)
    text = capsys.readouterr().out
    assert "LoRA step |" in text and "| Llama 2 layers" in text
