"""How a weight array is stored for a target: padding plus a named layout. numpy only (no torch, no MLIR).

The compiler's passes decide each weight global's stored form and record it as attributes; the
compiler turns those into a :class:`StoredForm` per parameter, applies it when it writes the weights,
and the artifact keeps the forms in its manifest, so the runtime can apply the very same transform to
raw checkpoint weights at deploy time without the compiler.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

#: The convention's layout: values [E, N, K/2] (two e2m1 per byte, low nibble first), scales [E, N, K/32].
ROW_MAJOR = "mxfp4-rowmajor"

#: Triton (cuda) targets: the checkpoint's own K-contiguous order, stored unchanged.
TRITON_KMAJOR = "triton-mxfp4-kmajor"

Transform = Callable[[str, np.ndarray], np.ndarray]  # (role, array) -> array

#: layout name -> (to the stored array, back to the row-major array); role is "values", "scales" or "bias".
_LAYOUTS: dict[str, tuple[Transform, Transform]] = {}


#: CPU layout: within each 32-value block (16 bytes of a row), byte b holds value b in its low nibble and
#: value b + 16 in its high nibble, so each nibble plane of 8 consecutive bytes lines up with 8 consecutive
#: activations (the CPU lowering's SIMD lanes). Scales and biases stay row-major. Same shape and size as
#: row-major, so the weight globals keep their types.
CPU_BLOCKSPLIT = "cpu-mxfp4-blocksplit"


def blocksplit_swizzle(values: np.ndarray) -> np.ndarray:
    """Row-major packed e2m1 bytes [..., K/2] -> the blocksplit order (see :data:`CPU_BLOCKSPLIT`)."""
    v = np.asarray(values, dtype=np.uint8)
    if v.shape[-1] % 16:
        raise ValueError(f"blocksplit needs K/2 to be a multiple of 16 bytes, got {v.shape[-1]}")
    blocks = v.reshape(*v.shape[:-1], v.shape[-1] // 16, 16)
    nib = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)  # value order
    return (nib[..., :16] | (nib[..., 16:] << 4)).astype(np.uint8).reshape(v.shape)


def blocksplit_unswizzle(stored: np.ndarray) -> np.ndarray:
    """Inverse of :func:`blocksplit_swizzle`."""
    v = np.asarray(stored, dtype=np.uint8)
    if v.shape[-1] % 16:
        raise ValueError(f"blocksplit needs K/2 to be a multiple of 16 bytes, got {v.shape[-1]}")
    blocks = v.reshape(*v.shape[:-1], v.shape[-1] // 16, 16)
    nib = np.concatenate([blocks & 0x0F, blocks >> 4], axis=-1)  # value order 0..31
    pairs = nib.reshape(*blocks.shape[:-1], 16, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8).reshape(v.shape)


def _blocksplit(role: str, a: np.ndarray) -> np.ndarray:
    if role == "values":
        return blocksplit_swizzle(a).view(a.dtype)
    if role in ("scales", "bias"):
        return a
    raise ValueError(f"layout {CPU_BLOCKSPLIT}: unknown weight role {role!r}")


def register_layout(name: str, transform: Transform, inverse: Transform) -> None:
    """Make ``name`` a known layout: ``transform(role, row_major)`` gives the stored array and
    ``inverse(role, stored)`` gives it back (reference checks read weights out of artifacts)."""
    _LAYOUTS[name] = (transform, inverse)


def known_layouts() -> list[str]:
    return sorted(_LAYOUTS)


def _layout(name: str, what: str) -> tuple[Transform, Transform]:
    if name not in _LAYOUTS:
        raise ValueError(f"weight '{what}': unknown layout '{name}' (known: {', '.join(known_layouts())})")
    return _LAYOUTS[name]


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
            out = _layout(self.layout, name)[0](self.role or "", out)
        return np.ascontiguousarray(out)

    def invert(self, name: str, stored: np.ndarray) -> np.ndarray:
        """The logical array ``stored`` was made from: layout undone, padding sliced off."""
        if tuple(stored.shape) != tuple(self.padded_shape):
            raise ValueError(f"weight '{name}': expected stored shape {list(self.padded_shape)}, got {list(stored.shape)}")
        a = stored if self.layout is None else _layout(self.layout, name)[1](self.role or "", stored)
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


def _blocksplit_inverse(role: str, a: np.ndarray) -> np.ndarray:
    return blocksplit_unswizzle(a).view(a.dtype) if role == "values" else a


def _identity(role: str, a: np.ndarray) -> np.ndarray:
    return a


register_layout(ROW_MAJOR, _identity, _identity)
register_layout(TRITON_KMAJOR, _identity, _identity)
register_layout(CPU_BLOCKSPLIT, _blocksplit, _blocksplit_inverse)
