"""The kernel plan: what the compiler hands the Triton codegen and the runtime, as plain data.

A plan is a JSON-serialisable dict (see docs/nvidia.md for an example)::

  format        PLAN_FORMAT
  target, arch  "cuda:sm_90", 90
  layer         the layer's semantics (E, k, H, I, routing, activation, dtype, ...), for humans and checks
  input         {"name", "dtype", "hidden"}: the entry tensor [T, H] (or [..., H], flattened)
  parameters    global name -> {"role", "shape", "dtype"}: weights the kernels read, in the plan's layout
  buffers       name -> {"dtype", "shape": [expr...], "init": "zeros"?}: scratch allocated per call
  kernels       entry name -> {"kernel", "constexprs", "num_warps", "num_stages", "args": [arg...]}
                arg = {"name", "bind": "input"|"param"|"buffer"|"none"|"expr", "ref"?, "expr"?, "type"?}
  classes       [{"name", "max_tokens" (None = unbounded), "vars": {name: expr}, "tiles": {...},
                  "launches": [{"kernel": entry name, "grid": [expr...]}]}]
  output        {"buffer": name}: [T, H] in the input dtype

Expressions (grids, sizes, scalar args) are :mod:`.expr` strings over ``T`` (tokens) and the
class's ``vars``. Nothing here imports torch: the same helpers serve the compiler and the executor.
"""

from __future__ import annotations

from typing import Any, Mapping

from .expr import evaluate, names

PLAN_FORMAT = "mxmoe-triton-plan/1"

#: plan dtype name -> Triton pointer type
POINTER_TYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "int32": "*i32",
                 "int64": "*i64", "uint8": "*u8"}
SCALAR_TYPES = ("i32", "i64", "fp32")


class PlanError(ValueError):
    """A kernel plan is malformed or does not fit the inputs it is run with."""


def shape_class(plan: Mapping[str, Any], num_tokens: int) -> Mapping[str, Any]:
    """The class entry that runs ``num_tokens`` tokens."""
    for cls in plan["classes"]:
        if cls["max_tokens"] is None or num_tokens <= cls["max_tokens"]:
            return cls
    raise PlanError(f"no shape class of the plan covers {num_tokens} tokens")


def environment(cls: Mapping[str, Any], num_tokens: int) -> dict[str, int]:
    """Names bound for the class's expressions at ``num_tokens`` tokens (T, then its vars in order)."""
    env = {"T": int(num_tokens)}
    for name, expr in cls.get("vars", {}).items():
        env[name] = evaluate(expr, env)
    return env


def arg_type(plan: Mapping[str, Any], arg: Mapping[str, Any]) -> str:
    """Triton signature type of one kernel argument (``*bf16``, ``i32``, ...)."""
    bind = arg["bind"]
    if bind == "input":
        dtype = plan["input"]["dtype"]
    elif bind == "param":
        dtype = plan["parameters"][arg["ref"]]["dtype"]
    elif bind == "buffer":
        dtype = plan["buffers"][arg["ref"]]["dtype"]
    elif bind == "none":
        dtype = arg.get("dtype", "float32")
    elif bind == "expr":
        if arg.get("type") not in SCALAR_TYPES:
            raise PlanError(f"argument {arg['name']}: scalar type must be one of {SCALAR_TYPES}")
        return arg["type"]
    else:
        raise PlanError(f"argument {arg['name']}: unknown binding {bind!r}")
    if dtype not in POINTER_TYPES:
        raise PlanError(f"argument {arg['name']}: unsupported dtype {dtype!r}")
    return POINTER_TYPES[dtype]


def validate(plan: Mapping[str, Any]) -> None:
    """Check a plan's structure and cross references; raises :class:`PlanError` naming the problem."""
    if not isinstance(plan, Mapping) or plan.get("format") != PLAN_FORMAT:
        raise PlanError(f"not a kernel plan of format {PLAN_FORMAT!r}")
    for key in ("input", "parameters", "buffers", "kernels", "classes", "output"):
        if key not in plan:
            raise PlanError(f"kernel plan has no '{key}'")
    if plan["output"]["buffer"] not in plan["buffers"]:
        raise PlanError(f"output buffer {plan['output']['buffer']!r} is not a plan buffer")
    for name, entry in plan["kernels"].items():
        for arg in entry["args"]:
            arg_type(plan, arg)
            if arg["bind"] in ("param", "buffer"):
                table = plan["parameters"] if arg["bind"] == "param" else plan["buffers"]
                if arg["ref"] not in table:
                    raise PlanError(f"kernel {name}: argument {arg['name']} names unknown {arg['bind']} {arg['ref']!r}")
    if not plan["classes"] or plan["classes"][-1]["max_tokens"] is not None:
        raise PlanError("the last shape class must be unbounded (max_tokens None)")
    for cls in plan["classes"]:
        known = {"T"}
        for var, expr in cls.get("vars", {}).items():
            _check_names(expr, known, f"class {cls['name']} var {var}")
            known.add(var)
        for launch in cls["launches"]:
            if launch["kernel"] not in plan["kernels"]:
                raise PlanError(f"class {cls['name']} launches unknown kernel {launch['kernel']!r}")
            for e in launch["grid"]:
                _check_names(e, known, f"class {cls['name']} grid of {launch['kernel']}")
            for arg in plan["kernels"][launch["kernel"]]["args"]:
                if arg["bind"] == "expr":
                    _check_names(arg["expr"], known, f"kernel {launch['kernel']} argument {arg['name']}")
        for bname, buf in plan["buffers"].items():
            for e in buf["shape"]:
                _check_names(e, known, f"buffer {bname} (class {cls['name']})")


def _check_names(expr, known: set[str], where: str) -> None:
    unknown = names(expr) - known
    if unknown:
        raise PlanError(f"{where}: expression {expr!r} uses undefined {', '.join(sorted(unknown))}")


def write_bundle(directory, plan: Mapping[str, Any], binaries: Mapping[str, bytes]) -> None:
    """Write a plan and its cubins to ``directory`` (plan.json + one .cubin per kernel), e.g. to carry a
    plan built on a machine with the compiler to a GPU machine without it. Weights are not included."""
    import json
    import os

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "plan.json"), "w") as f:
        json.dump(plan, f, indent=1, sort_keys=True)
    for name, blob in binaries.items():
        with open(os.path.join(directory, f"{name}.cubin"), "wb") as f:
            f.write(blob)


def read_bundle(directory) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Inverse of :func:`write_bundle`: (plan, {kernel entry: cubin})."""
    import json
    import os

    with open(os.path.join(directory, "plan.json")) as f:
        plan = json.load(f)
    validate(plan)
    binaries = {}
    for name in plan["kernels"]:
        path = os.path.join(directory, f"{name}.cubin")
        if os.path.exists(path):
            with open(path, "rb") as f:
                binaries[name] = f.read()
    return plan, binaries


def plan_parameters(plan: Mapping[str, Any], logical: Mapping[str, Any]) -> dict[str, Any]:
    """The plan's parameters from logical weights (checkpoint order, unpadded: what an ``MoE`` layer holds),
    keyed like ``plan["parameters"]`` and ``logical`` by operand name ("w13", "w13_scale", ...): values are
    put into the plan's layout (torch tensors stay on their device). For binding plans built elsewhere
    (``benchmarks/gpu_moe.py --build``) to a layer's own buffers; ``mxmoe.compile`` does this itself."""
    import numpy as np

    from mxmoe.core.stored_form import StoredForm

    out = {}
    for glob, spec in plan["parameters"].items():
        a = logical[spec["operand"]]
        if spec["role"] == "values":
            form = StoredForm(tuple(a.shape), tuple(a.shape), layout=plan["layer"]["layout"], role="values")
            if hasattr(a, "detach"):  # a torch tensor
                import torch

                a = torch.from_numpy(form.apply(glob, a.detach().cpu().numpy())).to(a.device)
            else:
                a = form.apply(glob, np.asarray(a))
        out[glob] = a
    return out
