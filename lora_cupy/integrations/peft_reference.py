"""PEFT's own generation, one request at a time: what served tokens are checked against.

:class:`PeftReference` loads every adapter into one ``peft.PeftModel`` over a private copy of
the base model (PEFT changes the model it wraps), and generates greedily for one prompt with
one adapter active (or with adapters disabled, for a base-model request), batch 1, no padding:
PEFT's and Hugging Face's path, nothing of lora_cupy's.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Mapping, Sequence


class PeftReference:
    """``generate(prompt, adapter, max_new_tokens)`` by PEFT, for adapters ``name -> directory``."""

    def __init__(self, base_model, adapters: Mapping[str, str | os.PathLike]):
        import peft

        if not adapters:
            raise ValueError("PeftReference needs at least one adapter")
        model = copy.deepcopy(base_model).eval()
        names = list(adapters)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = peft.PeftModel.from_pretrained(model, str(adapters[names[0]]), adapter_name=names[0])
            for name in names[1:]:
                self.model.load_adapter(str(adapters[name]), adapter_name=name)
        self.model.eval()
        self.adapters = tuple(names)

    def generate(self, prompt: Sequence[int], adapter: str | None, max_new_tokens: int,
                 eos_token_id: int | None = None) -> list[int]:
        """Greedy tokens after ``prompt`` with ``adapter`` alone active (None: the base model)."""
        import contextlib

        import torch

        dev = next(self.model.parameters()).device
        ids = torch.as_tensor([list(prompt)], dtype=torch.long, device=dev)
        if adapter is None:
            ctx = self.model.disable_adapter()
        else:
            self.model.set_adapter(adapter)
            ctx = contextlib.nullcontext()
        with ctx, torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=eos_token_id,
                                      pad_token_id=0 if eos_token_id is None else eos_token_id)
        return out[0, len(prompt):].tolist()

    def logits(self, input_ids, adapter: str | None):
        """PEFT's logits ``[1, n, vocab]`` for one unpadded sequence with ``adapter`` alone."""
        import contextlib

        import torch

        if adapter is None:
            ctx = self.model.disable_adapter()
        else:
            self.model.set_adapter(adapter)
            ctx = contextlib.nullcontext()
        with ctx, torch.inference_mode():
            return self.model(input_ids=input_ids).logits
