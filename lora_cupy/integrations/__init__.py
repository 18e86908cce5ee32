"""Serving a torch / Hugging Face model through a pool: attach, generate, graphs.

- :func:`attach` / :class:`Attachment`: hook a pool's targets onto a model's linears (detach
  restores it exactly); separate q/k/v (gate/up) linears run as one fused-slice launch.
- :class:`LoraGenerator`: greedy generation of many requests on many adapters in mixed
  prefill/decode batches, admission in front of the pool, CUDA-graph decode on a GPU.
- :func:`serve`: a model and adapter directories in, a generator out (the spec built by
  ``LoraSpec.from_model``).

Importing this package needs torch (and ``serve`` a Hugging Face model); the rest of
lora_cupy does not import it.
"""

from .attach import Attachment, attach
from .generate import GenerationRequest, LoraGenerator, RequestRecord, StepRecord, TokenEvent
from .hf import adapter_modules, serve, spec_for_adapters

__all__ = ["Attachment", "attach", "GenerationRequest", "LoraGenerator", "RequestRecord", "StepRecord",
           "TokenEvent", "adapter_modules", "serve", "spec_for_adapters"]
