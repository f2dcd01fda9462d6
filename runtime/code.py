"""A compiled module's code, in the runtime's hands: everything a backend produced except the weights.

Two kinds, one class each: :class:`IreeCode` (a ``.vmfb``: the cpu and rocm targets) and :class:`TritonCode` (a
kernel plan and its cubins: the cuda targets). Each knows how it sits in an artifact (its manifest record and
sections), whether this machine can run it, which weight format its executor binds, and how to make that
executor. The compiler's targets make them; the artifact writer, the loader, ``mxmoe.compile``'s modules and the
torch.compile cache only use this interface, so a new kind of code is one class here (and its target in the
compiler), with no backend names tested anywhere else.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

#: Section kinds (the artifact's ``sections[].kind``); a reader keeps and lists kinds it does not know.
KIND_VMFB = "iree-vmfb"
KIND_IRPA = "iree-parameter-archive"
KIND_SAFETENSORS = "safetensors"
KIND_CUBIN = "cubin"

#: a CPU module's calls are split so that each piece's input rows hold about 1 / CPU_CHUNK_WEIGHT_SHARE of the weights'
#: bytes (IreeCode.token_chunk), within these token counts.  Pieces that small keep the per-token cost at its level of
#: a few hundred tokens up to 262,144 tokens (E=32 k=4 H=I=512: ~1.5 K tokens a piece), while the weights, streamed
#: once per piece, stay a small share of it (gpt-oss-20b: ~9 K tokens): docs/cpu.md, "Per-token cost"
CPU_CHUNK_WEIGHT_SHARE = 8
CPU_TOKEN_CHUNK_RANGE = (1024, 65536)
CPU_TOKEN_CHUNK_ENV = "MXMOE_CPU_TOKEN_CHUNK"


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

    def token_chunk(self, weight_bytes: int, token_bytes: int) -> int | None:
        """The most tokens one call of a CPU module runs (larger calls run in pieces: runtime/module.py), for
        ``weight_bytes`` of parameters and ``token_bytes`` of input row; the environment's ``MXMOE_CPU_TOKEN_CHUNK``
        overrides it (0: never split). None on GPUs."""
        if self.driver != "local":
            return None
        if CPU_TOKEN_CHUNK_ENV in os.environ:
            value = os.environ[CPU_TOKEN_CHUNK_ENV].strip()
            if not value.isdigit():
                raise ValueError(f"{CPU_TOKEN_CHUNK_ENV} must be a number of tokens (0: never split), got {value!r}")
            return int(value) or None
        lo, hi = CPU_TOKEN_CHUNK_RANGE
        return min(max(weight_bytes // (CPU_CHUNK_WEIGHT_SHARE * max(token_bytes, 1)), lo), hi)

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
    """Triton kernel plans (plain data, ``mxmoe.kernels.triton``) and their ahead-of-time cubins by plan kernel (none
    when compiled with ``interpret=True``: the kernels then run under Triton's interpreter): one plan per entry
    point, over one weight set. ``plan`` / ``binaries`` are the first (default) entry's, ``more`` the others' by
    name."""

    plan: dict
    binaries: dict[str, bytes] = field(default_factory=dict)
    interpret: bool = False
    #: the first entry's name (the function it was compiled from)
    entry_name: str = "main"
    #: the other entries: name -> (plan, binaries)
    more: dict[str, tuple[dict, dict[str, bytes]]] = field(default_factory=dict)
    kind = "triton"
    weights_format = KIND_SAFETENSORS
    #: the executor takes torch tensors (CUDA tensors stay on their device)
    takes_tensors = True

    @property
    def plans(self) -> dict[str, dict]:
        """Every entry's plan, by entry name (the default first)."""
        return {self.entry_name: self.plan, **{name: plan for name, (plan, _) in self.more.items()}}

    def _sections(self, entry: str | None, binaries: dict[str, bytes]) -> dict[str, str]:
        prefix = "binary/" if entry is None else f"binary/{section_name(entry)}."
        return {k: prefix + section_name(k) for k in binaries}

    def record(self) -> dict:
        rec = {"kind": "triton", "kernel_plan": self.plan, "binaries": self._sections(None, self.binaries)}
        if self.more:
            rec["entry"] = self.entry_name
            rec["entries"] = {name: {"kernel_plan": plan, "binaries": self._sections(name, binaries)}
                              for name, (plan, binaries) in self.more.items()}
        return rec

    def sections(self) -> list[CodeSection]:
        out = [CodeSection(sec, KIND_CUBIN, bytes(self.binaries[k])) for k, sec in
               self._sections(None, self.binaries).items()]
        for name, (_, binaries) in self.more.items():
            out += [CodeSection(sec, KIND_CUBIN, bytes(binaries[k])) for k, sec in
                    self._sections(name, binaries).items()]
        return out

    def describe(self) -> str:
        n = len(self.binaries) + sum(len(b) for _, b in self.more.values())
        entries = f" for {1 + len(self.more)} entries" if self.more else ""
        return f"triton kernel plan{'s' if self.more else ''}{entries}, {n} kernel binaries"

    @classmethod
    def from_record(cls, record: Mapping[str, Any], target: Mapping[str, Any], read) -> "TritonCode":
        binaries = {k: read(v) for k, v in (record.get("binaries") or {}).items()}
        more = {name: (e.get("kernel_plan"), {k: read(v) for k, v in (e.get("binaries") or {}).items()})
                for name, e in (record.get("entries") or {}).items()}
        return cls(record.get("kernel_plan"), binaries, entry_name=record.get("entry", "main"), more=more)

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
        """The first entry's executor; with several entries, ``executor.entries`` maps every entry's name to its
        executor (one copy of the weights on the device, shared)."""
        from mxmoe.runtime.triton_executor import TritonExecutor  # imports torch and triton: not on the IREE path

        interpret = self.interpret or device == "interpret"
        kwargs = dict(device=None if interpret else device, mode="interpret" if interpret else "auto")
        with warnings.catch_warnings():
            # weights may be read-only views of a mapped artifact; the executor copies them to the device
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            first = TritonExecutor(self.plan, parameters, self.binaries, **kwargs)
            first.entries = {self.entry_name: first}
            # an entry may read weights the first one does not (the shared expert of modular_routed + shared): the
            # first's device copies where it has them, the others converted for that entry
            for name, (plan, binaries) in self.more.items():
                first.entries[name] = TritonExecutor(plan, {**parameters, **first.params}, binaries, **kwargs)
        return first

    def entry(self, executor, name: str):
        """The callable of entry ``name``: the executor of its plan."""
        entries = getattr(executor, "entries", None) or {}
        if name in entries:
            return entries[name]
        if not self.more:
            return executor  # a module of one entry (whatever its function was called)
        raise ValueError(f"no entry point {name!r} (this module has: {', '.join(entries)})")


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
