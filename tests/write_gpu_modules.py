"""Build the modules the GPU tests compile, for a GPU machine without the compiler (its IREE bindings):

    python tests/write_gpu_modules.py DIR [KEY_PREFIX ...]
    # on the GPU machine: MXMOE_GPU_PLANS=DIR python -m pytest -m gpu tests

Each test file in ``FILES`` names what it compiles in ``GPU_MODULES`` (key -> (layer factory, target, compile
options)). Every module is compiled here and written without weights (a few MB of cubins and plan each) to
``DIR/prebuilt/KEY.mxmoe``; the tests' ``gpu_module`` fixture (tests/conftest.py) loads it there and binds the
layer's own weights, which the test makes from the same seed. A key that exists is rebuilt (the code may have
changed). With prefixes, only the keys that start with one of them ("templates": the engine's, below).

The engine's and the transformers families' GPU tests bind modules through ``Mxfp4MoEMethod`` and the experts
integration, which read compiled templates from ``$MXMOE_TEMPLATES``: they are written to ``DIR/templates`` (point
``MXMOE_TEMPLATES`` there on the GPU machine).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
#: the test files with GPU_MODULES
FILES = ("compiler/test_cuda_interface_gpu.py", "kernels/test_triton_fuzz_gpu.py",
         "torch_frontend/test_routing_contract.py")


def _test_file(rel: str):
    """The test file ``rel`` (under tests/) imported as a module (the tests import in pytest's importlib mode)."""
    spec = importlib.util.spec_from_file_location(f"_gpu_{rel.replace('/', '_')[:-3]}", os.path.join(HERE, rel))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gpu_modules() -> dict:
    """Every test file's GPU_MODULES, merged (keys are unique across files)."""
    out = {}
    for rel in FILES:
        mod = _test_file(rel)
        clash = set(out) & set(mod.GPU_MODULES)
        if clash:
            raise SystemExit(f"{rel}: GPU_MODULES keys also in another file: {sorted(clash)}")
        out.update(mod.GPU_MODULES)
    return out


def write_templates(folder: str) -> None:
    """The compiled templates the engine's and the transformers families' GPU tests bind
    (tests/mxmoe/test_engine.py ``gpu_template_layers``, tests/mxmoe/test_transformers_gpu.py ``write_templates``),
    written as ``$MXMOE_TEMPLATES`` holds them."""
    os.environ["MXMOE_TEMPLATES"] = folder
    for case, method, layer in _test_file("mxmoe/test_engine.py").gpu_template_layers():
        t0 = time.perf_counter()
        method.template(layer)
        print(f"engine template {case}: {time.perf_counter() - t0:.0f} s", flush=True)
    _test_file("mxmoe/test_transformers_gpu.py").write_templates()


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    import mxmoe

    root, prefixes = argv[0], tuple(argv[1:])
    os.makedirs(os.path.join(root, "prebuilt"), exist_ok=True)
    for key, (make_layer, target, options) in gpu_modules().items():
        if prefixes and not key.startswith(prefixes):
            continue
        t0 = time.perf_counter()
        cm = mxmoe.compile(make_layer(), target=target, **options)
        path = os.path.join(root, "prebuilt", f"{key}.mxmoe")
        cm.save(path, weights="none")
        print(f"{key}: {os.path.getsize(path) / 1e6:.1f} MB in {time.perf_counter() - t0:.0f} s", flush=True)
    if not prefixes or "templates".startswith(prefixes):
        write_templates(os.path.join(root, "templates"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
