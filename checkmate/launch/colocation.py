"""The co-located shadows of one node's launcher, placed anew at every rendezvous (issue 38).

With ``checkmate launch --colocate`` the shadows run on the job's own nodes, and which
nodes are in the job is what torch's rendezvous decides: a node lost, a spare joining. So
the placement is made there. torch's elastic agent asks its rendezvous handler for the next
round before it starts (or restarts) the worker group; this module's handler (a backend of
torch's public registry that does everything through the real c10d handler) then has every
node's launcher, in that round's store:

1. publish its node name and the placement it knows (with a generation number);
2. read every member's, so that all compute the same placement: the rule's
   (checkmate.launch.shadow_placement.place) in the first round, then ``replace`` of the
   newest known one: the survivors stay where they are, with their ports; a lost node's
   replicas go to the members by the same rule;
3. start the shadows newly placed on its node (empty: the trainers have each adopt a
   current sibling's state, checkmate.train.protection, so the trainers send nothing) and
   stop, by PID, any of its own placed elsewhere now; wait until every node's are ready;
4. hand the round's workers the new shadow list (the environment they inherit).

A round whose members cannot hold the replicas by the rule (fewer nodes or failure domains
than ``--replicas``) keeps the placement it had and says so in one line: the partitions of
the lost nodes then have fewer current replicas, and ``protection()`` says which.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from checkmate.errors import CheckmateError
from checkmate.launch import shadow_placement
from checkmate.launch.local_shadows import START_TIMEOUT, LocalShadows
from checkmate.train import env as envmod

#: The rendezvous backend name ``checkmate launch --colocate`` gives torch's agent.
BACKEND = "checkmate-colocate"
#: Prefix of this module's keys in a round's store (the round's own prefix is torch's).
KEY = "checkmate/colocate"
#: Seconds a node waits for the others' shadows to be ready (a cold Numba cache compiles).
READY_WAIT = START_TIMEOUT + 30

PROG = "checkmate launch"


class Colocation:
    """What one launcher knows of the job's co-located shadows across rounds."""

    def __init__(self, node: str, ips: Mapping[str, str], domains: Mapping[str, str] | None,
                 partitions: int, replicas: int,
                 make: Callable[[list, list[int]], LocalShadows] | None, file: Path) -> None:
        #: this node's name, the address book (--colocate, in order) and --domain
        self.node, self.ips, self.domains = node, dict(ips), dict(domains or {})
        self.partitions, self.replicas = partitions, replicas
        #: ``make(addrs, mine) -> LocalShadows``: this node's shadows, built at the first
        #: round (the launcher's options: log dir, persistence, cores)
        self.make = make
        #: where the workers read each round's shadow list ($CHECKMATE_SHADOWS_FILE)
        self.file = Path(file).resolve()
        self.local: LocalShadows | None = None
        self.placement: shadow_placement.Placement | None = None
        self.slots: list[tuple[str, str, int, int]] = []
        self.gen = 0  # how many placements this job has had

    # ------------------------------------------------------------------ one round
    def on_round(self, store: Any, rank: int, world: int, out: Any = None) -> None:
        """Place the shadows for a round of ``world`` nodes (this one ``rank``); see the
        module's docstring. CheckmateError, one line, when it cannot."""
        out = out or sys.stdout
        mine = {"node": self.node, "gen": self.gen, "slots": self.slots,
                "placement": self.placement.nodes if self.placement else None}
        members = self._exchange(store, rank, world, json.dumps(mine))
        names = [m["node"] for m in members]
        if len(set(names)) != len(names):
            raise CheckmateError(f"two nodes of the job call themselves "
                                 f"{sorted(n for n in names if names.count(n) > 1)[0]} "
                                 "(--node): give each its own name")
        hosting = [n for n in self.ips if n in names]  # address-book order: one for all
        doms = {n: d for n, d in self.domains.items() if n in hosting}
        known = max((m for m in members if m["placement"]), key=lambda m: m["gen"],
                    default=None)
        if known is None:
            placement = shadow_placement.place(hosting, self.partitions, self.replicas,
                                               doms or None)
            slots = shadow_placement.slots(placement, self.ips)
            gen, said = 1, self._first(placement)
        else:
            old = [tuple(s) for s in known["slots"]]
            prev = shadow_placement.Placement(known["placement"], {
                n: self.domains.get(n, n) for ns in known["placement"] for n in ns})
            try:
                placement = shadow_placement.replace(prev, hosting, self.replicas,
                                                     doms or None)
                slots = shadow_placement.reslot(old, placement, self.ips)
            except CheckmateError as e:
                placement, slots = prev, old
                lost = sorted({n for ns in prev.nodes for n in ns} - set(hosting))
                said = (f"{PROG}: warning: cannot place the replicas of {', '.join(lost)} "
                        f"anew ({e}): their partitions keep fewer replicas") if lost else ""
            else:
                said = self._moved(old, slots, hosting)
            gen = int(known["gen"]) + (slots != old)
        self.placement, self.slots, self.gen = placement, slots, gen
        if said:
            print(said, file=out, flush=True)
        self._run_mine(out)
        self._barrier(store, rank, world)
        self._hand_to_workers()

    def _first(self, placement: shadow_placement.Placement) -> str:
        line = (f"{PROG}: shadows on the job's nodes ({self.replicas} replica(s) of each of "
                f"{self.partitions} partitions):\n{placement.describe()}")
        if placement.warning:
            line += f"\n{PROG}: warning: {placement.warning}"
        return line

    def _moved(self, old: list, slots: list, hosting: list[str]) -> str:
        """The line for a round that moved shadows ("" when none moved)."""
        n = self.partitions
        moved = [f"partition {i % n} replica {i // n}: {o[0]} -> {s[0]}"
                 for i, (o, s) in enumerate(zip(old, slots, strict=True)) if o != s]
        if not moved:
            return ""
        return (f"{PROG}: the job's nodes are now {', '.join(hosting)}: placed "
                f"{len(moved)} shadow(s) anew ({'; '.join(moved)}); each takes its state "
                "from a current sibling replica")

    def _run_mine(self, out: Any) -> None:
        """Start what is placed here now, stop what moved away."""
        mine = [i for i, s in enumerate(self.slots) if s[0] == self.node]
        addrs = [s[1:] for s in self.slots]
        if self.local is None:
            if self.make is None:
                raise CheckmateError("co-located shadows: nothing to start them with")
            self.local = self.make(addrs, mine)
            ip = self.ips.get(self.node, "")
            print(f"{PROG}: starting {len(mine)} of them on {self.node} ({ip})" if mine
                  else f"{PROG}: {self.node} hosts none of them", file=out, flush=True)
            self.local.start(out)
            return
        started, stopped = self.local.move(addrs, mine, out)
        if stopped:
            print(f"{PROG}: stopped {len(stopped)} shadow(s) on {self.node}: placed "
                  "elsewhere now", file=out, flush=True)
        if started:
            print(f"{PROG}: started {len(started)} shadow(s) on {self.node}: "
                  + ", ".join(self.local.name(i) for i in started), file=out, flush=True)

    def _exchange(self, store: Any, rank: int, world: int, mine: str) -> list[dict]:
        try:
            store.set(f"{KEY}/member/{rank}", mine)
            keys = [f"{KEY}/member/{r}" for r in range(world)]
            store.wait(keys, timedelta(seconds=READY_WAIT))
            return [json.loads(store.get(k)) for k in keys]
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise CheckmateError(f"placing the shadows in the rendezvous: {e}") from None

    def _barrier(self, store: Any, rank: int, world: int) -> None:
        """Until every node's shadows of this round are ready (workers elsewhere would
        find a new one not yet answering)."""
        try:
            store.set(f"{KEY}/ready/{rank}", "1")
            store.wait([f"{KEY}/ready/{r}" for r in range(world)],
                       timedelta(seconds=READY_WAIT))
        except (RuntimeError, ValueError) as e:
            raise CheckmateError(f"waiting for the other nodes' shadows: {e}") from None

    def _hand_to_workers(self) -> None:
        """The round's shadow list, where the round's workers read it: the file
        ``$CHECKMATE_SHADOWS_FILE`` (replaced whole: a worker never reads half of it) and
        the launcher's environment (what a worker started, not forked, inherits)."""
        lists = {envmod.SHADOWS: envmod.format_addrs(self.tcp),
                 envmod.SHADOWS_UDP: envmod.format_addrs(
                     [(ip, u) for _n, ip, u, _t in self.slots])}
        os.environ.update(lists)
        tmp = self.file.with_name(self.file.name + ".new")
        tmp.write_text(json.dumps(lists))
        os.replace(tmp, self.file)
        os.environ[envmod.SHADOWS_FILE] = str(self.file)

    @property
    def tcp(self) -> list[tuple[str, int]]:
        """Every shadow's TCP service as of the last round."""
        return [(ip, t) for _n, ip, _u, t in self.slots]

    def stop(self) -> None:
        if self.local is not None:
            self.local.stop()


# ---------------------------------------------------------------------- torch's handler
_ACTIVE: dict[str, Any] = {}


def use(colo: Colocation, backend: str) -> str:
    """Register the placing handler (once per process) for ``colo`` over torch's
    ``backend`` (c10d); returns the backend name to give torch's LaunchConfig."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    _ACTIVE["colo"], _ACTIVE["inner"] = colo, backend
    rendezvous_handler_registry.register(BACKEND, _create)
    return BACKEND


def _create(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    inner = rendezvous_handler_registry.create_handler(RendezvousParameters(
        _ACTIVE["inner"], params.endpoint, params.run_id, params.min_nodes, params.max_nodes,
        params.local_addr, **params.config))
    return _placing_handler(inner, _ACTIVE["colo"])


def _placing_handler(inner: Any, colo: Colocation) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    class PlacingRendezvous(RendezvousHandler):
        """torch's handler for the round; after each round the shadows are placed."""

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return inner.use_agent_store

        def next_rendezvous(self) -> Any:
            info = inner.next_rendezvous()
            colo.on_round(info.store, info.rank, info.world_size)
            return info

        def is_closed(self) -> bool:
            return inner.is_closed()

        def set_closed(self) -> None:
            inner.set_closed()

        def num_nodes_waiting(self) -> int:
            return inner.num_nodes_waiting()

        def get_run_id(self) -> str:
            return inner.get_run_id()

        def shutdown(self) -> bool:
            return inner.shutdown()

    return PlacingRendezvous()

