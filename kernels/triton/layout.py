"""Memory layouts of packed MXFP4 expert weights, as the grouped GEMMs read them.

The logical tensors are the checkpoint's: values [E, N, K/2] uint8 (two e2m1 codes a byte, low
nibble = even k) and scales [E, N, K/32] uint8 (e8m0). A layout is a reversible re-arrangement of
those two tensors; the kernels take the layout's ``k_contiguous`` flag as a compile-time constant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxmoe.core.layouts import ROW_MAJOR as CORE_ROW_MAJOR, TRITON_HOPPER, TRITON_HOPPER_TILED
from mxmoe.core.swizzle import hopper_swizzle, hopper_tiled_swizzle, hopper_tiled_unswizzle, hopper_unswizzle


@dataclass(frozen=True)
class WeightLayout:
    """``k_contiguous``: stored [E, N, K/2] / [E, N, K/32] (each output row's bytes contiguous along K)
    when True; stored [E, K/2, N] / [E, K/32, N] (N contiguous) when False. ``hopper``: the values are in
    :data:`mxmoe.core.layouts.TRITON_HOPPER` order (K-contiguous rows of re-arranged bytes, same shape), read
    by the kernels' decode-in-registers path. ``tiled``: Hopper words stored tile by tile
    (:data:`mxmoe.core.layouts.TRITON_HOPPER_TILED`, same shape)."""

    name: str
    k_contiguous: bool
    hopper: bool = False
    tiled: bool = False

    def swizzle(self, w: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Checkpoint tensors -> what the kernels read (a new contiguous copy when the order changes)."""
        _check_logical(w, w_scale)
        if self.hopper:
            return _on_host(hopper_tiled_swizzle if self.tiled else hopper_swizzle, w), w_scale.contiguous()
        if self.k_contiguous:
            return w.contiguous(), w_scale.contiguous()
        return w.transpose(-1, -2).contiguous(), w_scale.transpose(-1, -2).contiguous()

    def unswizzle(self, w: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`swizzle`."""
        if self.hopper:
            out = _on_host(hopper_tiled_unswizzle if self.tiled else hopper_unswizzle, w), w_scale.contiguous()
        elif self.k_contiguous:
            out = w.contiguous(), w_scale.contiguous()
        else:
            out = w.transpose(-1, -2).contiguous(), w_scale.transpose(-1, -2).contiguous()
        _check_logical(*out)
        return out

    def logical_shape(self, w: torch.Tensor) -> tuple[int, int, int]:
        """(E, N, K) of swizzled values ``w``, K counted in elements (two per byte)."""
        e, a, b = w.shape
        return (e, a, 2 * b) if self.k_contiguous else (e, b, 2 * a)


def _on_host(transform, w: torch.Tensor) -> torch.Tensor:
    """A numpy byte transform (same shape) applied to a tensor on any device; meta tensors (ahead-of-time
    planning) only need the shape."""
    if w.device.type == "meta":
        return w.contiguous()
    return torch.from_numpy(transform(w.detach().cpu().numpy())).to(w.device)


def _check_logical(w: torch.Tensor, w_scale: torch.Tensor) -> None:
    if w.dtype != torch.uint8 or w_scale.dtype != torch.uint8:
        raise TypeError(f"MXFP4 values and scales must be uint8, got {w.dtype} and {w_scale.dtype}")
    if w.dim() != 3 or w_scale.shape != (w.shape[0], w.shape[1], w.shape[2] * 2 // 32):
        raise ValueError(f"expected values [E, N, K/2] and scales [E, N, K/32], got {tuple(w.shape)} "
                         f"and {tuple(w_scale.shape)}")


#: The checkpoint's own order. Each tile's packed bytes are read as [BLOCK_K/2, BLOCK_N] with K the
#: contiguous axis, which is the K-packed rhs ``tl.dot_scaled`` takes; coalesced along K.
ROW_MAJOR = WeightLayout("row_major_nk", k_contiguous=True)
#: Transposed: N contiguous, so a warp's load spans output columns instead of K.
COL_MAJOR = WeightLayout("col_major_kn", k_contiguous=False)

LAYOUTS = {layout.name: layout for layout in (ROW_MAJOR, COL_MAJOR)}

#: The layout the compiler assigns for cuda targets (``mxmoe.core.layouts.TRITON_KMAJOR``): the checkpoint's
#: K-contiguous order, so its stored-form transform is the identity and scales stay [E, N, K/32].
KMAJOR = WeightLayout(CORE_ROW_MAJOR.name, k_contiguous=True)
#: The Hopper decode layout (``mxmoe.core.layouts.TRITON_HOPPER``): rows of re-arranged words.
HOPPER = WeightLayout(TRITON_HOPPER.name, k_contiguous=True, hopper=True)
#: What the compiler assigns for sm_90: the same words stored tile by tile
#: (``mxmoe.core.layouts.TRITON_HOPPER_TILED``).
HOPPER_TILED = WeightLayout(TRITON_HOPPER_TILED.name, k_contiguous=True, hopper=True, tiled=True)
for _layout in (KMAJOR, HOPPER, HOPPER_TILED):
    LAYOUTS[_layout.name] = _layout
