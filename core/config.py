"""MoE layer configuration shared by every layer of mxmoe.

Plain dataclass, no torch: the compiler writes it into IR attributes and the runtime reads it
back from an artifact's manifest, so it must be importable where torch is not installed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

#: Routing modes. "topk_softmax" is gpt-oss: top-k over the logits, softmax over the k chosen.
#: "softmax_topk" is Mixtral/Qwen-style: softmax over all experts, then top-k (optionally renormalised).
ROUTINGS = ("topk_softmax", "softmax_topk")
#: Activations. "swiglu_oai" is gpt-oss's clamped SwiGLU; "silu" is plain SiLU-GLU.
ACTIVATIONS = ("swiglu_oai", "silu")

MXFP4_BLOCK = 32


@dataclass(frozen=True)
class MoEConfig:
    """Shape and semantics of one MoE layer.

    ``interleaved`` says how the fused gate/up projection (w13, ``2*intermediate`` rows) is laid out:
    True means rows alternate gate, up, gate, up (gpt-oss); False means all gate rows, then all up rows.
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

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"MoEConfig: {msg}")

        for name in ("num_experts", "top_k", "hidden", "intermediate"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"{name} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            bad(f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        for name in ("hidden", "intermediate"):
            if getattr(self, name) % MXFP4_BLOCK:
                bad(f"{name}={getattr(self, name)} is not a multiple of the MXFP4 block ({MXFP4_BLOCK})")
        if self.routing not in ROUTINGS:
            bad(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.activation not in ACTIVATIONS:
            bad(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        for name in ("renormalize", "interleaved", "bias", "router_bias"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.renormalize and self.routing != "softmax_topk":
            bad("renormalize only applies to routing='softmax_topk'")
        for name in ("swiglu_alpha", "swiglu_limit"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                bad(f"{name} must be a finite number > 0, got {v!r}")

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


#: Named layer shapes. gpt-oss sizes are from the released models' config.json.
PRESETS: dict[str, MoEConfig] = {
    "gpt-oss-20b": MoEConfig(num_experts=32, top_k=4, hidden=2880, intermediate=2880),
    "gpt-oss-120b": MoEConfig(num_experts=128, top_k=4, hidden=2880, intermediate=2880),
    "tiny": MoEConfig(num_experts=8, top_k=2, hidden=64, intermediate=96),
}


def preset(name: str) -> MoEConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
