"""Fixtures of the kernel tests."""

import pytest

from mxmoe.kernels import cpu as ukernels


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
