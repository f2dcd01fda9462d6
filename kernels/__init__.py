"""mxmoe.kernels: the hand-written kernels and what builds them, importable without the compiler.

* :mod:`.triton`: the NVIDIA kernels (Triton), their planner, tile rules and ahead-of-time compiler.
* :mod:`.cpu`: the C microkernel the cpu target links, and its build.
"""
