"""Ahead-of-time compilation of a kernel plan's kernels to cubins, without a GPU.

Each kernel entry goes through ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``; the
signature/constexprs/attrs format used here is the same in Triton 3.6 and 3.9.
"""

from __future__ import annotations

from typing import Any, Mapping, Union

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .kernel_plan import KernelPlan, KernelSpec, PlanError
from .tile_config import compile_stages


# ------------------------------------------------------------------------------ kernel plans
def _plan_source(plan: KernelPlan, entry: KernelSpec) -> ASTSource:
    """ASTSource for one plan kernel entry, checking its args against the kernel's parameters."""
    from .kernels import get_kernel

    fn = get_kernel(entry.kernel, interpret=False)
    runtime_args = [a.name for a in entry.args]
    # constants added to a kernel after plans named its others have defaults: a plan may leave them out
    constexprs = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    constexprs.update(entry.constexprs)
    expected = [n for n in fn.arg_names if n not in constexprs]
    if runtime_args != expected or set(entry.constexprs) - set(fn.arg_names):
        raise PlanError(f"plan kernel {entry.kernel}: arguments {runtime_args} + constexprs "
                        f"{sorted(entry.constexprs)} do not match the kernel's parameters {fn.arg_names}")
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        ty = plan.arg_type(entry.args[runtime_args.index(name)])
        signature[name] = ty
        if ty.startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]  # the executor only passes 16-byte aligned pointers
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def compile_entry(plan: KernelPlan, name: str, arch: int):
    """Triton's CompiledKernel of plan kernel entry ``name`` for ``sm_<arch>`` (``.asm["cubin"]``,
    ``.asm["ptx"]``, ``.metadata``: e.g. to read its SASS with ``cuobjdump -sass``)."""
    entry = plan.kernels[name]
    return triton.compile(_plan_source(plan, entry), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=entry.num_warps,
                                       num_stages=compile_stages(entry.kernel, entry.constexprs, entry.num_stages,
                                                                 triton.__version__),
                                       enable_fp_fusion=True))  # the JIT default


def compile_plan(plan: Union[Mapping[str, Any], KernelPlan], arch: int | None = None,
                 cache: dict | None = None) -> tuple[dict[str, bytes], dict[str, dict]]:
    """Cubins of every kernel in a kernel plan (a :class:`KernelPlan` or its dict), and their launch
    metadata, for ``sm_<arch>`` (the plan's by default).

    Returns ({entry name: cubin bytes}, {entry name: {"function", "num_warps", "shared",
    "global_scratch_size", "global_scratch_align", "profile_scratch_size", "profile_scratch_align",
    "triton"}}). Runs without a GPU. ``cache`` (a dict the caller keeps): kernels already compiled for another
    plan with the same kernel, constants, launch options and argument types are taken from it.
    """
    import json
    import os

    from .kernels import standard_library_is_compiled

    plan = KernelPlan.from_dict(plan)
    arch = int(plan.arch if arch is None else arch)
    if arch not in (90, 100):
        raise ValueError(f"arch must be 90 or 100, got {arch}")
    if not standard_library_is_compiled():
        return _compile_plan_in_subprocess(plan, arch)
    cache = {} if cache is None else cache
    binaries, meta = {}, {}
    saved = os.environ.pop("TRITON_INTERPRET", None)  # compile real kernels even inside an interpreter run
    try:
        for name, entry in plan.kernels.items():
            key = (arch, entry.kernel, json.dumps(dict(entry.constexprs), sort_keys=True), entry.num_warps,
                   entry.num_stages, tuple(plan.arg_type(a) for a in entry.args))
            if key in cache:
                binaries[name], meta[name] = cache[key]
                continue
            compiled = compile_entry(plan, name, arch)
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
            cache[key] = (binaries[name], meta[name])
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


def _compile_plan_in_subprocess(plan: KernelPlan, arch: int):
    """This process imported Triton with TRITON_INTERPRET set, so ``triton.language``'s own helpers are
    interpreted and cannot be compiled: compile in a fresh interpreter without the variable."""
    import json
    import os
    import pickle
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SUBPROCESS, str(arch)], input=json.dumps(plan.to_dict()).encode(),
                          capture_output=True, env=env, timeout=1800)
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"AOT compilation for sm_{arch} failed in a subprocess: {tail[0]}")
    return pickle.loads(proc.stdout)
