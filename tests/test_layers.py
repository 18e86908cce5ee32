"""The library's modules stand in layers: none imports a module of its own layer or one above it.

What a reader of ``lora_cupy/`` can rely on: the pool sits on planning, slots, the catalog, the
store and the backends, and none of those reaches back up into the pool (or into the engine's
worker, the integrations, the benchmarks and the command line, which sit above everything).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lora_cupy

ROOT = Path(lora_cupy.__file__).parent

#: Bottom to top. A module not listed sits above every listed one.
LAYERS = (
    ("errors", "dtypes"),
    ("spec", "adapter", "addressing", "kernels", "backends.base", "backends.launch_ex"),
    ("peft", "backends.reference", "backends.cupy"),
    ("device", "engine.resource"),
    ("store", "slots", "buffers", "planning", "engine.admission"),
    ("agreement", "catalog", "delta"),
    ("pool",),
)
LAYER = {m: i for i, names in enumerate(LAYERS) for m in names}
TOP = len(LAYERS)


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imports(path: Path) -> set[str]:
    """The ``lora_cupy`` modules a file imports anywhere in it (lazy imports count too)."""
    me = _module(path).split(".")
    package = me[:-1] if path.name != "__init__.py" else me[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("lora_cupy"):
                mod = node.module.removeprefix("lora_cupy").lstrip(".")
            else:
                continue
            for alias in node.names:  # `from . import kernels` names a module
                sub = f"{mod}.{alias.name}" if mod else alias.name
                found.add(sub if (ROOT / Path(*sub.split("."))).with_suffix(".py").exists() else mod)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("lora_cupy.") for a in node.names if a.name.startswith("lora_cupy.")}
    return {m for m in found if m}


FILES = sorted(p for p in ROOT.rglob("*.py") if p.name != "__init__.py")


def test_every_listed_module_exists():
    modules = {_module(p) for p in FILES}
    assert set(LAYER) <= modules, sorted(set(LAYER) - modules)


@pytest.mark.parametrize("path", FILES, ids=lambda p: _module(p))
def test_no_module_imports_its_layer_or_one_above(path):
    me = _module(path)
    mine = LAYER.get(me, TOP)
    for other in _imports(path):
        if other.split(".")[0] == "bench" and me.startswith("bench"):
            continue
        theirs = LAYER.get(other, TOP)
        assert theirs < mine or (mine == TOP and theirs == TOP), \
            f"lora_cupy.{me} (layer {mine}) imports lora_cupy.{other} (layer {theirs})"
