"""A running shadow: receive thread, step thread, persistence thread and TCP service.

Start order: bind both sockets (fail fast on a taken port), load the newest verified
checkpoint from disk if there is one (a restarted shadow serves from disk), register with
the controller for the session epoch/token (unless disabled), then start receiving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from checkmate.config.cluster import RESTORE_PORT, SHADOW_PORT
from checkmate.errors import CheckmateError
from checkmate.protocol import auth, datamac
from checkmate.shadow import checkpoint_load, disk, ingest, persist
from checkmate.shadow.assembler import Assembler
from checkmate.shadow.kernels import warm_up_kernels
from checkmate.shadow.receiver import Receiver, open_socket
from checkmate.shadow.register import register
from checkmate.shadow.repair import RepairRequester, parse_peers
from checkmate.shadow.service import Service
from checkmate.shadow.sibling import SiblingReseed
from checkmate.shadow.state import ShadowState, Version

log = logging.getLogger("checkmate.shadow")


@dataclass
class NodeOptions:
    partition: int
    partitions: int
    job: int
    bind: str = "0.0.0.0"
    port: int = SHADOW_PORT
    restore_bind: str = "0.0.0.0"
    restore_port: int = RESTORE_PORT
    dir: str | None = None
    persist_every: int = 0
    persist_seconds: float = 0.0
    keep: int = 3
    retain: int = 4
    window: int = 8
    gap_timeout: float = 2.0
    epoch: int = 0
    token: int = 0
    controller: tuple[str, int] | None = None  # None: do not register (--no-register)
    #: Co-located in switch mode (``shadow serve --placed``): the launcher's attempt placed
    #: it at the controller, so it does not register; its session is the one the controller
    #: lists at its address (``ip``, its UDP port).
    placed: bool = False
    host: str = ""
    ip: str = ""
    mac: str = ""
    register_deadline: float = 30.0
    #: What the controller knows this shadow as, when not (job, partition): a mesh job's
    #: group (config job.groups > 1) has a wire job id of its own and numbers its
    #: partitions from 0, while the controller keys sessions by the config's job id and
    #: partition (checkmate.config.cluster.ClusterConfig.wire_place).
    control_job: int | None = None
    control_partition: int | None = None
    #: The job secret (checkmate.protocol.auth); None: read $CHECKMATE_SECRET_FILE's.
    secret: bytes | None = None
    #: "udp", or "verbs": the replica stream also arrives on a UD queue pair of RDMA
    #: device ``device`` (checkmate.shadow.verbs); repair traffic stays on UDP.
    transport: str = "udp"
    device: str = ""
    verbs_slots: int = 1024  # receive ring slots (buffers posted at once)


class ShadowNode:
    def __init__(self, opts: NodeOptions) -> None:
        self.opts = opts
        self.secret = opts.secret if opts.secret is not None else auth.load_secret()
        self.drops: Counter = Counter()
        self.state = ShadowState(opts.partition, opts.partitions, opts.job, opts.retain,
                                 opts.window, opts.gap_timeout, self._on_commit)
        self.sibling = SiblingReseed(self.state, self.secret)
        self.state.drops = self.drops
        #: The trainers' run (checkmate.protocol.datamac.run_secret) whose keys this shadow
        #: checks with: "" (the job secret's own keys) until a ``peers`` request names one.
        self.run = ""
        self.state.control_key = datamac.control_key(self.secret)
        self.state.on_assembler = self._on_assembler
        self.persister: persist.Persister | None = None
        self.sock, self.rcvbuf = open_socket(opts.bind, opts.port)
        self.udp_port = self.sock.getsockname()[1]
        try:
            self.service = Service(self.state, self.status, opts.restore_bind,
                                   opts.restore_port, self.secret, self.drops,
                                   self._on_peers, self._on_progress,
                                   disk.part_dir(opts.dir, opts.partition)
                                   if opts.dir else None,
                                   self._on_session if opts.controller else None,
                                   self._on_adopt)
        except Exception:
            self.sock.close()
            raise
        self.tcp_port = self.service.port
        self.receiver = Receiver(self.sock, opts.job, opts.partition, self.drops,
                                 opts.epoch, opts.token,
                                 mac_key=datamac.data_key(self.secret))
        self.repair = RepairRequester(self.sock, opts.job, opts.partition,
                                      lambda: (self.receiver.epoch, self.receiver.token),
                                      self.receiver.repair_stats,
                                      key=datamac.data_key(self.secret))
        self.restored_from: str | None = None
        self._commits_at_start = 0
        self.warm_seconds: float | None = None  # background kernel warm-up of an empty start
        self._ready_seconds = 0.0  # from start until every kernel was ready
        #: Set when the background warm-up has compiled (or loaded from Numba's cache) every
        #: kernel; until then ``status`` says ``kernels: compiling`` (see :meth:`_warm`).
        self.kernels_ready = threading.Event()
        self.kernels_error = ""
        self._warm_t0 = time.monotonic()
        self._peers: dict[str, Any] | None = None  # validated when the spec is known
        self.verbs: Any = None  # checkmate.shadow.verbs.VerbsReceiver with transport verbs
        self.metrics: Any = None  # checkmate.metrics.MetricsServer, set by `shadow serve`
        if opts.transport == "verbs":
            from checkmate.shadow.verbs import VerbsReceiver

            try:
                self.verbs = VerbsReceiver(self.receiver, opts.device,
                                           slots=opts.verbs_slots)
            except BaseException:
                self.service.stop()
                self.sock.close()
                raise
        elif opts.transport != "udp":
            self.service.stop()
            self.sock.close()
            from checkmate.errors import CheckmateError

            raise CheckmateError(f"unknown transport {opts.transport!r} (udp or verbs)")

    def _on_assembler(self, asm: Assembler) -> None:
        assert self.state.spec is not None
        # A shadow started without a job id learned it from the spec (ShadowState.set_spec).
        self.receiver.job = self.repair.job = self.state.job
        asm.repair = self.repair
        if self._peers is not None and not self.repair.known:
            try:
                self.repair.set_peers(self._peers, self.state.start, self.state.end)
            except CheckmateError as e:  # taken before the spec: owners outside the bounds
                self.drops["tcp_refused"] += 1
                log.error("peers sent before the spec do not fit partition %d: %s (repairs "
                          "wait for the next peers request)", self.opts.partition, e)
                self._peers = None
        self.receiver.attach(asm, self.state.spec.grad_dtype)

    def set_run(self, run: str) -> None:
        """Check everything from now on with run ``run``'s keys; a new run also drops every
        iteration being assembled (bytes of the run that ended must not complete one of the
        new run, whose gradients may differ: another world size, another restore point)."""
        if run == self.run:
            return
        rs = datamac.run_secret(self.secret, run)
        dk, ck = datamac.data_key(rs), datamac.control_key(rs)
        rc = self.receiver
        with rc._lock:  # between two batches of the receive thread
            self.run = run
            rc.mac_key = dk if rc.mac_key is not None else None
            self.repair.key = dk
            self.state.control_key = ck
            asm = self.state.asm
            if asm is not None:
                asm.control_key = ck if asm.control_key is not None else None
                asm.forget_open()
                asm.newest_seen = asm.known_done = 0  # the old run's progress means nothing
        log.info("run %s: datagrams are checked with its keys", run[:8] or "(none)")

    def _on_peers(self, body: dict[str, Any]) -> None:
        """Take a ``peers`` request, checked whole before anything changes: a refused one
        leaves the run keys, the iterations being assembled and the peers as they were."""
        run = body.get("run", "")
        if not isinstance(run, str) or not datamac.valid_run(run):
            raise CheckmateError("peers 'run' must be 32 lowercase hex digits")
        st = self.state
        known = st.spec is not None
        # Before the spec the owner ranges are checked against the flat space (any range of
        # the job; the partition's bounds are checked when the assembler takes them).
        start, end = (st.start, st.end) if known else (0, 1 << 62)
        parse_peers(body, start, end)
        self.set_run(run)
        if known:
            self.repair.set_peers(body, start, end)
        self._peers = dict(body)

    def _on_session(self) -> dict[str, Any]:
        """Adopt this partition's current session from the controller (asked here, over
        the authenticated handshake: whoever asked us to look is not trusted for it) when
        its epoch is newer: a launcher's attempt was programmed under it, and copies the
        switch stamped for an earlier attempt are dropped from now on."""
        from checkmate.train.layout import query_replica_sessions

        o = self.opts
        assert o.controller is not None
        job, part = self.control_place
        mine = query_replica_sessions(o.controller, job, secret=self.secret).get(part, {})
        # a partition with replicas lists each of its shadows: this one's by host, or a
        # placed one's by its address (its host is the config's name for the replica)
        reg = next((v for v in mine.values() if (
            (v.get("ip"), v.get("port")) == (o.ip, self.udp_port) if o.placed
            else v.get("host") == o.host)), None)
        if reg is None or reg.get("port") != self.udp_port:
            where = f" at {o.ip}:{self.udp_port}" if o.placed else ""
            raise CheckmateError(f"the controller's session of partition {part} is "
                                 f"not this shadow's{where} ({reg})")
        epoch, token = int(reg["epoch"]), int(reg["token"])
        if epoch > self.receiver.epoch:
            log.warning("partition %d: new session epoch %d (was %d): a new attempt",
                        o.partition, epoch, self.receiver.epoch)
            self.receiver.set_session(epoch, token)
        return {"epoch": self.receiver.epoch}

    def _placed_session(self) -> None:
        """A placed shadow started again where it was placed (its launcher restarts one
        that exited) takes the session the controller holds for its address; one placed
        anew has none there until rank 0's attempt, which asks it (``_on_session``)."""
        try:
            self._on_session()
        except (CheckmateError, OSError) as e:
            log.info("partition %d: no session at the controller yet (%s): the next "
                     "attempt places this shadow", self.opts.partition, e)

    def _on_adopt(self, source: tuple[str, int]) -> bool:
        """A trainer saw this shadow empty while a sibling replica is current: take the
        partition's state from it (shadow.sibling), in the background."""
        return self.sibling.start(source)

    @property
    def control_place(self) -> tuple[int, int]:
        """(job id, partition) the controller keys this shadow's session by."""
        o = self.opts
        return (o.job if o.control_job is None else o.control_job,
                o.partition if o.control_partition is None else o.control_partition)

    def _on_progress(self, done: int) -> None:
        st = self.state
        asm = st.asm
        if asm is None:
            return
        asm.note_done(done)
        # Back from disk and the trainers are more than the window ahead: what lies between
        # cannot be received nor (beyond the trainers' retention) repaired, so the restart
        # itself asks for the re-seed at once, not after a repair round answered "gone".
        latest = st.latest
        if (self.restored_from is not None and st.committed_count == self._commits_at_start
                and st.reseed is None and st._reseed_pending is None
                and latest is not None and done > latest + st.window):
            asm.want_reseed(f"restarted from disk at iteration {latest}, the trainers are "
                            f"at {done}")

    def _on_commit(self, v: Version) -> None:
        p = self.persister
        if p is not None:
            p.on_commit(v)  # a seed also purges the lineage it replaces (persist.py)

    def start(self) -> ShadowNode:
        o = self.opts
        try:
            if o.dir:
                self._load_from_disk()
                self.persister = persist.Persister(o.dir, o.partition, self.state,
                                                   o.persist_every, o.persist_seconds,
                                                   o.keep)
                self.state.after_commit = self.persister.wait_room
                self.state.on_diverged = self.persister.drop_from
                self.state.on_verified = self.persister.verified
                if self.restored_from is not None:
                    self.persister.last_iteration = self.state.latest
            self._commits_at_start = self.state.committed_count
            # The TCP service answers status at once; the kernels compile behind it.
            self._warm_t0 = time.monotonic()
            # Empty or not is decided now: a re-seed may give the state its spec while the
            # receive pass still compiles, and its optimizer kernels must be compiled anyway.
            threading.Thread(target=self._warm, args=(self.state.spec is None,),
                             name="shadow-warm", daemon=True).start()
            self.service.start()
            if o.placed:
                self._placed_session()
            elif o.controller is not None:
                epoch, token = register(self.secret, o.controller, *self.control_place,
                                        o.host, o.ip, o.mac, self.udp_port,
                                        o.register_deadline)
                self.receiver.set_session(epoch, token)
            self.receiver.start()
            if self.verbs is not None:
                self.verbs.start()
        except BaseException:
            self.stop()
            raise
        log.info("shadow partition %d/%d: udp %s:%d tcp %s:%d rcvbuf %d", o.partition,
                 o.partitions, o.bind, self.udp_port, o.restore_bind, self.tcp_port,
                 self.rcvbuf)
        return self

    def _warm(self, empty: bool) -> None:
        """Compile (or load from Numba's on-disk cache) the receive pass and, when started
        empty, every optimizer kernel (a disk restart compiled its own while installing
        the checkpoint), in the background: the service answers meanwhile, its status says
        ``kernels: compiling`` and for how long, so whoever starts trainers can wait for
        ``ready`` (checkmate.train.shadow_client.wait_ready) instead of timing out on a
        seed that waits for the compiler -- from a cold cache that takes minutes on a
        loaded machine."""
        try:
            ingest.warm()
            if empty:
                t0 = time.monotonic()
                warm_up_kernels()
                self.warm_seconds = round(time.monotonic() - t0, 3)
        except Exception as e:  # noqa: BLE001 - reported in status, the wait fails on it
            self.kernels_error = f"{type(e).__name__}: {e}"[:300]
            log.exception("compiling the shadow kernels failed")
            return
        self._ready_seconds = round(time.monotonic() - self._warm_t0, 3)
        self.kernels_ready.set()
        log.info("kernels ready in %.1fs", self._ready_seconds)

    def kernels_status(self) -> dict[str, Any]:
        """``ready``, ``compiling`` or ``failed``, and the seconds it took (or has taken)."""
        if self.kernels_ready.is_set():
            return {"state": "ready", "seconds": self._ready_seconds}
        state = "failed" if self.kernels_error else "compiling"
        return {"state": state, "seconds": round(time.monotonic() - self._warm_t0, 1),
                "error": self.kernels_error}

    def _load_from_disk(self) -> None:
        o = self.opts
        pdir = disk.part_dir(o.dir, o.partition)
        persist.clean_temp(pdir)
        ck = checkpoint_load.latest_valid(pdir)
        if ck is None:
            return
        m = ck.meta
        if m["partition"] != o.partition or m["partitions"] != o.partitions:
            raise disk.PersistError(
                f"{pdir} holds partition {m['partition']}/{m['partitions']}, this shadow is "
                f"{o.partition}/{o.partitions}")
        self.state.set_spec(ck.spec)
        # trusted as the trainers' state only if that iteration passed the state check
        verified = disk.is_verified(pdir, m["iteration"])
        self.state.install(m["iteration"], m["step"], ck.slots, m["buffers"], m["extra"],
                           m["lrs"], trusted=verified)
        self.state.versions[-1].verified = verified
        self.restored_from = str(pdir)
        self.service.reloaded = m["iteration"]
        log.info("restored partition %d from %s at iteration %d", o.partition, pdir,
                 m["iteration"])

    def stop(self) -> None:
        if self.verbs is not None:
            self.verbs.close()
        self.receiver.stop()
        self.service.stop()
        self.state.stop()
        if self.persister is not None:
            self.persister.stop()
        self.sock.close()

    def status(self, commit_times: bool = False) -> dict[str, Any]:
        """The ``status`` op's answer; ``commit_times`` adds every recent commit's
        (iteration, wall time), up to 4096 (for measuring commit lag, not for polling)."""
        st = self.state
        asm = st.asm
        return {
            "partition": self.opts.partition,
            "partitions": self.opts.partitions,
            "job": self.state.job,
            "seeded": st.seeded_iteration is not None,
            "newest_seen": asm.newest_seen if asm else None,
            "peers": self.repair.known,
            "repair": self.receiver.repair_status(),
            "reseed": {
                "wanted": (asm.reseed_wanted if asm else "") if st.reseed is None else "",
                "active": st.reseed is not None or self.sibling.source is not None,
                "sibling": self.sibling.status(),
                "count": st.reseeds_done,
                "reason": st.reseed_reason,
                "seconds": st.reseed_seconds,
                **({"progress": st.reseed.status()} if st.reseed is not None else {}),
            },
            "seeded_iteration": st.seeded_iteration,
            "installs": st.installs,  # seeds, disk reloads and re-seeds taken
            # what a restore may take: a failed state check withdraws the newer versions
            "latest": (st.retained() or [None])[-1],
            "retained": st.retained(),
            "epoch": self.receiver.epoch,
            "run": self.run,
            "gaps": list(asm.gaps) if asm else [],
            "gap_count": asm.gap_count if asm else 0,
            "pending": sorted(asm.open) if asm else [],
            "drops": dict(self.drops),
            "received": self.receiver.received,
            "receiver": self.receiver.stats(),
            "committed": st.committed_count,
            "step_seconds": round(st.step_seconds, 6),
            "error": st.last_error,
            "state_check": st.check.status(),
            "persist": self.persister.status() if self.persister else None,
            "restored_from": self.restored_from,
            "warm_seconds": self.warm_seconds,
            "kernels": self.kernels_status(),
            "rcvbuf": self.rcvbuf,
            "tcp_service": self.service.health(),
            "metrics": self.metrics.health() if self.metrics is not None else None,
            "verbs": self.verbs.status() if self.verbs is not None else None,
            "range": [st.start, st.end] if st.spec else None,
            **({"commit_times": [[i, round(t, 4)] for i, t in list(st.commit_times)]}
               if commit_times else {}),
        }
