"""The Triton kernels a kernel plan may name, compiled (JIT / AOT) or interpreted, by name.

``triton.jit`` decides at decoration time whether a kernel is a real ``JITFunction`` or an
``InterpretedFunction`` (the ``TRITON_INTERPRET`` environment variable). Ahead-of-time compilation
needs the former and ``interpret=True`` runs need the latter, possibly in one process (a test suite,
or a user who compiles for ``cuda:sm_90`` and then checks numerics on the CPU). So when the kernel
modules as imported are of the other kind, a private copy of the module is executed with the
variable set (or unset) for the duration of that import only; the process environment is restored.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading

#: plan kernel name -> (module inside this package, function)
KERNELS: dict[str, tuple[str, str]] = {
    "router": ("_routing_kernel", "router_kernel"),
    "route": ("_routing_kernel", "route_kernel"),
    "group_by_expert": ("_grouping_kernel", "group_by_expert_kernel"),
    "glu_gemm": ("_gemm_kernels", "glu_gemm_kernel"),
    "combine_gemm": ("_gemm_kernels", "combine_gemm_kernel"),
    "cast": ("_gemm_kernels", "cast_kernel"),
}

_copies: dict[tuple[str, bool], object] = {}
_lock = threading.Lock()


def _is_interpreted(fn) -> bool:
    from triton.runtime.jit import JITFunction

    return not isinstance(fn, JITFunction)


def _module(name: str, interpret: bool):
    full = f"{__package__}.{name}"
    mod = importlib.import_module(full)
    probe_name = next(f for m, f in KERNELS.values() if m == name)
    if _is_interpreted(getattr(mod, probe_name)) == interpret:
        return mod
    with _lock:
        key = (name, interpret)
        if key not in _copies:
            spec = importlib.util.find_spec(full)
            old = os.environ.get("TRITON_INTERPRET")
            if interpret:
                os.environ["TRITON_INTERPRET"] = "1"
            else:
                os.environ.pop("TRITON_INTERPRET", None)
            try:
                copy = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(copy)
            finally:
                if old is None:
                    os.environ.pop("TRITON_INTERPRET", None)
                else:
                    os.environ["TRITON_INTERPRET"] = old
            if _is_interpreted(getattr(copy, probe_name)) != interpret:
                raise RuntimeError(f"could not load {'interpreted' if interpret else 'compiled'} Triton kernels "
                                   f"from {full}")
            _copies[key] = copy
        return _copies[key]


def get_kernel(name: str, interpret: bool = False):
    """The kernel called ``name`` in a plan: a ``JITFunction`` or, with ``interpret``, an
    ``InterpretedFunction`` that runs on CPU tensors."""
    if name not in KERNELS:
        raise KeyError(f"unknown Triton kernel '{name}' (known: {', '.join(KERNELS)})")
    mod, fn = KERNELS[name]
    return getattr(_module(mod, interpret), fn)


def arg_names(name: str) -> list[str]:
    """Parameter names of kernel ``name`` in order (run-time args and constexprs alike)."""
    return list(get_kernel(name, interpret=False).arg_names)
