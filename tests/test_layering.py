"""The layers import one way only: every import in every source file, module level or inside a function.

docs/architecture.md draws the layers; this test is what keeps the drawing true. From the bottom:

    core -> kernels -> runtime -> compiler -> torch_frontend -> mxmoe (the public face: mxmoe.compile, the CLI)

A module may import its own layer and the layers below it, never one above. Besides, some layers promise to
stay light: ``core`` imports no torch, triton or MLIR (its torch bridge imports torch inside its functions);
``kernels`` and ``runtime`` never import the compiler's MLIR bindings; the runtime imports torch only for Triton
code (the IREE path runs where torch is not installed).
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: folder -> package, lowest layer first
LAYERS = {"core": "mxmoe.core", "kernels": "mxmoe.kernels", "runtime": "mxmoe.runtime", "compiler": "mxmoe.compiler",
          "torch_frontend": "mxmoe.torch_frontend", "mxmoe": "mxmoe"}
RANK = {folder: i for i, folder in enumerate(LAYERS)}

#: (folder, external top-level module) -> the files of that folder that may import it, and how
#: ("function": only inside a function; "module": anywhere)
EXTERNAL_RULES: dict[tuple[str, str], dict[str, str]] = {
    ("core", "torch"): {"core/bridge.py": "function"},
    ("core", "triton"): {},
    ("core", "iree"): {},
    ("kernels", "iree.compiler"): {},
    ("runtime", "iree.compiler"): {},
    # the Triton code's device check asks torch whether CUDA is there; only Triton code reaches it
    ("runtime", "torch"): {"runtime/triton_executor.py": "module", "runtime/code.py": "function"},
    ("runtime", "triton"): {"runtime/triton_executor.py": "module"},
}


def _layer_of(module: str) -> str | None:
    if module == "mxmoe" or module.startswith("mxmoe."):
        for folder, pkg in reversed(LAYERS.items()):
            if pkg != "mxmoe" and (module == pkg or module.startswith(pkg + ".")):
                return folder
        return "mxmoe"
    return None


def _imports(path: pathlib.Path, package: str):
    """(imported module, line, inside a function) for every import statement of a source file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for inner in ast.walk(node):
                if inner is not node:
                    in_function.add(id(inner))
    for node in ast.walk(tree):
        nested = id(node) in in_function
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, nested
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's own package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if mod == "mxmoe":  # ``from mxmoe import x`` imports the submodule x
                for alias in node.names:
                    yield f"mxmoe.{alias.name}", node.lineno, nested
            else:
                yield mod, node.lineno, nested


def _sources():
    for folder, pkg in LAYERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder)
            package = ".".join((pkg, *rel.parts[:-1]))
            yield folder, path, package


def _violations() -> list[str]:
    out = []
    for folder, path, package in _sources():
        rel = str(path.relative_to(ROOT))
        for mod, line, nested in _imports(path, package):
            layer = _layer_of(mod)
            if layer is not None:
                if RANK[layer] > RANK[folder]:
                    out.append(f"{rel}:{line}: {folder} imports {mod}, a module of the higher layer '{layer}'")
                continue
            for (rule_folder, ext), allowed in EXTERNAL_RULES.items():
                if rule_folder != folder or not (mod == ext or mod.startswith(ext + ".")):
                    continue
                how = allowed.get(rel)
                if how is None or (how == "function" and not nested):
                    where = "at module level " if how == "function" else ""
                    out.append(f"{rel}:{line}: {folder} imports {mod} {where}(see EXTERNAL_RULES)")
    return out


def test_layers_import_one_way():
    assert _violations() == []


def test_every_source_folder_is_a_layer():
    """A new top-level folder of Python sources must be placed in the layering (tests and benchmarks aside)."""
    folders = {p.parent.relative_to(ROOT).parts[0] for p in ROOT.glob("*/**/*.py")
               if not p.relative_to(ROOT).parts[0].startswith(".")}
    assert folders - set(LAYERS) - {"tests", "benchmarks", "build"} == set()


@pytest.mark.parametrize("source, expected", [
    ("import mxmoe.compiler.api\n", "core imports mxmoe.compiler.api"),
    ("def f():\n    from mxmoe.runtime import load\n", "core imports mxmoe.runtime"),
    ("import torch\n", "core imports torch"),
])
def test_the_check_sees_upward_and_hidden_imports(tmp_path, monkeypatch, source, expected):
    """The check itself: an upward import, one hidden inside a function, and a forbidden external module."""
    fake = tmp_path / "core"
    fake.mkdir()
    (fake / "bad.py").write_text(source)
    for folder in LAYERS:
        (tmp_path / folder).mkdir(exist_ok=True)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = _violations()
    assert len(found) == 1 and expected in found[0], found
