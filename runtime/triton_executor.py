"""Runs a Triton kernel plan: on a CUDA GPU (AOT cubins, or JIT of the same kernels) or under Triton's interpreter.

The plan (``mxmoe.kernels.triton.kernel_plan``) says everything: which kernels, their
constants, the shape class for the token count, grids and buffer sizes as expressions of ``T``,
and which parameter feeds which argument. This module only evaluates it. Modes:

* ``"cubin"``: loads the cubins ``mxmoe.compile`` built ahead of time with the CUDA driver API
  (``cuModuleLoadData`` / ``cuLaunchKernel`` through ctypes, on torch's current stream, so calls can
  be captured in CUDA graphs). Needs a GPU of the plan's arch; no Triton compiler is involved.
* ``"jit"``: launches the same Triton kernels with the same constants through the device's Triton
  (compiled there on first use).
* ``"interpret"``: the same kernels under ``TRITON_INTERPRET`` semantics on CPU tensors.
* ``"auto"`` (default): ``cubin`` when cubins for this GPU's arch are present and load, else ``jit``.

Weights are in the plan's layout already (the compiler transformed them); the executor never
re-lays them out. No host read-back happens inside a call: every size follows from ``T``.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import threading
import warnings
from typing import Any, Collection, Mapping, NamedTuple

import torch

from mxmoe.core.bridge import to_numpy, to_torch, torch_dtype
from mxmoe.core.swizzle import HOPPER_MAX_FAST_SCALE
from mxmoe.kernels.triton.expr import evaluate
from mxmoe.kernels.triton.kernel_plan import KernelPlan, PlanError, as_dict
from mxmoe.kernels.triton.kernels import ensure_allocator
from mxmoe.kernels.triton.tile_config import compile_stages

MODES = ("auto", "cubin", "jit", "interpret")


def _to_torch(name: str, value, want: str, device: torch.device) -> torch.Tensor:
    t = value.detach() if isinstance(value, torch.Tensor) else to_torch(value)
    if t.dtype == torch.int8 and want == "uint8":
        t = t.view(torch.uint8)
    if t.dtype != torch_dtype(want):
        raise PlanError(f"parameter '{name}': expected {want}, got {t.dtype}")
    return t.to(device).contiguous()


# ------------------------------------------------------------------------------------ CUDA driver
class _Driver:
    """The few CUDA driver API calls a cubin launch needs (libcuda through ctypes)."""

    _instance = None

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]

    @classmethod
    def get(cls) -> "_Driver":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def check(self, result: int, what: str) -> None:
        if result != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(msg))
            raise RuntimeError(f"CUDA driver: {what} failed: {msg.value.decode() if msg.value else result}")

    def ensure_context(self, device: torch.device) -> None:
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # makes torch's (primary) context current on this thread
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            self.check(self.lib.cuDeviceGet(ctypes.byref(dev), device.index or 0), "cuDeviceGet")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def load(self, cubin: bytes, function: str, shared: int) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        image = ctypes.create_string_buffer(cubin, len(cubin))
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), image), f"cuModuleLoadData({function})")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), module, function.encode()),
                   f"cuModuleGetFunction({function})")
        if shared > 49152:
            CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
            self.check(self.lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                   ctypes.c_int(shared)), f"cuFuncSetAttribute({function})")
        return module, fn


_CTYPES = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "fp32": ctypes.c_float}


class _CubinKernel:
    """One AOT-compiled kernel: its CUfunction and what a launch needs besides the arguments."""

    def __init__(self, driver: _Driver, cubin: bytes, meta: Mapping[str, Any], types: list[str]):
        if int(meta.get("num_ctas", 1)) != 1:
            raise RuntimeError(f"{meta['function']}: cluster launches are not supported")
        self.driver, self.meta, self.types = driver, meta, types
        self.module, self.fn = driver.load(cubin, meta["function"], int(meta["shared"]))

    def launch(self, grid: tuple[int, ...], args: list, device: torch.device) -> None:
        gx, gy, gz = (tuple(grid) + (1, 1, 1))[:3]
        values = []
        for ty, a in zip(self.types, args):
            values.append(ctypes.c_void_p(a.data_ptr()) if ty.startswith("*") else _CTYPES[ty](a))
        scratch = None
        if self.meta["global_scratch_size"] > 0:
            align = self.meta["global_scratch_align"]
            size = self.meta["global_scratch_size"] * gx * gy * gz
            scratch = torch.empty(size + align, dtype=torch.uint8, device=device)
            values.append(ctypes.c_void_p((scratch.data_ptr() + align - 1) // align * align))
        else:
            values.append(ctypes.c_void_p(0))
        values.append(ctypes.c_void_p(0))  # profile scratch: unused unless Triton's profiler is on
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        stream = torch.cuda.current_stream(device).cuda_stream
        self.driver.check(self.driver.lib.cuLaunchKernel(
            self.fn, gx, gy, gz, 32 * int(self.meta["num_warps"]), 1, 1, int(self.meta["shared"]),
            ctypes.c_void_p(stream), params, None), f"cuLaunchKernel({self.meta['function']})")
        if scratch is not None:
            scratch.record_stream(torch.cuda.current_stream(device))


# ------------------------------------------------------------------------------------- executor
def _check_scale_range(plan: KernelPlan, params: Mapping[str, torch.Tensor]) -> None:
    """A plan compiled with the one-multiply Hopper decode (``WIDE_SCALES=False``) is exact only for scale
    bytes <= 128: refuse other weights rather than return infinities."""
    if not any(e.constexprs.get("W_HOPPER") and not e.constexprs.get("WIDE_SCALES", True)
               for e in plan.kernels.values()):
        return
    for name, spec in plan.parameters.items():
        if spec.role == "scales" and params[name].numel() and int(params[name].max()) > HOPPER_MAX_FAST_SCALE:
            raise PlanError(f"parameter '{name}': scale byte {int(params[name].max())} > {HOPPER_MAX_FAST_SCALE}, "
                            "which this plan's decode was not compiled for (it was compiled from other weights); "
                            "recompile the layer with these weights")


class Step(NamedTuple):
    """One launch of a shape class at a token count: the plan's kernel entry, its kernel, the grid, and the
    arguments as (kind, value): "value" (a parameter, scalar or dummy tensor), "input", or "buffer" (a name)."""

    entry: str
    kernel: str
    grid: tuple[int, ...]
    args: tuple[tuple[str, Any], ...]


class TritonExecutor:
    """A kernel plan (a :class:`KernelPlan` or its dict) bound to weights on one device; call it with hidden
    states [..., H]. ``plan`` keeps the plan as format-/1 data, ``kernel_plan`` as typed objects."""

    def __init__(self, plan: Mapping[str, Any] | KernelPlan, parameters: Mapping[str, Any],
                 binaries: Mapping[str, bytes] | None = None, *, device: str | torch.device | None = None,
                 mode: str = "auto"):
        self.kernel_plan = kplan = KernelPlan.from_dict(plan)
        self.plan = as_dict(plan)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "interpret":
            self.device = torch.device("cpu")
        else:
            if not torch.cuda.is_available():
                raise RuntimeError(f"target {kplan.target} needs a CUDA GPU to run (none is visible); "
                                   "compile with interpret=True to run its kernels on the CPU")
            self.device = torch.device(device or "cuda")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        missing = sorted(set(kplan.parameters) - set(parameters))
        if missing:
            raise PlanError(f"no array for weight(s) {', '.join(missing)}")
        self.params = {}
        for name, spec in kplan.parameters.items():
            t = _to_torch(name, parameters[name], spec.dtype, self.device)
            if list(t.shape) != list(spec.shape):
                raise PlanError(f"parameter '{name}': expected shape {list(spec.shape)}, got {list(t.shape)}")
            self.params[name] = t
        _check_scale_range(kplan, self.params)
        self._dummies: dict[str, torch.Tensor] = {}
        self._launch_cache: dict[int, tuple] = {}
        self._reserved: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._zeros_left = False  # the reserved zeroed memory is zero (the last call left it so)
        self._lock = threading.Lock()
        self.mode = self._pick_mode(mode, binaries or {})

    # -------------------------------------------------------------------------------- set-up
    def _pick_mode(self, mode: str, binaries: Mapping[str, bytes]) -> str:
        self._cubins: dict[str, _CubinKernel] = {}
        if mode in ("interpret", "jit"):
            return mode
        plan = self.kernel_plan
        major, minor = torch.cuda.get_device_capability(self.device)
        arch_here = 10 * major + minor
        meta = plan.cubins or {}
        reason = None
        if not binaries or set(binaries) != set(plan.kernels) or set(meta) != set(plan.kernels):
            reason = "the module carries no cubins for every plan kernel"
        elif arch_here != plan.arch:
            reason = f"the cubins are for sm_{plan.arch}, this GPU is sm_{arch_here}"
        if reason is None:
            try:
                driver = _Driver.get()
                driver.ensure_context(self.device)
                for name, entry in plan.kernels.items():
                    types = [plan.arg_type(a) for a in entry.args]
                    self._cubins[name] = _CubinKernel(driver, bytes(binaries[name]), meta[name], types)
                return "cubin"
            except Exception as e:  # noqa: BLE001 - reported below, then JIT takes over
                reason = f"loading the cubins failed ({e})"
                self._cubins = {}
        if mode == "cubin":
            raise RuntimeError(f"cannot run the AOT cubins: {reason}")
        warnings.warn(f"mxmoe: {reason}; JIT-compiling the plan's kernels with this machine's Triton instead",
                      stacklevel=3)
        return "jit"

    def _dummy(self, dtype: str) -> torch.Tensor:
        if dtype not in self._dummies:
            self._dummies[dtype] = torch.zeros(16, dtype=torch_dtype(dtype), device=self.device)
        return self._dummies[dtype]

    def _launches(self, num_tokens: int) -> tuple:
        """Per token count: (buffer specs, [Step]); cached."""
        cached = self._launch_cache.get(num_tokens)
        if cached is not None:
            return cached
        plan = self.kernel_plan
        cls = plan.shape_class(num_tokens)
        env = cls.environment(num_tokens)
        buffers = [(name, tuple(evaluate(d, env) for d in b.shape), torch_dtype(b.dtype), b.init == "zeros",
                    b.left_zero) for name, b in plan.buffers.items()]
        steps = []
        for launch in cls.launches:
            entry = plan.kernels[launch.kernel]
            args = []
            for a in entry.args:
                if a.bind == "expr":
                    args.append(("value", evaluate(a.expr, env)))
                elif a.bind == "none":
                    args.append(("value", self._dummy(a.dtype or "float32")))
                elif a.bind == "param":
                    args.append(("value", self.params[a.ref]))
                else:
                    args.append((a.bind, a.ref))
            steps.append(Step(launch.kernel, entry.kernel, tuple(evaluate(g, env) for g in launch.grid), tuple(args)))
        result = (buffers, steps)
        with self._lock:
            if len(self._launch_cache) > 256:
                self._launch_cache.clear()
            self._launch_cache[num_tokens] = result
        return result

    # ---------------------------------------------------------------------------------- call
    def _check_input(self, x) -> tuple[torch.Tensor, torch.device | None, bool]:
        was_numpy = not isinstance(x, torch.Tensor)
        if was_numpy:
            x = to_torch(x)
        hidden = self.kernel_plan.input.hidden
        if x.dim() < 2 or x.shape[-1] != hidden:
            raise ValueError(f"input 'x': expected [T, {hidden}] (or [..., {hidden}]), got shape {tuple(x.shape)}")
        want = torch_dtype(self.kernel_plan.input.dtype)
        if x.dtype != want:
            if not x.is_floating_point():
                raise ValueError(f"input 'x': expected {self.kernel_plan.input.dtype}, got {x.dtype}")
            x = x.to(want)
        home = x.device
        if x.device != self.device:
            x = x.to(self.device)
        x = x.reshape(-1, hidden)
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.clone(memory_format=torch.contiguous_format)
        return x, home, was_numpy

    def _check_extra(self, extra, num_tokens: int) -> dict[str, torch.Tensor]:
        """The entry's inputs after x (router logits; top-k weights and ids), on this device in the plan's dtypes,
        as [T, hidden]."""
        specs = self.kernel_plan.extra_inputs
        if len(extra) != len(specs):
            names = ", ".join(i.name for i in (self.kernel_plan.input, *specs))
            raise ValueError(f"expected {1 + len(specs)} input(s) ({names}), got {1 + len(extra)}")
        out = {}
        for spec, t in zip(specs, extra):
            t = t if isinstance(t, torch.Tensor) else to_torch(t)
            if t.dim() < 2 or t.shape[-1] != spec.hidden or math.prod(t.shape[:-1]) != num_tokens:
                raise ValueError(f"input '{spec.name}': expected [{num_tokens}, {spec.hidden}] (as many rows as x), "
                                 f"got shape {tuple(t.shape)}")
            want = torch_dtype(spec.dtype)
            if (spec.dtype == "int32") != (not t.is_floating_point()):
                raise ValueError(f"input '{spec.name}': expected {spec.dtype}, got {t.dtype}")
            if t.device != self.device:
                t = t.to(self.device)
            if t.dtype != want:
                t = t.to(want)
            t = t.reshape(-1, spec.hidden)
            out[spec.name] = t if t.is_contiguous() else t.contiguous()
        return out

    def __call__(self, x, *extra):
        shape = tuple(x.shape)
        x2, home, was_numpy = self._check_input(x)
        inputs = self._check_extra(extra, x2.shape[0])
        if x2.shape[0] == 0:
            out = x2.new_empty(x2.shape)
        else:
            out = self.run(x2, inputs=inputs)[self.kernel_plan.output]
        out = out.reshape(shape)
        if was_numpy:
            return to_numpy(out)
        return out if home == self.device else out.to(home)

    # ------------------------------------------------------------- the launches one by one
    def steps(self, num_tokens: int) -> list[Step]:
        """The launches of ``num_tokens``'s shape class, in order, with grids and arguments resolved."""
        return self._launches(num_tokens)[1]

    def new_buffers(self, num_tokens: int) -> dict[str, torch.Tensor]:
        """The plan's scratch buffers for ``num_tokens``, newly allocated: every zero-initialised one a view of one
        zeroed allocation, the others uninitialised (for launching steps one by one; whole calls also use the
        memory of :meth:`reserve`)."""
        return self._call_buffers(num_tokens, reserved=False)[0]

    def _call_buffers(self, num_tokens: int, reserved: bool) -> tuple[dict[str, torch.Tensor], bool]:
        """A call's scratch, and whether the call leaves the reserved zeroed memory zero when it completes.
        ``reserved`` (whole calls only) and up to the token count of :meth:`reserve`: views of the reserved memory
        (no allocation: what CUDA-graph capture needs). Its zeroed part is zeroed only when the last call did not
        leave it zero: the plan's ``left_zero`` buffers are zero again at the end of every whole call, and only
        whole calls use that memory, so a call that completes leaves it as it found it (a call that raised, or a
        plan whose zeroed buffers are not all ``left_zero``, gets the memset again)."""
        specs = self._launches(num_tokens)[0]
        zeroed = [(n, shp, dt) for n, shp, dt, zero, _ in specs if zero]
        other = [(n, shp, dt) for n, shp, dt, zero, _ in specs if not zero]
        zero_bytes, other_bytes = self._arena_bytes(zeroed), self._arena_bytes(other)
        keep = self._reserved
        leaves_zero = False
        if reserved and keep is not None and num_tokens <= keep[0]:
            zpool, opool = keep[1][:zero_bytes], keep[2][:other_bytes]
            if not self._zeros_left:
                zpool.zero_()
            self._zeros_left = False  # until this call completes
            leaves_zero = all(kept for _, _, _, zero, kept in specs if zero)
        else:
            zpool = torch.zeros(zero_bytes, dtype=torch.uint8, device=self.device)
            opool = torch.empty(other_bytes, dtype=torch.uint8, device=self.device)
        buffers = {}
        for pool, group in ((zpool, zeroed), (opool, other)):
            offset = 0
            for name, shp, dtype in group:
                n = math.prod(shp) * dtype.itemsize
                buffers[name] = pool[offset:offset + n].view(dtype).view(shp)
                offset += -(-n // 256) * 256
        return buffers, leaves_zero

    @staticmethod
    def _arena_bytes(group) -> int:
        return sum(-(-math.prod(shp) * dtype.itemsize // 256) * 256 for _, shp, dtype in group)

    def reserve(self, max_tokens: int) -> None:
        """Allocate the scratch of every call of up to ``max_tokens`` tokens now, once: calls then take views of it
        (no allocation, no host synchronisation), so a call can be captured in a CUDA graph and replayed, and the
        output is a view of the reserved memory that the next call overwrites. Calls must then come from one stream
        at a time."""
        if max_tokens < 1:
            raise ValueError(f"reserve: max_tokens must be >= 1, got {max_tokens}")
        zero = other = 0
        bounds = {c.max_tokens for c in self.kernel_plan.classes if c.max_tokens is not None}
        for t in sorted({t for t in bounds if t <= max_tokens} | {max_tokens}):  # sizes grow with T inside a class
            specs = self._launches(t)[0]
            zero = max(zero, self._arena_bytes([(n, s, d) for n, s, d, z, _ in specs if z]))
            other = max(other, self._arena_bytes([(n, s, d) for n, s, d, z, _ in specs if not z]))
        self._reserved = (max_tokens, torch.zeros(zero, dtype=torch.uint8, device=self.device),
                          torch.empty(other, dtype=torch.uint8, device=self.device))
        self._zeros_left = True
        for dtype in {a.dtype or "float32" for e in self.kernel_plan.kernels.values() for a in e.args
                      if a.bind == "none"}:
            self._dummy(dtype)  # made now, not inside a capture

    def run(self, x: torch.Tensor, *, kernels: Collection[str] | None = None,
            buffers: Mapping[str, torch.Tensor] | None = None,
            inputs: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Run the launches of the shape class of ``x`` ([T, H], on this executor's device, in the plan's dtype)
        and return every buffer; a call is ``run(x)[plan output]``. ``kernels``: run only the launches of these
        kernels (``"glu_gemm"``, ...; a plan's entries name them); ``buffers``: copied into the call's buffers
        first. For tests of single kernels and for timing launches apart. ``inputs``: the plan's extra inputs by
        name (checked by ``__call__``)."""
        num_tokens = x.shape[0]
        bufs, leaves_zero = self._call_buffers(num_tokens, reserved=kernels is None and not buffers)
        for name, value in (buffers or {}).items():
            bufs[name].copy_(value)

        if self.mode == "interpret":
            from mxmoe.kernels.triton.kernels import interpreter_scope

            scope = interpreter_scope()
        else:
            scope = contextlib.nullcontext()
        with scope:
            for step in self.steps(num_tokens):
                if kernels is None or step.kernel in kernels:
                    self.launch(step, x, bufs, inputs)
        if leaves_zero:
            self._zeros_left = True
        return bufs

    def launch(self, step: Step, x: torch.Tensor, buffers: Mapping[str, torch.Tensor],
               inputs: Mapping[str, torch.Tensor] | None = None) -> None:
        """Launch one step of :meth:`steps` on input ``x`` (and the plan's extra ``inputs`` by name) and ``buffers``
        (interpreted launches inside ``mxmoe.kernels.triton.kernels.interpreter_scope()``, as :meth:`run` does)."""
        if min(step.grid) == 0:
            return
        args = [(x if ref is None or ref == "x" else inputs[ref]) if kind == "input" else
                buffers[ref] if kind == "buffer" else ref for kind, ref in step.args]
        if self.mode == "cubin":
            self._cubins[step.entry].launch(step.grid, args, self.device)
            return
        import triton

        from mxmoe.kernels.triton.kernels import get_kernel

        entry = self.kernel_plan.kernels[step.entry]
        fn = get_kernel(entry.kernel, interpret=self.mode == "interpret")
        stages = compile_stages(entry.kernel, entry.constexprs, entry.num_stages, triton.__version__)
        if self.mode == "jit":
            ensure_allocator()
        # by name: kernels may take run-time arguments after their constants (added with defaults, so that
        # plans written before them still run)
        fn[step.grid](**{a.name: v for a, v in zip(entry.args, args)}, **entry.constexprs,
                      num_warps=entry.num_warps, num_stages=stages)
