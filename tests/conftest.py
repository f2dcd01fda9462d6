"""Shared pytest set-up: GPU tests skip on machines without CUDA; the ``rss_bytes`` and
``near_tie_tokens`` fixtures."""

import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def rss_bytes():
    """This process's resident set size in bytes (Linux), as a function to call before and after."""
    return _rss_bytes


def _near_tie_tokens(logits, k: int):
    """Tokens whose k-th and (k+1)-th logits are within 2 bf16 ulps (fp32 logits: 2^-13 relative, past what
    another summation order of an fp32 dot changes): a difference in how the router's dot product is summed
    may legitimately pick the other expert there."""
    import torch

    top = logits.float().topk(min(k + 1, logits.shape[1]), dim=-1).values
    if top.shape[1] <= k:
        return torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    bits = 13 if logits.dtype == torch.float32 else 7
    ulp = torch.exp2(torch.floor(torch.log2(top[:, k - 1].abs().clamp_min(1e-30))) - bits)
    return (top[:, k - 1] - top[:, k]) <= 2 * ulp


@pytest.fixture
def near_tie_tokens():
    """``near_tie_tokens(logits [T, E], k)`` -> bool [T]: tokens whose routing may legitimately differ."""
    return _near_tie_tokens


@pytest.fixture
def linalg_matvec(monkeypatch):
    """Compile the cpu target without its C microkernel (``MXMOE_CPU_UKERNEL=0``): the pure-linalg matvec
    forms that the microkernel replaces at few tokens stay tested."""
    from mxmoe.kernels.cpu import matvec_object

    monkeypatch.setenv("MXMOE_CPU_UKERNEL", "0")
    matvec_object.cache_clear()
    yield
    matvec_object.cache_clear()
