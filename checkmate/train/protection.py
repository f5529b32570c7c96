"""What the trainers know about their checkpoints: each shadow's progress, lag, re-seeds.

Every trainer runs one monitor thread that asks every shadow for its status every ``poll``
seconds, and a shadow that is unreachable or has no state every FAST_POLL seconds (the
request carries the trainer's last finished iteration, which also tells a
shadow that holes up to there are due for repair). From the answers it keeps the
protection state (``CheckmateSession.protection()``): the newest iteration every shadow has
committed, each shadow's lag, and what is being done about it. It acts on what it sees:

- rank 0 tells a shadow who the trainers are (``peers``) whenever it does not know;
- the trainer of rank ``partition % world`` re-seeds a shadow that is not seeded (restarted
  empty) or that asks for it (a hole the trainers no longer retain): a ReseedSender takes
  one slice per iteration from ``CheckmateSession.step``;
- rank 0 logs one warning line when a shadow's lag passes ``lag_warn`` iterations, and one
  line when it is back within it.

Liveness: a shadow that has not answered a status poll for ``LIVENESS_SECONDS`` (dead,
unreachable, or silent: stopped, partitioned) is down. While any shadow is down, or not
seeded, or being re-seeded, the job is unprotected: ``protection()`` says
``protected_now`` False and ``unprotected_since`` (the first iteration no complete
checkpoint covers), ``newest_consistent`` is None while any shadow is down (no iteration is
known to exist in every partition) and otherwise the oldest of their newest commits, and
rank 0 prints one line when protection is lost and one when it returns by itself: once
every shadow answers and holds an iteration at or after the first uncovered one. A lag is
measured at one instant: the trainers' iteration when the shadow answered minus the
iteration it reported (never stale by a poll).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from checkmate.errors import CheckmateError
from checkmate.protocol.frames import Addr
from checkmate.train.shadow_client import ShadowClient

log = logging.getLogger("checkmate.train")

#: Seconds between two status polls of every shadow.
POLL_SECONDS = 0.5
#: Lag (iterations behind the trainers) that logs a warning.
LAG_WARN = 4
#: Seconds between two polls of a shadow that is unreachable or has no state (it is
#: restarting: its re-seed should start as soon as it answers).
FAST_POLL = 0.05
#: Seconds a shadow gets to pick up a re-seed before it is offered again.
RESEED_RETRY = 10.0
#: Seconds without an answer after which a shadow is down (unreachable or silent).
LIVENESS_SECONDS = 2.0
#: Seconds one status request may take (below LIVENESS_SECONDS: two tries fit in it).
STATUS_TIMEOUT = 1.0


@dataclass
class ShadowView:
    """The last status seen of one shadow."""

    latest: int | None = None
    #: the newest iteration its state check passed, and a divergence it found ("" none)
    verified: int | None = None
    diverged: str = ""
    seeded: bool = False
    reachable: bool = False
    wanted: str = ""
    active: bool = False
    peers: bool = False
    reseeds: int = 0
    error: str = ""
    warned: bool = False
    last_ok: float = 0.0  # time.monotonic() of the last answer
    done_at: int = 0  # the trainers' iteration when it answered (lag is measured there)


class ProtectionMonitor:
    """One trainer's view of the shadows; see the module docstring."""

    def __init__(self, sess: Any, poll: float = POLL_SECONDS, lag_warn: int = LAG_WARN,
                 liveness: float = LIVENESS_SECONDS) -> None:
        self.sess = sess
        lay = sess.layout
        self.rank, self.world = lay.rank, lay.world
        #: one slot per shadow: slot k * parts + p is replica k of partition p (one replica:
        #: slot p is partition p's shadow)
        self.parts, self.replicas = len(lay.shadow_tcp), len(lay.tcp_sets)
        self.addrs: list[Addr] = [a for addrs in lay.tcp_sets for a in addrs]
        self.poll, self.lag_warn, self.liveness = poll, lag_warn, liveness
        # Every shadow answered at start (the session seeded or restored them).
        now = time.monotonic()
        self.views = [ShadowView(last_ok=now, seeded=True) for _ in self.addrs]
        #: The first iteration not protected while protection is lost, else None.
        self.unprotected_since: int | None = None
        self._consistent: int | None = None  # the last newest_consistent while protected
        self.lost = 0  # times protection was lost
        self.reseeding: dict[int, Any] = {}  # slot -> ReseedSender
        self._offered: dict[int, float] = {}
        self.reseeds_started = 0
        self.sibling_reseeds = 0  # of those, taken from a sibling replica
        #: partitions down to their last current replica (rank 0 has said so once)
        self._last_one: set[int] = set()
        self._clients = [ShadowClient(a, timeout=min(STATUS_TIMEOUT, liveness / 2))
                         for a in self.addrs]
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
        last = time.monotonic()
        while not self._stop.wait(min(self.poll, FAST_POLL)):
            now = time.monotonic()
            if now - last >= self.poll:
                last = now
                self.poll_once()
            else:
                troubled = self._troubled()
                if troubled:
                    with self._polling:
                        self._poll(troubled)

    def _troubled(self) -> list[int]:
        """Shadows polled every FAST_POLL instead of every ``poll``: unreachable, or
        answering without state and not being re-seeded. A restarted shadow's re-seed then
        starts within FAST_POLL of its service answering, not at the next regular poll."""
        with self._lock:
            return [i for i, v in enumerate(self.views)
                    if not v.reachable or (not v.seeded and not v.active
                                           and i not in self.reseeding)]

    def poll_once(self) -> None:
        with self._polling:
            self._poll()

    def _poll(self, only: list[int] | None = None) -> None:
        done = self.sess.done_iteration
        for i, c in enumerate(self._clients):  # every slot: each replica of each partition
            if only is not None and i not in only:
                continue
            v = self.views[i]
            try:
                st = c.request({"op": "status", "progress": done})[0]
            except CheckmateError as e:
                with self._lock:
                    v.reachable, v.error = False, str(e)
                self._liveness()
                continue
            rs = st.get("reseed") or {}
            with self._lock:
                v.reachable, v.error = True, ""
                v.last_ok, v.done_at = time.monotonic(), self.sess.done_iteration
                v.latest, v.seeded = st.get("latest"), bool(st.get("seeded"))
                check = st.get("state_check") or {}
                v.verified, v.diverged = check.get("verified_iteration"), \
                    str(check.get("diverged") or "")
                v.wanted, v.active = str(rs.get("wanted") or ""), bool(rs.get("active"))
                v.peers, v.reseeds = bool(st.get("peers")), int(rs.get("count") or 0)
            try:
                self._act(i, v, done)
            except CheckmateError as e:
                v.error = str(e)
            self._liveness()

    # ------------------------------------------------------------------ liveness
    def down(self, i: int, now: float | None = None) -> bool:
        """No answer from the shadow of slot ``i`` for ``liveness`` seconds (dead,
        unreachable, silent)."""
        now = time.monotonic() if now is None else now
        return now - self.views[i].last_ok > self.liveness

    def _name(self, i: int) -> str:
        """Slot ``i`` as a line names it: "shadow of partition P[ replica K]"."""
        p, k = i % self.parts, i // self.parts
        rep = f" replica {k}" if self.replicas > 1 else ""
        return f"shadow of partition {p}{rep}"

    def _where(self, i: int) -> str:
        return f"{self._name(i)} ({self.addrs[i][0]}:{self.addrs[i][1]})"

    def _problem(self, i: int, now: float) -> str:
        """Why slot ``i`` does not hold the newest iterations ("" when it does)."""
        v, since = self.views[i], self.unprotected_since
        if self.down(i, now):
            return (f"{self._where(i)} has not answered for {now - v.last_ok:.1f}s"
                    + (f" ({v.error})" if v.error else ""))
        if not v.seeded or v.active or v.wanted or i in self.reseeding:
            return (f"{self._where(i)} holds no current state (re-seed "
                    f"{'running' if v.active or i in self.reseeding else 'needed'})")
        if since is not None and (v.latest is None or v.latest < since):
            return f"{self._where(i)} holds iteration {v.latest}, not yet {since}"
        return ""

    def _reseed(self, i: int, v: ShadowView) -> None:
        """Give slot ``i``'s shadow a state while training runs: from a current sibling
        replica when it is empty and has one (shadow.sibling: the trainers send nothing),
        else live from the trainers."""
        p, what = i % self.parts, self._name(i)
        sibling = self._sibling(i) if not v.seeded and not v.wanted else None
        if sibling is not None:
            got = self._clients[i].request({"op": "adopt",
                                            "from": list(self.addrs[sibling])})[0]
            if got.get("started"):
                self.sibling_reseeds += 1
                log.warning("checkmate: re-seeding the %s from its sibling replica %d (the "
                            "trainers send nothing)", what, sibling // self.parts)
            return
        reason = v.wanted or "shadow restarted without state"
        self.reseeding[i] = self.sess.new_reseed(p, reason, self.addrs[i])
        self.reseeds_started += 1
        alone = " from the trainers (no current sibling replica)" if self.replicas > 1 else ""
        log.warning("checkmate: re-seeding the %s%s while training runs (%s)", what, alone,
                    reason)

    def _sibling(self, i: int) -> int | None:
        """A current replica of slot ``i``'s partition other than ``i`` (None: none)."""
        return next((j for j in self.current(i % self.parts) if j != i), None)

    def _slots(self, p: int) -> range:
        return range(p, self.parts * self.replicas, self.parts)

    def current(self, p: int, now: float | None = None) -> list[int]:
        """The slots of partition ``p`` whose shadow holds the newest iterations."""
        now = time.monotonic() if now is None else now
        return [i for i in self._slots(p) if not self._problem(i, now)]

    def _why_unprotected(self, now: float) -> list[str]:
        """Why the newest iterations are not being checkpointed ([] when they are): the
        partitions none of whose replicas is current, each replica's reason. While
        protection is lost it returns only once some replica of every partition holds an
        iteration at or after the first uncovered one (a shadow back from disk holds an
        older one until it is re-seeded or catches up)."""
        out = []
        for p in range(self.parts):
            probs = [self._problem(i, now) for i in self._slots(p)]
            if all(probs):
                out += probs
        return out

    def _newest(self, p: int, now: float) -> int | None:
        """The newest iteration a current replica of partition ``p`` committed."""
        got = [self.views[i].latest for i in self.current(p, now)]
        return max((x for x in got if x is not None), default=None) if got else None

    def _liveness(self) -> None:
        """Track loss and return of protection; rank 0 prints one line for each, and one
        when a partition is down to its last current replica (and when it is not)."""
        now = time.monotonic()
        with self._lock:
            why = self._why_unprotected(now)
            if not why:
                latests = [self._newest(p, now) for p in range(self.parts)]
                self._consistent = min(latests) if None not in latests else None
            if why and self.unprotected_since is None:
                self.unprotected_since = (self._consistent or 0) + 1
                self.lost += 1
                lost: tuple[int, str] | None = (self.unprotected_since, "; ".join(why))
                back = None
            elif not why and self.unprotected_since is not None:
                back = (self.unprotected_since, self._consistent)
                self.unprotected_since, lost = None, None
            else:
                lost = back = None
            thin, thick = [], []
            if self.replicas > 1:
                for p in range(self.parts):
                    n = len(self.current(p, now))
                    if n == 1 and p not in self._last_one:
                        self._last_one.add(p)
                        thin.append(p)
                    elif n > 1 and p in self._last_one:
                        self._last_one.discard(p)
                        thick.append((p, n))
        if self.rank != 0:
            return
        if lost is not None:
            log.warning("checkmate: UNPROTECTED since iteration %d: %s", *lost)
        if back is not None:
            log.warning("checkmate: protected again: every shadow answers and holds iteration "
                        "%s or newer (unprotected from iteration %d)", back[1], back[0])
        for p in thin:
            log.warning("checkmate: partition %d is down to its last current replica of %d: "
                        "%s", p, self.replicas, "; ".join(
                            x for x in (self._problem(i, now) for i in self._slots(p)) if x))
        for p, n in thick:
            log.warning("checkmate: partition %d has %d current replicas again", p, n)

    def _act(self, i: int, v: ShadowView, done: int) -> None:
        sess = self.sess
        p = i % self.parts
        if self.rank == 0 and not v.peers:
            self._clients[i].request(sess.peers_body(p))
        mine = i % self.world == self.rank
        cur = self.reseeding.get(i)
        if cur is not None and cur.finished:
            del self.reseeding[i]
            cur = None
        need = (not v.seeded and not v.active) or bool(v.wanted)
        if mine and need and cur is None and sess.model is not None and (
                v.wanted or time.monotonic() - self._offered.get(i, -1e9) >= RESEED_RETRY):
            self._offered[i] = time.monotonic()
            self._reseed(i, v)
        if self.rank == 0:
            lag = self.lag(i, done)
            if lag is not None and lag > self.lag_warn and not v.warned:
                v.warned = True
                log.warning("checkmate: %s lags %d iterations (committed %s, trainers at "
                            "%d)%s", self._name(i), lag, v.latest, done,
                            f": {v.wanted}" if v.wanted else "")
            elif v.warned and lag is not None and lag <= self.lag_warn:
                v.warned = False
                log.warning("checkmate: %s caught up (committed %s)",
                            self._name(i), v.latest)

    # ------------------------------------------------------------------ training thread
    def capture(self, iteration: int, step: int) -> None:
        """After each optimizer step: one slice for every re-seed this rank is sending."""
        for r in list(self.reseeding.values()):
            if r.capturing:
                r.capture(iteration, step)

    # ------------------------------------------------------------------ reading
    def lag(self, i: int, done: int | None = None) -> int | None:
        """Iterations the shadow of slot ``i`` was behind when it last answered (the
        trainers' iteration then minus its newest commit); None while it is down. ``done``
        is ignored: the lag is measured at the answer, not against a later iteration."""
        v = self.views[i]
        if not v.reachable or self.down(i):
            return None
        return v.done_at - (v.latest if v.latest is not None and v.seeded else 0)

    def _view(self, i: int, now: float) -> dict[str, Any]:
        v = self.views[i]
        up = not self.down(i, now)
        return {"latest": v.latest if v.seeded and up else None,
                "lag": self.lag(i), "reachable": v.reachable and up,
                "up": up, "silent_seconds": round(now - v.last_ok, 3),
                "reseeding": v.active or i in self.reseeding,
                "wanted": v.wanted, "error": v.error,
                "verified": v.verified, "diverged": v.diverged}

    def protection(self) -> dict[str, Any]:
        """Per partition its shadow's view (with several replicas: its newest current
        replica's, every replica's under ``replicas`` and how many are ``current``)."""
        done = self.sess.done_iteration
        now = time.monotonic()
        with self._lock:
            shadows = {}
            for p in range(self.parts):
                cur = self.current(p, now)
                views = [self._view(i, now) for i in self._slots(p)]
                if self.replicas == 1:
                    shadows[p] = views[0]
                    continue
                best = max(cur, key=lambda i: self.views[i].latest or 0, default=p)
                shadows[p] = {**self._view(best, now), "current": len(cur),
                              "replicas": views}
            why = self._why_unprotected(now)
            latests = [s["latest"] for s in shadows.values()]
            checked = [s["verified"] for s in shadows.values()]
            since = self.unprotected_since
            if why and since is None:  # lost since the last poll: say so before the poller
                since = (self._consistent or 0) + 1
        return {"iteration": done,
                "newest_consistent": (min(latests) if latests and None not in latests
                                      else None),
                "protected_now": not why, "unprotected_since": since if why else None,
                "unprotected_why": why, "protection_lost": self.lost,
                "verified": min(checked) if checked and None not in checked else None,
                "shadows": shadows, "reseeds": self.reseeds_started,
                **({"sibling_reseeds": self.sibling_reseeds} if self.replicas > 1 else {})}
