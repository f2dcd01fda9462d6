"""The GPU tests' modules built ahead of time (tests/write_gpu_modules.py, the ``gpu_module`` fixture): the
registries import without a GPU and name every module once, and a module written without weights is found under
``$MXMOE_GPU_PLANS/prebuilt`` and bound to the layer's own weights (a cpu module here stands in for a cubin one)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _writer():
    spec = importlib.util.spec_from_file_location("_write_gpu_modules", os.path.join(HERE, "write_gpu_modules.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_gpu_module_is_registered_once():
    modules = _writer().gpu_modules()
    prefixes = {"interface-": 8, "fuzz-": 6, "routing-issue-": 3}
    for p, n in prefixes.items():
        assert sum(k.startswith(p) for k in modules) == n, p
    for key, (make_layer, target, options) in modules.items():
        assert callable(make_layer) and target == "cuda:sm_90" and isinstance(options, dict), key


def test_a_prebuilt_module_is_bound_to_the_layers_weights(gpu_module, tmp_path, monkeypatch):
    pytest.importorskip("iree.compiler")
    import mxmoe
    from mxmoe.runtime.loader import LoadedModule
    from mxmoe.torch_frontend import MoE

    layer = MoE.random("tiny", seed=5)
    cm = mxmoe.compile(layer, target="cpu")
    path = tmp_path / "prebuilt" / "tiny-cpu.mxmoe"
    path.parent.mkdir()
    cm.save(path, weights="none")
    monkeypatch.setenv("MXMOE_GPU_PLANS", str(tmp_path))
    got = gpu_module("tiny-cpu", layer, "cpu")
    assert isinstance(got, LoadedModule) and got.weight_set == "memory"
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(got(x), cm(x))
    # a key that is not there: compiled here
    assert not isinstance(gpu_module("absent", layer, "cpu"), LoadedModule)
