"""The README's API example runs as written, against a PEFT-format adapter directory."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from lora_cupy.demo import write_adapter
from lora_cupy.spec import LoraSpec, LoraTarget

README = Path(__file__).resolve().parents[1] / "README.md"


def test_api_example_runs(tmp_path, monkeypatch):
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "LoraAdapterPool" in b]
    spec = LoraSpec([LoraTarget("q_proj", 256, 256, num_layers=2)], num_slots=9, max_rank=16, dtype="float32")
    r, alpha = 8, 16.0
    write_adapter(tmp_path / "adapters" / "sql", spec, np.random.default_rng(), r, alpha, ["q_proj"])
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, str(README), "exec"), scope)
    x, y, pool = scope["x"], scope["y"], scope["pool"]
    # Rows 0-4 on "sql" at layer 0, from its file in float64; rows 5-7 (base) untouched.
    w = load_file(str(tmp_path / "adapters" / "sql" / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.q_proj"
    a, b = w[f"{key}.lora_A.weight"].astype(np.float64), w[f"{key}.lora_B.weight"].astype(np.float64)
    want = alpha / r * (x[:5].astype(np.float64) @ a.T) @ b.T  # [5, 256]
    np.testing.assert_allclose(y[:5], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    assert not y[5:].any()
    pool.check_valid()
    assert not any(pool.slots.snapshot().refcounts)
    pool.close()
