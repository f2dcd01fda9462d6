"""Stored forms of weights: padding (incl. gate|up halves) and named layouts, numpy only."""

import numpy as np
import pytest

from mxmoe import layouts
from mxmoe.layouts import ROW_MAJOR, StoredForm, pad_array, register_layout


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
    form = StoredForm(shape=(2, 3), padded_shape=(2, 4), pad_value=0, layout=ROW_MAJOR, role="bias")
    assert StoredForm.from_dict(form.to_dict()) == form
    out = form.apply("w2_bias", np.ones((2, 3), np.float32))
    assert out.shape == (2, 4) and out[:, 3].sum() == 0 and out[:, :3].sum() == 6
    with pytest.raises(ValueError, match=r"weight 'w2_bias': expected shape \[2, 3\], got \[3, 3\]"):
        form.apply("w2_bias", np.ones((3, 3), np.float32))


def test_layouts_apply_after_padding_and_unknown_layouts_are_named(monkeypatch):
    monkeypatch.setattr(layouts, "_TRANSFORMS", dict(layouts._TRANSFORMS))
    register_layout("test-reverse", lambda role, a: a[..., ::-1])
    form = StoredForm(shape=(1, 2), padded_shape=(1, 3), pad_value=9, layout="test-reverse", role="values")
    assert form.apply("w", np.array([[1, 2]], np.uint8)).tolist() == [[9, 2, 1]]
    bad = StoredForm(shape=(1, 2), padded_shape=(1, 2), layout="no-such-layout")
    with pytest.raises(ValueError, match="unknown layout 'no-such-layout'"):
        bad.apply("w", np.zeros((1, 2)))
