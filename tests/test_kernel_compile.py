"""Every kernel source compiles with NVRTC, as at run time, for each checked architecture: no GPU needed."""

from __future__ import annotations

import pytest

from lora_cupy import kernels


@pytest.mark.parametrize("arch", kernels.CHECK_ARCHS)
@pytest.mark.parametrize("family", sorted(kernels.FAMILIES))
def test_family_compiles(family, arch):
    ptx = kernels.compile_family(family, arch)
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert f".target {arch}" in text
    assert ".entry" in text


def test_every_source_belongs_to_a_family():
    files = {p.name for p in kernels.kernel_sources()}
    assert files, "raw_kernels/ holds no .cu source"
    assert files == {f.file for f in kernels.FAMILIES.values()}


@pytest.mark.parametrize("arch", kernels.CHECK_ARCHS)
@pytest.mark.parametrize("family", sorted(kernels.FAMILIES))
def test_broken_source_fails_the_check(family, arch, monkeypatch):
    """The check compiles what the loader reads: a source with an error in it fails it."""
    real = kernels.read_source

    def broken(file, defines=None):
        return real(file, defines) + '\nextern "C" __global__ void broken_kernel(float* y) { y[0] = ; }\n'

    monkeypatch.setattr(kernels, "read_source", broken)
    with pytest.raises(kernels.KernelCompileError) as e:
        kernels.compile_family(family, arch)
    assert kernels.FAMILIES[family].file in str(e.value)
    assert "expected an expression" in str(e.value)


def test_missing_template_instantiation_is_refused():
    fam = next(iter(kernels.FAMILIES.values()))
    src = kernels.read_source(fam.file)
    with pytest.raises(kernels.KernelCompileError):
        kernels.compile_source(src, fam.file, "sm_90", ("no_such_kernel<float>",))
