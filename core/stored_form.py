"""The stored form of a weight: how a logical array (checkpoint order, unpadded) becomes the array a compiled
module reads, and back. numpy only.

The compiler's passes decide each weight global's stored form and record it as attributes; the compiler turns
those into a :class:`StoredForm` per parameter and applies it when it writes the weights, and the artifact keeps
the forms in its manifest, so the runtime applies the very same transform to raw checkpoint weights at deploy
time without the compiler.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from mxmoe.core.layouts import get_layout


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
        """The stored array for ``array`` (raises ValueError naming ``name`` on a shape mismatch)."""
        if tuple(array.shape) != tuple(self.shape):
            raise ValueError(f"weight '{name}': expected shape {list(self.shape)}, got {list(array.shape)}")
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
