"""Entry-point signatures and the input checks the runtime does against them. No torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from mxmoe.core.bridge import DTYPES, is_tensor, numpy_dtype, to_numpy


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str                       # "bfloat16", "float32", ...
    shape: tuple[int | None, ...]    # None marks a dynamic dim
    max_dims: tuple[int | None, ...] | None = None  # upper bounds of dynamic dims, where known

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TensorSpec":
        if d.get("dtype") not in DTYPES:
            raise ValueError(f"tensor spec {d.get('name')!r}: unknown dtype {d.get('dtype')!r}")
        md = d.get("max_dims")
        return cls(d["name"], d["dtype"], tuple(d["shape"]), tuple(md) if md is not None else None)

    def describe(self) -> str:
        dims = ", ".join("?" if s is None else str(s) for s in self.shape)
        return f"{self.name}: {self.dtype}[{dims}]"

    def static_nbytes(self) -> int:
        """Bytes of one tensor of this spec, its dynamic dims taken as 1 (a parameter's size; an input's per token)."""
        n = numpy_dtype(self.dtype).itemsize
        for d in self.shape:
            n *= d if d is not None else 1
        return n


def as_numpy(value: Any) -> tuple[np.ndarray, bool]:
    """(numpy view/copy of value, whether it was a torch tensor). torch is never imported here."""
    if is_tensor(value):
        if value.device.type != "cpu":
            raise ValueError(f"this module runs on the CPU; got a tensor on {value.device}")
        return to_numpy(value), True
    return np.asarray(value), False


def check_inputs(specs: Sequence[TensorSpec], values: Sequence[Any]) -> tuple[list[np.ndarray], bool]:
    """Validate and convert inputs; float inputs are cast to the entry's float dtype."""
    if len(values) != len(specs):
        want = ", ".join(s.describe() for s in specs)
        raise ValueError(f"expected {len(specs)} input(s) ({want}), got {len(values)}")
    out, any_torch = [], False
    for spec, v in zip(specs, values):
        a, was_torch = as_numpy(v)
        any_torch |= was_torch
        want = numpy_dtype(spec.dtype)
        if a.dtype != want:
            if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
                if want.kind != "f" and want.name != "bfloat16":
                    raise ValueError(f"input '{spec.name}': expected {spec.dtype}, got {a.dtype}")
                a = a.astype(want)
            else:
                raise ValueError(f"input '{spec.name}': expected {spec.dtype}, got {a.dtype}")
        check_shape(spec, a.shape)
        out.append(np.ascontiguousarray(a))
    return out, any_torch


def check_shape(spec: TensorSpec, shape: Sequence[int], min_dynamic: int = 0) -> None:
    """Rank, static dims and dynamic-dim bounds of one input; ValueError naming the input otherwise. A dynamic dim
    may be 0 (an empty batch: see :func:`empty_outputs`)."""
    shape = tuple(int(d) for d in shape)
    if len(shape) != len(spec.shape):
        raise ValueError(f"input '{spec.name}': expected rank {len(spec.shape)} ({spec.describe()}), got shape {shape}")
    for i, (got, exp) in enumerate(zip(shape, spec.shape)):
        if exp is not None and got != exp:
            raise ValueError(f"input '{spec.name}': dim {i} must be {exp} ({spec.describe()}), got shape {shape}")
        if exp is None:
            hi = spec.max_dims[i] if spec.max_dims else None
            if got < min_dynamic or (hi is not None and got > hi):
                raise ValueError(f"input '{spec.name}': dynamic dim {i} = {got} is outside {min_dynamic}..{hi or 'inf'}")


@dataclass(frozen=True)
class EntrySignature:
    """One entry point of a compiled module: its name (the function it runs) and its tensors."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "inputs": [s.to_dict() for s in self.inputs],
                "outputs": [s.to_dict() for s in self.outputs]}

    @classmethod
    def from_dict(cls, d: dict) -> "EntrySignature":
        return cls(d["name"], tuple(TensorSpec.from_dict(s) for s in d["inputs"]),
                   tuple(TensorSpec.from_dict(s) for s in d["outputs"]))

    def describe(self) -> str:
        ins = ", ".join(s.describe() for s in self.inputs)
        outs = ", ".join(s.describe() for s in self.outputs)
        return f"{self.name}({ins}) -> {outs}"


def _dynamic_lead(spec: TensorSpec) -> int | None:
    """How many leading dims of ``spec`` are dynamic when all the rest are static, else None."""
    lead = next((i for i, d in enumerate(spec.shape) if d is not None), len(spec.shape))
    return lead if all(d is not None for d in spec.shape[lead:]) else None


def outputs_follow_input(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> bool:
    """Whether every output leads with the first input's dynamic (batch) dims and nothing else dynamic, as an MoE
    layer's ``[?, H] -> [?, H]`` does: what :func:`empty_outputs` needs, and what lets a call be split along them."""
    n_in = _dynamic_lead(inputs[0]) if inputs else None
    return bool(n_in) and all(_dynamic_lead(out) == n_in for out in outputs)


def empty_outputs(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], shape: Sequence[int]) -> list[tuple]:
    """The output shapes for a call whose first input, of ``shape``, holds no elements (an empty batch), without
    running anything: each output takes the input's leading (batch) dims and its own static trailing dims, as an MoE
    layer's ``[?, H] -> [?, H]`` does. ValueError for an entry whose outputs do not follow its input that way."""
    n_in = _dynamic_lead(inputs[0])
    if n_in is None or n_in == 0:
        raise ValueError(f"an empty input cannot run this entry ({inputs[0].describe()}): its output shapes do not "
                         "follow from the input's")
    lead = tuple(shape[: len(shape) - (len(inputs[0].shape) - n_in)])
    shapes = []
    for out in outputs:
        n_out = _dynamic_lead(out)
        if n_out != n_in:
            raise ValueError(f"an empty input cannot run this entry: output {out.describe()} does not follow input "
                             f"{inputs[0].describe()}")
        shapes.append(lead + tuple(out.shape[n_out:]))
    return shapes
