"""From lowered MLIR to an IREE module: iree-compile for the target, errors made readable."""

from __future__ import annotations

from iree.compiler import compile_str
from iree.compiler.tools import CompilerToolError

from mxmoe.compiler.targets import Target


class CompileError(RuntimeError):
    """iree-compile rejected the lowered module (a bug in mxmoe, or an unsupported model)."""


def compile_to_vmfb(mlir_text: str, target: Target, extra_flags: list[str] | None = None) -> bytes:
    flags = [*target.iree_flags, "--iree-input-type=torch", *(extra_flags or [])]
    try:
        return compile_str(mlir_text, extra_args=flags)
    except CompilerToolError as e:
        msg = str(e)
        first = next((ln for ln in msg.splitlines() if "error:" in ln), msg.splitlines()[0] if msg else "")
        raise CompileError(f"iree-compile failed for target {target.name}: {first.strip()}") from e
