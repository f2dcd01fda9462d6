"""mxmoe.core: what every other layer shares, in numpy (no torch, no MLIR, no triton at import).

The layer config, the MXFP4 codec, a layer's weights, the weight layouts and stored forms, checkpoint IO,
entry signatures, and the numpy reference of the MoE semantics.
"""
