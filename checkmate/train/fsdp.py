"""Checkmate for a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Under FSDP2 every parameter is a DTensor sharded on dim 0 over a 1-D mesh of the job's
ranks: rank r holds rows ``[r·c, min((r+1)·c, rows))`` with ``c = ⌈rows/world⌉``
(torch.chunk's split), and backward's reduce-scatter leaves it the reduced gradient of
exactly those rows. ``FSDPSession`` builds on that:

- ``step()`` sends this rank's gradient shard of every parameter (on a GPU through an
  asynchronous copy to pinned host memory, checkmate.train.share_copy) to the shadows that own
  it (flat offset = the parameter's offset + first row · row size), through the session's
  ``_on_reduced`` (host copies, replica log), *before* clipping, as the ring
  sends the reduced gradient. The shard is read where the optimizer reads it, right before
  the step, so whatever produced it -- one backward, several accumulated ones,
  ``set_requires_gradient_sync(False)`` passes -- is what trainers and shadows both apply.
- Clipping: the total norm over all shards (``torch.nn.utils.get_total_norm`` on the
  DTensor gradients); rank 0's float32 factor is broadcast, so every shard is scaled by
  the factor the control message carries.
- Repairs: the owners map a shadow gets is the shard ranges, so it asks the rank that
  holds a range.
- Seeding gathers the whole model and optimizer state on every rank (``full_tensor``, once
  at start) and each rank seeds its 1/world share, as any session does. A restore fetches
  the shadows' whole state on every rank, keeps this rank's rows as DTensors
  (``DTensor.from_local``, no communication) and loads them with the module's and the
  optimizer's own ``load_state_dict``.
- ``checkmate.optim`` steps the local shards (``to_local()``) with the shadows' arithmetic.

HSDP (``fully_shard(..., mesh=mesh)`` on a 2-D mesh ``(dp_replicate, dp_shard)``: every
parameter placed ``(Replicate(), Shard(0))``) is the same with the rows split over the
``dp_shard`` ranks only: the R replicas of a shard hold the same reduced gradient, and
replica ``p mod R`` sends (and repairs) partition p's part of it, so the sending is spread
over every rank and each element still goes out once. The whole job is one data-parallel
group (both dimensions are data parallel), ranks numbered replicate-major as torch's mesh
numbers them.

Not supported: a live re-seed of a restarted shadow (one rank holds only its rows of a
partition): one warning line, and the partition stays unprotected -- the protection monitor
reports its lag -- until the job restarts; FSDP2 with tensor parallel (a ``tp`` dimension),
other placements, and parameters that are not sharded (every parameter must be under
``fully_shard``) are refused.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

# FSDP2 places a parameter that TP also splits on dim 0 this way (rows of the TP part)
from torch.distributed.tensor.placement_types import _StridedShard

from checkmate.errors import CheckmateError
from checkmate.optim.clip import clip_coef_of
from checkmate.spec.model import shard_part
from checkmate.train.layout import JobLayout
from checkmate.train.repair import owners_body
from checkmate.train.ring import MAX_CHUNK
from checkmate.train.segments import Segment, cut_segments, send_runs
from checkmate.train.session import CheckmateSession
from checkmate.train.session_group import DP_DIMS
from checkmate.train.share_copy import ShareSender

log = logging.getLogger("checkmate.train")


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of a ``rows``-row parameter that FSDP2 gives ``rank`` (torch.chunk:
    ⌈rows/world⌉ each, the last ones smaller or empty)."""
    c = -(-rows // world)
    lo = min(rank * c, rows)
    return lo, min(lo + c, rows)


def shard_ranges(spec: Any, world: int) -> dict[str, list[tuple[int, int]]]:
    """Per parameter name, the element range [lo, hi) in the parameter that each rank holds
    (in rank order)."""
    out = {}
    for p in spec.params:
        row = p.numel // p.shape[0]
        out[p.name] = [(a * row, b * row) for a, b in
                       (shard_rows(p.shape[0], world, r) for r in range(world))]
    return out


def shard_owners(spec: Any, shards: dict[str, list[tuple[int, int]]], start: int, end: int
                 ) -> list[tuple[int, int, int]]:
    """``(lo, hi, rank)`` flat ranges of every shard inside [start, end): whom a shadow asks
    for a lost range."""
    out = []
    for p in spec.params:
        for r, (lo, hi) in enumerate(shards[p.name]):
            a, b = max(start, p.offset + lo), min(end, p.offset + hi)
            if a < b:
                out.append((a, b, r))
    return out


def _dp_dims(mesh: Any) -> list[int]:
    """The data-parallel dimensions of a parameter's mesh (all of an unnamed one: plain
    ``fully_shard`` makes a 1-D mesh without names)."""
    names = mesh.mesh_dim_names
    if not names:
        return list(range(mesh.ndim))
    return [i for i, n in enumerate(names) if n in DP_DIMS]


def fsdp_mesh(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(replicas, this rank's replica, shards, this rank's shard) of an FSDP2 model's mesh:
    plain FSDP2 (one replica), HSDP's (dp_replicate, dp_shard), or FSDP2 + TP's (dp, tp),
    whose data-parallel dimension is the shard one."""
    m = next(model.parameters()).device_mesh
    dp = _dp_dims(m)
    if len(dp) == 2:
        return m.size(dp[0]), m.get_local_rank(dp[0]), m.size(dp[1]), m.get_local_rank(dp[1])
    return 1, 0, m.size(dp[0]), m.get_local_rank(dp[0])


def tp_part(p: DTensor) -> tuple[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """(shape, place) of the tensor-parallel part of an FSDP2 parameter: the tensor FSDP
    cuts this rank's rows from (FSDP2 + TP shards the TP rank's local tensor on dim 0), and
    (global shape, offsets) of it in the whole tensor, None when TP does not split it."""
    dp = _dp_dims(p.device_mesh)
    return shard_part(p, [i for i in range(p.device_mesh.ndim) if i not in dp])


def replica_share(segments: dict[str, list[Segment]], replicas: int, replica: int
                  ) -> dict[str, list[Segment]]:
    """The segments of a shard that HSDP replica ``replica`` of ``replicas`` sends: those of
    the partitions p with p mod replicas == replica, so that the replicas, which all hold
    the shard's reduced gradient, send each element once between them."""
    return {n: [s for s in segs if s[3] % replicas == replica] for n, segs in segments.items()}


def _full(t: Any) -> Any:
    """The whole tensor of a DTensor (a collective: every rank calls it in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class FSDPSession(ShareSender, CheckmateSession):
    """A CheckmateSession over the user's own FSDP2 model (``fully_shard``).

    Args:
        model: the sharded module (``fully_shard`` applied to it, and usually to its
            blocks first); every parameter a float32 DTensor sharded on dim 0 over the
            job's ranks, requiring gradients.
        optimizer: ``checkmate.optim.SGD``/``Adam``/``AdamW`` over ``model.parameters()``.
        scheduler, layout, max_grad_norm, group: as for CheckmateSession; the layout's mode
            must be ``host`` (trainers send the copies) or ``off`` (the baseline).
        scaler, copy_engine: as for DDPSession (fp16 loss scaling; the shards' asynchronous
            copies to the host on GPUs).

    ``sess.model`` is ``model``; the loop is the same as with CheckmateSession.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, layout: JobLayout, max_grad_norm: float | None = None,
                 group: Any = None, *, scaler: Any = None, copy_engine: Any = None) -> None:
        if layout.mode not in ("host", "off"):
            raise CheckmateError(f"an FSDP2 job feeds the shadows in host mode only (or runs "
                                 f"without them: off), got mode {layout.mode!r}")
        super().__init__(model, optimizer, scheduler, layout, max_grad_norm, group,
                         scaler=scaler)
        #: HSDP's replicas and this rank's (1 and 0 for plain FSDP2), the shard ranks that
        #: split the rows and this rank's shard.
        self.replicas, self.replica, self.shard_world, self.shard_rank = fsdp_mesh(model)
        world, rank = self.shard_world, self.shard_rank
        #: Per parameter name, its element range [lo, hi) on every shard rank (in order).
        self.shards = shard_ranges(self.spec, world)
        named = dict(model.named_parameters())
        for name, ranges in self.shards.items():
            lo, hi = ranges[rank]
            got = named[name].to_local().numel()
            if got != hi - lo:
                raise CheckmateError(f"parameter {name}: this rank holds {got} elements, "
                                     f"FSDP2's dim-0 split of {tuple(named[name].shape)} over "
                                     f"{world} ranks gives it {hi - lo}")
        self._segments: dict[str, list[Segment]] = {}
        self._piece = 0
        self._refused_reseed: set[int] = set()
        #: FSDP2 + TP: per parameter, whether its rows count in this rank's share of the
        #: clip norm (_clip_tp)
        self._tp_counted: dict[int, bool] | None = None
        #: Replicated pieces and bytes, and seconds spent copying and sending them.
        self.shard_stats: dict[str, float] = {"pieces": 0, "bytes": 0, "seconds": 0.0}
        #: Asynchronous device-to-host copies of the shards (checkmate.train.share_copy),
        #: as in DDPSession: picked by the parameters' device when None.
        self.copy_engine = copy_engine
        self.copier = None

    def _check_model(self, model: torch.nn.Module) -> None:
        world, rank = self.layout.world, self.layout.rank
        other = self.mesh.place.other_dims if self.mesh is not None else ()
        if set(other) - {"tp"}:
            raise CheckmateError(
                f"FSDP2 on a mesh with {' and '.join(d for d in other if d != 'tp')} "
                "dimensions is not supported yet: FSDPSession takes plain FSDP2, HSDP "
                "(dp_replicate x dp_shard) or FSDP2 + TP (dp x tp)")
        for name, p in model.named_parameters():
            if not isinstance(p, DTensor):
                raise CheckmateError(
                    f"parameter {name} is not sharded: FSDPSession needs fully_shard applied "
                    "to the whole model (its gradient would never be reduced otherwise)")
            mesh = p.device_mesh
            dp = _dp_dims(mesh)
            on_dp = tuple(p.placements[i] for i in dp)
            rows = on_dp[-1] if on_dp else None
            coord = mesh.get_coordinate()
            flat = -1
            if coord and dp:  # the data-parallel coordinate, row-major over its dimensions
                flat = 0
                for i in dp:
                    flat = flat * mesh.size(i) + coord[i]
            if (not dp or len(dp) > 2 or (len(dp) == 2 and len(dp) != mesh.ndim)
                    or any(not pl.is_replicate() for pl in on_dp[:-1])
                    or not isinstance(rows, (Shard, _StridedShard)) or rows.dim != 0
                    or math.prod(mesh.size(i) for i in dp) != world or flat != rank):
                raise CheckmateError(
                    f"parameter {name} is a DTensor placed {tuple(p.placements)} on a mesh of "
                    f"shape {tuple(mesh.shape)}: Checkmate supports FSDP2's dim-0 sharding "
                    f"over the {world} data-parallel ranks in rank order: plain, HSDP's "
                    "(Replicate, Shard(0)) over (dp_replicate, dp_shard), or beside a tp "
                    "dimension (no HSDP with TP)")
            if p.dtype != torch.float32:
                raise CheckmateError(f"parameter {name} is {p.dtype}: the shadows keep float32 "
                                     "parameters (a MixedPrecisionPolicy may compute in "
                                     "another dtype; the sharded parameters stay float32)")
            if not p.requires_grad:
                raise CheckmateError(f"parameter {name} is frozen (requires_grad=False): "
                                     "leave it out of the model's parameters, or unfreeze it")
            if p.dim() == 0:
                raise CheckmateError(f"parameter {name} is a scalar: FSDP2 shards dim 0")

    # ------------------------------------------------------------------ setup
    def _start_comm(self, nonce: int) -> None:
        self.model = self.module
        if self.layout.mode == "off":
            return
        self._piece = MAX_CHUNK
        rank = self.shard_rank
        mine = cut_segments(self.spec, [
            (lo, hi) for lo, hi, r in shard_owners(self.spec, self.shards, 0, self.spec.total)
            if r == rank])
        self._segments = replica_share(mine, self.replicas, self.replica)
        self._start_copier(next(self.module.parameters()).to_local(), self._send_runs)

    def peers_body(self, partition: int) -> dict[str, Any]:
        lay = self.layout
        start, end = self.spec.bounds(partition)
        trainers = [lay.repair_addr(r) for r in range(lay.world)]
        sender = (partition % self.replicas) * self.shard_world  # its replica's first rank
        owners = [(lo, hi, sender + r) for lo, hi, r in
                  shard_owners(self.spec, self.shards, start, end)]
        return owners_body(trainers, owners if lay.repair else [], 0, self.run)

    def _spec_parts(self, model: torch.nn.Module) -> dict[str, Any] | None:
        """FSDP2 + TP: the spec holds each TP rank's part of a parameter (FSDP's rows are
        cut from it), placed in the whole tensor; plain FSDP2 and HSDP: whole tensors."""
        if self.mesh is None or not self.mesh.place.other_dims:
            return None
        return {n: tp_part(p) for n, p in model.named_parameters()}

    def _seed_flat(self) -> dict[str, Any]:
        model_sd = {k: self._tp_whole(v) for k, v in self.module.state_dict().items()}
        osd = self.optimizer.state_dict()
        state = {i: {k: self._tp_whole(v) for k, v in st.items()}
                 for i, st in sorted(osd["state"].items())}
        return self.spec.flat_from_state_dicts(model_sd, {**osd, "state": state})

    def _state_pieces(self) -> dict[str, list[tuple[int, Any]]]:
        """The state check's pieces: the gathered whole tensors of ``_seed_flat``."""
        return {s: [(0, torch.from_numpy(a))] for s, a in self._seed_flat().items()}

    def _tp_whole(self, v: Any) -> Any:
        """What the spec holds of ``v`` (a parameter or optimizer state, a collective for a
        DTensor): the whole tensor, or under FSDP2 + TP the TP rank's part of it."""
        full = _full(v)
        if not isinstance(v, DTensor):
            return full
        shape, place = tp_part(v)
        if place is None:
            return full
        return full[tuple(slice(o, o + z) for o, z in zip(place[1], shape, strict=True))]

    #: Every restored tensor becomes this rank's shard (CheckmateSession.local_state_dicts).
    places_state = True
    #: Ranks hold different shards: the whole state has no copies (HSDP's shards do:
    #: _replica_columns).
    replicates_state = False

    def _replica_columns(self) -> list[list[int]] | None:
        """HSDP: the replicas of each shard (ranks are replicate-major); plain FSDP2: none."""
        if self.replicas < 2:
            return None
        return [[r * self.shard_world + s for r in range(self.replicas)]
                for s in range(self.shard_world)]

    def _place_like(self, full: torch.Tensor, p: DTensor) -> DTensor:
        """This rank's rows of the whole tensor ``full``, placed as ``p`` is."""
        shape = tp_part(p)[0]
        lo, hi = shard_rows(shape[0], self.shard_world, self.shard_rank)
        local = full.reshape(shape)[lo:hi].to(p.to_local().device).contiguous().clone()
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())

    def new_reseed(self, partition: int, reason: str, addr: Any = None) -> Any:
        if partition not in self._refused_reseed:
            self._refused_reseed.add(partition)
            log.warning("checkmate: the shadow of partition %d needs a re-seed (%s), which an "
                        "FSDP2 job cannot do live: partition %d is unprotected until the job "
                        "restarts", partition, reason, partition)
        raise CheckmateError(f"partition {partition}: no live re-seed under FSDP2 ({reason})")

    # ------------------------------------------------------------------ per iteration
    def step(self, extra: dict[str, Any] | None = None) -> float | None:
        """Send this rank's gradient shards, then step as CheckmateSession does (clip,
        optimizer, scheduler, control message)."""
        it = self.iteration
        if self.layout.mode == "off":
            return super().step(extra)
        self._check_new_step()
        named = dict(self.module.named_parameters())
        missing = [p.name for p in self.spec.params if named[p.name].grad is None]
        if missing:
            raise CheckmateError(
                f"iteration {it}: no gradient for {len(missing)} of {len(self.spec.params)} "
                f"parameters (first {missing[0]}): call backward() between begin() and step() "
                "(every parameter must take part in the loss)")
        self._step_hyper()  # a refused step sends nothing
        self._send_shards(it, named)
        return super().step(extra)

    def _send_shards(self, it: int, named: dict[str, torch.Tensor]) -> None:
        """This rank's shard segments: read in place on the CPU, or queued for an
        asynchronous copy to the host (sent by the copier's thread once it completed; the
        step's fence orders the clip's writes after the copy)."""
        rank = self.shard_rank
        parts = []
        for p in self.spec.params:
            segs = self._segments.get(p.name)
            if not segs:
                continue
            first = self.shards[p.name][rank][0]
            g = named[p.name].grad.to_local().detach().reshape(-1)
            parts.append((p.name, g, [(lo - first, n, off, part) for lo, n, off, part in segs]))
        self._send_share_parts(it, 0, parts, self._send_runs)

    def _send_runs(self, it: int, index: int, runs: list[tuple[int, int, np.ndarray]]
                   ) -> None:
        t0 = time.perf_counter()
        pieces, nbytes = send_runs(
            runs, self._piece, lambda off, part, payload: self._on_reduced(it, index, off, part,
                                                                           payload))
        self.shard_stats["pieces"] += pieces
        self.shard_stats["bytes"] += nbytes
        self.shard_stats["seconds"] += time.perf_counter() - t0

    def _clip(self) -> float | None:
        if self.mesh is not None and self.mesh.place.other_dims:
            return self._clip_tp()
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return None
        total = _full(torch.nn.utils.get_total_norm(grads, 2.0))
        coef = torch.tensor([clip_coef_of(total, float(self.max_grad_norm))],
                            dtype=torch.float64)
        dist.broadcast(coef, group=self.group, group_src=0)  # one factor for every shard
        factor = torch.tensor(float(coef[0]), dtype=torch.float32)
        with torch.no_grad():
            for g in grads:
                local = g.to_local()
                local.mul_(factor.to(local.device))
        return float(coef[0])

    def _clip_tp(self) -> float | None:
        """FSDP2 + TP: the whole model's norm from every rank's local rows, each TP copy
        counted on the first TP rank only, summed over the whole job (clip_mesh)."""
        from checkmate.optim.clip import clip_mesh

        if self._tp_counted is None:  # fixed by the placements: worked out once
            self._tp_counted = {id(p): self.replica == 0 and (
                tp_part(p)[1] is not None or self.mesh.first_tp_rank)
                for p in self.module.parameters()}
        params = [p for p in self.module.parameters() if p.grad is not None]
        return clip_mesh([p.grad.to_local() for p in params],
                         [self._tp_counted[id(p)] for p in params],
                         float(self.max_grad_norm), self.mesh.world)
