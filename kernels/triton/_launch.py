"""One kernel launch described as data, so the same description can run now or compile ahead of time.

The forward builds a list of these; ``moe_forward`` launches them and ``aot_compile`` turns each
into a ``triton.compile`` call (tensors may then be on the ``meta`` device: only dtypes matter).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_POINTER_TYPES = {
    torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
    torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8",
}


def ensure_allocator() -> None:
    """Give Triton a torch allocator for kernels' global scratch (on-device TMA descriptors need one) when
    this thread has none; an allocator the application set is kept."""
    import triton
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    if current is None or type(current.get()).__name__ == "NullAllocator":
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


@dataclass(frozen=True)
class KernelLaunch:
    """A Triton kernel with its grid, run-time arguments (in order) and compile-time constants."""

    name: str
    kernel: Any  # triton JITFunction (or InterpretedFunction under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: dict[str, Any]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    # Run-time ints that must not be assumed divisible by 16 in an AOT build (token counts).
    dynamic_ints: frozenset[str] = field(default_factory=frozenset)

    def launch(self) -> None:
        """Run on the tensors' device: compiled on CUDA, under Triton's interpreter on CPU tensors."""
        if self.grid and min(self.grid) == 0:
            return
        on_cpu = any(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in self.args.values())
        if not on_cpu:
            ensure_allocator()
            self.kernel[self.grid](*self.args.values(), **self.constexprs,
                                   num_warps=self.num_warps, num_stages=self.num_stages)
            return
        from .kernels import interpreted, interpreter_scope

        with interpreter_scope():
            interpreted(self.kernel)[self.grid](*self.args.values(), **self.constexprs,
                                                num_warps=self.num_warps, num_stages=self.num_stages)

    def signature(self) -> tuple[dict[str, str], dict[tuple[int, ...], list]]:
        """(signature, attrs) in the form ``triton.compiler.ASTSource`` takes (Triton 3.6 to 3.9).

        Pointers are marked 16-byte aligned (torch's allocator guarantees it); ints are marked
        divisible by 16 when they are and are not token counts, the way the JIT would specialise.
        """
        sig: dict[str, str] = {}
        attrs: dict[tuple[int, ...], list] = {}
        for i, (name, value) in enumerate(self.args.items()):
            if isinstance(value, torch.Tensor):
                sig[name] = _POINTER_TYPES[value.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, bool):
                raise TypeError(f"{self.name}.{name}: pass flags as constexprs")
            elif isinstance(value, int):
                sig[name] = "i64" if abs(value) >= 2**31 else "i32"
                if name not in self.dynamic_ints and value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, float):
                sig[name] = "fp32"
            else:
                raise TypeError(f"{self.name}.{name}: unsupported argument {type(value)}")
        for name in self.constexprs:
            sig[name] = "constexpr"
        return sig, attrs
