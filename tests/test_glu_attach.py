"""Which gated MLPs the attachment may run through ``lora_expand_glu`` (CPU: the choice and the
refusals; the kernel and the path itself run in tests/gpu/test_glu_gpu.py and
test_integration_gpu.py)."""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from lora_cupy.integrations import attach, spec_for_adapters  # noqa: E402
from lora_cupy.integrations.attach import gated_mlp_fits  # noqa: E402
from lora_cupy.pool import LoraAdapterPool  # noqa: E402
from tests.peft_helpers import make_peft_adapter, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("glu")
    base = tiny_llama(2, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d, _ = make_peft_adapter(root / "a", r=8, lora_alpha=16, model=copy.deepcopy(base), seed=1)
    return base, {"a": d}


def test_a_llama_mlp_of_silu_fits_and_others_say_why(served):
    base, dirs = served
    spec = spec_for_adapters(base, dirs, num_slots=2)
    gate_up = next(t for t in spec.targets if [s.name for s in t.slices] == ["gate_proj", "up_proj"])
    mlp = base.model.layers[0].mlp
    assert gated_mlp_fits(mlp, gate_up) is None
    other = copy.deepcopy(mlp)
    other.act_fn = torch.nn.GELU()
    assert "not SiLU" in gated_mlp_fits(other, gate_up)
    qkv = next(t for t in spec.targets if t.num_slices == 3)
    assert "not ('gate_proj', 'up_proj')" in gated_mlp_fits(mlp, qkv)
    assert "not one of the gated MLPs" in gated_mlp_fits(torch.nn.Linear(2, 2), gate_up)


def test_on_the_cpu_no_mlp_is_replaced_and_asking_for_it_is_refused(served):
    base, dirs = served
    model = copy.deepcopy(base)
    spec = spec_for_adapters(model, dirs, num_slots=2)
    with LoraAdapterPool(spec, "cpu", adapters={k: str(v) for k, v in dirs.items()}) as pool:
        forward = model.model.layers[0].mlp.forward
        with attach(model, pool) as att:
            assert att.glu is False and att.glu_mlps == []
            assert model.model.layers[0].mlp.forward == forward
        with pytest.raises(ValueError, match="one CUDA device"):
            attach(model, pool, glu=True)
        assert not any(getattr(m, "_forward_hooks", None) for m in model.modules())  # nothing left hooked
