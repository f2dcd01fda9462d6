"""mxmoe.runtime.load: compiled artifacts loaded and run, checked against the reference MoE.

One tiny layer is compiled once for the module (plus one padded variant); everything else reuses it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import ml_dtypes
import numpy as np
import pytest
import torch

import mxmoe
from mxmoe.core.checkpoint import write_hf_gpt_oss, write_safetensors
from mxmoe.compiler.targets import get_target
from mxmoe.core.layouts import ROW_MAJOR
from mxmoe.runtime import ArtifactError, TargetUnavailableError, WeightsError, load
from mxmoe.runtime import artifact as A
from mxmoe.runtime.loader import stored_parameters
from mxmoe.core.reference import numpy_reference, relative_error
from mxmoe.torch_frontend import MoE
from mxmoe.core.weights import MoEWeights

TOL = 2e-2
BF16 = np.dtype(ml_dtypes.bfloat16)


def _x(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _err(out, ref) -> float:
    out = out.float().numpy() if isinstance(out, torch.Tensor) else np.asarray(out, np.float32)
    ref = ref.float().numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref, np.float32)
    return relative_error(out, ref)


@pytest.fixture(scope="module")
def layer():
    return MoE.random("tiny", seed=3)


@pytest.fixture(scope="module")
def compiled(layer):
    return mxmoe.compile(layer, target="cpu")


@pytest.fixture(scope="module")
def art(compiled, tmp_path_factory):
    p = tmp_path_factory.mktemp("rt") / "tiny.mxmoe"
    compiled.save(p)
    return p


@pytest.fixture(scope="module")
def mod(art):
    return load(art)


# ----------------------------------------------------------------------------------------- numerics

@pytest.mark.parametrize("tokens", [1, 7, 64, 333])
def test_matches_reference_torch_in_torch_out(mod, layer, tokens):
    x = _x(tokens, 64, tokens)
    out = mod(x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == x.shape
    assert _err(out, layer(x)) < TOL


def test_numpy_float32_input_is_converted(mod, layer):
    x = _x(9, 64, 1)
    out = mod(x.float().numpy())
    assert isinstance(out, np.ndarray) and out.dtype == BF16
    assert _err(out, layer(x)) < TOL


@pytest.mark.parametrize("variant", [
    {},
    {"routing": "softmax_topk", "renormalize": True},
    {"routing": "softmax_topk", "activation": "silu", "interleaved": False},
    {"bias": False, "router_bias": False},
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_numpy_reference_agrees_with_torch_reference(variant, dtype):
    """The torch-free reference used by `mxmoe run --check` on deploy boxes computes the same function."""
    cfg = mxmoe.preset("tiny").replace(**variant)
    layer = MoE(MoEWeights.random(cfg, seed=6), dtype=dtype)
    x = _x(50, 64, 2).to(dtype)
    ref_np = numpy_reference(layer.to_weights(), x.float().numpy(), np.dtype(BF16 if dtype == torch.bfloat16 else np.float32))
    assert _err(ref_np, layer(x)) < (TOL if dtype == torch.bfloat16 else 1e-5)


def test_manifest_records_signature_and_target(mod, compiled):
    m = mod.manifest
    assert m["target"]["name"] == "cpu" and m["target"]["backend"] == "iree"
    (entry,) = m["entries"]
    # the token dim is dynamic, bounded by what torch.export was told (capture's MAX_TOKENS)
    from mxmoe.torch_frontend.capture import MAX_TOKENS

    assert entry["inputs"] == [{"name": "x", "dtype": "bfloat16", "shape": [None, 64], "max_dims": [MAX_TOKENS, None]}]
    assert m["model"]["config"]["num_experts"] == 8
    names = {p["name"] for p in m["parameters"]}
    assert {"w13", "w13_scale", "w2", "w2_scale", "router_weight"} <= names
    assert m["target"]["layout"] == compiled.target.layout.name
    # a bf16 layer's weights: the target's layout, or rows16 where the host's microkernel runs the AMX form
    layout = compiled.target.layout_for("bf16").name
    assert all(p["form"]["layout"] == layout for p in m["parameters"] if p["name"].startswith("w"))
    for p in m["parameters"]:
        assert p["dtype"] == compiled.parameters[p["name"]].dtype.name
        assert p["shape"] == list(compiled.parameters[p["name"]].shape)


def test_embedded_weights_are_memory_mapped(art):
    from mxmoe.runtime.loader import parameter_arrays

    a = A.Artifact(art)
    arrays, _ = parameter_arrays(a)
    assert np.shares_memory(arrays["w13"], np.frombuffer(a._map(), np.uint8))


# ----------------------------------------------------------------------------------------- input checks

@pytest.mark.parametrize("bad, message", [
    (lambda: np.zeros((4,), np.float32), "input 'x': expected rank 2 (x: bfloat16[?, 64]), got shape (4,)"),
    (lambda: np.zeros((4, 63), np.float32), "input 'x': dim 1 must be 64 (x: bfloat16[?, 64]), got shape (4, 63)"),
    (lambda: np.zeros((4, 64), np.int32), "input 'x': expected bfloat16, got int32"),
    (lambda: np.zeros((0, 63), np.float32), "input 'x': dim 1 must be 64 (x: bfloat16[?, 64]), got shape (0, 63)"),
])
def test_input_errors_say_exactly_what_is_wrong(mod, bad, message):
    with pytest.raises(ValueError) as e:
        mod(bad())
    assert str(e.value) == message


def test_dynamic_dim_bound_is_checked(art, tmp_path):
    p = tmp_path / "bounded.mxmoe"

    def edit(m):
        e = dict(m["entries"][0])
        e["inputs"] = [{**e["inputs"][0], "max_dims": [100, None]}]
        return {**m, "entries": [e]}

    _rewrite_manifest(art, p, edit)
    mod = load(p)
    assert mod(np.zeros((100, 64), np.float32)).shape == (100, 64)
    with pytest.raises(ValueError) as e:
        mod(np.zeros((101, 64), np.float32))
    assert str(e.value) == "input 'x': dynamic dim 0 = 101 is outside 0..100"


def test_wrong_number_of_inputs(mod):
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match=r"^expected 1 input\(s\) \(x: bfloat16\[\?, 64\]\), got 2$"):
        mod(x, x)


# ----------------------------------------------------------------------------------------- concurrency, memory

def test_concurrent_calls_from_threads(mod, layer):
    xs = [_x(5 + i, 64, 100 + i) for i in range(8)]
    refs = [layer(x) for x in xs]
    errors, results = [], {}

    def worker(t: int):
        try:
            for rep in range(6):
                i = (t + rep) % len(xs)
                results[(t, rep)] = (i, mod(xs[i].float().numpy()))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(results) == 24
    for i, out in results.values():
        assert _err(out, refs[i]) < TOL


def test_many_calls_do_not_grow_memory(mod, layer, rss_bytes):
    x = _x(256, 64, 7).float().numpy()  # each output is 32 KiB: a leak of outputs would show clearly
    for _ in range(100):
        mod(x)
    before = rss_bytes()
    for _ in range(600):
        out = mod(x)
    grown = rss_bytes() - before
    assert grown < 6 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 600 calls"
    assert _err(out, layer(torch.from_numpy(x).to(torch.bfloat16))) < TOL


# ----------------------------------------------------------------------------------------- no torch

def test_iree_path_runs_without_torch(art, mod, tmp_path):
    x = _x(11, 64, 5).float().numpy()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "expected.npy", np.asarray(mod(x), np.float32))
    script = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "triton"):
                    raise ImportError(f"blocked import of {{name}}")
        sys.meta_path.insert(0, Block())
        try:
            import torch
            raise SystemExit("torch import was not blocked")
        except ImportError:
            pass
        import numpy as np
        import mxmoe.runtime
        mod = mxmoe.runtime.load({str(art)!r})
        out = mod(np.load({str(tmp_path / 'x.npy')!r}))
        exp = np.load({str(tmp_path / 'expected.npy')!r})
        assert np.array_equal(np.asarray(out, np.float32), exp)
        # the CLI's --check falls back to the numpy reference on a torch-free machine
        from mxmoe.cli import main
        rc = main(["run", {str(art)!r}, "--tokens", "9", "--check", "-q"])
        assert rc == 0, rc
        assert "torch" not in sys.modules and "triton" not in sys.modules, sorted(sys.modules)
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "vs the numpy reference" in r.stdout and "PASS" in r.stdout
    assert r.stdout.strip().splitlines()[-1] == "OK"


# ----------------------------------------------------------------------------------------- weights at deploy time

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two gpt-oss-layout checkpoints of the tiny shape (different weights), two layers each."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg = mxmoe.preset("tiny")
    out = {}
    for name, seeds in (("a", (10, 11)), ("b", (20, 21))):
        layers = {i: MoEWeights.random(cfg, seed=s) for i, s in enumerate(seeds)}
        write_hf_gpt_oss(root / name, layers, float_dtype="bfloat16")
        out[name] = (root / name, layers)
    return out


def _ref(weights: MoEWeights, x: torch.Tensor) -> torch.Tensor:
    return MoE(weights, dtype=torch.bfloat16)(x)


def test_external_weights_one_module_several_checkpoints(compiled, checkpoints, tmp_path):
    (ca, la), (cb, lb) = checkpoints["a"], checkpoints["b"]
    p = tmp_path / "ext.mxmoe"
    man = compiled.save(p, weights="external",
                        external_sources={"layer.1": {"kind": "hf-gpt-oss", "path": str(ca), "layer": 1}})
    assert not [s for s in man["sections"] if s["name"].startswith("weights/")]
    assert p.stat().st_size < 300_000  # the module alone (its C microkernel passes are most of it): ~240 KB
    x = _x(13, 64, 8)
    assert _err(load(p)(x), _ref(la[1], x)) < TOL                    # the recorded source
    assert _err(load(p, weights=cb, layer=0)(x), _ref(lb[0], x)) < TOL  # another checkpoint, same module
    assert _err(load(p, weights=ca, layer=0)(x), _ref(la[0], x)) < TOL


def test_external_weights_missing_source(compiled, tmp_path):
    p = tmp_path / "ext.mxmoe"
    compiled.save(p, weights="external",
                  external_sources={"layer.0": {"kind": "hf-gpt-oss", "path": str(tmp_path / "gone"), "layer": 0}})
    with pytest.raises(WeightsError, match="recorded source .*gone does not exist here"):
        load(p)
    p2 = tmp_path / "ext2.mxmoe"
    compiled.save(p2, weights="external")  # no source recorded at all
    with pytest.raises(WeightsError, match="weights are not in the artifact; pass weights="):
        load(p2)
    with pytest.raises(WeightsError, match="a checkpoint directory needs a layer number"):
        load(p2, weights=tmp_path)


def test_weight_sets_in_one_artifact(compiled, checkpoints, tmp_path):
    ca, la = checkpoints["a"]
    sets = {f"layer.{i}": (lambda w=w: {f: getattr(w, f) for f in compiled.model["parameters"]}) for i, w in la.items()}
    p = tmp_path / "sets.mxmoe"
    compiled.save(p, weight_sets=sets)
    x = _x(6, 64, 9)
    for i, w in la.items():
        m = load(p, weight_set=f"layer.{i}")
        assert m.weight_set == f"layer.{i}"
        assert _err(m(x), _ref(w, x)) < TOL
    with pytest.raises(ArtifactError, match="no weight set 'layer.7' \\(has: layer.0, layer.1\\)"):
        load(p, weight_set="layer.7")


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """The tiny layer compiled for a target that pads to 64: I=96 becomes 128 in the stored weights."""
    layer = MoE.random("tiny", seed=4)
    tgt = get_target("cpu").replace(layout=ROW_MAJOR, pad_multiple=64)
    return layer, mxmoe.compile(layer, target=tgt)


def test_deploy_time_transform_equals_the_compilers(padded, tmp_path):
    """Raw weights put through the manifest's stored forms at load time are byte-identical to what the
    compiler stored, and the module runs correctly on them."""
    layer, compiled = padded
    assert compiled.parameters["w13"].shape == (8, 256, 32)  # 2 * 128 rows (interleaved gate/up)
    p = tmp_path / "pad.mxmoe"
    man = compiled.save(p, weights="external")
    raw = {k: v for k, v in ((n, getattr(layer, n)) for n in compiled.model["parameters"])}
    raw = {k: (v.view(torch.int16).numpy().view(BF16) if v.dtype == torch.bfloat16 else v.numpy()) for k, v in raw.items()}
    stored = stored_parameters(man, raw)
    for name, a in compiled.parameters.items():
        assert stored[name].dtype == a.dtype and stored[name].shape == a.shape
        assert np.array_equal(stored[name].view(np.uint8), np.ascontiguousarray(a).view(np.uint8)), name
    st = tmp_path / "raw.safetensors"
    write_safetensors(st, raw)
    x = _x(17, 64, 10)
    assert _err(load(p, weights=st)(x), layer(x)) < TOL
    # and the embedded (compiler-padded) form runs the same
    compiled.save(tmp_path / "pad_emb.mxmoe")
    assert _err(load(tmp_path / "pad_emb.mxmoe")(x), layer(x)) < TOL


def test_weights_bound_from_memory(padded, tmp_path):
    """An artifact saved without weights, bound at load to weights the caller holds: the layer's MoEWeights, or a
    mapping of parameter name to torch tensor; the same outputs, bit for bit, as the compiler's embedded weights."""
    layer, compiled = padded
    p = tmp_path / "none.mxmoe"
    compiled.save(p, weights="none")
    compiled.save(tmp_path / "emb.mxmoe")
    x = _x(23, 64, 11)
    want = load(tmp_path / "emb.mxmoe")(x)
    by_fields = load(p, weights=layer.to_weights())
    assert by_fields.weight_set == "memory" and torch.equal(by_fields(x), want)
    tensors = {param: getattr(layer, field) for field, param in compiled.model["parameters"].items()
               if getattr(layer, field) is not None}
    assert torch.equal(load(p, weights=tensors)(x), want)
    assert _err(want, layer(x)) < TOL
    with pytest.raises(WeightsError, match=r"none.mxmoe: a object has no router_weight, .*, w13, .*; pass MoEWeights or a mapping"):
        load(p, weights=object())
    with pytest.raises(WeightsError, match="weights lack tensors: w2"):
        load(p, weights={k: v for k, v in tensors.items() if k != "w2"})
    with pytest.raises(WeightsError, match="weights are not in the artifact; pass weights="):
        load(p)


def test_external_weights_with_wrong_shape(compiled, tmp_path):
    raw = {n: np.zeros((1,), compiled.parameters[n].dtype) for n in compiled.model["parameters"]}
    st = tmp_path / "bad.safetensors"
    write_safetensors(st, raw)
    p = tmp_path / "ext.mxmoe"
    compiled.save(p, weights="external")
    with pytest.raises(WeightsError, match=r"weight '.*': expected shape \[.*\], got \[1\]"):
        load(p, weights=st)
    write_safetensors(st, {"router_weight": np.zeros((8, 64), np.float32)})
    with pytest.raises(WeightsError, match="weights lack tensors: "):
        load(p, weights=st)


# ----------------------------------------------------------------------------------------- targets

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_artifact_on_the_gpu(tmp_path):
    """A cuda:sm_90 artifact (cubins compiled ahead of time) loaded with mxmoe.runtime.load on the GPU:
    CUDA tensors in, CUDA tensors out, matching the reference."""
    layer = MoE.random("tiny", seed=12)
    # GPU machines may lack the IREE compiler mxmoe.compile imports: there, pass an artifact built
    # elsewhere with `mxmoe compile --preset tiny --seed 12 --target cuda:sm_90 -o FILE`.
    p = os.environ.get("MXMOE_TEST_SM90_ARTIFACT")
    if not p:
        p = tmp_path / "sm90.mxmoe"
        mxmoe.compile(layer, target="cuda:sm_90").save(p)
    mod = load(p)
    for tokens in (1, 7, 333, 4096):
        x = _x(tokens, 64, tokens)
        y = mod(x.cuda())
        assert y.is_cuda and y.dtype == torch.bfloat16
        assert _err(y.cpu(), layer(x)) < TOL


def _rewrite_manifest(src, dst, edit):
    a = A.Artifact(src)
    man = edit(dict(a.manifest))
    sections = [A.Section(s["name"], s["kind"], bytes(a.section(s["name"]))) for s in a.manifest["sections"]]
    A.write_artifact(dst, man, sections)


def test_cpu_without_the_compiled_features_is_refused(art, tmp_path):
    p = tmp_path / "other_cpu.mxmoe"
    _rewrite_manifest(art, p, lambda m: {**m, "target": {**m["target"], "cpu_features": ["avx2", "amx_fake"]}})
    with pytest.raises(TargetUnavailableError, match="compiled for a CPU with amx_fake, which this CPU lacks"):
        load(p)


@pytest.mark.parametrize("target, words", [("rocm:gfx942", "AMD MI300 GPU"), ("cuda:sm_90", "NVIDIA Hopper GPU")])
def test_gpu_target_cannot_run_here(art, tmp_path, target, words):
    from mxmoe.compiler.targets import get_target

    tgt = get_target(target)
    backend = tgt.backend
    module = {"kind": "triton", "kernel_plan": None, "binaries": {}} if backend == "triton" else None
    p = tmp_path / "gpu.mxmoe"
    _rewrite_manifest(art, p, lambda m: {**m, "target": {"name": target, "backend": backend, "arch": tgt.arch,
                                                        "device": tgt.device},
                                         "module": module or {**m["module"], "driver": "hip"}})
    if torch.cuda.is_available() and backend == "triton":
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(TargetUnavailableError, match=f"target {target} needs an? {words}"):
        load(p)


def _raw(layer) -> dict[str, np.ndarray]:
    """The layer's logical (checkpoint-order) arrays, under the compiled parameter names."""
    out = {}
    for name in ("router_weight", "router_bias", "w13", "w13_scale", "w13_bias", "w2", "w2_scale", "w2_bias"):
        t = getattr(layer, name)
        out[name] = t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()
    return out


def test_stored_parameters_equal_the_compilers(layer, compiled):
    """The runtime's deploy-time transform of raw weights gives the compiler's stored bytes exactly."""
    stored = stored_parameters(_manifest_of(compiled), _raw(layer))
    for name, a in compiled.parameters.items():
        assert np.array_equal(stored[name].view(np.uint8), np.ascontiguousarray(a).view(np.uint8)), name


def _manifest_of(compiled) -> dict:
    return {"target": {"backend": compiled.target.backend},
            "parameters": [{"name": n, "dtype": np.asarray(a).dtype.name, "shape": list(a.shape),
                            "form": compiled.stored_forms[n].to_dict() if n in compiled.stored_forms else None}
                           for n, a in compiled.parameters.items()]}


def test_layouts_are_applied_at_deploy_time_and_inverted_for_checks(art, layer, compiled, tmp_path, monkeypatch):
    """A parameter whose manifest names a non-identity layout: external weights go through that
    layout's transform, the reference check through its inverse, and an unknown layout is named."""
    from mxmoe.core import layouts
    from mxmoe.runtime.loader import logical_parameters, parameter_arrays

    flip = lambda a: np.ascontiguousarray(a[..., ::-1])  # noqa: E731
    monkeypatch.setitem(layouts.LAYOUTS, "test-flip-k", layouts.Layout("test-flip-k", flip, flip))

    def with_layout(name):
        def edit(m):
            params = [dict(p) for p in m["parameters"]]
            for p in params:
                if p["name"] == "w13":
                    p["form"] = {**p["form"], "layout": name}
            return {**m, "parameters": params}
        return edit

    p = tmp_path / "flip.mxmoe"
    _rewrite_manifest(art, p, with_layout("test-flip-k"))
    a = A.Artifact(p)
    raw = _raw(layer)
    stored = stored_parameters(a.manifest, raw)
    np.testing.assert_array_equal(stored["w13"], raw["w13"][..., ::-1])
    np.testing.assert_array_equal(stored["w2"], compiled.parameters["w2"])
    arrays, _ = parameter_arrays(a)
    logical = logical_parameters(a, {**arrays, "w13": stored["w13"]})
    np.testing.assert_array_equal(logical["w13"], raw["w13"])

    q = tmp_path / "unknown.mxmoe"
    _rewrite_manifest(art, q, with_layout("no-such-layout"))
    b = A.Artifact(q)
    with pytest.raises(WeightsError, match="weight 'w13': unknown layout 'no-such-layout'"):
        logical_parameters(b, parameter_arrays(b)[0])


def test_executors_share_one_iree_device_per_driver():
    """Many loaded layers must not each start their own IREE device and worker pool."""
    from mxmoe.runtime.iree_executor import shared_config

    assert shared_config("local-task") is shared_config("local-task")
