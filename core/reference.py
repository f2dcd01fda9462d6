"""The MoE reference in numpy, for checking a loaded artifact where torch is not installed (``mxmoe run
--check`` on a torch-free deploy box; with torch, the CLI uses ``mxmoe.torch_frontend.MoE`` itself).

It follows ``mxmoe.torch_frontend.ops`` step by step, rounding to the activation dtype
where the ops do: router logits (linear in the activation dtype), each grouped matmul's output, the GLU
output and the combined result; everything in between is fp32.
"""

from __future__ import annotations

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
    for f in ("router_bias", "w13_bias", "w2_bias"):
        fields.setdefault(f, None)
    return MoEWeights(cfg, **fields)


def _round(a: np.ndarray, dt: np.dtype) -> np.ndarray:
    return a.astype(dt).astype(np.float32)


def numpy_reference(weights: MoEWeights, x: np.ndarray, activation_dtype: np.dtype) -> np.ndarray:
    """The reference MoE in numpy; ``x`` is [T, H] or [B, S, H]; returns float32 of the same shape."""
    cfg, dt = weights.config, np.dtype(activation_dtype)
    shape = x.shape
    xs = _round(np.asarray(x, dtype=np.float32).reshape(-1, cfg.hidden), dt)
    rw = _round(weights.router_weight, dt)
    logits = xs @ rw.T
    if weights.router_bias is not None:
        logits = logits + _round(weights.router_bias, dt)
    logits = _round(logits, dt)
    # route: stable descending sort, ties to the lower expert index
    if cfg.routing == "topk_softmax":
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, : cfg.top_k]
        w = _softmax(np.take_along_axis(logits, ids, axis=-1))
    else:
        probs = _softmax(logits)
        ids = np.argsort(-probs, axis=-1, kind="stable")[:, : cfg.top_k]
        w = np.take_along_axis(probs, ids, axis=-1)
        if cfg.renormalize:
            w = w / w.sum(-1, keepdims=True)
    h = _grouped(xs, ids, weights.w13, weights.w13_scale, weights.w13_bias, dt)        # [T, k, 2I]
    gate, up = (h[..., 0::2], h[..., 1::2]) if cfg.interleaved else np.split(h, 2, axis=-1)
    if cfg.activation == "swiglu_oai":
        gate = np.minimum(gate, cfg.swiglu_limit)
        up = np.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        a = (up + 1.0) * (gate * _sigmoid(cfg.swiglu_alpha * gate))
    else:
        a = up * (gate * _sigmoid(gate))
    a = _round(a.astype(np.float32), dt)
    y = _grouped(a, ids, weights.w2, weights.w2_scale, weights.w2_bias, dt)            # [T, k, H]
    out = _round((y * w[..., None].astype(np.float32)).sum(axis=1), dt)
    return out.reshape(shape)


def _grouped(x: np.ndarray, ids: np.ndarray, w: np.ndarray, s: np.ndarray, bias, dt) -> np.ndarray:
    t, k = ids.shape
    xs = x if x.ndim == 3 else np.broadcast_to(x[:, None, :], (t, k, x.shape[-1]))
    out = np.zeros((t, k, w.shape[1]), dtype=np.float32)
    for e in np.unique(ids):
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
    return (1.0 / (1.0 + np.exp(-a))).astype(np.float32)


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref|, in fp32 (the tolerance measure the tests and the CLI use)."""
    out, ref = np.asarray(out, dtype=np.float32), np.asarray(ref, dtype=np.float32)
    if not ref.size and out.shape == ref.shape:
        return 0.0  # an empty batch: nothing to differ
    return float(np.abs(out - ref).max() / max(float(np.abs(ref).max()), 1e-30))
