"""Tensor parallelism on two GPUs of one host with NCCL (``pytest -m gpu`` on such a host).

The sharded Llama of ``tests/test_tp_model.py`` on ``cuda:0`` and ``cuda:1``: ranks in lockstep,
``agree`` an all-reduce MAX on the NCCL group, the step orders on a gloo group beside it, the
row-parallel all-reduces on NCCL, every projection's delta in the RawKernels on the rank's
shard. A mixed batch's greedy tokens must equal one unsharded model's on ``cuda:0``.
"""

from __future__ import annotations

import pytest

from tests.test_tp_gloo import assert_all_ok, launch
from tests.test_tp_model import check_tp_model, model_adapters, tp_model_worker  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001  (no torch CUDA build)
        return 0


@pytest.mark.skipif(_gpu_count() < 2, reason="needs two CUDA devices of one host")
def test_tp2_llama_greedy_tokens_equal_tp1_on_nccl(tmp_path, model_adapters):  # noqa: F811
    check_tp_model(assert_all_ok(launch(tp_model_worker, 2, tmp_path, model_adapters, "cuda:{rank}",
                                        backend="nccl")))
