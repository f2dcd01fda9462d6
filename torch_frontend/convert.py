"""``convert(model)``: swap the MoE blocks of a model for mxmoe layers, in place, in one call.

Recognised blocks:

* the MoE blocks of transformers' common families (``mxmoe.torch_frontend.families.BLOCK_RETURNS``: Mixtral, MiniMax,
  Qwen2/Qwen3/Qwen3-Next MoE, OLMoE, FlexOlmo, DeepSeek-V3, GLM-4 MoE, dots1, Granite MoE, Llama-4): router, experts
  and shared expert (with its gate) become one :class:`HFMoEBlock`, the experts quantized to MXFP4 (the shared
  expert kept in the checkpoint's bf16), the router checked by running it (docs/routing.md says which routing each
  maps to). Its forward returns what the block's returned (the hidden states, or with Llama-4 also the router
  logits).
* transformers gpt-oss ``GptOssMLP`` (class name ``GptOssMLP`` with a ``router`` and ``experts``):
  float experts (bf16/fp16/fp32 ``gate_up_proj``/``down_proj``) are quantized to MXFP4 on the way;
  experts already holding MXFP4 blocks/scales (``gate_up_proj_blocks``/``..._scales``, the HF
  checkpoint layout) are taken as they are. The replacement is a :class:`GptOssMoE`, a drop-in:
  ``forward(hidden_states [B, S, H]) -> (hidden_states [B, S, H], router_scores [B*S, top_k])`` exactly as
  ``GptOssMLP.forward`` returns in transformers 5.x (``router_scores`` in the activation dtype).
* mxmoe's own :class:`~mxmoe.torch_frontend.moe.MoE`: left as it is (reported as ``kept``).

Anything else is left alone. Recognised blocks that cannot be converted (for instance transformers'
``Mxfp4GptOssMLP`` whose weights were swizzled into triton_kernels tensors) are left alone and reported
under ``skipped`` with the reason. transformers is never imported here: recognition is by class name
and attributes, so conversion costs nothing for models that do not use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from mxmoe.torch_frontend.moe import MoE

__all__ = ["convert", "ConversionReport", "Replacement", "GptOssMoE", "HFMoEBlock"]

#: class names of transformers' gpt-oss MoE blocks (the MXFP4 one is recognised only to say why it is skipped)
_GPT_OSS_MLP = "GptOssMLP"
_GPT_OSS_MXFP4_MLP = "Mxfp4GptOssMLP"


class GptOssMoE(MoE):
    """An mxmoe MoE layer with transformers ``GptOssMLP``'s call signature (drop-in replacement).

    Returns ``(hidden_states, router_scores)``: the first with the input's shape, the second ``[tokens, top_k]``
    softmax weights of the chosen experts in the activation dtype, as transformers 5.x does (the decoder
    layer discards it). transformers' ``output_router_logits`` records the router's logits through hooks on
    ``GptOssTopKRouter``, which no longer exists after conversion: those outputs are not produced.
    """

    def forward(self, hidden_states: torch.Tensor):  # type: ignore[override]
        out, weights = self.forward_with_routing(hidden_states)
        return out, weights.to(hidden_states.dtype)


class HFMoEBlock(MoE):
    """An mxmoe MoE layer standing in for a transformers MoE block (router + experts + shared expert): ``forward``
    returns what the block's forward returned (``returns``: "tensor", or "logits": ``(hidden_states, router_logits)``
    as Llama-4's ``Llama4TextMoe``). transformers' ``output_router_logits`` hooks on the router module are gone with
    it: those outputs are not produced."""

    def __init__(self, weights, dtype: torch.dtype = torch.bfloat16, returns: str = "tensor", source: str = ""):
        super().__init__(weights, dtype=dtype)
        self.returns, self.source = returns, source

    def forward(self, hidden_states: torch.Tensor):  # type: ignore[override]
        out = super().forward(hidden_states)
        if self.returns == "logits":
            return out, torch.nn.functional.linear(self._tokens(hidden_states), self.router_weight)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, from={self.source}"


@dataclass(frozen=True)
class Replacement:
    """One block ``convert`` replaced (or kept, or skipped)."""

    name: str                 # qualified module name in the model ("" for the root)
    source: str               # class name of the block found
    target: str               # class name of what is there now
    action: str               # "quantized" (float -> MXFP4), "mxfp4" (weights taken as is), "kept", "skipped"
    num_experts: int = 0
    top_k: int = 0
    hidden: int = 0
    intermediate: int = 0
    dtype: str = ""
    reason: str = ""          # why a recognised block was skipped

    def describe(self) -> str:
        where = self.name or "<root>"
        if self.action == "skipped":
            return f"{where}: {self.source} skipped ({self.reason})"
        return (f"{where}: {self.source} -> {self.target} [{self.action}] experts={self.num_experts} "
                f"top_k={self.top_k} hidden={self.hidden} intermediate={self.intermediate} dtype={self.dtype}")


@dataclass
class ConversionReport:
    """What :func:`convert` did: ``replaced`` (new mxmoe layers), ``kept`` (already mxmoe), ``skipped``."""

    replaced: list[Replacement] = field(default_factory=list)
    kept: list[Replacement] = field(default_factory=list)
    skipped: list[Replacement] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.replaced)

    def __str__(self) -> str:
        lines = [f"mxmoe.convert: {len(self.replaced)} replaced, {len(self.kept)} kept, {len(self.skipped)} skipped"]
        lines += ["  " + r.describe() for r in (*self.replaced, *self.kept, *self.skipped)]
        return "\n".join(lines)


def _entry(name: str, src: nn.Module, dst: MoE, action: str) -> Replacement:
    c = dst.config
    return Replacement(name, type(src).__name__, type(dst).__name__, action, c.num_experts, c.top_k, c.hidden,
                       c.intermediate, str(dst.dtype).replace("torch.", ""))


def _device_of(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def _convert_gpt_oss(module: nn.Module, dtype: Optional[torch.dtype]) -> tuple[GptOssMoE, str]:
    from mxmoe.torch_frontend.transformers_compat import is_gpt_oss_mlp

    if not is_gpt_oss_mlp(module):
        raise ValueError("has no router/experts with gate_up_proj weights")
    experts = module.experts
    if hasattr(experts, "gate_up_proj_blocks"):
        action = "mxfp4"
    else:
        w = experts.gate_up_proj
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 3:
            raise ValueError(f"gate_up_proj is not a float [E, H, 2I] tensor ({type(w).__name__} "
                             f"{getattr(w, 'dtype', '')}); swizzled or packed experts are not supported")
        if w.device.type == "meta":
            raise ValueError("weights are on the meta device (load the model's weights first)")
        action = "quantized"
    new = GptOssMoE.from_transformers(module, dtype=dtype)
    return new.to(_device_of(module)), action


def _convert_block(module: nn.Module, dtype: Optional[torch.dtype]) -> tuple[HFMoEBlock, str]:
    from mxmoe.torch_frontend.families import block_spec

    spec = block_spec(module, dtype)
    new = HFMoEBlock(spec.weights, dtype=spec.dtype, returns=spec.returns, source=type(module).__name__)
    return new.to(_device_of(module)), "mxfp4" if spec.quantization["exact"] else "quantized"


def convert(model: nn.Module, *, dtype: Optional[torch.dtype] = None) -> ConversionReport:
    """Replace every recognised MoE block of ``model`` by an mxmoe layer, in place; return the report.

    ``dtype`` overrides the activation dtype of the new layers (default: the block's own weight dtype).
    The root module itself cannot be replaced in place: wrap it, or use ``GptOssMoE.from_transformers``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: expected an nn.Module, got {type(model).__name__}")
    report = ConversionReport()
    name_of_root = type(model).__name__
    if name_of_root in (_GPT_OSS_MLP, _GPT_OSS_MXFP4_MLP):
        raise ValueError(f"convert: the root module is itself a {name_of_root}; it cannot be replaced in place "
                         "(wrap it in a parent module, or use mxmoe.torch_frontend.GptOssMoE.from_transformers)")
    # Collect first, replace after: replacing while iterating named_modules would walk the new layers.
    found: list[tuple[str, nn.Module]] = []
    from mxmoe.torch_frontend.families import BLOCK_RETURNS

    known = (_GPT_OSS_MLP, _GPT_OSS_MXFP4_MLP, *BLOCK_RETURNS)
    if name_of_root in BLOCK_RETURNS:
        raise ValueError(f"convert: the root module is itself a {name_of_root}; it cannot be replaced in place "
                         "(wrap it in a parent module, or use mxmoe.torch_frontend.MoE.from_transformers)")
    for name, mod in model.named_modules():
        if isinstance(mod, MoE):
            report.kept.append(_entry(name, mod, mod, "kept"))
        elif type(mod).__name__ in known and not any(name.startswith(p + ".") for p, _ in found):
            found.append((name, mod))
    for name, mod in found:
        cls = type(mod).__name__
        try:
            if cls == _GPT_OSS_MXFP4_MLP:
                raise ValueError("transformers' triton_kernels MXFP4 layer holds swizzled weights; load the "
                                 "model with Mxfp4Config(dequantize=True) or from float weights instead")
            if cls == _GPT_OSS_MLP:
                new, action = _convert_gpt_oss(mod, dtype)
            else:
                new, action = _convert_block(mod, dtype)
        except ValueError as e:
            report.skipped.append(Replacement(name, cls, cls, "skipped", reason=str(e)))
            continue
        model.set_submodule(name, new)
        report.replaced.append(_entry(name, mod, new, action))
    return report
