"""The stored form of a weight: how a logical array (checkpoint order, unpadded) becomes the array a compiled
module reads, and back. numpy only.

The compiler's passes decide each weight global's stored form and record it as attributes; the compiler turns
those into a :class:`StoredForm` per parameter and applies it when it writes the weights, and the artifact keeps
the forms in its manifest, so the runtime applies the very same transform to raw checkpoint weights at deploy
time without the compiler.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping

import numpy as np

from mxmoe.core.layouts import get_layout
from mxmoe.core.mxfp4 import E8M0_NAN


@dataclass(frozen=True)
class StoredForm:
    """What turns a logical weight array into the array a compiled module reads."""

    shape: tuple[int, ...]                # logical shape (before padding)
    padded_shape: tuple[int, ...]         # shape after padding (== shape when unpadded)
    pad_value: int = 0                    # fill for padded elements (as the stored integer/float value)
    pad_halves: bool = False              # axis 1 holds two halves (gate | up): pad each half
    layout: str | None = None             # named layout applied after padding; None = as is
    role: str | None = None               # "values", "scales" or "bias" for weights with a layout

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StoredForm":
        d = dict(d)
        d["shape"], d["padded_shape"] = tuple(d["shape"]), tuple(d["padded_shape"])
        return cls(**d)

    def apply(self, name: str, array: np.ndarray) -> np.ndarray:
        """The stored array for ``array`` (raises ValueError naming ``name`` on a shape mismatch or a NaN)."""
        if tuple(array.shape) != tuple(self.shape):
            raise ValueError(f"weight '{name}': expected shape {list(self.shape)}, got {list(array.shape)}")
        refuse_nan(name, self.role, array)
        out = pad_array(array, self.padded_shape, self.pad_value, self.pad_halves)
        if self.layout is not None:
            out = get_layout(self.layout, name).encode(self.role or "", out)
        return np.ascontiguousarray(out)

    def invert(self, name: str, stored: np.ndarray) -> np.ndarray:
        """The logical array ``stored`` was made from: layout undone, padding sliced off."""
        if tuple(stored.shape) != tuple(self.padded_shape):
            raise ValueError(f"weight '{name}': expected stored shape {list(self.padded_shape)}, got {list(stored.shape)}")
        a = stored if self.layout is None else get_layout(self.layout, name).decode(self.role or "", stored)
        if self.pad_halves and self.padded_shape[1] != self.shape[1]:
            h, hp = self.shape[1] // 2, self.padded_shape[1] // 2
            a = np.concatenate([a[:, :h], a[:, hp:hp + h]], axis=1)
        return a[tuple(slice(0, d) for d in self.shape)]


def refuse_nan(name: str, role: str | None, a: np.ndarray) -> None:
    """ValueError naming the weight and its first bad index if it holds a NaN or an infinity (a float), or the E8M0
    NaN scale 0xFF (MXFP4 scales). Compiled modules do not propagate them as the reference does (their routing
    picks experts around a NaN logit), so every weight is checked once, when it is put in its stored form."""
    a = np.asarray(a)
    if not a.size:
        return
    # max/min first: no temporary array (a gpt-oss-20b layer's 25 MB of scales in under 1 ms); NaN wins both
    if role == "scales" and a.dtype == np.uint8:
        if a.max() != E8M0_NAN:
            return
        bad, what = a == E8M0_NAN, "the scale byte 0xFF (NaN in E8M0)"
    elif a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        with np.errstate(invalid="ignore"):
            if np.isfinite(a.max()) and np.isfinite(a.min()):
                return
        bad, what = ~np.isfinite(a), None
    else:
        return
    if bad.any():
        index = np.unravel_index(int(np.argmax(bad)), a.shape)
        what = what or str(a[index])
        raise ValueError(f"weight '{name}' holds {what} at index {[int(i) for i in index]}; mxmoe refuses NaN and "
                         "infinite weights")


def pad_array(a: np.ndarray, shape: tuple[int, ...], fill, halves: bool = False) -> np.ndarray:
    """Pad ``a`` at the end of each axis up to ``shape`` with ``fill``.

    With ``halves`` the second axis is two equal halves (a concatenated gate|up projection), and each
    half is padded on its own so that gate row i and up row i stay paired.
    """
    shape = tuple(int(s) for s in shape)
    if tuple(a.shape) == shape:
        return a
    if len(shape) != a.ndim or any(s < d for s, d in zip(shape, a.shape)):
        raise ValueError(f"cannot pad shape {list(a.shape)} to {list(shape)}")
    if halves:
        if a.shape[1] % 2 or shape[1] % 2:
            raise ValueError(f"pad_halves needs an even axis 1, got {a.shape[1]} -> {shape[1]}")
        h = a.shape[1] // 2
        half_shape = (shape[0], shape[1] // 2) + shape[2:]
        return np.concatenate([pad_array(a[:, :h], half_shape, fill), pad_array(a[:, h:], half_shape, fill)], axis=1)
    out = np.full(shape, fill, dtype=a.dtype)
    out[tuple(slice(0, d) for d in a.shape)] = a
    return out


def store_parameters(forms: Mapping[str, StoredForm], params: Mapping[str, np.ndarray],
                     labels: Mapping[str, str] | None = None) -> dict[str, np.ndarray]:
    """Apply each parameter's stored form; every global must have its array and vice versa. Errors name a weight by
    ``labels[global]`` where given (the model's name for it), else by its global's name."""
    missing = sorted(set(forms) - set(params))
    if missing:
        raise ValueError(f"no array for weight global(s): {', '.join(missing)}")
    labels = labels or {}
    return {name: forms[name].apply(labels.get(name, name), params[name]) for name in forms}
