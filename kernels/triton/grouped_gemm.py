"""The two grouped MXFP4 GEMMs of an MoE layer, as launch descriptions.

* ``plan_glu_gemm``: w13 with bias and GLU activation fused -> activations [T*k, I] (bf16) in
  expert-sorted row order, so the second GEMM reads its rows contiguously.
* ``plan_combine_gemm``: w2 with bias, routing-weight multiply and the combine back to token
  order fused, by fp32 atomic adds into a zeroed [T, H] accumulator.

Combine determinism: adds into one output element come from a token's k slots in whatever order
their CTAs finish. Starting from 0, fp32 ``0 + a + b == 0 + b + a`` exactly, so top_k <= 2 is
bitwise deterministic; for top_k >= 3 results may differ run to run in the last fp32 bit (well
below the final bf16 rounding, which it can still flip rarely). The alternative, writing [T, k, H]
and reducing, costs a full extra [T, k, H] write and read.
"""

from __future__ import annotations

import torch
import triton

from ._gemm_kernels import cast_kernel, combine_gemm_kernel, glu_gemm_kernel, hopper_decode_kernel
from ._launch import KernelLaunch
from .grouping import ExpertGroups
from .layout import WeightLayout
from .tile_config import TileConfig, use_tma

ACTIVATIONS = ("swiglu_oai", "silu")


def _no_bias(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=device)


def _check_weights(w, s, bias, layout: WeightLayout, n: int, k: int, num_experts: int, what: str):
    got = layout.logical_shape(w)
    if got != (num_experts, n, k):
        raise ValueError(f"{what}: expected logical [E, N, K] = {(num_experts, n, k)} in layout "
                         f"{layout.name}, got {got} from shape {tuple(w.shape)}")
    if s.numel() != num_experts * n * k // 32 or w.dtype != torch.uint8 or s.dtype != torch.uint8:
        raise ValueError(f"{what}: bad scales {tuple(s.shape)} {s.dtype} for values {tuple(w.shape)} {w.dtype}")
    if bias is not None and tuple(bias.shape) != (num_experts, n):
        raise ValueError(f"{what}: bias must be [E, N] = {(num_experts, n)}, got {tuple(bias.shape)}")


def _pipeline_stages(layout: WeightLayout, config: TileConfig) -> int:
    """Software-pipelining depth for this layout.

    Seen on H200 with Triton 3.6: with N-contiguous packed weights (``k_contiguous=False``) and
    num_stages >= 2 the upcast path of ``tl.dot_scaled`` returned wrong sums once the K loop ran
    more than one iteration (num_stages=1 was right, the K-contiguous layout right at any depth).
    """
    return config.num_stages if layout.k_contiguous else 1


def plan_glu_gemm(x: torch.Tensor, groups: ExpertGroups, w13: torch.Tensor, w13_scale: torch.Tensor,
                  w13_bias: torch.Tensor | None, *, top_k: int, layout: WeightLayout,
                  config: TileConfig, activation: str = "swiglu_oai", alpha: float = 1.702,
                  limit: float = 7.0, interleaved: bool = True,
                  wide_scales: bool = True) -> tuple[KernelLaunch, torch.Tensor]:
    """Describe the w13 GEMM; returns (launch, activations [T*k, I] bf16 in sorted row order).
    ``wide_scales`` (Hopper layout only): False promises every scale byte is <= 128, which lets the
    decode multiply once per value pair instead of twice (the compiler checks the weights it has)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if config.BLOCK_M != groups.block_m:
        raise ValueError(f"config.BLOCK_M={config.BLOCK_M} differs from the grouping's {groups.block_m}")
    num_tokens, hidden = x.shape
    num_experts = groups.expert_offsets.shape[0] - 1
    n13 = layout.logical_shape(w13)[1]
    intermediate = n13 // 2
    _check_weights(w13, w13_scale, w13_bias, layout, n13, hidden, num_experts, "w13")
    act = torch.empty(num_tokens * top_k, intermediate, dtype=torch.bfloat16, device=x.device)
    launch = KernelLaunch(
        "glu_gemm", glu_gemm_kernel, (groups.num_blocks, triton.cdiv(n13, config.BLOCK_N)),
        dict(x_ptr=x, w_ptr=w13, s_ptr=w13_scale,
             bias_ptr=w13_bias if w13_bias is not None else _no_bias(x.device), act_ptr=act,
             sorted_pairs_ptr=groups.sorted_pairs, expert_offsets_ptr=groups.expert_offsets,
             block_expert_ptr=groups.block_expert, block_start_ptr=groups.block_start),
        dict(HIDDEN=hidden, INTERMEDIATE=intermediate, TOP_K=top_k, HAS_BIAS=w13_bias is not None,
             INTERLEAVED=bool(interleaved), SWIGLU_OAI=activation == "swiglu_oai",
             ALPHA=float(alpha), LIMIT=float(limit), K_CONTIGUOUS=layout.k_contiguous,
             BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
             W_TMA=use_tma(config, layout.k_contiguous, interleaved, layout.tiled),
             NUM_EXPERTS=num_experts, GROUP_M=config.GROUP_M, W_HOPPER=layout.hopper,
             WIDE_SCALES=bool(wide_scales), W_TILES=layout.tiled),
        num_warps=config.num_warps, num_stages=_pipeline_stages(layout, config))
    return launch, act


def plan_combine_gemm(act: torch.Tensor, groups: ExpertGroups, routing_weights: torch.Tensor,
                      w2: torch.Tensor, w2_scale: torch.Tensor, w2_bias: torch.Tensor | None,
                      out: torch.Tensor, *, top_k: int, layout: WeightLayout,
                      config: TileConfig, wide_scales: bool = True) -> KernelLaunch:
    """Describe the w2 GEMM that adds into ``out`` ([T, H] fp32, zeroed by the caller); ``wide_scales``
    as in :func:`plan_glu_gemm`."""
    if config.BLOCK_M != groups.block_m:
        raise ValueError(f"config.BLOCK_M={config.BLOCK_M} differs from the grouping's {groups.block_m}")
    if out.dtype != torch.float32:
        raise TypeError("the combine accumulates with fp32 atomics; out must be fp32")
    num_experts = groups.expert_offsets.shape[0] - 1
    intermediate = act.shape[1]
    hidden = out.shape[1]
    _check_weights(w2, w2_scale, w2_bias, layout, hidden, intermediate, num_experts, "w2")
    return KernelLaunch(
        "combine_gemm", combine_gemm_kernel,
        (groups.num_blocks, triton.cdiv(hidden, config.BLOCK_N), config.SPLIT_K if layout.hopper else 1),
        dict(act_ptr=act, w_ptr=w2, s_ptr=w2_scale,
             bias_ptr=w2_bias if w2_bias is not None else _no_bias(act.device),
             routing_weights_ptr=routing_weights, out_ptr=out,
             sorted_pairs_ptr=groups.sorted_pairs, expert_offsets_ptr=groups.expert_offsets,
             block_expert_ptr=groups.block_expert, block_start_ptr=groups.block_start,
             cast_ptr=_no_bias(act.device), num_tokens=out.shape[0]),
        dict(HIDDEN=hidden, INTERMEDIATE=intermediate, TOP_K=top_k, HAS_BIAS=w2_bias is not None,
             K_CONTIGUOUS=layout.k_contiguous,
             BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
             W_TMA=use_tma(config, layout.k_contiguous, tiled=layout.tiled), NUM_EXPERTS=num_experts,
             GROUP_M=config.GROUP_M, W_HOPPER=layout.hopper, WIDE_SCALES=bool(wide_scales), FUSED_CAST=False,
             W_TILES=layout.tiled, SPLIT_K=config.SPLIT_K if layout.hopper else 1),
        num_warps=config.num_warps, num_stages=_pipeline_stages(layout, config),
        dynamic_ints=frozenset({"num_tokens"}))


#: Elements per program of the cast: 32 per thread at 4 warps. (At 1024, gpt-oss-20b's 16384-token
#: cast ran at 1.26 TB/s: the programs were too short.)
CAST_BLOCK = 4096


def plan_cast(src: torch.Tensor, dst: torch.Tensor) -> KernelLaunch:
    """Describe the fp32 accumulator -> output dtype copy."""
    return KernelLaunch("cast", cast_kernel, (triton.cdiv(src.numel(), CAST_BLOCK),),
                        dict(src_ptr=src, dst_ptr=dst, numel=src.numel()), dict(BLOCK=CAST_BLOCK),
                        num_warps=4, num_stages=1, dynamic_ints=frozenset({"numel"}))


def hopper_decode(w: torch.Tensor, w_scale: torch.Tensor, *, wide_scales: bool = True) -> torch.Tensor:
    """bf16 [N, K] weights of one expert's :data:`~.layout.HOPPER` values [N, K/2] and scales [N, K/32],
    decoded by the same code the GEMMs run (``wide_scales=False``: every scale byte must be <= 128)."""
    n, k = w.shape[0], 2 * w.shape[1]
    if w.dtype != torch.uint8 or w_scale.dtype != torch.uint8 or tuple(w_scale.shape) != (n, k // 32):
        raise ValueError(f"expected uint8 values [N, K/2] and scales [N, K/32], got {tuple(w.shape)} {w.dtype} "
                         f"and {tuple(w_scale.shape)} {w_scale.dtype}")
    out = torch.empty(n, k, dtype=torch.bfloat16, device=w.device)
    block_n, block_k = 64, 128
    KernelLaunch("hopper_decode", hopper_decode_kernel, (triton.cdiv(n, block_n), triton.cdiv(k, block_k)),
                 dict(w_ptr=w.contiguous(), s_ptr=w_scale.contiguous(), out_ptr=out),
                 dict(N=n, K=k, BLOCK_N=block_n, BLOCK_K=block_k, WIDE_SCALES=bool(wide_scales)),
                 num_warps=4, num_stages=1).launch()
    return out
