"""Stored forms of weights: padding (incl. gate|up halves) and named layouts, numpy only."""

import numpy as np
import pytest

from mxmoe.core import layouts, swizzle
from mxmoe.core.layouts import ROW_MAJOR, Layout
from mxmoe.core.stored_form import StoredForm, pad_array


def test_pad_array_fills_the_tail_of_each_axis():
    a = np.arange(6, dtype=np.uint8).reshape(2, 3)
    out = pad_array(a, (3, 5), 127)
    assert out.shape == (3, 5)
    assert (out[:2, :3] == a).all() and (out[2] == 127).all() and (out[:, 3:] == 127).all()


def test_pad_halves_keeps_gate_and_up_rows_paired():
    a = np.arange(1, 9, dtype=np.int32).reshape(1, 4, 2)  # gate rows 0-1, up rows 2-3
    out = pad_array(a, (1, 6, 2), 0, halves=True)
    assert out[0].tolist() == [[1, 2], [3, 4], [0, 0], [5, 6], [7, 8], [0, 0]]


def test_pad_array_rejects_shrinking_and_rank_change():
    with pytest.raises(ValueError, match="cannot pad"):
        pad_array(np.zeros((2, 3)), (2, 2), 0)
    with pytest.raises(ValueError, match="cannot pad"):
        pad_array(np.zeros((2, 3)), (2, 3, 1), 0)


def test_stored_form_round_trips_and_checks_the_shape():
    form = StoredForm(shape=(2, 3), padded_shape=(2, 4), pad_value=0, layout=ROW_MAJOR.name, role="bias")
    assert StoredForm.from_dict(form.to_dict()) == form
    out = form.apply("w2_bias", np.ones((2, 3), np.float32))
    assert out.shape == (2, 4) and out[:, 3].sum() == 0 and out[:, :3].sum() == 6
    with pytest.raises(ValueError, match=r"weight 'w2_bias': expected shape \[2, 3\], got \[3, 3\]"):
        form.apply("w2_bias", np.ones((3, 3), np.float32))


def test_layouts_apply_after_padding_and_unknown_layouts_are_named(monkeypatch):
    monkeypatch.setitem(layouts.LAYOUTS, "test-reverse", Layout("test-reverse", lambda a: a[..., ::-1], lambda a: a[..., ::-1]))
    form = StoredForm(shape=(1, 2), padded_shape=(1, 3), pad_value=9, layout="test-reverse", role="values")
    assert form.apply("w", np.array([[1, 2]], np.uint8)).tolist() == [[9, 2, 1]]
    bad = StoredForm(shape=(1, 2), padded_shape=(1, 2), layout="no-such-layout")
    with pytest.raises(ValueError, match="unknown layout 'no-such-layout'"):
        bad.apply("w", np.zeros((1, 2)))


@pytest.mark.parametrize("layout, role", [(ROW_MAJOR.name, "values"), ("triton-mxfp4-kmajor", "scales"),
                                          (layouts.CPU_BLOCKSPLIT.name, "values"), (layouts.CPU_BLOCKSPLIT.name, "bias")])
@pytest.mark.parametrize("halves", [False, True])
def test_invert_gives_back_the_logical_array(layout, role, halves):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 255 if role == "scales" else 256, size=(3, 6, 32), dtype=np.uint8)  # 0xFF: a NaN scale
    form = StoredForm(shape=(3, 6, 32), padded_shape=(3, 10, 64), pad_value=7, pad_halves=halves, layout=layout, role=role)
    stored = form.apply("w", a)
    assert stored.shape == (3, 10, 64)
    assert np.array_equal(form.invert("w", stored), a)
    with pytest.raises(ValueError, match=r"expected stored shape \[3, 10, 64\]"):
        form.invert("w", a)


def test_blocksplit_puts_values_b_and_b_plus_16_in_one_byte():
    values = np.arange(32, dtype=np.uint8) % 16          # value i has nibble i mod 16
    packed = (values[0::2] | (values[1::2] << 4)).reshape(1, 16)
    stored = swizzle.blocksplit_swizzle(packed)
    assert [(b & 15, b >> 4) for b in stored[0].tolist()] == [(i % 16, (i + 16) % 16) for i in range(16)]


@pytest.mark.parametrize("layout", [layouts.TRITON_HOPPER.name, layouts.TRITON_HOPPER_TILED.name])
@pytest.mark.parametrize("halves", [False, True])
def test_hopper_layout_round_trips_through_padding(halves, layout):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, size=(2, 40, 48), dtype=np.uint8)  # N = 40 pads to 48, K = 96 to 128
    form = StoredForm(shape=(2, 40, 48), padded_shape=(2, 48, 64), layout=layout, role="values",
                      pad_halves=halves)
    stored = form.apply("w13", a)
    assert stored.shape == (2, 48, 64) and not np.array_equal(stored[:, :40, :48], a)
    assert np.array_equal(form.invert("w13", stored), a)
    scales = StoredForm(shape=(2, 40, 3), padded_shape=(2, 48, 4), pad_value=127, layout=layout, role="scales")
    s = np.minimum(a[..., :3], 254)  # 0xFF is a NaN scale, refused
    assert np.array_equal(scales.invert("s", scales.apply("s", s)), s)


def test_hopper_word_holds_its_pairs_at_the_documented_places():
    """Checkpoint byte (row 8rb + i, byte 8t + 4jl + q) -> pair rb + 2t of the word at stored row 8jl + i,
    bytes 4q..4q+3: decode that word the kernel's way and find the byte's two values."""
    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, size=(16, 16), dtype=np.uint8)
    stored = swizzle.hopper_swizzle(a)
    for rb, i, t, jl, q in [(0, 0, 0, 0, 0), (1, 3, 0, 1, 2), (0, 7, 1, 0, 3), (1, 5, 1, 1, 1)]:
        word = int.from_bytes(bytes(stored[8 * jl + i, 4 * q:4 * q + 4]), "little")
        pair = 0
        for mask, r in swizzle.HOPPER_PAIR_BITS[rb + 2 * t]:
            pair |= ((word << r | word >> (32 - r)) if r else word) & mask & 0xFFFFFFFF
        halves = [pair & 0xFFFF, pair >> 16]
        codes = [((h >> 12) & 8) | ((h >> 6) & 7) for h in halves]
        byte = a[8 * rb + i, 8 * t + 4 * jl + q]
        assert codes == [byte & 15, byte >> 4]


@pytest.mark.parametrize("n,kb", [(5760, 1440), (96, 160), (80, 48), (16, 16)])
def test_hopper_tiles_are_a_permutation_with_contiguous_chunks(n, kb):
    """Every (row, byte) gets its own offset, and chunk j of a 64-row group (rows g0.., bytes 128j..) is one
    contiguous run: rows one after another, each row's bytes in order."""
    offs = swizzle.hopper_tile_offsets(n, kb)
    assert np.array_equal(np.sort(offs.ravel()), np.arange(n * kb))
    R, B = swizzle.HOPPER_TILE_ROWS, swizzle.HOPPER_TILE_BYTES
    for g0 in range(0, n, R):
        for b0 in range(0, kb, B):
            chunk = offs[g0:g0 + R, b0:b0 + B].ravel()
            assert np.array_equal(chunk, chunk[0] + np.arange(chunk.size))


def test_hopper_tiled_is_the_hopper_words_moved():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, size=(2, 96, 160), dtype=np.uint8)
    words, tiled = swizzle.hopper_swizzle(a), swizzle.hopper_tiled_swizzle(a)
    offs = swizzle.hopper_tile_offsets(96, 160).ravel()
    assert np.array_equal(tiled.reshape(2, -1)[:, offs], words.reshape(2, -1))
    assert np.array_equal(swizzle.hopper_tiled_unswizzle(tiled), a)
