"""``Mxfp4MoEMethod``: mxmoe as a serving engine's quantized fused-MoE method.

The lifecycle follows how engines drive such a method, so an integration is a thin adapter (docs/interface.md):

1. ``create_weights(layer)`` registers the parameters on the engine's MoE layer, in the standard layout with H and
   I padded up front to the target's multiple: ``w13_weight`` [E, 2I', H'/2] uint8, ``w13_weight_scale``
   [E, 2I', H'/32], ``w2_weight`` [E, H', I'/2], ``w2_weight_scale`` [E, H', I'/32], ``w13_bias`` [E, 2I'],
   ``w2_bias`` [E, H'] (params dtype), and for a shared expert ``shared_w13_weight`` [2S', H'/2] (+ ``_scale``) or
   bf16 [2S', H'], ``shared_w2_weight``, ``shared_gate_weight`` [1, H']; with DeepSeek-V3's routing
   (``routing="sigmoid_topk"``, ``num_expert_group``/``topk_group``, ``routed_scaling_factor``)
   ``e_score_correction_bias`` [E_global] fp32.
2. The engine's checkpoint loader copies tensors into the unpadded regions (padding stays zero weights with unit
   scales, which contributes nothing; see :meth:`Mxfp4MoEMethod.create_weights` for where gate and up go).
3. ``process_weights_after_loading(layer)`` converts them once to the target's layout and binds them to a module
   compiled once per shape (every layer of a model shares it).
4. ``apply`` (modular: the engine's top-k weights and global ids) or ``apply_monolithic`` (the router's logits).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mxmoe.core.bridge import numpy_dtype, to_numpy
from mxmoe.core.config import MXFP4_BLOCK, MoEConfig
from mxmoe.core.mxfp4 import E8M0_ONE
from mxmoe.core.weights import VLLM_NAMES, MoEWeights, expected_tensors

__all__ = ["Mxfp4MoEMethod"]

#: compiled templates (no weights) by (config, dtype, target, entries): every layer of one shape shares one
_TEMPLATES: dict[tuple, Any] = {}
_TEMPLATES_LOCK = threading.Lock()
#: a folder of compiled templates, written ahead of time (artifacts without weights, one per layer shape, target and
#: options): :func:`layer_template` reads one there before compiling and writes what it compiles, so a serving
#: machine without the compiler (no IREE) runs what a build machine with the same mxmoe wrote (docs/interface.md)
TEMPLATES_ENV = "MXMOE_TEMPLATES"


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def layer_template(weights: MoEWeights, dtype: torch.dtype, target, entries, options: dict | None = None) -> Any:
    """The compiled module (without weights) of ``weights``' layer shape for ``dtype``, ``target`` and ``entries``
    (``options``: more of ``mxmoe.compile``'s keywords): compiled on first use, then shared by every layer of that
    shape in this process."""
    from mxmoe.compiler.targets import get_target

    target = get_target(target)
    options = dict(options or {})
    key = (weights.config, dtype, target, tuple(entries), tuple(sorted(options.items())))
    with _TEMPLATES_LOCK:
        found = _TEMPLATES.get(key)
        if found is None:
            folder = os.environ.get(TEMPLATES_ENV)
            path = None
            if folder:
                path = Path(folder) / f"{template_key(weights.config, dtype, target, entries, options)}.mxmoe"
                found = _read_template(path)
            if found is None:
                if path is not None and not _has_compiler():
                    raise RuntimeError(f"no compiled template for this layer ({_describe(weights.config)}, {dtype}, "
                                       f"{target.name}) in ${TEMPLATES_ENV}={folder} ({path.name}), and no compiler "
                                       "here (iree-base-compiler) to build it: write it with the same mxmoe on a "
                                       "machine that has one")
                from mxmoe.torch_frontend.compile import compile as mx_compile
                from mxmoe.torch_frontend.moe import MoE

                compiled = mx_compile(MoE(weights, dtype=dtype), target, entries=list(entries), **options)
                found = compiled.without_weights()
                if path is not None:
                    _write_template(found, path)
            _TEMPLATES[key] = found
    return found


def template_key(config: MoEConfig, dtype: torch.dtype, target, entries, options: dict) -> str:
    """The file name (SHA-256) of a template in ``$MXMOE_TEMPLATES``: the layer's config, activation dtype, target
    (all its fields: arch, layout, padding), entries and compile options, and the mxmoe that compiled it (its version
    and a fingerprint of the sources that make compiled code), so a template from other code is never taken."""
    from mxmoe.compiler.targets import get_target
    from mxmoe.core._version import __version__
    from mxmoe.torch_frontend.compile_cache import source_fingerprint

    material = {"config": config.to_dict(), "dtype": str(dtype), "target": repr(get_target(target)),
                "entries": list(entries), "options": {k: options[k] for k in sorted(options)},
                "mxmoe": __version__, "sources": source_fingerprint()}
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


def _read_template(path: Path):
    """The template at ``path`` (checked: every section's SHA-256), or None where there is none."""
    from mxmoe.compiler.compiled import CompiledModule
    from mxmoe.runtime.artifact import Artifact, ArtifactError

    if not path.exists():
        return None
    try:
        art = Artifact(path)
        art.verify()
        return CompiledModule.from_artifact(art)
    except ArtifactError as e:
        raise RuntimeError(f"{path}: unreadable compiled template ({e}); delete it to rebuild") from None


def _write_template(template, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        template.save(path, weights="none", source={"kind": "engine template", "file": path.name})
    except OSError as e:
        warnings.warn(f"mxmoe: cannot write the compiled template {path} ({e}); continuing without it", stacklevel=3)


def _has_compiler() -> bool:
    try:
        return importlib.util.find_spec("iree.compiler") is not None
    except ModuleNotFoundError:  # no iree package at all
        return False


def _describe(config: MoEConfig) -> str:
    return f"E={config.num_experts} k={config.top_k} H={config.hidden} I={config.intermediate}"


def store_layer(template, weights: MoEWeights) -> dict[str, np.ndarray]:
    """``weights`` as the arrays ``template`` reads (padded, in its target's layout), by parameter name."""
    from mxmoe.core.stored_form import store_parameters

    # the compiled module's parameters are the layer's buffers, named like the MoEWeights fields
    raw = {spec.name: np.asarray(getattr(weights, spec.name)).astype(numpy_dtype(spec.dtype), copy=False)
           for spec in template.parameter_specs}
    return store_parameters(template.stored_forms, raw)


def bind_layer(weights: MoEWeights, dtype: torch.dtype, target, entries, options: dict | None = None):
    """``weights`` bound to the module compiled once for their shape (:func:`layer_template`): its entry points."""
    template = layer_template(weights, dtype, target, entries, options)
    return template.with_parameters(store_layer(template, weights)).bound()


class Mxfp4MoEMethod:
    """An MXFP4 fused-MoE method for one MoE layer shape on one target (see the module docstring)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 has_bias: bool = True, activation: str = "swiglu_oai", routing: str = "topk_softmax",
                 renormalize: bool = False, global_num_experts: int | None = None, expert_map=None,
                 apply_router_weight_on_input: bool = False, shared_intermediate_size: int = 0,
                 shared_gate: bool = False, shared_format: str = "mxfp4", target: str = "cpu",
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, interleaved: bool = True,
                 max_capture_size: int | None = None, num_expert_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, e_score_correction_bias: bool = False,
                 fp32_router_logits: bool = False, compile_options: dict | None = None):
        from mxmoe.compiler.targets import get_target

        self.target = get_target(target)
        if not self.target.runs_torch_tensors:
            raise ValueError(f"Mxfp4MoEMethod runs on torch tensors; target {self.target.name} cannot (compile an "
                             "artifact for it with mxmoe.compile instead)")
        for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"Mxfp4MoEMethod: {name} must be a positive int, got {v!r}")
        #: the target's padding of H and I (and of the shared expert's size), decided up front
        self.pad_multiple = math.lcm(self.target.pad_multiple, MXFP4_BLOCK)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.shared_intermediate_size = shared_intermediate_size
        self.hidden_padded = _round_up(hidden_size, self.pad_multiple)
        self.intermediate_padded = _round_up(intermediate_size, self.pad_multiple)
        self.shared_padded = _round_up(shared_intermediate_size, self.pad_multiple)
        if expert_map is not None and global_num_experts is None:
            global_num_experts = int(np.asarray(to_numpy(expert_map) if torch.is_tensor(expert_map)
                                                else expert_map).shape[0])
        self.config = MoEConfig(
            num_experts=num_experts, top_k=top_k, hidden=self.hidden_padded, intermediate=self.intermediate_padded,
            routing=routing, renormalize=renormalize, activation=activation, swiglu_alpha=swiglu_alpha,
            swiglu_limit=swiglu_limit, interleaved=interleaved, bias=has_bias, router_bias=False, router=False,
            global_num_experts=global_num_experts, apply_router_weight_on_input=apply_router_weight_on_input,
            shared_intermediate=self.shared_padded, shared_gate=shared_gate, shared_format=shared_format,
            n_group=num_expert_group, topk_group=topk_group, routed_scaling_factor=routed_scaling_factor,
            score_bias=e_score_correction_bias, router_fp32=fp32_router_logits)
        self.expert_map = None
        if global_num_experts is not None:
            em = expert_map if expert_map is not None else np.arange(global_num_experts) if \
                global_num_experts == num_experts else None
            if em is None:
                raise ValueError(f"Mxfp4MoEMethod: global_num_experts={global_num_experts} with {num_experts} local "
                                 "experts needs an expert_map")
            self.expert_map = np.asarray(to_numpy(em) if torch.is_tensor(em) else em).astype(np.int32)
        if max_capture_size is not None and (not isinstance(max_capture_size, int) or max_capture_size < 1):
            raise ValueError(f"Mxfp4MoEMethod: max_capture_size must be a positive int, got {max_capture_size!r}")
        self.max_capture_size = max_capture_size
        #: options of ``mxmoe.compile`` (``deterministic``, ``batch_invariant``; ``interpret`` for cuda targets on
        #: a machine without a GPU, e.g. tests)
        self.compile_options = dict(compile_options or {})
        self.entries = ["monolithic", "modular"] + (["modular_routed", "shared"] if shared_intermediate_size else [])

    # ---------------------------------------------------------------------------------- 1. parameters
    def create_weights(self, layer: nn.Module, params_dtype: torch.dtype = torch.bfloat16) -> None:
        """Register the parameters on ``layer`` (padded shapes, zero codes and unit scales), for a loader to fill.

        Where a loader puts checkpoint tensors of the unpadded sizes (H, I, S):
        ``w13_weight[e, :2I, :H/2]`` for interleaved gate/up rows (gate, up, gate, up, ...); for concatenated
        ones, gate rows at ``[e, :I]`` and up rows at ``[e, I':I'+I]`` (each half padded on its own). ``w2_weight[e,
        :H, :I/2]``; scales likewise (``/32``); biases ``w13_bias[e, rows]``, ``w2_bias[e, :H]``. The shared expert
        is concatenated (gate then up): ``shared_w13_weight[:S]`` and ``[S':S'+S]``, ``shared_w2_weight[:H, :S/2]``.
        """
        if params_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"create_weights: params_dtype must be bfloat16, float16 or float32, got {params_dtype}")
        self.params_dtype = params_dtype
        for field, spec in expected_tensors(self.config).items():
            if spec is None or field.startswith("router"):
                continue
            shape, dtype = spec
            shape = shape[1:] if field.startswith("shared_w") else shape  # the engine's shared expert has no E axis
            if dtype == np.uint8:
                t = torch.full(shape, E8M0_ONE if field.endswith("_scale") else 0, dtype=torch.uint8)
            elif dtype == np.int32:
                t = torch.from_numpy(self.expert_map.copy())
            elif field == "score_bias":  # the routing's correction bias stays fp32, as checkpoints hold it
                t = torch.zeros(shape, dtype=torch.float32)
            else:
                t = torch.zeros(shape, dtype=params_dtype)
            layer.register_parameter(VLLM_NAMES[field], nn.Parameter(t, requires_grad=False))

    # ---------------------------------------------------------------------------------- 2-3. convert once
    def _loaded_weights(self, layer: nn.Module) -> MoEWeights:
        """The layer's loaded parameters as logical MXFP4 weights (floats as fp32)."""
        fields = {}
        for field, name in VLLM_NAMES.items():
            if field.startswith("router"):
                continue
            p = getattr(layer, name, None)
            if p is None:
                fields[field] = None
                continue
            a = to_numpy(p)
            a = a.astype(np.float32) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a
            fields[field] = a[None] if field.startswith("shared_w") else a
        return MoEWeights(self.config, None, None, **fields)

    def template(self, layer: nn.Module):
        """The compiled module (without weights) ``layer`` binds to: compiled, or read from ``$MXMOE_TEMPLATES``,
        where it is also written; a build machine with the compiler but no GPU can so write a model's templates
        for serving machines without the compiler (docs/interface.md)."""
        return layer_template(self._loaded_weights(layer), self.params_dtype, self.target, self.entries,
                              self.compile_options)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert the loaded parameters to the target's layout and bind them to the compiled module (compiled
        once per layer shape and target, shared by every layer of that shape)."""
        layer._mxmoe_module = bind_layer(self._loaded_weights(layer), self.params_dtype, self.target, self.entries,
                                         self.compile_options)
        layer._mxmoe_device = next((p.device for p in layer.parameters()), torch.device("cpu"))
        layer._mxmoe_reserved = False
        if self.max_capture_size is not None:
            # CUDA-graph capture (cuda targets): every entry's scratch for up to max_capture_size tokens allocated
            # now, so apply / apply_monolithic allocate nothing and read nothing back to the host
            for ex in {id(e): e for e in self._executors(layer._mxmoe_module)}.values():
                if hasattr(ex, "reserve"):
                    ex.reserve(self.max_capture_size)
                    layer._mxmoe_reserved = True

    @staticmethod
    def _executors(mod) -> list:
        ex = mod.executor
        return list(getattr(ex, "entries", {}).values()) or [ex]

    # ---------------------------------------------------------------------------------- 4. apply
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
        """Modular: ``x`` [T, H], the engine's ``topk_weights`` [T, k] (fp32) and global ``topk_ids`` [T, k]
        (int32/int64); with ``shared_experts_input`` the shared expert's output on it is added (fused when it is
        ``x`` itself), without it the shared expert is skipped (the engine runs it elsewhere).

        With ``max_capture_size`` (cuda targets) a call of up to that many tokens allocates nothing and never
        synchronises with the host (given int32 ids and fp32 weights, and H a multiple of the padding), so it can be
        captured in a CUDA graph and replayed with new inputs; inside a capture the output is the module's own
        buffer (valid until the next call), outside one a copy."""
        mod = self._module(layer)
        xp = self._pad(x)
        ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
        w = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
        if not self.shared_intermediate_size or shared_experts_input is None:
            out = mod.entry("modular_routed" if self.shared_intermediate_size else "modular")(xp, w, ids)
        elif shared_experts_input is x:
            out = mod.entry("modular")(xp, w, ids)
        else:
            routed = mod.entry("modular_routed")(xp, w, ids)
            routed = routed.clone() if getattr(layer, "_mxmoe_reserved", False) else routed
            out = routed + mod.entry("shared")(self._pad(shared_experts_input))
            return self._unpad(out)
        return self._own(layer, self._unpad(out))

    def apply_monolithic(self, layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Monolithic: ``x`` [T, H] and the router's logits [T, E_global]; the routing runs inside."""
        return self._own(layer, self._unpad(self._module(layer).entry("monolithic")(self._pad(x), router_logits)))

    # ---------------------------------------------------------------------------------- helpers
    def _module(self, layer: nn.Module):
        mod = getattr(layer, "_mxmoe_module", None)
        if mod is None:
            raise RuntimeError("Mxfp4MoEMethod: call process_weights_after_loading(layer) before apply")
        return mod

    @staticmethod
    def _own(layer: nn.Module, y: torch.Tensor) -> torch.Tensor:
        """``y`` as the caller may keep it: a module with reserved scratch returns views of it, which the next call
        overwrites; those are copied unless a CUDA graph is being captured (a graph wants the fixed buffer)."""
        if getattr(layer, "_mxmoe_reserved", False) and not (y.is_cuda and torch.cuda.is_current_stream_capturing()):
            return y.clone()
        return y

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"Mxfp4MoEMethod: hidden states must be [T, {self.hidden_size}], got {tuple(x.shape)}")
        if self.hidden_padded == self.hidden_size:
            return x
        return torch.nn.functional.pad(x, (0, self.hidden_padded - self.hidden_size))

    def _unpad(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.hidden_padded == self.hidden_size else y[:, : self.hidden_size]
