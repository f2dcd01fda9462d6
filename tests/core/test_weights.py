"""MoEWeights: validation, builders, padding (layer math unchanged), dict round trip."""

import time

import ml_dtypes
import numpy as np
import pytest

from mxmoe.core import mxfp4
from mxmoe.core.config import preset
from mxmoe.core.weights import MoEWeights

TINY = preset("tiny")  # E=8, k=2, H=64, I=96


def moe_forward(w: MoEWeights, x: np.ndarray) -> np.ndarray:
    """Plain float64 MoE layer: route, GLU expert MLPs, weighted sum. Written here, independent of mxmoe."""
    cfg = w.config
    x = x.astype(np.float64)
    w13, w2 = (a.astype(np.float64) for a in w.dequantized())
    logits = x @ w.router_weight.T.astype(np.float64)
    if w.router_bias is not None:
        logits = logits + w.router_bias
    top = np.argsort(-logits, axis=1, kind="stable")[:, : cfg.top_k]
    if cfg.routing == "topk_softmax":
        chosen = np.take_along_axis(logits, top, 1)
        gates = np.exp(chosen - chosen.max(1, keepdims=True))
        gates /= gates.sum(1, keepdims=True)
    else:
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        gates = np.take_along_axis(probs, top, 1)
        if cfg.renormalize:
            gates /= gates.sum(1, keepdims=True)
    gate_rows, up_rows = w.gate_up_rows()
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(top[t]):
            h = w13[e] @ x[t] + (0 if w.w13_bias is None else w.w13_bias[e])
            g, u = h[gate_rows], h[up_rows]
            if cfg.activation == "swiglu_oai":
                g = np.minimum(g, cfg.swiglu_limit)
                u = np.clip(u, -cfg.swiglu_limit, cfg.swiglu_limit)
                act = g / (1 + np.exp(-cfg.swiglu_alpha * g)) * (u + 1)
            else:
                act = g / (1 + np.exp(-g)) * u
            out = w2[e] @ act + (0 if w.w2_bias is None else w.w2_bias[e])
            y[t] += gates[t, j] * out
    return y


def test_random_tiny_has_the_documented_shapes():
    w = MoEWeights.random(TINY, seed=1)
    assert w.router_weight.shape == (8, 64) and w.router_weight.dtype == np.float32
    assert w.w13.shape == (8, 192, 32) and w.w13_scale.shape == (8, 192, 2)
    assert w.w2.shape == (8, 64, 48) and w.w2_scale.shape == (8, 64, 3)
    for b in (w.router_bias, w.w13_bias, w.w2_bias):
        assert b.dtype == np.float32 and np.abs(b).max() > 0 and 0.05 < b.std() < 0.2
    w13, w2 = w.dequantized()
    assert w13.shape == (8, 192, 64) and w2.shape == (8, 64, 96)
    assert 0.5 / 8 < w13.std() < 2 / 8  # ~1/sqrt(H)
    np.testing.assert_array_equal(MoEWeights.random(TINY, seed=1).w13, w.w13)


def test_random_without_biases():
    w = MoEWeights.random(TINY.replace(bias=False, router_bias=False))
    assert w.router_bias is None and w.w13_bias is None and w.w2_bias is None


def test_validate_names_the_tensor_with_expected_and_actual():
    w = MoEWeights.random(TINY)
    w.w13_scale = np.zeros((8, 192, 3), np.uint8)
    with pytest.raises(ValueError, match=r"^w13_scale: expected shape \(8, 192, 2\) uint8, got \(8, 192, 3\) uint8$"):
        w.validate()


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("router_weight", np.zeros((8, 64), np.float64),
         r"router_weight: expected shape \(8, 64\) float32, got \(8, 64\) float64"),
        ("w2", np.zeros((8, 64, 48), np.int8), r"w2: expected shape \(8, 64, 48\) uint8, got \(8, 64, 48\) int8"),
        ("w2_bias", None, r"w2_bias: expected shape \(8, 64\) float32, got None"),
        ("w13", [1, 2], r"w13: expected shape \(8, 192, 32\) uint8, got list"),
    ],
)
def test_post_init_rejects_bad_tensors(field, value, match):
    fields = dict(vars(MoEWeights.random(TINY)))
    fields[field] = value
    with pytest.raises(ValueError, match=match):
        MoEWeights(**fields)


def test_bias_present_when_config_says_none():
    fields = dict(vars(MoEWeights.random(TINY)))
    fields["config"] = TINY.replace(bias=False)
    match = r"w13_bias: expected None, the config has no such tensor \(bias\); got \(8, 192\) float32"
    with pytest.raises(ValueError, match=match):
        MoEWeights(**fields)


def test_from_float_quantizes_exactly_representable_weights():
    src = MoEWeights.random(TINY, seed=2)
    w13, w2 = src.dequantized()
    w = MoEWeights.from_float(
        TINY, src.router_weight.astype(ml_dtypes.bfloat16), src.router_bias, w13, src.w13_bias, w2, src.w2_bias
    )
    got13, got2 = w.dequantized()
    np.testing.assert_array_equal(got13, w13)
    np.testing.assert_array_equal(got2, w2)
    assert w.router_weight.dtype == np.float32


def test_from_float_rejects_wrong_shapes():
    src = MoEWeights.random(TINY)
    w13, w2 = src.dequantized()
    with pytest.raises(ValueError, match=r"w2: expected float shape \(8, 64, 96\), got \(8, 96, 64\) float32"):
        MoEWeights.from_float(
            TINY, src.router_weight, src.router_bias, w13, src.w13_bias, w2.transpose(0, 2, 1), src.w2_bias
        )


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("activation", ["swiglu_oai", "silu"])
def test_pad_keeps_the_layer_math(interleaved, activation):
    cfg = TINY.replace(interleaved=interleaved, activation=activation)
    if activation == "silu":
        cfg = cfg.replace(routing="softmax_topk", renormalize=True)
    w = MoEWeights.random(cfg, seed=3)
    p = w.pad(hidden_multiple=128, intermediate_multiple=64)
    assert (p.config.hidden, p.config.intermediate) == (128, 128)
    assert p.config.replace(hidden=64, intermediate=96) == cfg

    x = np.random.default_rng(4).standard_normal((5, 64)).astype(np.float32)
    x_pad = np.zeros((5, 128), np.float32)
    x_pad[:, :64] = x
    y, y_pad = moe_forward(w, x), moe_forward(p, x_pad)
    np.testing.assert_allclose(y_pad[:, :64], y, rtol=1e-12, atol=1e-12)
    assert not y_pad[:, 64:].any()

    # The original rows survive in place (gate/up pairing kept), new scales are unit.
    gate, up = w.gate_up_rows()
    pgate, pup = p.gate_up_rows()
    np.testing.assert_array_equal(p.w13[:, pgate][:, :96, :32], w.w13[:, gate])
    np.testing.assert_array_equal(p.w13[:, pup][:, :96, :32], w.w13[:, up])
    assert (p.w13_scale[:, pgate][:, 96:] == mxfp4.E8M0_ONE).all()
    assert (p.w2_scale[:, 64:] == mxfp4.E8M0_ONE).all() and not p.w2_bias[:, 64:].any()


def test_pad_to_32_multiples_is_a_no_op_and_rejects_bad_multiples():
    w = MoEWeights.random(TINY)
    p = w.pad(hidden_multiple=16, intermediate_multiple=3)  # lcm(16, 32) = 32; lcm(3, 32) = 96
    assert p.config == TINY
    np.testing.assert_array_equal(p.w13, w.w13)
    with pytest.raises(ValueError, match="hidden_multiple: expected a positive int, got 0"):
        w.pad(hidden_multiple=0)


def test_numpy_dict_round_trip_uses_vllm_names():
    w = MoEWeights.random(TINY)
    d = w.to_numpy_dict()
    assert set(d) == {"router_weight", "router_bias", "w13_weight", "w13_weight_scale", "w13_bias",
                      "w2_weight", "w2_weight_scale", "w2_bias"}
    back = MoEWeights.from_numpy_dict(TINY, d)
    for k, v in back.to_numpy_dict().items():
        np.testing.assert_array_equal(v, d[k])

    nobias = TINY.replace(bias=False)
    d2 = MoEWeights.random(nobias).to_numpy_dict()
    assert "w13_bias" not in d2 and MoEWeights.from_numpy_dict(nobias, d2).w13_bias is None


def test_numpy_dict_missing_and_unknown_names():
    d = MoEWeights.random(TINY).to_numpy_dict()
    with pytest.raises(ValueError, match="missing tensors: w13_weight_scale, w2_bias"):
        MoEWeights.from_numpy_dict(TINY, {k: v for k, v in d.items() if k not in ("w13_weight_scale", "w2_bias")})
    with pytest.raises(ValueError, match="unknown tensors: w3_weight"):
        MoEWeights.from_numpy_dict(TINY, {**d, "w3_weight": d["w2_weight"]})


def test_gpt_oss_20b_random_weights_build_fast():
    cfg = preset("gpt-oss-20b")
    t0 = time.perf_counter()
    w = MoEWeights.random(cfg)
    elapsed = time.perf_counter() - t0
    assert elapsed < 15, f"took {elapsed:.1f} s"
    assert w.w13.shape == (32, 5760, 1440) and w.w2_scale.shape == (32, 2880, 90)
    sample = mxfp4.dequantize(w.w13[0, :64], w.w13_scale[0, :64])
    assert 0.5 / np.sqrt(2880) < sample.std() < 2 / np.sqrt(2880)
