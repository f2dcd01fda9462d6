"""Ahead of time for sharded layers: one artifact holding every rank's part, and the loader that runs a rank's part
with the collectives around it (docs/distributed.md).

One file with a weight set per rank (``rank.0`` .. ``rank.N-1``), not a file per rank, because every rank's part
has the same shapes (the cut needs ``E % ep == 0``), so one compiled module serves every rank: it is compiled
once (a file per rank would compile the same program N times), shipped and checked as one thing, and the cut is
recorded once. A rank maps only its own weight section (the runtime never touches the other ranks' bytes), so
the price is disk space on each host, not memory or load time.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from mxmoe.core.bridge import dtype_name, to_numpy, to_torch, torch_dtype
from mxmoe.core.config import MoEConfig
from mxmoe.distributed import DistributedError, ShardedMoE, ShardSpec, fingerprint, shard_weights
from mxmoe.runtime.artifact import Artifact, ArtifactError, Section, read_safetensors_view, safetensors_writer
from mxmoe.runtime.code import KIND_SAFETENSORS
from mxmoe.torch_frontend.moe import MoE

__all__ = ["parse_layout", "save_sharded", "load"]

#: the router's tensors, replicated in a section of the artifact (``shard/router.safetensors``, or
#: ``shard/router.layer.N.safetensors`` each): every rank routes its own tokens
_ROUTER = ("router_weight", "router_bias", "score_bias")


def parse_layout(text: str) -> tuple[int, int]:
    """``"ep:4"``, ``"tp:2"`` or ``"ep:2,tp:2"`` -> (ep, tp)."""
    counts = {"ep": 1, "tp": 1}
    seen = set()
    for part in str(text).split(","):
        key, sep, value = part.strip().partition(":")
        if key not in counts or not sep or key in seen or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"shard layout must look like ep:4, tp:2 or ep:2,tp:2, got {text!r}")
        seen.add(key)
        counts[key] = int(value)
    return counts["ep"], counts["tp"]


def save_sharded(layer: MoE, path, layout, target="cpu", *, layers=None, source: dict | None = None, progress=None,
                 **options):
    """Compile ``layer``'s part once for ``target`` and write one artifact with every rank's weights.

    ``layout``: ``(ep, tp)`` or its text form (:func:`parse_layout`); ``options`` go to ``mxmoe.compile``
    (``deterministic``, ``batch_invariant``...). ``layers``: several layers of ``layer``'s shape in one artifact
    (a whole checkpoint), as ``{name: callable returning its MoEWeights}`` (e.g. ``"layer.3"``): their sets are
    ``NAME.rank.R``, each layer read once for all its ranks. Returns (rank 0's compiled part, the manifest)."""
    import mxmoe

    if not isinstance(layer, MoE):
        raise TypeError(f"shard: expected an mxmoe MoE layer, got {type(layer).__name__}")
    if not layer.config.router:
        raise ValueError("shard: the layer needs its own router (each rank routes its tokens)")
    ep, tp = parse_layout(layout) if isinstance(layout, str) else (int(layout[0]), int(layout[1]))
    world = ep * tp
    specs = [ShardSpec(ep, tp, r) for r in range(world)]
    if layer.config.num_experts % ep:
        raise ValueError(f"shard: an artifact for ep={ep} needs the expert count ({layer.config.num_experts}) to be "
                         f"a multiple of {ep}, so that every rank's part has the same shapes and one compiled module "
                         "serves all (shard() in memory takes uneven cuts)")
    first = MoE(shard_weights(layer.to_weights(), specs[0]), dtype=layer.dtype)
    entries = ["modular_routed", "shared"] if layer.config.shared_intermediate else ["modular"]
    compiled = mxmoe.compile(first, target=target, entries=entries, **options)
    fields = (compiled.model or {}).get("parameters")
    if not fields:
        raise ValueError("shard: the compiled part's parameters are not an MoE layer's; cannot write per-rank sets")

    getters = {None: layer.to_weights} if layers is None else dict(layers)
    last: dict = {}

    def read(name) -> MoE:
        """Layer ``name`` as a module (the last one read is kept: its router and every rank's set come next)."""
        if name not in last:
            last.clear()
            w = getters[name]()
            if w.config != layer.config:
                raise ValueError(f"shard: layer {name} has another config than the compiled one")
            last[name] = layer if name is None else MoE(w, dtype=layer.dtype)
        return last[name]

    def rank_set(name, spec):
        def get():
            part = shard_weights(read(name).to_weights(), spec)
            return {param: getattr(part, field) for field, param in fields.items()}
        return get

    def router(name):
        def write(f) -> None:
            m = read(name)
            safetensors_writer({k: to_numpy(getattr(m, k)) for k in _ROUTER if getattr(m, k, None) is not None})(f)
        return write

    def prefix(name) -> str:
        return "" if name is None else f"{name}."

    routers = {name: f"shard/router.{prefix(name)}safetensors" for name in getters}
    sets = {f"{prefix(name)}rank.{s.rank}": rank_set(name, s) for name in getters for s in specs}
    record = {"ep": ep, "tp": tp, "world": world, "layer": layer.config.to_dict(), "dtype": dtype_name(layer.dtype),
              "fingerprint": fingerprint(layer, ep, tp), "entries": entries,
              "experts_per_rank": layer.config.num_experts // ep, "weight_sets": list(sets)}
    if layers is None:
        record["router"] = routers[None]
    else:
        record["layers"] = routers  # name -> its router's section
    # routers first (each layer read once), then the sets layer by layer (each layer read once more, for all ranks)
    manifest = compiled.save(path, weights="embedded", weight_sets=sets, source=source, progress=progress,
                             shard=record, extra_sections=[Section(sec, KIND_SAFETENSORS, router(name))
                                                           for name, sec in routers.items()])
    return compiled, manifest


def _open_part(path, rank: int, world: int, group, device, dispatch, verify, layer) -> tuple[ShardedMoE, dict, str]:
    import mxmoe.runtime

    art = Artifact(path)
    rec = art.manifest.get("shard")
    if rec is None:
        raise ArtifactError(f"{art.path}: not a sharded artifact (write one with mxmoe compile --shard ep:N ...)")
    if int(rec["world"]) != world:
        raise ArtifactError(f"{art.path}: cut for {rec['world']} ranks (ep={rec['ep']}, tp={rec['tp']}), but the "
                            f"group has {world}")
    module = mxmoe.runtime.load(path, device, rank=rank, layer=layer, verify=verify)
    section = rec["router"] if "layers" not in rec else rec["layers"][f"layer.{int(layer)}"]
    router = {k: to_torch(v.copy()) for k, v in read_safetensors_view(art.section(section), section).items()}
    part = ShardedMoE.from_compiled(MoEConfig.from_dict(rec["layer"]), torch_dtype(rec["dtype"]),
                                    ShardSpec(int(rec["ep"]), int(rec["tp"]), rank), module, router, group, dispatch)
    return part, rec, module.weight_set


def load(path, group=None, *, layer: int | None = None, device: str | None = None, dispatch: str = "auto",
         verify: bool = False) -> ShardedMoE:
    """This rank's part of the sharded artifact ``path`` as a :class:`~mxmoe.distributed.ShardedMoE` (its
    ``forward`` takes this rank's tokens and returns the layer's output for them); ``layer``: which layer of an
    artifact holding several. Every rank of ``group`` must call it; a rank whose file is missing, corrupt, cut for
    another group size, or another layout or layer than the others' makes every rank raise
    :class:`DistributedError` (within the process group's timeout)."""
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError("load: torch.distributed is not initialized (call init_process_group first)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    part, rec, problem, which = None, None, None, None
    try:
        part, rec, which = _open_part(path, rank, world, group, device, dispatch, verify, layer)
    except (ArtifactError, ValueError, RuntimeError, OSError, KeyError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        problem = text if str(Path(path)) in text else f"{path}: {text}"
    mine = {"problem": problem, "cut": None if rec is None else f"ep={rec['ep']}, tp={rec['tp']}",
            "layer": None if rec is None else f"{rec['fingerprint']}" + (f" ({which.rpartition('.rank.')[0]})"
                                                                         if ".rank." in which else "")}
    everyone: list = [None] * world
    try:
        dist.all_gather_object(everyone, mine, group=group)
    except RuntimeError as e:
        raise DistributedError(f"rank {rank}: could not agree with the other ranks on {path} "
                               f"({str(e).splitlines()[0][:200]})") from e
    bad = [r for r, m in enumerate(everyone) if m["problem"]]
    if bad:
        raise DistributedError(f"rank {rank}: rank(s) {bad} could not load their shard: {everyone[bad[0]]['problem']}")
    if len({(m["cut"], m["layer"]) for m in everyone}) != 1:
        seen = "; ".join(f"rank {r}: {m['cut']} of layer {m['layer']}" for r, m in enumerate(everyone))
        raise DistributedError(f"rank {rank}: ranks loaded shards of different layouts or layers ({seen}); load "
                               "the same artifact on every rank")
    return part
