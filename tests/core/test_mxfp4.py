"""MXFP4 format: packing, e8m0 scales, quantize/dequantize, agreement with ml_dtypes."""

import ml_dtypes
import numpy as np
import pytest

from mxmoe.core import mxfp4

E2M1 = ml_dtypes.float4_e2m1fn
E8M0 = ml_dtypes.float8_e8m0fnu


def test_fp4_values_match_ml_dtypes_bit_for_bit():
    ref = np.arange(16, dtype=np.uint8).view(E2M1).astype(np.float32)
    np.testing.assert_array_equal(mxfp4.FP4_VALUES, ref)
    np.testing.assert_array_equal(np.signbit(mxfp4.FP4_VALUES), np.signbit(ref))


def test_pack_is_low_nibble_first():
    codes = np.array([[1, 2, 0xF, 0x8]], dtype=np.uint8)
    np.testing.assert_array_equal(mxfp4.pack_fp4(codes), [[0x21, 0x8F]])


def test_pack_unpack_round_trip():
    codes = np.random.default_rng(0).integers(0, 16, (3, 5, 64), dtype=np.uint8)
    packed = mxfp4.pack_fp4(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == np.uint8
    np.testing.assert_array_equal(mxfp4.unpack_fp4(packed), codes)


@pytest.mark.parametrize(
    "codes, match",
    [
        (np.zeros((2, 3), np.uint8), "even-length"),
        (np.full((2,), 16, np.uint8), "0..15"),
        (np.zeros((2,), np.int32), "uint8"),
    ],
)
def test_pack_rejects_bad_codes(codes, match):
    with pytest.raises(ValueError, match=match):
        mxfp4.pack_fp4(codes)


def test_e8m0_matches_ml_dtypes_for_every_byte():
    b = np.arange(256, dtype=np.uint8)
    ours, ref = mxfp4.e8m0_to_float(b), b.view(E8M0).astype(np.float32)
    np.testing.assert_array_equal(ours, ref)  # NaNs compare equal here
    assert np.isnan(ours[255]) and ours[127] == 1.0 and ours[0] == np.float32(2.0**-127)


def _on_grid(rng, shape, scale_lo=100, scale_hi=150):
    """Random MXFP4 whose every block has a code of magnitude >= 4, so quantize must pick the same scale."""
    codes = rng.integers(0, 16, shape, dtype=np.uint8).reshape(shape[:-1] + (-1, 32))
    codes[..., 0] = rng.choice([6, 7, 14, 15], size=codes.shape[:-1]).astype(np.uint8)
    scales = rng.integers(scale_lo, scale_hi, codes.shape[:-1], dtype=np.uint8)
    return mxfp4.pack_fp4(codes.reshape(shape)), scales


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16])
def test_quantize_is_exact_on_the_grid(dtype):
    packed, scales = _on_grid(np.random.default_rng(1), (4, 6, 128))
    w = mxfp4.dequantize(packed, scales, dtype=dtype)
    assert w.dtype == dtype
    p2, s2 = mxfp4.quantize(w)
    np.testing.assert_array_equal(s2, scales)
    np.testing.assert_array_equal(p2, packed)  # bit for bit, -0 included


def test_dequantize_is_exact():
    packed, scales = _on_grid(np.random.default_rng(2), (3, 64), scale_lo=0, scale_hi=255)
    vals = mxfp4.FP4_VALUES[mxfp4.unpack_fp4(packed)].astype(np.float64).reshape(3, 2, 32)
    ref = vals * np.exp2(scales.astype(np.float64) - 127)[..., None]
    np.testing.assert_array_equal(mxfp4.dequantize(packed, scales, dtype=np.float64), ref.reshape(3, 64))
    f32 = mxfp4.dequantize(packed, scales)
    finite = np.abs(ref.reshape(3, 64)) < np.finfo(np.float32).max
    np.testing.assert_array_equal(f32[finite], ref.reshape(3, 64)[finite].astype(np.float32))


def test_rounding_ties_to_even_and_saturation():
    x = np.zeros(32, np.float32)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x[0] = 4.0  # amax in [4, 8) -> shared exponent 0, so x is rounded as is
    x[1:8] = ties
    x[8:15] = [-t for t in ties]
    x[15] = 7.9  # saturates
    x[16:20] = [0.2499, 0.2501, 1.2501, 4.9999]
    packed, scales = mxfp4.quantize(x)
    assert scales.tolist() == [127]
    got = mxfp4.dequantize(packed, scales)
    expect = [4, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -1, -2, -2, -4, -4, 6, 0, 0.5, 1.5, 4]
    np.testing.assert_array_equal(got[:20], expect)


def _reference(x: np.ndarray):
    """Scale bytes and codes computed independently: log2 for the exponent, ml_dtypes for the rounding."""
    blocks = x.astype(np.float64).reshape(x.shape[:-1] + (-1, 32))
    amax = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(amax)) - 2
    byte = np.where(amax == 0, 127, np.clip(e + 127, 0, 254)).astype(np.uint8)
    y = blocks / np.exp2(byte.astype(np.float64) - 127)[..., None]
    codes = np.clip(y, -6, 6).astype(E2M1).view(np.uint8)
    return byte, codes.reshape(x.shape)


def test_agrees_with_ml_dtypes_on_random_values_and_exact_ties():
    rng = np.random.default_rng(3)
    n_blocks = 20000
    x = rng.standard_normal((n_blocks, 32)).astype(np.float32)
    x *= np.exp2(rng.integers(-30, 30, (n_blocks, 1))).astype(np.float32)  # many exponents
    # A third of the blocks: exact midpoints of the scaled grid (ties), with amax pinned to set e.
    tie = rng.random(n_blocks) < 1 / 3
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    picks = rng.choice(mids, (n_blocks, 32)) * rng.choice([-1, 1], (n_blocks, 32))
    exps = np.exp2(rng.integers(-20, 20, (n_blocks, 1))).astype(np.float32)
    picks[:, 0] = 4.0
    x[tie] = (picks * exps)[tie]
    x[rng.random(n_blocks) < 0.01] = 0  # some all-zero blocks
    x[5, :] = np.float32(1e-40)  # subnormals: exponent clamps at byte 0
    x = x.reshape(100, -1)

    packed, scales = mxfp4.quantize(x)
    ref_scales, ref_codes = _reference(x)
    np.testing.assert_array_equal(scales, ref_scales.reshape(scales.shape))
    np.testing.assert_array_equal(mxfp4.unpack_fp4(packed), ref_codes)
    assert scales.reshape(-1)[5] == 0


@pytest.mark.parametrize("dtype", [np.float64, ml_dtypes.bfloat16, np.float16])
def test_agrees_with_ml_dtypes_for_other_input_dtypes(dtype):
    x = (np.random.default_rng(4).standard_normal((64, 64)) * 3).astype(dtype)
    packed, scales = mxfp4.quantize(x)
    ref_scales, ref_codes = _reference(x.astype(np.float64))
    np.testing.assert_array_equal(scales, ref_scales)
    np.testing.assert_array_equal(mxfp4.unpack_fp4(packed), ref_codes)


def test_huge_float64_saturates_at_largest_scale():
    x = np.zeros(32)
    x[0], x[1] = 1e300, -1e300
    packed, scales = mxfp4.quantize(x)
    assert scales.tolist() == [254]
    assert mxfp4.unpack_fp4(packed)[:2].tolist() == [7, 15]


def test_scale_bytes_are_e8m0_of_the_shared_exponent():
    x = np.random.default_rng(5).standard_normal((8, 64)).astype(np.float32)
    _, scales = mxfp4.quantize(x)
    amax = np.abs(x.reshape(8, 2, 32)).max(-1)
    scale = scales.view(E8M0).astype(np.float32)
    assert np.all((amax / scale >= 4) & (amax / scale < 8))


def test_all_zero_block_gets_unit_scale_and_zero_codes():
    x = np.zeros((2, 64), np.float32)
    x[1, 32:] = 1.0
    packed, scales = mxfp4.quantize(x)
    assert scales[0].tolist() == [mxfp4.E8M0_ONE] * 2 and scales[1, 0] == mxfp4.E8M0_ONE
    assert not packed[0].any() and not packed[1, :16].any()
    np.testing.assert_array_equal(mxfp4.dequantize(packed, scales), x)


def test_nan_scale_makes_its_block_nan():
    packed = np.full((1, 32), 0x21, np.uint8)
    scales = np.array([[mxfp4.E8M0_NAN, 127]], np.uint8)
    out = mxfp4.dequantize(packed, scales)
    assert np.isnan(out[0, :32]).all() and np.isfinite(out[0, 32:]).all()


def test_nonfinite_values_are_rejected_with_count_and_first_index():
    x = np.ones((3, 64), np.float32)
    x[1, 37] = np.nan
    x[2, 3] = -np.inf
    with pytest.raises(ValueError, match=r"w: cannot quantize 2 non-finite .*first at index \(1, 37\)"):
        mxfp4.quantize(x)
    with pytest.raises(ValueError, match=r"w13: cannot quantize 1 non-finite"):
        mxfp4.quantize(np.array([np.inf] + [0.0] * 31, dtype=ml_dtypes.bfloat16), name="w13")


def test_k_not_a_multiple_of_32_is_rejected():
    with pytest.raises(ValueError, match=r"w: axis 1 has length 48, expected a multiple of 32"):
        mxfp4.quantize(np.zeros((2, 48), np.float32))


def test_non_float_input_is_rejected():
    with pytest.raises(ValueError, match="int32"):
        mxfp4.quantize(np.zeros((2, 32), np.int32))


def test_dequantize_rejects_mismatched_scales():
    with pytest.raises(ValueError, match=r"scales: expected shape \(2, 2\)"):
        mxfp4.dequantize(np.zeros((2, 32), np.uint8), np.zeros((2, 3), np.uint8))


def test_other_axis_matches_transpose():
    x = np.random.default_rng(6).standard_normal((64, 5)).astype(np.float32)
    packed, scales = mxfp4.quantize(x, axis=0)
    pt, st = mxfp4.quantize(x.T)
    assert packed.shape == (32, 5) and scales.shape == (2, 5)
    np.testing.assert_array_equal(packed, pt.T)
    np.testing.assert_array_equal(scales, st.T)
    np.testing.assert_array_equal(mxfp4.dequantize(packed, scales, axis=0), mxfp4.dequantize(pt, st).T)


def test_random_mxfp4_shapes_spread_and_std():
    packed, scales = mxfp4.random_mxfp4(np.random.default_rng(7), (4, 64, 256), std=0.05)
    assert packed.shape == (4, 64, 128) and packed.dtype == np.uint8
    assert scales.shape == (4, 64, 8) and scales.dtype == np.uint8
    assert len(np.unique(scales)) == 3  # base exponent +-1
    std = mxfp4.dequantize(packed, scales).std()
    assert 0.05 / 2 < std < 0.05 * 2
    again = mxfp4.random_mxfp4(7, (4, 64, 256), std=0.05)
    np.testing.assert_array_equal(again[0], packed)
    np.testing.assert_array_equal(again[1], scales)


def test_drop_far_groups_zeroes_exactly_the_groups_past_the_span():
    """The sm_90 w4a8 form's weights: a group 11 binades under its row's largest scale is kept, 12 is zeroed; other
    rows and the scales are untouched."""
    rng = np.random.default_rng(0)
    codes = rng.integers(1, 256, size=(2, 3, 64), dtype=np.uint8)  # [E, N, K/2]: 4 groups a row
    scales = np.full((2, 3, 4), 130, dtype=np.uint8)
    scales[0, 1] = [140, 129, 128, 141]                            # row max 141: 129 is 12 under, 130 would be 11
    scales[1, 2] = [5, 200, 189, 188]                              # 189 is 11 under 200 (kept), 188 and 5 are not
    out = mxfp4.drop_far_groups(codes, scales)
    groups = out.reshape(2, 3, 4, 16)
    assert np.all(groups[0, 1, [1, 2]] == 0) and np.array_equal(groups[0, 1, [0, 3]],
                                                                codes.reshape(2, 3, 4, 16)[0, 1, [0, 3]])
    assert np.all(groups[1, 2, [0, 3]] == 0) and np.all(groups[1, 2, [1, 2]] != 0)
    mask = np.ones((2, 3), bool)
    mask[0, 1] = mask[1, 2] = False
    assert np.array_equal(out.reshape(2, 3, 64)[mask], codes[mask])


def test_mxfp8_row_round_trip_is_mxfp8_on_the_row_scale():
    """Values of a row's top block are their MXFP8 values; a block far under it moves by at most half an e4m3
    subnormal step at the row's scale (and its tiny values do move)."""
    x = np.random.default_rng(1).standard_normal((3, 96)).astype(np.float32)
    x[:, 32:64] *= 2.0 ** -12                                      # a block 12 binades under the others
    x[:, 0] = 100.0                                                # the row's largest: scale 2^(6 - 8)
    mx, row = mxfp4.mxfp8_round_trip(x), mxfp4.mxfp8_row_round_trip(x)
    assert np.array_equal(row[:, :32], mx[:, :32])
    assert np.all(np.abs(row - mx) <= 2.0 ** (6 - 8) * 2.0 ** -10)
    assert np.any(row[:, 32:64] != mx[:, 32:64])


def test_numpy_reference_runs_its_second_gemm_from_a_given_glu_output():
    """``return_glu`` gives the GLU output the second GEMM quantizes; fed back as ``glu_output`` it reproduces the
    layer bit for bit, and one value moved by an e4m3 step moves the outputs of that token only."""
    from mxmoe.core.config import MoEConfig
    from mxmoe.core.reference import numpy_reference
    from mxmoe.torch_frontend import MoE

    cfg = MoEConfig(num_experts=6, top_k=3, hidden=64, intermediate=96)
    w = MoE.random(cfg, seed=1).to_weights()
    x = np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32)
    kw = dict(activations="mxfp8", mx_fold="row")
    out, glu = numpy_reference(w, x, ml_dtypes.bfloat16, return_glu=True, **kw)
    assert glu.shape == (5, 3, 96) and np.abs(glu).max() > 0
    np.testing.assert_array_equal(numpy_reference(w, x, ml_dtypes.bfloat16, glu_output=glu, **kw), out)
    moved = glu.copy()
    moved[2, 1, np.abs(glu[2, 1]).argmax()] *= 1.125
    diff = np.abs(numpy_reference(w, x, ml_dtypes.bfloat16, glu_output=moved, **kw) - out).max(axis=1)
    assert diff[2] > 0 and np.all(np.delete(diff, 2) == 0)
