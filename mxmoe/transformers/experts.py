"""mxmoe as an experts implementation of transformers: the ``"mxmoe"`` entry of ``ExpertsInterface``, and
``quantize_experts`` / ``dequantize_experts``.

transformers calls an experts implementation with ``(experts_module, hidden_states [S, H], top_k_index [S, k],
top_k_weights [S, k])``: the family's router has already run (in torch); what is left is mxmoe's ``modular`` entry
(docs/interface.md). Each experts module is mapped once (:func:`mxmoe.torch_frontend.families.experts_spec`: its
flags, shapes and gate function, checked by running its own gate), its float weights quantized to MXFP4 and
bound to a module compiled once per distinct shape, top-k, dtype and target in the process (every layer of a model
shares it). Ids outside ``[0, E)`` (transformers' expert-parallel sentinel ``E``) contribute nothing.

After quantization an experts module holds no float weights (that is the memory MXFP4 saves): reading
``gate_up_proj`` raises an AttributeError that says so, and ``state_dict()`` refuses (saving it would drop the
experts); :func:`dequantize_experts` writes the exact dequantized floats back.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from mxmoe.core.weights import MoEWeights
from mxmoe.engine import layer_template, store_layer
from mxmoe.torch_frontend.families import (ExpertsSpec, Unsupported, experts_float_tensors, experts_spec,
                                           is_experts, quantize_experts_module, where)

__all__ = ["mxmoe_experts_forward", "quantize_experts", "dequantize_experts", "ExpertsReport", "QuantizedExperts",
           "SkippedModule", "target_for_device"]

_STATE_ATTR = "_mxmoe_experts"
_FLOAT_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
#: config attributes that hold a family's experts per token (the first one found)
_TOP_K_NAMES = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_topk", "top_k",
                "moe_k", "num_selected_experts")
_lock = threading.RLock()


def target_for_device(device: torch.device) -> str:
    """The mxmoe target for experts whose tensors are on ``device`` (cpu, or this CUDA GPU's arch)."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and not getattr(torch.version, "hip", None):
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:sm_{major}{minor}"
    raise ValueError(f"no mxmoe target for device {device}: mxmoe runs experts on cpu and NVIDIA cuda")


# ========================================================================================== state
@dataclass
class _State:
    """One experts module's MXFP4 weights and the compiled modules they are bound to."""

    spec: ExpertsSpec
    name: str
    cls: str                        # the module's class name (messages)
    target: Any                     # a compiler Target
    fields: dict                    # MoEWeights fields (logical MXFP4, padded sizes)
    stats: dict                     # quantization: exact, max_rel_error
    bound: dict = field(default_factory=dict)    # (top_k, dtype) -> the modular entry
    stored: tuple | None = None     # (stored forms, arrays): shared by every top_k / dtype (same shapes)

    def weights(self, top_k: int) -> MoEWeights:
        return MoEWeights(self.spec.config(top_k), None, None, **self.fields)

    def template(self, top_k: int, dtype: torch.dtype):
        """The modular entry's compiled module (without weights) for ``top_k`` and ``dtype``."""
        try:
            return layer_template(self.weights(top_k), dtype, self.target, ["modular"])
        except Exception as e:  # noqa: BLE001 - named and re-raised
            raise RuntimeError(f"{self.label}: compiling its experts (E={self.spec.num_experts}, "
                               f"H={self.spec.hidden}, I={self.spec.intermediate}, top_k={top_k}, {dtype}) for "
                               f"target {self.target.name} failed: {e}") from e

    def entry(self, top_k: int, dtype: torch.dtype):
        key = (top_k, dtype)
        found = self.bound.get(key)
        if found is None:
            weights = self.weights(top_k)
            template = self.template(top_k, dtype)
            forms = template.stored_forms
            if self.stored is None or self.stored[0] != forms:
                self.stored = (forms, store_layer(template, weights))
            found = self.bound[key] = template.with_parameters(self.stored[1]).bound().entry("modular")
        return found

    @property
    def label(self) -> str:
        return f"{self.cls} '{self.name}'" if self.name else self.cls


def _top_k_of(module: nn.Module) -> int | None:
    cfg = getattr(module, "config", None)
    for n in _TOP_K_NAMES:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


# ========================================================================================== float weights gone
_QUANTIZED_CLASSES: dict[type, type] = {}


def _quantized_class(cls: type) -> type:
    """``cls`` whose float expert weights, once removed, raise an AttributeError saying where they went."""
    if getattr(cls, "_mxmoe_original_class", None) is not None:
        return cls
    if cls not in _QUANTIZED_CLASSES:
        def __getattr__(self, name):
            if name in _FLOAT_NAMES and name in self.__dict__.get("_mxmoe_removed", ()):
                state = self.__dict__.get(_STATE_ATTR)
                raise AttributeError(
                    f"{state.label if state else type(self).__name__}: its float weights ({name}) were replaced by "
                    "MXFP4 (mxmoe.transformers.quantize_experts); run it with experts_implementation='mxmoe', or "
                    "call mxmoe.transformers.dequantize_experts(model) to have the (dequantized) floats back")
            return cls.__getattr__(self, name)

        _QUANTIZED_CLASSES[cls] = type(cls.__name__, (cls,), {
            "__getattr__": __getattr__, "_mxmoe_original_class": cls, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__})
    return _QUANTIZED_CLASSES[cls]


def _refuse_state_dict(module, *args, **kwargs):
    state = module.__dict__.get(_STATE_ATTR)
    raise RuntimeError(f"{state.label if state else type(module).__name__}: its experts hold MXFP4 weights only "
                       "(mxmoe.transformers.quantize_experts), so a state_dict would miss them; call "
                       "mxmoe.transformers.dequantize_experts(model) before saving")


def _remove_floats(module: nn.Module) -> None:
    removed = []
    for n in _FLOAT_NAMES:
        if n in module._parameters:
            del module._parameters[n]
            removed.append(n)
        elif n in module._buffers:
            del module._buffers[n]
            removed.append(n)
    module.__dict__["_mxmoe_removed"] = tuple(removed)
    module.__class__ = _quantized_class(type(module))
    module.__dict__["_mxmoe_sd_hook"] = module.register_state_dict_pre_hook(_refuse_state_dict)


def _restore_floats(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for n, t in tensors.items():
        if n in module._parameters or n in module.__dict__.get("_mxmoe_removed", ()):
            module._parameters.pop(n, None)
            module.register_parameter(n, nn.Parameter(t, requires_grad=False))
        else:
            with torch.no_grad():
                getattr(module, n).copy_(t)
    module.__dict__.pop("_mxmoe_removed", None)
    hook = module.__dict__.pop("_mxmoe_sd_hook", None)
    if hook is not None:
        hook.remove()
    original = getattr(type(module), "_mxmoe_original_class", None)
    if original is not None:
        module.__class__ = original


def _has_floats(module: nn.Module) -> bool:
    return isinstance(module._parameters.get("gate_up_proj", module._buffers.get("gate_up_proj")), torch.Tensor)


# ========================================================================================== quantize
def _quantize(module: nn.Module, name: str, target, keep_float: bool, progress: Callable | None = None) -> _State:
    spec = experts_spec(module, name)
    from mxmoe.compiler.targets import get_target

    target = get_target(target if target is not None else target_for_device(spec.device))
    fields, stats = quantize_experts_module(module, spec, progress)
    state = _State(spec, name, where(module), target, fields, stats)
    module.__dict__[_STATE_ATTR] = state
    if not keep_float:
        _remove_floats(module)
    return state


def _state_of(module: nn.Module) -> _State:
    state = module.__dict__.get(_STATE_ATTR)
    if state is None:
        with _lock:
            state = module.__dict__.get(_STATE_ATTR)
            if state is None:  # first call of a model loaded with experts_implementation="mxmoe": quantize now
                try:
                    state = _quantize(module, "", None, keep_float=False)
                except Unsupported as e:
                    raise Unsupported(e.where, e.reason + " (experts_implementation='mxmoe')") from None
    return state


# ========================================================================================== the implementation
def mxmoe_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """transformers' experts implementation ``"mxmoe"``: ``hidden_states`` [S, H] (or [..., H]), the router's
    ``top_k_index`` [S, k] and ``top_k_weights`` [S, k] -> the experts' weighted sum [S, H] in the input's dtype."""
    state = _state_of(self)
    spec = state.spec
    if hidden_states.shape[-1] != spec.hidden:
        raise ValueError(f"{state.label}: hidden states must be [..., {spec.hidden}], got {tuple(hidden_states.shape)}")
    if hidden_states.device.type != spec.device.type:
        raise ValueError(f"{state.label}: hidden states on {hidden_states.device}, its MXFP4 weights were bound for "
                         f"{spec.device} (quantize_experts(model, target=...) again after moving the model)")
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, spec.hidden)
    k = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1, k)
    w = top_k_weights.reshape(ids.shape[0], -1)
    if w.shape[1] != k and w.shape[1] == spec.num_experts:  # a router giving every expert's weight (older 5.x)
        w = w.gather(1, ids.clamp(0, spec.num_experts - 1).long())
    if ids.shape[0] != x.shape[0] or w.shape != ids.shape:
        raise ValueError(f"{state.label}: top_k_index {tuple(top_k_index.shape)} and top_k_weights "
                         f"{tuple(top_k_weights.shape)} must be [S, k] for {x.shape[0]} tokens")
    dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    if spec.hidden_padded != spec.hidden:
        x = torch.nn.functional.pad(x, (0, spec.hidden_padded - spec.hidden))
    entry = state.entry(k, dtype)
    y = entry(x.to(dtype), w.float(), ids.to(torch.int32))
    if spec.hidden_padded != spec.hidden:
        y = y[:, : spec.hidden]
    return y.to(hidden_states.dtype).reshape(shape)


# ========================================================================================== report
@dataclass(frozen=True)
class QuantizedExperts:
    """One experts module :func:`quantize_experts` quantized (or found already quantized)."""

    name: str
    cls: str
    num_experts: int
    hidden: int
    intermediate: int
    activation: str
    layout: str                  # "concatenated" or "interleaved" gate/up rows
    bias: bool
    dtype: str
    bytes_before: int            # its float expert weights (and biases)
    bytes_after: int             # MXFP4 values + scales (+ biases, kept in fp32)
    exact: bool                  # dequantizing gives the float weights back bit for bit (already MXFP4 values)
    max_rel_error: float         # max |dequantized - float| / max |float| over its weights
    action: str = "quantized"    # "quantized", or "kept" (it held MXFP4 weights already)


@dataclass(frozen=True)
class SkippedModule:
    name: str
    cls: str
    reason: str


@dataclass
class ExpertsReport:
    """What :func:`quantize_experts` did: modules quantized, skipped (with the reason), and the compiled shapes."""

    target: str
    modules: list[QuantizedExperts] = field(default_factory=list)
    skipped: list[SkippedModule] = field(default_factory=list)
    #: one entry per distinct compiled shape: {"config": MoEConfig, "dtype", "modules": count, "compile_s"}
    shapes: list[dict] = field(default_factory=list)

    @property
    def bytes_before(self) -> int:
        return sum(m.bytes_before for m in self.modules)

    @property
    def bytes_after(self) -> int:
        return sum(m.bytes_after for m in self.modules)

    def __len__(self) -> int:
        return len(self.modules)

    def __str__(self) -> str:
        mb = 2 ** 20
        lines = [f"mxmoe.transformers.quantize_experts: {len(self.modules)} experts modules to MXFP4 for target "
                 f"{self.target}, {len(self.skipped)} skipped; {self.bytes_before / mb:.1f} MiB -> "
                 f"{self.bytes_after / mb:.1f} MiB"]
        for m in self.modules:
            lines.append(f"  {m.name}: {m.cls} [{m.action}] E={m.num_experts} H={m.hidden} I={m.intermediate} "
                         f"{m.activation} {m.layout}{' +bias' if m.bias else ''} {m.dtype} "
                         f"{m.bytes_before / mb:.2f} -> {m.bytes_after / mb:.2f} MiB, "
                         + ("exact" if m.exact else f"max rel error {m.max_rel_error:.3g}"))
        for s in self.shapes:
            c = s["config"]
            lines.append(f"  compiled: E={c.num_experts} k={c.top_k} H={c.hidden} I={c.intermediate} {c.activation} "
                         f"{s['dtype']} for {s['modules']} module(s) in {s['compile_s']:.1f} s")
        lines += [f"  skipped {s.name}: {s.cls}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


def _entry_of(name: str, module: nn.Module, state: _State, action: str, bytes_before: int) -> QuantizedExperts:
    spec = state.spec
    after = sum(a.nbytes for a in state.fields.values() if a is not None)
    return QuantizedExperts(name, where(module), spec.num_experts, spec.hidden, spec.intermediate, spec.activation,
                            "interleaved" if spec.interleaved else "concatenated", spec.bias,
                            str(spec.dtype).replace("torch.", ""), bytes_before, after, state.stats["exact"],
                            state.stats["max_rel_error"], action)


def _looks_like_experts(module: nn.Module) -> bool:
    cls = type(module).__name__  # a shared expert (a dense MLP every token goes through) stays with torch
    return cls.endswith("Experts") and "Shared" not in cls and any(hasattr(module, n) for n in ("gate_up_proj", "gate_up_proj_blocks",
                                                                        "up_proj"))


def quantize_experts(model: nn.Module, target=None, *, keep_float: bool = False, compile: bool = True,  # noqa: A002
                     bind: bool = True, progress: bool | None = None) -> ExpertsReport:
    """Quantize the float weights of every experts module of ``model`` to MXFP4 in place (OCP recipe,
    ``mxmoe.core.mxfp4.quantize``), and compile the modular entry once per distinct shape for ``target`` (default:
    the weights' device: ``cpu`` or ``cuda:sm_XY``). Returns an :class:`ExpertsReport`.

    The model then runs its experts through mxmoe with ``model.set_experts_implementation("mxmoe")`` (or when loaded
    with ``experts_implementation="mxmoe"``); their float weights are freed unless ``keep_float``. Modules mxmoe
    cannot run are left as they are and listed in ``report.skipped`` with the reason. Float weights that are
    MXFP4 values already (an MXFP4 checkpoint loaded dequantized, e.g. gpt-oss) quantize exactly: ``exact`` says
    so. ``compile=False`` leaves compiling to the first call. ``bind=False`` compiles without binding the weights:
    on a machine without the target's device, to write the compiled templates a serving machine without the
    compiler reads (``$MXMOE_TEMPLATES``, docs/interface.md).
    """
    from mxmoe.compiler.targets import get_target

    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_experts: expected an nn.Module, got {type(model).__name__}")
    report = ExpertsReport(target=get_target(target).name if target is not None else "auto (the weights' device)")
    found = [(n, m) for n, m in model.named_modules() if is_experts(m) or _looks_like_experts(m)]
    bar = _progress_bar(progress, sum(int(getattr(m, "num_experts", 0) or 0) for _, m in found if is_experts(m)),
                        "quantizing experts")
    for name, module in found:
        if not is_experts(module):
            reason = ("not dispatched through transformers' ExpertsInterface"
                      + (" (Llama-4's experts: mxmoe.convert(model) replaces its whole MoE block)"
                         if type(module).__name__ == "Llama4TextExperts" else
                         " (transformers' own MXFP4 experts: load with Mxfp4Config(dequantize=True))"
                         if hasattr(module, "gate_up_proj_blocks") else ""))
            report.skipped.append(SkippedModule(name, type(module).__name__, reason))
            continue
        state = module.__dict__.get(_STATE_ATTR)
        if state is not None and not _has_floats(module):
            state.name = state.name or name
            report.modules.append(_entry_of(name, module, state, "kept", 0))
            continue
        before = sum(getattr(module, n).nbytes for n in _FLOAT_NAMES if isinstance(getattr(module, n, None),
                                                                                     torch.Tensor))
        try:
            with _lock:
                module.__dict__.pop(_STATE_ATTR, None)
                state = _quantize(module, name, target, keep_float, bar.update if bar else None)
        except Unsupported as e:
            report.skipped.append(SkippedModule(name, where(module), e.reason))
            continue
        if report.target.startswith("auto"):
            report.target = state.target.name
        report.modules.append(_entry_of(name, module, state, "quantized", before))
    if bar is not None:
        bar.close()
    if compile:
        _compile_shapes(model, report, bind)
    return report


def _compile_shapes(model: nn.Module, report: ExpertsReport, bind: bool = True) -> None:
    """Compile (and bind, unless not ``bind``) every quantized module whose top-k its config gives, once per
    distinct shape."""
    seen: dict[tuple, dict] = {}
    for name, module in model.named_modules():
        state = module.__dict__.get(_STATE_ATTR)
        k = _top_k_of(module)
        if state is None or k is None or k > state.spec.num_experts:
            continue
        dtype = state.spec.dtype if state.spec.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        key = (state.spec.config(k), dtype, state.target)
        t0 = time.perf_counter()
        if bind:
            state.entry(k, dtype)
        else:
            state.template(k, dtype)
        if key not in seen:
            seen[key] = {"config": key[0], "dtype": str(dtype).replace("torch.", ""), "modules": 0, "compile_s": 0.0}
            report.shapes.append(seen[key])
        seen[key]["modules"] += 1
        seen[key]["compile_s"] += time.perf_counter() - t0


def _progress_bar(progress: bool | None, total: int, what: str):
    if progress is False or total == 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=what, unit="expert", disable=None if progress is None else not progress,
                leave=False)


def dequantize_experts(model: nn.Module) -> list[QuantizedExperts]:
    """Write the exact dequantized MXFP4 weights back into every quantized experts module of ``model`` (their own
    names, orientation, dtype and device), so the eager implementation computes with what mxmoe computes with (and
    a user can see what quantization did). The MXFP4 weights stay: ``experts_implementation="mxmoe"`` still runs
    them. Returns the modules written back."""
    out = []
    for name, module in model.named_modules():
        state = module.__dict__.get(_STATE_ATTR)
        if state is None:
            continue
        tensors = experts_float_tensors(state.weights(1), state.spec)
        _restore_floats(module, tensors)
        out.append(_entry_of(name, module, state, "dequantized", sum(t.nbytes for t in tensors.values())))
    return out


def quantized_state(module: nn.Module) -> _State | None:
    """The MXFP4 state of an experts module (None if it was never quantized); for tests and tools."""
    return module.__dict__.get(_STATE_ATTR)
