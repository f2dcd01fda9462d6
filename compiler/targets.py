"""Target names mxmoe compiles for, and what each one means for the pipeline."""

from __future__ import annotations

from dataclasses import dataclass

from mxmoe.core.layouts import CPU_BLOCKSPLIT, ROW_MAJOR, TRITON_HOPPER_TILED, Layout


@dataclass(frozen=True)
class Target:
    name: str           # canonical spelling, e.g. "rocm:gfx942"
    backend: str        # "iree" or "triton"
    arch: str           # "host", "gfx942", "sm_90", ...
    layout: Layout      # weight layout the lowering reads
    pad_multiple: int   # H and I are padded up to this

    @property
    def iree_flags(self) -> list[str]:
        if self.backend != "iree":
            raise ValueError(f"{self.name} is not an IREE target")
        if self.arch == "host":
            # cpu=host alone takes the features of the CPU *model* (a Zen 4 guest gets AVX-512 although
            # its hypervisor does not expose it); features=host asks the CPU what it can actually run
            return ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
                    "--iree-llvmcpu-target-cpu=host", "--iree-llvmcpu-target-cpu-features=host"]
        return ["--iree-hal-target-device=hip", f"--iree-rocm-target={self.arch}"]

    @property
    def runnable_here(self) -> bool:
        return self.arch == "host"


TARGETS = {
    # cpu: the blocksplit layout is what the grouped CPU lowering reads (compiler/passes/lowering/cpu_grouped.py)
    "cpu": Target("cpu", "iree", "host", CPU_BLOCKSPLIT, 32),
    "rocm:gfx942": Target("rocm:gfx942", "iree", "gfx942", ROW_MAJOR, 32),
    "rocm:gfx950": Target("rocm:gfx950", "iree", "gfx950", ROW_MAJOR, 32),
    # sm_90: weights decoded in registers by the kernels (the Hopper layout); sm_100: the checkpoint order,
    # fed to Blackwell's native MXFP4 MMA through tl.dot_scaled
    "cuda:sm_90": Target("cuda:sm_90", "triton", "sm_90", TRITON_HOPPER_TILED, 32),
    "cuda:sm_100": Target("cuda:sm_100", "triton", "sm_100", ROW_MAJOR, 32),
}


def get_target(name: str) -> Target:
    if isinstance(name, Target):
        return name
    try:
        return TARGETS[str(name).strip().lower()]
    except KeyError:
        raise ValueError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}") from None
