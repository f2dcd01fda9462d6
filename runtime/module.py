"""A compiled module with its weights bound: what ``mxmoe.runtime.load`` and ``mxmoe.compile`` hand back.

Both call it the same way: inputs are checked against the entry signature, float inputs are converted to the
entry's dtype, numpy in gives numpy out and torch in gives torch out. Code whose executor takes tensors itself
(Triton: CUDA tensors stay on their device; any leading dims) gets them as they are and checks them itself.

An empty batch (a first input with no elements: 0 tokens, as an expert-parallel rank without tokens sends) runs
nothing: the outputs are empty arrays of the shapes ``mxmoe.core.signature.empty_outputs`` gives.

Code that says so (``token_chunk``: the CPU modules) runs a call of more tokens than that as consecutive calls of at
most that many, every per-token input sliced and the outputs joined: each token's result is computed from its own row
alone, so this changes no routing and only the f32 summation order of a matmul's rows (which path a work item takes
depends on how many rows its expert got), and it keeps the call's intermediates (~115 KB per token for gpt-oss-20b)
near the cache instead of growing with the token count; the size of a piece follows the weights' bytes
(``IreeCode.token_chunk``; docs/cpu.md, "Per-token cost").
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from mxmoe.core.bridge import numpy_dtype, to_torch
from mxmoe.core.signature import (EntrySignature, TensorSpec, check_inputs, check_shape, empty_outputs,
                                  outputs_follow_input)


class BoundModule:
    """Call it like the layer it was compiled from. Calls are safe from several threads at once (the executors
    serialise them)."""

    def __init__(self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], executor, takes_tensors: bool,
                 guard=None, token_chunk: int | None = None):
        self.inputs, self.outputs = list(inputs), list(outputs)
        self._executor = executor
        self._takes_tensors = takes_tensors
        self._guard = guard  # called before every call (a loaded artifact checks its file did not change)
        # tokens per executor call, where the entry's outputs follow its first input's leading dim (the module
        # docstring); the inputs whose leading dim is dynamic are the per-token ones, sliced into the pieces
        self._token_chunk = token_chunk if token_chunk and outputs_follow_input(self.inputs, self.outputs) else None
        self._per_token = [bool(s.shape) and s.shape[0] is None for s in self.inputs]
        # inputs of a program exported for one token count (every dim static): a tensor-taking executor, which
        # checks only the trailing dims, must not run another count
        self._fixed = [(i, spec) for i, spec in enumerate(self.inputs) if spec.shape and None not in spec.shape]

    @property
    def executor(self):
        return self._executor

    @property
    def token_chunk(self) -> int | None:
        """The most tokens one executor call runs (longer calls run in pieces), or None: never split."""
        return self._token_chunk

    def __call__(self, *args):
        if self._guard is not None:
            self._guard()
        if self._takes_tensors:
            if len(args) != len(self.inputs):
                want = ", ".join(s.describe() for s in self.inputs)
                raise ValueError(f"expected {len(self.inputs)} input(s) ({want}), got {len(args)}")
            if math.prod(args[0].shape) == 0:
                self._check_trailing_dims(args[0].shape)
                return self._unpack([to_torch(o, device=args[0].device) for o in self._empty(args[0].shape)])
            for i, spec in self._fixed:
                check_shape(spec, tuple(args[i].shape))
            return self._executor(*args)  # it checks shapes itself ([..., H]: leading dims are flattened)
        arrays, any_torch = check_inputs(self.inputs, args)
        outs = self._empty(arrays[0].shape) if arrays[0].size == 0 else self._run(arrays)
        if any_torch:
            outs = [to_torch(o) for o in outs]
        return self._unpack(outs)

    def _run(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """The executor on these inputs, in calls of at most ``token_chunk`` tokens (see the module docstring); if a
        per-token input disagrees with the first input's token count, the module gets the call whole and reports it."""
        n, chunk, per_token = arrays[0].shape[0], self._token_chunk, self._per_token
        if not chunk or n <= chunk or any(t and a.shape[0] != n for a, t in zip(arrays, per_token)):
            return self._executor(*arrays)
        step = -(-n // -(-n // chunk))  # pieces of equal size (but the last), as few as the chunk allows
        outs: list[np.ndarray] | None = None
        for start in range(0, n, step):
            part = self._executor(*[a[start:start + step] if t else a for a, t in zip(arrays, per_token)])
            if outs is None:
                outs = [np.empty((n,) + p.shape[1:], p.dtype) for p in part]
            for o, p in zip(outs, part):
                o[start:start + len(p)] = p
        return outs

    @staticmethod
    def _unpack(outs):
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _empty(self, shape) -> list[np.ndarray]:
        return [np.zeros(s, numpy_dtype(o.dtype)) for s, o in zip(empty_outputs(self.inputs, self.outputs, shape),
                                                                   self.outputs)]

    def _check_trailing_dims(self, shape) -> None:
        """The static dims a tensor-taking executor would have checked ([..., H]: any leading dims)."""
        spec = self.inputs[0]
        static = tuple(d for d in spec.shape if d is not None)
        if len(shape) < len(spec.shape) or tuple(shape[len(shape) - len(static):]) != static:
            raise ValueError(f"input '{spec.name}': expected [..., {', '.join(map(str, static))}] "
                             f"({spec.describe()}), got shape {tuple(shape)}")

    def __repr__(self) -> str:
        sig = ", ".join(s.describe() for s in self.inputs)
        return f"<mxmoe module ({sig})>"


class EntryPoints:
    """The entries of one compiled module over one set of bound weights (``layer``, ``monolithic``,
    ``modular``...): calling it runs the default (first) entry; ``entry(name)`` gives another as a
    :class:`BoundModule`. Entries share the loaded code and weights."""

    def __init__(self, entries: Sequence[EntrySignature], code, executor, guard=None, weight_bytes: int = 0):
        if not entries:
            raise ValueError("a compiled module needs at least one entry point")
        self.entries = list(entries)
        self._code, self._executor, self._guard = code, executor, guard
        self._weight_bytes = weight_bytes  # what the executor bound: sizes the pieces of a long call
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
                                                self._code.takes_tensors, self._guard, self._token_chunk(sig))
        return self._bound[sig.name]

    def _token_chunk(self, sig: EntrySignature) -> int | None:
        chunk = getattr(self._code, "token_chunk", None)
        return chunk(self._weight_bytes, sig.inputs[0].static_nbytes()) if chunk and sig.inputs else None

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

