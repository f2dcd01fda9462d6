"""Ahead-of-time compilation of the forward's kernels to cubins, for one layer shape.

Runs without a GPU: the forward is planned on ``meta`` tensors (only dtypes and shapes matter)
and each launch goes through ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``.
The signature/constexprs/attrs format used here is the same in Triton 3.6 and 3.9.
"""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ._launch import KernelLaunch
from .layout import ROW_MAJOR, WeightLayout
from .moe import plan_moe_forward
from .tile_config import TileConfig


def _jit_function(kernel):
    """The JITFunction to compile: under TRITON_INTERPRET=1 kernels are InterpretedFunctions,
    whose helpers the compiler cannot resolve, so AOT must run in a process without it."""
    if not isinstance(kernel, triton.runtime.jit.JITFunction):
        raise RuntimeError("aot_compile needs real Triton kernels; unset TRITON_INTERPRET "
                           "(it is read when the kernel modules are imported)")
    return kernel


def compile_launch(launch: KernelLaunch, arch: int):
    """Compile one launch description for ``sm_<arch>``; returns triton's CompiledKernel."""
    signature, attrs = launch.signature()
    src = ASTSource(fn=_jit_function(launch.kernel), signature=signature,
                    constexprs=dict(launch.constexprs), attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))


def aot_compile(arch: int, *, num_experts: int, top_k: int, hidden: int, intermediate: int,
                num_tokens: int = 1, routing: str = "topk_softmax", renormalize: bool = False,
                activation: str = "swiglu_oai", alpha: float = 1.702, limit: float = 7.0,
                interleaved: bool = True, bias: bool = True, dtype: torch.dtype = torch.bfloat16,
                layout: WeightLayout = ROW_MAJOR, config: TileConfig | None = None) -> dict[str, bytes]:
    """Cubins {kernel name: bytes} of every kernel ``moe_forward`` launches for this layer shape.

    ``num_tokens`` only picks the tile class (decode/prefill) via ``choose_config``; the token
    count stays a run-time argument of each kernel. ``arch`` is 90 (Hopper) or 100 (Blackwell).
    """
    if arch not in (90, 100):
        raise ValueError(f"arch must be 90 or 100, got {arch}")
    meta = dict(device="meta")
    u8 = dict(dtype=torch.uint8, **meta)
    w13, s13 = layout.swizzle(torch.empty(num_experts, 2 * intermediate, hidden // 2, **u8),
                              torch.empty(num_experts, 2 * intermediate, hidden // 32, **u8))
    w2, s2 = layout.swizzle(torch.empty(num_experts, hidden, intermediate // 2, **u8),
                            torch.empty(num_experts, hidden, intermediate // 32, **u8))
    b13 = torch.empty(num_experts, 2 * intermediate, dtype=torch.float32, **meta) if bias else None
    b2 = torch.empty(num_experts, hidden, dtype=torch.float32, **meta) if bias else None
    plan = plan_moe_forward(
        torch.empty(num_tokens, hidden, dtype=dtype, **meta),
        torch.empty(num_tokens, num_experts, dtype=torch.float32, **meta),
        w13, s13, b13, w2, s2, b2, top_k=top_k, routing=routing, renormalize=renormalize,
        activation=activation, alpha=alpha, limit=limit, interleaved=interleaved, layout=layout,
        config=config, arch=arch)
    return {launch.name: compile_launch(launch, arch).asm["cubin"] for launch in plan.launches}
