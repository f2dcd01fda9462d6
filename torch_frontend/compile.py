"""``mxmoe.compile``: an ``nn.Module`` (or an ``ExportedProgram``) -> a compiled, callable module.

The compiler takes exported programs; this is where a module becomes one: ``capture`` exports it with its
token dimension dynamic, and a bare :class:`~mxmoe.torch_frontend.moe.MoE` layer gets a default example input
and a ``model`` record (its config and which parameter holds which weight), so its artifact can be checked
against the reference later.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Sequence

import torch

from mxmoe.compiler.api import CompiledModule, compile_program
from mxmoe.core.weights import moe_model_info
from mxmoe.torch_frontend.capture import capture
from mxmoe.torch_frontend.moe import MoE


def _monolithic(self, x, router_logits):
    return self.monolithic(x, router_logits)


def _modular(self, x, topk_weights, topk_ids):
    return self.modular(x, topk_weights, topk_ids)


def _modular_routed(self, x, topk_weights, topk_ids):
    return self.modular(x, topk_weights, topk_ids, shared=False)


def _shared(self, x):
    return self._shared_expert(self._tokens(x)).reshape(x.shape)


#: entry name -> the forward that computes it (named arguments: torch.export maps dynamic dims by them).
#: Besides the three entries of ``config.entries``, a layer with a shared expert has "modular_routed" (the
#: modular entry without it) and "shared" (the shared expert alone), for engines that run it on other input.
ENTRY_METHODS = {"layer": MoE.forward, "monolithic": _monolithic, "modular": _modular, "modular_routed": _modular_routed,
                 "shared": _shared}


def entry_module(layer: MoE, entry: str) -> torch.nn.Module:
    """``layer`` with ``forward`` running ``entry``, sharing its buffers (so parameter names stay the layer's)."""
    if entry not in ENTRY_METHODS:
        raise ValueError(f"unknown entry {entry!r} (known: {', '.join(ENTRY_METHODS)})")
    if entry == "layer" and not layer.config.router:
        raise ValueError(f"entry 'layer' needs a layer with its own router (config.router); this layer's entries: "
                         f"{', '.join(layer.config.entries)}")
    if entry in ("modular_routed", "shared") and not layer.config.shared_intermediate:
        raise ValueError(f"entry {entry!r} needs a layer with a shared expert")
    if entry == "layer" and type(layer).forward is MoE.forward:
        return layer
    # a drop-in block (convert's GptOssMoE, HFMoEBlock) keeps its model's call signature in forward; its compiled
    # entries have the interface's (docs/interface.md): the layer entry is x -> out
    cls = type(f"{type(layer).__name__}_{entry}", (type(layer),), {"forward": ENTRY_METHODS[entry]})
    view = copy.copy(layer)
    view.__class__ = cls
    return view


def example_inputs(layer: MoE, entry: str, tokens: int = 4) -> tuple:
    """Random inputs of ``entry`` for ``tokens`` tokens (valid routing for the modular entry)."""
    cfg = layer.config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, cfg.hidden, generator=g).to(layer.dtype)
    if entry == "layer":
        return (x,)
    if entry == "monolithic":
        logits_dtype = torch.float32 if cfg.router_fp32 else layer.dtype
        return (x, torch.randn(tokens, cfg.experts_routed, generator=g).to(logits_dtype))
    if entry == "shared":
        return (x,)
    weights = torch.rand(tokens, cfg.top_k, generator=g)
    ids = torch.stack([torch.randperm(cfg.experts_routed, generator=g)[:cfg.top_k] for _ in range(tokens)])
    return (x, weights, ids.to(torch.int32))


def _default_example(module: torch.nn.Module, entry: str = "layer") -> tuple:
    if isinstance(module, MoE):
        return example_inputs(module, entry)
    raise ValueError("compile: example_inputs is required for a module that is not an mxmoe MoE layer")


def compile(source, target: str = "cpu", example_inputs: Sequence[Any] | None = None,  # noqa: A001
            entries: Sequence[str] | str | None = None, **options) -> CompiledModule:
    """Compile ``source`` (an ``nn.Module`` with ``example_inputs``, or an ``ExportedProgram``) for ``target``.

    For an mxmoe :class:`MoE` layer, ``entries`` picks its entry points ("layer", "monolithic", "modular", or
    "all"; default: "layer", or "monolithic" and "modular" for a layer without a router): one compiled module
    whose entries share the weights. ``options`` go to :func:`mxmoe.compiler.api.compile_program` (``extra_flags``,
    ``activations``, ``interpret``, ``deterministic``, ``batch_invariant``).
    """
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if isinstance(source, MoE):
        names = _entries(source, entries)
        if example_inputs is not None and names != ["layer"]:
            raise ValueError("compile: example_inputs applies to the layer entry alone; entries get their own")
        programs = {name: capture(entry_module(source, name),
                                  example_inputs if example_inputs is not None and name == "layer"
                                  else _default_example(source, name)) for name in names}
    elif entries is not None:
        raise ValueError(f"compile: entries apply to mxmoe MoE layers, not to a {type(source).__name__}")
    elif isinstance(source, torch.export.ExportedProgram):
        programs = source
    elif isinstance(source, torch.nn.Module):
        programs = capture(source, example_inputs if example_inputs is not None else _default_example(source))
    else:
        raise TypeError(f"compile: expected an nn.Module or torch.export.ExportedProgram, got {type(source).__name__}")
    timings["capture_s"] = time.perf_counter() - t0
    compiled = compile_program(programs, target, timings=timings, **options)
    if isinstance(source, MoE):
        compiled.model = moe_model_info(source.config, compiled.parameters)
    return compiled


def _entries(layer: MoE, entries) -> list[str]:
    if entries is None:
        return ["layer"] if layer.config.router else ["monolithic", "modular"]
    if entries == "all":
        return list(layer.config.entries)
    names = [entries] if isinstance(entries, str) else list(entries)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"compile: entries must name each entry once, got {names}")
    for name in names:
        entry_module(layer, name)  # checks the name
    return names
