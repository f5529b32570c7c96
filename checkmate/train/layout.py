"""Where a job's processes are: ranks, addresses, shadows, mode, and the sessions the
controller holds for them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from checkmate.config import cluster as config
from checkmate.control.handshake_client import controller_request
from checkmate.errors import CheckmateError
from checkmate.train.ddp import BUCKET_ELEMS
from checkmate.train.protection import LAG_WARN, POLL_SECONDS
from checkmate.train.repair import REPAIR_RATE
from checkmate.train.replica_log import DEFAULT_KEEP
from checkmate.train.replicate import ShadowTarget
from checkmate.train.reseed import RESEED_SLICES
from checkmate.train.ring import BIG_CHUNK
from checkmate.train.transport import LossyLink

#: switch: the switch copies REPLICATE datagrams; host: trainers send the copies; off: no
#: Checkmate at all (same ring, no tags, no shadows) -- the no-checkpoint baseline.
MODES = ("switch", "host", "off")


@dataclass


class JobLayout:
    """Addresses of one job: every trainer's ring endpoint and every shadow's.

    Args:
        job_id: the ckm job id.
        rank, world: this trainer's place.
        trainers: ``(ip, port)`` of each rank's ring socket, in rank order.
        shadows: each partition's UDP target (epoch/token filled from the controller in
            switch mode, or given for shadows that do not register).
        shadow_tcp: each partition's TCP service address (seed, status, fetch).
        mode: ``switch`` (the switch copies REPLICATE datagrams) or ``host`` (trainers send
            the copies themselves).
        controller: ``(ip, port)`` of the handshake service, asked for the shadows' current
            sessions (switch mode).
        repair: keep the last ``repair_keep`` iterations of what this trainer replicated and
            answer shadows' repair requests on ``repair_port`` (default config.REPAIR_PORT),
            paced to ``repair_rate`` bytes/s. Off: a lost copy is never repaired.
        reseed_slices: slices a live re-seed sends a partition in (one per iteration).
        monitor_poll, lag_warn: status poll period (s) and the lag that logs a warning.
        gockpt: ``(directory, every, steps)`` for GoCkpt mode (checkmate.gockpt.trainer): no
            shadows (mode ``off``), a periodic checkpoint every ``every`` iterations whose
            transfer is spread over ``steps`` steps, written by a local process per rank.
        verbs_device: host mode only: send the copies over RDMA UD from this device to the
            queue pair each shadow publishes in its status (``shadow serve --transport
            verbs``; docs/verbs.md). Empty (default): UDP.
    """

    job_id: int
    rank: int
    world: int
    trainers: list[tuple[str, int]]
    shadows: list[ShadowTarget]
    shadow_tcp: list[tuple[str, int]]
    mode: str = "switch"
    controller: tuple[str, int] | None = None
    chunk: int = BIG_CHUNK
    bucket_elems: int = BUCKET_ELEMS
    seed: int = 0
    link: LossyLink | None = field(default=None, repr=False)
    repair: bool = True
    repair_keep: int = DEFAULT_KEEP
    repair_rate: float = REPAIR_RATE
    repair_port: int = config.REPAIR_PORT
    reseed_slices: int = RESEED_SLICES
    monitor_poll: float = POLL_SECONDS
    lag_warn: int = LAG_WARN
    gockpt: tuple[str, int, int] | None = None
    verbs_device: str = ""
    #: refuse to resume on another number of ranks (checkmate.train.world)
    fixed_world: bool = False
    #: each rank's node id (checkmate.train.ring_schedule); None: torch elastic's
    #: GROUP_RANK of every rank, gathered at start, or without it every rank its own node
    node_of: list[int] | None = None
    #: seconds a ring operation may stall before it fails (a peer is gone)
    stall_timeout: float = 60.0
    #: the further replicas of every partition: whole sets beside ``shadows`` and
    #: ``shadow_tcp`` (the first), each numbered from partition 0; every copy (host mode;
    #: the switch makes them in switch mode) and control message goes to each, and a
    #: partition is protected while one is current
    replica_shadows: list[list[ShadowTarget]] = field(default_factory=list)
    replica_tcp: list[list[tuple[str, int]]] = field(default_factory=list)
    #: switch mode: the shadows are co-located, placed by the launchers' rendezvous
    #: (``checkmate launch --colocate``), and each attempt tells the controller where
    #: (checkmate.train.attempt); otherwise the controller's shadows registered themselves
    placed: bool = False

    @property
    def tcp_sets(self) -> list[list[tuple[str, int]]]:
        """Every replica set's TCP service addresses, the first set first."""
        return [self.shadow_tcp, *self.replica_tcp]

    def repair_addr(self, rank: int) -> tuple[str, int]:
        """Where ``rank`` answers repair requests: its ring IP, at ``repair_port`` shifted
        by as much as its ring port is from the default (several ranks of a node may share
        one IP, each on its own ports)."""
        ip, port = self.trainers[rank]
        return ip, self.repair_port + (port - config.TRAINER_PORT)

    def __post_init__(self) -> None:
        if self.verbs_device and self.mode != "host":
            raise CheckmateError(f"verbs_device applies to host mode (trainers send the "
                                 f"copies), not mode {self.mode!r}")
        if self.gockpt is not None and self.mode != "off":
            raise CheckmateError(f"GoCkpt mode checkpoints without shadows: it needs mode "
                                 f"off, got {self.mode!r}")
        if self.mode not in MODES:
            raise CheckmateError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if len(self.trainers) != self.world:
            raise CheckmateError(f"{len(self.trainers)} trainer addresses for world "
                                 f"size {self.world}")
        if self.node_of is not None and len(self.node_of) != self.world:
            raise CheckmateError(f"node_of names {len(self.node_of)} ranks for world size "
                                 f"{self.world}")
        if len(self.shadows) != len(self.shadow_tcp) or (not self.shadows
                                                         and self.mode != "off"):
            raise CheckmateError("need one UDP and one TCP address per shadow partition")
        if len(self.replica_shadows) != len(self.replica_tcp) or any(
                len(u) != len(self.shadows) or len(t) != len(self.shadows)
                for u, t in zip(self.replica_shadows, self.replica_tcp, strict=True)):
            raise CheckmateError("each replica set needs one UDP and one TCP address per "
                                 "shadow partition")
        if self.replica_tcp and self.verbs_device:
            raise CheckmateError("replicas of a partition are fed over UDP only, not verbs")
        if self.placed and self.mode != "switch":
            raise CheckmateError(f"placed shadows are the switch's to copy to (switch mode), "
                                 f"not mode {self.mode!r}")
        if self.replica_tcp and self.mode not in ("host", "switch"):
            raise CheckmateError(f"replicas of a partition are fed by the trainers (host "
                                 f"mode) or the switch (switch mode), not mode {self.mode!r}")


def query_registrations(controller: tuple[str, int], job_id: int, timeout: float = 2.0,
                        tries: int = 5, secret: bytes | None = None
                        ) -> tuple[dict[int, dict[str, Any]], int, int]:
    """The controller's current registrations, partition -> {epoch, token, ip, port}; how
    many partitions its config has (``expected``; a controller that does not say is taken
    at its word: as many as are registered); and how many data-parallel groups they are cut
    into (config ``job.groups``; 1 if not said). An authenticated ``session`` request;
    ``secret`` defaults to $CHECKMATE_SECRET_FILE's."""
    body = controller_request(controller, job_id, {"op": "session"}, timeout, tries, secret)
    regs = {int(p): v for p, v in body.get("partitions", {}).items()}
    expected = body.get("expected", len(regs))
    if not isinstance(expected, int) or isinstance(expected, bool) or expected < 1:
        expected = len(regs)
    groups = body.get("groups", 1)
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        groups = 1
    return regs, expected, groups


def query_sessions(controller: tuple[str, int], job_id: int, timeout: float = 2.0,
                   tries: int = 5, secret: bytes | None = None) -> dict[int, dict[str, Any]]:
    """The controller's current registrations: partition -> {epoch, token, ip, port}."""
    return query_registrations(controller, job_id, timeout, tries, secret)[0]


def query_replica_sessions(controller: tuple[str, int], job_id: int, timeout: float = 2.0,
                           tries: int = 5, secret: bytes | None = None
                           ) -> dict[int, dict[int, dict[str, Any]]]:
    """Every registered shadow's session: partition -> replica number -> {epoch, token, ip,
    port, host}. A controller that lists no ``replicas`` has one shadow per partition."""
    from checkmate.control.handshake_client import controller_request

    body = controller_request(controller, job_id, {"op": "session"}, timeout, tries, secret)
    reps = body.get("replicas")
    if not isinstance(reps, dict):
        return {int(p): {0: v} for p, v in body.get("partitions", {}).items()}
    out: dict[int, dict[int, dict[str, Any]]] = {}
    for p, lst in reps.items():
        for v in lst if isinstance(lst, list) else []:
            if isinstance(v, dict) and isinstance(v.get("replica"), int):
                out.setdefault(int(p), {})[v["replica"]] = v
    return out
