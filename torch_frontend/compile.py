"""``mxmoe.compile``: an ``nn.Module`` (or an ``ExportedProgram``) -> a compiled, callable module.

The compiler takes exported programs; this is where a module becomes one: ``capture`` exports it with its
token dimension dynamic, and a bare :class:`~mxmoe.torch_frontend.moe.MoE` layer gets a default example input
and a ``model`` record (its config and which parameter holds which weight), so its artifact can be checked
against the reference later.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from mxmoe.compiler.api import CompiledModule, compile_program
from mxmoe.core.weights import moe_model_info
from mxmoe.torch_frontend.capture import capture
from mxmoe.torch_frontend.moe import MoE


def _default_example(module: torch.nn.Module) -> tuple:
    if isinstance(module, MoE):
        g = torch.Generator().manual_seed(0)
        return (torch.randn(4, module.config.hidden, generator=g).to(module.dtype),)
    raise ValueError("compile: example_inputs is required for a module that is not an mxmoe MoE layer")


def compile(source, target: str = "cpu", example_inputs: Sequence[Any] | None = None,  # noqa: A001
            **options) -> CompiledModule:
    """Compile ``source`` (an ``nn.Module`` with ``example_inputs``, or an ``ExportedProgram``) for ``target``.

    ``options`` go to :func:`mxmoe.compiler.api.compile_program` (``extra_flags``, ``interpret``).
    """
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if isinstance(source, torch.export.ExportedProgram):
        ep = source
    elif isinstance(source, torch.nn.Module):
        ep = capture(source, example_inputs if example_inputs is not None else _default_example(source))
    else:
        raise TypeError(f"compile: expected an nn.Module or torch.export.ExportedProgram, got {type(source).__name__}")
    timings["capture_s"] = time.perf_counter() - t0
    compiled = compile_program(ep, target, timings=timings, **options)
    if isinstance(source, MoE):
        compiled.model = moe_model_info(source.config, compiled.parameters)
    return compiled
