"""``MoE``: the reference MXFP4 MoE layer, written with the mxmoe custom ops.

Its forward is the plain-torch reference every compiled path is checked against, and the graph
torch.export captures from it is what the compiler consumes.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mxmoe.core.config import MoEConfig, preset
from mxmoe.torch_frontend import ops
from mxmoe.torch_frontend.mxfp4 import dequantize
from mxmoe.core.weights import MoEWeights

#: buffers kept as they are (packed MXFP4 bytes, e8m0 scales, the int32 expert map); the rest are floats held in the
#: activation dtype
_EXACT_NAMES = ("w13", "w13_scale", "w2", "w2_scale", "expert_map", "shared_w13_scale", "shared_w2_scale",
                "score_bias")
_FLOAT_NAMES = ("router_weight", "router_bias", "w13_bias", "w2_bias", "shared_gate_weight")


def route_tokens(config: MoEConfig, tokens: torch.Tensor, router_weight: torch.Tensor,
                 router_bias: Optional[torch.Tensor], score_bias: Optional[torch.Tensor]):
    """``(weights [T, k] fp32, ids [T, k])``: the layer's router on ``tokens`` [T, H] (DeepSeek-V3's router_fp32:
    fp32 products of the held weights, logits not rounded), then its routing. Shared by :class:`MoE` and the
    sharded layers of mxmoe.distributed, which hold the router without the experts."""
    logits = F.linear(tokens.float() if config.router_fp32 else tokens, router_weight, router_bias)
    return route_logits(config, logits, score_bias)


def route_logits(config: MoEConfig, logits: torch.Tensor, score_bias: Optional[torch.Tensor]):
    """``(weights [T, k] fp32, ids [T, k])`` of the router's ``logits`` [T, E_global] by the config's routing."""
    return ops.route(logits, config.top_k, config.routing, config.renormalize, score_bias, config.n_group,
                     config.topk_group, config.routed_scaling_factor)


class MoE(nn.Module):
    """An MXFP4 MoE layer (gpt-oss and its kind) with its expert weights held as uint8 buffers.

    Router weights and biases are held in the activation dtype (as gpt-oss checkpoints do); the
    custom ops add biases in fp32. Input ``[T, H]`` or ``[B, S, H]``; output has the same shape.

    Three entries, as serving engines call a fused MoE method (docs/interface.md): ``forward(x)`` (the layer's
    own router), ``monolithic(x, router_logits)`` and ``modular(x, topk_weights, topk_ids)`` (the engine's
    routing; ids are global expert ids). The config's expert map, router weight on input and shared expert
    apply to all three.
    """

    def __init__(self, weights: MoEWeights, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if not isinstance(weights, MoEWeights):
            raise TypeError(f"MoE: expected MoEWeights, got {type(weights).__name__} (build them with MoEWeights(...), "
                            "MoEWeights.from_numpy_dict(config, tensors) or MoE.random(config))")
        if dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise ValueError(f"MoE: activation dtype must be bfloat16, float16 or float32, got {dtype}")
        self.config: MoEConfig = weights.config
        self._dtype = dtype
        shared_float = self.config.shared_format == "bf16"
        buffers = {}
        for name in _EXACT_NAMES + _FLOAT_NAMES + ("shared_w13", "shared_w2"):
            v = getattr(weights, name)
            if v is None:
                buffers[name] = None
            elif name in _FLOAT_NAMES or (shared_float and name in ("shared_w13", "shared_w2")):
                buffers[name] = torch.from_numpy(np.asarray(v, dtype=np.float32)).to(dtype)
                if name in self._fp32_names():  # an fp32 router holds its (activation-dtype) values in fp32
                    buffers[name] = buffers[name].float()
            else:
                buffers[name] = torch.from_numpy(np.ascontiguousarray(v))
        # absent tensors last: torch.export (2.13) mis-numbers buffers after two or more None ones
        for name, t in sorted(buffers.items(), key=lambda kv: kv[1] is None):
            self.register_buffer(name, t)

    # ------------------------------------------------------------------------------- construction
    @classmethod
    def random(cls, config: MoEConfig | str, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> "MoE":
        """A layer with random MXFP4 weights (never all zero); ``config`` may be a preset name."""
        if isinstance(config, str):
            config = preset(config)
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoE.random: expected a MoEConfig or a preset name, got {type(config).__name__}")
        return cls(MoEWeights.random(config, seed=seed), dtype=dtype)

    @classmethod
    def from_transformers(cls, block: nn.Module, dtype: Optional[torch.dtype] = None) -> "MoE":
        """Build from a transformers MoE block: gpt-oss's ``GptOssMLP`` (MXFP4 blocks taken as they are), or the
        block of a common family (router + experts + shared expert: Mixtral, Qwen2/3 MoE, Qwen3-Next, OLMoE,
        DeepSeek-V3, GLM-4 MoE, dots1, Granite MoE, MiniMax, Llama-4; ``mxmoe.torch_frontend.families``). Float
        expert weights are quantized to MXFP4 here; a block mxmoe cannot express raises ValueError saying why."""
        from mxmoe.torch_frontend.families import BLOCK_RETURNS, block_spec
        from mxmoe.torch_frontend.transformers_compat import is_gpt_oss_mlp, weights_from_gpt_oss_mlp

        name = type(block).__name__
        if name != "GptOssMLP" and (name in BLOCK_RETURNS or not is_gpt_oss_mlp(block)):
            spec = block_spec(block, dtype)
            return cls(spec.weights, dtype=spec.dtype)
        weights, src_dtype = weights_from_gpt_oss_mlp(block)
        return cls(weights, dtype=dtype or src_dtype)

    @classmethod
    def from_hf_checkpoint(cls, path: str, layer: int, dtype: torch.dtype = torch.bfloat16,
                           progress: bool | None = None) -> "MoE":
        """Build from layer ``layer`` of a Hugging Face checkpoint directory: gpt-oss (MXFP4 blocks taken as they
        are), or a family of ``mxmoe.core.hf_checkpoint`` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GLM-4 MoE,
        Llama-4), whose bf16 (or FP8) experts are quantized to MXFP4 one tensor at a time, with a progress bar
        (``progress``: None shows it on a terminal)."""
        from mxmoe.core.checkpoint import read_hf_gpt_oss
        from mxmoe.core.hf_checkpoint import hf_model_type, read_hf_moe, read_hf_moe_config

        if hf_model_type(path) == "gpt_oss":
            try:
                return cls(read_hf_gpt_oss(path, layer), dtype=dtype)
            except ValueError as e:
                if "gate_up_proj_blocks" not in str(e):
                    raise  # float gpt-oss experts (a bf16 checkpoint) are read below
        config = read_hf_moe_config(path)
        bar = None
        if progress is not False:
            from tqdm.auto import tqdm

            bar = tqdm(total=config.num_experts, desc=f"layer {layer}: quantizing experts", unit="expert",
                       disable=None if progress is None else False, leave=False)
        try:
            weights = read_hf_moe(path, layer, progress=bar.update if bar is not None else None, config=config)
        finally:
            if bar is not None:
                bar.close()
        return cls(weights, dtype=dtype)

    def to_weights(self) -> MoEWeights:
        """The layer's weights as numpy (floats as fp32), e.g. to write a checkpoint or compile."""
        d = {}
        for n in _EXACT_NAMES + _FLOAT_NAMES + ("shared_w13", "shared_w2"):
            v = getattr(self, n)
            d[n] = None if v is None else (v.detach().float() if v.is_floating_point() else v).cpu().numpy()
        return MoEWeights(config=self.config, **d)

    def to_transformers(self) -> nn.Module:
        """A transformers ``GptOssMLP`` holding this layer's dequantized weights (for parity checks)."""
        from mxmoe.torch_frontend.transformers_compat import gpt_oss_mlp_from_weights

        return gpt_oss_mlp_from_weights(self.to_weights(), dtype=self.router_weight.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def _fp32_names(self) -> tuple[str, ...]:
        """Buffers held in fp32 whatever the activation dtype: the correction bias, and an fp32 router's weights."""
        return ("score_bias",) + (("router_weight", "router_bias") if self.config.router_fp32 else ())

    def _apply(self, fn, *args, **kwargs):  # .to(dtype) / .half() keep the activation dtype in step
        keep = {n: getattr(self, n) for n in self._fp32_names() if getattr(self, n, None) is not None}
        out = super()._apply(fn, *args, **kwargs)
        probe = fn(torch.empty(0, dtype=self._dtype))
        if isinstance(probe, torch.Tensor) and probe.is_floating_point():
            self._dtype = probe.dtype
        for n, t in keep.items():
            if getattr(self, n).dtype != torch.float32:
                setattr(self, n, t.to(getattr(self, n).device))
        return out

    def dequantized_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) in fp32."""
        return dequantize(self.w13, self.w13_scale), dequantize(self.w2, self.w2_scale)

    # ------------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with_routing(x)[0]

    def forward_with_routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output (``x``'s shape) and each token's top-k routing weights ``[T, k]`` (fp32)."""
        tokens = self._tokens(x)
        if self.router_weight is None:
            raise ValueError(f"{type(self).__name__}: this layer has no router (config.router is False); call "
                             "monolithic(x, router_logits) or modular(x, topk_weights, topk_ids)")
        weights, ids = self.route_tokens(tokens)
        return self._experts(tokens, weights, ids).reshape(x.shape), weights

    def route_tokens(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing weights and global ids of ``tokens`` [T, H] by the layer's own router."""
        return route_tokens(self.config, tokens, self.router_weight, self.router_bias, self.score_bias)

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route_logits(self.config, logits, self.score_bias)

    def monolithic(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The output for hidden states ``x`` and the router's logits ``[T, E_global]`` (the engine's router)."""
        cfg = self.config
        tokens = self._tokens(x)
        logits = router_logits.reshape(-1, router_logits.shape[-1])
        if tuple(logits.shape) != (tokens.shape[0], cfg.experts_routed):
            raise ValueError(f"{type(self).__name__}: router_logits must be [T, {cfg.experts_routed}] for "
                             f"{tokens.shape[0]} tokens, got {tuple(router_logits.shape)}")
        weights, ids = self._route(logits)
        return self._experts(tokens, weights, ids).reshape(x.shape)

    def modular(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared: bool = True) -> torch.Tensor:
        """The output for hidden states ``x`` and the engine's routing: ``topk_weights`` [T, k] (fp32) and global
        ``topk_ids`` [T, k] (int32/int64; an id outside [0, E_global) is skipped). ``shared=False`` leaves the
        shared expert out (an engine may run it elsewhere)."""
        cfg = self.config
        tokens = self._tokens(x)
        t = tokens.shape[0]
        if tuple(topk_weights.shape) != (t, cfg.top_k) or tuple(topk_ids.shape) != (t, cfg.top_k):
            raise ValueError(f"{type(self).__name__}: topk_weights and topk_ids must be [T, {cfg.top_k}] for {t} "
                             f"tokens, got {tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{type(self).__name__}: topk_ids must be int32 or int64, got {topk_ids.dtype}")
        ids = ops.map_experts(topk_ids, self.expert_map, cfg.experts_routed)
        return self._experts(tokens, topk_weights.float(), ids, mapped=True, shared=shared).reshape(x.shape)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        cfg, name = self.config, type(self).__name__
        if x.shape[-1] != cfg.hidden or x.dim() not in (2, 3):
            raise ValueError(f"{name}: input must be [T, {cfg.hidden}] or [B, S, {cfg.hidden}], got {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise ValueError(f"{name}: input dtype {x.dtype} does not match the layer's dtype {self.dtype}")
        return x.reshape(-1, cfg.hidden)

    def _experts(self, tokens: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, mapped: bool = False,
                 shared: bool = True) -> torch.Tensor:
        """The routed experts (and the shared one) for routed (weights, ids): global ids unless ``mapped``."""
        cfg = self.config
        if cfg.expert_parallel and not mapped:
            ids = ops.map_experts(ids, self.expert_map, cfg.experts_routed)
        x_in = tokens
        if cfg.apply_router_weight_on_input:
            x_in = ops.weight_rows(tokens, weights)
            weights = torch.ones_like(weights)
        h = ops.mxfp4_grouped_matmul(x_in, ids, self.w13, self.w13_scale, self.w13_bias)
        a = ops.glu(h, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit, cfg.interleaved)
        y = ops.mxfp4_grouped_matmul(a, ids, self.w2, self.w2_scale, self.w2_bias)
        out = ops.combine(y, weights)
        if shared and cfg.shared_intermediate:
            out = out + self._shared_expert(tokens)
        return out

    def _shared_expert(self, tokens: torch.Tensor) -> torch.Tensor:
        """The shared expert: a GLU MLP (gate rows then up rows) every token goes through, as one expert
        routed with weight 1 (or its sigmoid gate) so the compiled paths run it with the routed kernels."""
        cfg = self.config
        if cfg.shared_format == "bf16":
            h = F.linear(tokens, self.shared_w13[0])
            a = ops.glu(h, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit, False)
            y = F.linear(a, self.shared_w2[0])
            if self.shared_gate_weight is None:
                return y
            return (y.float() * torch.sigmoid(F.linear(tokens, self.shared_gate_weight).float())).to(tokens.dtype)
        ids = tokens.new_zeros((tokens.shape[0], 1), dtype=torch.int32)
        gate = (torch.sigmoid(F.linear(tokens, self.shared_gate_weight).float()) if self.shared_gate_weight is not None
                else tokens.new_ones((tokens.shape[0], 1), dtype=torch.float32))
        h = ops.mxfp4_grouped_matmul(tokens, ids, self.shared_w13, self.shared_w13_scale, None)
        a = ops.glu(h, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit, False)
        y = ops.mxfp4_grouped_matmul(a, ids, self.shared_w2, self.shared_w2_scale, None)
        return ops.combine(y, gate)

    def extra_repr(self) -> str:
        c = self.config
        return (f"experts={c.num_experts}, top_k={c.top_k}, hidden={c.hidden}, intermediate={c.intermediate}, "
                f"routing={c.routing}, activation={c.activation}, dtype={self.dtype}")
