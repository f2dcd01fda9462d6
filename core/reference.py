"""The MoE reference in numpy, for checking a loaded artifact where torch is not installed (``mxmoe run
--check`` on a torch-free deploy box; with torch, the CLI uses ``mxmoe.torch_frontend.MoE`` itself).

It follows ``mxmoe.torch_frontend.ops`` step by step, rounding to the activation dtype
where the ops do: router logits (linear in the activation dtype), each grouped matmul's output, the GLU
output and the combined result; everything in between is fp32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from mxmoe.core import mxfp4
from mxmoe.core.config import MoEConfig
from mxmoe.core.weights import MoEWeights


def weights_from_parameters(model: dict, logical: Mapping[str, np.ndarray]) -> MoEWeights:
    """MoEWeights (biases and router as fp32) from an artifact's logical parameter arrays."""
    cfg = MoEConfig.from_dict(model["config"])
    fields = {}
    for field, param in model["parameters"].items():
        a = np.asarray(logical[param])
        # copies: the arrays may be read-only views of a memory-mapped artifact
        fields[field] = a.astype(np.float32) if (a.dtype.kind == "f" or a.dtype.name == "bfloat16") else a.copy()
    for f in ("router_weight", "router_bias", "w13_bias", "w2_bias"):
        fields.setdefault(f, None)
    return MoEWeights(cfg, **fields)


def _round(a: np.ndarray, dt: np.dtype) -> np.ndarray:
    return a.astype(dt).astype(np.float32)


def numpy_reference(weights: MoEWeights, x: np.ndarray, activation_dtype: np.dtype, *, entry: str = "layer",
                    router_logits: np.ndarray | None = None, topk_weights: np.ndarray | None = None,
                    topk_ids: np.ndarray | None = None, shared: bool = True, activations: str = "bf16",
                    mx_fold: str = "block", glu_output: np.ndarray | None = None, return_glu: bool = False):
    """The reference MoE in numpy; returns float32 of ``x``'s shape ([T, H] or [B, S, H]).

    ``entry``: "layer" (the layer's own router), "monolithic" (``router_logits`` [T, E_global]) or "modular"
    (``topk_weights`` [T, k] and global ``topk_ids`` [T, k]). ``shared=False`` leaves the shared expert out (an
    engine may run it elsewhere). ``activations="mxfp8"``: what a module compiled with that option computes: every
    MXFP4 matmul reads its activations quantized to MXFP8 (``mxfp4.mxfp8_round_trip``). With it, ``mx_fold="row"``
    is what the cuda:sm_90 form computes: each activation row on its largest scale (``mxfp4.mxfp8_row_round_trip``)
    and the routed experts' weight groups far under their row's largest scale read as zeros
    (``mxfp4.drop_far_groups``). ``activations="mxint8"``: the cpu target's int8 form, every MXFP4 matmul reads its
    activations quantized to MXINT8 (``mxfp4.mxint8_round_trip``); ``"mxint16"`` its two-plane form
    (``mxfp4.mxint16_round_trip``).

    ``return_glu``: return (output, the GLU output [T, k, I] as the second GEMM reads it before quantizing).
    ``glu_output`` [T, k, I]: use it instead of computing it, to check a module's second GEMM apart from its first:
    with MXFP8 activations a GLU value within rounding of an e4m3 step boundary lands on either side, and the
    second GEMM multiplies that step (1/16-1/8 of the value) into every output."""
    quants = {"bf16": lambda a: a, "mxint8": mxfp4.mxint8_round_trip, "mxint16": mxfp4.mxint16_round_trip,
              "mxfp8": mxfp4.mxfp8_row_round_trip if mx_fold == "row" else mxfp4.mxfp8_round_trip}
    if activations not in quants:
        raise ValueError(f"activations must be one of {', '.join(map(repr, quants))}, got {activations!r}")
    if mx_fold not in ("block", "row") or (mx_fold == "row" and activations != "mxfp8"):
        raise ValueError(f"mx_fold must be 'block', or 'row' with activations='mxfp8', got {mx_fold!r}")
    quant = quants[activations]
    if mx_fold == "row":
        weights = dataclasses.replace(weights, w13=mxfp4.drop_far_groups(weights.w13, weights.w13_scale),
                                      w2=mxfp4.drop_far_groups(weights.w2, weights.w2_scale))
    cfg, dt = weights.config, np.dtype(activation_dtype)
    shape = x.shape
    xs = _round(np.asarray(x, dtype=np.float32).reshape(-1, cfg.hidden), dt)
    if entry == "modular":
        w, ids = np.asarray(topk_weights, np.float32).reshape(-1, cfg.top_k), np.asarray(topk_ids).reshape(-1, cfg.top_k)
    else:
        # the router's dtype: the activation dtype, or fp32 (its logits are not rounded) with router_fp32
        rdt = np.dtype(np.float32) if cfg.router_fp32 else dt
        if entry == "layer":
            logits = xs @ _round(weights.router_weight, dt).T
            if weights.router_bias is not None:
                logits = logits + _round(weights.router_bias, dt)
        elif entry == "monolithic":
            logits = np.asarray(router_logits, np.float32).reshape(-1, cfg.experts_routed)
        else:
            raise ValueError(f"unknown entry {entry!r}")
        w, ids = route(_round(logits, rdt), cfg, weights.score_bias)
    ids = local_ids(ids, cfg, weights.expert_map)
    if cfg.apply_router_weight_on_input:
        x_in = _round(xs[:, None, :] * _round(w, dt)[..., None], dt)       # [T, 1, H]
        w = np.ones_like(w)
    else:
        x_in = xs
    h = _grouped(quant(x_in), ids, weights.w13, weights.w13_scale, weights.w13_bias, dt)      # [T, k, 2I]
    a = _round(glu(h, cfg, cfg.interleaved), dt)
    if glu_output is not None:
        a = _round(np.asarray(glu_output, np.float32).reshape(a.shape), dt)
    y = _grouped(quant(a), ids, weights.w2, weights.w2_scale, weights.w2_bias, dt)            # [T, k, H]
    out = _round((y * w[..., None].astype(np.float32)).sum(axis=1), dt)
    if shared and cfg.shared_intermediate:
        out = _round(out + shared_expert(weights, xs, dt, quant), dt)
    return (out.reshape(shape), a) if return_glu else out.reshape(shape)


def route(logits: np.ndarray, cfg: MoEConfig, score_bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(weights f32 [T, k], ids [T, k]) from logits already rounded to the router's dtype: a stable descending
    sort, so ties go to the lower expert index (the routing contract, docs/routing.md). ``score_bias`` [E] is the
    correction bias of "sigmoid_topk" (added for choosing only)."""
    logits = np.asarray(logits, np.float32)
    k = cfg.top_k
    if cfg.routing == "topk_softmax":
        ids = _top_k(logits, k)
        w = _softmax(np.take_along_axis(logits, ids, axis=-1))
    elif cfg.routing == "topk_sigmoid":
        ids = _top_k(logits, k)
        w = _sigmoid(np.take_along_axis(logits, ids, axis=-1))
    elif cfg.routing == "sigmoid_topk":
        scores = _sigmoid(logits)
        choice = scores + np.asarray(score_bias, np.float32) if score_bias is not None else scores
        ids = _top_k(group_limited(choice, cfg.n_group, cfg.topk_group), k)
        w = np.take_along_axis(scores, ids, axis=-1)
        if cfg.renormalize:
            w = w / (_slot_sum(w) + np.float32(1e-20))
    else:
        probs = _softmax(logits)
        ids = _top_k(probs, k)
        w = np.take_along_axis(probs, ids, axis=-1)
        if cfg.renormalize:
            w = w / w.sum(-1, keepdims=True)
    if cfg.routed_scaling_factor != 1.0:
        w = w * np.float32(cfg.routed_scaling_factor)
    return w.astype(np.float32), ids


def _top_k(values: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-values, axis=-1, kind="stable")[:, :k]


def _slot_sum(w: np.ndarray) -> np.ndarray:
    """sum_j w[:, j] in f32, in slot order (the order every implementation adds them), keepdims."""
    acc = np.zeros((w.shape[0], 1), np.float32)
    for j in range(w.shape[1]):
        acc = acc + w[:, j:j + 1]
    return acc


def group_limited(choice: np.ndarray, n_group: int, topk_group: int) -> np.ndarray:
    """``choice`` [T, E] with the experts outside the ``topk_group`` best of ``n_group`` groups (consecutive
    experts) set to -inf; a group's score is the sum of its two largest values (the larger first), ties of groups
    to the lower group index."""
    if n_group == 1 or topk_group == n_group:
        return choice
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)
    top2 = -np.sort(-grouped, axis=-1)[..., :2]
    group_scores = top2[..., 0] + top2[..., 1]
    chosen = np.zeros((t, n_group), bool)
    np.put_along_axis(chosen, _top_k(group_scores, topk_group), True, axis=-1)
    return np.where(chosen[..., None], grouped, np.float32(-np.inf)).reshape(t, e).astype(np.float32)


def local_ids(ids: np.ndarray, cfg: MoEConfig, expert_map: np.ndarray | None) -> np.ndarray:
    """Global expert ids -> local ones; -1 for a pair that is not routed to an expert of this layer (its expert
    is on another rank, or its id is outside [0, global experts))."""
    ids = np.asarray(ids, dtype=np.int64)
    valid = (ids >= 0) & (ids < cfg.experts_routed)
    safe = np.where(valid, ids, 0)
    local = expert_map[safe] if expert_map is not None else safe
    return np.where(valid, local, -1).astype(np.int64)


def glu(h: np.ndarray, cfg: MoEConfig, interleaved: bool) -> np.ndarray:
    gate, up = (h[..., 0::2], h[..., 1::2]) if interleaved else np.split(h, 2, axis=-1)
    gate, up = gate.astype(np.float32), up.astype(np.float32)
    act = cfg.activation
    if act in ("swiglu_oai", "silu_clamped"):
        lim = np.float32(cfg.swiglu_limit)
        gate = np.minimum(gate, lim)
        up = np.clip(up, -lim, lim)
    if act == "swiglu_oai":
        return ((up + np.float32(1.0)) * (gate * _sigmoid(np.float32(cfg.swiglu_alpha) * gate))).astype(np.float32)
    if act == "gelu":
        return (up * gelu(gate)).astype(np.float32)
    if act == "gelu_tanh":
        return (up * gelu_tanh(gate)).astype(np.float32)
    return (up * (gate * _sigmoid(gate))).astype(np.float32)


def gelu(x: np.ndarray) -> np.ndarray:
    """The exact GELU ``x/2 * (1 + erf(x/sqrt(2)))`` in f32 (erf in f64, rounded: numpy has no erf)."""
    x = np.asarray(x, np.float32)
    z = (x * np.float32(1 / math.sqrt(2))).astype(np.float64)
    erf = np.frompyfunc(math.erf, 1, 1)(z).astype(np.float32)
    return (x * np.float32(0.5) * (np.float32(1.0) + erf)).astype(np.float32)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation ``x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))`` in f32."""
    x = np.asarray(x, np.float32)
    inner = np.float32(math.sqrt(2 / math.pi)) * (x + np.float32(0.044715) * x * x * x)
    return (np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))).astype(np.float32)


def shared_expert(weights: MoEWeights, xs: np.ndarray, dt: np.dtype, quant=None) -> np.ndarray:
    """The shared expert's output [T, H] (rounded to ``dt``): a GLU MLP (gate rows then up rows) whose output is
    rounded like a routed expert's, then optionally scaled by ``sigmoid(x @ shared_gate_weight^T)`` (the gate's
    logit rounded to ``dt`` as a linear layer in that dtype gives it, the product in fp32) and rounded again.
    ``quant``: applied to the inputs of MXFP4 matmuls (see ``numpy_reference``'s ``activations``)."""
    w13, w2 = weights.shared_dequantized()
    if weights.config.shared_format == "bf16":
        w13, w2 = _round(w13, dt), _round(w2, dt)
        quant = None
    quant = quant or (lambda v: v)
    a = _round(glu(_round(quant(xs) @ w13.T, dt), weights.config, interleaved=False), dt)
    y = _round(quant(a) @ w2.T, dt)
    if weights.shared_gate_weight is None:
        return y
    return _round(y * _sigmoid(_round(xs @ _round(weights.shared_gate_weight, dt).T, dt)), dt)


def _grouped(x: np.ndarray, ids: np.ndarray, w: np.ndarray, s: np.ndarray, bias, dt) -> np.ndarray:
    """Row (t, j): x[t] (or x[t, j]) @ dequant(w[ids[t, j]])^T + bias, rounded; 0 where ids[t, j] is -1."""
    t, k = ids.shape
    xs = x if x.ndim == 3 else np.broadcast_to(x[:, None, :], (t, k, x.shape[-1]))
    out = np.zeros((t, k, w.shape[1]), dtype=np.float32)
    for e in np.unique(ids):
        if e < 0:
            continue
        sel = ids == e
        we = mxfp4.dequantize(w[e], s[e])
        y = xs[sel] @ we.T
        if bias is not None:
            y = y + np.asarray(bias[e], dtype=np.float32)
        out[sel] = y
    return _round(out, dt)


def _softmax(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.float32)
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _sigmoid(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, np.float32)
    return (np.float32(1.0) / (np.float32(1.0) + np.exp(-a))).astype(np.float32)


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref|, in fp32 (the tolerance measure the tests and the CLI use)."""
    out, ref = np.asarray(out, dtype=np.float32), np.asarray(ref, dtype=np.float32)
    if not ref.size and out.shape == ref.shape:
        return 0.0  # an empty batch: nothing to differ
    return float(np.abs(out - ref).max() / max(float(np.abs(ref).max()), 1e-30))
