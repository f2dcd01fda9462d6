"""The fused-MoE interface on a CUDA GPU (issue #23, the families' routers of #24): every entry of modules compiled
ahead of time for this GPU's arch (cubins, not the interpreter), at token counts of every shape class, against the
reference ``MoE`` on the same GPU. The same features run under the interpreter in tests/torch_frontend/test_entries.py
and tests/compiler/test_cuda_target.py; here the compiled kernels meet them, with larger batches.

Run on the GPU machine: ``python -m pytest -q -m gpu tests/compiler/test_cuda_interface_gpu.py`` (with
``MXMOE_GPU_PLANS`` where it lacks the compiler: ``tests/write_gpu_modules.py``).
"""

import functools

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: 1 and 7: gemv / decode (the router launch groups too), 100: the split router, 1100 and 4096: router_route
TOKENS = [1, 7, 100, 1100, 4096]
BASE = dict(num_experts=16, top_k=3, hidden=384, intermediate=320, activation="silu", interleaved=False)
FEATURES = {
    "expert-map": dict(global_num_experts=40),
    "weight-on-input-topk_sigmoid-gelu": dict(top_k=1, routing="topk_sigmoid", apply_router_weight_on_input=True,
                                              activation="gelu"),
    "shared-mxfp4-gate": dict(shared_intermediate=256, shared_gate=True, routing="softmax_topk", renormalize=True),
    "shared-bf16-gate": dict(shared_intermediate=256, shared_gate=True, shared_format="bf16"),
    "shared-bf16": dict(shared_intermediate=192, shared_format="bf16", activation="swiglu_oai", interleaved=True),
    "deepseek-router": dict(num_experts=32, top_k=6, routing="sigmoid_topk", n_group=4, topk_group=2,
                            score_bias=True, renormalize=True, routed_scaling_factor=2.5, router_fp32=True,
                            router_bias=False, activation="silu", shared_intermediate=256, shared_format="bf16"),
    "gelu_tanh-scaled": dict(activation="gelu_tanh", routed_scaling_factor=0.5),
    "silu_clamped": dict(activation="silu_clamped", swiglu_limit=2.0, top_k=5, num_experts=24),
}


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return "cuda:sm_100" if major >= 10 else "cuda:sm_90"


def _layer(feature: str):
    from mxmoe.core.config import MoEConfig
    from mxmoe.torch_frontend import MoE

    return MoE.random(MoEConfig(**{**BASE, **FEATURES[feature]}), seed=11)


#: the modules tests/write_gpu_modules.py builds for a GPU machine without the compiler: key -> (layer, target,
#: compile options)
GPU_MODULES = {f"interface-{f}-sm_90": (functools.partial(_layer, f), "cuda:sm_90", {"entries": "all"})
               for f in FEATURES}


@pytest.fixture(scope="module", params=list(FEATURES))
def compiled(request, gpu_module):
    layer = _layer(request.param)
    cm = gpu_module(f"interface-{request.param}-{_arch().split(':')[1]}", layer, _arch(), entries="all")
    yield layer.cuda(), cm
    torch.cuda.empty_cache()


def _check(out, ref, skip=None):
    out, ref = out.float(), ref.float()
    assert torch.isfinite(out).all()
    scale = ref.abs().max().item()
    bad = ((out - ref).abs() > 0.02 * scale + 0.02 * ref.abs()).any(dim=-1)
    if skip is not None:
        assert int(skip.sum()) <= max(1, out.shape[0] // 20), f"{int(skip.sum())} near-tie tokens"
        bad &= ~skip.to(bad.device)
    assert not bad.any(), f"{int(bad.sum())} of {out.shape[0]} tokens off"


@pytest.mark.parametrize("T", TOKENS)
def test_every_entry_on_the_gpu(compiled, T, near_tie_tokens):
    layer, cm = compiled
    cfg = layer.config
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, cfg.hidden, generator=gen).bfloat16().cuda()
    with torch.no_grad():
        xr = x.float() if cfg.router_fp32 else x
        logits = F.linear(xr, layer.router_weight.to(xr.dtype),
                          None if layer.router_bias is None else layer.router_bias.to(xr.dtype))
        _check(cm(x), layer(x), near_tie_tokens(logits.float().cpu(), cfg.top_k))
        given = torch.randn(T, cfg.experts_routed, generator=gen).cuda()
        given = given if cfg.router_fp32 else given.bfloat16()
        _check(cm.entry("monolithic")(x, given), layer.monolithic(x, given))
        w = (torch.rand(T, cfg.top_k, generator=gen) + 0.1).cuda()
        ids = torch.randint(-1, cfg.experts_routed + 1, (T, cfg.top_k), generator=gen, dtype=torch.int32).cuda()
        _check(cm.entry("modular")(x, w, ids), layer.modular(x, w, ids))
        # int64 ids (engines pass either) and all tokens on one expert
        same = torch.zeros_like(ids, dtype=torch.int64) + torch.arange(cfg.top_k, device="cuda")
        _check(cm.entry("modular")(x, w, same.int()), layer.modular(x, w, same))


def test_routing_is_batch_invariant_on_the_gpu(compiled):
    """A token's output through the monolithic entry (the engine's logits routed by the kernels) is the same alone
    and in a batch of 4096, for every router (the routing contract: docs/routing.md); with batch_invariant plans
    bitwise, here to bf16 rounding of the combine."""
    layer, cm = compiled
    cfg = layer.config
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4096, cfg.hidden, generator=gen).bfloat16().cuda()
    logits = torch.randn(4096, cfg.experts_routed, generator=gen).cuda()
    logits = logits if cfg.router_fp32 else logits.bfloat16()
    full = cm.entry("monolithic")(x, logits)
    for t in (0, 17, 4095):
        _check(cm.entry("monolithic")(x[t:t + 1], logits[t:t + 1]), full[t:t + 1])
