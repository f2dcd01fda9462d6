"""``mxmoe.runtime.load``: an artifact file -> a callable module. The IREE path needs no torch or triton.

    mod = mxmoe.runtime.load("model.mxmoe")
    y = mod(x)            # numpy in -> numpy out; torch in -> torch out

Inputs are checked against the artifact's entry signature (dtype, rank, static dims, dynamic-dim
bounds); float32/bfloat16/float16 inputs are converted to the entry's float dtype.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Mapping

import numpy as np

from mxmoe.core.bridge import numpy_dtype
from mxmoe.core.signature import EntrySignature, TensorSpec
from mxmoe.core.stored_form import StoredForm
from mxmoe.runtime.artifact import Artifact, ArtifactError, irpa_index, read_safetensors_view
from mxmoe.runtime.code import KIND_IRPA, KIND_SAFETENSORS, TargetUnavailableError
from mxmoe.runtime.module import EntryPoints


class WeightsError(ValueError):
    """Weights for an artifact could not be found or do not fit it."""


# ============================================================================================ module

class LoadedModule(EntryPoints):
    """A compiled module loaded from an artifact; call it like the layer it was compiled from (its default entry),
    or ``entry(name)`` for another (``mod.entry("modular")(x, topk_weights, topk_ids)``)."""

    def __init__(self, artifact: Artifact, code, executor, weight_set: str | None, mapped: bool = False):
        # a file changed under the mapping: an error at the next call, not SIGBUS or silently new weights
        super().__init__([EntrySignature.from_dict(d) for d in artifact.manifest["entries"]], code, executor,
                         guard=artifact.check_unchanged if mapped else None,
                         weight_bytes=sum(TensorSpec.from_dict(p).static_nbytes() for p in artifact.manifest["parameters"]))
        self.artifact = artifact
        self.manifest = artifact.manifest
        self.path = artifact.path
        self.target = artifact.target["name"]
        self.weight_set = weight_set
        #: whether the weights are read from the artifact's mapping at every call (else they were copied at load)
        self.mapped = mapped

    @property
    def kernel_plan(self) -> dict | None:
        """The Triton kernel plan of a cuda artifact (None for IREE targets), as ``CompiledModule.kernel_plan``."""
        return getattr(self._code, "plan", None)

    def __repr__(self) -> str:
        sig = ", ".join(s.describe() for s in self.inputs)
        return f"<mxmoe module {self.path.name} target={self.target} ({sig})>"


# ============================================================================================ load

def load(path: str | os.PathLike, device: str | None = None, *, weights: str | os.PathLike | None = None,
         weight_set: str | None = None, layer: int | None = None, verify: bool = False,
         copy: bool = False, rank: int | None = None) -> LoadedModule:
    """Load an mxmoe artifact for ``device`` and return a callable module.

    ``device``: None picks the target's default (``local-task`` for cpu, ``hip`` for rocm, the current
    CUDA device for cuda targets); cpu artifacts accept ``"cpu"``, ``"local-task"`` and ``"local-sync"``;
    cuda artifacts accept ``"cuda"``/``"cuda:N"``, or ``"interpret"`` to run the kernel plan under
    Triton's interpreter on the CPU (slow; for tests).
    ``weight_set``: which embedded weight set to bind (artifacts compiled from a whole checkpoint hold
    one per layer, named ``layer.N``; ``layer=N`` alone picks ``layer.N``); default: the artifact's default set.
    ``weights``: for artifacts saved with external weights or none (or to override embedded ones), a gpt-oss
    checkpoint directory (with ``layer``), a safetensors file whose tensors are named like the artifact's
    parameters, or weights already in memory: a mapping of parameter name to array (numpy, or a torch tensor on any
    device), or an ``MoEWeights`` of the layer the artifact was compiled from (its fields named by the manifest's
    ``model``); the runtime applies each parameter's stored form (padding, layout).
    ``rank``: for an artifact holding the parts of a sharded layer (``mxmoe compile --shard``), the rank whose part
    to load (its weight set ``rank.R``); such an artifact refuses to load without it, since one rank's part alone
    is not the layer (``mxmoe.distributed.load`` runs it with the collectives, docs/distributed.md).
    ``verify``: check the sha256 of the weight section too (module sections are always checked).
    ``copy``: read the embedded weights into memory instead of mapping them, so the module no longer depends on
    the file. Without it, a call refuses to run once the file was changed in place (``ArtifactError``).
    External weights are always read into memory.
    """
    art = Artifact(path)
    if rank is not None or "shard" in art.manifest:
        weight_set, layer = _shard_set(art, weight_set, rank, layer), None
    weight_set = _resolve_set(art, weights, weight_set, layer)
    code = art.code()
    try:
        code.check_runnable(art.target, device)
    except TargetUnavailableError as e:
        raise TargetUnavailableError(f"{art.path}: {e}") from None
    params, set_name, mapped = _weights_for(art, code, weights, weight_set, layer, verify, copy)
    try:
        executor = code.executor(params, art.target, device)
    except RuntimeError as e:
        raise ArtifactError(f"{art.path}: could not load the module: {str(e).splitlines()[0]}") from None
    return LoadedModule(art, code, executor, set_name, mapped)


# ============================================================================================ weights

def _shard_set(art: Artifact, weight_set, rank, layer) -> str:
    """The weight set of ``rank`` (of ``layer``, in one holding several) in a sharded artifact; errors for a rank
    or layer outside it, or none given."""
    shard = art.manifest.get("shard")
    if shard is None:
        raise ArtifactError(f"{art.path}: rank={rank} given, but this artifact is not sharded (no per-rank parts)")
    world, cut = int(shard["world"]), f"ep={shard['ep']}, tp={shard['tp']}"
    if rank is None:
        if weight_set is not None:
            return weight_set
        raise ArtifactError(f"{art.path}: holds the parts of a layer sharded over {world} ranks ({cut}); pass "
                            "rank=R (or weight_set='rank.R') to load one, and run it with mxmoe.distributed.load "
                            "under torchrun")
    prefix = ""
    if shard.get("layers"):
        names = list(shard["layers"])
        if layer is None or f"layer.{int(layer)}" not in names:
            have = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
            raise ArtifactError(f"{art.path}: holds {len(names)} sharded layers ({have}); pass layer=N of them"
                                + ("" if layer is None else f", not {layer}"))
        prefix = f"layer.{int(layer)}."
    elif layer is not None:
        raise ArtifactError(f"{art.path}: holds one sharded layer; layer={layer} does not apply")
    want = f"{prefix}rank.{int(rank)}"
    if weight_set is not None and weight_set != want:
        raise ArtifactError(f"{art.path}: rank={rank} and weight_set={weight_set!r} disagree")
    if not 0 <= int(rank) < world:
        raise ArtifactError(f"{art.path}: rank {rank} is outside this artifact's {world} ranks ({cut})")
    return want


def _resolve_set(art: Artifact, weights, weight_set, layer) -> str | None:
    """``layer=N`` alone, on an artifact with embedded weight sets, names the set ``layer.N``."""
    if layer is not None and weights is None and weight_set is None and art.manifest["weights"].get("storage") == "embedded":
        return f"layer.{int(layer)}"  # a whole-checkpoint artifact holds one weight set per layer
    return weight_set


def _embedded_weight_section(art: Artifact, weight_set, verify: bool, copy: bool = False):
    """(weight set entry, its section's info, the section's bytes: a view of the mapping, or a copy)."""
    ws = art.weight_set(weight_set)
    if verify:
        art.verify([ws["section"]])
    view = art.section(ws["section"])
    return ws, art.section_info(ws["section"]), memoryview(bytes(view)) if copy else view


def _weights_for(art: Artifact, code, weights, weight_set, layer, verify, copy=False):
    """(what ``code``'s executor binds, the weight set's name, whether it reads the artifact's mapping): for an IREE
    archive embedded in the artifact, an index over it (nothing copied unless ``copy``); otherwise the stored arrays
    by parameter name."""
    embedded = weights is None and art.manifest["weights"].get("storage") == "embedded"
    if code.weights_format == KIND_IRPA and embedded:
        ws, info, view = _embedded_weight_section(art, weight_set, verify, copy)
        if info["kind"] != KIND_IRPA:
            raise ArtifactError(f"{art.path}: weight section {ws['section']!r} is {info['kind']}, expected {KIND_IRPA}")
        with _corrupt_section(art, ws["section"]):
            return irpa_index(view), ws["name"], not copy
    arrays, name = _parameter_arrays(art, weights, weight_set, layer, verify, copy)
    return arrays, name, embedded and not copy


@contextmanager
def _corrupt_section(art: Artifact, section: str):
    """A weight section that does not parse becomes one line: its checksum mismatch when the bytes changed after
    writing (IREE's parser raises ValueError, IndexError or RuntimeError), else what the parser said."""
    try:
        yield
    except ArtifactError:
        raise
    except (ValueError, IndexError, RuntimeError) as e:
        art.verify([section])
        raise ArtifactError(f"{art.path}: corrupt weight section {section!r} ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _parameter_arrays(art: Artifact, weights, weight_set, layer, verify,
                      copy=False) -> tuple[dict[str, np.ndarray], str]:
    """Stored-form arrays by parameter name: from an embedded section or from external weights."""
    if weights is None and art.manifest["weights"].get("storage") == "embedded":
        ws, info, view = _embedded_weight_section(art, weight_set, verify, copy)
        with _corrupt_section(art, ws["section"]):
            if info["kind"] == KIND_SAFETENSORS:
                return read_safetensors_view(view, f"{art.path}:{ws['section']}"), ws["name"]
            return _irpa_arrays(art, view), ws["name"]
    if _in_memory(weights):
        return stored_parameters(art.manifest, _memory_weights(art, weights)), "memory"
    if weights is None and art.manifest["weights"].get("storage") == "none":
        raise WeightsError(f"{art.path}: weights are not in the artifact; pass weights=... (a checkpoint, a "
                           "safetensors file, or MoEWeights / arrays in memory)")
    src, set_name = _external_source(art, weights, weight_set, layer)
    raw = raw_weights(art, src)
    return stored_parameters(art.manifest, raw), set_name


def _in_memory(weights) -> bool:
    return weights is not None and not isinstance(weights, (str, os.PathLike))


def _memory_weights(art: Artifact, weights) -> dict[str, np.ndarray]:
    """Logical arrays by parameter name from weights held in memory: a mapping by parameter name, or an object
    whose attributes are the fields of the manifest's ``model`` (an ``MoEWeights``)."""
    if isinstance(weights, Mapping):
        named = dict(weights)
    else:
        model = art.manifest.get("model") or {}
        fields = model.get("parameters")
        if model.get("kind") != "moe" or not fields:
            raise WeightsError(f"{art.path}: not compiled from an MoE layer; pass weights as a mapping of "
                               f"parameter name to array, not a {type(weights).__name__}")
        missing = [f for f in fields if not hasattr(weights, f)]
        if missing:
            raise WeightsError(f"{art.path}: a {type(weights).__name__} has no {', '.join(missing)}; pass MoEWeights "
                               "or a mapping of parameter name to array")
        named = _moe_arrays(model, weights)
    return {name: _host_array(name, a) for name, a in named.items()}


def _moe_arrays(model: dict, weights) -> dict:
    """``weights``' arrays (an ``MoEWeights``) by the parameter names the manifest's ``model`` gives its fields."""
    return {param: getattr(weights, field) for field, param in model["parameters"].items()
            if getattr(weights, field) is not None}


def _host_array(name: str, a) -> np.ndarray:
    """A numpy array of ``a`` (a torch tensor is read back to the host; bf16 as numpy's bfloat16)."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "detach"):  # a torch tensor, without importing torch here
        from mxmoe.core.bridge import to_numpy

        return to_numpy(a)
    try:
        return np.asarray(a)
    except (TypeError, ValueError):
        raise WeightsError(f"weight '{name}': expected an array, got {type(a).__name__}") from None


def _irpa_arrays(art: Artifact, view: memoryview) -> dict[str, np.ndarray]:
    index = irpa_index(view)
    entries = dict(index.items())
    out = {}
    for p in art.manifest["parameters"]:
        e = entries.get(p["name"])
        if e is None:
            raise ArtifactError(f"{art.path}: weight archive lacks parameter {p['name']!r}")
        flat = np.frombuffer(e.file_view, dtype=np.uint8) if e.is_file else np.array(e.splat_pattern)
        out[p["name"]] = flat.view(numpy_dtype(p["dtype"])).reshape(p["shape"])
    return out


def _external_source(art: Artifact, weights, weight_set, layer) -> tuple[dict, str]:
    if weights is not None:
        p = Path(weights)
        if p.is_dir():
            if layer is None:
                try:
                    recorded = art.weight_set(weight_set).get("source") or {}
                except ArtifactError:
                    recorded = {}
                layer = recorded.get("layer")
            if layer is None:
                raise WeightsError(f"{p}: a checkpoint directory needs a layer number (--layer N)")
            return {"kind": "hf-gpt-oss", "path": str(p), "layer": int(layer)}, f"layer.{int(layer)}"
        if p.is_file():
            return {"kind": "safetensors", "path": str(p)}, p.stem
        raise WeightsError(f"{p}: no such weights file or checkpoint directory")
    ws = art.weight_set(weight_set)
    src = dict(ws.get("source") or {})
    if not src.get("path"):
        raise WeightsError(f"{art.path}: weights are not in the artifact; pass weights=... (--weights PATH)")
    if layer is not None:
        src["layer"] = int(layer)
    if not Path(src["path"]).exists():
        raise WeightsError(f"{art.path}: weights are not in the artifact and the recorded source {src['path']} "
                           "does not exist here; pass weights=... (--weights PATH)")
    return src, ws["name"] if layer is None else f"layer.{int(layer)}"


def raw_weights(art: Artifact, src: dict) -> dict[str, np.ndarray]:
    """Logical (unpadded, row-major) arrays by parameter name from an external source."""
    kind = src.get("kind")
    if kind == "hf-gpt-oss":
        from mxmoe.core.checkpoint import read_hf_gpt_oss

        model = art.manifest.get("model") or {}
        if model.get("kind") != "moe":
            raise WeightsError(f"{art.path}: not compiled from an MoE layer; a gpt-oss checkpoint cannot fill its weights")
        w = read_hf_gpt_oss(src["path"], int(src["layer"]))
        cfg = w.config.to_dict()
        want = model["config"]
        diff = [k for k in ("num_experts", "top_k", "hidden", "intermediate") if cfg.get(k) != want.get(k)]
        if diff:
            raise WeightsError(f"{src['path']}: layer shape differs from the artifact's: "
                               + ", ".join(f"{k} {cfg[k]} vs {want[k]}" for k in diff))
        return _moe_arrays(model, w)
    if kind == "safetensors":
        from mxmoe.core.checkpoint import read_safetensors

        return read_safetensors(src["path"])
    raise WeightsError(f"{art.path}: unknown weights source kind {kind!r}")


def stored_parameters(manifest: dict, raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Raw logical arrays -> the stored arrays the compiled module reads (dtype cast, padding, layout),
    exactly as the compiler stored them (``mxmoe.core.stored_form.StoredForm``, which also refuses NaN weights).
    The result is in memory: it never views the raw arrays, which may map checkpoint files."""
    missing = [p["name"] for p in manifest["parameters"] if p["name"] not in raw]
    if missing:
        raise WeightsError(f"weights lack tensors: {', '.join(missing)}")
    out = {}
    for p in manifest["parameters"]:
        a = np.asarray(raw[p["name"]])
        want = numpy_dtype(p["dtype"])
        if a.dtype != want:
            if not (_is_float(a.dtype) and _is_float(want)):
                raise WeightsError(f"weight '{p['name']}': expected {p['dtype']}, got {a.dtype}")
            a = a.astype(want)
        try:
            if p.get("form"):
                a = StoredForm.from_dict(p["form"]).apply(p["name"], a)
        except ValueError as e:
            raise WeightsError(str(e)) from None
        if list(a.shape) != list(p["shape"]):
            raise WeightsError(f"weight '{p['name']}': expected shape {list(p['shape'])}, got {list(a.shape)}")
        stored = np.ascontiguousarray(a)
        if np.may_share_memory(stored, raw[p["name"]]):
            stored = stored.copy()  # never a view of a (memory-mapped) checkpoint: the module must not depend on it
        out[p["name"]] = stored
    return out


def _is_float(dt: np.dtype) -> bool:
    return dt.kind == "f" or dt.name == "bfloat16"


def logical_parameters(art: Artifact, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stored arrays -> logical ones (layout undone, padding sliced off), for reference checks."""
    out = {}
    for p in art.manifest["parameters"]:
        a = arrays[p["name"]]
        form = p.get("form")
        try:
            out[p["name"]] = StoredForm.from_dict(form).invert(p["name"], a) if form else a
        except ValueError as e:
            raise WeightsError(f"{art.path}: {e}") from None
    return out


def parameter_arrays(art: Artifact, weights=None, weight_set=None, layer=None) -> tuple[dict[str, np.ndarray], str]:
    """The stored arrays an artifact's module would bind (views into the file where embedded)."""
    return _parameter_arrays(art, weights, _resolve_set(art, weights, weight_set, layer), layer, verify=False)


def open_artifact(path: str | os.PathLike) -> Artifact:
    return Artifact(path)


__all__ = ["LoadedModule", "TargetUnavailableError", "WeightsError", "load", "open_artifact", "parameter_arrays",
           "stored_parameters", "logical_parameters", "raw_weights"]
