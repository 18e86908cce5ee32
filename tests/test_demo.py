"""The README's demo: a small Llama-style model serving PEFT-written adapters through one pool
on the CPU, every request's tokens checked against PEFT's own generation."""

from __future__ import annotations

import json

import pytest

from lora_cupy.cli import main


def summary_value(out: str, key: str) -> str:
    return next(line.split()[-1] for line in out.splitlines() if line.startswith(key + " "))


def test_demo_serves_more_adapters_than_slots_and_matches_peft(capsys, tmp_path):
    report = tmp_path / "demo.json"
    args = ["demo", "--device", "cpu", "--quiet", "--adapters", "5", "--slots", "2", "--requests", "10",
            "--max-new-tokens", "5", "--arrivals", "3", "--max-batch", "4", "--json", str(report)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "every request's tokens equal PEFT's generation" in out
    assert sum("tokens = PEFT's" in line for line in out.splitlines()) == 10
    exact, ties = int(summary_value(out, "matching_peft")), int(summary_value(out, "near_ties"))
    assert exact + ties == 10 and ties <= 1  # a near-tie of PEFT's own logits at most (float32 rounding)
    assert int(summary_value(out, "evictions")) > 0  # 5 adapters through 2 slots
    assert int(summary_value(out, "max_admission_wait_steps")) > 0
    data = json.loads(report.read_text())
    assert [r["request"] for r in data["rows"]] == [f"req{i:02d}" for i in range(10)]
    assert all((r["matches_peft"] or r["peft_near_tie"]) and 1 <= r["tokens"] <= 5 for r in data["rows"])
    assert data["summary"]["tokens"] == sum(r["tokens"] for r in data["rows"])


def test_demo_serves_given_model_and_adapter_directories(capsys, tmp_path):
    """``--model DIR --adapter NAME=DIR``: the user's own model and adapters (here a 3-layer model
    saved by Hugging Face, adapters written by the demo's PEFT helper)."""
    import numpy as np

    from lora_cupy.demo import demo_model, write_peft_adapters

    model = demo_model(3, 5)
    model.save_pretrained(tmp_path / "model")
    dirs = write_peft_adapters(model, tmp_path, 2, np.random.default_rng(1))
    args = ["demo", "--device", "cpu", "--quiet", "--requests", "4", "--max-new-tokens", "3", "--slots", "1",
            "--model", str(tmp_path / "model"), *[f"--adapter=mine{k}={d}" for k, d in enumerate(dirs.values())]]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert int(summary_value(out, "adapters")) == 2
    assert any("mine" in line for line in out.splitlines() if line.startswith("req"))


def test_demo_refuses_bad_arguments():
    with pytest.raises(SystemExit):
        main(["demo", "--slots", "0"])
    with pytest.raises(SystemExit):
        main(["demo", "--max-len", "10"])
