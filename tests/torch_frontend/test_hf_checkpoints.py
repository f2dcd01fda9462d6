"""Hugging Face checkpoints of the MoE families (``mxmoe.core.hf_checkpoint``, ``MoE.from_hf_checkpoint``): tiny models
saved by transformers (their own tensor names) read back as the very layer ``MoE.from_transformers`` builds from the
live block; a DeepSeek-V3 checkpoint in block-scaled FP8; streaming (one expert's floats at a time); the presets'
real shapes; errors that name the file and the key.
"""

from __future__ import annotations

import json
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

from mxmoe.core import mxfp4
from mxmoe.core.config import PRESETS
from mxmoe.core.hf_checkpoint import hf_moe_layer_indices, read_hf_moe, read_hf_moe_config
from mxmoe.core.safetensors import SafetensorsFile, write_safetensors
from mxmoe.torch_frontend import MoE
from mxmoe.torch_frontend.families import BLOCK_RETURNS

transformers = pytest.importorskip("transformers")

_FIELDS = ("router_weight", "router_bias", "w13", "w13_scale", "w13_bias", "w2", "w2_scale", "w2_bias", "score_bias",
           "shared_w13", "shared_w2", "shared_gate_weight")


def _tiny(family: str):
    from mxmoe.transformers.families import tiny_config, tiny_model

    if family == "llama4":
        from transformers import Llama4ForCausalLM, Llama4TextConfig

        torch.manual_seed(0)
        return Llama4ForCausalLM(tiny_config(Llama4TextConfig, num_local_experts=4, num_experts_per_tok=1,
                                             interleave_moe_layer_step=1, intermediate_size_mlp=64))
    return tiny_model(family, randomize=False)


def _same(a: MoE, b: MoE) -> None:
    assert a.config == b.config
    for f in _FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert torch.equal(x, y), f


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe",
                                    "gpt_oss", "llama4"])
def test_a_saved_checkpoint_reads_back_as_the_live_block(family, tmp_path):
    model = _tiny(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path)
    layers = hf_moe_layer_indices(tmp_path)
    blocks = [m for m in model.modules() if type(m).__name__ in BLOCK_RETURNS]
    assert len(layers) == len(blocks) >= 1
    ckpt = MoE.from_hf_checkpoint(str(tmp_path), layers[-1], dtype=torch.float32, progress=False)
    _same(ckpt, MoE.from_transformers(blocks[-1], dtype=torch.float32))


def test_deepseek_fp8_checkpoints_are_dequantized_per_block(tmp_path):
    """FP8 e4m3 experts with 128x128 ``weight_scale_inv`` blocks: the MXFP4 of the dequantized values."""
    model = _tiny("deepseek_v3")
    model.save_pretrained(tmp_path)
    f = SafetensorsFile(tmp_path / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    rng = np.random.default_rng(0)
    expected = {}
    for name in [k for k in tensors if ".experts." in k and k.endswith("_proj.weight")]:
        w = tensors[name].astype(np.float32)
        scale = rng.uniform(0.5, 2.0, size=(-(-w.shape[0] // 128), -(-w.shape[1] // 128))).astype(np.float32)
        q = (w / 0.2).astype(ml_dtypes.float8_e4m3fn)          # values in fp8 range, scale ~0.2 x block scale
        scale = scale * np.float32(0.2)
        tensors[name] = q
        tensors[name + "_scale_inv"] = scale
        expected[name] = q.astype(np.float32) * np.repeat(np.repeat(scale, 128, 0), 128, 1)[: w.shape[0], : w.shape[1]]
    write_safetensors(tmp_path / "model.safetensors", tensors, {"format": "pt"})
    (layer,) = hf_moe_layer_indices(tmp_path)
    w = read_hf_moe(tmp_path, layer)
    i = w.config.intermediate
    gate = expected[f"model.layers.{layer}.mlp.experts.3.gate_proj.weight"]
    q, s = mxfp4.quantize(gate)
    assert np.array_equal(w.w13[3, :i], q) and np.array_equal(w.w13_scale[3, :i], s)
    down = expected[f"model.layers.{layer}.mlp.experts.5.down_proj.weight"]
    assert np.array_equal(w.w2[5], mxfp4.quantize(down)[0])


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_streaming_reads_one_expert_at_a_time(tmp_path):
    """A layer of 64 experts of H = I = 512 in bf16 (96 MiB of floats, 192 MiB as fp32): reading it grows the
    process's anonymous memory by about its MXFP4 output (26 MiB), not by the floats."""
    e, h, i = 64, 512, 512
    rng = np.random.default_rng(0)
    tensors = {"model.layers.0.mlp.gate.weight": rng.standard_normal((e, h), np.float32).astype(ml_dtypes.bfloat16)}
    for x in range(e):
        for n, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            tensors[f"model.layers.0.mlp.experts.{x}.{n}.weight"] = (
                rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    write_safetensors(tmp_path / "model.safetensors", tensors, {"format": "pt"})
    del tensors
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": h, "moe_intermediate_size": i, "num_experts": e,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu"}))
    before = _rss_anon()
    seen = []
    w = read_hf_moe(tmp_path, 0, progress=seen.append)
    grown = _rss_anon() - before
    out = sum(getattr(w, f).nbytes for f in ("w13", "w13_scale", "w2", "w2_scale", "router_weight"))
    assert len(seen) == e
    assert grown < out + 24 * 2 ** 20, f"anonymous memory grew {grown / 2**20:.0f} MiB for {out / 2**20:.0f} MiB out"


def test_presets_have_the_real_shapes():
    p = PRESETS
    assert (p["mixtral-8x7b"].num_experts, p["mixtral-8x7b"].top_k, p["mixtral-8x7b"].hidden,
            p["mixtral-8x7b"].intermediate) == (8, 2, 4096, 14336)
    q3 = p["qwen3-30b-a3b"]
    assert (q3.num_experts, q3.top_k, q3.hidden, q3.intermediate, q3.renormalize) == (128, 8, 2048, 768, True)
    q15 = p["qwen1.5-moe-a2.7b"]
    assert (q15.num_experts, q15.top_k, q15.hidden, q15.intermediate, q15.shared_intermediate, q15.shared_gate) == (
        60, 4, 2048, 1408, 5632, True)
    ol = p["olmoe-1b-7b"]
    assert (ol.num_experts, ol.top_k, ol.hidden, ol.intermediate) == (64, 8, 2048, 1024)
    ds = p["deepseek-v3"]
    assert (ds.num_experts, ds.top_k, ds.hidden, ds.intermediate, ds.n_group, ds.topk_group,
            ds.routed_scaling_factor, ds.shared_intermediate, ds.routing, ds.router_fp32) == (
        256, 8, 7168, 2048, 8, 4, 2.5, 2048, "sigmoid_topk", True)
    l4 = p["llama-4-scout"]
    assert (l4.num_experts, l4.top_k, l4.hidden, l4.intermediate, l4.routing, l4.apply_router_weight_on_input,
            l4.shared_intermediate) == (16, 1, 5120, 8192, "topk_sigmoid", True, 8192)


def test_preset_shapes_match_the_families_config_classes():
    """Each preset is what read_hf_moe_config makes of its family's config.json (the released sizes)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    released = {
        "mixtral-8x7b": ("mixtral", {}),
        "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                            num_experts_per_tok=8, norm_topk_prob=True)),
        "qwen1.5-moe-a2.7b": ("qwen2_moe", {}),
        "olmoe-1b-7b": ("olmoe", dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8)),
        "deepseek-v3": ("deepseek_v3", {}),
        "llama-4-scout": ("llama4_text", {}),
    }
    import tempfile

    for name, (mtype, kw) in released.items():
        cfg = CONFIG_MAPPING[mtype](**kw).to_dict()
        with tempfile.TemporaryDirectory() as d:
            (__import__("pathlib").Path(d) / "config.json").write_text(json.dumps(cfg))
            got = read_hf_moe_config(d)
        assert got == PRESETS[name], (name, got)


def test_config_errors_name_the_file_and_the_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 64}))
    with pytest.raises(ValueError, match=r"config.json: missing key moe_intermediate_size"):
        read_hf_moe_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "jetmoe", "hidden_size": 64}))
    with pytest.raises(ValueError, match=r"model_type 'jetmoe' is not a family mxmoe reads checkpoints of"):
        read_hf_moe_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "hidden_size": 64,
                                                      "num_local_experts": 4, "num_experts_per_tok": 2,
                                                      "intermediate_size": 64, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        read_hf_moe_config(tmp_path)
