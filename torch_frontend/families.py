"""transformers' MoE modules as mxmoe layers: experts modules (the ``use_experts_implementation`` flags), routers and
shared experts, mapped to a :class:`~mxmoe.core.config.MoEConfig` and :class:`~mxmoe.core.weights.MoEWeights`.

transformers (5.x) holds the experts of ~65 MoE families in one form: ``gate_up_proj`` ``[E, 2I, H]`` (``[E, H, 2I]``
when ``is_transposed``), gate and up rows concatenated (``is_concatenated``) or interleaved, ``down_proj``
``[E, H, I]`` (``[E, I, H]``), optional biases (``has_bias``), and a GLU (``_apply_gate``: the default
``act_fn(gate) * up`` or a family's own). Everything here is recognised from those attributes and checked by
running the module's own code (the gate on a probe, the router on random tokens) against mxmoe's, so a module is
either mapped exactly or refused with :class:`Unsupported` naming it and the reason; nothing falls back silently.

Sizes that are not a multiple of the MXFP4 block (32) are zero-padded (zero weights contribute nothing); the
mapped layer then works on the padded hidden size, and callers pad the tokens (:attr:`ExpertsSpec.hidden_padded`).
transformers itself is imported only where a check needs its code (the default gate's identity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mxmoe.core import mxfp4
from mxmoe.core.bridge import to_numpy
from mxmoe.core.config import MXFP4_BLOCK, MoEConfig
from mxmoe.core.weights import MoEWeights
from mxmoe.torch_frontend import ops

__all__ = ["Unsupported", "ExpertsSpec", "is_experts", "experts_spec", "quantize_experts_module",
           "experts_float_tensors", "BlockSpec", "block_spec", "identify_gate"]

#: the flags ``use_experts_implementation`` sets on an experts module
_FLAGS = ("has_gate", "has_bias", "is_concatenated", "is_transposed", "has_post_expert_norm")


class Unsupported(ValueError):
    """A transformers module mxmoe cannot run as it is; the message names the module and the reason."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


def where(module: nn.Module, name: str = "") -> str:
    """``ClassName 'qualified.name'`` (or the class alone), for messages."""
    cls = getattr(type(module), "_mxmoe_original_class", type(module)).__name__
    return f"{cls} '{name}'" if name else cls


def _round_up(n: int, m: int = MXFP4_BLOCK) -> int:
    return -(-n // m) * m


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module transformers dispatches through its ExpertsInterface (the flags every
    transformers 5 sets: ``has_bias`` and ``is_transposed``; later releases add the others)."""
    return (hasattr(module, "has_bias") and hasattr(module, "is_transposed") and hasattr(module, "config")
            and any(n in module._parameters for n in ("gate_up_proj", "up_proj"))
            or all(hasattr(module, f) for f in _FLAGS) and hasattr(module, "_is_expert_parallel"))


# ================================================================================== the gate
def _first_attr(module: nn.Module, names: tuple[str, ...]):
    for n in names:
        v = getattr(module, n, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def identify_gate(gate_fn, interleaved: bool, intermediate: int, *, limit: float | None = None,
                  alpha: float | None = None, device=None) -> tuple[str, float, float] | None:
    """The mxmoe activation ``(name, alpha, limit)`` that computes what ``gate_fn`` ([N, 2I] -> [N, I]) does, found by
    running it on a probe in fp32 (values well beyond any clamp limit) against each candidate; None if none does.

    Candidates: gpt-oss's clamped SwiGLU (with the module's ``alpha`` and ``limit``), the clamped SiLU (``limit``),
    SiLU, exact GELU, tanh GELU. A candidate matches when every probe output agrees to fp32 rounding.
    """
    span = max(12.0, 3 * (limit or 0.0))
    g = torch.Generator().manual_seed(0)
    probe = (torch.rand(96, 2 * intermediate, generator=g) * 2 - 1) * span
    probe[:32] /= 16  # small values too, where the GELUs and SiLU differ least
    probe = probe.to(device) if device is not None else probe
    candidates = []
    if limit is not None and alpha is not None:
        candidates.append(("swiglu_oai", alpha, limit))
    if limit is not None:
        candidates.append(("silu_clamped", 1.702, limit))
    candidates += [("silu", 1.702, 7.0), ("gelu", 1.702, 7.0), ("gelu_tanh", 1.702, 7.0)]
    with torch.no_grad():
        try:
            theirs = gate_fn(probe).float()
        except Exception:  # noqa: BLE001 - a gate that cannot run on its own is not one we can map
            return None
        if tuple(theirs.shape) != (probe.shape[0], intermediate):
            return None
        for act, a, lim in candidates:
            ours = ops.glu(probe, act, a, lim, interleaved).float()
            if torch.allclose(ours, theirs, rtol=2e-6, atol=2e-6 * span):
                return act, a, lim
    return None


def _gate_description(module: nn.Module) -> str:
    from transformers.integrations import moe as hf_moe

    if getattr(type(module), "_apply_gate", None) is getattr(hf_moe, "_default_apply_gate", None):
        act = getattr(module, "act_fn", None)
        name = getattr(act, "__name__", None) or type(act).__name__
        return f"act_fn(gate) * up with act_fn {name}"
    return f"its own _apply_gate ({type(module).__name__}._apply_gate)"


# ================================================================================== experts
@dataclass(frozen=True)
class ExpertsSpec:
    """What an experts module computes, in mxmoe's terms."""

    num_experts: int
    hidden: int                  # H of the module
    intermediate: int            # I of the module
    activation: str
    swiglu_alpha: float
    swiglu_limit: float
    interleaved: bool            # gate/up rows interleaved (not is_concatenated)
    transposed: bool             # gate_up_proj [E, H, 2I] (is_transposed)
    bias: bool
    dtype: torch.dtype
    device: torch.device

    @property
    def hidden_padded(self) -> int:
        return _round_up(self.hidden)

    @property
    def intermediate_padded(self) -> int:
        return _round_up(self.intermediate)

    def config(self, top_k: int, **routing) -> MoEConfig:
        """The layer config of these experts for ``top_k`` (padded sizes; no router unless ``routing`` gives one)."""
        base = dict(router=False, router_bias=False)
        base.update(routing)
        return MoEConfig(num_experts=self.num_experts, top_k=top_k, hidden=self.hidden_padded,
                         intermediate=self.intermediate_padded, activation=self.activation,
                         swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit, interleaved=self.interleaved,
                         bias=self.bias, **base)


def _float_param(module: nn.Module, name: str, at: str, dims: int) -> torch.Tensor:
    t = getattr(module, name, None)
    if not isinstance(t, torch.Tensor):
        raise Unsupported(at, f"has no {name} tensor (got {type(t).__name__})")
    if not t.is_floating_point() or t.dim() != dims or type(t) not in (torch.Tensor, nn.Parameter):
        raise Unsupported(at, f"{name} is {type(t).__name__} {t.dtype} {tuple(t.shape)}, not a plain float "
                              f"{dims}-d tensor (already quantized or sharded weights are not read)")
    if t.device.type == "meta":
        raise Unsupported(at, f"{name} is on the meta device (load the model's weights first)")
    return t


def experts_spec(module: nn.Module, name: str = "") -> ExpertsSpec:
    """The :class:`ExpertsSpec` of a transformers experts module; :class:`Unsupported` naming it and why if mxmoe
    cannot compute what it computes (no gate, a norm after each expert, a gate function mxmoe does not have,
    weights that are not plain float tensors, a device other than cpu or cuda)."""
    at = where(module, name)
    if not is_experts(module):
        raise Unsupported(at, "is not an experts module of transformers' ExpertsInterface (no use_experts_implementation "
                              "flags)")
    if not getattr(module, "has_gate", True):
        act = getattr(module, "act_fn", None)
        raise Unsupported(at, f"non-gated experts (up_proj, then {getattr(act, '__name__', type(act).__name__)}): "
                              "mxmoe's experts are GLUs (gate and up projections)")
    if getattr(module, "has_post_expert_norm", False):
        raise Unsupported(at, "a norm after each expert (has_post_expert_norm) is not built in mxmoe")
    gate_up = _float_param(module, "gate_up_proj", at, 3)
    down = _float_param(module, "down_proj", at, 3)
    if gate_up.device.type not in ("cpu", "cuda"):
        raise Unsupported(at, f"weights on device {gate_up.device}: mxmoe runs experts on cpu and cuda")
    transposed = bool(module.is_transposed)
    e = gate_up.shape[0]
    h, two_i = (gate_up.shape[1], gate_up.shape[2]) if transposed else (gate_up.shape[2], gate_up.shape[1])
    want_down = (e, two_i // 2, h) if transposed else (e, h, two_i // 2)
    if two_i % 2 or tuple(down.shape) != want_down:
        raise Unsupported(at, f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do not make "
                              f"[E, 2I, H] / [E, H, I] experts (is_transposed={transposed})")
    i = two_i // 2
    bias = bool(module.has_bias)
    if bias:
        for bname, shape in (("gate_up_proj_bias", (e, two_i)), ("down_proj_bias", (e, h))):
            b = _float_param(module, bname, at, 2)
            if tuple(b.shape) != shape:
                raise Unsupported(at, f"{bname} is {tuple(b.shape)}, expected {shape}")
    gate_fn = getattr(module, "_apply_gate", None)
    if gate_fn is None:
        raise Unsupported(at, "has no _apply_gate (the GLU of its gate and up projections)")
    # gate/up rows: the is_concatenated flag where transformers sets it (older 5.x releases do not: both are tried)
    layouts = [not module.is_concatenated] if hasattr(module, "is_concatenated") else [False, True]
    found = None
    for interleaved in layouts:
        found = identify_gate(gate_fn, interleaved, i, limit=_first_attr(module, ("limit", "swiglu_limit")),
                              alpha=_first_attr(module, ("alpha", "swiglu_alpha")), device=gate_up.device)
        if found is not None:
            break
    if found is None:
        raise Unsupported(at, f"its gate ({_gate_description(module)}) computes none of mxmoe's GLU activations "
                              "(silu, gelu, gelu_tanh, silu_clamped, swiglu_oai)")
    act, alpha, limit = found
    return ExpertsSpec(num_experts=e, hidden=h, intermediate=i, activation=act, swiglu_alpha=alpha,
                       swiglu_limit=limit, interleaved=interleaved, transposed=transposed, bias=bias,
                       dtype=gate_up.dtype, device=gate_up.device)


def _pad_rows(a: np.ndarray, i: int, ip: int, interleaved: bool) -> np.ndarray:
    """[2I, ...] gate/up rows -> [2Ip, ...] with zero rows, keeping the layout (pairs appended, or each half padded)."""
    if ip == i:
        return a
    extra = np.zeros((ip - i,) + a.shape[1:], a.dtype)
    if interleaved:
        return np.concatenate([a, extra, extra])
    return np.concatenate([a[:i], extra, a[i:], extra])


def _pad_last(a: np.ndarray, n: int) -> np.ndarray:
    if a.shape[-1] == n:
        return a
    return np.concatenate([a, np.zeros(a.shape[:-1] + (n - a.shape[-1],), a.dtype)], axis=-1)


def quantize_experts_module(module: nn.Module, spec: ExpertsSpec, progress=None) -> tuple[dict, dict]:
    """Quantize the experts' float weights to MXFP4 (OCP recipe, ``mxmoe.core.mxfp4.quantize``), one expert at a
    time (so no float copy of all experts is made), zero-padded to the padded sizes.

    Returns ``(fields, stats)``: the MoEWeights fields (w13, w13_scale, w13_bias, w2, w2_scale, w2_bias) and
    ``{"exact": whether dequantizing gives the float weights back bit for bit, "max_rel_error": ...}``.
    """
    e, i, ip, hp = spec.num_experts, spec.intermediate, spec.intermediate_padded, spec.hidden_padded
    w13 = np.empty((e, 2 * ip, hp // 2), np.uint8)
    s13 = np.empty((e, 2 * ip, hp // MXFP4_BLOCK), np.uint8)
    w2 = np.empty((e, hp, ip // 2), np.uint8)
    s2 = np.empty((e, hp, ip // MXFP4_BLOCK), np.uint8)
    exact, err_num, err_den = True, 0.0, 0.0
    h = spec.hidden
    gate_up, down = module.gate_up_proj, module.down_proj
    with torch.no_grad():
        for x in range(e):
            a13 = to_numpy(gate_up[x].t() if spec.transposed else gate_up[x])        # [2I, H]
            a2 = to_numpy(down[x].t() if spec.transposed else down[x])               # [H, I]
            q, sc = mxfp4.quantize(_pad_rows(_pad_last(a13, hp), i, ip, spec.interleaved), name=f"expert {x} gate_up")
            w13[x], s13[x] = q, sc
            back13 = _unpad_rows(mxfp4.dequantize(q, sc), i, ip, spec.interleaved)[:, :h]
            p2 = _pad_last(a2, ip)
            if hp != h:
                p2 = np.concatenate([p2, np.zeros((hp - h, ip), p2.dtype)])
            q, sc = mxfp4.quantize(p2, name=f"expert {x} down")
            w2[x], s2[x] = q, sc
            back2 = mxfp4.dequantize(q, sc)[:h, :i]
            for f, back in ((a13, back13), (a2, back2)):
                ff = f.astype(np.float32)
                exact = exact and bool(np.array_equal(back, ff))
                err_num = max(err_num, float(np.abs(back - ff).max(initial=0.0)))
                err_den = max(err_den, float(np.abs(ff).max(initial=0.0)))
            if progress is not None:
                progress(1)
        fields = {"w13": w13, "w13_scale": s13, "w2": w2, "w2_scale": s2, "w13_bias": None, "w2_bias": None}
        if spec.bias:
            b13 = module.gate_up_proj_bias.detach().float().cpu().numpy()
            fields["w13_bias"] = np.stack([_pad_rows(b13[x], i, ip, spec.interleaved) for x in range(e)])
            fields["w2_bias"] = _pad_last(module.down_proj_bias.detach().float().cpu().numpy(), hp)
    return fields, {"exact": exact, "max_rel_error": err_num / err_den if err_den else 0.0}


def _unpad_rows(a: np.ndarray, i: int, ip: int, interleaved: bool) -> np.ndarray:
    if ip == i:
        return a
    if interleaved:
        return a[: 2 * i]
    return np.concatenate([a[:i], a[ip: ip + i]])


def experts_float_tensors(weights: MoEWeights, spec: ExpertsSpec) -> dict[str, torch.Tensor]:
    """The module's float tensors (its names, orientation, dtype and device, unpadded) holding exactly the values of
    the MXFP4 ``weights`` (what ``dequantize_experts`` writes back)."""
    i, ip, h = spec.intermediate, spec.intermediate_padded, spec.hidden
    w13, w2 = weights.dequantized()                                     # [E, 2Ip, Hp], [E, Hp, Ip] f32
    w13 = np.stack([_unpad_rows(w13[x], i, ip, spec.interleaved) for x in range(spec.num_experts)])[:, :, :h]
    w2 = w2[:, :h, :i]
    if spec.transposed:
        w13, w2 = w13.transpose(0, 2, 1), w2.transpose(0, 2, 1)
    out = {"gate_up_proj": w13, "down_proj": w2}
    if spec.bias:
        out["gate_up_proj_bias"] = np.stack([_unpad_rows(weights.w13_bias[x], i, ip, spec.interleaved)
                                             for x in range(spec.num_experts)])
        out["down_proj_bias"] = weights.w2_bias[:, :h]
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)).to(device=spec.device, dtype=spec.dtype)
            for k, v in out.items()}


# ================================================================================== whole blocks
#: transformers router classes and the routing they compute (checked by running the router, see ``_check_router``)
_SOFTMAX_RENORM = {"MixtralTopKRouter", "MiniMaxTopKRouter"}
_SOFTMAX_NORM_FLAG = {"Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter", "Qwen3NextTopKRouter",
                      "FlexOlmoTopKRouter", "Qwen3VLMoeTextTopKRouter", "Qwen3_5MoeTopKRouter"}
_TOPK_SOFTMAX = {"GptOssTopKRouter", "GraniteMoeTopKRouter", "GraniteMoeSharedTopKRouter",
                 "GraniteMoeHybridTopKRouter"}
_SIGMOID_GROUPED = {"DeepseekV3TopkRouter", "Glm4MoeTopkRouter", "Dots1TopkRouter"}
_LLAMA4 = {"Llama4Router"}
#: block classes convert() knows, with how their forward returns: "tensor", or a tuple whose second item is the
#: router's scores ("scores": gpt-oss) or logits ("logits": Llama-4)
BLOCK_RETURNS = {
    "MixtralSparseMoeBlock": "tensor", "MiniMaxSparseMoeBlock": "tensor", "Qwen2MoeSparseMoeBlock": "tensor",
    "Qwen3MoeSparseMoeBlock": "tensor", "Qwen3NextSparseMoeBlock": "tensor", "OlmoeSparseMoeBlock": "tensor",
    "FlexOlmoSparseMoeBlock": "tensor", "DeepseekV3MoE": "tensor", "Glm4MoeMoE": "tensor", "Dots1MoE": "tensor",
    "GraniteMoeMoE": "tensor", "GptOssMLP": "scores", "Llama4TextMoe": "logits",
}


@dataclass
class BlockSpec:
    """A transformers MoE block as one mxmoe layer."""

    weights: MoEWeights
    dtype: torch.dtype
    returns: str                 # see BLOCK_RETURNS
    quantization: dict           # the experts' quantization stats ("exact", "max_rel_error")


def _router_of(block: nn.Module) -> tuple[str, nn.Module]:
    for attr in ("gate", "router"):
        r = getattr(block, attr, None)
        if isinstance(r, nn.Module) and isinstance(getattr(r, "weight", None), torch.Tensor):
            return attr, r
    raise ValueError("has no router (a 'gate' or 'router' submodule with a weight)")


def _routing_of(router: nn.Module, num_experts: int) -> dict:
    """The MoEConfig routing fields of a transformers router (by class; verified by running it afterwards)."""
    cls = type(router).__name__
    if cls in _SOFTMAX_RENORM:
        return dict(routing="softmax_topk", renormalize=True)
    if cls in _SOFTMAX_NORM_FLAG:
        return dict(routing="softmax_topk", renormalize=bool(getattr(router, "norm_topk_prob", False)))
    if cls in _TOPK_SOFTMAX:
        return dict(routing="topk_softmax")
    if cls in _SIGMOID_GROUPED:
        n_group, topk_group = int(getattr(router, "num_group", 1) or 1), int(getattr(router, "topk_group", 1) or 1)
        if n_group == 1:
            topk_group = 1
        return dict(routing="sigmoid_topk", renormalize=bool(router.norm_topk_prob), n_group=n_group,
                    topk_group=topk_group, routed_scaling_factor=float(router.routed_scaling_factor),
                    router_fp32=True, score_bias=getattr(router, "e_score_correction_bias", None) is not None)
    if cls in _LLAMA4:
        return dict(routing="topk_sigmoid", apply_router_weight_on_input=True)
    raise ValueError(f"its router {cls} is not one mxmoe maps (known: "
                     f"{', '.join(sorted(_SOFTMAX_RENORM | _SOFTMAX_NORM_FLAG | _TOPK_SOFTMAX | _SIGMOID_GROUPED | _LLAMA4))})")


def _shared_of(block: nn.Module, hidden: int, act: str) -> tuple[dict, dict]:
    """(config fields, weight fields) of the block's shared expert: a gate_proj/up_proj/down_proj MLP with the routed
    experts' activation, optionally scaled by sigmoid(shared_expert_gate(x)); none -> ({}, {})."""
    mlp = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    if mlp is None:
        return {}, {}
    lin = {n: getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")}
    if not all(isinstance(m, nn.Linear) and m.bias is None for m in lin.values()):
        raise ValueError(f"its shared expert {type(mlp).__name__} is not gate_proj/up_proj/down_proj linears "
                         "without biases")
    act_fn = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    s = lin["gate_proj"].out_features
    found = identify_gate(lambda h: act_fn(h[..., :s]) * h[..., s:], False, s, device=lin["gate_proj"].weight.device)
    if found is None or found[0] != act:
        raise ValueError(f"its shared expert's activation ({type(act_fn).__name__}) is not the routed experts' ({act})")
    sp = _round_up(s)
    f = lambda m: m.weight.detach().float().cpu().numpy()  # noqa: E731
    gate, up, down = f(lin["gate_proj"]), f(lin["up_proj"]), f(lin["down_proj"])   # [S, H], [S, H], [H, S]
    hp = _round_up(hidden)
    w13 = np.zeros((1, 2 * sp, hp), np.float32)
    w13[0, :s, :hidden], w13[0, sp:sp + s, :hidden] = gate, up
    w2 = np.zeros((1, hp, sp), np.float32)
    w2[0, :hidden, :s] = down
    cfg = dict(shared_intermediate=sp, shared_format="bf16")
    fields = {"shared_w13": w13, "shared_w2": w2}
    gate_lin = getattr(block, "shared_expert_gate", None)
    if gate_lin is not None:
        if not (isinstance(gate_lin, nn.Linear) and gate_lin.out_features == 1 and gate_lin.bias is None):
            raise ValueError("its shared_expert_gate is not a bias-free linear to 1 output")
        g = np.zeros((1, hp), np.float32)
        g[0, :hidden] = f(gate_lin)[0]
        fields["shared_gate_weight"] = g
        cfg["shared_gate"] = True
    return cfg, fields


def _llama4_experts(block: nn.Module) -> tuple[ExpertsSpec, dict, dict]:
    """Llama-4's experts (not an ExpertsInterface module): gate_up_proj [E, H, 2I] (concatenated), down_proj [E, I, H],
    act_fn(gate) * up."""
    ex = block.experts
    gate_up = _float_param(ex, "gate_up_proj", "Llama4TextExperts", 3)
    e, h, two_i = gate_up.shape
    found = identify_gate(lambda t: ex.act_fn(t[..., : two_i // 2]) * t[..., two_i // 2:], False, two_i // 2,
                          device=gate_up.device)
    if found is None:
        raise ValueError(f"its experts' act_fn ({type(ex.act_fn).__name__}) is none of mxmoe's GLU activations")
    spec = ExpertsSpec(num_experts=e, hidden=h, intermediate=two_i // 2, activation=found[0], swiglu_alpha=found[1],
                       swiglu_limit=found[2], interleaved=False, transposed=True, bias=False, dtype=gate_up.dtype,
                       device=gate_up.device)
    fields, stats = quantize_experts_module(ex, spec)
    return spec, fields, stats


def block_spec(block: nn.Module, dtype: torch.dtype | None = None) -> BlockSpec:
    """A transformers MoE block (router + experts [+ shared expert]) as one mxmoe layer; ValueError says why not."""
    cls = type(block).__name__
    if cls not in BLOCK_RETURNS:
        raise ValueError(f"{cls} is not an MoE block convert() knows ({', '.join(sorted(BLOCK_RETURNS))})")
    _, router = _router_of(block)
    experts = getattr(block, "experts", None)
    if cls == "Llama4TextMoe":
        spec, fields, stats = _llama4_experts(block)
    else:
        if experts is None or not is_experts(experts):
            raise ValueError("its experts are not a transformers ExpertsInterface module")
        try:
            spec = experts_spec(experts)
        except Unsupported as e:
            raise ValueError(e.reason) from None
        fields, stats = quantize_experts_module(experts, spec)
    if spec.hidden % MXFP4_BLOCK:
        raise ValueError(f"hidden size {spec.hidden} is not a multiple of {MXFP4_BLOCK} (the experts implementation, "
                         "mxmoe.transformers, pads it; a whole converted block does not)")
    routing = _routing_of(router, spec.num_experts)
    top_k = int(getattr(router, "top_k", 0) or getattr(block, "top_k", 0))
    rw = router.weight.detach()
    if tuple(rw.shape) != (spec.num_experts, spec.hidden):
        raise ValueError(f"its router weight {tuple(rw.shape)} is not [E={spec.num_experts}, H={spec.hidden}]")
    rb = getattr(router, "bias", None)
    shared_cfg, shared_fields = _shared_of(block, spec.hidden, spec.activation)
    cfg = spec.config(top_k, router=True, router_bias=rb is not None, **routing, **shared_cfg)
    score_bias = None
    if cfg.score_bias:
        score_bias = router.e_score_correction_bias.detach().float().cpu().numpy().astype(np.float32)
    weights = MoEWeights(cfg, router_weight=rw.float().cpu().numpy(),
                         router_bias=None if rb is None else rb.detach().float().cpu().numpy(), **fields,
                         score_bias=score_bias, **shared_fields)
    layer_dtype = dtype or spec.dtype
    _check_router(router, weights, layer_dtype, cls)
    return BlockSpec(weights, layer_dtype, BLOCK_RETURNS[cls], stats)


def _check_router(router: nn.Module, weights: MoEWeights, dtype: torch.dtype, cls: str) -> None:
    """Run the block's router on random tokens and check mxmoe's routing picks the same experts with the same weights
    (away from near ties: transformers' torch.topk has no tie rule), so a router whose semantics differ from what its
    class name promised is refused instead of mis-compiled."""
    cfg = weights.config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, cfg.hidden, generator=g).to(dtype=router.weight.dtype, device=router.weight.device)
    with torch.no_grad():
        out = router(x)
        if cls == "Llama4TextMoe":
            scores, logits = out
            hf_ids = scores.float().topk(cfg.top_k, dim=-1).indices
            hf_w = scores.float().gather(1, hf_ids)
        else:
            logits, hf_w, hf_ids = out if len(out) == 3 else (out[0], None, None)
            if hf_ids is None:
                raise ValueError(f"its router returns {len(out)} values, not (logits, weights, ids)")
        sb = None if weights.score_bias is None else torch.from_numpy(weights.score_bias).to(logits.device)
        w, ids = ops.route(logits.reshape(-1, cfg.experts_routed), cfg.top_k, cfg.routing, cfg.renormalize, sb,
                           cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
    lf = logits.float()
    top = lf.topk(min(cfg.top_k + 1, lf.shape[1]), dim=-1).values
    clear = (top[:, -2] - top[:, -1]) > 1e-2 * top.abs().max(dim=-1).values.clamp_min(1e-6) \
        if cfg.top_k < lf.shape[1] else torch.ones(lf.shape[0], dtype=torch.bool, device=lf.device)
    if cfg.routing == "sigmoid_topk" and (cfg.score_bias or cfg.n_group > 1):
        clear = torch.ones_like(clear)  # choice is not by logit; random fp32 values have no near ties
    mi, oi = ids.long().sort(dim=-1)
    hi, ho = hf_ids.long().sort(dim=-1)
    same_ids = (mi == hi).all(dim=-1)
    if not bool(same_ids[clear].all()):
        raise ValueError(f"its router ({type(router).__name__}) chose other experts than mxmoe's routing "
                         f"'{cfg.routing}' would")
    mw = w.gather(1, oi)
    hw = hf_w.float().gather(1, ho)
    if cfg.apply_router_weight_on_input:
        mw = mw.to(dtype).float()
    if not torch.allclose(mw[clear], hw[clear], rtol=1e-2, atol=1e-3):
        raise ValueError(f"its router ({type(router).__name__}) gives other weights than mxmoe's routing "
                         f"'{cfg.routing}'")
