"""The routing contract's tie rules in torch, for code that routes or compares routings outside a compiled layer.

docs/routing.md: the top ``k`` experts by rounded logit, ties to the lower expert index; and, between two correct
implementations whose fp32 sums differ in their last bits, the tokens whose k-th and (k+1)-th logits are so close
that one may round them apart where the other rounds them together (near ties), so either choice is right.
References, tests and benchmarks use these two rather than ``torch.topk``, whose order among equal values is not
specified (on CUDA it is not the lower index every time).
"""

from __future__ import annotations

import torch
from torch import Tensor


def top_k(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``(values, indices)`` of the ``k`` largest entries of each row of ``x`` [T, E], ties to the lower index."""
    vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[:, :k], ids[:, :k]


def near_tie_tokens(logits: Tensor, k: int) -> Tensor:
    """bool [T]: tokens whose k-th and (k+1)-th logits are within 2 ulps of the logits' dtype (bf16: 2^-7 relative;
    fp32 logits: 2^-13, past what another summation order of an fp32 dot changes), where two correct routers may
    pick different experts."""
    top = logits.float().topk(min(k + 1, logits.shape[1]), dim=-1).values
    if top.shape[1] <= k:
        return torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    bits = 13 if logits.dtype == torch.float32 else 7
    ulp = torch.exp2(torch.floor(torch.log2(top[:, k - 1].abs().clamp_min(1e-30))) - bits)
    return (top[:, k - 1] - top[:, k]) <= 2 * ulp
