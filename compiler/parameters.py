"""The stored form of every weight a compiled module reads, taken from what the passes recorded.

After the pass pipeline, each ``util.global`` bound to a parameter may carry ``mxmoe.padded_from`` /
``mxmoe.pad_value`` / ``mxmoe.pad_halves`` (from mxmoe-pad) and ``mxmoe.layout`` / ``mxmoe.weight_role``
(from mxmoe-assign-layout). :func:`stored_forms` reads them; :func:`store_parameters` applies them to
the imported arrays, so padding and layout cost nothing at run time.
"""

from __future__ import annotations

import numpy as np
from iree.compiler import ir

from mxmoe.compiler import dialect
from mxmoe.compiler.passes import pad
from mxmoe.core.stored_form import StoredForm, store_parameters  # noqa: F401  (store_parameters: where callers found it)

LAYOUT, ROLE = dialect.LAYOUT_ATTR, dialect.ROLE_ATTR


def stored_forms(module_op: ir.Operation) -> dict[str, StoredForm]:
    """Parameter-backed global name -> its StoredForm."""
    forms = {}
    for op in module_op.regions[0].blocks[0].operations:
        op = op.operation
        if op.name != "util.global" or "initial_value" not in op.attributes:
            continue
        if "flow.parameter" not in str(op.attributes["initial_value"]):
            continue
        attrs = op.attributes
        stored = tuple(dialect.shape(ir.RankedTensorType(ir.TypeAttr(attrs["type"]).value)))
        logical = tuple(ir.DenseI64ArrayAttr(attrs[pad.PADDED_FROM])) if pad.PADDED_FROM in attrs else stored
        forms[dialect.py_attr(attrs["sym_name"])] = StoredForm(
            shape=tuple(int(d) for d in logical), padded_shape=stored,
            pad_value=int(dialect.py_attr(attrs[pad.PAD_VALUE])) if pad.PAD_VALUE in attrs else 0,
            pad_halves=pad.PAD_HALVES in attrs,
            layout=dialect.py_attr(attrs[LAYOUT]) if LAYOUT in attrs else None,
            role=dialect.py_attr(attrs[ROLE]) if ROLE in attrs else None)
    return forms
