"""The kernel plan: what the planner hands the Triton codegen and the runtime, as small typed objects.

A :class:`KernelPlan` is plain data. :meth:`KernelPlan.to_dict` writes, and :meth:`KernelPlan.from_dict`
reads (and checks), the JSON-serialisable dict of format :data:`PLAN_FORMAT` that artifacts and plan bundles
store (see docs/nvidia.md for an example)::

  format        PLAN_FORMAT
  target, arch  "cuda:sm_90", 90
  layer         the layer's semantics (E, k, H, I, routing, activation, dtype, ...), for humans and checks
  input         {"name", "dtype", "hidden"}: the entry tensor [T, H] (or [..., H], flattened)
  extra_inputs  (entries with more inputs) [{"name", "dtype", "hidden"}]: [T, hidden] each, after x
  parameters    global name -> {"role", "operand", "shape", "dtype"}: weights the kernels read, in the plan's layout
  buffers       name -> {"dtype", "shape": [expr...], "init": "zeros"?, "left_zero": true?}: scratch of a call
  kernels       entry name -> {"kernel", "constexprs", "num_warps", "num_stages", "args": [arg...]}
                arg = {"name", "bind": "input"|"param"|"buffer"|"none"|"expr", "ref"?, "expr"?, "type"?, "dtype"?}
  classes       [{"name", "max_tokens" (None = unbounded), "vars": {name: expr}, "tiles": {...},
                  "launches": [{"kernel": entry name, "grid": [expr...]}]}]
  output        {"buffer": name}: [T, H] in the input dtype
  options       {"deterministic": bool, "batch_invariant": bool, "activations"?: "mxfp8"}: the compile options
                (absent: all off / bf16)
  cubins        (added by codegen) entry name -> launch metadata of its cubin

Expressions (grids, sizes, scalar args) are :mod:`.expr` strings over ``T`` (tokens) and the
class's ``vars``. Nothing here imports torch or triton: the same objects serve the planner, the codegen and
the executor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Union

from .expr import Expr, evaluate, names

PLAN_FORMAT = "mxmoe-triton-plan/1"

#: plan dtype name -> Triton pointer type
POINTER_TYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "int32": "*i32",
                 "int64": "*i64", "uint8": "*u8"}
SCALAR_TYPES = ("i32", "i64", "fp32")


class PlanError(ValueError):
    """A kernel plan is malformed or does not fit the inputs it is run with."""


@dataclass(frozen=True)
class Arg:
    """One run-time argument of a kernel: where its value comes from (``bind``) and what it names."""

    name: str
    bind: str
    ref: str | None = None      # "param": the parameter's name; "buffer": the buffer's; "input": an extra input's
    expr: Expr | None = None    # "expr": the scalar's value
    type: str | None = None     # "expr": its Triton type (i32, i64, fp32)
    dtype: str | None = None    # "none": the dtype of the (absent) tensor

    @classmethod
    def input(cls, name: str, ref: str | None = None) -> "Arg":
        """An entry input: ``x`` (``ref`` None) or one of the plan's ``extra_inputs`` by name."""
        return cls(name, "input", ref)

    @classmethod
    def param(cls, name: str, ref: str) -> "Arg":
        return cls(name, "param", ref)

    @classmethod
    def buffer(cls, name: str, ref: str) -> "Arg":
        return cls(name, "buffer", ref)

    @classmethod
    def none(cls, name: str, dtype: str = "float32") -> "Arg":
        return cls(name, "none", dtype=dtype)

    @classmethod
    def scalar(cls, name: str, expr: Expr, type: str = "i32") -> "Arg":
        return cls(name, "expr", expr=expr, type=type)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "bind": self.bind}
        for key in ("ref", "expr", "type", "dtype"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Arg":
        return cls(d["name"], d["bind"], d.get("ref"), d.get("expr"), d.get("type"), d.get("dtype"))


@dataclass(frozen=True)
class KernelSpec:
    """One compiled kernel: which kernel (``mxmoe.kernels.triton.kernels.KERNELS``), its specialization
    constants, launch options and run-time arguments in order. Classes whose kernels coincide share one."""

    kernel: str
    constexprs: Mapping[str, Any]
    num_warps: int
    num_stages: int
    args: tuple[Arg, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "constexprs": dict(self.constexprs), "num_warps": self.num_warps,
                "num_stages": self.num_stages, "args": [a.to_dict() for a in self.args]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "KernelSpec":
        return cls(d["kernel"], dict(d["constexprs"]), d["num_warps"], d["num_stages"],
                   tuple(Arg.from_dict(a) for a in d["args"]))


@dataclass(frozen=True)
class Launch:
    """A kernel entry launched on a grid of expressions."""

    kernel: str
    grid: tuple[Expr, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "grid": list(self.grid)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Launch":
        return cls(d["kernel"], tuple(d["grid"]))


@dataclass(frozen=True)
class ShapeClass:
    """The launches for token counts up to ``max_tokens`` (None: unbounded), with the class's named sizes
    (``vars``, evaluated in order after ``T``) and its GEMM tiles (``tiles``: for humans and tools)."""

    name: str
    max_tokens: int | None
    vars: Mapping[str, Expr]
    tiles: Mapping[str, Mapping[str, Any]]
    launches: tuple[Launch, ...]

    def environment(self, num_tokens: int) -> dict[str, int]:
        """Names bound for the class's expressions at ``num_tokens`` tokens (T, then its vars in order)."""
        env = {"T": int(num_tokens)}
        for name, expr in self.vars.items():
            env[name] = evaluate(expr, env)
        return env

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "max_tokens": self.max_tokens, "vars": dict(self.vars),
                "tiles": {g: dict(t) for g, t in self.tiles.items()}, "launches": [lc.to_dict() for lc in self.launches]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ShapeClass":
        return cls(d["name"], d["max_tokens"], dict(d.get("vars", {})),
                   {g: dict(t) for g, t in d.get("tiles", {}).items()}, tuple(Launch.from_dict(lc) for lc in d["launches"]))


@dataclass(frozen=True)
class Buffer:
    """Scratch of one call: dtype and shape (expressions), ``init="zeros"`` when a kernel needs it zeroed;
    ``left_zero`` when the plan's kernels also leave it zero at the end of every whole call (counters that their
    last user resets, sums that their reader clears), so that scratch kept from call to call needs zeroing once,
    not every call. Runtimes that do not know the flag zero it every call, which stays correct."""

    dtype: str
    shape: tuple[Expr, ...]
    init: str | None = None
    left_zero: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape)}
        if self.init is not None:
            d["init"] = self.init
        if self.left_zero:
            d["left_zero"] = True
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Buffer":
        return cls(d["dtype"], tuple(d["shape"]), d.get("init"), bool(d.get("left_zero", False)))


@dataclass(frozen=True)
class Parameter:
    """A weight the kernels read: its role, the layer operand it holds, and its stored shape and dtype."""

    role: str
    operand: str
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "operand": self.operand, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Parameter":
        return cls(d["role"], d["operand"], tuple(d["shape"]), d["dtype"])


@dataclass(frozen=True)
class LayerInfo:
    """The layer's semantics as the plan records them (the kernels' constants say the same)."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    routing: str
    renormalize: bool
    activation: str
    alpha: float
    limit: float
    interleaved: bool
    dtype: str            # activation dtype: "bfloat16" | "float32"
    layout: str           # mxmoe.core.layouts name of the stored MXFP4 values
    #: the entry the plan runs (docs/interface.md): "layer" (x in, the layer's router), "monolithic" (x and the
    #: engine's router logits), "modular" (x and the engine's top-k weights and global ids), "shared" (x through
    #: the shared expert alone)
    entry: str = dataclasses.field(default="layer", kw_only=True)
    #: the experts routing picks from (router rows, logits width, expert map length); 0: num_experts
    global_experts: int = dataclasses.field(default=0, kw_only=True)
    #: the routing weight scales the token before the experts (top_k 1), the combine adds with weight 1
    weight_on_input: bool = dataclasses.field(default=False, kw_only=True)
    #: a shared expert (MXFP4, gate rows then up rows) of this intermediate size, 0 for none; gated by sigmoid
    shared_intermediate: int = dataclasses.field(default=0, kw_only=True)
    shared_gate: bool = dataclasses.field(default=False, kw_only=True)
    #: its weights: "mxfp4" (run as one more grouped expert) or "bf16" (the activation dtype: dense GEMMs)
    shared_format: str = dataclasses.field(default="mxfp4", kw_only=True)
    #: "sigmoid_topk"'s expert groups (docs/routing.md): keep the ``topk_group`` best of ``n_group``
    n_group: int = dataclasses.field(default=1, kw_only=True)
    topk_group: int = dataclasses.field(default=1, kw_only=True)
    #: every routing weight times this (``routed_scaling_factor``)
    scaling: float = dataclasses.field(default=1.0, kw_only=True)
    #: the router runs in fp32 (fp32 weights, an IEEE dot, logits not rounded; monolithic: fp32 logits in)
    router_fp32: bool = dataclasses.field(default=False, kw_only=True)

    @property
    def experts_routed(self) -> int:
        return self.global_experts or self.num_experts

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(LayerInfo)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LayerInfo":
        """Plans written before the entry fields lack them: the layer entry, no expert map, no shared expert."""
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(LayerInfo) if f.name in d or not f.kw_only})


@dataclass(frozen=True)
class PlanOptions:
    """Compile options a plan was made with (``mxmoe.compile(..., deterministic=, batch_invariant=)``).

    * ``deterministic``: the same input gives the same output bits on every call: no class adds more than two
      fp32 atomics into one output element (the combine writes per-slot rows and adds them in slot order where
      it would).
    * ``batch_invariant`` (implies ``deterministic``): a token's output bits do not depend on the other tokens of
      its batch: every class reduces along K the same way (one BLOCK_K, no split K) and combines the same way.
      (A token's routing is batch invariant in every plan: docs/routing.md.)
    """

    deterministic: bool = False
    batch_invariant: bool = False
    #: the form the expert GEMMs take the activations in: "bf16" (as the layer has them) or "mxfp8" (w4a8)
    activations: str = "bf16"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"deterministic": self.deterministic, "batch_invariant": self.batch_invariant}
        if self.activations != "bf16":  # plans of the default form read as before
            d["activations"] = self.activations
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "PlanOptions":
        d = d or {}
        return cls(bool(d.get("deterministic", False)), bool(d.get("batch_invariant", False)),
                   str(d.get("activations", "bf16")))


@dataclass(frozen=True)
class PlanInput:
    name: str
    dtype: str
    hidden: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "hidden": self.hidden}


@dataclass(frozen=True)
class KernelPlan:
    """A layer's kernels for one arch, per token-count class (see the module docstring). Constructing one
    checks its cross references and expressions; :meth:`from_dict` also its structure."""

    target: str
    arch: int
    layer: LayerInfo
    input: PlanInput
    parameters: Mapping[str, Parameter]
    buffers: Mapping[str, Buffer]
    kernels: Mapping[str, KernelSpec]
    classes: tuple[ShapeClass, ...]
    output: str                                   # the buffer holding [T, H] in the input dtype
    #: codegen's launch metadata per kernel entry (cubin function name, shared memory, scratch sizes, ...)
    cubins: Mapping[str, Mapping[str, Any]] | None = None
    #: the compile options it was made with (plans written before them: all off)
    options: PlanOptions = PlanOptions()
    #: entry inputs after ``x`` (the monolithic entry's router logits, the modular entry's top-k weights and ids),
    #: each [T, hidden] with T the tokens of x
    extra_inputs: tuple[PlanInput, ...] = ()

    def __post_init__(self) -> None:
        self._check()

    # ---------------------------------------------------------------------------------- queries
    def shape_class(self, num_tokens: int) -> ShapeClass:
        """The class that runs ``num_tokens`` tokens."""
        for cls in self.classes:
            if cls.max_tokens is None or num_tokens <= cls.max_tokens:
                return cls
        raise PlanError(f"no shape class of the plan covers {num_tokens} tokens")

    def arg_type(self, arg: Arg) -> str:
        """Triton signature type of one kernel argument (``*bf16``, ``i32``, ...)."""
        if arg.bind == "input":
            dtype = self.input.dtype if arg.ref in (None, self.input.name) else self.extra_input(arg.ref).dtype
        elif arg.bind == "param":
            dtype = self.parameters[arg.ref].dtype
        elif arg.bind == "buffer":
            dtype = self.buffers[arg.ref].dtype
        elif arg.bind == "none":
            dtype = arg.dtype or "float32"
        elif arg.bind == "expr":
            if arg.type not in SCALAR_TYPES:
                raise PlanError(f"argument {arg.name}: scalar type must be one of {SCALAR_TYPES}")
            return arg.type
        else:
            raise PlanError(f"argument {arg.name}: unknown binding {arg.bind!r}")
        if dtype not in POINTER_TYPES:
            raise PlanError(f"argument {arg.name}: unsupported dtype {dtype!r}")
        return POINTER_TYPES[dtype]

    def extra_input(self, name: str) -> PlanInput:
        for inp in self.extra_inputs:
            if inp.name == name:
                return inp
        raise PlanError(f"the plan has no input {name!r} (inputs: "
                        f"{', '.join([self.input.name] + [i.name for i in self.extra_inputs])})")

    def replace_constexprs(self, changes: Mapping[str, Mapping[str, Any]]) -> "KernelPlan":
        """A copy whose kernel entries have some constants changed: {entry name: {constant: value}}."""
        kernels = {name: dataclasses.replace(spec, constexprs={**spec.constexprs, **changes[name]})
                   if name in changes else spec for name, spec in self.kernels.items()}
        return dataclasses.replace(self, kernels=kernels)

    # ---------------------------------------------------------------------------------- checks
    def _check(self) -> None:
        if self.output not in self.buffers:
            raise PlanError(f"output buffer {self.output!r} is not a plan buffer")
        for name, entry in self.kernels.items():
            for arg in entry.args:
                self.arg_type(arg)
                if arg.bind in ("param", "buffer"):
                    table = self.parameters if arg.bind == "param" else self.buffers
                    if arg.ref not in table:
                        raise PlanError(f"kernel {name}: argument {arg.name} names unknown {arg.bind} {arg.ref!r}")
        if not self.classes or self.classes[-1].max_tokens is not None:
            raise PlanError("the last shape class must be unbounded (max_tokens None)")
        for cls in self.classes:
            known = {"T"}
            for var, expr in cls.vars.items():
                _check_names(expr, known, f"class {cls.name} var {var}")
                known.add(var)
            for launch in cls.launches:
                if launch.kernel not in self.kernels:
                    raise PlanError(f"class {cls.name} launches unknown kernel {launch.kernel!r}")
                for e in launch.grid:
                    _check_names(e, known, f"class {cls.name} grid of {launch.kernel}")
                for arg in self.kernels[launch.kernel].args:
                    if arg.bind == "expr":
                        _check_names(arg.expr, known, f"kernel {launch.kernel} argument {arg.name}")
            for bname, buf in self.buffers.items():
                for e in buf.shape:
                    _check_names(e, known, f"buffer {bname} (class {cls.name})")

    # ----------------------------------------------------------------------------- plain data
    def to_dict(self) -> dict[str, Any]:
        """The plan as format :data:`PLAN_FORMAT` (JSON-serialisable; keys in the order artifacts hold them)."""
        d = {
            "format": PLAN_FORMAT,
            "target": self.target,
            "arch": self.arch,
            "layer": self.layer.to_dict(),
            "input": self.input.to_dict(),
            "parameters": {name: p.to_dict() for name, p in self.parameters.items()},
            "buffers": {name: b.to_dict() for name, b in self.buffers.items()},
            "kernels": {name: k.to_dict() for name, k in self.kernels.items()},
            "classes": [c.to_dict() for c in self.classes],
            "output": {"buffer": self.output},
            "options": self.options.to_dict(),
        }
        if self.extra_inputs:
            d["extra_inputs"] = [i.to_dict() for i in self.extra_inputs]
        if self.cubins is not None:
            d["cubins"] = {name: dict(meta) for name, meta in self.cubins.items()}
        return d

    @classmethod
    def from_dict(cls, plan: Union[Mapping[str, Any], "KernelPlan"]) -> "KernelPlan":
        """Read (and check) a plan dict of format :data:`PLAN_FORMAT`; raises :class:`PlanError` naming the
        problem. A :class:`KernelPlan` is returned as it is."""
        if isinstance(plan, KernelPlan):
            return plan
        if not isinstance(plan, Mapping) or plan.get("format") != PLAN_FORMAT:
            raise PlanError(f"not a kernel plan of format {PLAN_FORMAT!r}")
        for key in ("target", "arch", "layer", "input", "parameters", "buffers", "kernels", "classes", "output"):
            if key not in plan:
                raise PlanError(f"kernel plan has no '{key}'")
        try:
            inp = plan["input"]
            cubins = plan.get("cubins")
            return cls(
                target=plan["target"], arch=plan["arch"], layer=LayerInfo.from_dict(plan["layer"]),
                input=PlanInput(inp["name"], inp["dtype"], inp["hidden"]),
                parameters={n: Parameter.from_dict(p) for n, p in plan["parameters"].items()},
                buffers={n: Buffer.from_dict(b) for n, b in plan["buffers"].items()},
                kernels={n: KernelSpec.from_dict(k) for n, k in plan["kernels"].items()},
                classes=tuple(ShapeClass.from_dict(c) for c in plan["classes"]),
                output=plan["output"]["buffer"],
                cubins=None if cubins is None else {n: dict(m) for n, m in cubins.items()},
                options=PlanOptions.from_dict(plan.get("options")),
                extra_inputs=tuple(PlanInput(i["name"], i["dtype"], i["hidden"]) for i in plan.get("extra_inputs", ())))
        except (KeyError, TypeError, AttributeError) as e:
            raise PlanError(f"malformed kernel plan: {type(e).__name__} {e}") from None


def _check_names(expr, known: set[str], where: str) -> None:
    unknown = names(expr) - known
    if unknown:
        raise PlanError(f"{where}: expression {expr!r} uses undefined {', '.join(sorted(unknown))}")


def as_dict(plan: Union[Mapping[str, Any], KernelPlan]) -> dict[str, Any] | Mapping[str, Any]:
    """``plan`` as format-/1 data (a dict is returned as it is)."""
    return plan.to_dict() if isinstance(plan, KernelPlan) else plan


# ------------------------------------------------------------------------------ bundles and weights
def write_bundle(directory, plan: Union[Mapping[str, Any], KernelPlan], binaries: Mapping[str, bytes]) -> None:
    """Write a plan and its cubins to ``directory`` (plan.json + one .cubin per kernel), e.g. to carry a
    plan built on a machine with the compiler to a GPU machine without it. Weights are not included."""
    import json
    import os

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "plan.json"), "w") as f:
        json.dump(as_dict(plan), f, indent=1, sort_keys=True)
    for name, blob in binaries.items():
        with open(os.path.join(directory, f"{name}.cubin"), "wb") as f:
            f.write(blob)


def read_bundle(directory) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Inverse of :func:`write_bundle`: (plan dict, checked; {kernel entry: cubin})."""
    import json
    import os

    with open(os.path.join(directory, "plan.json")) as f:
        plan = json.load(f)
    KernelPlan.from_dict(plan)
    binaries = {}
    for name in plan["kernels"]:
        path = os.path.join(directory, f"{name}.cubin")
        if os.path.exists(path):
            with open(path, "rb") as f:
                binaries[name] = f.read()
    return plan, binaries


def plan_parameters(plan: Union[Mapping[str, Any], KernelPlan], logical: Mapping[str, Any]) -> dict[str, Any]:
    """The plan's parameters from logical weights (checkpoint order, unpadded: what an ``MoE`` layer holds),
    keyed like the plan's parameters and ``logical`` by operand name ("w13", "w13_scale", ...): values are
    put into the plan's layout (torch tensors stay on their device). For binding plans built elsewhere
    (``benchmarks/gpu_moe.py --build``) to a layer's own buffers; ``mxmoe.compile`` does this itself."""
    import numpy as np

    from mxmoe.core.stored_form import StoredForm

    plan = KernelPlan.from_dict(plan)
    out = {}
    for glob, spec in plan.parameters.items():
        a = logical[spec.operand]
        if spec.role == "values":
            form = StoredForm(tuple(a.shape), tuple(a.shape), layout=plan.layer.layout, role="values")
            if hasattr(a, "detach"):  # a torch tensor
                import torch

                a = torch.from_numpy(form.apply(glob, a.detach().cpu().numpy())).to(a.device)
            else:
                a = form.apply(glob, np.asarray(a))
        out[glob] = a
    return out
