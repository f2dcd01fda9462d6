"""The targets mxmoe compiles for: one object per target, owning everything that differs between them.

A :class:`Target` says which passes run (its pipeline), how H and I are padded, which weight layout its lowering
reads, how the lowered module becomes code (``iree-compile`` or a Triton kernel plan and cubins), what the artifact
records about it, and which device runs it. Nothing else in mxmoe tests a target's name or backend: adding an arch
is a line in :data:`TARGETS`, a new kind of target a class here (and its code kind in ``mxmoe.runtime.code``).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from mxmoe.core.layouts import CPU_BLOCKSPLIT, CPU_ROWS16, ROW_MAJOR, TRITON_HOPPER_TILED, Layout
from mxmoe.runtime.code import IreeCode, TritonCode

Pipeline = list[tuple[str, "str | None"]]


@dataclass(frozen=True)
class Target:
    """What one target means for the compiler (see the module docstring)."""

    name: str              # canonical spelling, e.g. "rocm:gfx942"
    arch: str              # "host", "gfx942", "sm_90", ...
    layout: Layout         # the weight layout its lowering reads
    pad_multiple: int = 32  # H and I are padded up to this
    device: str = ""       # the device it needs, in words (error messages, the manifest)
    #: the kind of code it makes: "iree" or "triton" (``mxmoe.runtime.code``)
    backend: ClassVar[str] = ""

    def replace(self, **changes) -> "Target":
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------------------------- passes
    def passes(self) -> Pipeline:
        """The pass pipeline from imported torch IR to what :meth:`compile` takes."""
        return [
            ("mxmoe-convert-torch-ops", None),
            ("mxmoe-verify", None),
            ("mxmoe-fuse", None),
            ("mxmoe-pad", str(self.pad_multiple)),
            ("mxmoe-assign-layout", self.layout.name),
            ("mxmoe-verify", None),
        ]

    # ---------------------------------------------------------------------------------- code
    def check_options(self, *, extra_flags: Sequence[str], interpret: bool) -> None:
        """Refuse compile options this target has no use for, before any work is done."""

    def check_entries(self, names: Sequence[str]) -> None:
        """Refuse entry points this target cannot compile, before any work is done."""

    def numerics_options(self, *, deterministic: bool | None, batch_invariant: bool) -> dict[str, bool]:
        """The ``deterministic`` (None: the target's default) / ``batch_invariant`` compile options
        (docs/routing.md) as :meth:`compile` takes them; a target that cannot promise one refuses it here, before
        any work is done."""
        if deterministic or batch_invariant:
            raise ValueError(f"target {self.name} does not offer deterministic or batch-invariant compiles "
                             "(compile-only here: never measured)")
        return {}

    @staticmethod
    def numerics_record(deterministic: bool, batch_invariant: bool) -> dict[str, Any]:
        """The manifest's ``target.numerics``: what the compiled module promises."""
        return {"numerics": {"deterministic": bool(deterministic), "batch_invariant": bool(batch_invariant)}}

    def with_activations(self, activations: str) -> "Target":
        """This target with the activation form ``activations`` (the compile option); "bf16" is every target's
        default (the activations as the layer has them)."""
        if activations != "bf16":
            raise ValueError(f"target {self.name} takes activations='bf16' only, got {activations!r}")
        return self

    def compile(self, module, parameters: Mapping[str, np.ndarray], *, extra_flags: Sequence[str] = (),
                interpret: bool = False, timings: dict[str, float], default_entry: str = "main", **numerics):
        """The code of ``module`` (after :meth:`passes`): an ``IreeCode`` or a ``TritonCode``."""
        raise NotImplementedError

    def record(self, code, mlir: str = "") -> dict[str, Any]:
        """What an artifact's manifest says of the target (the runtime reads nothing else about it)."""
        return {"name": self.name, "backend": self.backend, "arch": self.arch, "layout": self.layout.name,
                "device": self.device}

    @property
    def runnable_here(self) -> bool:
        """Whether modules of this target run on this machine without a device of its own (the host CPU)."""
        return False

    @property
    def runs_torch_tensors(self) -> bool:
        """Whether its modules run on the torch tensors of their device (what the torch.compile backend needs)."""
        return self.runnable_here


@dataclass(frozen=True)
class IreeTarget(Target):
    """A target IREE compiles (``iree-compile`` with :meth:`iree_flags`); code: a ``.vmfb``."""

    backend: ClassVar[str] = "iree"
    driver: ClassVar[str] = ""

    @property
    def iree_flags(self) -> list[str]:
        raise NotImplementedError

    def passes(self) -> Pipeline:
        return super().passes() + [("mxmoe-lower-to-linalg", None)]

    def check_options(self, *, extra_flags, interpret) -> None:
        if interpret:
            raise ValueError(f"interpret=True applies to cuda targets only, not {self.name}")

    def compile(self, module, parameters, *, extra_flags=(), interpret=False, timings, default_entry="main",
                **numerics):
        import time

        from mxmoe.compiler import iree_backend

        t0 = time.perf_counter()
        vmfb = iree_backend.compile_to_vmfb(str(module), self, list(extra_flags))
        timings["iree_compile_s"] = time.perf_counter() - t0
        return IreeCode(vmfb, driver=self.driver, function=default_entry)


#: IREE's data tiling and its mmt4d microkernel, for modules whose expert matmuls are mxmoe's C kernel (then the
#: router is the only matmul IREE compiles: its weight is packed at compile time and it runs the host's
#: dot-product instructions; gpt-oss-20b's router at 1 token 115 -> 22 us, docs/cpu.md). Not for the linalg
#: schedule, whose decode-once contraction IREE then fails to compile (vectors over its stack limit).
CPU_DATA_TILING = ("--iree-opt-data-tiling", "--iree-llvmcpu-enable-ukernels=all")


@dataclass(frozen=True)
class CpuTarget(IreeTarget):
    """This machine's CPU (llvm-cpu): the blocksplit layout, and the C microkernel linked in when it builds here.

    ``activations``: "bf16" (default: the activations as the layer has them; bf16 exact on AVX512-BF16 hosts, on
    AMX tiles with bf16 layers' weights in ``cpu-mxfp4-rows16`` where the host has them, int16 per block on AVX2
    ones), "mxint16" (opt-in: every expert matmul reads its activations as 15-bit integers per
    32-value block, below bf16's resolution, split into two int8 planes for ``vpdpbusd``: faster than "bf16" up to
    ~16 rows per expert, slower past ~32) or "mxint8" (opt-in: OCP MXINT8 activations, 1-2% error, the fastest);
    both int8 forms keep the weights in the ``cpu-mxfp4-rows16`` layout and need the C microkernel (docs/cpu.md)."""

    activations: str = "bf16"
    driver: ClassVar[str] = "local"
    ACTIVATIONS: ClassVar[tuple[str, ...]] = ("bf16", "mxint8", "mxint16")

    def with_activations(self, activations: str) -> "CpuTarget":
        if activations not in self.ACTIVATIONS:
            raise ValueError(f"target {self.name}: activations must be one of {', '.join(self.ACTIVATIONS)}, "
                             f"got {activations!r}")
        return self.replace(activations=activations, layout=CPU_BLOCKSPLIT if activations == "bf16" else CPU_ROWS16)

    def layout_for(self, dtype: str) -> Layout:
        """The weight layout of a layer whose activations are ``dtype`` ("bf16", "f16", "f32"): the target's, but for
        bf16 layers with the default activations on a host whose microkernel runs the AMX form (rows16)."""
        from mxmoe.kernels.cpu import bf16_layout, matvec_object

        uk = matvec_object()
        if dtype == "bf16" and self.activations == "bf16" and uk.path and bf16_layout(uk.flavor) == "rows16":
            return CPU_ROWS16
        return self.layout

    @property
    def iree_flags(self) -> list[str]:
        # cpu=host alone takes the features of the CPU *model* (a Zen 4 guest gets AVX-512 although its
        # hypervisor does not expose it); features=host asks the CPU what it can actually run
        return ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
                "--iree-llvmcpu-target-cpu=host", "--iree-llvmcpu-target-cpu-features=host"]

    def passes(self) -> Pipeline:
        from mxmoe.kernels.cpu import ENV_SWITCH, matvec_object

        option = None
        uk = matvec_object()
        if uk.path and "," in str(uk.path):
            raise ValueError(f"target {self.name}: the cpu microkernel's path may not contain a comma (the pass "
                             f"options' separator): {uk.path}; set MXMOE_CACHE_DIR elsewhere")
        passes = Target.passes(self)
        if uk.path:
            option = f"ukernel={uk.path},activations={self.activations}"
            if self.layout_for("bf16") != self.layout:
                # bf16 layers' weights in rows16 for the AMX form (kernels/cpu/bf16_rows16.c), the others blocksplit
                passes = [(name, f"{opt},bf16={CPU_ROWS16.name}" if name == "mxmoe-assign-layout" else opt)
                          for name, opt in passes]
        elif self.activations != "bf16":
            raise ValueError(f"target {self.name}: activations='{self.activations}' runs on the C microkernel only, "
                             f"which is not available here ({uk.reason})")
        elif not uk.reason.startswith(ENV_SWITCH):
            _warn_once(f"mxmoe: the cpu microkernel is not available ({uk.reason}); compiling the linalg matvec "
                       "instead, which measured 3-4x slower (docs/cpu.md)")
        return passes + [("mxmoe-lower-to-linalg", option)]

    def compile(self, module, parameters, *, extra_flags=(), **kwargs):
        from mxmoe.compiler import iree_backend
        from mxmoe.kernels.cpu import MATMUL_SYMBOLS

        text = str(module)
        if not any(sym in text for sym in MATMUL_SYMBOLS):
            return super().compile(module, parameters, extra_flags=extra_flags, **kwargs)
        try:
            return super().compile(module, parameters, extra_flags=[*CPU_DATA_TILING, *extra_flags], **kwargs)
        except iree_backend.CompileError as e:
            if "large vector sizes" not in str(e):
                raise
            # data tiling of an f32 dense matmul fused with its consumer (an f32 layer's shared expert in the int8
            # forms) exceeds iree-compile's vector limit: such a module compiles without it (its router then on
            # IREE's plain matmul codegen)
            return super().compile(module, parameters, extra_flags=extra_flags, **kwargs)

    def numerics_options(self, *, deterministic: bool | None, batch_invariant: bool) -> dict[str, bool]:
        # Always deterministic (no atomics); batch invariant where the C microkernel computes each row alone
        # (bf16/f16 layers; the routing is batch invariant for every layer): docs/routing.md. Accepted, recorded.
        return {}

    def record(self, code, mlir: str = "") -> dict[str, Any]:
        from mxmoe.core.host import cpu_features
        from mxmoe.kernels.cpu import MATMUL_SYMBOLS

        # the C microkernel is linked into the module, whose MLIR calls it by these symbols
        microkernel = any(sym in mlir for sym in MATMUL_SYMBOLS)
        return {**super().record(code, mlir), "cpu_features": cpu_features(), "cpu_microkernel": microkernel,
                "activations": self.activations, **self.numerics_record(True, microkernel)}

    @property
    def runnable_here(self) -> bool:
        return True


@dataclass(frozen=True)
class RocmTarget(IreeTarget):
    """An AMD GPU through IREE's HIP backend: the row-major layout, lowered to row blocks fed to the matrix cores
    (``compiler/passes/lowering/rocm_grouped.py``, docs/amd.md).

    ``activations``: "bf16" (default: MXFP4 weights dequantized in registers to bf16, ``v_mfma_f32_*_bf16``) or
    "mxfp8" (activations quantized to MXFP8 per token, the scaled MFMA ``v_mfma_scale_f32_*_f8f6f4`` of gfx950;
    K padded to a multiple of :data:`SCALED_K`)."""

    activations: str = "bf16"
    driver: ClassVar[str] = "hip"
    #: the activation forms the lowering has, and the archs with a scaled MFMA (the "mxfp8" form)
    ACTIVATIONS: ClassVar[tuple[str, ...]] = ("bf16", "mxfp8")
    SCALED_MFMA_ARCHS: ClassVar[tuple[str, ...]] = ("gfx950",)
    #: the K of one scaled MFMA (16x16x128): K must be a multiple of it
    SCALED_K: ClassVar[int] = 128

    @property
    def iree_flags(self) -> list[str]:
        return ["--iree-hal-target-device=hip", f"--iree-rocm-target={self.arch}"]

    def with_activations(self, activations: str) -> "RocmTarget":
        if activations not in self.ACTIVATIONS:
            raise ValueError(f"target {self.name}: activations must be one of {', '.join(self.ACTIVATIONS)}, "
                             f"got {activations!r}")
        if activations == "mxfp8" and self.arch not in self.SCALED_MFMA_ARCHS:
            raise ValueError(f"target {self.name}: activations='mxfp8' feeds the scaled MFMA of "
                             f"{', '.join(self.SCALED_MFMA_ARCHS)}; {self.arch} has none (its bf16 MFMA takes the "
                             "activations as they are)")
        return self.replace(activations=activations)

    #: the weight decode of the bf16 form by arch: gfx950 converts MXFP4 to bf16 in one instruction
    #: (``arith.scaling_extf``); elsewhere integer ops are 4-5x fewer instructions than its expansion
    HARDWARE_DECODE_ARCHS: ClassVar[tuple[str, ...]] = ("gfx950",)

    def passes(self) -> Pipeline:
        pad = self.pad_multiple
        if self.activations == "mxfp8":
            pad = int(np.lcm(pad, self.SCALED_K))
        decode = "scaling_extf" if self.arch in self.HARDWARE_DECODE_ARCHS else "int"
        return Target.passes(self.replace(pad_multiple=pad)) + [
            ("mxmoe-lower-to-linalg", f"activations={self.activations},decode={decode}")]

    def record(self, code, mlir: str = "") -> dict[str, Any]:
        return {**super().record(code, mlir), "activations": self.activations}


@dataclass(frozen=True)
class CudaTarget(Target):
    """An NVIDIA GPU through Triton: a kernel plan and its cubins, compiled ahead of time for the arch.

    ``activations``: "bf16" (default: the activations as the layer has them, MXFP4 weights upcast for the MMA) or
    "mxfp8" (w4a8: the expert GEMMs read the activations quantized to MXFP8 inside the plan's kernels; sm_100 feeds
    both operands with their scales to the block-scaled tcgen05 MMA, sm_90 runs fp8 wgmma on weights decoded to
    e4m3 with their scales folded per K step; both read the weights row-major: ``kernels/triton/_w4a8_kernels.py``,
    docs/nvidia.md)."""

    activations: str = "bf16"
    backend: ClassVar[str] = "triton"
    ACTIVATIONS: ClassVar[tuple[str, ...]] = ("bf16", "mxfp8")

    def with_activations(self, activations: str) -> "CudaTarget":
        if activations not in self.ACTIVATIONS:
            raise ValueError(f"target {self.name}: activations must be one of {', '.join(self.ACTIVATIONS)}, "
                             f"got {activations!r}")
        if activations == self.activations:
            return self
        # the w4a8 kernels read the checkpoint's row-major values (the Hopper words are a bf16-decode layout)
        layout = ROW_MAJOR if activations == "mxfp8" else dict(TARGET_LAYOUTS)[self.name]
        return self.replace(activations=activations, layout=layout)

    @property
    def runs_torch_tensors(self) -> bool:
        return True

    @property
    def sm(self) -> int:
        return int(self.arch.removeprefix("sm_"))

    def check_options(self, *, extra_flags, interpret) -> None:
        if extra_flags:
            raise ValueError(f"extra_flags are iree-compile flags; target {self.name} compiles with Triton")

    def check_module(self, module) -> None:
        """Refuse mxmoe ops whose semantics the Triton kernels do not implement (NotImplementedError naming it), so a
        layer never runs another routing or activation than its own. The kernels' tables are the planner's."""
        from mxmoe.compiler import dialect
        from mxmoe.kernels.triton.planner import ACTIVATIONS, ROUTINGS

        def refuse(what: str) -> None:
            raise NotImplementedError(f"target {self.name}: {what} is not built for the Triton path yet (IREE "
                                      f"targets compile it)")

        for op in dialect.walk_mxmoe(module.operation):
            v = dialect.OpView(op)
            if op.name == "mxmoe.route" and v.attr("routing") not in ROUTINGS:
                refuse(f"routing '{v.attr('routing')}'")
            elif "activation" in op.attributes and v.attr("activation") not in ACTIVATIONS:
                refuse(f"activation '{v.attr('activation')}'")

    def numerics_options(self, *, deterministic: bool | None, batch_invariant: bool) -> dict[str, bool]:
        # the plan's options (mxmoe.kernels.triton.kernel_plan.PlanOptions). Deterministic by default: on the H100
        # it cost under 1% at 1-16384 tokens for gpt-oss-20b/120b (docs/routing.md); batch_invariant implies it
        if deterministic is False and batch_invariant:
            raise ValueError("batch_invariant=True implies deterministic: do not pass deterministic=False with it")
        if batch_invariant and self.activations != "bf16":
            raise ValueError(f"target {self.name}: activations={self.activations!r} has no batch-invariant form (its "
                             "small token tiles swap the MMA's operands); compile with activations='bf16'")
        return {"deterministic": deterministic is not False, "batch_invariant": batch_invariant}

    def compile(self, module, parameters, *, extra_flags=(), interpret=False, timings, default_entry="main",
                deterministic: bool = False, batch_invariant: bool = False):
        from mxmoe.compiler.triton_backend import compile_triton

        self.check_module(module)
        plans, binaries = compile_triton(module, parameters, self, interpret=interpret, timings=timings,
                                         deterministic=deterministic, batch_invariant=batch_invariant,
                                         activations=self.activations)
        # one plan per entry over one weight set; the default (first) entry's stays where single-entry modules keep it
        first, *rest = plans
        return TritonCode(plans[first], binaries[first], interpret=interpret, entry_name=first,
                          more={name: (plans[name], binaries[name]) for name in rest})

    def record(self, code, mlir: str = "") -> dict[str, Any]:
        options = (getattr(code, "plan", None) or {}).get("options") or {}
        return {**super().record(code, mlir), "activations": self.activations,
                **self.numerics_record(options.get("deterministic", False), options.get("batch_invariant", False))}


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)


#: the cuda targets' default (bf16-activation) weight layouts
TARGET_LAYOUTS = (("cuda:sm_90", TRITON_HOPPER_TILED), ("cuda:sm_100", ROW_MAJOR))

TARGETS: dict[str, Target] = {t.name: t for t in (
    CpuTarget("cpu", "host", CPU_BLOCKSPLIT, device="this kind of CPU"),
    RocmTarget("rocm:gfx942", "gfx942", ROW_MAJOR, device="an AMD MI300 GPU (gfx942)"),
    RocmTarget("rocm:gfx950", "gfx950", ROW_MAJOR, device="an AMD MI355 GPU (gfx950)"),
    # sm_90: weights decoded in registers by the kernels (the Hopper layout); sm_100: the checkpoint order,
    # fed to tl.dot_scaled
    CudaTarget("cuda:sm_90", "sm_90", TRITON_HOPPER_TILED, device="an NVIDIA Hopper GPU (sm_90)"),
    CudaTarget("cuda:sm_100", "sm_100", ROW_MAJOR, device="an NVIDIA Blackwell GPU (sm_100)"),
)}


def rocm_form_on_cpu(arch: str = "gfx942", activations: str = "bf16") -> Target:
    """A cpu target compiling exactly the linalg ``rocm:{arch}`` emits (its row-major layout, padding, activation
    form and weight decode: ``lowering/rocm_grouped.py``), so the AMD lowering's numerics are measured on this
    machine without an AMD GPU (tests, benchmarks/amd_isa.py)."""
    rocm = get_target(f"rocm:{arch}").with_activations(activations)

    @dataclass(frozen=True)
    class RocmFormOnCpu(CpuTarget):
        def passes(self):
            return rocm.passes()

    return RocmFormOnCpu(f"cpu (the {rocm.name} lowering, activations={activations})", "host", rocm.layout,
                         rocm.pad_multiple, device="this kind of CPU")


def get_target(name: "str | Target") -> Target:
    if isinstance(name, Target):
        return name
    try:
        return TARGETS[str(name).strip().lower()]
    except KeyError:
        raise ValueError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}") from None
