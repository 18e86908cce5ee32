"""The README's Hugging Face example runs as written, on a tiny Llama with two PEFT adapters."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import torch

from tests.peft_helpers import make_peft_adapter, tiny_llama

README = Path(__file__).resolve().parents[1] / "README.md"


def test_serving_example_runs(tmp_path, monkeypatch, capsys):
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "serve(" in b]
    model = tiny_llama(2, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, r in (("sql", 4), ("chat", 8)):
            make_peft_adapter(tmp_path / "adapters" / name, r=r, model=copy.deepcopy(model), seed=r)
    ids = torch.randint(0, 64, (1, 5))
    with torch.inference_mode():
        before = model(input_ids=ids).logits.clone()
    monkeypatch.chdir(tmp_path)
    scope = {"model": model, "prompt_ids": [5, 6, 7]}
    exec(compile(block, str(README), "exec"), scope)
    lines = capsys.readouterr().out.split("\n")
    tokens = [line for line in lines if line.startswith("r1 ")]
    assert 1 <= len(tokens) <= 32 and tokens == [f"r1 {t}" for t in scope["gen"].records["r1"].tokens]
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, before)  # detached
