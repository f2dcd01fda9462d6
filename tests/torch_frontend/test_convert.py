"""mxmoe.torch_frontend.convert: recognised MoE blocks are replaced in place by drop-in mxmoe layers."""

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from transformers import GptOssConfig  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP  # noqa: E402

from mxmoe.core.config import MoEConfig  # noqa: E402
from mxmoe.torch_frontend import GptOssMoE, MoE, convert  # noqa: E402
from mxmoe.core.weights import MoEWeights  # noqa: E402

H, I, E, K = 64, 64, 4, 2


def _mlp(seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    mlp = GptOssMLP(GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K))
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.3)
    return mlp.to(dtype).eval()


def _x(dtype=torch.float32, shape=(2, 5, H), seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_replaces_gpt_oss_mlp_in_place_and_leaves_the_rest():
    other = nn.Linear(4, 4)
    model = nn.ModuleDict({"block": nn.ModuleDict({"mlp": _mlp()}), "other": other})
    report = convert(model)
    assert isinstance(model["block"]["mlp"], GptOssMoE)
    assert model["other"] is other
    assert len(report) == 1 and not report.kept and not report.skipped
    r = report.replaced[0]
    assert (r.name, r.source, r.target, r.action) == ("block.mlp", "GptOssMLP", "GptOssMoE", "quantized")
    assert (r.num_experts, r.top_k, r.hidden, r.intermediate, r.dtype) == (E, K, H, I, "float32")
    assert "block.mlp: GptOssMLP -> GptOssMoE [quantized]" in str(report)


def test_drop_in_matches_transformers_on_the_dequantized_weights():
    model = nn.ModuleDict({"mlp": _mlp()})
    convert(model)
    new = model["mlp"]
    ref = new.to_transformers().eval()  # transformers' own GptOssMLP holding the dequantized MXFP4 weights
    x = _x()
    with torch.no_grad():
        out, scores = new(x)
        ref_out, ref_scores = ref(x)
    assert out.shape == x.shape and scores.shape == (x.shape[0] * x.shape[1], K)
    assert scores.dtype == ref_scores.dtype == x.dtype
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(scores, ref_scores, atol=1e-6, rtol=1e-6)


def test_quantized_output_stays_close_to_the_float_block():
    mlp = _mlp(seed=3)
    x = _x(seed=4)
    with torch.no_grad():
        ref, _ = mlp(x)
    model = nn.ModuleDict({"mlp": mlp})
    convert(model)
    with torch.no_grad():
        out, _ = model["mlp"](x)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 0.3, f"MXFP4 quantization error {rel:.3f} is far above 4-bit level (transposed weights?)"


def test_bf16_block_keeps_its_dtype():
    model = nn.ModuleDict({"mlp": _mlp(dtype=torch.bfloat16)})
    report = convert(model)
    assert report.replaced[0].dtype == "bfloat16"
    with torch.no_grad():
        out, scores = model["mlp"](_x(torch.bfloat16))
    assert out.dtype == scores.dtype == torch.bfloat16


def test_mxmoe_layers_are_kept_and_convert_is_idempotent():
    own = MoE.random(MoEConfig(num_experts=E, top_k=K, hidden=H, intermediate=I), dtype=torch.float32)
    model = nn.ModuleDict({"own": own, "mlp": _mlp()})
    first = convert(model)
    assert [r.name for r in first.replaced] == ["mlp"] and [r.name for r in first.kept] == ["own"]
    converted = model["mlp"]
    second = convert(model)
    assert len(second) == 0 and sorted(r.name for r in second.kept) == ["mlp", "own"]
    assert model["own"] is own and model["mlp"] is converted


def test_already_mxfp4_blocks_are_taken_bit_exact():
    mlp = _mlp(seed=5)
    ex = mlp.experts
    # The HF checkpoint layout: blocks [E, N, K/32, 16] and e8m0 scales [E, N, K/32] instead of float weights.
    w = MoEWeights.from_float(
        MoEConfig(num_experts=E, top_k=K, hidden=H, intermediate=I),
        mlp.router.weight.detach().numpy(), mlp.router.bias.detach().numpy(),
        ex.gate_up_proj.detach().numpy().transpose(0, 2, 1), ex.gate_up_proj_bias.detach().numpy(),
        ex.down_proj.detach().numpy().transpose(0, 2, 1), ex.down_proj_bias.detach().numpy())
    del ex.gate_up_proj, ex.down_proj
    ex.register_buffer("gate_up_proj_blocks", torch.from_numpy(w.w13).reshape(E, 2 * I, H // 32, 16))
    ex.register_buffer("gate_up_proj_scales", torch.from_numpy(w.w13_scale))
    ex.register_buffer("down_proj_blocks", torch.from_numpy(w.w2).reshape(E, H, I // 32, 16))
    ex.register_buffer("down_proj_scales", torch.from_numpy(w.w2_scale))
    model = nn.ModuleDict({"mlp": mlp})
    report = convert(model)
    assert report.replaced[0].action == "mxfp4"
    new = model["mlp"]
    assert torch.equal(new.w13, torch.from_numpy(w.w13)) and torch.equal(new.w2_scale, torch.from_numpy(w.w2_scale))


def test_unconvertible_blocks_are_skipped_with_a_reason():
    meta_mlp = _mlp()
    meta_mlp.to("meta")
    fake_triton = type("Mxfp4GptOssMLP", (nn.Module,), {})()
    model = nn.ModuleDict({"a": meta_mlp, "b": fake_triton})
    report = convert(model)
    assert not report.replaced
    reasons = {r.name: r.reason for r in report.skipped}
    assert "meta device" in reasons["a"] and "swizzled" in reasons["b"]
    assert model["a"] is meta_mlp and model["b"] is fake_triton


def test_root_block_and_non_modules_are_rejected():
    with pytest.raises(ValueError, match="root module is itself a GptOssMLP"):
        convert(_mlp())
    with pytest.raises(TypeError, match="expected an nn.Module"):
        convert("not a module")


def test_input_checks():
    model = nn.ModuleDict({"mlp": _mlp()})
    convert(model)
    with pytest.raises(ValueError, match=r"GptOssMoE: input must be \[T, 64\]"):
        model["mlp"](torch.zeros(1, 2, 32))
    with pytest.raises(ValueError, match="does not match the layer's dtype"):
        model["mlp"](torch.zeros(1, 2, H, dtype=torch.bfloat16))


@pytest.mark.parametrize("target", ["cpu", "cuda:sm_90"])
def test_a_converted_block_compiles_with_the_interface_entries(target):
    """mxmoe.compile of the drop-in block: its forward keeps GptOssMLP's (out, scores) signature, its compiled
    layer entry is the interface's x -> out (the cuda target under Triton's interpreter)."""
    import mxmoe

    if target.startswith("cuda"):
        pytest.importorskip("triton")
    model = nn.ModuleDict({"mlp": _mlp(seed=3, dtype=torch.bfloat16)})
    convert(model)
    block = model["mlp"]
    cm = mxmoe.compile(block, target=target, **({"interpret": True} if target.startswith("cuda") else {}))
    assert [s.name for s in cm.outputs] == ["out0"] and len(cm.outputs) == 1
    x = _x(torch.bfloat16, shape=(7, H), seed=4)
    out, ref = cm(x).float(), block(x)[0].float()
    assert float((out - ref).abs().max() / ref.abs().max()) < 2e-2
