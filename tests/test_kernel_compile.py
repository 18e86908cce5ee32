"""Every kernel source compiles with NVRTC, as at run time, for each checked architecture: no GPU needed."""

from __future__ import annotations

import os
from pathlib import Path

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


def test_source_names_its_headers(tmp_path, monkeypatch):
    """CuPy caches on the source text: an edited header must change the text it compiles."""
    for p in kernels.kernel_dir().glob("*.cu*"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(kernels, "kernel_dir", lambda: tmp_path)
    file = next(iter(kernels.FAMILIES.values())).file
    before = kernels.read_source(file)
    header = tmp_path / "common.cuh"
    header.write_text(header.read_text() + "\n// edited\n")
    assert kernels.read_source(file) != before


def test_environment_defines_are_parsed_and_bad_ones_refused(monkeypatch):
    from lora_cupy import kernels

    monkeypatch.setenv("LORA_CUPY_KERNEL_DEFINES", "LORA_SHRINK_BLOCKS=3, LORA_EXAMPLE=4")
    assert kernels.env_defines() == {"LORA_SHRINK_BLOCKS": "3", "LORA_EXAMPLE": "4"}
    monkeypatch.setenv("LORA_CUPY_KERNEL_DEFINES", "")
    assert kernels.env_defines() == {}
    for bad in ("KREG", "1X=2", "A="):
        monkeypatch.setenv("LORA_CUPY_KERNEL_DEFINES", bad)
        with pytest.raises(ValueError, match="NAME=VALUE"):
            kernels.env_defines()


def test_code_sizes_count_every_kernel_of_a_family():
    """Instruction counts from the CUBIN NVRTC builds: one per name expression, the SIMT kernels
    far smaller than the tensor-core ones, the fused kernel (shrink and expand in one) larger than
    its shrink alone, its chunked instantiation larger than the one on tiles, and every ALIGNED
    instantiation smaller than its twin (the fused one at tile 16 under 0.8x: what it is for)."""
    simt = kernels.code_sizes("lora_delta")
    assert set(simt) == set(kernels.FAMILIES["lora_delta"].name_expressions)
    assert all(50 < n < 2000 for n in simt.values())
    mma = kernels.code_sizes(kernels.mma_family("bfloat16"))
    assert set(mma) == set(kernels.FAMILIES[kernels.mma_family("bfloat16")].name_expressions)
    assert min(mma.values()) > max(simt.values())
    for al in ("false", "true"):
        for chunks in ("false", "true"):
            assert mma[f"lora_fused<__nv_bfloat16, 16, 64, {chunks}, {al}>"] > mma[f"lora_shrink<__nv_bfloat16, 16, {al}>"]
        # the chunk count and spread are in the chunked instantiation only
        assert mma[f"lora_fused<__nv_bfloat16, 16, 64, true, {al}>"] > mma[f"lora_fused<__nv_bfloat16, 16, 64, false, {al}>"]
    # an ALIGNED instantiation has no element-wise paths: every one is smaller than its twin
    # (the fused kernel at tile 16 by about a third: 8688 -> 5856 instructions when this was written);
    # lora_chunk's flags are ALIGNED, then SLICED. lora_pair's ALIGNED expand at rank width 16 also
    # carries the runs of whole tiles (pair_expand_run, ALIGNED only), so it is held to 1.2x its twin.
    for name, n in mma.items():
        kind, params = name.split("<")[0], [p.strip() for p in name[:-1].split("<", 1)[1].split(",")]
        at = {"lora_chunk": 3}.get(kind, len(params) - 1)
        if params[at] == "true":
            twin = f"{kind}<{', '.join(params[:at] + ['false'] + params[at + 1:])}>"
            bound = 1.2 if (kind, params[1]) == ("lora_pair_expand", "16") else 1.0
            assert n < bound * mma[twin], (name, n, mma[twin])
        # lora_chunk for one slice: the slice loops and lookups compiled out; at rank width 64 in chunks
        # of CHUNK_BM it also carries the rank split's shrink (chunk_shrink_rs), so it is held to 1.25x
        # its sliced twin (8808 against 7352 and 4304 against 4112 instructions when this was written)
        if kind == "lora_chunk" and params[4] == "false":
            sliced = f"{kind}<{', '.join(params[:4] + ['true'])}>"
            split = (int(params[1]), int(params[2])) == (64, kernels.CHUNK_BM)
            assert n < (1.25 if split else 1.0) * mma[sliced], (name, n, mma[sliced])
    assert mma["lora_fused<__nv_bfloat16, 16, 64, false, true>"] < 0.8 * mma["lora_fused<__nv_bfloat16, 16, 64, false, false>"]


def test_elf_section_reader_refuses_what_is_not_a_cubin():
    with pytest.raises(ValueError, match="ELF"):
        kernels._elf_sections(b"//\n.version 9.0\n.target sm_90\n")


def test_prebuild_writes_each_family_keyed_by_its_source(tmp_path):
    """``check-kernels --prebuild``: a CUBIN and its lowered names a family, named by a hash of the
    source (headers included), the architecture and the kernels, so an edited source matches no file."""
    import json

    written = kernels.prebuild(tmp_path, "sm_90", ["lora_delta"])
    assert len(written) == 1 and written[0].read_bytes()[:4] == b"\x7fELF"
    lowered = json.loads((tmp_path / (written[0].name[:-len(".cubin")] + ".json")).read_text())
    assert set(lowered) == set(kernels.FAMILIES["lora_delta"].name_expressions)
    assert all(low.startswith("_Z") for low in lowered.values())  # mangled: what the module exports
    src = kernels.read_source("lora_delta.cu")
    stem = kernels.prebuilt_stem("lora_delta", "sm_90", src)
    assert written[0].name == stem + ".cubin"
    assert kernels.prebuilt_stem("lora_delta", "sm_90", src + "\n") != stem
    assert kernels.prebuilt_stem("lora_delta", "sm_80", src) != stem


def test_check_kernels_prebuild_command(tmp_path, capsys, monkeypatch):
    from lora_cupy.cli import main

    # one small family stands for all of them (the tensor-core ones take minutes on two cores)
    monkeypatch.setattr(kernels, "FAMILIES", {"lora_delta": kernels.FAMILIES["lora_delta"]})
    assert main(["check-kernels", "--prebuild", str(tmp_path), "--arch", "sm_90", "--arch", "sm_80"]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.cubin"))
    assert [n.split(".")[:2] for n in names] == [["lora_delta", "sm_80"], ["lora_delta", "sm_90"]]
    assert capsys.readouterr().out.count("wrote") == 2


def _own_source(monkeypatch, extra: str) -> None:
    """Give this test's compiles a source of their own (a key no other test's compile shares)."""
    import uuid

    real = kernels.read_source
    tag = f"\n// {uuid.uuid4().hex}\n{extra}"
    monkeypatch.setattr(kernels, "read_source", lambda file, defines=None: real(file, defines) + tag)


def _same_compile(a, b) -> bool:
    """Two NVRTC results of one source are the same compile: the same lowered names, the same PTX but
    for the names NVRTC gives internal symbols (they carry a number of the compiling process), and
    the same machine code for every kernel."""
    import re

    def ptx(p):
        return re.sub(rb"_cu_[0-9a-f]{8}_\d+", b"_cu_", p)

    def code(cubin):
        return {k: v for k, v in kernels._elf_sections(cubin, data=True).items() if k.startswith(".text.")}

    return a[2] == b[2] and ptx(a[0]) == ptx(b[0]) and code(a[1]) == code(b[1]) and len(code(a[1])) == len(a[2])


def test_compile_ahead_gives_what_a_compile_here_gives(monkeypatch):
    """A compile started in a worker process is the compile this process would run: the same PTX,
    machine code and lowered names; the family's check then waits for it rather than compiling again."""
    from concurrent.futures import Future

    _own_source(monkeypatch, "")
    fam = kernels.FAMILIES["lora_delta"]
    key = (kernels.read_source(fam.file), fam.file, "sm_80", fam.name_expressions)
    futures = kernels.compile_ahead([("lora_delta", "sm_80")])
    assert len(futures) == 1 and isinstance(kernels._COMPILED[key], Future)
    assert kernels.compile_ahead([("lora_delta", "sm_80")]) == []  # under way: not started twice
    ahead = futures[0].result(timeout=600)
    here = kernels._nvrtc_compile(*key)
    assert _same_compile(ahead, here)
    assert not _same_compile(ahead, kernels._nvrtc_compile(key[0], key[1], "sm_90", key[3]))  # it can fail
    assert kernels.compile_family("lora_delta", "sm_80") == ahead[0]
    assert kernels._COMPILED[key] == ahead  # kept as a result now, not a future
    assert kernels.compile_ahead([("lora_delta", "sm_80")]) == []  # done: not started again


def test_a_source_refused_in_a_worker_raises_its_log_where_it_is_asked_for(monkeypatch):
    _own_source(monkeypatch, 'extern "C" __global__ void broken_kernel(float* y) { y[0] = ; }\n')
    futures = kernels.compile_ahead([("lora_delta", "sm_90")])
    with pytest.raises(kernels.KernelCompileError):
        futures[0].result(timeout=600)
    with pytest.raises(kernels.KernelCompileError, match="expected an expression") as e:
        kernels.compile_family("lora_delta", "sm_90")
    assert "lora_delta.cu" in str(e.value)


def test_cancel_ahead_stops_the_workers_at_once(tmp_path):
    """A run stopped early (``cancel_ahead``, as the test session's end calls it) does not wait at exit
    for a tensor-core family's compile (minutes on two cores)."""
    import subprocess
    import sys
    import time

    script = tmp_path / "cancel.py"
    script.write_text(
        "import time\n"
        "from lora_cupy import kernels\n"
        "if __name__ == '__main__':\n"
        "    futures = kernels.compile_ahead([('lora_mma_bfloat16', 'sm_90'), ('lora_mma_float16', 'sm_90')])\n"
        "    time.sleep(3)\n"
        "    assert not any(f.done() for f in futures)\n"
        "    kernels.cancel_ahead()\n"
        "    assert kernels._COMPILED == {} and kernels._AHEAD is None\n"
        "    print('cancelled')\n")
    t = time.perf_counter()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "cancelled", done.stderr
    assert time.perf_counter() - t < 60


def test_a_cubin_is_written_whole(tmp_path):
    """NVRTC's CUBIN as the C API gives it (nvrtcGetCUBINSize bytes), not CuPy's getCUBIN, which drops
    the last byte: the image spans exactly what its ELF header says, and a CUBIN short of that by a
    few bytes is given them back as zeros (more is left as it is: not a CuPy off-by-one)."""
    import ctypes

    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram('extern "C" __global__ void f(float* y) { y[threadIdx.x] += 1.f; }\n', "f.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=sm_90"])
        libs = [w for w in open("/proc/self/maps").read().split() if "libnvrtc.so" in w]
        assert libs, "the NVRTC library CuPy loaded is not mapped in this process"
        lib = ctypes.CDLL(libs[0])
        size = ctypes.c_size_t(0)
        assert lib.nvrtcGetCUBINSize(ctypes.c_void_p(prog), ctypes.byref(size)) == 0
        whole = ctypes.create_string_buffer(size.value)
        assert lib.nvrtcGetCUBIN(ctypes.c_void_p(prog), whole) == 0
        assert kernels._whole_elf(nvrtc.getCUBIN(prog)) == whole.raw
    finally:
        nvrtc.destroyProgram(prog)
    assert kernels._elf_end(whole.raw) == len(whole.raw)
    assert kernels._whole_elf(whole.raw[:-3]) == whole.raw  # a few bytes short: given back
    assert kernels._whole_elf(whole.raw[:-40]) == whole.raw[:-40]  # more: left alone
    written = kernels.prebuild(tmp_path, "sm_90", ["lora_delta"])[0].read_bytes()
    assert kernels._elf_end(written) == len(written)


def test_device_arch_is_hopper_specific_target_only_on_hopper():
    assert kernels.device_arch("90") == "sm_90a"
    assert kernels.device_arch(90) == "sm_90a"
    assert [kernels.device_arch(c) for c in ("80", "86", "89", "100", "120")] == \
        ["sm_80", "sm_86", "sm_89", "sm_100", "sm_120"]
    with pytest.raises(ValueError, match="compute capability"):
        kernels.device_arch("9.0")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tall_chunks_run_on_warpgroup_mma_only_for_sm_90a(dtype):
    """chunk.cuh's chunks of 64 and 128 at rank width 64 take wgmma where the target is sm_90a (what Hopper
    runs, ``device_arch``), with the proxy fence their copies need; sm_90 builds the same sources on
    mma.sync alone (what a later architecture runs)."""
    family = kernels.mma_family(dtype)
    hopper = kernels.compile_family(family, "sm_90a")
    plain = kernels.compile_family(family, "sm_90")
    hopper, plain = (p.decode() if isinstance(p, bytes) else p for p in (hopper, plain))
    kind = "bf16" if dtype == "bfloat16" else "f16"
    assert f"wgmma.mma_async.sync.aligned.m64n64k16.f32.{kind}.{kind}" in hopper
    assert "fence.proxy.async.shared::cta" in hopper
    assert "wgmma" not in plain and "fence.proxy.async" not in plain
    assert "mma.sync.aligned.m16n8k16" in plain
    # kernel by kernel: lora_chunk at rank width 64 in chunks of 64 and 128 and no other
    fam = kernels.FAMILIES[family]
    lowered = kernels._nvrtc(kernels.read_source(fam.file), fam.file, "sm_90a", fam.name_expressions, cubin=False)[1]
    bodies = {name: body for name, _, body in (e.partition("(") for e in hopper.split(".entry ")[1:])}
    for rw, bm in kernels.CHUNK_SHAPES:
        for aligned, sliced in ((False, False), (False, True), (True, False), (True, True)):
            entry = lowered[kernels.chunk_name(kernels.CUDA_TYPES[dtype], rw, bm, aligned=aligned, sliced=sliced)]
            assert ("wgmma.mma_async" in bodies[entry]) == (rw == 64 and bm >= 64), (rw, bm, aligned, sliced)


def test_cached_cubin_compiles_once_then_reads_the_cache(tmp_path, monkeypatch):
    """The run-time build for an architecture-specific target: compiled with NVRTC on the first ask,
    written whole under the cache directory, read back by a later process (the second call here
    compiles nothing), and compiled again for an edited source or another architecture."""
    calls = []

    def fake_nvrtc(source, name, arch, name_expressions, cubin):
        calls.append((arch, source))
        assert cubin
        return b"\x7fELF" + arch.encode() + source.encode(), {e: f"_Z{i}" for i, e in enumerate(name_expressions)}

    monkeypatch.setattr(kernels, "_nvrtc", fake_nvrtc)
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "c"))
    src = kernels.read_source("lora_delta.cu")
    path, lowered = kernels.cached_cubin("lora_delta", src, "sm_90a")
    assert path.parent == tmp_path / "c" and path.name == kernels.prebuilt_stem("lora_delta", "sm_90a", src) + ".cubin"
    assert path.read_bytes() == b"\x7fELFsm_90a" + src.encode()
    assert set(lowered) == set(kernels.FAMILIES["lora_delta"].name_expressions)
    assert not list(path.parent.glob("*.tmp"))
    assert kernels.cached_cubin("lora_delta", src, "sm_90a") == (path, lowered)
    assert len(calls) == 1
    kernels.cached_cubin("lora_delta", src + "\n", "sm_90a")
    kernels.cached_cubin("lora_delta", src, "sm_100a")
    assert [a for a, _ in calls] == ["sm_90a", "sm_90a", "sm_100a"]
    path.with_suffix(".json").write_text("{not json")  # a damaged cache entry is built again
    assert kernels.cached_cubin("lora_delta", src, "sm_90a")[1] == lowered and len(calls) == 4


def test_cache_dir_follows_its_variable_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "x"))
    assert kernels.cache_dir() == tmp_path / "x"
    monkeypatch.delenv(kernels.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernels.cache_dir() == tmp_path / "xdg" / "lora_cupy"


class _FakeCupy:
    """As much of ``cupy`` as ``kernels._load`` touches, on a machine with no GPU: a device of the
    given compute capability and a RawModule that records how it was made."""

    def __init__(self, cc: str):
        import types

        self.made = []
        self.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(compute_capability=cc))
        fake = self

        class RawModule:
            def __init__(self, **kw):
                fake.made.append(kw)

            def get_function(self, name):
                return name

        self.RawModule = RawModule


@pytest.fixture
def fake_device(monkeypatch, tmp_path):
    import sys

    def install(cc: str) -> _FakeCupy:
        fake = _FakeCupy(cc)
        monkeypatch.setitem(sys.modules, "cupy", fake)
        return fake

    monkeypatch.delenv(kernels.PREBUILT_ENV, raising=False)
    monkeypatch.delenv("LORA_CUPY_KERNEL_DEFINES", raising=False)
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    kernels._load.cache_clear()
    yield install
    kernels._load.cache_clear()


def _fake_nvrtc(source, name, arch, name_expressions, cubin):
    return b"\x7fELF" + arch.encode(), {e: f"_Z{i}" for i, e in enumerate(name_expressions)}


def test_hopper_loads_the_projects_sm_90a_build_and_others_cupys(fake_device, monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_nvrtc", _fake_nvrtc)
    fake = fake_device("90")
    mod = kernels.load_module("lora_delta")
    assert isinstance(mod, kernels.PrebuiltModule) and mod.path.parent == tmp_path
    assert mod.path.name.startswith("lora_delta.sm_90a.") and fake.made == [{"path": str(mod.path)}]
    kernels._load.cache_clear()
    fake = fake_device("80")
    mod = kernels.load_module("lora_delta")
    assert not isinstance(mod, kernels.PrebuiltModule)
    assert fake.made[0]["name_expressions"] == kernels.FAMILIES["lora_delta"].name_expressions
    assert "-arch" not in " ".join(fake.made[0]["options"])  # CuPy names the device's architecture itself


def test_a_failed_sm_90a_build_falls_back_to_cupys_portable_build(fake_device, monkeypatch, tmp_path):
    def refuse(*a, **k):
        raise kernels.KernelCompileError("NVRTC failed for sm_90a: planted\nthe log", path="lora_delta.cu")

    monkeypatch.setattr(kernels, "_nvrtc", refuse)
    fake = fake_device("90")
    with pytest.warns(RuntimeWarning, match=r"sm_90a build failed \(.*planted\); compiling it through CuPy for sm_90"):
        mod = kernels.load_module("lora_delta")
    assert not isinstance(mod, kernels.PrebuiltModule)
    assert fake.made and fake.made[-1]["code"] == kernels.read_source("lora_delta.cu")
    assert not list(tmp_path.iterdir())  # nothing half-written left in the cache


def test_a_prebuilt_cubin_is_found_under_the_devices_target(fake_device, monkeypatch, tmp_path):
    """``LORA_CUPY_PREBUILT``: the file named for this source and ``device_arch`` loads with no compile;
    one whose names file cannot be read is passed over with a warning, and the family is built instead."""
    import json

    built = []

    def counting_nvrtc(*a, **k):
        built.append(a[2])
        return _fake_nvrtc(*a, **k)

    monkeypatch.setattr(kernels, "_nvrtc", counting_nvrtc)
    pb = tmp_path / "pb"
    pb.mkdir()
    src = kernels.read_source("lora_delta.cu")
    stem = pb / kernels.prebuilt_stem("lora_delta", "sm_90a", src)
    cubin, names_file = Path(f"{stem}.cubin"), Path(f"{stem}.json")
    names = {e: f"_Z{i}" for i, e in enumerate(kernels.FAMILIES["lora_delta"].name_expressions)}
    cubin.write_bytes(b"\x7fELF prebuilt")
    names_file.write_text(json.dumps(names))
    monkeypatch.setenv(kernels.PREBUILT_ENV, str(pb))
    fake_device("90")
    mod = kernels.load_module("lora_delta")
    assert isinstance(mod, kernels.PrebuiltModule) and mod.path == cubin and built == []
    kernels._load.cache_clear()
    names_file.write_text("{not json")
    with pytest.warns(UserWarning, match="not loaded"):
        mod = kernels.load_module("lora_delta")
    assert mod.path.parent == tmp_path and built == ["sm_90a"]  # built into the cache directory instead


def _fake_nvrtc_compile(calls):
    def compile_(source, name, arch, name_expressions, extra=()):
        calls.append((arch, source, tuple(extra)))
        return b"ptx", b"\x7fELF" + arch.encode(), tuple((e, f"_Z{i}") for i, e in enumerate(name_expressions))

    return compile_


def test_a_dev_source_is_built_for_sm_90a_once_then_loaded(fake_device, monkeypatch, tmp_path):
    """``source_module``: a dev tool's copy of the kernels is built as the families are (sm_90a through
    the project's NVRTC on Hopper, with the include directories it names), kept in the cache directory
    under a hash of what was built, and loaded again with no compile; elsewhere CuPy builds it."""
    calls = []
    monkeypatch.setattr(kernels, "_nvrtc_compile", _fake_nvrtc_compile(calls))
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "h.cuh").write_text("// a header\n")
    fake = fake_device("90")
    mod = kernels.source_module("// traced", "trace.cu", ["k<1>", "k<2>"], include_dirs=[inc])
    assert isinstance(mod, kernels.PrebuiltModule) and mod.path.parent == tmp_path
    assert mod.path.name.startswith("trace.sm_90a.") and fake.made == [{"path": str(mod.path)}]
    assert calls == [("sm_90a", "// traced", (f"-I{inc}",))]
    assert mod.get_function("k<2>") == "_Z1"
    assert kernels.source_module("// traced", "trace.cu", ["k<1>", "k<2>"], include_dirs=[inc]).path == mod.path
    assert len(calls) == 1  # read back, not built again
    other = kernels.source_module("// traced, edited", "trace.cu", ["k<1>", "k<2>"], include_dirs=[inc])
    assert other.path != mod.path and len(calls) == 2
    assert kernels.source_module("// traced", "trace.cu", ["k<1>"], include_dirs=[inc]).path not in (mod.path, other.path)
    assert len(calls) == 3
    (inc / "h.cuh").write_text("// a header, edited\n")  # what the source includes changed: built anew
    assert kernels.source_module("// traced", "trace.cu", ["k<1>", "k<2>"], include_dirs=[inc]).path != mod.path
    assert len(calls) == 4
    fake = fake_device("80")
    plain = kernels.source_module("// traced", "trace.cu", ["k<1>"], include_dirs=[inc])
    assert not isinstance(plain, kernels.PrebuiltModule) and len(calls) == 4
    assert fake.made[0]["code"] == "// traced" and fake.made[0]["name_expressions"] == ("k<1>",)
    assert f"-I{inc}" in fake.made[0]["options"]


def test_a_dev_sources_cubin_is_named_for_the_kernels_headers_too(tmp_path, monkeypatch):
    """A dev tool's copy of lora_mma.cu includes the kernels' headers: an edited header names another file."""
    for p in kernels.kernel_dir().glob("*.cu*"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(kernels, "kernel_dir", lambda: tmp_path)
    before = kernels._source_files(tmp_path / "c", "// copy", "copy.cu", "sm_90a", ("k<1>",))
    header = tmp_path / "pair.cuh"
    header.write_text(header.read_text() + "\n// edited\n")
    assert kernels._source_files(tmp_path / "c", "// copy", "copy.cu", "sm_90a", ("k<1>",)) != before


def test_a_dev_source_built_ahead_is_found_and_a_failed_build_falls_back(fake_device, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(kernels, "_nvrtc_compile", _fake_nvrtc_compile(calls))
    pb = tmp_path / "pb"
    ahead = kernels.source_cubin("// proto", "proto.cu", ["p<1>"], "sm_90a", where=pb)  # on a CPU machine
    assert ahead.parent == pb and len(calls) == 1

    def refuse(*a, **k):
        raise kernels.KernelCompileError("NVRTC failed for sm_90a: planted\nthe log", path="proto.cu")

    monkeypatch.setattr(kernels, "_nvrtc_compile", refuse)
    monkeypatch.setenv(kernels.PREBUILT_ENV, str(pb))
    fake_device("90")
    assert kernels.source_module("// proto", "proto.cu", ["p<1>"]).path == ahead
    with pytest.warns(RuntimeWarning, match=r"proto.cu: the sm_90a build failed \(.*planted\); compiling it through CuPy"):
        mod = kernels.source_module("// proto, edited", "proto.cu", ["p<1>"])
    assert not isinstance(mod, kernels.PrebuiltModule)
    assert not [p for p in tmp_path.iterdir() if p.is_file()]  # nothing half-written in the cache


def test_source_cubin_compiles_with_its_include_directories(tmp_path):
    """The real NVRTC: a source whose header lies in a directory of its own builds for sm_90a."""
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "twice.cuh").write_text("__device__ float twice(float v) { return 2.f * v; }\n")
    src = '#include "twice.cuh"\ntemplate <int N> __global__ void k(float* y) { y[N] = twice(y[N]); }\n'
    cubin = kernels.source_cubin(src, "inc.cu", ["k<3>"], "sm_90a", where=tmp_path / "out", include_dirs=[inc])
    assert cubin.read_bytes()[:4] == b"\x7fELF"
    assert "k<3>" in cubin.with_suffix(".json").read_text()
    with pytest.raises(kernels.KernelCompileError, match="twice.cuh"):
        kernels.source_cubin(src, "inc.cu", ["k<3>"], "sm_90a", where=tmp_path / "out2")


#: A ``libnvrtc.so.13`` of CUDA 13.0, the oldest NVRTC the package allows (``nvidia-cuda-nvrtc>=13``;
#: the NVRTC of a CUDA 13.0 host): ``.ci/run`` installs that wheel beside the venv and names it here.
OLDEST_NVRTC_ENV = "LORA_CUPY_OLDEST_NVRTC"


def _compile_with(lib_path: str, family: str, arch: str, options) -> tuple[tuple[int, int], int, str]:
    """One family compiled by the NVRTC library at ``lib_path`` (through its C API; CuPy's binding is
    bound to the NVRTC it loaded): ``(version, result code, log)``."""
    import ctypes

    lib_dir = Path(lib_path).parent
    for builtins in sorted(lib_dir.glob("libnvrtc-builtins.so.*")):  # its soname, loaded before NVRTC asks
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(lib_path)
    major, minor = ctypes.c_int(), ctypes.c_int()
    assert lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0
    fam = kernels.FAMILIES[family]
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), kernels.read_source(fam.file).encode(), fam.file.encode(),
                                  0, None, None) == 0
    try:
        for expr in fam.name_expressions:
            assert lib.nvrtcAddNameExpression(prog, expr.encode()) == 0
        opts = kernels.compile_options(arch, options)
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts)))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        return (major.value, minor.value), rc, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.skipif(not os.environ.get(OLDEST_NVRTC_ENV),
                    reason=f"{OLDEST_NVRTC_ENV} names no CUDA 13.0 libnvrtc.so (.ci/run installs one)")
def test_every_family_compiles_with_the_oldest_nvrtc():
    """A CUDA 13.0 host compiles what 13.5 does: each family for Hopper (sm_90a) with the run-time
    options. Without ``-default-device`` 13.0 refuses lora_mma.cu's generic lambda as host code, so
    the option is checked to be what makes the difference."""
    lib = os.environ[OLDEST_NVRTC_ENV]
    version, rc, log = _compile_with(lib, "lora_mma_float32", "sm_90a",
                                     [o for o in kernels.NVRTC_OPTIONS if o != "-default-device"])
    assert version == (13, 0), f"{lib} is NVRTC {version}, not 13.0"
    assert rc != 0 and "JIT mode" in log  # 13.0's refusal, which -default-device answers
    for family in sorted(kernels.FAMILIES):
        version, rc, log = _compile_with(lib, family, "sm_90a", kernels.NVRTC_OPTIONS)
        assert rc == 0, f"NVRTC {version} refuses {family}:\n{log[:3000]}"
