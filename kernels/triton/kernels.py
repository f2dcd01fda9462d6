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
from contextlib import contextmanager

#: plan kernel name -> (module inside this package, function). ``route_and_group`` and ``group_by_expert`` are
#: in no plan built now, but plans of earlier versions name them (and their JIT fallback needs them).
KERNELS: dict[str, tuple[str, str]] = {
    "router_gemm": ("_routing_kernel", "router_gemm_kernel"),
    "route_partials": ("_routing_kernel", "route_partials_kernel"),
    "router_route": ("_routing_kernel", "router_route_kernel"),
    "route_and_group": ("_routing_kernel", "route_and_group_kernel"),
    "router_route_group": ("_routing_kernel", "router_route_group_kernel"),
    "router_route_scatter": ("_routing_kernel", "router_route_scatter_kernel"),
    "group_by_expert": ("_grouping_kernel", "group_by_expert_kernel"),
    "chunk_histogram": ("_grouping_kernel", "chunk_histogram_kernel"),
    "chunk_scan": ("_grouping_kernel", "chunk_scan_kernel"),
    "chunk_scatter": ("_grouping_kernel", "chunk_scatter_kernel"),
    "map_ids": ("_grouping_kernel", "map_ids_kernel"),
    "map_and_group": ("_grouping_kernel", "map_and_group_kernel"),
    "dense_groups": ("_grouping_kernel", "dense_groups_kernel"),
    "shared_gate": ("_routing_kernel", "shared_gate_kernel"),
    "glu_gemm": ("_gemm_kernels", "glu_gemm_kernel"),
    "combine_gemm": ("_gemm_kernels", "combine_gemm_kernel"),
    "cast": ("_gemm_kernels", "cast_kernel"),
    "combine_slots": ("_gemm_kernels", "combine_slots_kernel"),
    "dense_glu": ("_dense_kernels", "dense_glu_kernel"),
    "dense_out": ("_dense_kernels", "dense_out_kernel"),
    "mxfp8_quant": ("_w4a8_kernels", "mxfp8_quant_kernel"),
    "glu_gemm_w4a8": ("_w4a8_kernels", "glu_gemm_w4a8_kernel"),
    "combine_gemm_w4a8": ("_w4a8_kernels", "combine_gemm_w4a8_kernel"),
}

_copies: dict[tuple[str, bool], object] = {}
_lock = threading.Lock()
_run_lock = threading.RLock()
_interpreted_helpers: dict[object, object] = {}


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


@contextmanager
def interpreter_scope():
    """Run interpreted kernels inside this scope.

    Triton's own helpers (``tl.argmax``, ``tl.sigmoid``, ``tl.cumsum``, ...) are ``@jit`` functions
    too, decorated when ``triton`` was imported; in a process that imported it without
    ``TRITON_INTERPRET`` they are ``JITFunction`` objects, which refuse to be called from Python. For
    the scope's duration a call to one runs its Python body under the interpreter instead (what an
    ``InterpretedFunction`` does). Scopes are serialised: the switch is process-wide.
    """
    from triton.runtime import interpreter
    from triton.runtime.interpreter import InterpretedFunction, InterpreterError
    from triton.runtime.jit import JITFunction

    def device_call(helper, args, kwargs):
        # What InterpretedFunction.__call__ does for a device function, except that the patches it
        # applies to triton.language are undone afterwards (Triton leaves them in place, which breaks
        # every later compilation in this process).
        scope = interpreter._patch_lang(helper.fn)
        try:
            return helper.rewrite()(*args, **kwargs)
        except InterpreterError:
            raise
        except Exception as e:
            raise InterpreterError(repr(e)) from e
        finally:
            scope.restore()

    with _run_lock:
        original_jit, original_interp = JITFunction.__call__, InterpretedFunction.__call__

        def jit_call(self, *args, **kwargs):
            helper = _interpreted_helpers.get(id(self))  # JITFunction.__hash__ would parse its source
            if helper is None:
                helper = _interpreted_helpers.setdefault(id(self), InterpretedFunction(self.fn))
            return device_call(helper, args, kwargs)

        JITFunction.__call__ = jit_call
        InterpretedFunction.__call__ = lambda self, *args, **kwargs: device_call(self, args, kwargs)
        try:
            yield
        finally:
            JITFunction.__call__, InterpretedFunction.__call__ = original_jit, original_interp


def ensure_allocator() -> None:
    """Give Triton a torch allocator for kernels' global scratch (on-device TMA descriptors need one) when
    this thread has none; an allocator the application set is kept. For JIT launches."""
    import torch
    import triton
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    if current is None or type(current.get()).__name__ == "NullAllocator":
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def standard_library_is_compiled() -> bool:
    """Whether ``triton.language``'s own @jit helpers are real JITFunctions (needed to compile kernels)."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    return isinstance(tl.standard.sigmoid, JITFunction)
