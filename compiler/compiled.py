"""``CompiledModule``: what ``mxmoe.compile`` returns. Kept apart from the compiler proper (which needs IREE's MLIR
bindings) so that a module written without weights can be read back and bound on a machine without the compiler
(:meth:`CompiledModule.from_artifact`: the engine's templates, the torch.compile cache)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from mxmoe.compiler.targets import Target, get_target
from mxmoe.core.signature import EntrySignature, TensorSpec
from mxmoe.core.stored_form import StoredForm
from mxmoe.runtime.artifact import save_module
from mxmoe.runtime.code import IreeCode, TritonCode
from mxmoe.runtime.module import EntryPoints


@dataclass
class CompiledModule:
    """A module compiled for one target, runnable in this process and savable as an artifact.

    Call it with torch tensors (returns torch tensors) or numpy arrays (returns numpy). Float inputs
    are cast to the entry's dtype; shapes and dtypes are checked against ``inputs``.
    """

    target: Target
    #: its entry points (the default first): ``cm(...)`` runs the first, ``cm.entry(name)`` any
    entries: list[EntrySignature]
    #: what the target compiled (``mxmoe.runtime.code``: IreeCode or TritonCode)
    code: IreeCode | TritonCode
    #: the stored arrays by parameter name (padded, in the target's layout); empty in a template without weights
    parameters: dict[str, np.ndarray]
    mlir: str
    #: each parameter's stored name, dtype and shape (kept when the arrays are not)
    parameter_specs: list[TensorSpec] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    #: per weight global: how the stored array was made from the logical one (padding, layout)
    stored_forms: dict[str, StoredForm] = field(default_factory=dict)
    #: what was compiled, when known: {"kind": "moe", "config": ..., "parameters": {field: global}} for an MoE layer
    model: dict | None = None
    _bound: EntryPoints | None = None

    @property
    def entry_names(self) -> list[str]:
        """The entries' names, the default first (as a loaded artifact's module lists them)."""
        return [e.name for e in self.entries]

    @property
    def inputs(self) -> list[TensorSpec]:
        return list(self.entries[0].inputs)

    @property
    def outputs(self) -> list[TensorSpec]:
        return list(self.entries[0].outputs)

    # the code's parts under the names callers know them by
    @property
    def vmfb(self) -> bytes | None:
        return getattr(self.code, "vmfb", None)

    @property
    def kernel_plan(self) -> dict | None:
        return getattr(self.code, "plan", None)

    @property
    def binaries(self) -> dict[str, bytes]:
        return getattr(self.code, "binaries", {})

    @property
    def interpret(self) -> bool:
        return getattr(self.code, "interpret", False)

    def without_weights(self) -> "CompiledModule":
        """A copy that holds no parameters (the torch.compile backend binds each layer's own)."""
        return dataclasses.replace(self, parameters={}, _bound=None)

    def with_parameters(self, parameters: dict[str, np.ndarray]) -> "CompiledModule":
        return dataclasses.replace(self, parameters=parameters, _bound=None)

    def save(self, path, weights: str = "embedded", **options) -> dict:
        """Write this module as one mxmoe artifact file (docs/artifact-format.md); returns its manifest."""
        options.setdefault("model", self.model)
        return save_module(path, target=self.target.record(self.code, self.mlir), code=self.code, entries=self.entries,
                           parameter_specs=self.parameter_specs,
                           parameters=self.parameters or None, stored_forms=self.stored_forms, weights=weights,
                           timings=self.timings, **options)

    def bound(self) -> EntryPoints:
        """This module with its parameters bound to an executor on this machine (made once)."""
        if self._bound is None:
            record = self.target.record(self.code, self.mlir)
            self.code.check_runnable(record)  # TargetUnavailableError (a RuntimeError) naming what is missing
            self._bound = EntryPoints(self.entries, self.code, self.code.executor(self.parameters, record),
                                      weight_bytes=sum(p.static_nbytes() for p in self.parameter_specs))
        return self._bound

    def executor(self):
        return self.bound().executor

    def entry(self, name: str):
        """Entry point ``name`` (e.g. "modular") as a callable module."""
        return self.bound().entry(name)

    def __call__(self, *args):
        return self.bound()(*args)

    @classmethod
    def from_artifact(cls, art) -> "CompiledModule":
        """The module an artifact holds, without its weights (``with_parameters`` binds some): the code, entries,
        parameter specs and stored forms, as the compiler made them; no MLIR."""
        m = art.manifest
        return cls(target=get_target(m["target"]["name"]), entries=[EntrySignature.from_dict(d) for d in m["entries"]],
                   code=art.code(), parameters={}, mlir="",
                   parameter_specs=[TensorSpec(p["name"], p["dtype"], tuple(p["shape"])) for p in m["parameters"]],
                   stored_forms={p["name"]: StoredForm.from_dict(p["form"]) for p in m["parameters"] if p.get("form")},
                   model=m.get("model"))
