"""MoE layer configuration shared by every layer of mxmoe.

Plain dataclass, no torch: the compiler writes it into IR attributes and the runtime reads it
back from an artifact's manifest, so it must be importable where torch is not installed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

#: Routing modes (docs/routing.md):
#:
#: * "topk_softmax" (gpt-oss, Granite MoE): top-k over the logits, softmax over the k chosen.
#: * "softmax_topk" (Mixtral, Qwen, OLMoE): softmax over all experts, then top-k (optionally renormalised).
#: * "sigmoid_topk" (DeepSeek-V3, GLM-4 MoE, dots1): sigmoid scores; the top-k is chosen on the scores plus an
#:   optional correction bias (``score_bias``), limited to the ``topk_group`` best of ``n_group`` expert groups;
#:   the weights are the chosen experts' sigmoid scores (optionally renormalised).
#: * "topk_sigmoid" (Llama-4): top-k over the logits, each weight the sigmoid of its logit.
#:
#: Every routing multiplies its weights by ``routed_scaling_factor`` last.
ROUTINGS = ("topk_softmax", "softmax_topk", "sigmoid_topk", "topk_sigmoid")
#: Routings whose weights may be renormalised to sum to 1 over the k chosen
RENORMALIZABLE = ("softmax_topk", "sigmoid_topk")
#: Activations of the GLU ``act(gate) * up`` (docs/transformers.md lists which family uses which):
#:
#: * "swiglu_oai": gpt-oss's clamped SwiGLU, ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with
#:   ``g = min(gate, L)`` (``swiglu_alpha``, ``swiglu_limit``);
#: * "silu": plain SiLU-GLU, ``silu(gate) * up``;
#: * "silu_clamped": ``silu(min(gate, L)) * clamp(up, -L, L)`` (DeepSeek-V4, Hunyuan-V4; ``swiglu_limit``);
#: * "gelu": ``gelu(gate) * up`` with the exact (erf) GELU;
#: * "gelu_tanh": ``gelu(gate) * up`` with the tanh approximation (Gemma-4's ``gelu_pytorch_tanh``).
ACTIVATIONS = ("swiglu_oai", "silu", "silu_clamped", "gelu", "gelu_tanh")
#: How a shared expert's weights are held: MXFP4 like the routed experts, or bf16 (many checkpoints keep them so).
SHARED_FORMATS = ("mxfp4", "bf16")
#: Entry points a compiled layer can have: "layer" (hidden states in, the layer's own router), "monolithic"
#: (hidden states and the router's logits in) and "modular" (hidden states and the engine's top-k weights and ids).
ENTRIES = ("layer", "monolithic", "modular")

MXFP4_BLOCK = 32


@dataclass(frozen=True)
class MoEConfig:
    """Shape and semantics of one MoE layer.

    ``interleaved`` says how the fused gate/up projection (w13, ``2*intermediate`` rows) is laid out:
    True means rows alternate gate, up, gate, up (gpt-oss); False means all gate rows, then all up rows.

    Beyond the routed experts (the fused-MoE interface of serving engines, docs/interface.md):

    * ``router``: the layer holds its own router linear (``router_weight`` [E_global, H]); without it only the
      ``monolithic`` and ``modular`` entries exist (the engine computes the router).
    * ``global_num_experts``: expert parallelism: this layer holds ``num_experts`` of ``global_num_experts``
      experts; ``expert_map`` (int32 [global]) gives each global id its local one or -1. Routing picks global
      ids; a pair whose expert is not local (or whose id is outside [0, global)) contributes nothing here.
    * ``apply_router_weight_on_input``: the routing weight scales the token before the experts instead of the
      expert's output after (Llama-4); only with ``top_k == 1``.
    * ``router_fp32``: the router's logits are fp32: the router linear runs in fp32 (``x.float() @ W.float()^T``,
      not rounded to the activation dtype), as DeepSeek-V3, GLM-4 MoE and dots1 compute them, and the
      ``monolithic`` entry takes fp32 logits; otherwise logits are in (rounded to) the activation dtype.
    * routing details (docs/routing.md): ``n_group``/``topk_group`` (group-limited top-k of "sigmoid_topk"),
      ``score_bias`` (its correction bias, a weight ``score_bias`` [E_global] fp32, used for choosing only) and
      ``routed_scaling_factor`` (multiplies every routing's weights).
    * ``shared_intermediate`` > 0: a shared expert, a dense GLU MLP (gate rows then up rows, the routed
      experts' activation) every token also goes through, its output added to the routed one; with
      ``shared_gate`` it is first scaled by ``sigmoid(x @ shared_gate_weight^T)``. ``shared_format``: its
      weights in MXFP4 or bf16.
    """

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    routing: str = "topk_softmax"
    renormalize: bool = False
    activation: str = "swiglu_oai"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    interleaved: bool = True
    bias: bool = True
    router_bias: bool = True
    router: bool = True
    global_num_experts: int | None = None
    apply_router_weight_on_input: bool = False
    shared_intermediate: int = 0
    shared_gate: bool = False
    shared_format: str = "mxfp4"
    router_fp32: bool = False
    n_group: int = 1
    topk_group: int = 1
    score_bias: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"MoEConfig: {msg}")

        for name in ("num_experts", "top_k", "hidden", "intermediate"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"{name} must be a positive int, got {v!r}")
        g = self.global_num_experts
        if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g < self.num_experts):
            bad(f"global_num_experts must be an int >= num_experts ({self.num_experts}), got {g!r}")
        if self.top_k > self.experts_routed:
            bad(f"top_k ({self.top_k}) exceeds the number of experts routed over ({self.experts_routed})")
        for name in ("hidden", "intermediate"):
            if getattr(self, name) % MXFP4_BLOCK:
                bad(f"{name}={getattr(self, name)} is not a multiple of the MXFP4 block ({MXFP4_BLOCK})")
        if self.routing not in ROUTINGS:
            bad(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.activation not in ACTIVATIONS:
            bad(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        for name in ("renormalize", "interleaved", "bias", "router_bias", "router", "apply_router_weight_on_input",
                     "shared_gate", "router_fp32", "score_bias"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("swiglu_alpha", "swiglu_limit"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                bad(f"{name} must be a finite number > 0, got {v!r}")
        if self.renormalize and self.routing not in RENORMALIZABLE:
            bad(f"renormalize only applies to routing {' or '.join(map(repr, RENORMALIZABLE))}, not {self.routing!r}")
        for name in ("n_group", "topk_group"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"{name} must be a positive int, got {v!r}")
        g_all = self.experts_routed
        if (self.n_group, self.topk_group) != (1, 1):
            if self.routing != "sigmoid_topk":
                bad(f"n_group/topk_group (group-limited top-k) apply to routing 'sigmoid_topk' only, not {self.routing!r}")
            if g_all % self.n_group or g_all // self.n_group < 2:
                bad(f"n_group={self.n_group} must divide the {g_all} experts routed over into groups of 2 or more")
            if self.topk_group > self.n_group:
                bad(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
            if self.top_k > self.topk_group * (g_all // self.n_group):
                bad(f"top_k={self.top_k} exceeds the {self.topk_group * (g_all // self.n_group)} experts of the "
                    f"topk_group={self.topk_group} groups chosen")
        if self.score_bias and self.routing != "sigmoid_topk":
            bad(f"score_bias (a correction bias for choosing) applies to routing 'sigmoid_topk' only, not {self.routing!r}")
        f = self.routed_scaling_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0 or f != f or f == float("inf"):
            bad(f"routed_scaling_factor must be a positive finite number, got {f!r}")
        object.__setattr__(self, "routed_scaling_factor", float(f))
        if self.apply_router_weight_on_input and self.top_k != 1:
            bad(f"apply_router_weight_on_input needs top_k 1 (the weight scales the token once), got top_k {self.top_k}")
        s = self.shared_intermediate
        if not isinstance(s, int) or isinstance(s, bool) or s < 0 or s % MXFP4_BLOCK:
            bad(f"shared_intermediate must be 0 or a positive multiple of {MXFP4_BLOCK}, got {s!r}")
        if self.shared_format not in SHARED_FORMATS:
            bad(f"shared_format must be one of {SHARED_FORMATS}, got {self.shared_format!r}")
        if self.shared_gate and not s:
            bad("shared_gate needs a shared expert (shared_intermediate > 0)")
        if not self.router and self.router_bias:
            bad("router_bias needs router=True")

    @property
    def experts_routed(self) -> int:
        """How many experts the routing picks from: the global count under expert parallelism."""
        return self.global_num_experts if self.global_num_experts is not None else self.num_experts

    @property
    def expert_parallel(self) -> bool:
        return self.global_num_experts is not None

    @property
    def entries(self) -> tuple[str, ...]:
        """The entry points this layer can be compiled with (see :data:`ENTRIES`)."""
        return ENTRIES if self.router else ENTRIES[1:]

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MoEConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"MoEConfig: unknown fields {sorted(unknown)}")
        return cls(**d)


#: what the SiLU-GLU families share: concatenated gate/up rows, no biases, a router without bias
_GLU = dict(activation="silu", interleaved=False, bias=False, router_bias=False)

#: Named layer shapes, from the released models' config.json (one MoE layer each; shared experts in bf16 as their
#: checkpoints hold them).
PRESETS: dict[str, MoEConfig] = {
    "gpt-oss-20b": MoEConfig(num_experts=32, top_k=4, hidden=2880, intermediate=2880),
    "gpt-oss-120b": MoEConfig(num_experts=128, top_k=4, hidden=2880, intermediate=2880),
    "mixtral-8x7b": MoEConfig(num_experts=8, top_k=2, hidden=4096, intermediate=14336, routing="softmax_topk",
                              renormalize=True, **_GLU),
    "qwen3-30b-a3b": MoEConfig(num_experts=128, top_k=8, hidden=2048, intermediate=768, routing="softmax_topk",
                               renormalize=True, **_GLU),
    "qwen1.5-moe-a2.7b": MoEConfig(num_experts=60, top_k=4, hidden=2048, intermediate=1408, routing="softmax_topk",
                                   shared_intermediate=5632, shared_gate=True, shared_format="bf16", **_GLU),
    "olmoe-1b-7b": MoEConfig(num_experts=64, top_k=8, hidden=2048, intermediate=1024, routing="softmax_topk", **_GLU),
    "deepseek-v3": MoEConfig(num_experts=256, top_k=8, hidden=7168, intermediate=2048, routing="sigmoid_topk",
                             renormalize=True, n_group=8, topk_group=4, routed_scaling_factor=2.5, score_bias=True,
                             router_fp32=True, shared_intermediate=2048, shared_format="bf16", **_GLU),
    "llama-4-scout": MoEConfig(num_experts=16, top_k=1, hidden=5120, intermediate=8192, routing="topk_sigmoid",
                               apply_router_weight_on_input=True, shared_intermediate=8192, shared_format="bf16",
                               **_GLU),
    "tiny": MoEConfig(num_experts=8, top_k=2, hidden=64, intermediate=96),
}


def preset(name: str) -> MoEConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
