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
        self.addrs: list[Addr] = list(lay.shadow_tcp)
        self.poll, self.lag_warn, self.liveness = poll, lag_warn, liveness
        # Every shadow answered at start (the session seeded or restored them).
        now = time.monotonic()
        self.views = [ShadowView(last_ok=now, seeded=True) for _ in self.addrs]
        #: The first iteration not protected while protection is lost, else None.
        self.unprotected_since: int | None = None
        self._consistent: int | None = None  # the last newest_consistent while protected
        self.lost = 0  # times protection was lost
        self.reseeding: dict[int, Any] = {}  # partition -> ReseedSender
        self._offered: dict[int, float] = {}
        self.reseeds_started = 0
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
            return [p for p, v in enumerate(self.views)
                    if not v.reachable or (not v.seeded and not v.active
                                           and p not in self.reseeding)]

    def poll_once(self) -> None:
        with self._polling:
            self._poll()

    def _poll(self, only: list[int] | None = None) -> None:
        done = self.sess.done_iteration
        for p, c in enumerate(self._clients):
            if only is not None and p not in only:
                continue
            v = self.views[p]
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
                self._act(p, v, done)
            except CheckmateError as e:
                v.error = str(e)
            self._liveness()

    # ------------------------------------------------------------------ liveness
    def down(self, p: int, now: float | None = None) -> bool:
        """No answer from shadow ``p`` for ``liveness`` seconds (dead, unreachable, silent)."""
        now = time.monotonic() if now is None else now
        return now - self.views[p].last_ok > self.liveness

    def _why_unprotected(self, now: float) -> list[str]:
        """Why the newest iterations are not being checkpointed ([] when they are). While
        protection is lost it returns only once every shadow holds an iteration at or after
        the first uncovered one (a shadow back from disk holds an older one until it is
        re-seeded or catches up)."""
        since = self.unprotected_since
        out = []
        for p, v in enumerate(self.views):
            where = f"shadow of partition {p} ({self.addrs[p][0]}:{self.addrs[p][1]})"
            if self.down(p, now):
                out.append(f"{where} has not answered for {now - v.last_ok:.1f}s"
                           + (f" ({v.error})" if v.error else ""))
            elif not v.seeded or v.active or v.wanted or p in self.reseeding:
                out.append(f"{where} holds no current state (re-seed "
                           f"{'running' if v.active or p in self.reseeding else 'needed'})")
            elif since is not None and (v.latest is None or v.latest < since):
                out.append(f"{where} holds iteration {v.latest}, not yet {since}")
        return out

    def _liveness(self) -> None:
        """Track loss and return of protection; rank 0 prints one line for each."""
        now = time.monotonic()
        with self._lock:
            why = self._why_unprotected(now)
            if not why:
                latests = [v.latest for v in self.views]
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
        if self.rank != 0:
            return
        if lost is not None:
            log.warning("checkmate: UNPROTECTED since iteration %d: %s", *lost)
        if back is not None:
            log.warning("checkmate: protected again: every shadow answers and holds iteration "
                        "%s or newer (unprotected from iteration %d)", back[1], back[0])

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
    def lag(self, p: int, done: int | None = None) -> int | None:
        """Iterations shadow ``p`` was behind when it last answered (the trainers' iteration
        then minus its newest commit); None while it is down. ``done`` is ignored: the lag is
        measured at the answer, not against a later iteration."""
        v = self.views[p]
        if not v.reachable or self.down(p):
            return None
        return v.done_at - (v.latest if v.latest is not None and v.seeded else 0)

    def protection(self) -> dict[str, Any]:
        done = self.sess.done_iteration
        now = time.monotonic()
        with self._lock:
            shadows = {}
            for p, v in enumerate(self.views):
                up = not self.down(p, now)
                shadows[p] = {"latest": v.latest if v.seeded and up else None,
                              "lag": self.lag(p), "reachable": v.reachable and up,
                              "up": up, "silent_seconds": round(now - v.last_ok, 3),
                              "reseeding": v.active or p in self.reseeding,
                              "wanted": v.wanted, "error": v.error,
                              "verified": v.verified, "diverged": v.diverged}
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
                "shadows": shadows, "reseeds": self.reseeds_started}
