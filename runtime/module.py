"""A compiled module with its weights bound: what ``mxmoe.runtime.load`` and ``mxmoe.compile`` hand back.

Both call it the same way: inputs are checked against the entry signature, float inputs are converted to the
entry's dtype, numpy in gives numpy out and torch in gives torch out. Code whose executor takes tensors itself
(Triton: CUDA tensors stay on their device; any leading dims) gets them as they are and checks them itself.
"""

from __future__ import annotations

from typing import Sequence

from mxmoe.core.bridge import to_torch
from mxmoe.core.signature import EntrySignature, TensorSpec, check_inputs


class BoundModule:
    """Call it like the layer it was compiled from. Calls are safe from several threads at once (the executors
    serialise them)."""

    def __init__(self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], executor, takes_tensors: bool):
        self.inputs, self.outputs = list(inputs), list(outputs)
        self._executor = executor
        self._takes_tensors = takes_tensors

    @property
    def executor(self):
        return self._executor

    def __call__(self, *args):
        if self._takes_tensors:
            if len(args) != len(self.inputs):
                want = ", ".join(s.describe() for s in self.inputs)
                raise ValueError(f"expected {len(self.inputs)} input(s) ({want}), got {len(args)}")
            return self._executor(*args)  # it checks shapes itself ([..., H]: leading dims are flattened)
        arrays, any_torch = check_inputs(self.inputs, args)
        outs = self._executor(*arrays)
        if any_torch:
            outs = [to_torch(o) for o in outs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def __repr__(self) -> str:
        sig = ", ".join(s.describe() for s in self.inputs)
        return f"<mxmoe module ({sig})>"


class EntryPoints:
    """The entries of one compiled module over one set of bound weights (``layer``, ``monolithic``,
    ``modular``...): calling it runs the default (first) entry; ``entry(name)`` gives another as a
    :class:`BoundModule`. Entries share the loaded code and weights."""

    def __init__(self, entries: Sequence[EntrySignature], code, executor):
        if not entries:
            raise ValueError("a compiled module needs at least one entry point")
        self.entries = list(entries)
        self._code, self._executor = code, executor
        self._bound: dict[str, BoundModule] = {}

    @property
    def entry_names(self) -> list[str]:
        return [e.name for e in self.entries]

    def entry(self, name: str | None = None) -> BoundModule:
        sig = self.entries[0] if name is None else next((e for e in self.entries if e.name == name), None)
        if sig is None:
            raise ValueError(f"no entry point {name!r} (this module has: {', '.join(self.entry_names)})")
        if sig.name not in self._bound:
            self._bound[sig.name] = BoundModule(sig.inputs, sig.outputs, self._code.entry(self._executor, sig.name),
                                                self._code.takes_tensors)
        return self._bound[sig.name]

    @property
    def inputs(self) -> list[TensorSpec]:
        return list(self.entries[0].inputs)

    @property
    def outputs(self) -> list[TensorSpec]:
        return list(self.entries[0].outputs)

    @property
    def executor(self):
        return self._executor

    def __call__(self, *args):
        return self.entry()(*args)
