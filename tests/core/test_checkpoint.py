"""safetensors IO without torch, gpt-oss and vLLM layouts, and agreement with transformers/safetensors."""

import json

import ml_dtypes
import numpy as np
import pytest

from mxmoe.core import checkpoint as ckpt
from mxmoe.core.config import preset
from mxmoe.core.weights import MoEWeights

TINY = preset("tiny")


def assert_same_weights(a: MoEWeights, b: MoEWeights):
    assert a.config == b.config
    da, db = a.to_numpy_dict(), b.to_numpy_dict()
    assert set(da) == set(db)
    for k in da:
        assert da[k].dtype == db[k].dtype, k
        np.testing.assert_array_equal(da[k], db[k], err_msg=k)


def all_dtypes():
    rng = np.random.default_rng(0)
    return {
        "bf16": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal((7,)).astype(np.float16),
        "f32": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "f64": rng.standard_normal((1,)),
        "u8": rng.integers(0, 256, (9,), dtype=np.uint8),
        "i8": rng.integers(-128, 128, (3, 3), dtype=np.int8),
        "i32": rng.integers(-(2**31), 2**31, (5,), dtype=np.int32),
        "i64": rng.integers(-(2**62), 2**62, (2, 2), dtype=np.int64),
        "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }


def test_safetensors_round_trip_every_dtype(tmp_path):
    tensors = all_dtypes()
    ckpt.write_safetensors(tmp_path / "t.safetensors", tensors, {"format": "pt"})
    f = ckpt.SafetensorsFile(tmp_path / "t.safetensors")
    assert f.metadata == {"format": "pt"} and sorted(f.keys()) == sorted(tensors)
    for name, ref in tensors.items():
        got = f.get(name)
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), ref.reshape(-1).view(np.uint8), err_msg=name)
    assert not f.get("f32").flags.writeable


def test_our_files_load_in_safetensors_and_back(tmp_path):
    st_numpy = pytest.importorskip("safetensors.numpy")
    tensors = {k: v for k, v in all_dtypes().items() if k != "bf16"}
    ckpt.write_safetensors(tmp_path / "a.safetensors", tensors)
    for k, v in st_numpy.load_file(tmp_path / "a.safetensors").items():
        np.testing.assert_array_equal(v, tensors[k])
    st_numpy.save_file(tensors, tmp_path / "b.safetensors")
    for k, v in ckpt.read_safetensors(tmp_path / "b.safetensors").items():
        np.testing.assert_array_equal(v, tensors[k])


def test_bf16_interoperates_with_safetensors_torch(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    x = np.random.default_rng(1).standard_normal((4, 6)).astype(ml_dtypes.bfloat16)
    ckpt.write_safetensors(tmp_path / "ours.safetensors", {"x": x, "u": np.arange(5, dtype=np.uint8)})
    loaded = st_torch.load_file(tmp_path / "ours.safetensors")
    assert loaded["x"].dtype == torch.bfloat16
    np.testing.assert_array_equal(loaded["x"].float().numpy(), x.astype(np.float32))

    t = torch.randn(3, 7, dtype=torch.bfloat16)
    st_torch.save_file({"t": t}, tmp_path / "theirs.safetensors")
    got = ckpt.read_safetensors(tmp_path / "theirs.safetensors")["t"]
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), t.float().numpy())


@pytest.mark.parametrize(
    "cut, match",
    [
        (lambda raw: raw[:5], r"truncated: 5 bytes, too short for the 8-byte header length"),
        (lambda raw: raw[:20], r"truncated: header claims \d+ bytes but only 12 follow"),
        (lambda raw: raw[:-3], r"truncated: tensor 'x' ends at data byte 64 but the file holds 61 data bytes"),
        (lambda raw: (2**40).to_bytes(8, "little") + raw[8:], r"not a safetensors file \(its first 8 bytes"),
        (lambda raw: raw[:8] + b"X" + raw[9:], r"corrupt header: not UTF-8 JSON"),
    ],
)
def test_truncated_or_corrupt_files(tmp_path, cut, match):
    path = tmp_path / "t.safetensors"
    ckpt.write_safetensors(path, {"x": np.zeros(16, np.float32)})
    path.write_bytes(cut(path.read_bytes()))
    with pytest.raises(ValueError, match=match) as info:
        ckpt.SafetensorsFile(path)
    assert str(path) in str(info.value)


def test_header_size_mismatch_is_corrupt(tmp_path):
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(ValueError, match=r"tensor 'x' F32\[4\] needs 16 bytes, data_offsets span 12"):
        ckpt.SafetensorsFile(path)


def test_hf_gpt_oss_round_trip(tmp_path):
    layers = {0: MoEWeights.random(TINY, seed=1), 2: MoEWeights.random(TINY, seed=2)}
    extra = {"model.embed_tokens.weight": np.ones((10, 64), ml_dtypes.bfloat16)}
    ckpt.write_hf_gpt_oss(tmp_path, layers, extra)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_local_experts"] == 8 and cfg["num_hidden_layers"] == 3
    assert ckpt.read_hf_config(tmp_path) == TINY
    assert ckpt.hf_moe_layers(tmp_path) == [0, 2]
    for i, w in layers.items():
        assert_same_weights(ckpt.read_hf_gpt_oss(tmp_path, i), w)
    blocks = ckpt.read_safetensors(tmp_path / "model.safetensors")["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert blocks.shape == (8, 192, 2, 16) and blocks.dtype == np.uint8


def test_hf_bf16_floats_are_read_as_float32(tmp_path):
    w = MoEWeights.random(TINY)
    ckpt.write_hf_gpt_oss(tmp_path, {0: w}, float_dtype="bfloat16")
    raw = ckpt.read_safetensors(tmp_path / "model.safetensors")
    assert raw["model.layers.0.mlp.router.bias"].dtype == ml_dtypes.bfloat16
    got = ckpt.read_hf_gpt_oss(tmp_path, 0)
    assert got.w2_bias.dtype == np.float32
    np.testing.assert_array_equal(got.w2_bias, w.w2_bias.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(got.w13, w.w13)


def test_blocks_match_transformers_dequantization(tmp_path):
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = MoEWeights.random(TINY, seed=5)
    ckpt.write_hf_gpt_oss(tmp_path, {0: w})
    raw = ckpt.read_safetensors(tmp_path / "model.safetensors")
    w13, w2 = w.dequantized()
    for part, ours in (("gate_up_proj", w13), ("down_proj", w2)):
        blocks = torch.from_numpy(raw[f"model.layers.0.mlp.experts.{part}_blocks"].copy())
        scales = torch.from_numpy(raw[f"model.layers.0.mlp.experts.{part}_scales"].copy())
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]: transposed
        np.testing.assert_array_equal(theirs.numpy(), ours.transpose(0, 2, 1), err_msg=part)


def test_hf_checkpoint_written_by_torch(tmp_path):
    """A checkpoint produced the way real ones are (torch, bf16 floats) reads back correctly."""
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    w = MoEWeights.random(TINY, seed=6)
    ckpt.write_hf_gpt_oss(tmp_path, {0: w}, float_dtype="bfloat16")
    def to_torch(v):
        if v.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(v.astype(np.float32)).bfloat16()
        return torch.from_numpy(v.copy())

    tensors = {k: to_torch(v) for k, v in ckpt.read_safetensors(tmp_path / "model.safetensors").items()}
    (tmp_path / "model.safetensors").unlink()
    st_torch.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    got = ckpt.read_hf_gpt_oss(tmp_path, 0)
    np.testing.assert_array_equal(got.w13, w.w13)
    np.testing.assert_array_equal(got.router_weight, w.router_weight.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_sharded_checkpoint_with_index(tmp_path):
    w = MoEWeights.random(TINY, seed=7)
    ckpt.write_hf_gpt_oss(tmp_path / "single", {1: w})
    tensors = ckpt.read_safetensors(tmp_path / "single" / "model.safetensors")
    names = sorted(tensors)
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "config.json").write_text((tmp_path / "single" / "config.json").read_text())
    weight_map = {}
    for j, part in enumerate((names[:3], names[3:])):
        fname = f"model-0000{j + 1}-of-00002.safetensors"
        ckpt.write_safetensors(shard_dir / fname, {n: tensors[n] for n in part})
        weight_map.update(dict.fromkeys(part, fname))
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert ckpt.hf_moe_layers(shard_dir) == [1]
    assert_same_weights(ckpt.read_hf_gpt_oss(shard_dir, 1), w)

    (shard_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model-00002-of-00002.safetensors: shard listed in .* does not exist"):
        ckpt.read_hf_gpt_oss(shard_dir, 1)


def test_missing_tensors_are_listed_with_the_file(tmp_path):
    w = MoEWeights.random(TINY)
    ckpt.write_hf_gpt_oss(tmp_path, {0: w})
    path = tmp_path / "model.safetensors"
    dropped = ("down_proj_scales", "router.bias")
    tensors = {k: v for k, v in ckpt.read_safetensors(path).items() if not k.endswith(dropped)}
    ckpt.write_safetensors(path, tensors)
    with pytest.raises(ValueError) as info:
        ckpt.read_hf_gpt_oss(tmp_path, 0)
    msg = str(info.value)
    assert msg.startswith(f"missing tensors in {tmp_path}")
    assert "model.layers.0.mlp.router.bias" in msg and "model.layers.0.mlp.experts.down_proj_scales" in msg
    # a layer the checkpoint does not have at all is named as such, not as its eight missing tensors
    with pytest.raises(ValueError, match=r"^\S+: no MoE layer 3 \(MoE layers: 0\)$"):
        ckpt.read_hf_gpt_oss(tmp_path, 3)


def test_wrong_shape_names_the_checkpoint_tensor(tmp_path):
    w = MoEWeights.random(TINY)
    ckpt.write_hf_gpt_oss(tmp_path, {0: w})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.gate_up_proj_blocks: expected shape "
                                         r"\(8, 128, 2, 16\) uint8, got \(8, 192, 2, 16\) uint8"):
        ckpt.read_hf_gpt_oss(tmp_path, 0)


def test_hf_config_errors_and_aliases(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "hidden_size": 64}))
    match = r"config.json: missing keys num_local_experts, num_experts_per_tok, intermediate_size"
    with pytest.raises(ValueError, match=match):
        ckpt.read_hf_config(tmp_path)
    hf = {"num_local_experts": 8, "experts_per_token": 2, "hidden_size": 64, "intermediate_size": 96, "swiglu_limit": 5}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert ckpt.read_hf_config(tmp_path) == TINY.replace(swiglu_limit=5.0)
    with pytest.raises(ValueError, match=r"config.json: not found"):
        ckpt.read_hf_config(tmp_path / "nowhere")


def test_hf_writer_rejects_configs_gpt_oss_cannot_express(tmp_path):
    w = MoEWeights.random(TINY.replace(interleaved=False))
    with pytest.raises(ValueError, match=r"not expressible in the gpt-oss layout, differs in \{'interleaved': False\}"):
        ckpt.write_hf_gpt_oss(tmp_path, {0: w})


@pytest.mark.parametrize("float_dtype", ["float32", "bfloat16"])
def test_vllm_round_trip(tmp_path, float_dtype):
    w = MoEWeights.random(TINY.replace(interleaved=False), seed=8)
    prefix, router = "model.layers.0.mlp.experts.", "model.layers.0.mlp.gate."
    path = tmp_path / "layer.safetensors"
    ckpt.write_vllm(path, w, prefix, router, {"other": np.zeros(3, np.float32)}, float_dtype=float_dtype)
    names = set(ckpt.SafetensorsFile(path).keys())
    assert {prefix + "w13_weight", prefix + "w2_weight_scale", router + "weight", router + "bias", "other"} <= names
    got = ckpt.read_vllm(tmp_path, prefix, router, w.config)  # a directory works too
    if float_dtype == "float32":
        assert_same_weights(got, w)
    else:
        np.testing.assert_array_equal(got.w13_bias, w.w13_bias.astype(ml_dtypes.bfloat16).astype(np.float32))
        np.testing.assert_array_equal(got.w2, w.w2)


def test_vllm_without_biases_and_errors(tmp_path):
    cfg = TINY.replace(bias=False, router_bias=False)
    w = MoEWeights.random(cfg)
    path = tmp_path / "l.safetensors"
    ckpt.write_vllm(path, w, "e.", "r.")
    assert_same_weights(ckpt.read_vllm(path, "e.", "r.", cfg), w)
    with pytest.raises(ValueError, match=rf"missing tensors in {path}: r.bias, e.w13_bias, e.w2_bias"):
        ckpt.read_vllm(path, "e.", "r.", TINY)
    match = r"e.w13_weight: expected shape \(8, 128, 32\) uint8, got \(8, 192, 32\) uint8"
    with pytest.raises(ValueError, match=match):
        ckpt.read_vllm(path, "e.", "r.", cfg.replace(intermediate=64))
