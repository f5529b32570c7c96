"""What keeps a session's iterations restorable, and what says whether they are.

The replica log and repair service (lost copies answered from the trainers), the shadows'
``peers`` (who owns which replica), live re-seeds, the switch mode's session refresh, and
the protection state: ``protection``, the progress line of ``report``, and ``finish``'s
wait for the last iteration.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from checkmate.errors import CheckmateError
from checkmate.train.layout import query_replica_sessions
from checkmate.train.protection import ProtectionMonitor
from checkmate.train.repair import RepairServer, owners_body
from checkmate.train.replica_log import ReplicaLog
from checkmate.train.reseed import ReseedSender
from checkmate.train.ring import replica_owners


class _Reliability:
    """Part of :class:`CheckmateSession` (session.py): replication's safety nets and the
    protection state."""

    def _start_reliability(self) -> None:
        """Replica log, repair service, peers at every shadow, protection monitor."""
        lay = self.layout
        if lay.repair:
            self.replica_log = ReplicaLog(lay.repair_keep)
            self.repair = RepairServer(lay.repair_addr(lay.rank),
                                       lay.job_id, self.replica_log, self.sender.targets,
                                       lay.repair_rate, data_key=self.data_key,
                                       mirrors=self.sender.mirrors)
        if lay.rank == 0:
            from checkmate.train.shadow_client import ShadowClient

            for addrs in lay.tcp_sets:
                for p, a in enumerate(addrs):
                    try:
                        with ShadowClient(a) as c:
                            c.request(self.peers_body(p))
                    except (CheckmateError, OSError):
                        if len(lay.tcp_sets) == 1:
                            raise
                        # a replica that is down: the monitor tells it once it answers

        self.monitor = ProtectionMonitor(self, lay.monitor_poll, lay.lag_warn).start()
        from checkmate.metrics_port import port_from_env

        port = port_from_env(None)
        if port is not None:  # one port per rank on a shared host: PORT + rank (0: any)
            from checkmate import metrics  # prometheus-client: only when metrics are on

            self.metrics = metrics.serve(metrics.TrainerCollector(self.protection, lay.rank),
                                         port + lay.rank if port else 0,
                                         lay.trainers[lay.rank][0])

    def peers_body(self, partition: int) -> dict[str, Any]:
        """The ``peers`` request for one shadow: trainers' repair addresses and owners."""
        lay = self.layout
        start, end = self.spec.bounds(partition)
        trainers = [lay.repair_addr(r) for r in range(lay.world)]
        return owners_body(trainers, replica_owners(self.buckets, lay.world, start, end,
                                                    self.node_of)
                           if lay.repair else [], 0, self.run)

    def new_reseed(self, partition: int, reason: str,
                   addr: tuple[str, int] | None = None) -> ReseedSender:
        """A live re-seed of ``partition``'s shadow at ``addr`` (default: its first
        replica); the protection monitor starts it."""
        return ReseedSender(self.spec, dict(self.module.named_parameters()), self.optimizer,
                            partition, addr or self.layout.shadow_tcp[partition],
                            self.layout.reseed_slices, reason)

    def _on_reduced(self, iteration: int, bucket: int, offset: int, partition: int,
                    payload: bytes, switched: bool = False) -> None:
        """One reduced piece this rank hands to its shadow. ``switched``: the ring sent it
        tagged through the switch, which copies it in switch mode; otherwise (host mode,
        or no hop of the piece's ring path crosses the switch: one node) the trainer sends
        the copy itself."""
        if self.replica_log is not None:
            self.replica_log.add_piece(iteration, bucket, offset, partition, payload)
        if self.layout.mode == "host" or (self.layout.mode == "switch" and not switched):
            self.sender.copy(iteration, bucket, offset, partition, payload)

    def protection(self) -> dict[str, Any]:
        """The protection state: newest iteration every shadow committed, lag per shadow,
        re-seeds, repairs answered (see checkmate.train.protection)."""
        if self.monitor is None:
            return {"iteration": self.done_iteration, "newest_consistent": None,
                    "shadows": {}, "reseeds": 0, "repair": None}
        out = self.monitor.protection()
        out["repair"] = self.repair.status() if self.repair is not None else None
        return out

    def _refresh_sessions(self) -> None:
        place = self.control_place()
        regs = place.mine(query_replica_sessions(self.layout.controller, place.job))
        for k in range(1 + len(self.layout.replica_shadows)):  # each replica its own
            self.sender.update_sessions({p: (int(v[k]["epoch"]), int(v[k]["token"]))
                                         for p, v in regs.items() if k in v}, replica=k)

    def _refresh_loop(self) -> None:
        while not self._refresh_stop.wait(1.0):
            try:
                self._refresh_sessions()
            except (CheckmateError, OSError):
                pass  # keep the last known sessions; the next round tries again

    def finish(self, timeout: float = 30.0) -> dict[str, Any]:
        """End of training, on every rank: wait (at most ``timeout`` s) until every shadow
        committed the last iteration, then return the protection state, the same on every
        rank. A shadow that did not get there is one warning line on rank 0, never a hang
        or an exception; ``result["protected"]`` says whether the last iteration is
        restorable. Repairs keep being answered meanwhile.
        """
        ok = [True]
        if self.layout.mode == "off":
            return {**self.protection(), "protected": False}
        last = self.done_iteration
        # The last iteration is checked too (issue 35): by the step when K divides it, else
        # here, with the shadows' ``check`` request (the control message went unchecked).
        schedule = self._check_schedule()
        rows = self._verify() if schedule is not None and schedule.last != last else None
        if self.layout.rank == 0:
            try:
                self.wait_shadows(last, timeout)
                if rows is not None:
                    self._check_shadows(last, rows)
            except CheckmateError as e:
                ok[0] = False
                import logging

                logging.getLogger("checkmate.train").warning(
                    "checkmate: training finished at iteration %d but it is not protected: "
                    "%s", self.done_iteration, e)
        dist.broadcast_object_list(ok, group=self.group, group_src=0)
        if self.monitor is not None:
            self.monitor.poll_once()
        return {**self.protection(), "protected": bool(ok[0])}

    def _check_shadows(self, iteration: int, rows: list[list[str]]) -> None:
        """Every shadow's state check of ``iteration`` against ``rows``; CheckmateError
        naming the first that differs from the trainers. With several replicas of a
        partition, one that cannot be reached is passed over while another of them passes;
        every one that answers must hold the trainers' state."""
        from checkmate.train.shadow_client import ShadowClient

        sets = self.layout.tcp_sets
        for p in range(len(self.layout.shadow_tcp)):
            passed, gone = 0, ""
            for k, addrs in enumerate(sets):
                a = addrs[p]
                rep = f" replica {k}" if len(sets) > 1 else ""
                try:
                    with ShadowClient(a) as c:
                        said = c.check(iteration, rows)
                except (CheckmateError, OSError) as e:
                    if len(sets) == 1:
                        raise
                    gone = f"the shadow of partition {p}{rep} ({a[0]}:{a[1]}): {e}"
                    continue
                if not said.get("verified"):
                    raise CheckmateError(f"the shadow of partition {p}{rep} ({a[0]}:{a[1]}) "
                                         f"does not hold the trainers' state: "
                                         f"{said.get('diverged')}")
                passed += 1
            if not passed:
                raise CheckmateError(f"no replica of partition {p} could be checked: {gone}")

    def wait_shadows(self, iteration: int, timeout: float = 30.0) -> None:
        """Block until every partition committed ``iteration`` in one of its replicas (for
        tests and clean shutdown)."""
        from checkmate.train.shadow_client import ShadowClient

        deadline = time.monotonic() + timeout
        sets = self.layout.tcp_sets
        for p in range(len(self.layout.shadow_tcp)):
            # one connection per replica for the whole wait (each reconnects after a
            # failure); a lone shadow gets the default timeout, as before replicas
            clients = [ShadowClient(addrs[p]) if len(sets) == 1 else
                       ShadowClient(addrs[p], 2.0) for addrs in sets]
            try:
                self._wait_partition(p, clients, iteration, deadline)
            finally:
                for c in clients:
                    c.close()

    def _wait_partition(self, p: int, clients: list[Any], iteration: int,
                        deadline: float) -> None:
        """Until one replica of partition ``p`` (``clients``) committed ``iteration``."""
        latest: dict[int, Any] = {}
        while True:
            for k, c in enumerate(clients):
                try:
                    latest[k] = c.status().get("latest") or 0
                except (CheckmateError, OSError) as e:
                    if len(clients) == 1:
                        raise
                    latest[k] = f"unreachable ({e})"
            if any(isinstance(x, int) and x >= iteration for x in latest.values()):
                return
            if time.monotonic() > deadline:
                a = clients[0].addr
                held = (f"committed up to iteration {latest[0]}" if len(clients) == 1 else
                        "replicas hold " + ", ".join(f"{k}: {x}" for k, x in
                                                     sorted(latest.items())))
                raise CheckmateError(f"the shadow of partition {p} ({a[0]}:{a[1]}) {held}, "
                                     f"not {iteration}")
            time.sleep(0.02)

    def report(self, loss: float | torch.Tensor | None = None) -> None:
        """Progress for the console: on rank 0, every ``progress_every`` iterations
        (CHECKMATE_PROGRESS_EVERY; ``checkmate launch --progress-every``), one line with the
        iteration, ``loss`` and the protection state. Call it after ``step``."""
        every = getattr(self, "progress_every", 0)
        it = self.done_iteration
        if self.layout.rank != 0 or not every or it % every:
            return
        if self.mesh is not None and not self.mesh.first_tp_rank:
            return  # the TP ranks of a replica report one loss: the first one says it
        text = f"checkmate: iteration {it}"
        if loss is not None:
            text += f" loss {float(loss.detach() if torch.is_tensor(loss) else loss):.4f}"
        if self.layout.mode == "off":
            text += " | not protected (mode off)"
        else:
            # Asked now on connections of its own (the monitor thread owns its clients).
            from checkmate.train.shadow_client import ShadowClient

            sets = self.layout.tcp_sets
            per: list[list[int]] = [[] for _ in self.layout.shadow_tcp]
            for addrs in sets:
                for p, a in enumerate(addrs):
                    try:
                        with ShadowClient(a, 2.0) as c:
                            got = c.status().get("latest")
                    except (CheckmateError, OSError):
                        continue
                    if got is not None:
                        per[p].append(int(got))
            latest = [max(x) if x else None for x in per]
            held = min(latest) if None not in latest else None
            lags = " ".join("?" if x is None else str(it - x) for x in latest)
            text += f" | shadows hold iteration {held} (lag per shadow: {lags})"
            if len(sets) > 1:  # how many replicas of each partition answered with state
                text += f" (replicas answering: {' '.join(str(len(x)) for x in per)})"
        print(text, flush=True)
