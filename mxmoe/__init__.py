"""mxmoe: an MLIR-based compiler and runtime for MXFP4 Mixture-of-Experts layers.

Importing ``mxmoe`` is cheap and needs no torch: the layers (``mxmoe.torch_frontend``,
``mxmoe.compiler``, ``mxmoe.runtime``) load on first use.
"""

from mxmoe.core._version import __version__
from mxmoe.core.config import MoEConfig, preset

__all__ = ["__version__", "MoEConfig", "preset", "compile", "convert"]


def compile(source, target: str = "cpu", **options):  # noqa: A001 - mirrors torch.compile's name on purpose
    """Compile an nn.Module (with ``example_inputs=``) or an ExportedProgram for ``target``.

    Thin forwarder so ``mxmoe.compile`` works without importing the compiler at ``import mxmoe``.
    """
    from mxmoe.torch_frontend.compile import compile as _compile

    return _compile(source, target=target, **options)


def convert(model, **options):
    """Replace the MoE blocks of ``model`` (transformers' gpt-oss and common families) by mxmoe layers, in place;
    returns the report. Forwarder to :func:`mxmoe.torch_frontend.convert` (docs/transformers.md)."""
    from mxmoe.torch_frontend.convert import convert as _convert

    return _convert(model, **options)
