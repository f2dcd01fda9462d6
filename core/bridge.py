"""The one bridge between torch tensors and numpy arrays, and the dtype names every layer writes.

Entry signatures, artifacts, kernel plans and stored weights name dtypes by the strings in :data:`DTYPES`.
numpy has no bfloat16 of its own: ``ml_dtypes.bfloat16`` stands in, and a bf16 tensor crosses the bridge as
its 16-bit pattern (no rounding, no copy where the memory allows). torch is imported inside the functions
that take or make tensors, so this module (and ``mxmoe.core``) loads where torch is not installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: dtype names mxmoe writes (signatures, manifests, plans) -> numpy's name for them
DTYPES = ("bfloat16", "float16", "float32", "int8", "int32", "int64", "uint8")


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name (``"bfloat16"`` is ml_dtypes' bfloat16)."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(DTYPES)})")
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def dtype_name(dtype: Any) -> str:
    """The name of a numpy dtype or a torch dtype, one of :data:`DTYPES` (ValueError for any other)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {name} is not supported (supported: {', '.join(DTYPES)})")
    return name


def torch_dtype(name: str):
    """The torch dtype of a dtype name."""
    import torch

    return getattr(torch, dtype_name(name))


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (without importing torch)."""
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def to_numpy(t) -> np.ndarray:
    """A CPU numpy view of tensor ``t`` (copied to the host first if it lives on a device); bf16 stays bf16."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_torch(a: np.ndarray, device=None):
    """A tensor sharing ``a``'s memory where it can (on the CPU), else on ``device``; bf16 stays bf16."""
    import torch

    a = np.asarray(a)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if device is None else t.to(device)
