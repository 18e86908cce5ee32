"""The wheel ships raw_kernels/ inside lora_cupy and finds it at run time; sim/ stays out of it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a clean copy of the tree: a ``build/`` left in the checkout by an
    earlier build would keep modules deleted since, and ship them."""
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], check=True, capture_output=True)
    (whl,) = out.glob("lora_cupy-*.whl")
    return whl


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    sources = {p.name for p in (ROOT / "raw_kernels").iterdir() if p.suffix in (".cu", ".cuh")}
    shipped = {n.rsplit("/", 1)[1] for n in names if n.startswith("lora_cupy/_kernels/")}
    assert sources and sources <= shipped
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "lora_cupy").rglob("*.py") if "__pycache__" not in p.parts}
    assert modules <= set(names), sorted(modules - set(names))
    tops = {n.split("/", 1)[0] for n in names}
    assert not tops & {"sim", "tests", "notebooks", "raw_kernels"}, tops


def test_installed_wheel_finds_and_compiles_its_kernels(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    code = ("import lora_cupy.kernels as k; d = k.kernel_dir(); print(d); "
            "k.compile_family(sorted(k.FAMILIES)[0], 'sm_90')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path[1:]])}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(site)
