"""``Mxfp4MoEMethod`` driven as a serving engine drives a quantized fused-MoE method: create the parameters, fill
them with real MXFP4 data of the unpadded size as a checkpoint loader would, process them once, apply (modular
and monolithic), against the reference built from the same tensors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

from mxmoe.compiler.targets import get_target
from mxmoe.core.config import MoEConfig
from mxmoe.core.reference import numpy_reference, relative_error
from mxmoe.core.weights import MoEWeights
from mxmoe.engine import Mxfp4MoEMethod

BF16 = ml_dtypes.bfloat16
TOL = 2e-2


def _load(layer: nn.Module, w: MoEWeights, cfg: MoEConfig, method: Mxfp4MoEMethod) -> None:
    """What a checkpoint loader does: copy the unpadded tensors into the (padded) parameters."""
    i, ip, h = cfg.intermediate, method.intermediate_padded, cfg.hidden

    def rows(dst, src):  # w13's rows: interleaved pairs first; concatenated halves each at the start of theirs
        if cfg.interleaved:
            dst[:, : 2 * i] = src
        else:
            dst[:, :i], dst[:, ip: ip + i] = src[:, :i], src[:, i:]

    with torch.no_grad():
        rows(layer.w13_weight[:, :, : h // 2], torch.from_numpy(w.w13))
        rows(layer.w13_weight_scale[:, :, : h // 32], torch.from_numpy(w.w13_scale))
        layer.w2_weight[:, :h, : i // 2] = torch.from_numpy(w.w2)
        layer.w2_weight_scale[:, :h, : i // 32] = torch.from_numpy(w.w2_scale)
        if cfg.bias:
            rows(layer.w13_bias, torch.from_numpy(w.w13_bias))
            layer.w2_bias[:, :h] = torch.from_numpy(w.w2_bias)
        if cfg.shared_intermediate:
            s, sp = cfg.shared_intermediate, method.shared_padded
            sw13, sw2 = w.shared_w13[0], w.shared_w2[0]
            layer.shared_w13_weight[:s, : h // 2], layer.shared_w13_weight[sp: sp + s, : h // 2] = (
                torch.from_numpy(sw13[:s]), torch.from_numpy(sw13[s:]))
            layer.shared_w2_weight[:h, : s // 2] = torch.from_numpy(sw2)
            sc13, sc2 = w.shared_w13_scale[0], w.shared_w2_scale[0]
            layer.shared_w13_weight_scale[:s, : h // 32], layer.shared_w13_weight_scale[sp: sp + s, : h // 32] = (
                torch.from_numpy(sc13[:s]), torch.from_numpy(sc13[s:]))
            layer.shared_w2_weight_scale[:h, : s // 32] = torch.from_numpy(sc2)
            if cfg.shared_gate:
                layer.shared_gate_weight[:, :h] = torch.from_numpy(w.shared_gate_weight)
        if cfg.score_bias:
            layer.e_score_correction_bias.copy_(torch.from_numpy(w.score_bias))


def _bf16_floats(w: MoEWeights) -> MoEWeights:
    """The reference's view of a layer whose floats (biases, gate) the engine holds in bf16."""
    d = {f: getattr(w, f) for f in ("w13", "w13_scale", "w2", "w2_scale", "expert_map", "shared_w13",
                                     "shared_w13_scale", "shared_w2", "shared_w2_scale", "score_bias")}
    for f in ("w13_bias", "w2_bias", "shared_gate_weight"):
        a = getattr(w, f)
        d[f] = None if a is None else a.astype(BF16).astype(np.float32)
    return MoEWeights(w.config, None, None, **d)


#: the cpu target padding H and I to 64: the gpt-oss case pads I (96 -> 128), the qwen-like one H (96 -> 128)
PADDED_CPU = get_target("cpu").replace(pad_multiple=64)

CASES = {
    "gpt-oss": dict(num_experts=8, top_k=2, hidden=64, intermediate=96),
    "qwen-like-ep-shared": dict(num_experts=6, top_k=3, hidden=96, intermediate=64, activation="silu",
                                interleaved=False, bias=False, routing="softmax_topk", renormalize=True,
                                global_num_experts=16, shared_intermediate=64, shared_gate=True),
    "llama4-like": dict(num_experts=8, top_k=1, hidden=64, intermediate=64, activation="silu", interleaved=False,
                        bias=False, apply_router_weight_on_input=True, shared_intermediate=32),
    # DeepSeek-V3's routing from the engine's fp32 logits: a correction bias, 4 groups keep 2, renormalised, x2.5
    "deepseek-like": dict(num_experts=16, top_k=3, hidden=64, intermediate=64, activation="silu", interleaved=False,
                          bias=False, routing="sigmoid_topk", renormalize=True, n_group=4, topk_group=2,
                          routed_scaling_factor=2.5, score_bias=True, router_fp32=True),
}


#: where the engine cases run: the cpu target (padding H and I to 64), and the cuda target's Triton kernels under the
#: interpreter with scratch reserved for CUDA-graph capture (the GPU test captures: test_cuda_graph_capture_on_the_gpu)
ENGINE_TARGETS = {"cpu": dict(target=PADDED_CPU),
                  "cuda-interpreted": dict(target="cuda:sm_90", compile_options={"interpret": True},
                                           max_capture_size=80)}


def _method(cfg: MoEConfig, w: MoEWeights, **options) -> Mxfp4MoEMethod:
    """The engine's method for ``cfg``, as a serving engine would build it from its own config fields."""
    return Mxfp4MoEMethod(
        num_experts=cfg.num_experts, top_k=cfg.top_k, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        has_bias=cfg.bias, activation=cfg.activation, routing=cfg.routing, renormalize=cfg.renormalize,
        global_num_experts=cfg.global_num_experts,
        expert_map=None if w.expert_map is None else torch.from_numpy(w.expert_map),
        apply_router_weight_on_input=cfg.apply_router_weight_on_input,
        shared_intermediate_size=cfg.shared_intermediate, shared_gate=cfg.shared_gate, interleaved=cfg.interleaved,
        num_expert_group=cfg.n_group, topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
        e_score_correction_bias=cfg.score_bias, fp32_router_logits=cfg.router_fp32, **options)


def _loaded_layer(case: str, **options):
    """(config, weights, method, layer) for ``CASES[case]``: the method's parameters created on a layer and filled as a
    checkpoint loader would, not yet processed."""
    cfg = MoEConfig(router=False, router_bias=False, **CASES[case])
    w = MoEWeights.random(cfg, seed=7)
    method = _method(cfg, w, **options)
    layer = nn.Module()
    method.create_weights(layer, params_dtype=torch.bfloat16)
    _load(layer, w, cfg, method)
    return cfg, w, method, layer


@pytest.fixture(scope="module", params=[(case, t) for case in CASES for t in ENGINE_TARGETS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def engine_layer(request):
    case, where = request.param
    if where != "cpu":
        pytest.importorskip("iree.compiler")
    _, w, method, layer = _loaded_layer(case, **ENGINE_TARGETS[where])
    method.process_weights_after_loading(layer)
    return method, layer, _bf16_floats(w)


@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_modular_and_monolithic_match_the_reference(engine_layer, tokens):
    method, layer, w = engine_layer
    cfg = w.config
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, cfg.hidden, generator=g).bfloat16()
    logits = torch.randn(tokens, cfg.experts_routed, generator=g)
    logits = logits if cfg.router_fp32 else logits.bfloat16()
    y = method.apply_monolithic(layer, x, logits)
    ref = numpy_reference(w, x.float().numpy(), BF16, entry="monolithic", router_logits=logits.float().numpy())
    assert relative_error(y.float().numpy(), ref) <= TOL
    tw = torch.rand(tokens, cfg.top_k, generator=g)
    ids = torch.stack([torch.randperm(cfg.experts_routed, generator=g)[:cfg.top_k] for _ in range(tokens)])
    for shared_input in (x, None):
        y = method.apply(layer, x, tw, ids, shared_experts_input=shared_input)  # int64 ids, as engines often pass
        ref = numpy_reference(w, x.float().numpy(), BF16, entry="modular", topk_weights=tw.numpy(),
                              topk_ids=ids.numpy(), shared=shared_input is not None)
        assert relative_error(y.float().numpy(), ref) <= TOL, f"shared input {shared_input is not None}"


def test_shared_expert_on_other_input(engine_layer):
    method, layer, w = engine_layer
    if not w.config.shared_intermediate:
        pytest.skip("no shared expert")
    cfg = w.config
    x = torch.randn(4, cfg.hidden, generator=torch.Generator().manual_seed(3)).bfloat16()
    other = torch.randn(4, cfg.hidden, generator=torch.Generator().manual_seed(4)).bfloat16()
    tw, ids = torch.rand(4, cfg.top_k), torch.zeros(4, cfg.top_k, dtype=torch.int32) - 1  # nothing routed here
    y = method.apply(layer, x, tw, ids, shared_experts_input=other)
    from mxmoe.core.reference import shared_expert

    ref = shared_expert(w, other.float().numpy(), np.dtype(BF16))
    assert relative_error(y.float().numpy(), ref) <= TOL


def test_apply_before_processing_and_bad_shapes_are_named():
    method = Mxfp4MoEMethod(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64, target="cpu")
    layer = nn.Module()
    method.create_weights(layer)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="call process_weights_after_loading"):
        method.apply(layer, x, torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int32))
    method.process_weights_after_loading(layer)
    with pytest.raises(ValueError, match=r"hidden states must be \[T, 64\]"):
        method.apply(layer, torch.zeros(2, 32, dtype=torch.bfloat16), torch.ones(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="apply_router_weight_on_input needs top_k 1"):
        Mxfp4MoEMethod(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64,
                       apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match="needs an expert_map"):
        Mxfp4MoEMethod(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64, global_num_experts=8)
    with pytest.raises(ValueError, match="cannot"):
        Mxfp4MoEMethod(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64, target="rocm:gfx942")


def test_layers_of_one_shape_share_one_compiled_module():
    from mxmoe import engine

    method = Mxfp4MoEMethod(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64, target="cpu")
    layers = [nn.Module(), nn.Module()]
    for layer in layers:
        method.create_weights(layer)
        method.process_weights_after_loading(layer)
    before = len(engine._TEMPLATES)
    third = nn.Module()
    method.create_weights(third)
    method.process_weights_after_loading(third)
    assert len(engine._TEMPLATES) == before
    assert layers[0]._mxmoe_module is not layers[1]._mxmoe_module


def test_templates_folder_serves_a_machine_without_the_compiler(tmp_path, monkeypatch):
    """With ``MXMOE_TEMPLATES``, the module compiled for a layer shape is written there; a process without the
    compiler takes it from there and gives the same bits; a corrupt template and a missing one are one-line errors."""
    import mxmoe.engine as engine

    monkeypatch.setenv(engine.TEMPLATES_ENV, str(tmp_path))
    monkeypatch.setattr(engine, "_TEMPLATES", {})

    def run():
        cfg, _, method, layer = _loaded_layer("gpt-oss", target=PADDED_CPU)
        method.process_weights_after_loading(layer)
        g = torch.Generator().manual_seed(3)
        return method.apply_monolithic(layer, torch.randn(9, cfg.hidden, generator=g).bfloat16(),
                                       torch.randn(9, cfg.experts_routed, generator=g).bfloat16())

    first = run()
    files = list(tmp_path.glob("*.mxmoe"))
    assert len(files) == 1

    def no_compiler(*a, **k):
        raise AssertionError("compiled although the template was there")

    monkeypatch.setattr("mxmoe.torch_frontend.compile.compile", no_compiler)
    monkeypatch.setattr(engine, "_has_compiler", lambda: False)
    monkeypatch.setattr(engine, "_TEMPLATES", {})
    assert torch.equal(run(), first)
    files[0].write_bytes(b"not an artifact")
    monkeypatch.setattr(engine, "_TEMPLATES", {})
    with pytest.raises(RuntimeError, match=r"\.mxmoe: unreadable compiled template \(.*\); delete it to rebuild"):
        run()
    files[0].unlink()
    monkeypatch.setattr(engine, "_TEMPLATES", {})
    with pytest.raises(RuntimeError, match=r"no compiled template for this layer \(E=8 k=2 H=64 I=128, torch.bfloat16, "
                                           r"cpu\) in \$MXMOE_TEMPLATES=.*, and no compiler here"):
        run()


def test_deepseek_routing_in_the_monolithic_entry():
    """DeepSeek-V3's routing through the engine method: fp32 router logits, the correction bias loaded into
    ``e_score_correction_bias`` (fp32), groups, scaling."""
    cfg = MoEConfig(num_experts=8, top_k=2, hidden=64, intermediate=96, activation="silu", interleaved=False,
                    bias=False, router=False, router_bias=False, routing="sigmoid_topk", renormalize=True, n_group=4,
                    topk_group=2, routed_scaling_factor=2.5, score_bias=True, router_fp32=True)
    w = MoEWeights.random(cfg, seed=3)
    method = Mxfp4MoEMethod(num_experts=8, top_k=2, hidden_size=64, intermediate_size=96, has_bias=False,
                            activation="silu", routing="sigmoid_topk", renormalize=True, interleaved=False,
                            num_expert_group=4, topk_group=2, routed_scaling_factor=2.5, e_score_correction_bias=True,
                            fp32_router_logits=True, target=PADDED_CPU)
    layer = nn.Module()
    method.create_weights(layer, params_dtype=torch.bfloat16)
    assert layer.e_score_correction_bias.dtype == torch.float32 and layer.e_score_correction_bias.shape == (8,)
    _load(layer, w, cfg, method)
    with torch.no_grad():
        layer.e_score_correction_bias.copy_(torch.from_numpy(w.score_bias))
    method.process_weights_after_loading(layer)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=g).bfloat16()
    logits = torch.randn(9, 8, generator=g)
    y = method.apply_monolithic(layer, x, logits)
    ref = numpy_reference(_bf16_floats(w), x.float().numpy(), BF16, entry="monolithic", router_logits=logits.numpy())
    assert relative_error(y.float().numpy(), ref) <= TOL


def _compiler_or_templates() -> None:
    """Skip where the cuda modules can be neither compiled (no IREE) nor taken from ``$MXMOE_TEMPLATES``
    (tests/write_gpu_modules.py writes the GPU tests' templates)."""
    import os

    from mxmoe.engine import TEMPLATES_ENV, _has_compiler

    if not _has_compiler() and not os.environ.get(TEMPLATES_ENV):
        pytest.skip(f"no compiler here and ${TEMPLATES_ENV} not set")


#: the engine method's options in the GPU test (and so in the templates written for it)
_CUDA_GRAPHS = dict(target="cuda:sm_90", max_capture_size=256)


#: the engine's GPU test layers, for tests/write_gpu_modules.py: it runs each through the method on the build machine
#: (target cuda:sm_90, nothing bound) with $MXMOE_TEMPLATES set, which writes their templates
def gpu_template_layers():
    for case in CASES:
        _, _, method, layer = _loaded_layer(case, **_CUDA_GRAPHS)
        yield case, method, layer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_graph_capture_on_the_gpu(case):
    """``max_capture_size`` on a GPU: apply and apply_monolithic captured in CUDA graphs and replayed with new inputs
    give what eager calls give, which match the reference."""
    _compiler_or_templates()
    cfg, w, method, layer = _loaded_layer(case, **_CUDA_GRAPHS)
    layer.cuda()
    method.process_weights_after_loading(layer)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, cfg.hidden, generator=g).bfloat16().cuda()
    logits = torch.randn(256, cfg.experts_routed, generator=g).cuda()
    logits = logits if cfg.router_fp32 else logits.bfloat16()
    tw = torch.rand(256, cfg.top_k, generator=g).cuda()
    ids = torch.randint(0, cfg.experts_routed, (256, cfg.top_k), generator=g, dtype=torch.int32).cuda()
    eager_mono, eager_mod = method.apply_monolithic(layer, x, logits), method.apply(layer, x, tw, ids, x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        method.apply_monolithic(layer, x, logits)  # warm up outside the capture (JIT, allocator)
        method.apply(layer, x, tw, ids, x)
    torch.cuda.synchronize()
    graph_mono, graph_mod = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph_mono):
        out_mono = method.apply_monolithic(layer, x, logits)
    with torch.cuda.graph(graph_mod):
        out_mod = method.apply(layer, x, tw, ids, x)
    x.copy_(torch.randn(256, cfg.hidden, generator=g).bfloat16())
    logits.copy_(torch.randn(256, cfg.experts_routed, generator=g).to(logits.dtype))
    graph_mono.replay()
    graph_mod.replay()
    torch.testing.assert_close(out_mono, method.apply_monolithic(layer, x, logits), rtol=0, atol=0)
    torch.testing.assert_close(out_mod, method.apply(layer, x, tw, ids, x), rtol=0, atol=0)
    ref = numpy_reference(_bf16_floats(w), x.float().cpu().numpy(), BF16, entry="monolithic",
                          router_logits=logits.float().cpu().numpy())
    assert relative_error(out_mono.float().cpu().numpy(), ref) <= TOL
    assert not torch.equal(eager_mono, out_mono) and eager_mod.shape == out_mod.shape
