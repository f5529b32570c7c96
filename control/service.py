"""The handshake service: shadows register here and get an epoch and token.

A UDP socket on the switch's address, port config.CONTROLLER_PORT (docs/protocol.md,
"Handshake"). Every request must carry a valid MAC made with the job secret, a fresh nonce
and a timestamp within checkmate.protocol.auth.SKEW; anything else gets a refusal that reveals
nothing and is counted (logged at most a few lines a minute). ``register`` mints a new
session (larger epoch, fresh token) -- unless it repeats the current registration's
``instance`` (a shadow's retry), which gets that session again --, reprograms the switch
so the partition's copies go to the registering shadow stamped with that session
(through the same plan/driver path as `control deploy`, so only changed entries are
written), stores it, and answers ``registered``. ``session`` answers the current
registrations. ``attempt`` (a launcher's rendezvous) programs the ring hops of its ranks
under one new epoch; a config whose shadows are co-located (on the trainer nodes) has
them placed by it, at the addresses the launcher started them on, instead of registered.
``counters`` answers what the service counted (requests by op, refusals,
drops), which `control status` shows. Bad requests get a NACK with a reason; datagrams that
are not handshake requests are dropped and counted.
"""

from __future__ import annotations

import socket
import sys
import threading
from collections import Counter

from checkmate.config.cluster import CONTROLLER_PORT, ClusterConfig
from checkmate.control import plan as plan_mod
from checkmate.control.drivers.base import Driver
from checkmate.control.sessions import SessionStore, parse_placement
from checkmate.errors import CheckmateError
from checkmate.protocol import auth, handshake, wire
from checkmate.ratelog import RateLimitedLog


class HandshakeService:
    def __init__(self, cfg: ClusterConfig, driver: Driver, store: SessionStore,
                 secret: bytes, bind_ip: str | None = None, port: int = CONTROLLER_PORT,
                 log=None) -> None:
        self.cfg = cfg
        self.key = auth.handshake_key(secret)
        self.guard = auth.ReplayGuard()
        self.driver = driver
        self.store = store
        self.addr = (bind_ip or cfg.switch.ip, port)
        self.stats: Counter[str] = Counter()
        self.stop_event = threading.Event()
        self._log = log or (lambda msg: print(f"control serve: {msg}", flush=True))
        # Bad input is counted always and logged at most a few lines a minute.
        self._bad_log = RateLimitedLog(self._log)
        self.sock: socket.socket | None = None

    # -- switch programming --------------------------------------------------------------
    def deploy(self, regs: dict | None = None) -> None:
        regs = self.store.for_config(self.cfg) if regs is None else regs
        try:
            res = self.driver.apply(plan_mod.build(self.cfg, regs, self.store.rings))
        except CheckmateError:
            self.driver.close()  # reconnect (and re-arbitrate) on the next request
            raise
        if res.writes:
            self._log(f"switch {self.cfg.switch.name}: {res.summary()}")

    # -- requests ------------------------------------------------------------------------
    def handle(self, data: bytes, peer_ip: str | None = None) -> bytes | None:
        """The reply to one datagram, or None when it is dropped. ``peer_ip``: the sender's
        address; a shadow may only register from its configured address."""
        try:
            m = handshake.parse(data)
        except wire.WireError:
            self.stats["malformed"] += 1
            return None
        h = m.header
        if h.flags & (wire.Flags.ACK | wire.Flags.NACK):
            self.stats["unexpected_reply"] += 1
            return None
        try:
            handshake.verify_request(self.key, m, self.guard)
        except auth.AuthError as e:
            self.stats["unauthenticated"] += 1
            self._bad_log(f"refused a request from {peer_ip or '?'}: {e}")
            return handshake.refusal(h)
        body = m.body
        op = body.get("op")
        try:
            job = body.get("job", h.job_id)
            if job != self.cfg.job_id or h.job_id != self.cfg.job_id:
                raise CheckmateError(f"unknown job {job!r} (this controller runs job "
                                     f"{self.cfg.job_id})")
            if op == "register":
                out = self._register(body, peer_ip)
            elif op == "session":
                out = self._session()
            elif op == "attempt":
                out = self._attempt(body)
            elif op == "counters":  # what was refused and dropped, for `control status`
                out = {"op": "counters", "job": self.cfg.job_id, "counters": dict(self.stats)}
            else:
                raise CheckmateError(f"unknown op {op!r}")
        except CheckmateError as e:
            self.stats["refused"] += 1
            self._bad_log(f"refused {op!r}: {e}")
            return handshake.reply(self.key, m, {"op": "error", "reason": str(e)}, ok=False)
        self.stats[str(op)] += 1
        return handshake.reply(self.key, m, out)

    def _register(self, body: dict, peer_ip: str | None) -> dict:
        reg = self.store.new_session(self.cfg, body, peer_ip)
        if self.store.known(reg):
            # A retry of a registration made (its reply was lost or late): answer it again;
            # no new epoch, no switch write (a newer instance that replaced it stays).
            self.stats["register_repeated"] += 1
            return {"op": "registered", "job": self.cfg.job_id, "partition": reg.partition,
                    "epoch": reg.epoch, "token": reg.token}
        regs = self.store.for_config(self.cfg)
        regs[reg.host] = reg
        self.deploy(regs)  # raises (-> NACK) if the switch cannot be programmed
        self.store.commit(reg)
        self._log(f"registered {reg.host} for partition {reg.partition} at {reg.ip}:"
                  f"{reg.port}, epoch {reg.epoch}")
        return {"op": "registered", "job": self.cfg.job_id, "partition": reg.partition,
                "epoch": reg.epoch, "token": reg.token}

    def _attempt(self, body: dict) -> dict:
        """A launcher's rendezvous made a new attempt: program the switch's replication for
        its ranks under a new epoch for every partition, before the attempt's first
        iteration. ``rings``: per data-parallel group (``job.groups`` of them), every rank's
        ring IP in ring order; ``ranks``: the one ring of a group-less job. A hop between
        two ranks of one host crosses no switch and gets no entry; entries of hosts that
        left (a lost node) are withdrawn by the plan's diff. ``shadows`` (a co-located
        config's, required there and refused elsewhere): per partition, every replica's
        "IP:PORT" where the launcher started it, on a trainer node; each gets a session at
        that address under the attempt's epoch, copied to out of its node's port. A repeat
        of the current attempt (a retry whose reply was lost: same id, rings and shadows)
        gets its sessions again."""
        attempt = body.get("attempt")
        rings = body.get("rings", [body["ranks"]] if "ranks" in body else None)
        if not isinstance(attempt, str) or not 0 < len(attempt) <= 128:
            raise CheckmateError("bad attempt: a string of 1 to 128 characters")
        if not isinstance(rings, list) or not 1 <= len(rings) <= 255 or not all(
                isinstance(r, list) and 1 <= len(r) <= 4096 and
                all(isinstance(ip, str) for ip in r) for r in rings):
            raise CheckmateError("bad rings: per data-parallel group a list of 1 to 4096 IP "
                                 "strings in ring order")
        if len(rings) != self.cfg.groups:
            raise CheckmateError(f"the attempt names {len(rings)} data-parallel group(s), the "
                                 f"controller's config {self.cfg.groups} (job.groups)")
        placed, placement = None, None
        if not self.cfg.colocated:
            if "shadows" in body:
                raise CheckmateError("bad shadows: this config's shadows are hosts of their "
                                     "own (they register); an attempt places only co-located "
                                     "ones")
        elif "shadows" not in body:
            raise CheckmateError("this config's shadows are co-located: the attempt must say "
                                 'where the launcher placed each ("shadows")')
        else:
            placed = parse_placement(self.cfg, body["shadows"])
            placement = [[f"{node.ip}:{port}" for node, port in reps] for reps in placed]
        if attempt == self.store.attempt and rings == self.store.rings \
                and placement == self.store.placement:
            regs = self.store.for_config(self.cfg)
            self.stats["attempt_repeated"] += 1
        else:
            for ring in rings:  # a bad mapping: refused before any write
                plan_mod.ring_hops(self.cfg, ring)
            regs = (self.store.attempt_sessions(self.cfg) if placed is None
                    else self.store.placed_sessions(self.cfg, placed))
            old_rings = self.store.rings
            self.store.rings = rings
            try:
                self.deploy(regs)
            except CheckmateError:
                self.store.rings = old_rings
                raise
            self.store.commit_attempt(attempt, rings, regs, placement)
            hosts = sorted({ip for r in rings for ip in r})
            per = f" in {len(rings)} groups" if len(rings) > 1 else ""
            on = sorted({r.node for r in regs.values() if r.node})
            self._log(f"attempt {attempt}: {sum(map(len, rings))} rank(s){per} on "
                      f"{len(hosts)} host(s) {', '.join(hosts)}, epoch "
                      f"{next(iter(regs.values())).epoch}"
                      + (f", shadows placed on {', '.join(on)}" if on else ""))
        return {"op": "attempt", "job": self.cfg.job_id, "attempt": attempt,
                **self._by_partition(regs, with_host=False)}

    def _session(self) -> dict:
        regs = self.store.for_config(self.cfg)
        # ``expected``: how many partitions the config has, so a launcher can tell "not
        # every shadow has registered yet" from a complete answer.
        return {"op": "session", "job": self.cfg.job_id, "groups": self.cfg.groups,
                "expected": self.cfg.num_partitions, **self._by_partition(regs)}

    def _by_partition(self, regs: dict[str, plan_mod.Registration],
                      with_host: bool = True) -> dict:
        """``partitions``: per partition, its first registered shadow's session (replica
        order); ``replicas``: per partition, every registered shadow's, with its replica
        number (a partition of one shadow lists that one) and, for a co-located shadow, the
        node it was placed on."""
        out: dict[str, dict] = {"partitions": {}, "replicas": {}}
        for h in self.cfg.shadow_hosts:
            r = regs.get(h.name)
            if r is None:
                continue
            d = {"epoch": r.epoch, "token": r.token, "ip": r.ip, "port": r.port,
                 **({"host": r.host} if with_host else {})}
            out["partitions"].setdefault(str(h.partition), d)
            out["replicas"].setdefault(str(h.partition), []).append(
                {**d, "host": r.host, "replica": self.cfg.replica_index(h),
                 **({"node": r.node} if r.node else {})})
        return out

    # -- loop ----------------------------------------------------------------------------
    def bind(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(self.addr)
        except OSError as e:
            s.close()
            raise CheckmateError(f"cannot listen on {self.addr[0]}:{self.addr[1]}: "
                                 f"{e.strerror}") from None
        s.settimeout(0.2)
        self.sock = s

    def serve_forever(self) -> None:
        if self.sock is None:
            self.bind()
        assert self.sock is not None
        self._log(f"listening on {self.addr[0]}:{self.addr[1]} for job {self.cfg.job_id}")
        while not self.stop_event.is_set():
            try:
                data, peer = self.sock.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError as e:
                print(f"control serve: recv failed: {e}", file=sys.stderr)
                continue
            try:
                out = self.handle(data, peer[0])
            except Exception as e:  # a request must never kill the service
                self.stats["errors"] += 1
                self._log(f"internal error on request from {peer[0]}: {e!r}")
                continue
            if out is not None:
                self.sock.sendto(out, peer)

    def close(self) -> None:
        self.stop_event.set()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
