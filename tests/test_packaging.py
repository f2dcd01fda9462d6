"""The distribution installs the three layers under one name and nothing else at top level."""

import importlib
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {"mxmoe": "mxmoe", "mxmoe.core": "core", "mxmoe.kernels": "kernels", "mxmoe.runtime": "runtime",
          "mxmoe.compiler": "compiler", "mxmoe.torch_frontend": "torch_frontend"}


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_source_package_is_listed():
    listed = set(_project()["tool"]["setuptools"]["packages"])
    found = set()
    for pkg, folder in LAYERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((pkg,) + rel))
    assert found == listed


def test_package_dirs_map_the_layers():
    assert _project()["tool"]["setuptools"]["package-dir"] == LAYERS


def test_layers_import_under_mxmoe_only():
    for pkg in LAYERS:
        importlib.import_module(pkg)
    for bare in ("core", "kernels", "compiler", "runtime", "torch_frontend"):
        spec = importlib.util.find_spec(bare)
        assert spec is None or ROOT in pathlib.Path(spec.origin or "").parents, f"stray top-level '{bare}'"


def test_import_mxmoe_is_cheap():
    """`import mxmoe` must not pull in torch, the MLIR bindings or triton."""
    code = ("import sys, mxmoe; heavy = [m for m in ('torch', 'triton', 'iree.compiler') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
