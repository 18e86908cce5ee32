"""``lora_expand_glu`` (expand_glu.cuh): a gated MLP's silu(g + dg) * (u + du) against the float64
oracle on fresh random data (odd widths, mixed ranks, NaN past each rank, slot-0 rows, padding
positions, h in place over g), the plain activation with no addressing, and its refusals. The
attachment's path through it runs against PEFT in test_integration_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from lora_cupy.backends.cupy import TOLERANCE
from lora_cupy.planning import LaunchViews


def _gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_count() == 0, reason="no CUDA device")]

DTYPES = ("bfloat16", "float16")


def silu64(z: np.ndarray) -> np.ndarray:
    return z / (1.0 + np.exp(-z))


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def td(a: np.ndarray, dtype: str):
    """A host array as a CUDA torch tensor of ``dtype`` (values through float32)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(a.astype(np.float32))).to("cuda", torch_dtype(dtype))


def to64(t) -> np.ndarray:
    return t.float().cpu().numpy().astype(np.float64)


def run_glu(make_case, dtype, *, T, inter, max_rank, ranks, mix, pad_to=None, in_place=True, plain=False,
            num_slots=17, active=9, in_f=136):
    """One fresh case of a two-slice target (gate, up) of ``inter`` columns each: g and u random,
    the shrink then ``glu``; returns (h as float64, the float64 oracle, the case)."""
    torch = pytest.importorskip("torch")
    from lora_cupy.backends.cupy import CupyBackend

    case = make_case(T=T, in_f=in_f, slices=(inter, inter), max_rank=max_rank, ranks=ranks, dtype=dtype, mix=mix,
                     num_slots=num_slots, active=active, pad_to=pad_to)
    be = CupyBackend(case.spec)
    w = case.w
    from lora_cupy.backends.base import LayerWeights

    layer = be.prepare(LayerWeights(td(w.a, dtype), td(w.b, dtype), torch.from_numpy(w.scaling).cuda(),
                                    torch.from_numpy(w.ranks).cuda(), w.out_offsets))
    assert layer.glu_fits() is None
    rows = case.x.shape[0]
    y0 = case.y0.astype(np.float32)
    g, u = td(y0[:, :inter], dtype), td(y0[:, inter:], dtype)
    h = g if in_place else torch.full_like(g, float("nan"))
    if plain:
        layer.glu(g, u, h, None, rows)
        ref = silu64(to64(td(y0[:, :inter], dtype))) * to64(td(y0[:, inter:], dtype))
    else:
        views = LaunchViews(case.token_order.shape[0], 0, torch.from_numpy(case.token_order).cuda(),
                            torch.from_numpy(case.slot_indptr).cuda())
        addressed = int(case.slot_indptr[-1])
        layer.half("shrink", td(case.x, dtype), views, rows)
        layer.glu(g, u, h, views, addressed)
        ref = silu64(case.ref[:, :inter]) * case.ref[:, inter:]
    torch.cuda.synchronize()
    assert not bool(be.workspace.any()), "v not zeroed after lora_expand_glu"
    assert not bool(be.counters.any()), "counters not reset after lora_expand_glu"
    return to64(h), ref, case


@pytest.mark.parametrize("T,inter,max_rank,ranks,mix", [
    (1, 136, 16, (16,), "identical"),
    (77, 200, 16, (0, 5, 13, 16), "zipf"),
    (300, 128, 32, (1, 8, 32), "uniform"),
    (700, 72, 64, (8, 13, 64), "skewed"),
    (333, 136, 48, (0, 20, 48), "zipf"),  # rank width 48: KS 4 covers ranks the pool does not have
    (1000, 256, 16, (16,), "uniform"),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_glu_matches_oracle(make_case, dtype, T, inter, max_rank, ranks, mix):
    """Every row of h (slot-0 rows too) against silu(g + dg) * (u + du) in float64, with g, u and
    the delta's inputs exactly as the kernel saw them; NaN past each rank of A and B; tiles of
    several runs and slot 0."""
    h, ref, case = run_glu(make_case, dtype, T=T, inter=inter, max_rank=max_rank, ranks=ranks, mix=mix)
    assert np.isfinite(h).all(), "non-finite output: poisoned weights were read"
    err = np.linalg.norm(h - ref) / np.linalg.norm(ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.3g} above {TOLERANCE[dtype]}"
    touched = case.touched
    if touched.any():  # the delta really landed: without it the rows would be far off
        plain = silu64(case.y0[:, :inter].astype(np.float64)) * case.y0[:, inter:].astype(np.float64)
        moved = np.linalg.norm(h[touched] - plain[touched])
        assert moved >= 0.5 * np.linalg.norm(ref[touched] - plain[touched])


@pytest.mark.parametrize("dtype", DTYPES)
def test_glu_padding_untouched_and_separate_output(make_case, dtype):
    """A capture bucket's padding positions (past slot_indptr[S]) leave their h rows as they were
    (NaN here); h in a buffer of its own."""
    h, ref, case = run_glu(make_case, dtype, T=100, inter=136, max_rank=16, ranks=(16, 8), mix="uniform",
                           pad_to=160, in_place=False)
    assert np.isnan(h[100:]).all(), "padding rows were written"
    err = np.linalg.norm(h[:100] - ref[:100]) / np.linalg.norm(ref[:100])
    assert err < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_glu_plain_activation(make_case, dtype):
    """No addressing: silu(g) * u for every row, no v read."""
    h, ref, _ = run_glu(make_case, dtype, T=513, inter=200, max_rank=16, ranks=(16,), mix="uniform", plain=True)
    err = np.linalg.norm(h - ref) / np.linalg.norm(ref)
    assert err < TOLERANCE[dtype]


def test_glu_refuses_bad_arguments(make_case):
    torch = pytest.importorskip("torch")
    from lora_cupy.backends.base import LayerWeights
    from lora_cupy.backends.cupy import CupyBackend

    case = make_case(T=64, in_f=136, slices=(128, 128), max_rank=16, ranks=(16,), dtype="bfloat16", mix="uniform")
    be = CupyBackend(case.spec)
    w = case.w
    layer = be.prepare(LayerWeights(td(w.a, "bfloat16"), td(w.b, "bfloat16"), torch.from_numpy(w.scaling).cuda(),
                                    torch.from_numpy(w.ranks).cuda(), w.out_offsets))
    g = torch.zeros(64, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="must be"):
        layer.glu(g, g[:, :120], g, None, 64)
    with pytest.raises(TypeError, match="dtype"):
        layer.glu(g, g.half(), g, None, 64)
    with pytest.raises(ValueError, match="row stride"):
        wide = torch.zeros(64, 256, dtype=torch.bfloat16, device="cuda")
        layer.glu(g, wide[:, :128], g, None, 64)
    one = make_case(T=8, in_f=136, slices=(128,), max_rank=16, ranks=(16,), dtype="bfloat16", mix="uniform")
    lone = CupyBackend(one.spec).prepare(LayerWeights(td(one.w.a, "bfloat16"), td(one.w.b, "bfloat16"),
                                                      torch.from_numpy(one.w.scaling).cuda(),
                                                      torch.from_numpy(one.w.ranks).cuda(), one.w.out_offsets))
    assert "two slices" in lone.glu_fits()
