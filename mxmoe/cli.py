"""The ``mxmoe`` command: compile MoE layers ahead of time, run and inspect the artifacts.

    mxmoe compile --preset gpt-oss-20b --target cpu -o moe20b.mxmoe
    mxmoe compile CHECKPOINT_DIR --target cpu -o model.mxmoe [--layer N] [--weights external]
    mxmoe compile model.pt2 --target rocm:gfx942 -o model.mxmoe
    mxmoe compile my_pkg.layers:make_block --target cpu -o block.mxmoe
    mxmoe run moe20b.mxmoe --tokens 8 --check
    mxmoe inspect moe20b.mxmoe

Errors print one line (``mxmoe: error: ...``) and exit non-zero; set MXMOE_DEBUG=1 for a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

from mxmoe.core._version import __version__
from mxmoe.core.files import output_path, write_atomically

EXIT_ERROR = 1       # the command could not do its job (bad input, missing file, corrupt artifact...)
EXIT_MISMATCH = 3    # run --check: the compiled result disagrees with the reference
DEFAULT_TOL = 2e-2   # max |out - ref| / max |ref| accepted by --check (bf16 activations)


class CliError(Exception):
    """A user-facing error: printed as one line, exit status EXIT_ERROR."""


# ============================================================================================ output

def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


class _Step:
    """Prints ``label ...`` then ``done in X s``; on a terminal a ticking clock shows it is alive."""

    def __init__(self, label: str, quiet: bool = False):
        self.label, self.quiet = label, quiet
        self._stop = threading.Event()

    def __enter__(self):
        self.t0 = time.perf_counter()
        if not self.quiet:
            print(f"{self.label} ...", end="", flush=True, file=sys.stderr)
            if sys.stderr.isatty():
                self._thread = threading.Thread(target=self._tick, daemon=True)
                self._thread.start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            print(f"\r{self.label} ... {time.perf_counter() - self.t0:.0f} s", end="", flush=True, file=sys.stderr)

    def __exit__(self, exc_type, *_):
        self._stop.set()
        self.elapsed = time.perf_counter() - self.t0
        if not self.quiet:
            end = "failed" if exc_type else f"done in {self.elapsed:.1f} s"
            if sys.stderr.isatty():
                print(f"\r{self.label} ... {end}", file=sys.stderr, flush=True)
            else:
                print(f" {end}", file=sys.stderr, flush=True)
        return False


def _say(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


# ============================================================================================ compile

def _load_hf_family(p: Path, args, dtype):
    """A checkpoint of the MoE families (docs/transformers.md): its first MoE layer read now (bf16 experts quantized
    while streaming), the others when the artifact's weights are packed."""
    from mxmoe.core.hf_checkpoint import describe, hf_moe_layer_indices, layer_names, read_hf_moe_config
    from mxmoe.core.checkpoint import _Tensors
    from mxmoe.torch_frontend import MoE

    cfg = read_hf_moe_config(p)
    tensors = _Tensors(p)
    layers = hf_moe_layer_indices(p, tensors)
    if not layers:
        raise CliError(f"{p}: no MoE layers found (no ...layers.N.mlp.gate.weight / router.weight with experts)")
    if args.layer is not None:
        if args.layer not in layers:
            raise CliError(f"{p}: no MoE layer {args.layer} (layers: {_ranges(layers)})")
        layers = [args.layer]
    if args.weights == "external":
        raise CliError(f"{p}: --weights external reads MXFP4 gpt-oss checkpoints only; this one's experts are "
                       "quantized at compile time (use --weights embedded)")
    for n in layers[1:]:  # every other layer's tensors are there, before compiling (read when packing)
        layer_names(tensors, n)
    with _Step(f"reading layer {layers[0]} of {p} ({describe(p)})", args.quiet):
        layer = MoE.from_hf_checkpoint(str(p), layers[0], dtype=dtype, progress=None if not args.quiet else False)
    desc = {"kind": "hf-moe", "path": str(p.resolve()), "layers": layers, "config": cfg.to_dict()}
    return layer, None, desc, {"path": p.resolve(), "layers": layers, "family": True}


def _load_source(args):
    """(module or ExportedProgram, example_inputs or None, description dict, checkpoint info or None)."""
    import torch

    from mxmoe.torch_frontend import MoE

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[args.dtype]
    if args.preset:
        if args.source:
            raise CliError("give either SOURCE or --preset, not both")
        from mxmoe.core.config import preset

        cfg = preset(args.preset)
        with _Step(f"building random {args.preset} layer (E={cfg.num_experts}, k={cfg.top_k}, "
                   f"H={cfg.hidden}, I={cfg.intermediate})", args.quiet):
            layer = MoE.random(cfg, seed=args.seed, dtype=dtype)
        return layer, None, {"kind": "preset", "preset": args.preset, "seed": args.seed}, None
    if not args.source:
        raise CliError("nothing to compile: give SOURCE (.pt2, checkpoint directory or module:factory) or --preset")
    src = args.source
    p = Path(src)
    if p.is_dir():
        from mxmoe.core.checkpoint import hf_moe_layers, read_hf_config
        from mxmoe.core.hf_checkpoint import hf_model_type

        if not (p / "config.json").is_file():
            raise CliError(f"{p}: not a checkpoint directory (no config.json)")
        if hf_model_type(p) != "gpt_oss" or not hf_moe_layers(p):  # another family, or float gpt-oss experts
            return _load_hf_family(p, args, dtype)
        cfg = read_hf_config(p)
        layers = hf_moe_layers(p)
        if not layers:
            raise CliError(f"{p}: no MoE layers found (no model.layers.N.mlp.experts.gate_up_proj_blocks tensors)")
        if args.layer is not None:
            if args.layer not in layers:
                raise CliError(f"{p}: no MoE layer {args.layer} (layers: {_ranges(layers)})")
            layers = [args.layer]
        with _Step(f"reading layer {layers[0]} of {p} (E={cfg.num_experts}, k={cfg.top_k}, H={cfg.hidden}, "
                   f"I={cfg.intermediate})", args.quiet):
            import warnings

            with warnings.catch_warnings():  # the checkpoint's tensors are read-only memory maps; MoE copies none
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                layer = MoE.from_hf_checkpoint(str(p), layers[0], dtype=dtype)
        # every other layer: check its tensors now, so a broken checkpoint fails before compiling
        from mxmoe.core.checkpoint import read_hf_gpt_oss

        for n in layers[1:]:
            read_hf_gpt_oss(p, n)
        desc = {"kind": "hf-gpt-oss", "path": str(p.resolve()), "layers": layers}
        return layer, None, desc, {"path": p.resolve(), "layers": layers}
    if src.endswith(".pt2") or p.is_file():
        from mxmoe.torch_frontend import load_program

        with _Step(f"loading exported program {p}", args.quiet):
            ep = load_program(p)
        return ep, None, {"kind": "exported-program", "path": str(p.resolve())}, None
    if ":" in src:
        mod_name, _, fn_name = src.partition(":")
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # module.path:factory names a module of the working directory too
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            raise CliError(f"{src}: cannot import module {mod_name!r} ({_first_line(e)})") from None
        fn = getattr(mod, fn_name, None)
        if not callable(fn):
            raise CliError(f"{src}: module {mod_name!r} has no callable {fn_name!r}")
        with _Step(f"calling {src}", args.quiet):
            made = fn()
        if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
            module, example = made
            example = tuple(example) if isinstance(example, (list, tuple)) else (example,)
        elif isinstance(made, torch.nn.Module):
            module, example = made, None
        else:
            raise CliError(f"{src}: expected the factory to return (nn.Module, example_inputs), "
                           f"got {type(made).__name__}")
        return module, example, {"kind": "factory", "factory": src}, None
    raise CliError(f"{src}: no such file or directory (SOURCE is a .pt2 file, a checkpoint directory or module:factory)")


#: The ops of an exported bare MoE layer (anything else means a larger module around it).
_BARE_MOE_OPS = {"aten.sym_size.int": None, "aten.reshape.default": None, "aten.view.default": None,
                 "getitem": None, "aten.linear.default": 1, "mxmoe.route.default": 1,
                 "mxmoe.mxfp4_grouped_matmul.default": 2, "mxmoe.glu.default": 1, "mxmoe.combine.default": 1}


def _moe_from_exported(ep, parameter_names) -> dict | None:
    """The manifest's ``model`` record for an exported program that is exactly one mxmoe MoE layer
    (so ``run --check`` can rebuild the reference from the artifact's weights), else None."""
    from mxmoe.core.config import MoEConfig
    from mxmoe.core.weights import moe_model_info

    counts: dict[str, int] = {}
    ops = {}
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        name = "getitem" if getattr(n.target, "__name__", "") == "getitem" else str(n.target)
        if name not in _BARE_MOE_OPS:
            return None
        counts[name] = counts.get(name, 0) + 1
        ops[name] = n
    if any(want is not None and counts.get(name, 0) != want for name, want in _BARE_MOE_OPS.items()):
        return None
    names = set(parameter_names)
    if ("w13_bias" in names) != ("w2_bias" in names):
        return None
    try:
        w13 = ep.state_dict["w13"]
        route, glu = ops["mxmoe.route.default"].args, ops["mxmoe.glu.default"].args
        cfg = MoEConfig(num_experts=int(w13.shape[0]), top_k=int(route[1]), hidden=int(w13.shape[2]) * 2,
                        intermediate=int(w13.shape[1]) // 2, routing=route[2], renormalize=bool(route[3]),
                        activation=glu[1], swiglu_alpha=float(glu[2]), swiglu_limit=float(glu[3]),
                        interleaved=bool(glu[4]), bias="w13_bias" in names, router_bias="router_bias" in names)
    except (KeyError, IndexError, ValueError, TypeError, AttributeError):
        return None
    return moe_model_info(cfg, names)


def _ranges(xs: list[int]) -> str:
    return ", ".join(map(str, xs)) if len(xs) <= 8 else f"{xs[0]}..{xs[-1]} ({len(xs)} layers)"


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _numerics_flags(args) -> dict:
    """``--[no-]deterministic`` / ``--batch-invariant`` as ``mxmoe.compile`` options (only those given)."""
    flags = {}
    if args.deterministic is not None:
        flags["deterministic"] = args.deterministic
    if args.batch_invariant:
        flags["batch_invariant"] = True
    return flags


def cmd_compile(args) -> int:
    from mxmoe.compiler.targets import get_target

    try:
        target = get_target(args.target)
    except ValueError as e:
        raise CliError(str(e)) from None
    out = Path(args.output)
    output_path(out)  # a destination that cannot be written fails now, not after the compile
    if args.weights == "external" and not (args.source and Path(args.source).is_dir()):
        raise CliError("--weights external needs a checkpoint directory SOURCE (the runtime reads the weights from it)")
    t_all = time.perf_counter()
    source, example, desc, ckpt = _load_source(args)

    import mxmoe

    if args.shard:
        return _compile_sharded(args, target, out, source, desc, ckpt, t_all)
    entries = None
    if args.entries:
        from mxmoe.torch_frontend import MoE

        if not isinstance(source, MoE):
            raise CliError("--entries applies to MoE layers (--preset or a checkpoint), not to this SOURCE")
        entries = "all" if args.entries == "all" else [e.strip() for e in args.entries.split(",") if e.strip()]
    with _Step(f"compiling for {target.name} (capture, import, passes, "
               f"{'iree-compile' if target.backend == 'iree' else 'triton'})", args.quiet):
        try:
            compiled = mxmoe.compile(source, target=target, example_inputs=example, entries=entries,
                                     activations=args.activations, **_numerics_flags(args))
        except (ValueError, NotImplementedError) as e:
            if entries is None:
                raise
            raise CliError(str(e)) from None
    _say("  " + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in compiled.timings.items()), args.quiet)

    options = {}
    if compiled.model is None and desc["kind"] == "exported-program":
        options["model"] = _moe_from_exported(source, compiled.parameters)
        compiled.model = options["model"]
    if ckpt is not None:
        from mxmoe.core.checkpoint import read_hf_gpt_oss
        from mxmoe.core.hf_checkpoint import read_hf_moe

        # the families' bf16 experts are quantized as each layer's weights are packed; gpt-oss's are read as they are
        read = read_hf_moe if ckpt.get("family") else read_hf_gpt_oss
        if not ckpt.get("family"):
            srcs = {f"layer.{n}": {"kind": "hf-gpt-oss", "path": str(ckpt["path"]), "layer": n} for n in ckpt["layers"]}
            options["external_sources"] = srcs
        if args.weights == "embedded":
            model = compiled.model

            def getter(n):
                def get():
                    w = read(ckpt["path"], n)
                    return {param: getattr(w, f) for f, param in model["parameters"].items()}
                return get

            options["weight_sets"] = {f"layer.{n}": getter(n) for n in ckpt["layers"]}
    n_sets = len(options.get("weight_sets") or {})
    if n_sets > 1 and not args.quiet:
        done = [0]

        def progress(msg: str) -> None:
            if msg.startswith("packing weights"):
                done[0] += 1
                _say(f"  {msg} ({done[0]}/{n_sets})")

        options["progress"] = progress
    with _Step(f"writing {out}", args.quiet):
        if n_sets > 1 and not args.quiet:
            print(file=sys.stderr)
        manifest = compiled.save(out, weights=args.weights, source=desc, **options)
    total = time.perf_counter() - t_all
    size = out.stat().st_size
    secs = {s["name"]: s["size"] for s in manifest["sections"]}
    module_bytes = sum(v for k, v in secs.items() if not k.startswith("weights/"))
    weight_bytes = sum(v for k, v in secs.items() if k.startswith("weights/"))
    sets = manifest["weights"]["sets"]
    print(f"compiled {_describe_source(desc, compiled)} for {target.name} in {total:.1f} s")
    for e in compiled.entries:
        print(f"  entry   {e.describe()}")
    wdesc = (f"embedded, {len(sets)} set(s), {_human(weight_bytes)}" if args.weights == "embedded"
             else f"external ({len(sets)} source(s)), read at load time")
    print(f"  wrote   {out}: {_human(size)} (module {_human(module_bytes)}, weights {wdesc})")
    return 0


def _compile_sharded(args, target, out: Path, source, desc: dict, ckpt, t_all: float) -> int:
    """``compile --shard``: one MoE layer cut over ranks, one artifact with each rank's weight set."""
    from mxmoe.shard_artifact import parse_layout, save_sharded
    from mxmoe.torch_frontend import MoE

    try:
        layout = parse_layout(args.shard)
    except ValueError as e:
        raise CliError(str(e)) from None
    if not isinstance(source, MoE):
        raise CliError("--shard cuts an MoE layer (--preset or a checkpoint with --layer), not this SOURCE")
    if args.entries:
        raise CliError("--shard compiles the entries a rank's part needs (modular, or modular_routed and shared); "
                       "drop --entries")
    if args.weights != "embedded":
        raise CliError("--shard stores every rank's weights in the artifact: use --weights embedded")
    layers = None
    if ckpt is not None and len(ckpt["layers"]) > 1:  # every layer's parts in one artifact: sets layer.N.rank.R
        from mxmoe.core.checkpoint import read_hf_gpt_oss
        from mxmoe.core.hf_checkpoint import read_hf_moe

        read = read_hf_moe if ckpt.get("family") else read_hf_gpt_oss
        layers = {f"layer.{n}": (lambda n=n: read(ckpt["path"], n)) for n in ckpt["layers"]}
    ep, tp = layout
    with _Step(f"compiling rank parts (ep={ep}, tp={tp}) for {target.name} and writing {out}", args.quiet):
        try:
            compiled, manifest = save_sharded(source, out, layout, target, layers=layers, source=desc,
                                              activations=args.activations, **_numerics_flags(args))
        except (ValueError, NotImplementedError) as e:
            raise CliError(str(e)) from None
    total = time.perf_counter() - t_all
    secs = {s["name"]: s["size"] for s in manifest["sections"]}
    per_rank = [v for k, v in secs.items() if k.startswith("weights/")]
    c = source.config
    part = f"{c.num_experts // ep} experts x intermediate {c.intermediate // tp} a rank"
    whole = _describe_source(desc, compiled).split("[", 1)[-1]
    print(f"compiled MoE layer (E={c.num_experts}, k={c.top_k}, H={c.hidden}, I={c.intermediate}) [{whole} cut "
          f"ep={ep} x tp={tp} = {ep * tp} ranks ({part}) for {target.name} in {total:.1f} s")
    for e in compiled.entries:
        print(f"  entry   {e.describe()} (each rank's part)")
    names = (f"{ep * tp} weight sets rank.0..rank.{ep * tp - 1}" if layers is None else
             f"{len(per_rank)} weight sets layer.N.rank.R for {len(layers)} layers")
    print(f"  wrote   {out}: {_human(out.stat().st_size)} ({names}, {_human(max(per_rank))} each; a rank maps only "
          "its own)")
    return 0


def _describe_source(desc: dict, compiled) -> str:
    m = compiled.model
    what = ""
    if m and m.get("kind") == "moe":
        c = m["config"]
        what = f"MoE layer (E={c['num_experts']}, k={c['top_k']}, H={c['hidden']}, I={c['intermediate']})"
    kind = desc["kind"]
    if kind == "preset":
        return f"{what} [random {desc['preset']}, seed {desc['seed']}]"
    if kind in ("hf-gpt-oss", "hf-moe"):
        return f"{what} [{desc['path']}, layer(s) {_ranges(desc['layers'])}]"
    if kind == "exported-program":
        return f"{what or 'exported program'} [{desc['path']}]"
    return f"{what or 'module'} [{desc['factory']}]"


# ============================================================================================ run

def _random_inputs(specs, tokens: int, seed: int, model: dict | None = None):
    """Random inputs for an entry: floats from N(0, 1); an MoE entry's routing inputs valid for the layer
    (``topk_ids``: distinct global expert ids per token, ``topk_weights``: in (0.05, 1.05))."""
    import numpy as np

    from mxmoe.core.bridge import numpy_dtype

    rng = np.random.default_rng(seed)
    cfg = (model or {}).get("config") or {}
    experts = cfg.get("global_num_experts") or cfg.get("num_experts")
    out = []
    for s in specs:
        shape = tuple(tokens if d is None else d for d in s.shape)
        dt = numpy_dtype(s.dtype)
        if s.name == "topk_ids" and experts and len(shape) == 2:
            out.append(np.stack([rng.permutation(experts)[: shape[1]] for _ in range(shape[0])]).reshape(shape).astype(dt))
        elif s.name == "topk_weights":
            out.append((rng.random(shape, dtype=np.float32) + 0.05).astype(dt))
        elif dt.kind == "f" or dt.name == "bfloat16":
            out.append(rng.standard_normal(shape, dtype=np.float32).astype(dt))
        else:
            out.append(rng.integers(0, 2, size=shape).astype(dt))
    return out


def cmd_run(args) -> int:

    from mxmoe.runtime import load
    from mxmoe.runtime.artifact import Artifact

    if args.tokens < 0:
        raise CliError(f"--tokens must be 0 or more, got {args.tokens}")
    if not (math.isfinite(args.tol) and args.tol >= 0):
        raise CliError(f"--tol must be a finite number >= 0, got {args.tol}")
    if args.output:
        output_path(args.output)  # checked before the run, not after it
    art = Artifact(args.artifact)
    # --check verifies the weights it compares: a changed byte would otherwise reach the module and the reference alike
    verify = args.verify or args.check
    with _Step(f"loading {args.artifact} for {art.target['name']}", args.quiet):
        mod = load(args.artifact, device=args.device, weights=args.weights, weight_set=args.weight_set,
                   layer=args.layer, verify=verify, copy=args.copy)
    names = [args.entry] if args.entry else (mod.entry_names if args.check else mod.entry_names[:1])
    if args.input and len(names) > 1:
        names = names[:1]
    failed = False
    for name in names:
        try:
            entry = mod.entry(name)
        except ValueError as e:
            raise CliError(str(e)) from None
        failed |= _run_entry(args, art, mod, entry, name, len(mod.entry_names) > 1) != 0
    return EXIT_MISMATCH if failed else 0


def _run_entry(args, art, mod, entry, name: str, named: bool) -> int:
    """Run (and with --check, check) one entry; 0, or EXIT_MISMATCH when its check fails."""
    import numpy as np

    if args.input:
        p = Path(args.input)
        if not p.is_file():
            raise CliError(f"{p}: no such input file")
        try:
            x = np.load(p, allow_pickle=False)
        except ValueError as e:
            raise CliError(f"{p}: not a .npy array ({_first_line(e)})") from None
        inputs = [x]
    else:
        inputs = _random_inputs(entry.inputs, args.tokens, args.seed, art.manifest.get("model"))
    try:
        out = entry(*inputs)  # first call (warm-up)
    except ValueError as e:
        raise CliError(str(e)) from None
    times = []
    for _ in range(max(args.repeat, 1)):
        t0 = time.perf_counter()
        out = entry(*inputs)
        times.append(time.perf_counter() - t0)
    outs = out if isinstance(out, tuple) else (out,)
    tokens = inputs[0].shape[0] if inputs[0].ndim >= 1 else 1
    what = f"{art.target['name']} module" + (f", entry {name}," if named else "")
    print(f"ran {what} on {tuple(inputs[0].shape)} input ({tokens} tokens): "
          f"{np.median(times) * 1e3:.2f} ms (median of {len(times)}); output {tuple(outs[0].shape)} {outs[0].dtype}")
    if args.output:
        o = np.asarray(outs[0])
        if o.dtype.name == "bfloat16":  # .npy has no bfloat16: store the exact values as float32
            o = o.astype(np.float32)
        buf = io.BytesIO()
        np.save(buf, o)  # in memory first: numpy's own file writes report a full disk without its errno
        with write_atomically(args.output) as f:
            f.write(buf.getbuffer())  # exactly the path given, no .npy appended
        print(f"  wrote {args.output} ({o.dtype})")
    if not args.check:
        return 0
    ref, impl = _reference(args, entry, art, inputs, name)
    from mxmoe.core.reference import relative_error

    err = relative_error(np.asarray(outs[0], dtype=np.float32), ref)
    ok = err <= args.tol
    embedded = args.weights is None and art.manifest["weights"].get("storage") == "embedded"
    verified = "weights match their sha256; " if embedded else ""
    print(f"check{f' ({name})' if named else ''}: {verified}max relative error vs the {impl} reference {err:.2e} "
          f"(tolerance {args.tol:.0e}) -> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else EXIT_MISMATCH


def _reference(args, mod, art, inputs, entry: str):
    """The reference output (float32) of ``entry`` for ``inputs`` from the artifact's own weights."""
    import numpy as np

    from mxmoe.runtime.loader import logical_parameters, parameter_arrays
    from mxmoe.core.bridge import numpy_dtype
    from mxmoe.core.reference import weights_from_parameters

    if args.reference:
        import torch

        from mxmoe.torch_frontend import load_program

        ep = load_program(args.reference)
        targs = []
        for a, s in zip(inputs, mod.inputs):
            t = torch.from_numpy(np.asarray(a, dtype=np.float32))
            targs.append(t.to(getattr(torch, s.dtype)) if s.dtype in ("bfloat16", "float16", "float32") else t)
        with torch.no_grad():
            r = ep.module()(*targs)
        r = r[0] if isinstance(r, (tuple, list)) else r
        return r.float().numpy(), f"exported-program ({args.reference})"
    model = art.manifest.get("model")
    if not model or model.get("kind") != "moe":
        raise CliError(f"{art.path}: --check needs a reference; this artifact was compiled from a general module, "
                       "so give the exported program with --reference SOURCE.pt2")
    stored, _ = parameter_arrays(art, args.weights, args.weight_set, args.layer)
    weights = weights_from_parameters(model, logical_parameters(art, stored))
    return _layer_reference(weights, entry, inputs, numpy_dtype(mod.inputs[0].dtype),
                            prefer_torch=not args.numpy_reference, activations=art.target.get("activations", "bf16"),
                            mx_fold=reference_fold(art.target))


def reference_fold(target: dict) -> str:
    """The numpy reference's ``mx_fold`` for an artifact's target record: the sm_90 w4a8 form folds its MX scales
    per row (docs/nvidia.md), every other form computes the OCP blocks as they are."""
    return "row" if target.get("activations") == "mxfp8" and target.get("name") == "cuda:sm_90" else "block"


#: an MoE entry's inputs after the hidden states, as the references name them (main: the layer entry's old name)
_ENTRY_ARGS = {"layer": (), "main": (), "monolithic": ("router_logits",), "modular": ("topk_weights", "topk_ids")}


def _layer_reference(weights, entry: str, inputs, activation_dtype, prefer_torch: bool, activations: str = "bf16",
                     mx_fold: str = "block"):
    """(reference output of ``entry`` as float32, which implementation ran): mxmoe's torch layer where torch is
    installed, else the numpy reference (same semantics; a deploy box may have no torch). A w4a8 module
    (``activations="mxfp8"``) is compared with the numpy reference that rounds the activations to MXFP8 as it does:
    against the bf16 one its error is that of MXFP8 itself (~5%), above any useful tolerance; a cpu module with
    ``activations="mxint8"`` with the reference that rounds them to MXINT8 (its own error ~1-2.5%), and one with
    ``"mxint16"`` with the one that rounds them as it does (below bf16's resolution)."""
    import numpy as np

    from mxmoe.core.reference import numpy_reference

    if entry not in _ENTRY_ARGS:
        raise CliError(f"--check knows the MoE entries {', '.join(_ENTRY_ARGS)}, not {entry!r}")
    x = np.asarray(inputs[0], dtype=np.float32)
    extra = dict(zip(_ENTRY_ARGS[entry], inputs[1:]))
    if prefer_torch and activations == "bf16":
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            from mxmoe.core.bridge import to_torch, torch_dtype
            from mxmoe.torch_frontend.moe import MoE

            tdt = torch_dtype(np.dtype(activation_dtype).name)
            layer = MoE(weights, dtype=tdt)
            xt = torch.from_numpy(np.ascontiguousarray(x)).to(tdt)
            with torch.no_grad():
                if entry == "monolithic":
                    out = layer.monolithic(xt, to_torch(extra["router_logits"]).to(tdt))
                elif entry == "modular":
                    out = layer.modular(xt, to_torch(extra["topk_weights"]), to_torch(extra["topk_ids"]))
                else:
                    out = layer(xt)
            return out.float().numpy(), "torch"
    np_entry = "layer" if entry == "main" else entry
    return numpy_reference(weights, x, activation_dtype, entry=np_entry, activations=activations, mx_fold=mx_fold,
                           **{k: np.asarray(v) if k == "topk_ids" else np.asarray(v, np.float32)
                              for k, v in extra.items()}), "numpy" + (
        "" if activations == "bf16" else " (MXFP8 activations, per-row scales)" if mx_fold == "row"
        else f" ({activations.upper()} activations)")


# ============================================================================================ inspect

def cmd_inspect(args) -> int:
    from mxmoe.runtime.artifact import Artifact
    from mxmoe.core.signature import TensorSpec

    art = Artifact(args.artifact)
    if args.verify:
        art.verify()
    m = art.manifest
    if args.json:
        print(json.dumps(m, indent=2))
        return 0
    t = m["target"]
    print(f"{art.path}: mxmoe artifact, format v{art.version}, written by mxmoe {m.get('mxmoe_version', '?')}, "
          f"{_human(art.size)}")
    line = f"  target      {t['name']} (backend {t['backend']}, arch {t['arch']})"
    if t.get("cpu_features"):
        line += f"; compiled for CPU features {' '.join(t['cpu_features'])}"
    if "cpu_microkernel" in t:
        line += "; with the C matvec microkernel" if t["cpu_microkernel"] else "; linalg matvec (no C microkernel)"
    print(line)
    if "activations" in t:
        form = {"mxfp8": "w4a8: the expert GEMMs read MXFP8 activations",
                "mxint8": "the expert GEMMs read MXINT8 activations",
                "mxint16": "the expert GEMMs read 15-bit integer activations per 32-value block"}.get(t["activations"])
        print(f"  activations {t['activations']}" + (f" ({form}; run --check compares with the reference that rounds "
                                                   "them the same way)" if form else ""))
    numerics = t.get("numerics")
    if numerics is not None:
        print(f"  numerics    deterministic {'yes' if numerics.get('deterministic') else 'no'}, batch invariant "
              f"{'yes' if numerics.get('batch_invariant') else 'no'} (routing: batch invariant always)")
    model = m.get("model")
    if model and model.get("kind") == "moe":
        c = model["config"]
        flags = [c["routing"], c["activation"], "interleaved gate/up" if c["interleaved"] else "gate|up halves",
                 "biases" if c["bias"] else "no biases"]
        print(f"  layer       MoE: {c['num_experts']} experts, top-{c['top_k']}, hidden {c['hidden']}, "
              f"intermediate {c['intermediate']} ({', '.join(flags)})")
    shard = m.get("shard")
    if shard:
        c = shard["layer"]
        sets = "layer.N.rank.R is rank R's part of layer N" if shard.get("layers") else "rank.R is rank R's part"
        print(f"  sharded     ep={shard['ep']} x tp={shard['tp']} = {shard['world']} ranks of a layer of "
              f"{c['num_experts']} experts, intermediate {c['intermediate']} (weight set {sets}; run with "
              "mxmoe.distributed.load)")
    src = m.get("source")
    if src:
        print(f"  source      {', '.join(f'{k}={v}' for k, v in src.items())}")
    for e in m["entries"]:
        ins = ", ".join(TensorSpec.from_dict(d).describe() for d in e["inputs"])
        outs = ", ".join(TensorSpec.from_dict(d).describe() for d in e["outputs"])
        print(f"  entry       {e['name']}({ins}) -> {outs}   (? = dynamic)")
    print(f"  module      {art.code().describe()}")
    w = m["weights"]
    sets = w.get("sets", [])
    names = ", ".join(s["name"] for s in sets[:6]) + (" ..." if len(sets) > 6 else "")
    sizes = sum(art.section_info(s["section"])["size"] for s in sets if s.get("section"))
    print(f"  weights     {w['storage']}, {w['format']}, {len(sets)} set(s): {names}"
          + (f" (default {w.get('default')})" if len(sets) > 1 else "") + (f", {_human(sizes)}" if sizes else ""))
    if w["storage"] == "external":
        for s in w.get("sets", [])[:6]:
            print(f"                {s['name']}: {s.get('source')}")
    print("  parameters")
    for p in m["parameters"]:
        f = p.get("form") or {}
        extra = []
        if f.get("role"):
            extra.append(f["role"])
        if f.get("layout"):
            extra.append(f"layout {f['layout']}")
        if f and list(f.get("shape", [])) != list(f.get("padded_shape", [])):
            extra.append(f"padded from {list(f['shape'])}")
        print(f"    {p['name']:<16} {p['dtype']}{list(p['shape'])}  {', '.join(extra)}")
    print("  sections")
    for s in m["sections"]:
        print(f"    {s['name']:<28} {s['kind']:<24} offset {s['offset']:>12}  {_human(s['size']):>10}  "
              f"sha256 {s['sha256'][:16]}")
    if args.verify:
        print("  verified: every section matches its sha256")
    return 0


# ============================================================================================ main

def build_parser() -> argparse.ArgumentParser:
    from mxmoe.core.config import PRESETS

    p = argparse.ArgumentParser(
        prog="mxmoe", description="Compile MXFP4 Mixture-of-Experts layers ahead of time and run them.",
        epilog="Targets: cpu, rocm:gfx942, rocm:gfx950, cuda:sm_90, cuda:sm_100. "
               "See docs/user-guide.md. Set MXMOE_DEBUG=1 to see tracebacks.")
    p.add_argument("--version", action="version", version=f"mxmoe {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser("compile", help="compile a layer or model into one .mxmoe artifact",
                       description="Compile SOURCE for TARGET into one artifact file. SOURCE is a saved "
                                   "ExportedProgram (.pt2), a Hugging Face gpt-oss-style checkpoint directory, "
                                   "or module.path:factory (a callable returning (nn.Module, example_inputs)).")
    c.add_argument("source", nargs="?", help="model.pt2 | CHECKPOINT_DIR | module.path:factory")
    c.add_argument("--target", "-t", required=True, help="cpu, rocm:gfx942, rocm:gfx950, cuda:sm_90, cuda:sm_100")
    c.add_argument("-o", "--output", required=True, help="artifact file to write (e.g. model.mxmoe)")
    c.add_argument("--entries", help="MoE layers: the entry points to compile, comma-separated (layer, monolithic, "
                                     "modular) or 'all'; default: layer")
    c.add_argument("--preset", choices=sorted(PRESETS), help="compile a random example layer of this shape instead of SOURCE")
    c.add_argument("--seed", type=int, default=0, help="seed of the --preset layer's random weights")
    c.add_argument("--layer", type=int, help="checkpoint SOURCE: compile this MoE layer only (default: all MoE "
                                             "layers, one compiled module with one weight set per layer)")
    c.add_argument("--weights", choices=("embedded", "external"), default="embedded",
                   help="embedded: store the weights in the artifact (default); external: store none, the "
                        "runtime reads them from the checkpoint at load time")
    c.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                   help="activation dtype of --preset/checkpoint layers (default bfloat16)")
    c.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="the same input gives the same output bits on every call (the default on cuda and cpu; "
                        "cuda --no-deterministic: fp32 atomics may add more than twice into an output)")
    c.add_argument("--batch-invariant", action="store_true",
                   help="a token's output bits do not depend on its batch (cuda: every token-count class reduces "
                        "alike; implies --deterministic); docs/routing.md")
    c.add_argument("--shard", metavar="LAYOUT", help="cut MoE layers over ranks: ep:N, tp:N or ep:A,tp:B; writes "
                   "one artifact with a weight set per rank (rank.R; layer.N.rank.R for a whole checkpoint), run with "
                   "mxmoe.distributed.load under torchrun (docs/distributed.md)")
    c.add_argument("--activations", choices=("bf16", "mxfp8", "mxint8", "mxint16"), default=None,
                   help="the form the expert GEMMs take the activations in: bf16 (default), mxint8 (cpu: int8 "
                        "activations), mxint16 (cpu: 15-bit integer activations as two int8 planes, faster than "
                        "bf16 at few rows per expert; docs/cpu.md) or mxfp8 (w4a8: "
                        "rocm:gfx950, cuda:sm_90, cuda:sm_100; docs/nvidia.md, docs/amd.md)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    c.set_defaults(func=cmd_compile)

    r = sub.add_parser("run", help="run an artifact on random (or given) input, optionally check it",
                       description="Load ARTIFACT, run it on random input of --tokens tokens (or --input x.npy) "
                                   "and print the time; --check compares with the reference MoE computed from "
                                   "the artifact's own weights and exits 3 on a mismatch.")
    r.add_argument("artifact")
    r.add_argument("--tokens", "-n", type=int, default=4, help="tokens of random input (default 4; 0 is an empty "
                                                                "batch)")
    r.add_argument("--input", help=".npy file with the input instead of random data")
    r.add_argument("--output", help="write the output to this file, in .npy format (bfloat16 as float32)")
    r.add_argument("--check", action="store_true", help="compare with the reference; exit 3 if it disagrees "
                                                        "(every entry of the artifact, unless --entry names one)")
    r.add_argument("--entry", help="entry point to run (layer, monolithic, modular...; default: the first)")
    r.add_argument("--tol", type=float, default=DEFAULT_TOL, help=f"--check tolerance (default {DEFAULT_TOL})")
    r.add_argument("--numpy-reference", action="store_true", help="--check with the numpy reference even if torch is installed")
    r.add_argument("--reference", help="--check against this exported program (.pt2) instead of the MoE reference")
    r.add_argument("--weights", help="weights to bind: checkpoint directory (with --layer) or safetensors file")
    r.add_argument("--layer", type=int, help="checkpoint layer: for --weights / external weights, or the embedded "
                                             "weight set layer.N of a whole-checkpoint artifact")
    r.add_argument("--weight-set", help="embedded weight set to bind (e.g. layer.3; default: the artifact's default)")
    r.add_argument("--device", help="device (cpu targets: cpu, local-task, local-sync)")
    r.add_argument("--repeat", type=int, default=3, help="timed runs after one warm-up (default 3)")
    r.add_argument("--seed", type=int, default=1, help="seed of the random input")
    r.add_argument("--verify", action="store_true", help="also check the weights' sha256 before running "
                                                          "(--check always does)")
    r.add_argument("--copy", action="store_true", help="read the weights into memory instead of mapping the file")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("inspect", help="print an artifact's manifest in human form",
                       description="Print what ARTIFACT holds: target, entry signature, weights, sections.")
    i.add_argument("artifact")
    i.add_argument("--json", action="store_true", help="print the raw manifest as JSON")
    i.add_argument("--verify", action="store_true", help="check every section's sha256")
    i.set_defaults(func=cmd_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("mxmoe: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `mxmoe inspect X | head`: stop quietly, like other command-line tools
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception as e:  # noqa: BLE001 - every failure becomes one readable line
        if os.environ.get("MXMOE_DEBUG"):
            raise
        print(f"mxmoe: error: {_error_line(e)}", file=sys.stderr)
        return EXIT_ERROR


def _error_line(e: BaseException) -> str:
    msg = _first_line(e)
    # ArtifactError and WeightsError are ValueErrors, OutputError an OSError; TargetUnavailableError is checked by
    # name (importing the runtime here could itself fail, and the error line must still print)
    if isinstance(e, (CliError, ValueError, OSError, NotImplementedError)):  # OSError: e.g. no space left on device
        return msg
    if type(e).__name__ == "TargetUnavailableError":
        return msg
    if type(e).__name__ == "CompileError":
        return msg
    return f"internal error ({type(e).__name__}: {msg}); rerun with MXMOE_DEBUG=1 for a traceback"


if __name__ == "__main__":
    sys.exit(main())
