"""A compiled module with its weights bound: what ``mxmoe.runtime.load`` and ``mxmoe.compile`` hand back.

Both call it the same way: inputs are checked against the entry signature, float inputs are converted to the
entry's dtype, numpy in gives numpy out and torch in gives torch out. Code whose executor takes tensors itself
(Triton: CUDA tensors stay on their device; any leading dims) gets them as they are and checks them itself.
"""

from __future__ import annotations

from typing import Sequence

from mxmoe.core.bridge import to_torch
from mxmoe.core.signature import TensorSpec, check_inputs


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
