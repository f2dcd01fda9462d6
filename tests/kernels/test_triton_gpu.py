"""The compiled Triton path on a CUDA GPU at gpt-oss layer shapes, against the reference MoE forward.

Skipped without CUDA. The module under test is what ``mxmoe.compile(layer, target="cuda:sm_90")``
produces (kernel plan + AOT cubins). GPU machines may lack the compiler's IREE bindings; there the
plan and cubins come from ``MXMOE_GPU_PLANS`` (a directory written on a compiler machine by
``python benchmarks/gpu_moe.py --build DIR``), and the weights are the layer's own buffers put into the
plan's layout (``kernel_plan.plan_parameters``; the executor checks every shape against the plan).
"""

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: 2048 and 6144: large tiles from 160 rows per expert for gpt-oss-20b and 120b (2048 is mid for 120b)
TOKENS = [1, 7, 64, 333, 1024, 2048, 4096, 6144, 8192, 16384]


def _compiled(name: str, layer):
    """(executor for ``layer`` of preset ``name``, the layer on the GPU)."""
    from mxmoe.runtime.triton_executor import TritonExecutor

    plans = os.environ.get("MXMOE_GPU_PLANS")
    if plans:
        from mxmoe.kernels.triton.kernel_plan import read_bundle

        from mxmoe.kernels.triton.kernel_plan import plan_parameters

        plan, binaries = read_bundle(os.path.join(plans, name))
        assert plan["layer"]["layout"] == "triton-mxfp4-hopper-tiled"
        layer = layer.cuda()
        params = plan_parameters(plan, {s["operand"]: getattr(layer, s["operand"]) for s in plan["parameters"].values()})
        return TritonExecutor(plan, params, binaries), layer
    pytest.importorskip("iree.compiler", reason="no compiler here and MXMOE_GPU_PLANS not set")
    import mxmoe

    cm = mxmoe.compile(layer, target="cuda:sm_90")
    return cm.executor(), layer.cuda()


@pytest.fixture(scope="module", params=["gpt-oss-20b", "gpt-oss-120b"])
def layer_and_module(request):
    from mxmoe.torch_frontend import MoE

    ex, layer = _compiled(request.param, MoE.random(request.param, seed=0))
    yield request.param, layer, ex
    del ex, layer
    torch.cuda.empty_cache()


@pytest.mark.parametrize("T", TOKENS)
def test_gpt_oss_layer_matches_reference(layer_and_module, T, near_tie_tokens):
    name, layer, ex = layer_and_module
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, layer.config.hidden, generator=gen).to(torch.bfloat16).cuda()
    with torch.no_grad():
        ref = layer(x).float()
        out = ex(x)
        logits = F.linear(x, layer.router_weight, layer.router_bias)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape and out.is_cuda
    out = out.float()
    assert torch.isfinite(out).all()
    scale = ref.abs().max().item()
    assert scale > 0.1, "reference output is degenerate"
    bad = ((out - ref).abs() > 0.02 * scale + 0.02 * ref.abs()).any(dim=1)
    ties = near_tie_tokens(logits, layer.config.top_k)
    unexplained = bad & ~ties
    assert not unexplained.any(), (
        f"{name} T={T}: {int(unexplained.sum())} token(s) off beyond bf16 tolerance without a routing near-tie; "
        f"max err {(out - ref).abs().max().item():.4g} vs output scale {scale:.4g}")
    assert int(bad.sum()) <= max(1, T // 100), f"too many near-tie tokens differ: {int(bad.sum())} of {T}"
    # Relative error over the whole output stays at bf16 level.
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"{name} T={T}: relative L2 error {rel:.3g}"


def test_executor_runs_the_aot_cubins(layer_and_module):
    """On a GPU of the plan's arch, the AOT cubins are what runs (not a JIT fallback)."""
    name, layer, ex = layer_and_module
    major, minor = torch.cuda.get_device_capability()
    if 10 * major + minor != ex.plan["arch"]:
        pytest.skip(f"plan is for sm_{ex.plan['arch']}, GPU is sm_{10 * major + minor}")
    assert ex.mode == "cubin"


def _captured(ex, x):
    """(CUDA graph of one call ``ex(x)``, its output), warmed up on a side stream first as capture needs."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ex(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ex(x)
    return g, out


def test_cuda_graph_replay_matches_eager(layer_and_module):
    name, layer, ex = layer_and_module
    x = torch.randn(8, layer.config.hidden, generator=torch.Generator().manual_seed(5)).bfloat16().cuda()
    eager = ex(x).clone()
    g, out = _captured(ex, x)
    x.copy_(torch.randn(8, layer.config.hidden, generator=torch.Generator().manual_seed(6)).bfloat16())
    g.replay()
    torch.cuda.synchronize()
    fresh = ex(x)
    assert torch.allclose(out.float(), fresh.float(), atol=1e-2, rtol=1e-2)
    assert not torch.equal(out, eager)


def test_reserved_graphs_replay_without_the_memset(layer_and_module):
    """Graphs captured from calls on reserved scratch (as mxmoe.engine captures them) hold no memset of its zeroed
    part when the calls leave it zero (the router resets its counters, the cast clears the sums it read). Graphs
    of several classes replayed in turns, many times, each give the eager output of a fresh executor, and the
    zeroed scratch is zero after them."""
    name, layer, ex = layer_and_module
    kept, _ = _compiled(name, layer)
    kept.reserve(512)
    assert kept._zeros_left
    graphs = {}
    for T in (1, 8, 64, 300):
        x = torch.randn(T, layer.config.hidden, generator=torch.Generator().manual_seed(T)).bfloat16().cuda()
        graphs[T] = (*_captured(kept, x), x, ex(x).clone())
    for _ in range(5):
        for T, (g, out, x, want) in graphs.items():
            g.replay()
            torch.cuda.synchronize()
            assert torch.allclose(out.float(), want.float(), atol=1e-2, rtol=1e-2), f"{name} T={T}"
            assert not kept._reserved[1].any(), f"{name} T={T}: the zeroed scratch is left non-zero"
    assert kept._zeros_left

@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_all_tokens_on_the_same_experts_at_every_class(name):
    """A zero router ties every expert, so every token takes experts 0..k-1 (ties go to the lower index: the routing
    contract): k experts each with all T rows, up to 64 row blocks of the large class's 256-row tiles at 16384
    tokens (the shape that gave wrong rows with an MXFP4 shared expert, one grouped expert of T rows, on the H100;
    docs/interface.md). Every row against the reference."""
    from mxmoe.torch_frontend import MoE

    layer = MoE.random(name, seed=3)
    with torch.no_grad():
        layer.router_weight.zero_()
        if layer.router_bias is not None:
            layer.router_bias.zero_()
    ex, layer = _compiled(name, layer)
    for T in (1, 64, 1024, 4096, 16384):
        x = torch.randn(T, layer.config.hidden, generator=torch.Generator().manual_seed(T)).bfloat16().cuda()
        with torch.no_grad():
            ref = layer(x).float()
            out = ex(x).float()
        scale = ref.abs().max()
        bad = ((out - ref).abs() > 0.02 * scale + 0.02 * ref.abs()).any(dim=1)
        assert not bad.any(), f"{name} T={T}: {int(bad.sum())} rows off, first {torch.nonzero(bad).flatten()[:5].tolist()}"
        assert ((out - ref).norm() / ref.norm()).item() < 1e-2, (name, T)
    del ex, layer
    torch.cuda.empty_cache()


def test_an_mxfp4_shared_expert_in_the_large_class(near_tie_tokens):
    """A gated MXFP4 shared expert (one more grouped expert of T rows) in the large class's 256-row tiles, from its
    first token count (2731 for this layer) up: every row against the reference. Triton 3.6 had compiled its w2 GEMM
    (K = I = 256: as many K steps as pipeline stages) into wrong rows for about half the tokens
    (tile_config.compile_stages); bundle ``shape-16-3-384-320-256`` (``gpu_moe.py --build DIR --models
    16,3,384,320,256``)."""
    from mxmoe.core.config import MoEConfig
    from mxmoe.torch_frontend import MoE

    # the layer gpu_moe.py builds for "16,3,384,320,256" (gpt-oss semantics, a gated shared expert of 256)
    cfg = MoEConfig(num_experts=16, top_k=3, hidden=384, intermediate=320, shared_intermediate=256, shared_gate=True)
    ex, layer = _compiled("shape-16-3-384-320-256", MoE.random(cfg, seed=11))
    assert [c["name"] for c in ex.plan["classes"]][-1] == "large"
    for T in (1100, 2731, 4096, 8192):
        x = torch.randn(T, layer.config.hidden, generator=torch.Generator().manual_seed(T)).bfloat16().cuda()
        with torch.no_grad():
            ref = layer(x).float()
            out = ex(x).float()
            logits = F.linear(x, layer.router_weight, layer.router_bias)
        scale = ref.abs().max()
        bad = ((out - ref).abs() > 0.02 * scale + 0.02 * ref.abs()).any(dim=1) & ~near_tie_tokens(logits, 3)
        assert not bad.any(), f"T={T}: {int(bad.sum())} rows off, first {torch.nonzero(bad).flatten()[:5].tolist()}"
