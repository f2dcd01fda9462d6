"""Expert- and tensor-parallel MoE layers over ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

``shard(layer, mode, group)`` returns this rank's part of an mxmoe ``MoE`` layer as a module whose forward takes
this rank's tokens and returns the full layer output for them; the collectives are inside. Every mode is the same
computation with a different cut of the weights (docs/distributed.md):

* each rank routes its own tokens (the router is replicated), so a token's experts follow the routing contract
  whatever rank it is on;
* **ep** (expert parallel): rank ``r`` holds a contiguous block of the experts (its ``expert_map`` sends the others'
  ids to -1, which contribute nothing); **tp** (tensor parallel): every rank holds a 1/tp slice of every expert's
  intermediate dimension (gate/up rows and the matching w2 columns; w2's bias on the first slice only);
  **ep+tp**: both at once, ``rank = ep_rank * tp + tp_rank``;
* the exchange: ``allgather`` (default, and the only one for tp > 1): the tokens and their routing are gathered
  from all ranks, each rank computes its experts' (or slices') partial outputs for all of them, and a
  reduce-scatter (an all-to-all of the fp32 partials, summed by the owner in rank order) sums them back to the
  rank that owns each token; ``all_to_all`` (ep only): a token is
  sent only to the ranks that hold one of its experts, and the partial outputs come back the same way;
* the shared expert (if any) runs once per token, on the rank that owns it.

Partial outputs cross the wire in fp32 and are summed in rank order, so the result is deterministic; it differs
from the single-process layer by the rounding of each rank's partial to the activation dtype (a few ulps).
Ahead of time: :mod:`mxmoe.shard_artifact` (one artifact, a weight set per rank; :func:`load` here).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mxmoe.core.config import MXFP4_BLOCK
from mxmoe.core.weights import MoEWeights
from mxmoe.torch_frontend.moe import MoE, route_tokens

#: torch >= 2.12 calls it all_gather_single (all_gather_into_tensor warns there); the GPU machines run 2.11
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["ShardSpec", "ShardedMoE", "shard", "shard_model", "load", "DistributedError", "DEFAULT_TIMEOUT"]

#: how long a collective may wait for the other ranks before it fails (a rank that died or hangs): the process
#: group's own timeout, which ``torch.distributed.init_process_group(timeout=...)`` sets; this is what mxmoe's
#: tests and benchmark use
DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)


#: why a sharded layer is a graph break under torch.compile (dynamo shows it, e.g. with ``fullgraph=True``)
_GRAPH_BREAK = ("mxmoe ShardedMoE runs outside the compiled graph: its collectives exchange data-dependent "
                "token counts; compile without fullgraph=True (the rest of the model is still compiled)")
try:
    _outside_the_graph = torch.compiler.disable(reason=_GRAPH_BREAK)
except TypeError:  # torch without disable(reason=...)
    _outside_the_graph = torch.compiler.disable


class DistributedError(RuntimeError):
    """Ranks disagree on the layer or its sharding, or a collective failed (a rank died or timed out)."""


# ============================================================================================ the cut

@dataclass(frozen=True)
class ShardSpec:
    """How a layer is cut over ``ep * tp`` ranks, and which part is ``rank``'s."""

    ep: int
    tp: int
    rank: int

    def __post_init__(self) -> None:
        if self.ep < 1 or self.tp < 1:
            raise ValueError(f"shard: ep and tp must be >= 1, got ep={self.ep}, tp={self.tp}")
        if not 0 <= self.rank < self.ep * self.tp:
            raise ValueError(f"shard: rank {self.rank} is outside 0..{self.ep * self.tp - 1}")

    @property
    def ep_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def experts(self, num_experts: int) -> range:
        """The global expert ids this rank holds: contiguous blocks, the first ``E % ep`` ranks one more."""
        base, extra = divmod(num_experts, self.ep)
        start = self.ep_rank * base + min(self.ep_rank, extra)
        return range(start, start + base + (self.ep_rank < extra))

    def intermediate(self, intermediate: int) -> range:
        """This rank's slice of each expert's intermediate dimension."""
        if intermediate % (self.tp * MXFP4_BLOCK):
            raise ValueError(f"shard: tp={self.tp} needs the intermediate size ({intermediate}) to be a multiple of "
                             f"tp x {MXFP4_BLOCK} = {self.tp * MXFP4_BLOCK} (each slice whole MXFP4 blocks)")
        size = intermediate // self.tp
        return range(self.tp_rank * size, (self.tp_rank + 1) * size)


def parse_mode(mode, world: int) -> tuple[int, int]:
    """(ep, tp) from ``"ep"``, ``"tp"``, ``"ep+tp"`` (needs a dict) or ``{"ep": a, "tp": b}`` over ``world`` ranks."""
    if isinstance(mode, dict):
        unknown = set(mode) - {"ep", "tp"}
        if unknown:
            raise ValueError(f"shard: unknown mode keys {sorted(unknown)} (use 'ep' and 'tp')")
        ep, tp = int(mode.get("ep", 1)), int(mode.get("tp", 1))
    elif mode == "ep":
        ep, tp = world, 1
    elif mode == "tp":
        ep, tp = 1, world
    elif mode == "ep+tp":
        raise ValueError('shard: mode "ep+tp" needs the split, e.g. {"ep": 4, "tp": 2}')
    else:
        raise ValueError(f"shard: mode must be 'ep', 'tp' or {{'ep': a, 'tp': b}}, got {mode!r}")
    if ep * tp != world:
        raise ValueError(f"shard: ep x tp = {ep} x {tp} = {ep * tp} ranks, but the group has {world}")
    return ep, tp


def shard_weights(w: MoEWeights, spec: ShardSpec) -> MoEWeights:
    """This rank's weights: its experts (an expert map from global ids), its slice of each one's intermediate
    dimension (w2's bias on the first slice only), and the shared expert whole; not the router."""
    cfg = w.config
    if cfg.expert_parallel:
        raise ValueError("shard: the layer is already a shard (it has an expert map); shard the whole layer")
    experts = np.asarray(spec.experts(cfg.num_experts))
    if len(experts) == 0:
        raise ValueError(f"shard: ep={spec.ep} leaves rank {spec.rank} without experts ({cfg.num_experts} in all)")
    sl = spec.intermediate(cfg.intermediate)
    i0, i1, size = sl.start, sl.stop, len(sl)
    if cfg.interleaved:  # gate/up rows in pairs
        rows = np.arange(2 * i0, 2 * i1)
    else:  # gate half, then up half
        rows = np.concatenate([np.arange(i0, i1), cfg.intermediate + np.arange(i0, i1)])
    expert_map = np.full(cfg.num_experts, -1, np.int32)
    expert_map[experts] = np.arange(len(experts), dtype=np.int32)
    first = spec.tp_rank == 0
    w13_bias = None if w.w13_bias is None else w.w13_bias[experts][:, rows]
    w2_bias = None if w.w2_bias is None else (w.w2_bias[experts] if first else np.zeros_like(w.w2_bias[experts]))
    # no router: a part runs the modular entry on the ids the replicated router chose (ShardedMoE holds it)
    local = cfg.replace(num_experts=len(experts), intermediate=size, global_num_experts=cfg.num_experts,
                        router=False, router_bias=False, score_bias=False)
    return MoEWeights(
        local, None, None,
        w13=w.w13[experts][:, rows], w13_scale=w.w13_scale[experts][:, rows], w13_bias=w13_bias,
        w2=w.w2[experts][:, :, i0 // 2: i1 // 2], w2_scale=w.w2_scale[experts][:, :, i0 // MXFP4_BLOCK: i1 // MXFP4_BLOCK],
        w2_bias=w2_bias, expert_map=expert_map, shared_w13=w.shared_w13, shared_w13_scale=w.shared_w13_scale,
        shared_w2=w.shared_w2, shared_w2_scale=w.shared_w2_scale, shared_gate_weight=w.shared_gate_weight,
        )


# ============================================================================================ the module

class ShardedMoE(nn.Module):
    """This rank's part of an MoE layer; ``forward(x)`` takes this rank's tokens and returns the layer's output for
    them (every rank of the group must call it, with its own tokens: 0 tokens is fine)."""

    def __init__(self, layer: MoE, spec: ShardSpec, group=None, dispatch: str = "auto"):
        super().__init__()
        if not layer.config.router:
            raise ValueError("shard: the layer needs its own router (each rank routes its tokens)")
        self._setup(layer.config, layer.dtype, spec, group, dispatch, layer.router_weight, layer.router_bias,
                    getattr(layer, "score_bias", None))
        self.local = MoE(shard_weights(layer.to_weights(), spec), dtype=layer.dtype).to(layer.router_weight.device)

    @classmethod
    def from_compiled(cls, config, dtype, spec: ShardSpec, compiled, router: dict, group=None,
                      dispatch: str = "auto") -> "ShardedMoE":
        """A part whose experts run ``compiled`` (a module with the "modular" entry, or "modular_routed" and
        "shared"; e.g. a rank's weight set loaded from a sharded artifact) and that routes with ``router``
        (``router_weight``, ``router_bias``, ``score_bias`` tensors of the whole layer, replicated)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(config, dtype, spec, group, dispatch, router["router_weight"], router.get("router_bias"),
                    router.get("score_bias"))
        self.local = None
        self._compiled = compiled
        return self

    def _setup(self, config, dtype, spec, group, dispatch, router_weight, router_bias, score_bias) -> None:
        if dispatch not in ("auto", "allgather", "all_to_all"):
            raise ValueError(f"shard: dispatch must be 'auto', 'allgather' or 'all_to_all', got {dispatch!r}")
        if dispatch == "all_to_all" and spec.tp > 1:
            raise ValueError("shard: dispatch 'all_to_all' sends tokens to the ranks of their experts (ep only); "
                             "with tp > 1 every rank needs every token: use 'allgather'")
        self.spec, self.group, self.dispatch = spec, group, dispatch
        self.config, self.dtype = config, dtype
        # the router is replicated: plain attributes (the local layer, where there is one, holds the buffers)
        self.router_weight, self.router_bias, self.score_bias = router_weight, router_bias, score_bias
        self._compiled = None
        #: what this rank did: bytes handed to collectives and received, their time, token rows its experts ran
        self.stats = {"bytes_sent": 0, "bytes_received": 0, "collective_s": 0.0, "expert_rows": 0}
        #: time each collective to its end: on CUDA tensors a collective only enqueues, so ``collective_s`` then
        #: counts a device synchronization before and after each one (off by default: it costs the overlap)
        self.sync_timing = False
        self._owner_table = None  # the ep rank of each global expert, on the tokens' device (_owners)

    def extra_repr(self) -> str:
        return (f"ep={self.spec.ep}, tp={self.spec.tp}, rank={self.spec.rank}, "
                f"experts={list(self.spec.experts(self.config.num_experts))[:4]}..., dispatch={self.dispatch}")

    # ---------------------------------------------------------------------------------- compile
    @property
    def entries(self) -> list[str]:
        """The entry points a compiled part needs: the routed experts and, apart, the shared expert."""
        return ["modular_routed", "shared"] if self.config.shared_intermediate else ["modular"]

    def compile(self, target="cpu", **options) -> "ShardedMoE":
        """Compile this rank's experts (and shared expert) with mxmoe for ``target`` (``options`` as for
        ``mxmoe.compile``, e.g. ``deterministic=True``); routing and the collectives stay in torch."""
        import mxmoe

        if self.local is None:
            raise ValueError("shard: this part was loaded compiled already")
        self._compiled = mxmoe.compile(self.local, target=target, entries=self.entries, **options)
        return self

    def _experts(self, x, weights, ids):
        """This rank's experts' partial output (no shared expert) for tokens with global ``ids``."""
        self.stats["expert_rows"] += x.shape[0]
        if x.shape[0] == 0:
            return x.new_zeros(x.shape)
        if self._compiled is not None:
            return self._compiled.entry(self.entries[0])(x, weights, ids.to(torch.int32))
        return self.local.modular(x, weights, ids, shared=False)

    def _shared(self, x):
        if not self.config.shared_intermediate or x.shape[0] == 0:
            return None
        if self._compiled is not None:
            return self._compiled.entry("shared")(x)
        return self.local._shared_expert(x)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        h = self.config.hidden
        if x.shape[-1] != h or x.dim() not in (2, 3):
            raise ValueError(f"ShardedMoE: input must be [T, {h}] or [B, S, {h}], got {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise ValueError(f"ShardedMoE: input dtype {x.dtype} does not match the layer's dtype {self.dtype}")
        return x.reshape(-1, h)

    def _route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole layer's routing of this rank's tokens (the same as ``MoE.forward_with_routing``). The router
        follows the tokens to their device once (a part loaded from an artifact holds it on the host)."""
        if self.router_weight.device != tokens.device:
            self.router_weight, self.router_bias, self.score_bias = (
                None if t is None else t.to(tokens.device) for t in (self.router_weight, self.router_bias,
                                                                      self.score_bias))
        return route_tokens(self.config, tokens, self.router_weight, self.router_bias, self.score_bias)

    # ---------------------------------------------------------------------------------- forward
    @_outside_the_graph
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Inference only, like the mxmoe ops. Under ``torch.compile`` this is a graph break: the collectives and
        their data-dependent sizes run in eager PyTorch; the experts run what this part holds (mxmoe-compiled
        after ``compile()``)."""
        tokens = self._tokens(x)
        weights, ids = self._route(tokens)
        if self.spec.ep * self.spec.tp == 1:  # one rank holds the layer: nothing to exchange
            out = self._experts(tokens, weights, ids).float()
        else:
            counts = self._all_gather_counts(tokens.shape[0], tokens.device)
            use_a2a = self.dispatch == "all_to_all" or (self.dispatch == "auto" and self.spec.tp == 1
                                                        and sum(counts) >= 512 and self._reach() <= 0.75)
            if use_a2a:
                out = self._forward_all_to_all(tokens, weights, ids)
            else:
                out = self._forward_allgather(tokens, weights, ids, counts)
        shared = self._shared(tokens)
        if shared is not None:
            out = out + shared.float()
        return out.to(x.dtype).reshape(x.shape)

    def _forward_allgather(self, tokens, weights, ids, counts: list[int]) -> torch.Tensor:
        """Every rank computes its part for all tokens; the partials go back to their owners, summed in rank order."""
        world, most = len(counts), max(counts)
        if most == 0:
            return tokens.new_zeros(tokens.shape, dtype=torch.float32)
        x_all, w_all, ids_all = self._all_gather_rows([tokens, weights, ids.to(torch.int32)], most)
        if min(counts) == most:  # no padding rows: every gathered row is a token
            partial = self._experts(x_all, w_all, ids_all).float()
        else:
            rows = torch.from_numpy(np.concatenate([np.arange(r * most, r * most + c) for r, c in enumerate(counts)]))
            rows = rows.to(tokens.device)
            partial = torch.zeros(world * most, tokens.shape[1], dtype=torch.float32, device=tokens.device)
            partial[rows] = self._experts(x_all[rows], w_all[rows], ids_all[rows]).float()
        return self._reduce_scatter_in_rank_order(partial, world, most)[: tokens.shape[0]]

    def _reduce_scatter_in_rank_order(self, partial: torch.Tensor, world: int, most: int) -> torch.Tensor:
        """Rank ``r``'s rows of every rank's fp32 partials, summed in rank order (0, 1, ..., N-1).

        A reduce-scatter collective sums in whatever order its algorithm takes (gloo's and NCCL's rings start at
        a different rank for each chunk, NCCL may pick another algorithm by size), so its bits depend on the
        rank and the library. An all-to-all of the partials moves the same bytes ((N-1)/N of them per rank) and
        leaves the sum to us: the same bits on every run, every library, every rank count's placement."""
        blocks = torch.empty_like(partial)
        self._collective("all_to_all (partials)",
                         lambda: dist.all_to_all_single(blocks, partial.contiguous(), group=self.group),
                         partial.numel() * 4, blocks.numel() * 4, partial.device)
        blocks = blocks.view(world, most, partial.shape[1])
        out = blocks[0].clone()
        for r in range(1, world):
            out += blocks[r]
        return out

    def _forward_all_to_all(self, tokens, weights, ids) -> torch.Tensor:
        """Each token goes only to the ranks holding one of its experts (its other ids masked to -1 there); the
        partial outputs come back the same way and are summed in rank order."""
        world = self.spec.ep
        hit = self._owners(ids.device)[ids.long()][:, :, None] == torch.arange(world, device=ids.device)  # [T, k, N]
        to_rank = hit.any(dim=1).T                                         # [N, T]: token t goes to rank r
        counts = to_rank.sum(dim=1).tolist()
        dest, tok = torch.nonzero(to_rank, as_tuple=True)                  # rank-major, tokens in order within
        send_ids = torch.where(hit[tok, :, dest], ids[tok], -1).to(torch.int32)
        recv_counts = self._all_to_all_counts(counts, tokens.device)
        x_recv, w_recv, ids_recv = self._all_to_all_rows([tokens[tok], weights[tok], send_ids], counts, recv_counts)
        y = self._experts(x_recv, w_recv, ids_recv).float()
        y_back = self._all_to_all(y, recv_counts, counts)
        out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        at = 0
        for n in counts:  # rank order, each rank's tokens distinct: deterministic
            out.index_add_(0, tok[at: at + n], y_back[at: at + n])
            at += n
        return out

    def _reach(self) -> float:
        """The share of the ranks a token's k experts reach under uniform routing, 1 - (1 - 1/N)^k: what the
        all-to-all exchange sends of what the all-gather does (two ranks, top-4: 0.94, where the all-to-all measured
        slower on two H200s at every token count; eight ranks, top-4: 0.41)."""
        return 1.0 - (1.0 - 1.0 / self.spec.ep) ** self.config.top_k

    def _owners(self, device) -> torch.Tensor:
        """The ep rank holding each global expert, on ``device`` (made once per device)."""
        cached = self._owner_table
        if cached is None or cached.device != device:
            owner = torch.empty(self.config.num_experts, dtype=torch.int64)
            for r in range(self.spec.ep):
                owner[list(ShardSpec(self.spec.ep, 1, r).experts(self.config.num_experts))] = r
            self._owner_table = cached = owner.to(device)
        return cached

    # ---------------------------------------------------------------------------------- collectives
    def _collective(self, what: str, fn, sent: int, received: int, device=None):
        import time

        sync = self.sync_timing and device is not None and device.type == "cuda"
        if sync:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        try:
            out = fn()
            if sync:
                torch.cuda.synchronize(device)
        except RuntimeError as e:
            raise DistributedError(f"rank {self.spec.rank}: {what} failed ({str(e).splitlines()[0][:200]}); if a "
                                   "rank died, hung or left the group, the process group's timeout bounded the "
                                   "wait") from e
        self.stats["collective_s"] += time.perf_counter() - t0
        self.stats["bytes_sent"] += sent
        self.stats["bytes_received"] += received
        return out

    def _all_gather_counts(self, n: int, device) -> list[int]:
        """Every rank's token count; on the tokens' device (NCCL takes CUDA tensors only, gloo CPU ones)."""
        world = self.spec.ep * self.spec.tp
        out = torch.zeros(world, dtype=torch.int64, device=device)
        mine = torch.tensor([n], dtype=torch.int64, device=device)
        self._collective("all_gather (token counts)", lambda: _all_gather(out, mine, group=self.group),
                         8, 8 * world, device)
        return out.tolist()

    def _all_gather_rows(self, tensors: list[torch.Tensor], most: int) -> list[torch.Tensor]:
        """Every rank's rows of ``tensors`` (this rank's tokens' rows, any dtypes), each rank's padded to ``most``
        with zero bytes, in one all-gather: a row's bytes of all the tensors side by side (one collective and its
        latency, not one per tensor)."""
        world, n = self.spec.ep * self.spec.tp, tensors[0].shape[0]
        src = _pack_rows(tensors)
        if n < most:
            src = torch.cat([src, src.new_zeros(most - n, src.shape[1])])
        out = torch.empty((world * most, src.shape[1]), dtype=torch.uint8, device=src.device)
        self._collective("all_gather", lambda: _all_gather(out, src, group=self.group), src.numel(), out.numel(),
                         src.device)
        return _unpack_rows(out, tensors)

    def _all_to_all_counts(self, counts: list[int], device) -> list[int]:
        send = torch.tensor(counts, dtype=torch.int64, device=device)
        recv = torch.empty_like(send)
        self._collective("all_to_all (counts)", lambda: dist.all_to_all_single(recv, send, group=self.group),
                         send.numel() * 8, recv.numel() * 8, device)
        return recv.tolist()

    def _all_to_all_rows(self, tensors: list[torch.Tensor], send_counts: list[int],
                         recv_counts: list[int]) -> list[torch.Tensor]:
        """:meth:`_all_to_all` of several tensors' rows (the same rows of each) in one collective: a row's bytes of
        all of them side by side, as :meth:`_all_gather_rows` sends them."""
        return _unpack_rows(self._all_to_all(_pack_rows(tensors), send_counts, recv_counts), tensors)

    def _all_to_all(self, t: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        out = torch.empty((sum(recv_counts), *t.shape[1:]), dtype=t.dtype, device=t.device)
        self._collective("all_to_all", lambda: dist.all_to_all_single(
            out, t.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts, group=self.group),
            t.numel() * t.element_size(), out.numel() * out.element_size(), t.device)
        return out


def _pack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """uint8 [n, bytes]: row i holds row i of every tensor (same leading dim n, any dtypes), their bytes side by side,
    so that one collective moves them all."""
    n = tensors[0].shape[0]
    return torch.cat([t.reshape(n, math.prod(t.shape[1:])).contiguous().view(torch.uint8) for t in tensors], dim=1)


def _unpack_rows(rows: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors :func:`_pack_rows` packed (each with ``like``'s dtype and trailing shape) from its rows."""
    out, at, m = [], 0, rows.shape[0]
    for t in like:
        width = math.prod(t.shape[1:]) * t.element_size()
        out.append(rows[:, at: at + width].view(t.dtype).reshape(m, *t.shape[1:]).contiguous())
        at += width
    return out


# ============================================================================================ entry point

def fingerprint(layer: MoE, ep: int, tp: int) -> str:
    """What every rank must agree on: the layer's config and weights' digest, and the cut."""
    h = hashlib.sha256(json.dumps({"config": dataclasses.asdict(layer.config), "ep": ep, "tp": tp,
                                   "dtype": str(layer.dtype)}, sort_keys=True).encode())
    for name, b in sorted(layer.named_buffers()):
        h.update(name.encode())
        h.update(b.detach().cpu().contiguous().view(torch.uint8).numpy()[:4096].tobytes())  # a cheap sample
    return h.hexdigest()[:16]


def shard(layer: MoE, mode: Any = "ep", group=None, *, dispatch: str = "auto") -> ShardedMoE:
    """This rank's part of ``layer`` (see the module docstring). Every rank of ``group`` (default: the world) must
    call it with the same layer; ranks that disagree on the layer or the cut get a :class:`DistributedError`."""
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError("shard: torch.distributed is not initialized (call init_process_group first)")
    if not isinstance(layer, MoE):
        raise TypeError(f"shard: expected an mxmoe MoE layer, got {type(layer).__name__}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ep, tp = parse_mode(mode, world)
    mine = fingerprint(layer, ep, tp)
    everyone: list[Any] = [None] * world
    try:
        dist.all_gather_object(everyone, mine, group=group)
    except RuntimeError as e:
        raise DistributedError(f"rank {rank}: could not agree with the other ranks ({str(e).splitlines()[0][:200]})") from e
    if len(set(everyone)) != 1:
        odd = [r for r, f in enumerate(everyone) if f != everyone[0]]
        raise DistributedError(f"rank {rank}: ranks disagree on the layer or its sharding (ranks {odd} differ from "
                               "rank 0): shard the same layer with the same mode on every rank")
    return ShardedMoE(layer, ShardSpec(ep, tp, rank), group, dispatch)


def shard_model(model: nn.Module, mode: Any = "ep", group=None, *, dispatch: str = "auto", compile=None,  # noqa: A002
                **options) -> int:
    """Replace every mxmoe ``MoE`` layer inside ``model`` by this rank's part, in place (every rank calls it on
    the same model, e.g. after ``mxmoe.convert``); ``compile``: a target to compile each part's experts for
    (``options`` as for ``mxmoe.compile``). Returns how many layers were sharded."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE) and name]
    if isinstance(model, MoE):
        raise TypeError("shard_model: the model is one MoE layer; use shard(layer, mode)")
    for name, layer in found:
        parent_name, _, attr = name.rpartition(".")
        part = shard(layer, mode, group, dispatch=dispatch)
        if compile is not None:
            part.compile(compile, **options)
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, part)
    return len(found)


def load(path, group=None, **kwargs) -> ShardedMoE:
    """This rank's part of a sharded artifact (``mxmoe compile --shard``), collectives included; see
    :func:`mxmoe.shard_artifact.load`."""
    from mxmoe.shard_artifact import load as _load

    return _load(path, group, **kwargs)
