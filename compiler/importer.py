"""ExportedProgram -> MLIR (torch dialect + ``util.global`` weights), via IREE's fx_importer.

Weights and buffers are not inlined: each becomes a ``util.global`` bound to an externalized
parameter (``#flow.parameter.named<"model"::NAME>``), so the compiled module and the weights are
separate files and later passes can change a weight's layout by rewriting its global.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from iree.compiler import ir
from iree.compiler.extras.fx_importer import FxImporter, FxImporterHooks

from mxmoe.compiler.context import new_context
from mxmoe.core.bridge import to_numpy

#: Parameter scope name used in the compiled module and the parameter archive.
PARAMETER_SCOPE = "model"

_ELEMENT = {torch.uint8: "i8", torch.int8: "i8", torch.bfloat16: "bf16", torch.float16: "f16",
            torch.float32: "f32", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}


def global_name(target: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in target)


@dataclass
class Imported:
    """An imported program: the MLIR module and the parameter arrays its globals name."""

    module: ir.Module
    parameters: dict[str, np.ndarray] = field(default_factory=dict)


class _ParameterHooks(FxImporterHooks):
    def __init__(self, parameters: dict[str, np.ndarray]):
        self.parameters = parameters
        self.module_op = None

    def prepare_module(self, module_op):
        self.module_op = module_op

    def resolve_input(self, gni, value, info):
        if not isinstance(value, torch.Tensor) or info.mutable_producer_node_name is not None:
            return None
        if value.dtype not in _ELEMENT:
            raise ValueError(f"mxmoe import: weight '{info.input_spec.target}' has unsupported dtype {value.dtype}")
        name = global_name(info.input_spec.target)
        shape = "x".join(str(d) for d in value.shape)
        ty = ir.Type.parse(f"tensor<{shape}{'x' if shape else ''}{_ELEMENT[value.dtype]}>")
        if name not in self.parameters:
            self.parameters[name] = to_numpy(value)
            decl = ir.Operation.parse(
                f'util.global private @{name} = #flow.parameter.named<"{PARAMETER_SCOPE}"::"{name}"> : {ty}')
            ir.InsertionPoint.at_block_begin(self.module_op.regions[0].blocks[0]).insert(decl)
        loaded = ir.Operation.create("util.global.load", results=[ty],
                                     attributes={"global": ir.FlatSymbolRefAttr.get(name)}).result
        return ir.Operation.create("torch_c.from_builtin_tensor", results=[info.ir_type], operands=[loaded]).result


def import_program(ep: torch.export.ExportedProgram, func_name: str = "main",
                   context: ir.Context | None = None) -> Imported:
    """Import ``ep`` into a fresh MLIR module whose weights are parameter-backed globals."""
    return import_programs({func_name: ep}, context)


def import_programs(programs: dict[str, torch.export.ExportedProgram], context: ir.Context | None = None) -> Imported:
    """Import several programs (the entries of one layer) as functions of one module: a weight every program
    reads (same name) is one global, so one set of weights serves every entry."""
    for name, ep in programs.items():
        if not isinstance(ep, torch.export.ExportedProgram):
            raise TypeError(f"import_program expects a torch.export.ExportedProgram, got {type(ep).__name__} "
                            f"(entry {name!r})")
    ctx = context or new_context()
    params: dict[str, np.ndarray] = {}
    importer = FxImporter(context=ctx, hooks=_ParameterHooks(params))
    for name, ep in programs.items():
        importer.import_program(ep, func_name=name)
    return Imported(module=importer.module, parameters=params)
