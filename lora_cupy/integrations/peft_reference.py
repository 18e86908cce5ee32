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
from dataclasses import dataclass

#: A top-2 logit gap below this at a divergence counts as a near-tie: about 40x the largest
#: float32 logit difference measured between served rows and PEFT's (2.6e-6 on the tiny test
#: models), and met at about 0.1% of positions of a random model.
NEAR_TIE = 1e-4


@dataclass(frozen=True)
class Comparison:
    """Served tokens against PEFT's greedy generation: ``equal``, else the first token ``index``
    where they part and PEFT's margin there (its chosen logit minus the served token's, on the
    served prefix): ``near_tie`` when that margin is below :data:`NEAR_TIE`."""

    equal: bool
    index: int | None = None
    margin: float | None = None

    @property
    def near_tie(self) -> bool:
        return not self.equal and self.margin is not None and self.margin < NEAR_TIE

    @property
    def ok(self) -> bool:
        return self.equal or self.near_tie


class PeftReference:
    """``generate(prompt, adapter, max_new_tokens)`` by PEFT, for adapters ``name -> directory``.

    ``autocast_adapter_dtype``: PEFT's own option. True (its default) keeps a float16 / bfloat16
    model's adapter weights in float32; False keeps them in the model's dtype, as a pool of that
    dtype holds them (the yardstick for the rounding a pool's slots add)."""

    def __init__(self, base_model, adapters: Mapping[str, str | os.PathLike], autocast_adapter_dtype: bool = True):
        import peft

        if not adapters:
            raise ValueError("PeftReference needs at least one adapter")
        model = copy.deepcopy(base_model).eval()
        names = list(adapters)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = peft.PeftModel.from_pretrained(model, str(adapters[names[0]]), adapter_name=names[0],
                                                        autocast_adapter_dtype=autocast_adapter_dtype)
            for name in names[1:]:
                self.model.load_adapter(str(adapters[name]), adapter_name=name,
                                        autocast_adapter_dtype=autocast_adapter_dtype)
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

    def compare(self, prompt: Sequence[int], adapter: str | None, tokens: Sequence[int], max_new_tokens: int,
                eos_token_id: int | None = None) -> Comparison:
        """``tokens`` (served) against :meth:`generate`; where they part, PEFT's margin there."""
        import torch

        want = self.generate(prompt, adapter, max_new_tokens, eos_token_id)
        tokens = list(tokens)
        if tokens == want:
            return Comparison(True)
        k = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), min(len(tokens), len(want)))
        if k >= len(tokens) or k >= len(want):  # one stopped (end of sequence) where the other went on
            return Comparison(False, k)
        dev = next(self.model.parameters()).device
        ids = torch.as_tensor([list(prompt) + tokens[:k]], dtype=torch.long, device=dev)
        last = self.logits(ids, adapter)[0, -1].float()
        return Comparison(False, k, float(last[want[k]] - last[tokens[k]]))

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
