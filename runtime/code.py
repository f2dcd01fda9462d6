"""A compiled module's code, in the runtime's hands: everything a backend produced except the weights.

Two kinds, one class each: :class:`IreeCode` (a ``.vmfb``: the cpu and rocm targets) and :class:`TritonCode` (a
kernel plan and its cubins: the cuda targets). Each knows how it sits in an artifact (its manifest record and
sections), whether this machine can run it, which weight format its executor binds, and how to make that
executor. The compiler's targets make them; the artifact writer, the loader, ``mxmoe.compile``'s modules and the
torch.compile cache only use this interface, so a new kind of code is one class here (and its target in the
compiler), with no backend names tested anywhere else.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

#: Section kinds (the artifact's ``sections[].kind``); a reader keeps and lists kinds it does not know.
KIND_VMFB = "iree-vmfb"
KIND_IRPA = "iree-parameter-archive"
KIND_SAFETENSORS = "safetensors"
KIND_CUBIN = "cubin"


class TargetUnavailableError(RuntimeError):
    """The module was compiled for a device this machine does not have."""


@dataclass(frozen=True)
class CodeSection:
    """One section of code to write into an artifact: its name, kind and bytes."""

    name: str
    kind: str
    data: bytes


def _needs(target: Mapping[str, Any]) -> str:
    return target.get("device") or target.get("arch") or target.get("name", "?")


# ============================================================================================= IREE

@dataclass
class IreeCode:
    """An IREE module (``.vmfb``) and the HAL driver family it was compiled for (``local``: the CPU; ``hip``)."""

    vmfb: bytes
    driver: str = "local"
    function: str = "main"
    kind = "iree"
    weights_format = KIND_IRPA
    #: the executor takes numpy arrays (callers' torch tensors are bridged, outputs bridged back)
    takes_tensors = False

    def record(self) -> dict:
        return {"kind": KIND_VMFB, "section": "module.vmfb", "function": self.function, "driver": self.driver}

    def sections(self) -> list[CodeSection]:
        return [CodeSection("module.vmfb", KIND_VMFB, bytes(self.vmfb))]

    def describe(self) -> str:
        return f"{KIND_VMFB} ({len(self.vmfb) / 1024:.1f} KB), function {self.function}, driver {self.driver}"

    @classmethod
    def from_record(cls, record: Mapping[str, Any], target: Mapping[str, Any], read) -> "IreeCode":
        # artifacts written before the record named its driver: the cpu target ran locally, the rest on hip
        driver = record.get("driver") or ("local" if target.get("arch") == "host" else "hip")
        return cls(read(record["section"]), driver=driver, function=record.get("function", "main"))

    def _driver(self, target: Mapping[str, Any], device: str | None) -> str:
        if self.driver == "local":
            if device in (None, "cpu", "local-task"):
                return "local-task"
            if device == "local-sync":
                return "local-sync"
            raise TargetUnavailableError(f"target {target.get('name')} runs on the CPU; device {device!r} cannot run "
                                         "it (use cpu, local-task or local-sync)")
        return self.driver

    def check_runnable(self, target: Mapping[str, Any], device: str | None = None) -> None:
        """Raise :class:`TargetUnavailableError` unless this machine can run the module on ``device``."""
        try:
            import iree.runtime as rt
        except ImportError:
            raise TargetUnavailableError(f"target {target.get('name')} runs on IREE, and the IREE runtime is not "
                                         "installed (pip install iree-base-runtime)") from None
        driver = self._driver(target, device)
        if self.driver == "local":
            from mxmoe.core.host import cpu_features

            have = cpu_features()
            missing = [f for f in target.get("cpu_features") or [] if have is not None and f not in have]
            if missing:
                raise TargetUnavailableError(f"compiled for a CPU with {', '.join(missing)}, which this CPU lacks; "
                                             "recompile it on this machine")
            return
        try:
            available = bool(rt.get_driver(driver).query_available_devices())
        except Exception:  # noqa: BLE001 - any failure means: no usable device of that driver
            available = False
        if not available:
            raise TargetUnavailableError(f"target {target.get('name')} needs {_needs(target)}; this machine has none")

    def executor(self, parameters, target: Mapping[str, Any], device: str | None = None):
        """The loaded module with ``parameters`` (an IREE parameter index over a memory-mapped archive, or stored
        arrays by name) bound; see :meth:`entry`."""
        from mxmoe.runtime.iree_executor import IreeExecutor

        return IreeExecutor(self.vmfb, parameters, driver=self._driver(target, device), function=self.function)

    def entry(self, executor, name: str):
        """``(*numpy arrays) -> [numpy arrays]`` running entry ``name`` (a function of the module)."""
        return executor if name == self.function else executor.function(name)


# ============================================================================================= Triton

@dataclass
class TritonCode:
    """A Triton kernel plan (plain data, ``mxmoe.kernels.triton``) and its ahead-of-time cubins by plan kernel
    (none when compiled with ``interpret=True``: its kernels then run under Triton's interpreter)."""

    plan: dict
    binaries: dict[str, bytes] = field(default_factory=dict)
    interpret: bool = False
    kind = "triton"
    weights_format = KIND_SAFETENSORS
    #: the executor takes torch tensors (CUDA tensors stay on their device)
    takes_tensors = True

    def record(self) -> dict:
        return {"kind": "triton", "kernel_plan": self.plan,
                "binaries": {k: f"binary/{section_name(k)}" for k in self.binaries}}

    def sections(self) -> list[CodeSection]:
        return [CodeSection(f"binary/{section_name(k)}", KIND_CUBIN, bytes(blob)) for k, blob in self.binaries.items()]

    def describe(self) -> str:
        return f"triton kernel plan, {len(self.binaries)} kernel binaries"

    @classmethod
    def from_record(cls, record: Mapping[str, Any], target: Mapping[str, Any], read) -> "TritonCode":
        binaries = {k: read(v) for k, v in (record.get("binaries") or {}).items()}
        return cls(record.get("kernel_plan"), binaries)

    def check_runnable(self, target: Mapping[str, Any], device: str | None = None) -> None:
        if device == "interpret" or self.interpret:
            return  # Triton's interpreter runs the plan's kernels on the CPU (slow; for tests)
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except Exception:  # noqa: BLE001 - no torch, or a torch without CUDA
            has_cuda = False
        if not has_cuda:
            raise TargetUnavailableError(f"target {target.get('name')} needs {_needs(target)} with torch CUDA; "
                                         "this machine has none")

    def executor(self, parameters, target: Mapping[str, Any], device: str | None = None):
        from mxmoe.runtime.triton_executor import TritonExecutor  # imports torch and triton: not on the IREE path

        interpret = self.interpret or device == "interpret"
        with warnings.catch_warnings():
            # weights may be read-only views of a mapped artifact; the executor copies them to the device
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return TritonExecutor(self.plan, parameters, self.binaries, device=None if interpret else device,
                                  mode="interpret" if interpret else "auto")

    def entry(self, executor, name: str):
        """The callable of entry ``name``: a Triton module has one entry (the compiler refuses others)."""
        return executor


def section_name(s: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in s)


#: the manifest's ``module.kind`` -> the class that reads it
CODE_KINDS = {KIND_VMFB: IreeCode, "triton": TritonCode}


def code_from_record(record: Mapping[str, Any], target: Mapping[str, Any], read) -> IreeCode | TritonCode:
    """The code an artifact's ``module`` record describes; ``read(section name) -> bytes`` reads its sections."""
    cls = CODE_KINDS.get(record.get("kind"))
    if cls is None:
        raise ValueError(f"unknown module kind {record.get('kind')!r} (known: {', '.join(CODE_KINDS)})")
    return cls.from_record(record, target, read)
