"""Per-iteration assembly of a partition's gradient and its control message.

Owned by the receive thread (no locks on the hot path). Each open iteration has an fp32
staging buffer the size of the partition and coverage sets for gradient elements and
control bytes. An iteration is complete when every element of the partition and every byte
of its control message arrived; complete iterations are handed to the stepper strictly in
order. If an older iteration stays incomplete while newer ones keep arriving for longer than
``gap_timeout`` seconds, the gap (iteration and missing ranges) is reported once: logged,
counted and kept for ``status`` -- never waited on silently.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from checkmate import wire
from checkmate.shadow.intervals import IntervalSet

log = logging.getLogger("checkmate.shadow")

#: Largest control message accepted (JSON with base64 buffers).
MAX_CONTROL = 64 << 20


@dataclass
class Control:
    """A parsed, validated per-iteration control message."""

    iteration: int
    lrs: list[float]
    clip_coef: float | None
    skip: bool
    buffers: dict[str, str]
    extra: dict[str, Any]


@dataclass
class _Iter:
    staging: np.ndarray
    u32: np.ndarray
    raw: memoryview
    first_seen: float
    cov: IntervalSet = field(default_factory=IntervalSet)
    ctrl_len: int = -1
    ctrl_buf: bytearray | None = None
    ctrl_cov: IntervalSet = field(default_factory=IntervalSet)
    control: Control | None = None
    ctrl_error: str = ""
    gap_reported: bool = False


def parse_control(data: bytes, iteration: int, groups: int) -> Control:
    """Validate a control message body; ValueError says what is wrong."""
    body = json.loads(data)
    if not isinstance(body, dict):
        raise ValueError("control message is not a JSON object")
    if body.get("iteration") != iteration:
        raise ValueError(f"control body says iteration {body.get('iteration')!r}, "
                         f"header says {iteration}")
    lrs = body.get("lrs")
    if (not isinstance(lrs, list) or len(lrs) != groups or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            for x in lrs)):
        raise ValueError(f"control lrs must be {groups} finite numbers, got {lrs!r}")
    clip = body.get("clip_coef")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                             or not math.isfinite(clip)):
        raise ValueError(f"control clip_coef must be a number or null, got {clip!r}")
    skip = body.get("skip", False)
    if not isinstance(skip, bool):
        raise ValueError("control skip must be true or false")
    buffers = body.get("buffers") or {}
    extra = body.get("extra") or {}
    if not isinstance(buffers, dict) or not isinstance(extra, dict):
        raise ValueError("control buffers and extra must be objects")
    return Control(iteration, [float(x) for x in lrs],
                   None if clip is None else float(clip), skip, buffers, extra)


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
    ) -> None:
        self.start, self.end, self.size = start, end, end - start
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

    # ----- buffers ----------------------------------------------------------------------
    def release(self, staging: np.ndarray) -> None:
        """Return a staging buffer (any thread; deque append is atomic)."""
        self.free.append(staging)

    def _open(self, it: int) -> _Iter:
        try:
            stg = self.free.pop()
        except IndexError:
            stg = np.empty(self.size, dtype=np.float32)
        st = _Iter(stg, stg.view(np.uint32), memoryview(stg).cast("B"), time.monotonic())
        self.open[it] = st
        return st

    def request_reset(self, committed: int) -> None:
        """From another thread: drop everything open and continue after ``committed``."""
        self._reset_to = committed

    def _apply_reset(self) -> None:
        it, self._reset_to = self._reset_to, None
        for st in self.open.values():
            self.free.append(st.staging)
        self.open.clear()
        self.committed = it
        self.next_dispatch = it + 1

    # ----- placement --------------------------------------------------------------------
    def _admit(self, it: int) -> _Iter | None:
        if self._reset_to is not None:
            self._apply_reset()
        if it < self.next_dispatch:
            self.drops["stale"] += 1
            return None
        if it > self.committed + self.window:
            self.drops["window"] += 1
            return None
        st = self.open.get(it)
        return st if st is not None else self._open(it)

    def place(self, it: int, offset: int, count: int, dtype: int, payload: memoryview) -> None:
        """Place gradient elements [offset, offset+count) (global) from ``payload``."""
        st = self._admit(it)
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
        st = self._admit(it)
        if st is None:
            return
        if total <= 0 or total > MAX_CONTROL or offset + count > total:
            self.drops["control_range"] += 1
            return
        if st.ctrl_buf is None:
            st.ctrl_len, st.ctrl_buf = total, bytearray(total)
        elif st.ctrl_len != total:
            self.drops["control_range"] += 1
            return
        new = st.ctrl_cov.add(offset, offset + count)
        if not new:
            self.drops["duplicate"] += 1
            return
        for s, e in new:
            st.ctrl_buf[s:e] = payload[s - offset:e - offset]
        if st.ctrl_cov.total == total and st.control is None:
            try:
                st.control = parse_control(bytes(st.ctrl_buf), it, self.groups)
            except ValueError as e:
                st.ctrl_error = str(e)
                self.drops["control_invalid"] += 1
                log.warning("iteration %d: bad control message: %s", it, e)
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
