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
from .tile_config import TileConfig, compile_stages


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


# ------------------------------------------------------------------------------ kernel plans
def _plan_source(plan, entry: dict):
    """ASTSource for one plan kernel entry, checking its args against the kernel's parameters."""
    from .kernel_plan import PlanError, arg_type
    from .kernels import get_kernel

    fn = get_kernel(entry["kernel"], interpret=False)
    runtime_args = [a["name"] for a in entry["args"]]
    expected = [n for n in fn.arg_names if n not in entry["constexprs"]]
    if runtime_args != expected or set(entry["constexprs"]) - set(fn.arg_names):
        raise PlanError(f"plan kernel {entry['kernel']}: arguments {runtime_args} + constexprs "
                        f"{sorted(entry['constexprs'])} do not match the kernel's parameters {fn.arg_names}")
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in entry["constexprs"]:
            signature[name] = "constexpr"
            continue
        arg = entry["args"][runtime_args.index(name)]
        ty = arg_type(plan, arg)
        signature[name] = ty
        if ty.startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]  # the executor only passes 16-byte aligned pointers
    return ASTSource(fn=fn, signature=signature, constexprs=dict(entry["constexprs"]), attrs=attrs)


def compile_plan(plan, arch: int | None = None) -> tuple[dict[str, bytes], dict[str, dict]]:
    """Cubins of every kernel in a kernel plan, and their launch metadata, for ``sm_<arch>``.

    Returns ({entry name: cubin bytes}, {entry name: {"function", "num_warps", "shared",
    "global_scratch_size", "global_scratch_align", "profile_scratch_size", "profile_scratch_align",
    "triton"}}). Runs without a GPU.
    """
    import os

    from .kernels import standard_library_is_compiled

    arch = int(plan["arch"] if arch is None else arch)
    if arch not in (90, 100):
        raise ValueError(f"arch must be 90 or 100, got {arch}")
    if not standard_library_is_compiled():
        return _compile_plan_in_subprocess(plan, arch)
    binaries, meta = {}, {}
    saved = os.environ.pop("TRITON_INTERPRET", None)  # compile real kernels even inside an interpreter run
    try:
        for name, entry in plan["kernels"].items():
            compiled = triton.compile(_plan_source(plan, entry), target=GPUTarget("cuda", arch, 32),
                                      options=dict(num_warps=entry["num_warps"],
                                                   num_stages=compile_stages(entry["kernel"], entry["constexprs"],
                                                                             entry["num_stages"], triton.__version__),
                                                  enable_fp_fusion=True))  # the JIT default
            binaries[name] = bytes(compiled.asm["cubin"])
            md = compiled.metadata
            meta[name] = {
                "function": md.name, "num_warps": int(md.num_warps), "num_ctas": int(getattr(md, "num_ctas", 1)),
                "shared": int(md.shared),
                "global_scratch_size": int(getattr(md, "global_scratch_size", 0) or 0),
                "global_scratch_align": int(getattr(md, "global_scratch_align", 1) or 1),
                "profile_scratch_size": int(getattr(md, "profile_scratch_size", 0) or 0),
                "profile_scratch_align": int(getattr(md, "profile_scratch_align", 1) or 1),
                "triton": triton.__version__,
            }
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    return binaries, meta


_SUBPROCESS = """
import json, pickle, sys
from mxmoe.kernels.triton.aot import compile_plan
plan = json.load(sys.stdin)
sys.stdout.buffer.write(pickle.dumps(compile_plan(plan, int(sys.argv[1]))))
"""


def _compile_plan_in_subprocess(plan, arch: int):
    """This process imported Triton with TRITON_INTERPRET set, so ``triton.language``'s own helpers are
    interpreted and cannot be compiled: compile in a fresh interpreter without the variable."""
    import json
    import os
    import pickle
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SUBPROCESS, str(arch)], input=json.dumps(plan).encode(),
                          capture_output=True, env=env, timeout=1800)
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"AOT compilation for sm_{arch} failed in a subprocess: {tail[0]}")
    return pickle.loads(proc.stdout)
