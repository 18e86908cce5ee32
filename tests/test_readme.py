"""The README's API example runs as written, against a PEFT-format adapter directory."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from lora_cupy.demo import write_adapter
from lora_cupy.spec import LoraSpec, LoraTarget

README = Path(__file__).resolve().parents[1] / "README.md"


def test_api_example_runs(tmp_path, monkeypatch):
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "LoraAdapterPool" in b]
    spec = LoraSpec([LoraTarget("q_proj", 256, 256, num_layers=2)], num_slots=9, max_rank=16, dtype="float32")
    write_adapter(tmp_path / "adapters" / "sql", spec, np.random.default_rng(), 8, 16.0, ["q_proj"])
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, str(README), "exec"), scope)
    y, pool = scope["y"], scope["pool"]
    assert np.abs(y[:5]).min(axis=1).all() and not y[5:].any()  # adapter rows written, base rows not
    pool.check_valid()
    assert not any(pool.slots.snapshot().refcount)
    pool.close()
