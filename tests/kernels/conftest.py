"""Fixtures of the kernel tests."""

import types

import ml_dtypes
import numpy as np
import pytest

from mxmoe.core import reference
from mxmoe.kernels import cpu as ukernels

#: the GLU epilogue's cases: (activation, alpha, limit)
GLU_CASES = [("swiglu_oai", 1.702, 7.0), ("silu", 1.0, 7.0), ("silu_clamped", 1.0, 5.0), ("gelu_tanh", 1.0, 7.0)]
#: the epilogue's output types -> one unit in their last place, relative
ULP = {np.dtype(ml_dtypes.bfloat16): 2.0 ** -7, np.dtype(np.float16): 2.0 ** -10, np.dtype(np.float32): 2.0 ** -21}


def _expected(h: np.ndarray, glu, dt: np.dtype, interleaved: bool) -> np.ndarray:
    """What the reference does after a w13 matmul: h [S, N] f32 (bias added) rounded to the activation type dt,
    the GLU in f32 (gate/up rows interleaved or in halves), rounded again (f32 values)."""
    act, alpha, limit = glu
    cfg = types.SimpleNamespace(activation=act, swiglu_alpha=alpha, swiglu_limit=limit)
    with np.errstate(over="ignore"):  # exp(-z) of a very negative gate: inf, a sigmoid of 0 as it should be
        return reference.glu(h.astype(dt).astype(np.float32), cfg, interleaved).astype(dt).astype(np.float32)


def _check(got: np.ndarray, h: np.ndarray, glu, interleaved: bool) -> None:
    """The epilogue's [S, N / 2] (its output type) against _expected: the exp differs from numpy's by an ulp or
    so, so a value may round the other way (one unit in the output type's last place); most are equal. gelu_tanh
    adds 1 to a tanh near -1 in f32 (the reference too): an f32 ulp of that tanh, times g u / 2, on top."""
    want = _expected(h, glu, got.dtype, interleaved)
    got32 = got.astype(np.float32)
    assert np.isfinite(got32).all()
    hr = h.astype(got.dtype).astype(np.float32)
    g, u = (hr[:, 0::2], hr[:, 1::2]) if interleaved else np.split(hr, 2, axis=1)
    atol = 2.0 ** -24 * np.abs(g * u) if glu[0] == "gelu_tanh" else 0.0
    assert (np.abs(got32 - want) <= ULP[got.dtype] * np.abs(want) + atol + 1e-30).all(), np.abs(got32 - want).max()
    assert (got32 == want).mean() > (0.5 if got.dtype == np.float32 else 0.97), (got32 == want).mean()


@pytest.fixture
def glu_io():
    """What the GLU epilogue tests of both C matmuls share: ``cases``, ``dtypes`` (the output types by name) and
    ``check``."""
    return types.SimpleNamespace(cases=GLU_CASES, check=_check,
                                 dtypes={"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32})


@pytest.fixture(params=ukernels.host_flavors() or ["none"])
def flavor(request, monkeypatch):
    """Compile with each microkernel flavor this host runs (``MXMOE_CPU_UKERNEL=<flavor>``)."""
    if request.param == "none":
        pytest.skip(f"no cpu microkernel here: {ukernels.matvec_object().reason}")
    monkeypatch.setenv(ukernels.ENV_SWITCH, request.param)
    ukernels.matvec_object.cache_clear()
    uk = ukernels.matvec_object()
    if uk.path is None:
        pytest.skip(uk.reason)
    assert uk.flavor == request.param
    yield request.param
    ukernels.matvec_object.cache_clear()
