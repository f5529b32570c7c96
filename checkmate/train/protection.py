"""What the trainers know about their checkpoints: each shadow's progress, lag, re-seeds.

Every trainer runs one monitor thread that asks every shadow for its status every ``poll``
seconds (the request carries the trainer's last finished iteration, which also tells a
shadow that holes up to there are due for repair). From the answers it keeps the
protection state (``CheckmateSession.protection()``): the newest iteration every shadow has
committed, each shadow's lag, and what is being done about it. It acts on what it sees:

- rank 0 tells a shadow who the trainers are (``peers``) whenever it does not know;
- the trainer of rank ``partition % world`` re-seeds a shadow that is not seeded (restarted
  empty) or that asks for it (a hole the trainers no longer retain): a ReseedSender takes
  one slice per iteration from ``CheckmateSession.step``;
- rank 0 logs one warning line when a shadow's lag passes ``lag_warn`` iterations, and one
  line when it is back within it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from checkmate.errors import CheckmateError
from checkmate.shadow_client import Addr, ShadowClient

log = logging.getLogger("checkmate.train")

#: Seconds between two status polls of every shadow.
POLL_SECONDS = 0.5
#: Lag (iterations behind the trainers) that logs a warning.
LAG_WARN = 4
#: Seconds a shadow gets to pick up a re-seed before it is offered again.
RESEED_RETRY = 10.0


@dataclass
class ShadowView:
    """The last status seen of one shadow."""

    latest: int | None = None
    seeded: bool = False
    reachable: bool = False
    wanted: str = ""
    active: bool = False
    peers: bool = False
    reseeds: int = 0
    error: str = ""
    warned: bool = False


class ProtectionMonitor:
    """One trainer's view of the shadows; see the module docstring."""

    def __init__(self, sess: Any, poll: float = POLL_SECONDS, lag_warn: int = LAG_WARN
                 ) -> None:
        self.sess = sess
        lay = sess.layout
        self.rank, self.world = lay.rank, lay.world
        self.addrs: list[Addr] = list(lay.shadow_tcp)
        self.poll, self.lag_warn = poll, lag_warn
        self.views = [ShadowView() for _ in self.addrs]
        self.reseeding: dict[int, Any] = {}  # partition -> ReseedSender
        self._offered: dict[int, float] = {}
        self.reseeds_started = 0
        self._clients = [ShadowClient(a, timeout=2.0) for a in self.addrs]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # One poller at a time: finish() polls from the training thread while the monitor's
        # thread may be polling, and both would use the same shadow connections.
        self._polling = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ckm-protect", daemon=True)

    def start(self) -> ProtectionMonitor:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        for c in self._clients:
            c.close()
        for r in list(self.reseeding.values()):
            r.cancel()

    # ------------------------------------------------------------------ polling
    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            self.poll_once()

    def poll_once(self) -> None:
        with self._polling:
            self._poll()

    def _poll(self) -> None:
        done = self.sess.done_iteration
        for p, c in enumerate(self._clients):
            v = self.views[p]
            try:
                st = c.request({"op": "status", "progress": done})[0]
            except CheckmateError as e:
                v.reachable, v.error = False, str(e)
                continue
            rs = st.get("reseed") or {}
            with self._lock:
                v.reachable, v.error = True, ""
                v.latest, v.seeded = st.get("latest"), bool(st.get("seeded"))
                v.wanted, v.active = str(rs.get("wanted") or ""), bool(rs.get("active"))
                v.peers, v.reseeds = bool(st.get("peers")), int(rs.get("count") or 0)
            try:
                self._act(p, v, done)
            except CheckmateError as e:
                v.error = str(e)

    def _act(self, p: int, v: ShadowView, done: int) -> None:
        sess = self.sess
        if self.rank == 0 and not v.peers:
            self._clients[p].request(sess.peers_body(p))
        mine = p % self.world == self.rank
        cur = self.reseeding.get(p)
        if cur is not None and cur.finished:
            del self.reseeding[p]
            cur = None
        need = (not v.seeded and not v.active) or bool(v.wanted)
        if mine and need and cur is None and sess.model is not None:
            if time.monotonic() - self._offered.get(p, -1e9) >= RESEED_RETRY or v.wanted:
                reason = v.wanted or "shadow restarted without state"
                self._offered[p] = time.monotonic()
                self.reseeding[p] = sess.new_reseed(p, reason)
                self.reseeds_started += 1
                log.warning("checkmate: re-seeding the shadow of partition %d while training "
                            "runs (%s)", p, reason)
        if self.rank == 0:
            lag = self.lag(p, done)
            if lag is not None and lag > self.lag_warn and not v.warned:
                v.warned = True
                log.warning("checkmate: shadow of partition %d lags %d iterations (committed "
                            "%s, trainers at %d)%s", p, lag, v.latest, done,
                            f": {v.wanted}" if v.wanted else "")
            elif v.warned and lag is not None and lag <= self.lag_warn:
                v.warned = False
                log.warning("checkmate: shadow of partition %d caught up (committed %s)", p,
                            v.latest)

    # ------------------------------------------------------------------ training thread
    def capture(self, iteration: int, step: int) -> None:
        """After each optimizer step: one slice for every re-seed this rank is sending."""
        for r in list(self.reseeding.values()):
            if r.capturing:
                r.capture(iteration, step)

    # ------------------------------------------------------------------ reading
    def lag(self, p: int, done: int) -> int | None:
        v = self.views[p]
        if not v.reachable:
            return None
        return done - (v.latest if v.latest is not None and v.seeded else 0)

    def protection(self) -> dict[str, Any]:
        done = self.sess.done_iteration
        with self._lock:
            shadows = {}
            for p, v in enumerate(self.views):
                shadows[p] = {"latest": v.latest if v.seeded else None,
                              "lag": self.lag(p, done), "reachable": v.reachable,
                              "reseeding": v.active or p in self.reseeding,
                              "wanted": v.wanted, "error": v.error}
            latests = [s["latest"] for s in shadows.values()]
        return {"iteration": done,
                "newest_consistent": (min(latests) if latests and None not in latests
                                      else None),
                "shadows": shadows, "reseeds": self.reseeds_started}
