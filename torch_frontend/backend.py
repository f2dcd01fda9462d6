"""``torch.compile(model, backend="mxmoe")``: mxmoe for the MoE regions, PyTorch for the rest.

What the backend does with each FX graph dynamo hands it:

1. **Find the regions.** A capability-based partition groups the mxmoe custom ops (``mxmoe::route``,
   ``mxfp4_grouped_matmul``, ``glu``, ``combine``, their ``getitem``s) and the router ``linear`` that
   feeds ``route`` into regions, one per MoE layer. Inside an mxmoe :class:`~mxmoe.torch_frontend.moe.MoE`
   module (what ``convert`` puts in a model) the region also takes the layer's own ops around them: a bf16
   shared expert's linears and sigmoid gate, the casts, the shared expert's ids and the final add, so the whole
   layer is one region (the Triton path runs nothing less). Reshapes at the layer's edges stay outside.
2. **Compile each region with mxmoe** for the device its tensors live on (cpu -> the IREE ``cpu`` target;
   cuda -> ``cuda:sm_XY`` through Triton; ``Target.runs_torch_tensors``). The region is
   exported with a dynamic token dimension, so 1, 5, 17 or 300 tokens run the same compiled module.
   **Weights** (inputs that dynamo lifted from module parameters/buffers, or ``get_attr`` constants) become
   the compiled module's parameters. They are *bound at run time*, not baked into the compiled code: the
   region node keeps receiving the live weight tensors, the first call binds them (zero-copy on CPU) and a
   later call rebinds only if a weight tensor was replaced or modified in place (its ``data_ptr`` or
   version counter changed). So every layer with the same shapes shares one compiled module, and the
   on-disk cache (:mod:`compile_cache`) can hold it without any weights.
3. **Replace** each compiled region by one ``mxmoe::region`` custom-op node (its fake implementation runs
   the region's original ops on fake tensors, so symbolic shapes flow through) and hand the whole graph to
   PyTorch's default compiler, inductor (``rest="eager"`` runs it as is instead; if inductor fails, e.g. no
   C++ compiler, the backend warns once and runs the graph eagerly).

Errors while compiling a region leave that region's original ops in the graph (they run their eager
reference implementations) and emit one :class:`MxmoeFallbackWarning` per distinct region saying why;
``fallback="raise"`` (backend option, or ``MXMOE_FALLBACK=raise``) raises :class:`MxmoeCompileError`. Weights a
compiled region cannot bind (NaN weights, which mxmoe refuses) run the original ops until they change, with the
same warning. A call that fails (a bad input) is that call's error, raised to its caller: it never demotes the
region. An empty batch (0 tokens) returns an empty output without running anything.

Options (``torch.compile(m, backend="mxmoe", options={...})``; environment variable in brackets):
``fallback`` "warn"|"raise" [MXMOE_FALLBACK], ``rest`` "inductor"|"eager" [MXMOE_REST],
``cache_dir`` a folder, or None/"off" for no disk cache [MXMOE_CACHE_DIR].

Inference only: the mxmoe ops have no autograd formulas.
"""

from __future__ import annotations

import inspect
import itertools
import operator
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx

from mxmoe.core.bridge import dtype_name, to_numpy
from mxmoe.torch_frontend import ops as _ops  # noqa: F401  (registers the mxmoe custom ops)
from mxmoe.torch_frontend.compile_cache import CompileCache, make_key
from mxmoe.torch_frontend.moe import MoE

__all__ = ["mxmoe_backend", "register", "stats", "reset", "MxmoeCompileError", "MxmoeFallbackWarning"]

ENV_FALLBACK = "MXMOE_FALLBACK"
ENV_REST = "MXMOE_REST"
_REGION_OP_NAME = "region"


class MxmoeCompileError(RuntimeError):
    """mxmoe could not compile an MoE region (raised only with ``fallback="raise"``)."""


class MxmoeFallbackWarning(UserWarning):
    """An MoE region runs its original (reference) ops because mxmoe could not compile it."""


# ------------------------------------------------------------------------------------------ options
@dataclass(frozen=True)
class Options:
    fallback: str = "warn"
    rest: str = "inductor"
    cache_dir: Any = "env"      # "env": from MXMOE_CACHE_DIR / default; None or "off": no disk cache; else a path

    @classmethod
    def parse(cls, options: Optional[dict]) -> "Options":
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"mxmoe backend: unknown option(s) {unknown}; known: {sorted(known)}")
        fallback = str(options.get("fallback", os.environ.get(ENV_FALLBACK, "warn"))).lower()
        rest = str(options.get("rest", os.environ.get(ENV_REST, "inductor"))).lower()
        if fallback not in ("warn", "raise"):
            raise ValueError(f"mxmoe backend: fallback must be 'warn' or 'raise', got {fallback!r}")
        if rest not in ("inductor", "eager"):
            raise ValueError(f"mxmoe backend: rest must be 'inductor' or 'eager', got {rest!r}")
        return cls(fallback, rest, options.get("cache_dir", "env"))

    def cache(self) -> CompileCache:
        if self.cache_dir == "env":
            return CompileCache.from_env()
        if self.cache_dir is None or str(self.cache_dir).strip().lower() in ("off", "none", "0", "false", ""):
            return CompileCache(None)
        return CompileCache(self.cache_dir)


# -------------------------------------------------------------------------------------------- stats
@dataclass
class Stats:
    """Process-wide counters, for tests and for seeing what the backend did."""

    graphs: int = 0          # FX graphs the backend was given (dynamo compiles/recompiles)
    regions: int = 0         # MoE regions found in them
    compiled: int = 0        # regions that ran mxmoe.compile (no cache hit)
    memory_hits: int = 0     # regions served from this process's compiled modules
    disk_hits: int = 0       # regions loaded from the on-disk cache
    fallbacks: int = 0       # regions left to the original ops
    binds: int = 0           # weight bindings (first call of a region, or weights changed)
    compile_s: float = 0.0   # seconds spent in mxmoe.compile
    load_s: float = 0.0      # seconds spent reading the disk cache

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)


stats = Stats()
_lock = threading.RLock()
#: key -> _Compiled (vmfb + signature; holds no weights); key -> reason for regions that failed to compile
_MEMORY: dict[str, "_Compiled"] = {}
_FAILED: dict[str, str] = {}
#: (key, reason) of compiled regions whose weights could not be bound (said once each)
_BIND_FAILED: set[tuple[str, str]] = set()
_warned_rest: set[str] = set()


def reset() -> None:
    """Forget compiled modules and failures held in memory (the disk cache is untouched) and zero ``stats``."""
    with _lock:
        _MEMORY.clear()
        _FAILED.clear()
        _BIND_FAILED.clear()
        _warned_rest.clear()
        stats.reset()


# ---------------------------------------------------------------------------------- device targets

def target_for(device: torch.device) -> str:
    """The mxmoe target name for tensors on ``device``."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and getattr(torch.version, "hip", None):  # ROCm builds call their GPUs "cuda"
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        return f"rocm:{arch}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:sm_{major}{minor}"
    raise ValueError(f"no mxmoe target for device {device}")


# ---------------------------------------------------------------------------------- region finding
def _is_mxmoe_op(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "mxmoe" and \
        target._schema.name != f"mxmoe::{_REGION_OP_NAME}"


_LINEARS = {torch._C._nn.linear, torch.nn.functional.linear, torch.ops.aten.linear.default}


def _supported(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if _is_mxmoe_op(node.target):
        return True
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and _is_mxmoe_op(src.target)
    if node.target in _LINEARS:  # the router: a linear whose only consumers are mxmoe.route
        return bool(node.users) and all(
            u.op == "call_function" and u.target is torch.ops.mxmoe.route.default for u in node.users)
    return False


_PURE_METHODS = {"to", "float", "half", "bfloat16", "view", "reshape", "contiguous", "type", "detach"}


def _drop_dead_consumers(gm: fx.GraphModule) -> None:
    """Erase unused pure consumers of mxmoe ops (e.g. the discarded ``router_scores.to(dtype)`` of a
    transformers decoder layer), so they do not become extra region outputs. Nothing else is touched."""
    changed = True
    while changed:
        changed = False
        for n in list(gm.graph.nodes):
            if n.users or not any(isinstance(a, fx.Node) and _supported(a) for a in n.all_input_nodes):
                continue
            pure = (n.op == "call_method" and n.target in _PURE_METHODS) or (
                n.op == "call_function" and n.target is operator.getitem)
            if pure:
                gm.graph.erase_node(n)
                changed = True


#: tensor ops that stay at a layer's edges: the token reshapes (shape arithmetic gives no tensor, so stays too)
_EDGE_METHODS = {"view", "reshape", "flatten", "contiguous"}
_EDGE_FUNCTIONS = {torch.reshape, torch.flatten}


def _layer_of(node: fx.Node) -> Optional[str]:
    """The path of the innermost mxmoe MoE module whose forward made ``node`` (dynamo's nn_module_stack)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, cls in reversed(list(stack.values())):
        if isinstance(cls, type) and issubclass(cls, MoE):
            return path
    return None


def _growable(node: fx.Node) -> bool:
    """A tensor-valued op that may join its layer's region (not a reshape at the layer's edge)."""
    edges = {"call_method": _EDGE_METHODS, "call_function": _EDGE_FUNCTIONS}.get(node.op)
    return edges is not None and node.target not in edges and isinstance(_meta_value(node), torch.Tensor)


def _region_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The supported nodes, grown inside each mxmoe MoE module: a node of the same layer joins when it reads a
    region node (the bf16 shared expert's w2 linear, its gate's product and cast, the final add) or when all its
    users are region nodes (the shared expert's w13 linear, its gate, an fp32 router's cast, new_zeros ids)."""
    region = {n for n in gm.graph.nodes if _supported(n)}
    owner = {n: _layer_of(n) for n in gm.graph.nodes}
    candidates = [n for n in gm.graph.nodes if owner[n] is not None and n not in region and _growable(n)]
    grown = True
    while grown:
        grown = False
        for n in candidates:
            if n in region:
                continue
            reads = any(a in region and owner[a] == owner[n] for a in n.all_input_nodes)
            feeds = bool(n.users) and all(u in region and owner[u] == owner[n] for u in n.users)
            if reads or feeds:
                region.add(n)
                grown = True
    return region


def _find_regions(gm: fx.GraphModule) -> list[list[fx.Node]]:
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    supported = _region_nodes(gm)

    class _Support(OperatorSupportBase):
        def is_node_supported(self, submodules, node):
            return node in supported

    kwargs = {"allows_single_node_partition": True}
    if "skip_horizontal_fusion" in inspect.signature(CapabilityBasedPartitioner.__init__).parameters:
        kwargs["skip_horizontal_fusion"] = True  # one region per MoE layer (torch >= 2.12); else merged if parallel
    part = CapabilityBasedPartitioner(gm, _Support(), **kwargs)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    regions = []
    for p in part.propose_partitions():
        members = set(p.nodes)
        # the partitioner keeps a getitem with its producer; one on a weight (a shared expert's w[0]) joins the
        # region that reads it, so the region takes the weight itself
        members |= {n for n in supported if n.op == "call_function" and n.target is operator.getitem
                    and n.users and all(u in members for u in n.users)}
        nodes = sorted(members, key=order.__getitem__)
        if any(_is_mxmoe_op(n.target) for n in nodes):
            regions.append(nodes)
    regions.sort(key=lambda ns: order[ns[0]])
    return regions


# --------------------------------------------------------------------------------- region analysis
def _is_weight(node: fx.Node, value) -> bool:
    """Weights: get_attr constants, or placeholders dynamo lifted from module parameters/buffers."""
    if node.op == "get_attr":
        return True
    if node.op != "placeholder" or not isinstance(value, torch.Tensor):
        return False
    if isinstance(value, torch.nn.Parameter) or getattr(value, "_dynamo_static_input_type", None):
        return True
    ga = node.meta.get("grapharg")
    src = getattr(getattr(ga, "source", None), "name", "")
    src = src() if callable(src) else src
    return "._buffers[" in str(src) or "._parameters[" in str(src)


def _fetch_attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _meta_value(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def _hint(d) -> int:
    if isinstance(d, torch.SymInt):
        return int(d.node.hint) if d.node.hint is not None else 8
    return int(d)


def _static_dim(d):
    return int(d) if not isinstance(d, torch.SymInt) else "?"


def _target_name(t) -> str:
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', getattr(t, '__name__', repr(t)))}"


def _structure(sub: fx.GraphModule) -> list:
    """A name-free description of a region graph: equal for every layer with the same ops and literals."""
    index: dict[fx.Node, int] = {}
    out = []

    def arg(a):
        if isinstance(a, fx.Node):
            return f"%{index[a]}"
        if isinstance(a, (list, tuple)):
            return [arg(x) for x in a]
        if isinstance(a, dict):
            return {k: arg(v) for k, v in sorted(a.items())}
        return repr(a)

    for i, n in enumerate(sub.graph.nodes):
        index[n] = i
        if n.op == "placeholder":
            out.append(["in"])
        elif n.op == "output":
            out.append(["out", arg(n.args)])
        else:
            out.append([n.op, _target_name(n.target), arg(n.args), arg(n.kwargs)])
    return out


def _export_module(sub: fx.GraphModule, roles: list[str], weights: dict[int, torch.Tensor]) -> fx.GraphModule:
    """The region as a module for torch.export: activations stay inputs, weight ``i`` becomes buffer ``w<i>``."""
    root = torch.nn.Module()
    for i, t in weights.items():
        root.register_buffer(f"w{i}", t.detach())
    g = fx.Graph()
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env = {ph: g.placeholder(f"a{i}") for i, ph in enumerate(phs) if roles[i] == "act"}
    env.update({ph: g.get_attr(f"w{i}") for i, ph in enumerate(phs) if roles[i] == "weight"})
    for n in sub.graph.nodes:
        if n.op == "output":
            g.output(fx.map_arg(n.args[0], env.__getitem__))
        elif n.op != "placeholder":
            env[n] = g.node_copy(n, env.__getitem__)
    return fx.GraphModule(root, g, class_name="MxmoeRegion")


# -------------------------------------------------------------------------------- compiled modules
@dataclass
class _Compiled:
    """A compiled region without weights: a ``CompiledModule`` template (no parameter arrays) plus which region
    input feeds which parameter. :meth:`bind` fills in a layer's weights through the compiler's stored forms
    (padding/layout), so one compiled module serves every layer of the same shapes."""

    key: str
    template: Any           # mxmoe.compiler.api.CompiledModule without parameter arrays
    param_names: dict       # region input index -> parameter (global) name

    def cacheable(self) -> bool:
        """Interpreted Triton modules carry no cubins and are rebuilt in a moment: not worth a disk entry."""
        return not self.template.interpret

    def save(self, path, source: dict) -> None:
        """Write the template as an artifact without weights (the disk cache's entry)."""
        self.template.save(path, weights="none",
                           source={**source, "param_names": {str(k): v for k, v in self.param_names.items()}})

    @classmethod
    def from_artifact(cls, key: str, art) -> "_Compiled":
        from mxmoe.compiler.compiled import CompiledModule

        names = {int(k): v for k, v in art.manifest["source"]["param_names"].items()}
        return cls(key, CompiledModule.from_artifact(art), names)

    def bind(self, weights: dict[int, torch.Tensor], names: Optional[dict[int, str]] = None) -> Callable:
        """``(*activations) -> list[Tensor]`` running the compiled module with ``weights`` as its parameters; errors
        name a weight by ``names[i]`` (the graph's name for region input ``i``)."""
        from mxmoe.core.stored_form import store_parameters

        raw = {self.param_names[i]: to_numpy(t) for i, t in weights.items()}
        forms = self.template.stored_forms
        labels = {self.param_names[i]: n for i, n in (names or {}).items()}
        stored = store_parameters(forms, raw, labels) if forms else raw
        module = self.template.with_parameters(stored)
        module.bound()  # load now: a failure here is a binding failure, not a mid-run one

        def run(*acts) -> list:
            out = module(*acts)
            return list(out) if isinstance(out, (tuple, list)) else [out]

        return run


def _compile_region(key: str, region_mod: fx.GraphModule, example_acts: list, target: str,
                    weight_pos: list[int], expected_outputs: list) -> _Compiled:
    from mxmoe.compiler.targets import get_target

    tgt = get_target(target)  # checked before the compiler (and IREE) is imported
    if not tgt.runs_torch_tensors:
        raise NotImplementedError(f"the torch.compile backend does not run mxmoe's {tgt.backend} target "
                                  f"{tgt.name} on torch tensors yet")
    from mxmoe.compiler.api import compile_program
    from mxmoe.compiler.importer import global_name
    from mxmoe.torch_frontend.capture import capture

    # Export in a clean tracing context: inside a backend call, dynamo's context is active, and guards the
    # nested export installs would otherwise land on the frame being compiled.
    with torch._guards.tracing(None):
        ep = capture(region_mod, tuple(example_acts))
    cm = compile_program(ep, target=tgt)
    names = {i: global_name(f"w{i}") for i in weight_pos}
    if set(cm.parameters) != set(names.values()):
        raise RuntimeError(f"compiled module's parameters {sorted(cm.parameters)} do not match the region's "
                           f"weights {sorted(names.values())}")
    for spec in cm.inputs:
        if spec.shape[0] is not None:
            raise RuntimeError(f"region input {spec.describe()} did not keep a dynamic token dimension")
    if [s.dtype for s in cm.outputs] != expected_outputs:
        raise RuntimeError(f"compiled outputs {[s.dtype for s in cm.outputs]} differ from the graph's "
                           f"{expected_outputs}")
    return _Compiled(key, cm.without_weights(), names)


def _get_compiled(key: str, build: Callable[[], _Compiled], cache: CompileCache) -> _Compiled:
    """From memory, else from disk, else ``build()`` (and store it). Raises what ``build`` raises."""
    with _lock:
        got = _MEMORY.get(key)
        if got is not None:
            stats.memory_hits += 1
            return got
        if key in _FAILED:
            raise MxmoeCompileError(_FAILED[key])
        t0 = time.perf_counter()
        entry = cache.get(key)
        if entry is not None:
            try:
                got = _Compiled.from_artifact(key, entry)
            except (KeyError, ValueError, TypeError) as e:
                warnings.warn(f"mxmoe cache: unreadable manifest for {key[:12]} ({e}); recompiling", stacklevel=2)
                got = None
            if got is not None:
                stats.disk_hits += 1
                stats.load_s += time.perf_counter() - t0
                _MEMORY[key] = got
                return got
        t0 = time.perf_counter()
        got = build()
        stats.compile_s += time.perf_counter() - t0
        stats.compiled += 1
        if got.cacheable():
            cache.put(key, got.save)
        _MEMORY[key] = got
        return got


# ----------------------------------------------------------------------------- the region custom op
_INSTANCES: "weakref.WeakValueDictionary[int, _Region]" = weakref.WeakValueDictionary()
_handles = itertools.count()


class _Region:
    """One MoE region of one graph: its original ops (for fake tensors and fallback) and its binding."""

    def __init__(self, key: str, sub: fx.GraphModule, roles: list[str], compiled: _Compiled, opts: Options):
        self.key, self.sub, self.roles, self.compiled, self.opts = key, sub, roles, compiled, opts
        self.act_pos = [i for i, r in enumerate(roles) if r == "act"]
        self.weight_pos = [i for i, r in enumerate(roles) if r == "weight"]
        inputs = [n.name for n in sub.graph.nodes if n.op == "placeholder"]
        self.weight_names = {i: inputs[i] for i in self.weight_pos}  # e.g. l_self_modules_moe_buffers_w13_
        self.handle = next(_handles)
        self._bound: Optional[tuple] = None
        _INSTANCES[self.handle] = self

    def fake(self, args: list) -> list:
        return list(self.sub(*args))

    def __call__(self, args: list) -> list:
        ws = {i: args[i] for i in self.weight_pos}
        ident = tuple((t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.device) for t in ws.values())
        if self._bound is None or self._bound[0] != ident:
            self._bound = (ident, self._bind(ws))
        run = self._bound[1]
        if run is None:  # these weights could not be bound: the original ops run until the weights change
            return list(self.sub(*args))
        # A call that fails (a bad input) is that call's error, raised to the caller; the region stays compiled.
        return run(*(args[i] for i in self.act_pos))

    def _bind(self, ws: dict) -> Optional[Callable]:
        """The compiled module with these weights bound, or None (after one warning per region and reason) when
        they cannot be: e.g. NaN weights, which mxmoe refuses and the original ops propagate."""
        try:
            run = self.compiled.bind(ws, self.weight_names)
        except Exception as e:
            if self.opts.fallback == "raise":
                raise MxmoeCompileError(f"mxmoe: cannot bind the weights of a compiled MoE region "
                                        f"({_one_line(e)})") from e
            stats.fallbacks += 1
            with _lock:
                first = (self.key, _one_line(e)) not in _BIND_FAILED
                _BIND_FAILED.add((self.key, _one_line(e)))
            if first:
                warnings.warn(f"mxmoe: cannot bind the weights of a compiled MoE region ({_one_line(e)}); running "
                              "its original ops until they change", MxmoeFallbackWarning, stacklevel=3)
            return None
        stats.binds += 1
        return run


def _instance(handle: int, key: str) -> _Region:
    inst = _INSTANCES.get(handle)
    if inst is None or inst.key != key:  # e.g. a graph from inductor's on-disk cache, numbered in another process
        inst = next((r for r in list(_INSTANCES.values()) if r.key == key), None)
        if inst is None:
            raise RuntimeError(f"mxmoe.region: no live compiled region for key {key[:12]} (handle {handle})")
    return inst


@torch.library.custom_op(f"mxmoe::{_REGION_OP_NAME}", mutates_args=())
def region(args: list[torch.Tensor], key: str, handle: int) -> list[torch.Tensor]:
    """An MoE region compiled by mxmoe (inserted by the torch.compile backend, never written by hand)."""
    return _instance(handle, key)(args)


@region.register_fake
def _(args, key, handle):
    return _instance(handle, key).fake(args)


# ------------------------------------------------------------------------------------- the backend
def _one_line(e: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters (export errors run to pages)."""
    text = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _fallback(opts: Options, key: Optional[str], reason: str, err: Optional[BaseException]) -> None:
    stats.fallbacks += 1
    if opts.fallback == "raise":
        raise MxmoeCompileError(f"mxmoe: MoE region not compiled ({reason}); fallback='raise'") from err
    msg = f"mxmoe: MoE region not compiled ({reason}); running the original ops"
    with _lock:  # one warning per distinct region (or, before a region has a key, per distinct reason)
        first = (key or msg) not in _FAILED
        _FAILED[key or msg] = msg
    if first:
        warnings.warn(msg, MxmoeFallbackWarning, stacklevel=3)


def _process_region(gm: fx.GraphModule, nodes: list[fx.Node], placeholder_values: dict, opts: Options,
                    cache: CompileCache) -> Optional[_Region]:
    from torch.fx.passes.utils.fuser_utils import fuse_as_graphmodule

    key = None
    try:
        sub, orig_inputs, orig_outputs = fuse_as_graphmodule(gm, nodes, "MxmoeRegion")
        out_node = next(n for n in sub.graph.nodes if n.op == "output")
        if not isinstance(out_node.args[0], (tuple, list)):  # one output: make it a 1-tuple like the others
            out_node.args = ((out_node.args[0],),)
            sub.recompile()
        roles, weights, example_acts, devices, shapes = [], {}, [], set(), []
        token_sizes: dict[str, int] = {}
        for i, n in enumerate(orig_inputs):
            if n.op == "get_attr":
                val = _fetch_attr(gm, n.target)
            elif n.op == "placeholder" and n in placeholder_values:
                val = placeholder_values[n]
            else:
                val = _meta_value(n)
            if not isinstance(val, torch.Tensor):
                raise ValueError(f"region input '{n.name}' is a {type(val).__name__}, not a tensor")
            devices.add(val.device)
            if _is_weight(n, val):
                if isinstance(val, torch._subclasses.FakeTensor):
                    raise ValueError(f"weight '{n.name}' is a fake tensor; its values are needed to bind it")
                roles.append("weight")
                weights[i] = val
                shapes.append({"role": "weight", "dtype": str(val.dtype), "shape": list(val.shape)})
            else:
                roles.append("act")
                dims = [_hint(d) for d in val.shape]
                if dims:
                    dims[0] = max(dims[0], 2)
                    # inputs sharing the token count (the same symbol, e.g. the tokens and a shared expert's
                    # projection of them) get the same example size: export gives them one dynamic dim
                    tokens = token_sizes.setdefault(str(val.shape[0]), dims[0])
                    dims[0] = tokens
                if val.is_floating_point():
                    ex = torch.randn(dims, generator=torch.Generator().manual_seed(i)).to(val.dtype)
                else:
                    ex = torch.zeros(dims, dtype=val.dtype)
                example_acts.append(ex.to(val.device))
                shapes.append({"role": "act", "dtype": str(val.dtype),
                               "shape": ["?"] + [_static_dim(d) for d in val.shape[1:]]})
        if len(devices) != 1:
            raise ValueError(f"region tensors are on several devices {sorted(map(str, devices))}")
        if "act" not in roles:
            raise ValueError("region has no activation input")
        device = devices.pop()
        target = target_for(device)
        key = make_key({"graph": _structure(sub), "inputs": shapes, "target": target, "bind": "runtime"})
        expected_outputs = [dtype_name(_meta_value(n).dtype) for n in orig_outputs]
        region_mod = _export_module(sub, roles, weights)
        compiled = _get_compiled(
            key, lambda: _compile_region(key, region_mod, example_acts, target, sorted(weights), expected_outputs),
            cache)
    except MxmoeCompileError:  # this region's key failed before and was reported then
        if opts.fallback == "raise":
            raise
        stats.fallbacks += 1
        return None
    except Exception as e:
        _fallback(opts, key, _one_line(e), e)
        return None

    inst = _Region(key, sub, roles, compiled, opts)
    # Replace the region's nodes by one mxmoe.region call and getitems for its outputs.
    with gm.graph.inserting_after(nodes[-1]):
        call = gm.graph.call_function(torch.ops.mxmoe.region.default, (list(orig_inputs), key, inst.handle))
    call.meta["example_value"] = [_meta_value(n) for n in orig_outputs]
    prev = call
    for j, out in enumerate(orig_outputs):
        with gm.graph.inserting_after(prev):
            g = gm.graph.call_function(operator.getitem, (call, j))
        g.meta = dict(out.meta)
        out.replace_all_uses_with(g)
        prev = g
    for n in reversed(nodes):
        gm.graph.erase_node(n)
    return inst


def _compile_rest(gm: fx.GraphModule, example_inputs: Sequence, opts: Options) -> Callable:
    if opts.rest == "eager":
        return gm.forward
    try:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, list(example_inputs))
    except Exception as e:
        reason = _one_line(e)
        if reason not in _warned_rest:
            _warned_rest.add(reason)
            warnings.warn(f"mxmoe: inductor could not compile the rest of the graph ({reason}); running it eagerly",
                          MxmoeFallbackWarning, stacklevel=2)
        return gm.forward


def _propagate_fake(gm: fx.GraphModule, example_inputs: Sequence) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    with torch._guards.tracing(None):
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)


def mxmoe_backend(gm: fx.GraphModule, example_inputs: Sequence, options: Optional[dict] = None, **_ignored):
    """The torch.compile backend: mxmoe for the MoE regions, inductor (or eager) for the rest."""
    opts = Options.parse(options)
    cache = opts.cache()
    stats.graphs += 1
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = {n: v for n, v in zip(placeholders, example_inputs)}
    if any(_meta_value(n) is None for n in gm.graph.nodes if n.op not in ("output", "placeholder")):
        _propagate_fake(gm, example_inputs)  # e.g. a graph from fx.symbolic_trace: no shapes recorded
    regions = []
    try:
        _drop_dead_consumers(gm)
        found = _find_regions(gm)
    except Exception as e:  # a torch-version difference in the FX utilities, say: run the graph as it is
        _fallback(opts, None, _one_line(e), e)
        found = []
    for nodes in found:
        stats.regions += 1
        inst = _process_region(gm, nodes, values, opts, cache)
        if inst is not None:
            regions.append(inst)
    if regions:
        gm.graph.lint()
        gm.recompile()
    compiled = _compile_rest(gm, example_inputs, opts)

    def run(*args, **kwargs):
        return compiled(*args, **kwargs)

    run._mxmoe_regions = regions  # keeps the regions (and their weight bindings) alive with the compiled graph
    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True
    return run


def register() -> None:
    """Register ``"mxmoe"`` with dynamo's backend registry (idempotent; the entry point also provides it)."""
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    # An entry point already discovered for the name (it may be loading this very module) registers itself.
    if "mxmoe" not in _COMPILER_FNS and _BACKENDS.get("mxmoe") is None:
        register_backend(compiler_fn=mxmoe_backend, name="mxmoe")


# Importing this module means the backend is wanted: make "mxmoe" resolvable even where the package is not
# installed (no entry point), e.g. a source checkout on a GPU machine.
register()
