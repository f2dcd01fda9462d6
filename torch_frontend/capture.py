"""``capture``: torch.export of a module that contains mxmoe MoE layers, token count dynamic; ``load_program``:
such a program saved as a ``.pt2``, read back."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.export import Dim, ExportedProgram

from mxmoe.torch_frontend import ops as _ops  # noqa: F401  (registers the mxmoe custom ops a saved program names)

#: Upper bound for the dynamic token dimension; big enough for prefill of long prompts.
MAX_TOKENS = 1 << 20


def _grow(t: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """torch.export specialises size-1 dims; give it an example of size 2 where the caller passed 1."""
    for d in dims:
        if t.shape[d] == 1:
            t = torch.cat([t, t], dim=d)
    return t


def capture(module: torch.nn.Module, example_inputs: Sequence[Any] | torch.Tensor, *,
            dynamic: bool = True, max_tokens: int = MAX_TOKENS) -> ExportedProgram:
    """Export ``module`` with its leading (token) dimension(s) symbolic.

    Every floating-point tensor input gets a dynamic dim 0 (``tokens``); a rank-3 input ``[B, S, H]``
    gets dynamic batch and sequence dims. An integer input of rank 2 (an engine's top-k ids ``[T, k]``) shares
    the token dim. Works for a bare ``MoE`` and for larger modules around one;
    the mxmoe custom ops stay single nodes in the graph.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    if not example_inputs:
        raise ValueError("capture: example_inputs is empty; pass at least the hidden-states tensor")
    module = module.eval()
    if not dynamic:
        return torch.export.export(module, example_inputs)
    tokens = Dim("tokens", min=1, max=max_tokens)
    batch = Dim("batch", min=1, max=max_tokens)
    seq = Dim("seq", min=1, max=max_tokens)
    args, shapes = [], []
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and (x.is_floating_point() or x.dim() == 2):
            dims = {0: tokens} if x.dim() == 2 else {0: batch, 1: seq}
            args.append(_grow(x, list(dims)))
            shapes.append(dims)
        else:
            args.append(x)
            shapes.append(None)
    with torch.no_grad():
        return torch.export.export(module, tuple(args), dynamic_shapes=tuple(shapes))


def load_program(path: str | os.PathLike) -> ExportedProgram:
    """A saved ExportedProgram (``.pt2``). torch can only rebuild the mxmoe ops' nodes once the ops are registered,
    which importing this module does. ValueError naming the file when it is not a loadable program (torch's own
    multi-page warnings about it are kept quiet)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such file")
    log = logging.getLogger("torch.export")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return torch.export.load(str(p))
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ValueError(f"{p}: not a loadable torch.export program (.pt2): {first}") from None
    finally:
        log.setLevel(level)
