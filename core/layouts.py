"""Weight layouts: how a kernel wants the packed MXFP4 values of an expert weight stored. numpy only.

The convention every checkpoint and the reference use is row-major: values ``[E, N, K/2]`` uint8 (two e2m1
codes a byte, low nibble = even k), scales ``[E, N, K/32]`` (one e8m0 byte per 32 along K), biases ``[E, N]``.
A layout re-arranges the values (and, for ``cpu-mxfp4-rows16`` only, the scales; biases stay row-major, shapes
stay the same) so that a kernel's loads and decode are cheap. Each :class:`Layout` carries the three things that
must agree: its name (the ``mxmoe.layout`` IR attribute and the artifact manifest's record), the encode/decode pair
applied on the host, and the flags a kernel is compiled for. :data:`LAYOUTS` is the one registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from mxmoe.core import swizzle

Permutation = Callable[[np.ndarray], np.ndarray]

#: weight roles a layout is applied to (the compiler records one per weight global)
ROLES = ("values", "scales", "bias")


def _same(a: np.ndarray) -> np.ndarray:
    return a


@dataclass(frozen=True)
class Layout:
    """One stored order of packed MXFP4 values (see the module docstring)."""

    name: str
    #: row-major values -> stored values, and its inverse (same shape and dtype)
    permute: Permutation = field(default=_same, repr=False, compare=False)
    unpermute: Permutation = field(default=_same, repr=False, compare=False)
    #: what a Triton GEMM is compiled for: Hopper words decoded in registers (``W_HOPPER``), stored in
    #: 64-row tiles (``W_TILES``); neither: packed bytes fed to ``tl.dot_scaled``
    hopper_words: bool = False
    tiles: bool = False
    summary: str = ""
    #: row-major scales -> stored scales, and its inverse (same shape and dtype): identity but for rows16
    permute_scales: Permutation = field(default=_same, repr=False, compare=False)
    unpermute_scales: Permutation = field(default=_same, repr=False, compare=False)

    def encode(self, role: str, row_major: np.ndarray) -> np.ndarray:
        """The stored array for a weight of ``role`` given in row-major order."""
        self._check_role(role)
        if role == "values":
            return self.permute(row_major).view(row_major.dtype)
        return self.permute_scales(row_major).view(row_major.dtype) if role == "scales" else row_major

    def decode(self, role: str, stored: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`encode` (reference checks read weights back out of artifacts)."""
        self._check_role(role)
        if role == "values":
            return self.unpermute(stored).view(stored.dtype)
        return self.unpermute_scales(stored).view(stored.dtype) if role == "scales" else stored

    def _check_role(self, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"layout {self.name}: unknown weight role {role!r} (known: {', '.join(ROLES)})")


ROW_MAJOR = Layout("mxfp4-rowmajor", summary="the checkpoint's order (ROCm targets; sm_100's tl.dot_scaled)")
CPU_BLOCKSPLIT = Layout(
    "cpu-mxfp4-blocksplit", swizzle.blocksplit_swizzle, swizzle.blocksplit_unswizzle,
    summary="per 32-value block, byte b holds values b and b+16, so each nibble plane of 8 bytes meets 8 "
            "consecutive activations (the cpu microkernel's SIMD lanes)")
CPU_ROWS16 = Layout(
    "cpu-mxfp4-rows16", swizzle.rows16_swizzle, swizzle.rows16_unswizzle,
    permute_scales=swizzle.rows16_scales, unpermute_scales=swizzle.rows16_unscales,
    summary="16 output rows interleaved per 32-value block (4 values of each row per 4 bytes, two nibble "
            "planes), scales likewise: one vpdpbusd accumulates 16 rows (the cpu target's activations='mxint8' and "
            "'mxint16')")
TRITON_HOPPER = Layout(
    "triton-mxfp4-hopper", swizzle.hopper_swizzle, swizzle.hopper_unswizzle, hopper_words=True,
    summary="32-bit words holding the 8 values one thread of a warpgroup MMA needs, their bits at bf16 "
            "positions (docs/nvidia.md)")
TRITON_HOPPER_TILED = Layout(
    "triton-mxfp4-hopper-tiled", swizzle.hopper_tiled_swizzle, swizzle.hopper_tiled_unswizzle, hopper_words=True,
    tiles=True, summary="Hopper words stored in 64-row groups, 128 bytes of K at a time (sm_90)")

#: name -> layout. "triton-mxfp4-kmajor" is what artifacts of mxmoe <= 0.1 called the row-major order of the
#: sm_100 target; it still reads.
LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in (ROW_MAJOR, CPU_BLOCKSPLIT, CPU_ROWS16, TRITON_HOPPER,
                                                        TRITON_HOPPER_TILED)}
_ALIASES = {"triton-mxfp4-kmajor": ROW_MAJOR}


def get_layout(name: str, what: str | None = None) -> Layout:
    """The layout called ``name``; ValueError naming the known ones (and ``what`` it was asked for) otherwise."""
    if isinstance(name, Layout):
        return name
    found = LAYOUTS.get(name) or _ALIASES.get(name)
    if found is None:
        who = f"weight '{what}': " if what else ""
        raise ValueError(f"{who}unknown layout '{name}' (known: {', '.join(sorted(LAYOUTS))})")
    return found


def known_layouts() -> list[str]:
    return sorted(LAYOUTS)
