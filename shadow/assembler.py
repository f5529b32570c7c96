"""Per-iteration assembly of a partition's gradient and its control message.

Owned by the receive thread (no locks on the hot path). Each open iteration has an fp32
staging buffer the size of the partition and coverage sets for gradient elements and
control bytes. An iteration is complete when every element of the partition and every byte
of its control message arrived; complete iterations are handed to the stepper strictly in
order. A hole (missing elements, a missing or invalid control message) is repaired: once
there is evidence that the senders are done with an iteration (a newer iteration arrives,
its control message arrived, or the trainers report they passed it) and nothing new
arrived for it for ``REPAIR_DELAY`` seconds, exactly the missing ranges are asked of the
trainers (checkmate.shadow.repair), again with exponential backoff until they arrive. A
trainer that no longer retains the iteration answers "gone": the shadow then asks to be
re-seeded (``reseed_wanted``), as it does when the oldest iteration is not repaired within
``REPAIR_ESCALATE`` seconds; from then on it sends no repair requests (the re-seed fixes
it), nor while nothing was heard from the trainers for ``TRAINERS_GONE`` seconds. If an
older iteration stays incomplete while newer ones keep
arriving for longer than ``gap_timeout`` seconds, the gap (iteration and missing ranges) is
also reported once: logged, counted and kept for ``status`` -- never waited on silently.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from checkmate.protocol import wire
from checkmate.protocol.datamac import CONTROL_MAC, control_mac
from checkmate.ratelog import RateLimitedLog
from checkmate.shadow.control_message import MAX_CONTROL, Control, parse_control
from checkmate.shadow.intervals import IntervalSet

log = logging.getLogger("checkmate.shadow")

#: Seconds without progress on an iteration, once the senders are known to be done with it,
#: before its holes are asked for (the receive thread lingers 5 ms between batches).
REPAIR_DELAY = 0.01
#: Seconds without progress before asking even without evidence that the senders are done
#: (the last iteration of a job has no newer one behind it).
REPAIR_IDLE = 1.0
#: Longest wait between two requests for the same iteration.
REPAIR_MAX_BACKOFF = 0.5
#: Oldest pending iterations looked at per tick.
REPAIR_SCAN = 8
#: Seconds the oldest pending iteration may stay under repair before the shadow gives up on
#: repair and asks to be re-seeded (a fault that drops every answer for it would otherwise
#: stall the partition for good).
REPAIR_ESCALATE = 5.0
#: Seconds without a datagram or a progress report from the trainers after which they are
#: taken to be gone: repair requests pause until something is heard again.
TRAINERS_GONE = 5.0
#: Seconds an incomplete control message may go without a new byte before it is forgotten
#: (``control_expired``) and asked for whole again: bytes held that can never complete
#: (another length, a message of a fragment that will not come) cannot pin the iteration.
CONTROL_EXPIRE = 1.0


@dataclass


class _Iter:
    staging: np.ndarray
    u32: np.ndarray
    raw: memoryview
    first_seen: float
    u8: np.ndarray | None = None  # the staging bytes, for compiled copies (shadow.ingest)
    cov: IntervalSet = field(default_factory=IntervalSet)
    ctrl_len: int = -1
    ctrl_buf: bytearray | None = None
    ctrl_cov: IntervalSet = field(default_factory=IntervalSet)
    control: Control | None = None
    ctrl_error: str = ""
    ctrl_at: float = 0.0  # when the last new control byte arrived
    gap_reported: bool = False
    # Progress seen by the last tick (covered elements + control bytes) and when it changed;
    # measured in tick() so the per-datagram path pays nothing for it.
    seen: int = 0
    last_progress: float = 0.0
    repair_tries: int = 0
    repair_next: float = 0.0
    repair_first: float = 0.0  # when it was first asked for


class Assembler:
    """Staging and completion tracking for one partition [start, end)."""

    def __init__(
        self,
        start: int,
        end: int,
        groups: int,
        on_complete: Callable[[int, np.ndarray, Control], None],
        drops: Counter,
        window: int = 8,
        gap_timeout: float = 2.0,
        max_gaps: int = 32,
        job: int = 0,
        control_key: bytes | None = None,
        control_limit: int = MAX_CONTROL,
        buffers: dict[str, int] | None = None,
    ) -> None:
        self.start, self.end, self.size = start, end, end - start
        self.job, self.control_key = job, control_key
        #: Longest control message the spec allows (control_message.control_limit) and its
        #: buffers' sizes: bigger messages and unknown buffers are refused.
        self.control_limit, self.buffers = control_limit, buffers
        self._bad_log = RateLimitedLog(log.warning)
        self.groups = groups
        self.on_complete = on_complete
        self.drops = drops
        self.window = window
        self.gap_timeout = gap_timeout
        self.open: dict[int, _Iter] = {}
        self.next_dispatch = 1
        #: Last iteration the stepper committed; written by the stepper thread.
        self.committed = 0
        self.free: deque[np.ndarray] = deque()
        self.gaps: deque[dict[str, Any]] = deque(maxlen=max_gaps)
        self.gap_count = 0
        self.placed_bytes = 0
        self._reset_to: int | None = None
        #: Newest iteration any valid datagram was seen for (window drops included), when it
        #: last grew, and the newest iteration the trainers said they finished.
        self.newest_seen = 0
        self.newest_seen_at = 0.0
        self.known_done = 0
        #: When anything was last heard from the trainers (a new iteration, a datagram past
        #: the window, a progress report); and whether repair is paused for their silence.
        self.heard_at = time.monotonic()
        self.repair_paused = False
        self.repair: Any = None  # checkmate.shadow.repair.RepairRequester, set by the node
        #: Why this partition cannot be repaired and must be re-seeded ("" while it can), and
        #: who to tell (the state cancels a live re-seed that can no longer complete).
        self.reseed_wanted = ""
        self.on_wanted: Callable[[str], None] | None = None

    # ----- buffers ----------------------------------------------------------------------
    def release(self, staging: np.ndarray) -> None:
        """Return a staging buffer (any thread; deque append is atomic)."""
        self.free.append(staging)

    def _open(self, it: int) -> _Iter:
        try:
            stg = self.free.pop()
        except IndexError:
            stg = np.empty(self.size, dtype=np.float32)
        now = time.monotonic()
        st = _Iter(stg, stg.view(np.uint32), memoryview(stg).cast("B"), now, stg.view(np.uint8),
                   last_progress=now)
        self.open[it] = st
        return st

    def _seen(self, it: int) -> None:
        if it > self.newest_seen:
            self.newest_seen = it
            self.newest_seen_at = self.heard_at = time.monotonic()

    def forget_open(self) -> None:
        """Drop every iteration being assembled (its bytes may be of a run that ended, or
        half-placed by a receive loop that failed); repair asks for them again. Caller holds
        the receiver's lock (this thread owns the assembler)."""
        for it in list(self.open):
            self.free.append(self.open.pop(it).staging)

    def request_reset(self, committed: int) -> None:
        """From another thread: drop everything open and continue after ``committed``."""
        self._reset_to = committed

    def _apply_reset(self) -> None:
        # Iterations after the new state are still the right gradients: keep what arrived.
        it, self._reset_to = self._reset_to, None
        for i in [i for i in self.open if i <= it]:
            self.free.append(self.open.pop(i).staging)
        self.committed = it
        self.next_dispatch = it + 1
        self.reseed_wanted = ""
        self._dispatch()

    # ----- placement --------------------------------------------------------------------
    def admit(self, it: int, n: int = 1) -> _Iter | None:
        """The open state of iteration ``it`` (opened if new) for ``n`` pieces about to be
        placed, or None with all ``n`` counted as dropped (stale or past the window)."""
        if self._reset_to is not None:
            self._apply_reset()
        if it < self.next_dispatch:
            self.drops["stale"] += n
            return None
        if it > self.committed + self.window:
            # Dropped, so it must not count as seen either: an iteration number from a
            # datagram the shadow refuses would make it open (and ask repairs for) every
            # iteration up to it. Trainers far ahead are known from their progress reports.
            self.drops["window"] += n
            self.heard_at = time.monotonic()  # trainers ahead: alive (an uncommon path)
            return None
        if it > self.newest_seen:
            self._seen(it)
        st = self.open.get(it)
        return st if st is not None else self._open(it)

    def place(self, it: int, offset: int, count: int, dtype: int, payload: memoryview) -> None:
        """Place gradient elements [offset, offset+count) (global) from ``payload``."""
        st = self.admit(it)
        if st is None:
            return
        a = offset - self.start
        new = st.cov.add(a, a + count)
        if not new:
            self.drops["duplicate"] += 1
            return
        if dtype == 0:  # float32: a plain byte copy, the common case
            if len(new) == 1 and new[0][0] == a and new[0][1] == a + count:
                st.raw[4 * a:4 * (a + count)] = payload
                self.placed_bytes += 4 * count
                if st.cov.total == self.size and st.control is not None \
                        and it == self.next_dispatch:
                    self._dispatch()
                return
            raw = st.raw
            for s, e in new:
                raw[4 * s:4 * e] = payload[4 * (s - a):4 * (e - a)]
        elif dtype == wire.DType.BFLOAT16:
            src = np.frombuffer(payload, dtype="<u2")
            for s, e in new:
                dst = st.u32[s:e]
                dst[:] = src[s - a:e - a]
                dst <<= 16
        else:
            src = np.frombuffer(payload, dtype="<f2")
            for s, e in new:
                st.staging[s:e] = src[s - a:e - a]
        for s, e in new:
            self.placed_bytes += 4 * (e - s)
        if st.cov.total == self.size and st.control is not None and it == self.next_dispatch:
            self._dispatch()

    def place_control(self, it: int, offset: int, count: int, total: int,
                      payload: memoryview) -> None:
        """Place control bytes [offset, offset+count) of a message of ``total`` bytes."""
        st = self.admit(it)
        if st is None:
            return
        if (total <= CONTROL_MAC or total > self.control_limit or count <= 0
                or offset + count > total):
            self.drops["control_range"] += 1
            return
        if st.control is not None:
            self.drops["duplicate"] += 1
            return
        if st.ctrl_buf is None:
            # Reserved only for a fragment whose tag verified (the receiver checked it), and
            # at most the spec's bound: a forged fragment reserves nothing.
            st.ctrl_len, st.ctrl_buf = total, bytearray(total)
        elif st.ctrl_len != total:
            self.drops["control_range"] += 1
            return
        new = st.ctrl_cov.add(offset, offset + count)
        if not new:
            self.drops["duplicate"] += 1
            return
        st.ctrl_at = time.monotonic()
        for s, e in new:
            st.ctrl_buf[s:e] = payload[s - offset:e - offset]
        if st.ctrl_cov.total == total:
            data = bytes(st.ctrl_buf)
            st.ctrl_len, st.ctrl_buf, st.ctrl_cov = -1, None, IntervalSet()
            if self.control_key is not None:
                body, mac = data[:-CONTROL_MAC], data[-CONTROL_MAC:]
                if not hmac.compare_digest(mac, control_mac(self.control_key, self.job, it,
                                                            body)):
                    # Not from a trainer (or changed on the way): forgotten, as a bad one.
                    self.drops["control_mac"] += 1
                    self._bad_log(f"iteration {it}: control message MAC does not verify")
                    return
                data = body
            try:
                st.control = parse_control(data, it, self.groups, self.buffers)
            except Exception as e:  # noqa: BLE001 - no input may end the receive thread
                # Forgotten, so a correct copy (a resend or a repair) is taken in.
                st.ctrl_error = f"{type(e).__name__}: {e}"[:200]
                self.drops["control_invalid"] += 1
                self._bad_log(f"iteration {it}: bad control message: {st.ctrl_error}")
                return
            if st.cov.total == self.size and it == self.next_dispatch:
                self._dispatch()

    def _dispatch(self) -> None:
        """Hand complete iterations to the stepper, oldest first, without skipping any."""
        while True:
            st = self.open.get(self.next_dispatch)
            if st is None or st.control is None or st.cov.total != self.size:
                return
            it = self.next_dispatch
            del self.open[it]
            self.next_dispatch = it + 1
            self.on_complete(it, st.staging, st.control)

    # ----- repair -----------------------------------------------------------------------
    def note_done(self, iteration: int) -> None:
        """The trainers finished ``iteration`` (from their status polls): evidence for repair.

        Also counts as seen: a shadow that received nothing of an iteration still asks.
        """
        self.heard_at = time.monotonic()
        if iteration > self.known_done:
            self.known_done = iteration
        if iteration > self.newest_seen:
            self._seen(iteration)

    def on_gone(self, it: int) -> None:
        """A trainer no longer retains ``it``: this partition needs a re-seed."""
        if it >= self.next_dispatch:
            self._want_reseed(f"iteration {it} is missing and no longer retained by the "
                              "trainers")

    def want_reseed(self, reason: str) -> None:
        """Ask the trainers for a re-seed (from any thread: one string assignment)."""
        self._want_reseed(reason)

    def _want_reseed(self, reason: str) -> None:
        if not self.reseed_wanted:
            self.reseed_wanted = reason
            log.error("partition needs a re-seed: %s", reason)
            if self.on_wanted is not None:
                self.on_wanted(reason)

    def tick(self, now: float | None = None) -> float:
        """Gap reports and repair requests; returns seconds until the next tick is useful."""
        if self._reset_to is not None:
            self._apply_reset()
        now = time.monotonic() if now is None else now
        wait = 0.1
        self._expire_control(now)
        if self.repair is not None:
            wait = min(wait, self._request_repairs(now))
        self.check_gaps(now)
        return wait

    def _expire_control(self, now: float) -> None:
        """Forget incomplete control messages that made no progress for CONTROL_EXPIRE
        seconds (repair then asks for the whole message again)."""
        for it, st in self.open.items():
            if st.ctrl_buf is not None and now - st.ctrl_at > CONTROL_EXPIRE:
                st.ctrl_len, st.ctrl_buf, st.ctrl_cov = -1, None, IntervalSet()
                st.repair_next = 0.0  # ask at once
                self.drops["control_expired"] += 1
                self._bad_log(f"iteration {it}: incomplete control message expired")

    def _request_repairs(self, now: float) -> float:
        if self.reseed_wanted:
            return 0.1  # repair gave up; the re-seed resets the assembler
        silent = now - self.heard_at
        if silent > TRAINERS_GONE:
            if not self.repair_paused and self.open:
                self.repair_paused = True
                log.warning("repair paused: nothing heard from the trainers for %.0fs",
                            silent)
            return 0.1
        if self.repair_paused:
            self.repair_paused = False
            log.warning("repair resumed: the trainers are heard again")
        horizon = max(self.newest_seen, self.known_done)
        wait = 0.1
        for it in range(self.next_dispatch, min(self.next_dispatch + REPAIR_SCAN,
                                                self.committed + self.window + 1)):
            if it > horizon:
                break
            st = self.open.get(it)
            if st is None:
                # Nothing of it arrived although newer iterations did: a whole hole.
                if now - self.newest_seen_at < REPAIR_DELAY:
                    wait = min(wait, REPAIR_DELAY)
                    continue
                st = self._open(it)
                st.last_progress = self.newest_seen_at
            if st.control is not None and st.cov.total == self.size:
                continue
            seen = st.cov.total + st.ctrl_cov.total
            if seen != st.seen:
                st.seen, st.last_progress = seen, now
            evidence = horizon > it or st.control is not None
            idle = now - st.last_progress
            due = REPAIR_DELAY if evidence else REPAIR_IDLE
            if idle < due:
                wait = min(wait, due - idle)
                continue
            if (it == self.next_dispatch and st.repair_tries
                    and now - st.repair_first > REPAIR_ESCALATE):
                self._want_reseed(f"iteration {it} not repaired within {REPAIR_ESCALATE:g}s "
                                  f"({st.repair_tries} requests)")
                return 0.1
            if now < st.repair_next:
                wait = min(wait, st.repair_next - now)
                continue
            missing = [(self.start + a, self.start + b)
                       for a, b in st.cov.missing(0, self.size)]
            self.repair.request(it, missing, st.control is None, st.repair_tries)
            if not st.repair_tries:
                st.repair_first = now
            st.repair_tries += 1
            backoff = min(REPAIR_MAX_BACKOFF, REPAIR_DELAY * 2 ** st.repair_tries)
            st.repair_next = now + backoff
            wait = min(wait, backoff)
        return max(wait, 0.001)

    # ----- gaps -------------------------------------------------------------------------
    def check_gaps(self, now: float | None = None) -> None:
        """Report the oldest pending iteration once if newer ones arrive past the timeout."""
        if self._reset_to is not None:
            self._apply_reset()
        if not self.open:
            return
        now = time.monotonic() if now is None else now
        it = self.next_dispatch
        newer = [s.first_seen for i, s in self.open.items() if i > it]
        if not newer or now - min(newer) < self.gap_timeout:
            return
        st = self.open.get(it)
        if st is None:
            st = self._open(it)
        if st.gap_reported:
            return
        st.gap_reported = True
        missing = [[self.start + s, self.start + e] for s, e in st.cov.missing(0, self.size)]
        gap = {
            "iteration": it,
            "missing": missing[:64],
            "missing_elements": self.size - st.cov.total,
            "control": "ok" if st.control is not None else (st.ctrl_error or "missing"),
            "newest": max(self.open),
        }
        self.gaps.append(gap)
        self.gap_count += 1
        log.error("gap: iteration %d incomplete while iteration %d arrives: %d elements "
                  "missing %s, control %s", it, gap["newest"], gap["missing_elements"],
                  missing[:4], gap["control"])
