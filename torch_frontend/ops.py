"""The mxmoe custom ops: how an MoE layer looks to torch.export and to the compiler.

An MoE layer is four ops, split where the compiler wants seams:

* ``mxmoe::route(logits, top_k, routing, renormalize, score_bias?, n_group, topk_group, scaling)
  -> (weights f32 [T,k], ids i32 [T,k])`` (docs/routing.md)
* ``mxmoe::mxfp4_grouped_matmul(x, ids, w, w_scale, bias?) -> [T,k,N]``: row ``(t, j)`` is
  ``x[t] @ dequant(w[ids[t,j]])^T + bias[ids[t,j]]``; ``x`` is ``[T,K]`` (shared by the k slots)
  or ``[T,k,K]`` (one row per slot). fp32 accumulation, result rounded to ``x.dtype``.
* ``mxmoe::glu(h, activation, alpha, limit, interleaved) -> [..., I]`` from ``[..., 2I]``.
* ``mxmoe::combine(y, weights) -> [T,H]``: ``sum_j weights[t,j] * y[t,j]`` in fp32, rounded to ``y.dtype``.
* ``mxmoe::map_experts(ids, expert_map?, num_global) -> local ids i32 [T,k]``: expert parallelism; -1 marks a pair
  whose expert is not in this layer (another rank's, or an id outside ``[0, num_global)``).
* ``mxmoe::weight_rows(x, weights) -> [T,k,H]``: the routing weight applied to the token before the experts
  (``apply_router_weight_on_input``): ``x[t] * weights[t,j]`` with the weight rounded to ``x.dtype`` first.

A grouped-matmul row whose id is -1 is 0 (no bias), so it adds nothing to the combine; compiled paths skip it.

Each op has an eager implementation, which *is* the reference semantics every compiled path is tested
against, and a fake implementation so torch.export keeps it as one node with a symbolic token count.
Biases are cast to fp32 before they are added, whatever their stored dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from mxmoe.core.config import ACTIVATIONS, MXFP4_BLOCK, RENORMALIZABLE, ROUTINGS
from mxmoe.torch_frontend.mxfp4 import dequantize
from mxmoe.torch_frontend.ties import top_k as _top_k_stable

_LIB = "mxmoe"


def _check(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"mxmoe.{op}: {msg}")


# --------------------------------------------------------------------------------------------- route
@torch.library.custom_op(f"{_LIB}::route", mutates_args=())
def route(logits: Tensor, top_k: int, routing: str, renormalize: bool, score_bias: Optional[Tensor] = None,
          n_group: int = 1, topk_group: int = 1, scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """Pick ``top_k`` experts per token and their mixing weights (fp32, ids int32); docs/routing.md.

    Ties go to the lower expert index (a stable sort), the rule every compiled path follows too:
    bf16 logits tie often enough that ``torch.topk``'s unspecified order would make results differ.
    ``score_bias`` [E] (fp32), ``n_group``/``topk_group``: "sigmoid_topk"'s correction bias (added for choosing
    only) and group-limited choice; ``scaling`` multiplies the weights last (``routed_scaling_factor``).
    """
    check_route(logits, top_k, routing, renormalize, score_bias, n_group, topk_group, scaling)
    lf = logits.float()
    if routing == "topk_softmax":
        vals, ids = _top_k_stable(lf, top_k)
        weights = torch.softmax(vals, dim=-1)
    elif routing == "topk_sigmoid":
        vals, ids = _top_k_stable(lf, top_k)
        weights = _sigmoid(vals)
    elif routing == "sigmoid_topk":
        scores = _sigmoid(lf)
        choice = scores + score_bias.float() if score_bias is not None else scores
        _, ids = _top_k_stable(_group_limited(choice, n_group, topk_group), top_k)
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (_slot_sum(weights) + 1e-20)
    else:
        probs = torch.softmax(lf, dim=-1)
        weights, ids = _top_k_stable(probs, top_k)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, ids.to(torch.int32)


def _sigmoid(x: Tensor) -> Tensor:
    """1 / (1 + exp(-x)) in fp32, written out as the numpy reference and the compiled paths compute it."""
    return 1.0 / (1.0 + torch.exp(-x))


def _slot_sum(w: Tensor) -> Tensor:
    """sum_j w[:, j] in slot order (keepdim), the order every implementation adds them."""
    acc = torch.zeros_like(w[:, :1])
    for j in range(w.shape[1]):
        acc = acc + w[:, j:j + 1]
    return acc


def _group_limited(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """``choice`` [T, E] with the experts outside the ``topk_group`` best of ``n_group`` groups (consecutive experts)
    at -inf; a group's score is the sum of its two largest values, ties of groups to the lower group index."""
    if n_group == 1 or topk_group == n_group:
        return choice
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)
    top2 = torch.sort(grouped, dim=-1, descending=True).values[..., :2]
    _, groups = _top_k_stable(top2[..., 0] + top2[..., 1], topk_group)
    chosen = torch.zeros((t, n_group), dtype=torch.bool, device=choice.device).scatter(1, groups, True)
    return grouped.masked_fill(~chosen.unsqueeze(-1), float("-inf")).reshape(t, e)


@route.register_fake
def _(logits, top_k, routing, renormalize, score_bias=None, n_group=1, topk_group=1, scaling=1.0):
    check_route(logits, top_k, routing, renormalize, score_bias, n_group, topk_group, scaling)
    t = logits.shape[0]
    return logits.new_empty((t, top_k), dtype=torch.float32), logits.new_empty((t, top_k), dtype=torch.int32)


def check_route(logits: Tensor, top_k: int, routing: str, renormalize: bool, score_bias: Optional[Tensor] = None,
                n_group: int = 1, topk_group: int = 1, scaling: float = 1.0) -> None:
    _check(logits.dim() == 2, "route", f"logits must be [T, E], got shape {tuple(logits.shape)}")
    _check(logits.is_floating_point(), "route", f"logits must be floating point, got {logits.dtype}")
    e = logits.shape[1]
    _check(0 < top_k <= e, "route", f"top_k={top_k} must be in 1..{e} (num experts)")
    _check(routing in ROUTINGS, "route", f"routing must be one of {ROUTINGS}, got {routing!r}")
    _check(not renormalize or routing in RENORMALIZABLE, "route",
           f"renormalize applies to routing {' or '.join(RENORMALIZABLE)}, not {routing!r}")
    if score_bias is not None:
        _check(routing == "sigmoid_topk", "route", f"score_bias applies to routing 'sigmoid_topk', not {routing!r}")
        _check(score_bias.dtype == torch.float32 and tuple(score_bias.shape) == (e,), "route",
               f"score_bias must be float32 [{e}], got {score_bias.dtype} {tuple(score_bias.shape)}")
    if (n_group, topk_group) != (1, 1):
        _check(routing == "sigmoid_topk", "route", f"n_group/topk_group apply to routing 'sigmoid_topk', not {routing!r}")
        _check(n_group > 0 and e % n_group == 0 and e // n_group >= 2, "route",
               f"n_group={n_group} must divide the {e} experts into groups of 2 or more")
        _check(0 < topk_group <= n_group and top_k <= topk_group * (e // n_group), "route",
               f"topk_group={topk_group} must be in 1..{n_group} and its groups hold top_k={top_k} experts")
    _check(scaling > 0, "route", f"scaling must be positive, got {scaling}")


# ---------------------------------------------------------------------------- mxfp4_grouped_matmul
@torch.library.custom_op(f"{_LIB}::mxfp4_grouped_matmul", mutates_args=())
def mxfp4_grouped_matmul(x: Tensor, ids: Tensor, w: Tensor, w_scale: Tensor, bias: Optional[Tensor]) -> Tensor:
    """Per (token, slot) matmul with the MXFP4 weights of the expert routed there.

    Only experts that some token selected are dequantized, so the reference costs
    O(tokens x top_k) expert reads, like the compiled paths.
    """
    check_grouped_matmul(x, ids, w, w_scale, bias)
    t, k = ids.shape
    n = w.shape[1]
    if ids.numel():  # an empty batch (0 tokens) has no ids, and no min or max
        lo, hi = int(ids.min()), int(ids.max())
        _check(-1 <= lo and hi < w.shape[0], "mxfp4_grouped_matmul", f"expert ids must be in 0..{w.shape[0] - 1} "
               f"(or -1: not this layer's), got {lo}..{hi}")
    xs = x.float() if x.dim() == 3 else x.float().unsqueeze(1).expand(t, k, x.shape[-1])
    out = torch.zeros((t, k, n), dtype=torch.float32, device=x.device)
    ids_l = ids.long()
    for e in torch.unique(ids_l).tolist():
        if e < 0:
            continue
        sel = ids_l == e
        we = dequantize(w[e], w_scale[e])  # [N, K] fp32
        y = xs[sel] @ we.t()
        if bias is not None:
            y = y + bias[e].float()
        out[sel] = y
    return out.to(x.dtype)


@mxfp4_grouped_matmul.register_fake
def _(x, ids, w, w_scale, bias):
    check_grouped_matmul(x, ids, w, w_scale, bias)
    return x.new_empty((ids.shape[0], ids.shape[1], w.shape[1]))


def check_grouped_matmul(x: Tensor, ids: Tensor, w: Tensor, w_scale: Tensor, bias: Optional[Tensor]) -> None:
    op = "mxfp4_grouped_matmul"
    _check(w.dtype == torch.uint8, op, f"w must be packed uint8 MXFP4, got {w.dtype}")
    _check(w_scale.dtype == torch.uint8, op, f"w_scale must be uint8 e8m0, got {w_scale.dtype}")
    _check(w.dim() == 3, op, f"w must be [E, N, K/2], got shape {tuple(w.shape)}")
    e, n, kh = w.shape
    kk = 2 * kh
    _check(kk % MXFP4_BLOCK == 0, op, f"K={kk} is not a multiple of the MXFP4 block ({MXFP4_BLOCK})")
    _check(tuple(w_scale.shape) == (e, n, kk // MXFP4_BLOCK), op,
           f"w_scale must be {(e, n, kk // MXFP4_BLOCK)} for w {tuple(w.shape)}, got {tuple(w_scale.shape)}")
    _check(x.is_floating_point(), op, f"x must be floating point, got {x.dtype}")
    _check(x.dim() in (2, 3) and x.shape[-1] == kk, op, f"x must be [T, {kk}] or [T, k, {kk}], got {tuple(x.shape)}")
    _check(ids.dim() == 2 and ids.dtype in (torch.int32, torch.int64), op,
           f"ids must be int32/int64 [T, k], got {ids.dtype} {tuple(ids.shape)}")
    if x.dim() == 3:
        _check(tuple(x.shape[:2]) == tuple(ids.shape), op, f"x {tuple(x.shape)} and ids {tuple(ids.shape)} disagree on [T, k]")
    if bias is not None:
        _check(tuple(bias.shape) == (e, n), op, f"bias must be {(e, n)}, got {tuple(bias.shape)}")


# ----------------------------------------------------------------------------------------------- glu
@torch.library.custom_op(f"{_LIB}::glu", mutates_args=())
def glu(h: Tensor, activation: str, alpha: float, limit: float, interleaved: bool) -> Tensor:
    """Gated activation of a fused gate/up projection, computed in fp32."""
    check_glu(h, activation)
    hf = h.float()
    if interleaved:
        gate, up = hf[..., 0::2], hf[..., 1::2]
    else:
        gate, up = hf.chunk(2, dim=-1)
    if activation in ("swiglu_oai", "silu_clamped"):
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    if activation == "swiglu_oai":
        out = (up + 1.0) * (gate * torch.sigmoid(alpha * gate))
    elif activation == "gelu":
        out = up * torch.nn.functional.gelu(gate)
    elif activation == "gelu_tanh":
        out = up * torch.nn.functional.gelu(gate, approximate="tanh")
    else:  # silu, silu_clamped
        out = up * (gate * torch.sigmoid(gate))
    return out.to(h.dtype)


@glu.register_fake
def _(h, activation, alpha, limit, interleaved):
    check_glu(h, activation)
    return h.new_empty((*h.shape[:-1], h.shape[-1] // 2))


def check_glu(h: Tensor, activation: str) -> None:
    _check(activation in ACTIVATIONS, "glu", f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    _check(h.shape[-1] % 2 == 0, "glu", f"last dim must be even (gate and up), got {h.shape[-1]}")


# ------------------------------------------------------------------------------------------- combine
@torch.library.custom_op(f"{_LIB}::combine", mutates_args=())
def combine(y: Tensor, weights: Tensor) -> Tensor:
    """Weighted sum of the k expert outputs of each token."""
    check_combine(y, weights)
    return (y.float() * weights.float().unsqueeze(-1)).sum(dim=1).to(y.dtype)


@combine.register_fake
def _(y, weights):
    check_combine(y, weights)
    return y.new_empty((y.shape[0], y.shape[2]))


def check_combine(y: Tensor, weights: Tensor) -> None:
    _check(y.dim() == 3, "combine", f"y must be [T, k, N], got shape {tuple(y.shape)}")
    _check(weights.dim() == 2 and tuple(weights.shape) == tuple(y.shape[:2]), "combine",
           f"weights must be [T, k] = {tuple(y.shape[:2])}, got {tuple(weights.shape)}")


# --------------------------------------------------------------------------------------- map_experts
@torch.library.custom_op(f"{_LIB}::map_experts", mutates_args=())
def map_experts(ids: Tensor, expert_map: Optional[Tensor], num_global: int) -> Tensor:
    """Global expert ids -> this layer's (int32): ``expert_map[id]``, or the id itself without a map; -1 where
    the expert is another rank's or the id is outside ``[0, num_global)`` (e.g. an engine's skip sentinel)."""
    check_map_experts(ids, expert_map, num_global)
    ids_l = ids.long()
    valid = (ids_l >= 0) & (ids_l < num_global)
    safe = torch.where(valid, ids_l, torch.zeros_like(ids_l))
    local = expert_map.long()[safe] if expert_map is not None else safe
    return torch.where(valid, local, torch.full_like(local, -1)).to(torch.int32)


@map_experts.register_fake
def _(ids, expert_map, num_global):
    check_map_experts(ids, expert_map, num_global)
    return ids.new_empty(ids.shape, dtype=torch.int32)


def check_map_experts(ids: Tensor, expert_map: Optional[Tensor], num_global: int) -> None:
    _check(ids.dim() == 2 and ids.dtype in (torch.int32, torch.int64), "map_experts",
           f"ids must be int32/int64 [T, k], got {ids.dtype} {tuple(ids.shape)}")
    _check(num_global > 0, "map_experts", f"num_global must be positive, got {num_global}")
    if expert_map is not None:
        _check(expert_map.dtype == torch.int32 and tuple(expert_map.shape) == (num_global,), "map_experts",
               f"expert_map must be int32 [{num_global}], got {expert_map.dtype} {tuple(expert_map.shape)}")


# --------------------------------------------------------------------------------------- weight_rows
@torch.library.custom_op(f"{_LIB}::weight_rows", mutates_args=())
def weight_rows(x: Tensor, weights: Tensor) -> Tensor:
    """``[T, H]`` tokens scaled by their routing weights, one row per slot ``[T, k, H]``: the weight (rounded to
    the token's dtype) multiplies the token before the experts, rounded to ``x.dtype`` (Llama-4's
    ``apply_router_weight_on_input``; serving engines compute ``x * w.to(x.dtype)``)."""
    check_weight_rows(x, weights)
    w = weights.to(x.dtype).float()
    return (x.float().unsqueeze(1) * w.unsqueeze(-1)).to(x.dtype)


@weight_rows.register_fake
def _(x, weights):
    check_weight_rows(x, weights)
    return x.new_empty((x.shape[0], weights.shape[1], x.shape[1]))


def check_weight_rows(x: Tensor, weights: Tensor) -> None:
    _check(x.dim() == 2 and x.is_floating_point(), "weight_rows", f"x must be float [T, H], got {x.dtype} {tuple(x.shape)}")
    _check(weights.dim() == 2 and weights.shape[0] == x.shape[0], "weight_rows",
           f"weights must be [T, k] with T = {x.shape[0]}, got {tuple(weights.shape)}")


OPS = {
    "route": route,
    "mxfp4_grouped_matmul": mxfp4_grouped_matmul,
    "glu": glu,
    "combine": combine,
    "map_experts": map_experts,
    "weight_rows": weight_rows,
}
