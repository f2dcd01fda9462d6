"""MXFP4 decode in torch, for the reference ops (the numpy codec lives in ``mxmoe.core.mxfp4``)."""

from __future__ import annotations

import torch

from mxmoe.core.config import MXFP4_BLOCK

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` packed e2m1 (low nibble first) + ``[..., K/32]`` e8m0 -> ``[..., K]`` fp32, exactly."""
    lut = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
    p = packed.to(torch.int64)
    vals = torch.stack((lut[p & 0xF], lut[p >> 4]), dim=-1).flatten(-2)  # [..., K]
    s = scales.to(torch.int32)
    scale = torch.where(s == 0xFF, torch.nan, torch.exp2((s - 127).float()))
    vals = vals.unflatten(-1, (-1, MXFP4_BLOCK)) * scale.unsqueeze(-1)
    return vals.flatten(-2)
