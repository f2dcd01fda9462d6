"""The pass pipelines, one per target backend, from imported torch IR to backend input."""

from __future__ import annotations

import functools
import warnings

from mxmoe.compiler.passes import run_passes
from mxmoe.compiler.targets import Target


def mxmoe_pipeline(target: Target) -> list[tuple[str, str | None]]:
    """Passes that turn torch IR with mxmoe custom ops into fused, laid-out mxmoe ops."""
    return [
        ("mxmoe-convert-torch-ops", None),
        ("mxmoe-verify", None),
        ("mxmoe-fuse", None),
        ("mxmoe-pad", str(target.pad_multiple)),
        ("mxmoe-assign-layout", target.layout.name),
        ("mxmoe-verify", None),
    ]


def iree_pipeline(target: Target) -> list[tuple[str, str | None]]:
    """The cpu target links the C microkernel when it could be built here (else the linalg-only lowering)."""
    option = None
    if target.arch == "host":
        from mxmoe.kernels.cpu import ENV_SWITCH, matvec_object

        uk = matvec_object()
        if uk.path:
            option = f"ukernel={uk.path}"
        elif not uk.reason.startswith(ENV_SWITCH):
            _warn_once(f"mxmoe: the cpu microkernel is not available ({uk.reason}); compiling the linalg matvec "
                       "instead, which measured 3-4x slower (docs/cpu.md)")
    return mxmoe_pipeline(target) + [("mxmoe-lower-to-linalg", option)]


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)


def run_for_target(module, target: Target) -> None:
    run_passes(module, iree_pipeline(target) if target.backend == "iree" else mxmoe_pipeline(target))
