"""Details behind ``mxmoe-lower-to-linalg``: MLIR text emitters, one module per lowering strategy.

* :mod:`.text`: small helpers that write linalg/tensor/arith as text with fresh SSA names.
* :mod:`.mxfp4`: exact MXFP4 decodes (e2m1 code x e8m0 scale -> f32) as op lines for generic bodies.
* :mod:`.cpu_grouped`: the CPU schedule of a grouped MXFP4 matmul (tokens sorted by expert, one
  kernel call per used expert, decode fused into the kernel's inner loop) for the ``cpu-mxfp4-blocksplit``
  weight layout.
"""
