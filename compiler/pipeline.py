"""The pass pipelines, one per target backend, from imported torch IR to backend input."""

from __future__ import annotations

from mxmoe.compiler.passes import run_passes
from mxmoe.compiler.targets import Target


def mxmoe_pipeline(target: Target) -> list[tuple[str, str | None]]:
    """Passes that turn torch IR with mxmoe custom ops into fused, laid-out mxmoe ops."""
    return [
        ("mxmoe-convert-torch-ops", None),
        ("mxmoe-verify", None),
        ("mxmoe-fuse", None),
        ("mxmoe-pad", str(target.pad_multiple)),
        ("mxmoe-assign-layout", target.layout),
        ("mxmoe-verify", None),
    ]


def iree_pipeline(target: Target) -> list[tuple[str, str | None]]:
    return mxmoe_pipeline(target) + [("mxmoe-lower-to-linalg", None)]


def run_for_target(module, target: Target) -> None:
    run_passes(module, iree_pipeline(target) if target.backend == "iree" else mxmoe_pipeline(target))
