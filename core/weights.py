"""The weights of one MXFP4 MoE layer, checked against its ``MoEConfig``.

Every other part of mxmoe (reference math, compiler, runtime, checkpoint IO) takes a ``MoEWeights``,
so shape/dtype mistakes are caught here once, with the tensor's name, instead of deep in a kernel.
numpy only (no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mxmoe.core import mxfp4
from mxmoe.core.bridge import numpy_dtype
from mxmoe.core.config import MXFP4_BLOCK, MoEConfig

__all__ = ["MoEWeights", "VLLM_NAMES", "expected_tensors", "check_tensor", "moe_model_info"]

#: MoEWeights field -> its name in vLLM's fused-MoE state dict (router, expert map and shared-expert names are
#: ours; shared-expert parameters carry "shared" in their names).
VLLM_NAMES = {
    "router_weight": "router_weight",
    "router_bias": "router_bias",
    "w13": "w13_weight",
    "w13_scale": "w13_weight_scale",
    "w13_bias": "w13_bias",
    "w2": "w2_weight",
    "w2_scale": "w2_weight_scale",
    "w2_bias": "w2_bias",
    "expert_map": "expert_map",
    "shared_w13": "shared_w13_weight",
    "shared_w13_scale": "shared_w13_weight_scale",
    "shared_w2": "shared_w2_weight",
    "shared_w2_scale": "shared_w2_weight_scale",
    "shared_gate_weight": "shared_gate_weight",
    "score_bias": "e_score_correction_bias",
}

#: the config field that turns each optional tensor on
_FLAGS = {"router_weight": "router", "router_bias": "router_bias", "w13_bias": "bias", "w2_bias": "bias",
          "expert_map": "global_num_experts", "shared_w13": "shared_intermediate",
          "shared_w13_scale": "shared_intermediate with shared_format 'mxfp4'", "shared_w2": "shared_intermediate",
          "shared_w2_scale": "shared_intermediate with shared_format 'mxfp4'", "shared_gate_weight": "shared_gate",
          "score_bias": "score_bias"}

_F32, _U8, _I32 = np.dtype(np.float32), np.dtype(np.uint8), np.dtype(np.int32)


def expected_tensors(config: MoEConfig) -> dict[str, tuple[tuple[int, ...], np.dtype] | None]:
    """Field name -> (shape, dtype) that ``config`` implies, or None for a tensor the config turns off."""
    e, h, i, g = config.num_experts, config.hidden, config.intermediate, config.experts_routed
    s, b = config.shared_intermediate, MXFP4_BLOCK
    mx_shared = bool(s) and config.shared_format == "mxfp4"
    return {
        "router_weight": ((g, h), _F32) if config.router else None,
        "router_bias": ((g,), _F32) if config.router and config.router_bias else None,
        "w13": ((e, 2 * i, h // 2), _U8),
        "w13_scale": ((e, 2 * i, h // b), _U8),
        "w13_bias": ((e, 2 * i), _F32) if config.bias else None,
        "w2": ((e, h, i // 2), _U8),
        "w2_scale": ((e, h, i // b), _U8),
        "w2_bias": ((e, h), _F32) if config.bias else None,
        "expert_map": ((g,), _I32) if config.expert_parallel else None,
        # the shared expert as one expert ([1, ...]): MXFP4 like the routed ones, or float (bf16 in the layer)
        "shared_w13": (((1, 2 * s, h // 2), _U8) if mx_shared else ((1, 2 * s, h), _F32)) if s else None,
        "shared_w13_scale": ((1, 2 * s, h // b), _U8) if mx_shared else None,
        "shared_w2": (((1, h, s // 2), _U8) if mx_shared else ((1, h, s), _F32)) if s else None,
        "shared_w2_scale": ((1, h, s // b), _U8) if mx_shared else None,
        "shared_gate_weight": ((1, h), _F32) if config.shared_gate else None,
        # the routing's correction bias ("sigmoid_topk"), held in fp32 everywhere
        "score_bias": ((g,), _F32) if config.score_bias else None,
    }


def check_expert_map(expert_map: np.ndarray, num_experts: int) -> None:
    """``expert_map`` maps every global id to a local id in [0, num_experts) or -1, each local id exactly once."""
    bad = (expert_map < -1) | (expert_map >= num_experts)
    if bad.any():
        g = int(np.flatnonzero(bad)[0])
        raise ValueError(f"expert_map: global expert {g} maps to {int(expert_map[g])}, outside -1..{num_experts - 1}")
    local = np.sort(expert_map[expert_map >= 0])
    if not np.array_equal(local, np.arange(num_experts)):
        raise ValueError(f"expert_map: the local ids must be 0..{num_experts - 1}, each exactly once; got "
                         f"{local.tolist()[:16]}{' ...' if len(local) > 16 else ''}")


def _describe(array) -> str:
    if array is None:
        return "None"
    if not isinstance(array, np.ndarray):
        return type(array).__name__
    return f"{tuple(array.shape)} {array.dtype}"


def check_tensor(name: str, array, shape: tuple[int, ...], dtype) -> None:
    """Raise ``ValueError("name: expected shape S D, got S' D'")`` unless ``array`` matches exactly."""
    shape, dtype = tuple(shape), np.dtype(dtype)
    if not isinstance(array, np.ndarray) or array.shape != shape or array.dtype != dtype:
        raise ValueError(f"{name}: expected shape {shape} {dtype}, got {_describe(array)}")


@dataclass(eq=False)  # identity equality: comparing arrays field by field has no single truth value
class MoEWeights:
    """One MoE layer: router, fused gate/up (w13) and down (w2) projections in MXFP4, optional biases.

    w13 has ``2*intermediate`` rows, interleaved (gate, up, gate, up, ...) or concatenated (all gate,
    then all up) as ``config.interleaved`` says. MXFP4 tensors are packed along the reduction axis
    (hidden for w13, intermediate for w2); see ``mxmoe.core.mxfp4`` for the byte layout.
    """

    config: MoEConfig
    router_weight: np.ndarray  # [E, H] float32
    router_bias: np.ndarray | None  # [E] float32
    w13: np.ndarray  # [E, 2I, H/2] uint8
    w13_scale: np.ndarray  # [E, 2I, H/32] uint8
    w13_bias: np.ndarray | None  # [E, 2I] float32
    w2: np.ndarray  # [E, H, I/2] uint8
    w2_scale: np.ndarray  # [E, H, I/32] uint8
    w2_bias: np.ndarray | None  # [E, H] float32
    expert_map: np.ndarray | None = None  # [E_global] int32: local id or -1
    shared_w13: np.ndarray | None = None  # [1, 2S, H/2] uint8 (MXFP4) or [1, 2S, H] float32 (bf16 format)
    shared_w13_scale: np.ndarray | None = None  # [1, 2S, H/32] uint8
    shared_w2: np.ndarray | None = None  # [1, H, S/2] uint8 or [1, H, S] float32
    shared_w2_scale: np.ndarray | None = None  # [1, H, S/32] uint8
    shared_gate_weight: np.ndarray | None = None  # [1, H] float32
    score_bias: np.ndarray | None = None  # [E_global] float32: "sigmoid_topk"'s correction bias (choosing only)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every tensor's dtype and shape against the config; ValueError names the first bad one."""
        if not isinstance(self.config, MoEConfig):
            raise ValueError(f"config: expected MoEConfig, got {type(self.config).__name__}")
        for name, spec in expected_tensors(self.config).items():
            array = getattr(self, name)
            if spec is None:
                if array is not None:
                    raise ValueError(f"{name}: expected None, the config has no such tensor ({_FLAGS[name]}); "
                                     f"got {_describe(array)}")
            else:
                check_tensor(name, array, *spec)
        if self.expert_map is not None:
            check_expert_map(self.expert_map, self.config.num_experts)

    # ----------------------------------------------------------------------------------------- builders

    @classmethod
    def random(cls, config: MoEConfig, seed: int = 0) -> "MoEWeights":
        """Random layer with sensible magnitudes; gpt-oss sizes build in seconds (no float quantization).

        w13 values have std ~1/sqrt(H) and w2 ~1/sqrt(I) so activations stay O(1); the router has std
        1/sqrt(H); biases are N(0, 0.1^2) so bias handling is exercised (never all zeros). Under expert
        parallelism the local experts are a random subset of the global ones, in random order.
        """
        rng = np.random.default_rng(seed)
        e, h, i, g, s = (config.num_experts, config.hidden, config.intermediate, config.experts_routed,
                         config.shared_intermediate)
        router_weight = (rng.standard_normal((g, h), dtype=np.float32) / np.float32(math.sqrt(h)))
        router_bias = _bias(rng, (g,)) if config.router_bias else None
        w13, w13_scale = mxfp4.random_mxfp4(rng, (e, 2 * i, h), std=1 / math.sqrt(h))
        w2, w2_scale = mxfp4.random_mxfp4(rng, (e, h, i), std=1 / math.sqrt(i))
        w13_bias = _bias(rng, (e, 2 * i)) if config.bias else None
        w2_bias = _bias(rng, (e, h)) if config.bias else None
        extra: dict[str, np.ndarray] = {}
        if config.expert_parallel:
            extra["expert_map"] = np.full(g, -1, np.int32)
            extra["expert_map"][rng.choice(g, size=e, replace=False)] = np.arange(e, dtype=np.int32)
        if s and config.shared_format == "mxfp4":
            extra["shared_w13"], extra["shared_w13_scale"] = mxfp4.random_mxfp4(rng, (1, 2 * s, h), std=1 / math.sqrt(h))
            extra["shared_w2"], extra["shared_w2_scale"] = mxfp4.random_mxfp4(rng, (1, h, s), std=1 / math.sqrt(s))
        elif s:  # bf16-representable values, so the layer's bf16 copy is exact
            extra["shared_w13"] = _bf16(rng.standard_normal((1, 2 * s, h), dtype=np.float32) / np.float32(math.sqrt(h)))
            extra["shared_w2"] = _bf16(rng.standard_normal((1, h, s), dtype=np.float32) / np.float32(math.sqrt(s)))
        if config.shared_gate:
            extra["shared_gate_weight"] = _bf16(rng.standard_normal((1, h), dtype=np.float32) / np.float32(math.sqrt(h)))
        if config.score_bias:  # about the spread of the sigmoid scores' differences, so it changes choices
            extra["score_bias"] = rng.standard_normal(g, dtype=np.float32) * np.float32(0.05)
        if not config.router:
            router_weight = router_bias = None
        return cls(config, router_weight, router_bias, w13, w13_scale, w13_bias, w2, w2_scale, w2_bias, **extra)

    @classmethod
    def from_float(
        cls,
        config: MoEConfig,
        router_weight: np.ndarray,
        router_bias: np.ndarray | None,
        w13: np.ndarray,
        w13_bias: np.ndarray | None,
        w2: np.ndarray,
        w2_bias: np.ndarray | None,
    ) -> "MoEWeights":
        """Quantize float weights (w13 ``[E, 2I, H]``, w2 ``[E, H, I]``) to MXFP4 along their last axis."""
        e, h, i = config.num_experts, config.hidden, config.intermediate
        for name, array, shape in (("w13", w13, (e, 2 * i, h)), ("w2", w2, (e, h, i))):
            array = np.asarray(array)
            if array.shape != shape:
                raise ValueError(f"{name}: expected float shape {shape}, got {_describe(array)}")
        w13_q, w13_s = mxfp4.quantize(w13, name="w13")
        w2_q, w2_s = mxfp4.quantize(w2, name="w2")
        return cls(
            config,
            _as_f32(router_weight),
            _as_f32(router_bias),
            w13_q,
            w13_s,
            _as_f32(w13_bias),
            w2_q,
            w2_s,
            _as_f32(w2_bias),
        )

    # ----------------------------------------------------------------------------------------- views

    def dequantized(self) -> tuple[np.ndarray, np.ndarray]:
        """(w13 float32 ``[E, 2I, H]``, w2 float32 ``[E, H, I]``), exact, for reference implementations."""
        return mxfp4.dequantize(self.w13, self.w13_scale), mxfp4.dequantize(self.w2, self.w2_scale)

    def shared_dequantized(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(shared w13 float32 ``[2S, H]``, shared w2 ``[H, S]``), exact; None without a shared expert."""
        if not self.config.shared_intermediate:
            return None
        if self.config.shared_format == "bf16":
            return self.shared_w13[0], self.shared_w2[0]
        return (mxfp4.dequantize(self.shared_w13[0], self.shared_w13_scale[0]),
                mxfp4.dequantize(self.shared_w2[0], self.shared_w2_scale[0]))

    def gate_up_rows(self) -> tuple[slice, slice]:
        """Row selectors of w13 (and w13_bias) for the gate and the up projection, per the layout."""
        if self.config.interleaved:
            return slice(0, None, 2), slice(1, None, 2)
        return slice(0, self.config.intermediate), slice(self.config.intermediate, None)

    def pad(self, hidden_multiple: int = 1, intermediate_multiple: int = 1) -> "MoEWeights":
        """Zero-pad hidden and intermediate up to multiples of lcm(multiple, 32), e.g. for kernel tiles.

        New weights are zero codes with unit scales (byte 127), new bias entries are zero, the router
        gets zero columns. The layer's result on zero-padded inputs is unchanged and its padded output
        columns are zero: padded hidden inputs meet zero weight columns (router and w13); each padded
        intermediate channel has gate = up = 0 (zero rows, zero bias) and both GLUs give 0 there
        (swiglu_oai: 0 * sigmoid(0) * (0 + 1); silu: silu(0) * 0), and it meets zero columns of w2
        anyway; padded output rows of w2 and w2_bias are zero. Padding of w13 keeps the gate/up layout:
        interleaved appends (gate, up) row pairs; concatenated pads the gate half and the up half.
        Tensors that need no padding are shared with ``self``, not copied (weights are treated as
        immutable; gpt-oss-120b's w13 alone is 1 GiB).
        """
        for name, m in (("hidden_multiple", hidden_multiple), ("intermediate_multiple", intermediate_multiple)):
            if not isinstance(m, int) or isinstance(m, bool) or m <= 0:
                raise ValueError(f"{name}: expected a positive int, got {m!r}")
        cfg = self.config
        hp = _round_up(cfg.hidden, math.lcm(hidden_multiple, MXFP4_BLOCK))
        ip = _round_up(cfg.intermediate, math.lcm(intermediate_multiple, MXFP4_BLOCK))
        dh, di = hp - cfg.hidden, ip - cfg.intermediate
        b = MXFP4_BLOCK

        def rows13(a: np.ndarray, fill) -> np.ndarray:
            """Grow w13's row axis (axis 1) from 2I to 2Ip, keeping gate/up layout."""
            if not di:
                return a
            if cfg.interleaved:
                return _pad_axis(a, 1, 2 * di, fill)
            gate, up = a[:, : cfg.intermediate], a[:, cfg.intermediate :]
            return np.concatenate([_pad_axis(gate, 1, di, fill), _pad_axis(up, 1, di, fill)], axis=1)

        one = mxfp4.E8M0_ONE
        mx_shared = cfg.shared_format == "mxfp4"
        return MoEWeights(
            cfg.replace(hidden=hp, intermediate=ip),
            router_weight=_pad_axis(self.router_weight, 1, dh, 0),
            router_bias=self.router_bias,
            expert_map=self.expert_map,
            # the shared expert's hidden axes grow like the routed ones' (its intermediate size stays)
            shared_w13=_pad_axis(self.shared_w13, 2, dh // 2 if mx_shared else dh, 0),
            shared_w13_scale=_pad_axis(self.shared_w13_scale, 2, dh // b, one),
            shared_w2=_pad_axis(self.shared_w2, 1, dh, 0),
            shared_w2_scale=_pad_axis(self.shared_w2_scale, 1, dh, one),
            shared_gate_weight=_pad_axis(self.shared_gate_weight, 1, dh, 0),
            score_bias=self.score_bias,
            w13=rows13(_pad_axis(self.w13, 2, dh // 2, 0), 0),
            w13_scale=rows13(_pad_axis(self.w13_scale, 2, dh // b, one), one),
            w13_bias=None if self.w13_bias is None else rows13(self.w13_bias, 0),
            w2=_pad_axis(_pad_axis(self.w2, 2, di // 2, 0), 1, dh, 0),
            w2_scale=_pad_axis(_pad_axis(self.w2_scale, 2, di // b, one), 1, dh, one),
            w2_bias=None if self.w2_bias is None else _pad_axis(self.w2_bias, 1, dh, 0),
        )

    # ----------------------------------------------------------------------------------------- dicts

    def to_numpy_dict(self) -> dict[str, np.ndarray]:
        """Tensors under their vLLM names (``VLLM_NAMES``); disabled biases are left out."""
        return {VLLM_NAMES[f]: getattr(self, f) for f in VLLM_NAMES if getattr(self, f) is not None}

    @classmethod
    def from_numpy_dict(cls, config: MoEConfig, d: dict[str, np.ndarray]) -> "MoEWeights":
        """Inverse of ``to_numpy_dict``; missing or unknown names raise a ValueError listing them."""
        spec = expected_tensors(config)
        needed = [VLLM_NAMES[f] for f, s in spec.items() if s is not None]
        missing = [n for n in needed if n not in d]
        if missing:
            raise ValueError(f"missing tensors: {', '.join(missing)}")
        unknown = sorted(set(d) - set(VLLM_NAMES.values()))
        if unknown:
            known = ", ".join(VLLM_NAMES.values())
            raise ValueError(f"unknown tensors: {', '.join(unknown)}; expected names among {known}")
        return cls(config, **{f: d.get(VLLM_NAMES[f]) for f in VLLM_NAMES})


def _bf16(a: np.ndarray) -> np.ndarray:
    """``a`` (float32) rounded to the nearest bf16 values, kept as float32."""
    return a.astype(numpy_dtype("bfloat16")).astype(np.float32)


def _bias(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)


def _as_f32(a) -> np.ndarray | None:
    """Float arrays (any float dtype, incl. bfloat16) -> float32; None stays None; other dtypes kept for validate()."""
    if a is None:
        return None
    a = np.asarray(a)
    if a.dtype.kind == "f" or a.dtype.name in ("bfloat16", "float16"):
        return a.astype(np.float32, copy=False)
    return a


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_axis(a: np.ndarray | None, axis: int, extra: int, fill) -> np.ndarray | None:
    """Append ``extra`` entries of ``fill`` along ``axis``; ``a`` itself when there is nothing to add (or None)."""
    if a is None or not extra:
        return a
    shape = list(a.shape)
    shape[axis] = extra
    return np.concatenate([a, np.full(shape, fill, dtype=a.dtype)], axis=axis)


def moe_model_info(config, parameter_names) -> dict | None:
    """The manifest's ``model`` record for a compiled bare MoE layer: its config and which parameter
    holds which ``MoEWeights`` field (None when the parameters are not exactly the layer's)."""
    names = set(parameter_names)
    fields = {f: f for f in VLLM_NAMES if f in names}
    if set(fields) != names:
        return None
    return {"kind": "moe", "config": config.to_dict(), "parameters": fields}
