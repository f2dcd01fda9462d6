"""torch.compile(backend="mxmoe"): regions compiled by mxmoe (IREE on CPU), the rest by inductor/eager.

Every numeric check compares the compiled model with the same model run eagerly: the mxmoe custom ops'
eager implementations are the reference semantics.
"""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("iree.compiler", reason="the compiler's IREE bindings (a GPU machine may lack them)")

import mxmoe
from mxmoe.compiler import api as compiler_api
from mxmoe.compiler.targets import get_target
from mxmoe.core.config import MoEConfig
from mxmoe.torch_frontend import MoE, ops
from mxmoe.torch_frontend import backend as B
from mxmoe.runtime import artifact as A
from mxmoe.torch_frontend.compile_cache import CompileCache, make_key

CFG = MoEConfig(num_experts=4, top_k=2, hidden=64, intermediate=64)
BF16 = dict(atol=2e-2, rtol=2e-2)  # bf16 outputs: a rounding step apart at most


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    torch._dynamo.reset()
    B.reset()
    monkeypatch.delenv(B.ENV_FALLBACK, raising=False)
    monkeypatch.delenv(B.ENV_REST, raising=False)
    yield
    torch._dynamo.reset()


def _x(n, seed=0, dtype=torch.bfloat16):
    return torch.randn(n, CFG.hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One disk cache for the tests that do not test the cache: after the first compile, a disk hit."""
    return tmp_path_factory.mktemp("mxmoe-cache")


def _opts(cache_dir, **kw):
    return {"cache_dir": str(cache_dir), **kw}


def _mxmoe_compiles() -> int:
    return B.stats.compiled + B.stats.disk_hits  # real compiles plus loads from the (shared) disk cache


class TwoLayers(nn.Module):
    """Two MoE layers of the same shape with different weights, plus plain ops around them."""

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.norm = nn.LayerNorm(CFG.hidden).to(dtype)
        self.a = MoE.random(CFG, seed=1, dtype=dtype)
        self.b = MoE.random(CFG, seed=2, dtype=dtype)

    def forward(self, x):
        h = x + self.a(self.norm(x))
        return h + self.b(h) * 0.5


def test_dynamic_token_counts_compile_once(shared_cache):
    m = MoE.random(CFG, seed=0)
    f = torch.compile(m, backend="mxmoe", options=_opts(shared_cache, rest="eager", fallback="raise"))
    graphs = {}
    with torch.no_grad():
        for i, n in enumerate((1, 5, 17, 300, 33)):
            x = _x(n, seed=i)
            torch.testing.assert_close(f(x), m(x), **BF16)
            graphs[n] = B.stats.graphs
    assert _mxmoe_compiles() == 1, B.stats         # one mxmoe (IREE) module for every token count
    # dynamo: the size-1 specialisation, then (torch 2.13) one dynamic graph; torch 2.11 also specialises the
    # first size > 1. After that, new token counts compile nothing.
    assert graphs[17] <= 3 and graphs[33] == graphs[300] == graphs[17], graphs
    assert B.stats.fallbacks == 0


def test_same_shaped_layers_share_one_compile_and_bind_their_own_weights(shared_cache):
    m = TwoLayers()
    f = torch.compile(m, backend="mxmoe", options=_opts(shared_cache, rest="eager", fallback="raise"))
    x = _x(9, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(f(x), m(x), **BF16)
    assert (B.stats.regions, _mxmoe_compiles(), B.stats.memory_hits, B.stats.binds) == (2, 1, 1, 2), B.stats


def test_weights_changed_in_place_are_rebound(shared_cache):
    m = MoE.random(CFG, seed=0, dtype=torch.float32)
    f = torch.compile(m, backend="mxmoe", options=_opts(shared_cache, rest="eager", fallback="raise"))
    x = _x(6, dtype=torch.float32)
    with torch.no_grad():
        before = f(x)
        torch.testing.assert_close(before, m(x), atol=1e-5, rtol=1e-5)
        m.w2_bias.mul_(-1.0)
        m.router_weight.copy_(torch.flip(m.router_weight, dims=[0]))
        after = f(x)
        torch.testing.assert_close(after, m(x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(before, after)
    assert B.stats.binds == 2 and _mxmoe_compiles() == 1


def test_get_attr_weights(shared_cache):
    """A graph whose weights are get_attr constants (e.g. from fx.symbolic_trace), not lifted inputs."""
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = MoE.random(CFG, seed=7, dtype=torch.float32)

        def forward(self, x):
            m = self.moe
            w, ids = ops.route(F.linear(x, m.router_weight, m.router_bias), CFG.top_k, CFG.routing, False)
            h = ops.glu(ops.mxfp4_grouped_matmul(x, ids, m.w13, m.w13_scale, m.w13_bias), CFG.activation,
                        CFG.swiglu_alpha, CFG.swiglu_limit, CFG.interleaved)
            return ops.combine(ops.mxfp4_grouped_matmul(h, ids, m.w2, m.w2_scale, m.w2_bias), w) * 2.0

    mod = Plain()
    gm = torch.fx.symbolic_trace(mod)
    assert sum(n.op == "get_attr" for n in gm.graph.nodes) == 8
    x = _x(7, dtype=torch.float32)
    run = B.mxmoe_backend(gm, [x], options=_opts(shared_cache, rest="eager", fallback="raise"))
    with torch.no_grad():
        torch.testing.assert_close(run(x), mod(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(run(_x(40, seed=9, dtype=torch.float32)),
                                   mod(_x(40, seed=9, dtype=torch.float32)), atol=1e-5, rtol=1e-5)
    assert _mxmoe_compiles() == 1 and any(n.target is torch.ops.mxmoe.region.default for n in gm.graph.nodes)


def _boom(*args, **kwargs):  # the tests using it run without a disk cache, so the compiler is reached
    raise RuntimeError("boom from the test")


def test_compile_error_falls_back_with_one_warning(shared_cache, monkeypatch):
    monkeypatch.setattr(compiler_api, "compile_program", _boom)
    m = TwoLayers()
    f = torch.compile(m, backend="mxmoe", options=_opts("off", rest="eager"))
    x = _x(5, seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            y = f(x)
    ours = [w for w in caught if issubclass(w.category, B.MxmoeFallbackWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "boom from the test" in str(ours[0].message) and "running the original ops" in str(ours[0].message)
    with torch.no_grad():
        torch.testing.assert_close(y, m(x), atol=0, rtol=0)  # the original ops ran: bit-identical
    assert B.stats.fallbacks == 2 and _mxmoe_compiles() == 0


@pytest.mark.parametrize("how", ["option", "env"])
def test_compile_error_can_raise(shared_cache, monkeypatch, how):
    monkeypatch.setattr(compiler_api, "compile_program", _boom)
    opts = _opts("off", rest="eager")
    if how == "option":
        opts["fallback"] = "raise"
    else:
        monkeypatch.setenv(B.ENV_FALLBACK, "raise")
    f = torch.compile(MoE.random(CFG), backend="mxmoe", options=opts)
    with pytest.raises(Exception, match="MoE region not compiled .*boom from the test"):
        with torch.no_grad():
            f(_x(3))


def test_a_target_this_machine_cannot_run_falls_back_with_its_name(shared_cache, monkeypatch):
    assert B.target_for(torch.device("cpu")) == "cpu"
    monkeypatch.setattr(B, "target_for", lambda device: "rocm:gfx942")
    m = MoE.random(CFG)
    f = torch.compile(m, backend="mxmoe", options=_opts(shared_cache, rest="eager"))
    x = _x(4)
    with pytest.warns(B.MxmoeFallbackWarning, match="rocm:gfx942"):
        with torch.no_grad():
            y = f(x)
    torch.testing.assert_close(y, m(x), atol=0, rtol=0)


def test_cuda_regions_go_through_the_triton_path(monkeypatch):
    """CUDA tensors -> the Triton target. Run here on the CPU with the Triton module's kernels under the
    interpreter (``interpret=True``), since this machine has no GPU; the GPU test below runs it for real."""
    pytest.importorskip("triton")
    assert get_target("cuda:sm_90").runs_torch_tensors
    monkeypatch.setattr(B, "target_for", lambda device: "cuda:sm_90")
    real_compile = compiler_api.compile_program
    monkeypatch.setattr(compiler_api, "compile_program",
                        lambda ep, target, **kw: real_compile(ep, target=target, interpret=True))
    m = MoE.random(CFG, seed=0)  # one layer: stacked bf16 layers can flip a near-tied route downstream
    f = torch.compile(m, backend="mxmoe", options=_opts("off", rest="eager", fallback="raise"))
    with torch.no_grad():
        for n, seed in ((1, 0), (6, 1), (19, 2)):
            x = _x(n, seed=seed)
            torch.testing.assert_close(f(x), m(x), **BF16)
    assert B.stats.compiled == 1 and B.stats.fallbacks == 0, B.stats


def test_inductor_failure_runs_the_rest_eagerly(shared_cache, monkeypatch):
    import torch._inductor.compile_fx as cfx

    def no_inductor(*a, **k):
        raise RuntimeError("no C++ compiler in this test")

    monkeypatch.setattr(cfx, "compile_fx", no_inductor)
    m = TwoLayers()
    f = torch.compile(m, backend="mxmoe", options=_opts(shared_cache, fallback="raise"))
    x = _x(6, seed=8)
    with pytest.warns(B.MxmoeFallbackWarning, match="inductor could not compile .*no C\\+\\+ compiler"):
        with torch.no_grad():
            y = f(x)
    with torch.no_grad():
        torch.testing.assert_close(y, m(x), **BF16)
    assert B.stats.regions == 2 and B.stats.fallbacks == 0


# ------------------------------------------------------------------------------ bad calls and bad weights
def test_weights_a_compiled_region_cannot_bind_run_its_original_ops(shared_cache, monkeypatch):
    def broken_bind(self, weights, names=None):
        raise RuntimeError("cannot load the module in this test")

    monkeypatch.setattr(B._Compiled, "bind", broken_bind)
    m = MoE.random(CFG, seed=0)
    f = torch.compile(m, backend="mxmoe", options=_opts(shared_cache, rest="eager"))
    with torch.no_grad():
        with pytest.warns(B.MxmoeFallbackWarning, match="cannot bind the weights .*cannot load the module"):
            y = f(_x(5))
        torch.testing.assert_close(y, m(_x(5)), atol=0, rtol=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", B.MxmoeFallbackWarning)  # said once, not at every call
            torch.testing.assert_close(f(_x(9, seed=2)), m(_x(9, seed=2)), atol=0, rtol=0)


def test_nan_weights_run_the_original_ops_until_they_change(shared_cache):
    """mxmoe refuses NaN weights (its routing would not propagate them); the region runs the original ops, which
    do, and goes back to the compiled module once the weights are finite again."""
    m = MoE.random(CFG, seed=0)
    f = torch.compile(m, backend="mxmoe", options=_opts(shared_cache, rest="eager"))
    x = _x(6, seed=4)
    with torch.no_grad():
        good = f(x)
        saved = m.router_weight[1, 2].clone()
        m.router_weight[1, 2] = float("nan")
        bad = r"weight 'l_self_buffers_router_weight_' holds nan at index \[1, 2\]"
        with pytest.warns(B.MxmoeFallbackWarning, match=bad):
            y = f(x)
        assert y.isnan().any()
        torch.testing.assert_close(y, m(x), atol=0, rtol=0, equal_nan=True)
        m.router_weight[1, 2] = saved
        torch.testing.assert_close(f(x), good, atol=0, rtol=0)
    assert B.stats.binds == 2 and B.stats.fallbacks == 1, B.stats


class NormMoE(nn.Module):
    """A LayerNorm and an MoE layer: the block of the empty-batch report."""

    def __init__(self, seed):
        super().__init__()
        self.norm = nn.LayerNorm(CFG.hidden).to(torch.bfloat16)
        self.moe = MoE.random(CFG, seed=seed)

    def forward(self, x):
        return x + self.moe(self.norm(x))


def test_an_empty_batch_is_an_empty_output_not_a_compile_failure(shared_cache):
    """0 tokens (an expert-parallel rank without tokens) demoted every same-shaped layer to the original ops."""
    m = nn.Sequential(NormMoE(1), NormMoE(2))
    f = torch.compile(m, backend="mxmoe", options=_opts(shared_cache, rest="eager"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", B.MxmoeFallbackWarning)
        with torch.no_grad():
            for n in (5, 17):
                torch.testing.assert_close(f(_x(n, seed=n)), m(_x(n, seed=n)), **BF16)
            with pytest.raises(RuntimeError, match="dtype"):
                f(_x(4, dtype=torch.float32))  # rightly fails (in the LayerNorm)
            y = f(torch.zeros(0, CFG.hidden, dtype=torch.bfloat16))
            assert y.shape == (0, CFG.hidden) and y.dtype == torch.bfloat16
            torch.testing.assert_close(f(_x(9, seed=9)), m(_x(9, seed=9)), **BF16)
    assert B.stats.fallbacks == 0, B.stats


def test_a_failing_call_is_that_calls_error_and_the_region_stays_compiled(shared_cache, monkeypatch):
    real_bind = B._Compiled.bind
    calls = []

    def bind(self, weights, *names):
        run = real_bind(self, weights, *names)

        def checked(*acts):
            calls.append(acts[0].shape[0])
            if acts[0].shape[0] == 13:
                raise ValueError("13 tokens are refused in this test")
            return run(*acts)
        return checked

    monkeypatch.setattr(B._Compiled, "bind", bind)
    m = MoE.random(CFG, seed=0)
    f = torch.compile(m, backend="mxmoe", options=_opts(shared_cache, rest="eager"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", B.MxmoeFallbackWarning)
        with torch.no_grad():
            with pytest.raises(ValueError, match="13 tokens are refused in this test"):
                f(_x(13))
            torch.testing.assert_close(f(_x(9, seed=2)), m(_x(9, seed=2)), **BF16)
    assert calls == [13, 9] and B.stats.fallbacks == 0, (calls, B.stats)


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="unknown option"):
        B.Options.parse({"fallbak": "raise"})
    with pytest.raises(ValueError, match="fallback must be"):
        B.Options.parse({"fallback": "ignore"})


# ------------------------------------------------------------------------------------------- cache
def _cache_entry_writer(payload: bytes):
    """A minimal compiled-module artifact with the cache's source record (what ``_Compiled.save`` writes)."""
    def write(path, source):
        manifest = {"target": {"name": "cpu", "backend": "iree", "arch": "host"},
                    "module": {"kind": A.KIND_VMFB, "section": "module.vmfb"},
                    "entries": [{"name": "main", "inputs": [], "outputs": []}], "parameters": [],
                    "weights": {"storage": "none", "sets": []}, "source": source}
        A.write_artifact(path, manifest, [A.Section("module.vmfb", A.KIND_VMFB, payload)])
    return write


def test_cache_roundtrip_and_corruption_is_detected(tmp_path):
    cache = CompileCache(tmp_path)
    key = make_key({"what": "test"})
    assert key != make_key({"what": "other"})
    assert cache.get(key) is None
    path = cache.put(key, _cache_entry_writer(b"payload bytes"))
    entry = cache.get(key)
    assert entry.section_bytes("module.vmfb") == b"payload bytes" and entry.manifest["source"]["cache_key"] == key
    good = path.read_bytes()
    at = A.Artifact(path).section_info("module.vmfb")["offset"]
    flipped = bytearray(good)
    flipped[at] ^= 1
    for bad in (good[:-1] + bytes([good[-1] ^ 1]), good[:-3], b"garbage" + good, good.replace(key.encode(), b"0" * 64),
                bytes(flipped)):
        path.write_bytes(bad)
        with pytest.warns(UserWarning, match="corrupt entry"):
            assert cache.get(key) is None
        assert not path.exists()  # deleted, never used
    assert CompileCache(None).get(key) is None and CompileCache(None).put(key, _cache_entry_writer(b"x")) is None


def test_triton_region_goes_through_the_disk_cache(tmp_path):
    """A region compiled for cuda:sm_90 (AOT cubins, no GPU needed) is cached as an artifact without weights
    (kernel plan + cubins), comes back identical, binds a layer's weights and runs (here under Triton's
    interpreter); a flipped cubin byte makes the entry corrupt, so the backend recompiles instead of using it."""
    import dataclasses

    layer = MoE.random(CFG, seed=0)
    cm = mxmoe.compile(layer, target="cuda:sm_90", example_inputs=(_x(4),))
    names = dict(enumerate(sorted(cm.parameters)))
    compiled = B._Compiled("k", cm.without_weights(), names)
    cache, key = CompileCache(tmp_path), make_key({"region": "triton"})
    path = cache.put(key, compiled.save)
    back = B._Compiled.from_artifact(key, cache.get(key))
    assert back.template.kernel_plan == cm.kernel_plan and back.template.binaries == cm.binaries
    assert back.template.vmfb is None and back.param_names == names
    assert back.template.stored_forms == cm.stored_forms and back.template.parameter_specs == cm.parameter_specs
    # no GPU here: the same plan, interpreted
    back.template = dataclasses.replace(back.template, code=dataclasses.replace(back.template.code, interpret=True))
    operand = {g: spec["operand"] for g, spec in cm.kernel_plan["parameters"].items()}
    run = back.bind({i: getattr(layer, operand[g]) for i, g in names.items()})
    x = _x(5)
    (y,) = run(x)
    torch.testing.assert_close(y, layer(x), **BF16)
    data = bytearray(path.read_bytes())
    cubin = next(s for s in A.Artifact(path).manifest["sections"] if s["kind"] == A.KIND_CUBIN)
    data[cubin["offset"] + cubin["size"] // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="corrupt entry"):
        assert cache.get(key) is None


def test_cache_location_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MXMOE_CACHE_DIR", str(tmp_path / "here"))
    assert CompileCache.from_env().root == tmp_path / "here"
    monkeypatch.setenv("MXMOE_CACHE_DIR", "off")
    assert not CompileCache.from_env().enabled


def test_corrupt_cache_entry_is_rebuilt(tmp_path):
    opts = _opts(tmp_path / "cache", rest="eager", fallback="raise")
    m = MoE.random(CFG, seed=0)
    x = _x(8)
    with torch.no_grad():
        torch.compile(m, backend="mxmoe", options=opts)(x)
    (entry,) = list((tmp_path / "cache").glob("*/*.mxmoe"))
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF  # flip bits inside the compiled module
    entry.write_bytes(bytes(data))
    torch._dynamo.reset()
    B.reset()
    with pytest.warns(UserWarning, match="corrupt entry"):
        with torch.no_grad():
            y = torch.compile(m, backend="mxmoe", options=opts)(x)
    torch.testing.assert_close(y, m(x), **BF16)
    assert B.stats.compiled == 1 and B.stats.disk_hits == 0
    assert CompileCache(tmp_path / "cache").get(entry.stem) is not None  # rewritten, valid


_SECOND_PROCESS = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    from mxmoe.core.config import MoEConfig
    from mxmoe.torch_frontend import MoE, backend as B
    device = sys.argv[2]
    m = MoE.random(MoEConfig(num_experts=4, top_k=2, hidden=64, intermediate=64), seed=0).to(device)
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(device)
    with torch.no_grad():
        y = torch.compile(m, backend="mxmoe", options={"cache_dir": sys.argv[1], "rest": "eager",
                                                       "fallback": "raise"})(x)
        ref = m(x).float()
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    print(json.dumps({"compiled": B.stats.compiled, "disk_hits": B.stats.disk_hits, "err": err,
                      "y": y.float().cpu().flatten().tolist(), "seconds": time.perf_counter() - t0}))
""")


def _cold_and_warm_process(cache_dir, device: str) -> tuple[dict, dict]:
    def process():
        safe_path = ["-P"] if sys.flags.safe_path else []  # a parent run with -P (no cwd on sys.path): the same
        out = subprocess.run([sys.executable, *safe_path, "-c", _SECOND_PROCESS, str(cache_dir), device],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = process(), process()
    assert (cold["compiled"], cold["disk_hits"]) == (1, 0)
    assert (warm["compiled"], warm["disk_hits"]) == (0, 1)
    assert cold["err"] <= 2e-2 and warm["err"] <= 2e-2, (cold["err"], warm["err"])  # relative: bf16 output
    if device == "cpu":  # deterministic there: the module loaded from disk computes exactly what was compiled
        assert warm["y"] == cold["y"]          # (CUDA sums the top-k contributions with float atomics)
    return cold, warm


def test_second_process_loads_from_disk(tmp_path):
    _cold_and_warm_process(tmp_path / "cache", "cpu")


# -------------------------------------------------------------------------------------- registration
_REGISTRATION = textwrap.dedent("""
    import sys
    import mxmoe, mxmoe.torch_frontend
    print('torch._dynamo' in sys.modules)                    # import mxmoe stays cheap
    import torch
    f = torch.compile(lambda x: x * 2 + 1, backend='mxmoe')  # found through the entry point
    assert f(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
    from torch._dynamo.backends.registry import _COMPILER_FNS
    print(_COMPILER_FNS['mxmoe'].__module__)
""")


def test_backend_name_resolves_through_the_entry_point():
    out = subprocess.run([sys.executable, "-c", _REGISTRATION], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MXMOE_CACHE_DIR": "off"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "mxmoe.torch_frontend.backend"]


def test_registers_on_import_when_dynamo_is_loaded():
    from torch._dynamo.backends.registry import _COMPILER_FNS, lookup_backend

    import mxmoe.torch_frontend as tf

    tf._register_backend_if_dynamo_loaded()  # idempotent, and never clashes with the entry point
    assert lookup_backend("mxmoe") is B.mxmoe_backend and _COMPILER_FNS["mxmoe"] is B.mxmoe_backend


# -------------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def tiny_gpt_oss():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from transformers import GptOssConfig, GptOssForCausalLM

    from mxmoe.torch_frontend import convert

    torch.manual_seed(0)
    cfg = GptOssConfig(hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       vocab_size=128, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                       max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    report = convert(model)
    assert [r.name for r in report.replaced] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    ids = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the same converted model (same dequantized MXFP4 weights), run eagerly
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=8, do_sample=False)
    return model, ids, logits, tokens


def _compiled_run(model, options, fn):
    model.compile(backend="mxmoe", options=options)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", B.MxmoeFallbackWarning)  # neither mxmoe nor inductor fell back
            with torch.no_grad():
                return fn()
    finally:
        model._compiled_call_impl = None  # back to eager for the next test


def test_tiny_gpt_oss_logits_match_eager(tiny_gpt_oss, shared_cache):
    model, ids, ref_logits, _ = tiny_gpt_oss
    # default options: the rest of the graph (attention, norms, embeddings, lm_head) goes to inductor
    logits = _compiled_run(model, _opts(shared_cache, fallback="raise"), lambda: model(ids).logits)
    torch.testing.assert_close(logits.float(), ref_logits.float(), atol=2e-2, rtol=2e-2)
    assert B.stats.regions == 2 and B.stats.fallbacks == 0 and _mxmoe_compiles() == 1, B.stats


def test_tiny_gpt_oss_generates_the_same_greedy_tokens(tiny_gpt_oss, shared_cache):
    model, ids, _, ref_tokens = tiny_gpt_oss
    # rest="eager" here only to keep the test fast: generate adds prefill/decode graphs (inductor: ~25 s more)
    tokens = _compiled_run(model, _opts(shared_cache, rest="eager", fallback="raise"),
                           lambda: model.generate(ids, max_new_tokens=8, do_sample=False))
    assert tokens.shape == (1, ids.shape[1] + 8)
    assert tokens.tolist() == ref_tokens.tolist()
    assert B.stats.fallbacks == 0 and _mxmoe_compiles() == 1 and B.stats.graphs >= 2, B.stats


# ------------------------------------------------------------------------------------ on the GPU
@pytest.mark.gpu
def test_cuda_model_runs_its_moe_regions_through_triton(tmp_path):
    pytest.importorskip("iree.compiler", reason="mxmoe.compile needs the MLIR bindings")
    m = TwoLayers().cuda()
    f = torch.compile(m, backend="mxmoe", options=_opts(tmp_path, fallback="raise"))
    with torch.no_grad():
        for n in (1, 5, 17, 300):
            x = _x(n, seed=n).cuda()
            out, ref = f(x).float(), m(x).float()
            # Two stacked bf16 layers with inductor's fused norm/residual around them: a few elements sit a
            # bf16 step or two apart (seen: 3 of 19200 at 300 tokens), so bound the error by the output scale.
            assert (out - ref).abs().max() <= 2e-2 * ref.abs().max(), (n, (out - ref).abs().max(), ref.abs().max())
    # dynamo may trace twice (a 1-token graph, then the dynamic one): two regions each, one mxmoe compile
    assert B.stats.regions == 2 * B.stats.graphs and B.stats.fallbacks == 0 and B.stats.compiled == 1, B.stats


@pytest.mark.gpu
def test_second_cuda_process_runs_the_cached_triton_region(tmp_path):
    """The disk cache's Triton entries (kernel plan + cubins) load and run in a fresh CUDA process."""
    pytest.importorskip("iree.compiler", reason="mxmoe.compile needs the MLIR bindings")
    _cold_and_warm_process(tmp_path / "cache", "cuda")
    assert any(tmp_path.joinpath("cache").rglob("*")), "nothing was cached"


@pytest.mark.gpu
def test_tiny_gpt_oss_on_cuda_matches_eager_and_generates_the_same_tokens(tiny_gpt_oss, tmp_path):
    pytest.importorskip("iree.compiler", reason="mxmoe.compile needs the MLIR bindings")
    import copy

    model, ids, _, _ = tiny_gpt_oss
    model, ids = copy.deepcopy(model).cuda(), ids.cuda()
    with torch.no_grad():  # the eager reference on the same device
        ref_logits = model(ids).logits
        ref_tokens = model.generate(ids, max_new_tokens=8, do_sample=False)
    logits = _compiled_run(model, _opts(tmp_path, fallback="raise"), lambda: model(ids).logits)
    torch.testing.assert_close(logits.float(), ref_logits.float(), atol=2e-2, rtol=2e-2)
    tokens = _compiled_run(model, _opts(tmp_path, rest="eager", fallback="raise"),
                           lambda: model.generate(ids, max_new_tokens=8, do_sample=False))
    assert tokens.tolist() == ref_tokens.tolist()
    assert B.stats.fallbacks == 0, B.stats
