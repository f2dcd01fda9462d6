"""Hugging Face checkpoints of transformers' MoE families, read without torch: each family's ``config.json`` as the
:class:`~mxmoe.core.config.MoEConfig` of its MoE layers, and a layer's router, experts and shared expert as
:class:`~mxmoe.core.weights.MoEWeights`, the experts quantized to MXFP4 **while streaming**: one expert tensor at a
time is read from the memory-mapped shard, converted and quantized (``mxmoe.core.mxfp4.quantize``, the OCP
recipe), so a checkpoint's bf16 experts never sit in RAM at once (a 30B model's layer needs one expert's floats).

Families (``model_type`` in config.json): ``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe``, ``deepseek_v3``,
``glm4_moe``, ``llama4`` (its text model) and ``gpt_oss`` (float experts here; MXFP4 ones through
``mxmoe.core.checkpoint.read_hf_gpt_oss``, taken as they are). Tensor names are the checkpoints' own:
per-expert ``experts.{e}.gate_proj/up_proj/down_proj.weight`` (Mixtral: ``w1``/``w3``/``w2``), or fused
``experts.gate_up_proj``/``down_proj`` (gpt-oss, Llama-4, and transformers-5 style fused ones), under any root
(``model.``, ``language_model.model.``...). DeepSeek-V3's FP8 checkpoints (``weight_scale_inv`` in 128x128
blocks) are dequantized block by block on the way. The shared expert keeps the checkpoint's bf16 values
(``shared_format="bf16"``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from mxmoe.core import mxfp4
from mxmoe.core.config import MXFP4_BLOCK, MoEConfig
from mxmoe.core.weights import MoEWeights

__all__ = ["FAMILIES", "hf_model_type", "read_hf_moe_config", "hf_moe_layer_indices", "read_hf_moe", "HFLayerNames"]

#: model_type -> what the family is called in messages
FAMILIES = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE (Qwen1.5-MoE)", "qwen3_moe": "Qwen3-MoE", "olmoe": "OLMoE",
            "deepseek_v3": "DeepSeek-V3", "glm4_moe": "GLM-4 MoE", "llama4": "Llama-4", "llama4_text": "Llama-4",
            "gpt_oss": "gpt-oss"}
_BLOCKS = ("mlp", "block_sparse_moe", "feed_forward")
_ROUTER = re.compile(r"^(?P<root>.*?)layers\.(?P<layer>\d+)\.(?P<block>" + "|".join(_BLOCKS) + r")\.(gate|router)\.weight$")
FP8_BLOCK = 128
#: the names config.json files give the routed experts' count (transformers 5 writes the config class's own)
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")


def _config_json(ckpt_dir) -> tuple[Path, dict]:
    path = Path(ckpt_dir) / "config.json"
    try:
        return path, json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: not found") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def hf_model_type(ckpt_dir) -> str:
    """The ``model_type`` of a checkpoint directory's config.json (gpt_oss when it has none, as older ones)."""
    return _config_json(ckpt_dir)[1].get("model_type", "gpt_oss")


def _text(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def _need(path: Path, cfg: dict, *keys: str):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    raise ValueError(f"{path}: missing key {' or '.join(keys)}")


def _activation(path: Path, cfg: dict) -> str:
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{path}: hidden_act {act!r}: mxmoe reads {FAMILIES.get(cfg.get('model_type'), '')} "
                         "checkpoints with SiLU-GLU experts only")
    return "silu"


def read_hf_moe_config(ckpt_dir) -> MoEConfig:
    """The MoEConfig of a checkpoint's MoE layers (router, routing, experts, shared expert), from config.json."""
    path, full = _config_json(ckpt_dir)
    mtype = full.get("model_type", "gpt_oss")
    cfg = _text(full)
    if mtype not in FAMILIES:
        raise ValueError(f"{path}: model_type {mtype!r} is not a family mxmoe reads checkpoints of "
                         f"(known: {', '.join(FAMILIES)})")
    h = _need(path, cfg, "hidden_size")
    common = dict(hidden=h, bias=False, router_bias=False, interleaved=False)
    try:
        if mtype == "gpt_oss":
            from mxmoe.core.checkpoint import read_hf_config

            return read_hf_config(ckpt_dir)
        if mtype == "mixtral":
            return MoEConfig(num_experts=_need(path, cfg, *_EXPERTS), top_k=_need(path, cfg, "num_experts_per_tok"),
                             intermediate=_need(path, cfg, "intermediate_size"), routing="softmax_topk", renormalize=True,
                             activation=_activation(path, cfg), **common)
        if mtype in ("qwen2_moe", "qwen3_moe", "olmoe"):
            inter = _need(path, cfg, "intermediate_size") if mtype == "olmoe" else _need(path, cfg, "moe_intermediate_size")
            shared = int(cfg.get("shared_expert_intermediate_size") or 0) if mtype == "qwen2_moe" else 0
            return MoEConfig(num_experts=_need(path, cfg, *_EXPERTS), top_k=_need(path, cfg, "num_experts_per_tok"),
                             intermediate=inter, routing="softmax_topk", renormalize=bool(cfg.get("norm_topk_prob", False)),
                             activation=_activation(path, cfg), shared_intermediate=shared, shared_gate=bool(shared),
                             shared_format="bf16" if shared else "mxfp4", **common)
        if mtype in ("deepseek_v3", "glm4_moe"):
            inter = _need(path, cfg, "moe_intermediate_size")
            n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
            if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
                raise ValueError(f"topk_method {cfg['topk_method']!r}: mxmoe reads the noaux_tc (sigmoid) routing only")
            return MoEConfig(num_experts=_need(path, cfg, *_EXPERTS), top_k=_need(path, cfg, "num_experts_per_tok"),
                             intermediate=inter, routing="sigmoid_topk", renormalize=bool(cfg.get("norm_topk_prob", True)),
                             n_group=n_group, topk_group=topk_group if n_group > 1 else 1,
                             routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)), score_bias=True,
                             router_fp32=True, activation=_activation(path, cfg),
                             shared_intermediate=inter * int(cfg.get("n_shared_experts") or 0),
                             shared_format="bf16" if cfg.get("n_shared_experts") else "mxfp4", **common)
        # llama4
        return MoEConfig(num_experts=_need(path, cfg, *_EXPERTS), top_k=_need(path, cfg, "num_experts_per_tok"),
                         intermediate=_need(path, cfg, "intermediate_size"), routing="topk_sigmoid",
                         apply_router_weight_on_input=True, activation=_activation(path, cfg),
                         shared_intermediate=_need(path, cfg, "intermediate_size"), shared_format="bf16", **common)
    except ValueError as exc:
        msg = str(exc)
        raise ValueError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None


# ============================================================================================ tensor names
@dataclass(frozen=True)
class HFLayerNames:
    """Where one MoE layer's tensors are in a checkpoint."""

    prefix: str            # e.g. "model.layers.3.mlp."
    router: str            # "gate" or "router"
    experts: str           # "per_expert", "fused" or "mxfp4"
    gate_up: tuple[str, str] = ("gate_proj", "up_proj")   # per-expert names of gate and up ("w1", "w3")
    down: str = "down_proj"
    shared: str | None = None      # "shared_expert" / "shared_experts"

    def expert(self, e: int, which: str) -> str:
        return f"{self.prefix}experts.{e}.{which}.weight"


def _index(ckpt_dir):
    from mxmoe.core.checkpoint import _Tensors

    return _Tensors(ckpt_dir)


def hf_moe_layer_indices(ckpt_dir, tensors=None) -> list[int]:
    """The layers whose MoE block (a router and experts) is in the checkpoint, ascending."""
    tensors = tensors or _index(ckpt_dir)
    names = tensors.names()
    prefixes = {m.group("root") + f"layers.{m.group('layer')}.{m.group('block')}.experts.": int(m.group("layer"))
                for n in names if (m := _ROUTER.match(n))}
    found = {layer for n in names for p, layer in prefixes.items() if n.startswith(p)}
    return sorted(found)


def layer_names(tensors, layer: int) -> HFLayerNames:
    names = set(tensors.names())
    found = [m for n in names if (m := _ROUTER.match(n)) and int(m.group("layer")) == layer]
    if not found:
        raise ValueError(f"{tensors.label}: no MoE router for layer {layer} (no ...layers.{layer}.mlp.gate.weight "
                         "or router.weight)")
    m = found[0]
    prefix = f"{m.group('root')}layers.{layer}.{m.group('block')}."
    router = m.group(4)
    under = [n for n in names if n.startswith(prefix)]
    shared = next((s for s in ("shared_expert", "shared_experts") if f"{prefix}{s}.gate_proj.weight" in names), None)
    if f"{prefix}experts.gate_up_proj_blocks" in names:
        return HFLayerNames(prefix, router, "mxfp4", shared=shared)
    if f"{prefix}experts.gate_up_proj" in names:
        return HFLayerNames(prefix, router, "fused", shared=shared)
    if f"{prefix}experts.0.w1.weight" in names:
        return HFLayerNames(prefix, router, "per_expert", ("w1", "w3"), "w2", shared)
    if f"{prefix}experts.0.gate_proj.weight" in names:
        return HFLayerNames(prefix, router, "per_expert", shared=shared)
    raise ValueError(f"{tensors.label}: layer {layer}'s experts are in no form mxmoe reads "
                     f"(found {sorted(under)[:6]}...)")


# ============================================================================================ reading
def _float(tensors, name: str) -> np.ndarray:
    """A float tensor as float32 (FP8 with its block scales dequantized): one tensor's worth of memory."""
    a = tensors.get([name])[name]
    if a.dtype.name.startswith("float8"):
        scale_name = name + "_scale_inv"
        if scale_name not in set(tensors.names()):
            raise ValueError(f"{tensors.label}: {name} is {a.dtype} without a {scale_name} (block scales)")
        s = tensors.get([scale_name])[scale_name].astype(np.float32)
        out = a.astype(np.float32)
        rows, cols = out.shape
        want = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
        if s.shape != want:
            raise ValueError(f"{tensors.label}: {scale_name} is {s.shape}, expected {want} for {name} {a.shape} in "
                             f"{FP8_BLOCK}x{FP8_BLOCK} blocks")
        out *= np.repeat(np.repeat(s, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[:rows, :cols]
        return out
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise ValueError(f"{tensors.label}: {name} is {a.dtype}, expected a float tensor")
    return a


def _check(name: str, a: np.ndarray, shape: tuple[int, ...]) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")


def read_hf_moe(ckpt_dir, layer: int, progress: Callable[[int], None] | None = None,
                config: MoEConfig | None = None) -> MoEWeights:
    """Layer ``layer``'s MoE block of a checkpoint directory, its experts quantized to MXFP4 one tensor at a time.

    ``progress(n)`` is called after each expert (a progress bar's ``update``). MXFP4 gpt-oss checkpoints are read
    as they are (``read_hf_gpt_oss``)."""
    config = config or read_hf_moe_config(ckpt_dir)
    tensors = _index(ckpt_dir)
    names = layer_names(tensors, layer)
    mtype = hf_model_type(ckpt_dir)
    if names.experts == "mxfp4":
        from mxmoe.core.checkpoint import read_hf_gpt_oss

        return read_hf_gpt_oss(ckpt_dir, layer)
    e, h, i = config.num_experts, config.hidden, config.intermediate
    b = MXFP4_BLOCK
    w13 = np.empty((e, 2 * i, h // 2), np.uint8)
    s13 = np.empty((e, 2 * i, h // b), np.uint8)
    w2 = np.empty((e, h, i // 2), np.uint8)
    s2 = np.empty((e, h, i // b), np.uint8)
    p = names.prefix
    if names.experts == "fused":
        gu_name, dn_name = f"{p}experts.gate_up_proj", f"{p}experts.down_proj"
        gu, dn = tensors.get([gu_name])[gu_name], tensors.get([dn_name])[dn_name]
        transposed = mtype in ("gpt_oss", "llama4", "llama4_text")
        _check(gu_name, gu, (e, h, 2 * i) if transposed else (e, 2 * i, h))
        _check(dn_name, dn, (e, i, h) if transposed else (e, h, i))
        for x in range(e):   # one expert's slice of the memory map at a time
            if transposed:  # [H, 2I] / [I, H]: quantized along axis 0, stored [2I, H/2] / [H, I/2]
                w13[x], s13[x] = _swap(mxfp4.quantize(gu[x], axis=0, name=f"{gu_name}[{x}]"))
                w2[x], s2[x] = _swap(mxfp4.quantize(dn[x], axis=0, name=f"{dn_name}[{x}]"))
            else:
                w13[x], s13[x] = mxfp4.quantize(gu[x], name=f"{gu_name}[{x}]")
                w2[x], s2[x] = mxfp4.quantize(dn[x], name=f"{dn_name}[{x}]")
            if progress:
                progress(1)
    else:
        gname, uname = names.gate_up
        for x in range(e):
            for which, rows in ((gname, slice(0, i)), (uname, slice(i, 2 * i))):
                n = names.expert(x, which)
                a = _float(tensors, n)
                _check(n, a, (i, h))
                w13[x, rows], s13[x, rows] = mxfp4.quantize(a, name=n)
            n = names.expert(x, names.down)
            a = _float(tensors, n)
            _check(n, a, (h, i))
            w2[x], s2[x] = mxfp4.quantize(a, name=n)
            if progress:
                progress(1)
    extra: dict[str, np.ndarray | None] = {"w13_bias": None, "w2_bias": None}
    router = f"{p}{names.router}.weight"
    rw = _float(tensors, router).astype(np.float32)
    _check(router, rw, (config.experts_routed, h))
    rb = None
    if config.router_bias:
        rb = _float(tensors, f"{p}{names.router}.bias").astype(np.float32)
        _check(f"{p}{names.router}.bias", rb, (config.experts_routed,))
    if config.bias:  # gpt-oss's float experts
        for field, name, shape in (("w13_bias", "gate_up_proj_bias", (e, 2 * i)), ("w2_bias", "down_proj_bias", (e, h))):
            extra[field] = _float(tensors, f"{p}experts.{name}").astype(np.float32)
            _check(f"{p}experts.{name}", extra[field], shape)
    if config.score_bias:
        sb = f"{p}{names.router}.e_score_correction_bias"
        extra["score_bias"] = _float(tensors, sb).astype(np.float32)
        _check(sb, extra["score_bias"], (config.experts_routed,))
    if config.shared_intermediate:
        if names.shared is None:
            raise ValueError(f"{tensors.label}: layer {layer} has no shared expert (config.json says it has one)")
        s = config.shared_intermediate
        sp = f"{p}{names.shared}."
        parts = {}
        for which, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
            a = _float(tensors, f"{sp}{which}.weight").astype(np.float32)
            _check(f"{sp}{which}.weight", a, shape)
            parts[which] = a
        extra["shared_w13"] = np.concatenate([parts["gate_proj"], parts["up_proj"]])[None]
        extra["shared_w2"] = parts["down_proj"][None]
        if config.shared_gate:
            gate = f"{p}shared_expert_gate.weight"
            extra["shared_gate_weight"] = _float(tensors, gate).astype(np.float32)
            _check(gate, extra["shared_gate_weight"], (1, h))
    return MoEWeights(config, router_weight=rw, router_bias=rb, w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, **extra)


def _swap(qs: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 quantized along axis 0 of a [K, N] array -> packed [N, K/2] and scales [N, K/32]."""
    q, s = qs
    return np.ascontiguousarray(q.T), np.ascontiguousarray(s.T)


def describe(ckpt_dir) -> str:
    """One line: the family and its MoE layer shape (for messages and progress bars)."""
    c = read_hf_moe_config(ckpt_dir)
    return (f"{FAMILIES.get(hf_model_type(ckpt_dir), '?')} E={c.num_experts} k={c.top_k} H={c.hidden} "
            f"I={c.intermediate}{f' shared={c.shared_intermediate}' if c.shared_intermediate else ''}")

