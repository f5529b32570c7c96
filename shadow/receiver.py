"""The shadow's UDP receive thread: validate each ckm datagram, place it, drop the rest.

Datagrams are taken in batches with recvmmsg (checkmate.shadow.mmsg) and each batch is
validated in one compiled call (checkmate.shadow.ingest; Python then works per run of
contiguous pieces, not per datagram). It only receives,
validates and copies into staging (checkmate.shadow.assembler); the
optimizer step and persistence run in other threads, so receive never waits on them. Every
datagram that is not accepted is counted under one reason: short, magic, version, flags,
mac, job, epoch, token, length, crc, not_ready, dtype, partition, range, stale, window,
duplicate, control_range, control_invalid, control_mac. Every datagram but a control
fragment must carry the tag checkmate.protocol.datamac derives from the job secret (checked
in the same compiled call); a control message is checked whole by the assembler.

Datagrams flagged PARITY (the FEC parity of earlier versions) are dropped under ``flags``.
Repair answers from trainers (flag ACK,
checkmate.protocol.repair) are checked exactly like copies
from the switch and counted in ``repair["answers"]``; a "gone" answer (ACK | NACK) marks the
partition as needing a re-seed. The same thread sends the repair requests (Assembler.tick)
whenever the socket is idle or the next request falls due.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from checkmate.control.pfc import mark_ckm
from checkmate.protocol import wire
from checkmate.shadow import ingest
from checkmate.shadow.assembler import Assembler
from checkmate.shadow.mmsg import BatchReceiver
from checkmate.shadow.osname import name_thread

log = logging.getLogger("checkmate.shadow")

#: Receive buffer size asked for; the kernel may grant less (reported in status).
RCVBUF = 256 << 20
#: While datagrams trickle in, sleep this long whenever the queue runs dry, so the next
#: recvmmsg takes many datagrams at once. Waking per poll() took ~3 datagrams per wake-up
#: (114 wake-ups per training iteration per shadow); on a machine where shadows share cores
#: with trainers each wake-up can preempt a trainer in the middle of its ring hop. The shadow
#: is off the training path, so a few ms of extra delay cost nothing.
LINGER = 0.005
#: Linger only with a receive buffer that holds LINGER seconds at ~1 GB/s with room to spare
#: (a small unprivileged buffer would overflow and drop datagrams instead).
LINGER_MIN_RCVBUF = 32 << 20
#: A call that returns fewer datagrams than this is a trickle too (see the loop).
LINGER_BATCH = 8
_MAXDGRAM = 65536
#: Failures of the receive loop tolerated (each restarts it) within RESTART_WINDOW seconds.
RESTARTS = 5
RESTART_WINDOW = 60.0
_GRAD_DTYPE = {"float32": wire.DType.FLOAT32, "bfloat16": wire.DType.BFLOAT16,
               "float16": wire.DType.FLOAT16}
# Fewest seconds between two assembler ticks while datagrams stream in (bounds its CPU).
MIN_TICK = 0.002
_SIZES = {int(k): v for k, v in wire.DTYPE_SIZE.items()}


def open_socket(bind: str, port: int, rcvbuf: int = RCVBUF) -> tuple[socket.socket, int]:
    """A bound UDP socket with the largest receive buffer the kernel grants."""
    s = mark_ckm(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))  # acks/nacks it sends
    # SO_RCVBUFFORCE (33 on Linux; not exported by Python) passes rmem_max with CAP_NET_ADMIN.
    for opt in (getattr(socket, "SO_RCVBUFFORCE", 33), socket.SO_RCVBUF):
        try:
            s.setsockopt(socket.SOL_SOCKET, opt, rcvbuf)
            break
        except OSError:
            continue
    try:
        s.bind((bind, port))
    except OSError as e:
        s.close()
        from checkmate.errors import CheckmateError

        raise CheckmateError(f"cannot bind UDP {bind}:{port}: {e.strerror or e}") from None
    granted = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    return s, granted


class Receiver:
    """Validates datagrams for one partition and feeds an :class:`Assembler`."""

    def __init__(self, sock: socket.socket, job: int, partition: int,
                 drops: Counter, epoch: int = 0, token: int = 0,
                 batch: int = 64, mac_key: tuple[int, int] | None = None) -> None:
        self.sock = sock
        #: checkmate.protocol.datamac key: every datagram but control fragments must carry its tag
        #: (None: no check -- only for measuring what the check costs).
        self.mac_key = mac_key
        self.job = job
        self.partition = partition
        self.epoch = epoch
        self.token = token
        self.drops = drops
        self.asm: Assembler | None = None  # set once the spec is known and state seeded
        self.grad_dtype = int(wire.DType.FLOAT32)
        self.received = 0
        #: Repair traffic: requests sent (by the assembler), answers and "gone" received.
        self.repair_stats: Counter = Counter()
        self.batch = batch
        #: What the compiled scan fills (checkmate.shadow.ingest), and its CRC32C function.
        self._batch = ingest.Batch(batch)
        self._crc_fn = ingest.crc_function()
        granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        self.linger = LINGER if granted >= LINGER_MIN_RCVBUF else 0.0
        self.wakeups = 0  # times the thread went to sleep and woke up (poll or linger)
        #: Assembler ticks (repair scheduling, gap reports) and the seconds spent in them:
        #: what a healthy stream pays for repair on the shadow's CPU.
        self.ticks = 0
        self.tick_seconds = 0.0
        #: Held while a batch is placed or the assembler ticks: another transport's thread
        #: (checkmate.shadow.verbs) places into the same assembler.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Health of the receive loop (see ``run``): restarts after a failure, the last
        #: failure, whether it gave up; ``on_fatal(line)`` is called when it does.
        self.restarts = 0
        self.last_error = ""
        self.failed = False
        self.on_fatal: Callable[[str], None] | None = None

    def attach(self, asm: Assembler, grad_dtype: str) -> None:
        self.grad_dtype = int(_GRAD_DTYPE[grad_dtype])
        self.asm = asm

    def set_session(self, epoch: int, token: int) -> None:
        self.epoch, self.token = epoch, token

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="shadow-recv", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def run(self) -> None:
        """The receive loop, restarted if it fails: an exception that escapes it (a bug,
        never bad input, which is counted and dropped) is logged with its traceback, counted
        (``receiver_crashed``, ``restarts`` in status), everything half-assembled is dropped
        (repair fetches it again, so a batch cut short cannot leave coverage without its
        bytes) and the loop starts again. More than RESTARTS failures within RESTART_WINDOW
        seconds end it for good: ``failed`` in status, and ``on_fatal`` (``shadow serve``
        exits with one line) so the shadow is never up but deaf."""
        name_thread()
        crashes: deque[float] = deque()
        while not self._stop.is_set():
            try:
                self._loop()
                return
            except Exception as e:  # noqa: BLE001 - restarted below, never silently dead
                self.drops["receiver_crashed"] += 1
                self.last_error = f"{type(e).__name__}: {e}"[:300]
                log.exception("receive thread failed")
                now = time.monotonic()
                crashes.append(now)
                while crashes and now - crashes[0] > RESTART_WINDOW:
                    crashes.popleft()
                if len(crashes) > RESTARTS:
                    self.failed = True
                    why = (f"the receive thread failed {len(crashes)} times in "
                           f"{RESTART_WINDOW:.0f}s (last: {self.last_error}): this shadow "
                           "takes no more datagrams")
                    log.critical(why)
                    if self.on_fatal is not None:
                        self.on_fatal(why)
                    return
                self.restarts += 1
                with self._lock:
                    if self.asm is not None:
                        self.asm.forget_open()
                time.sleep(0.05)

    def _loop(self) -> None:
        # Compiled before the thread takes datagrams: here, not at construction, so a cold
        # Numba cache does not hold up the shadow's TCP service (the node warms it too).
        ingest.warm()
        sock = self.sock
        # Non-blocking batched receive; poll only when the queue is empty (a socket timeout
        # would cost a poll() syscall before every datagram).
        sock.setblocking(False)
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        poll = poller.poll
        rx = BatchReceiver(sock, self.batch, _MAXDGRAM)
        take, ring_u8, lens = rx.take, np.frombuffer(rx.ring, np.uint8), rx.lens
        bases = np.arange(self.batch, dtype=np.int64) * rx.slot
        handle, lock = self.handle, self._lock
        stop = self._stop.is_set
        next_tick = time.monotonic()
        linger, sleep = self.linger, time.sleep
        # Datagrams taken since the thread last slept. A trickle (fewer than one batch) means
        # waking again at once would take only a few: linger. After a burst the sender has
        # paused (e.g. it waits for something): block in poll() and answer as soon as it
        # resumes.
        taken, batch = 0, self.batch
        while not stop():
            try:
                k = take()
            except BlockingIOError:
                self.wakeups += 1
                if linger and 0 < taken < batch:
                    taken = 0
                    sleep(linger)
                    continue
                taken = 0
                wait = 0.1
                if self.asm is not None:
                    wait = self._tick(None)
                next_tick = time.monotonic() + max(wait, MIN_TICK)
                poll(max(1, int(wait * 1000)))
                continue
            taken += k
            self.received += k
            now = time.monotonic()
            if now >= next_tick:
                # In a steady stream the socket never runs dry: tick when the assembler said
                # a repair request falls due, so a hole is asked for within milliseconds.
                wait = self._tick(now) if self.asm is not None else 0.1
                next_tick = now + max(wait, MIN_TICK)
            with lock:
                # Checked under the lock that ShadowNode.set_run takes: a batch verified with
                # the run that just ended cannot be placed after the new run dropped its bytes.
                handle(ring_u8, bases[:k], lens[:k])
            if linger and k < LINGER_BATCH:
                # A few datagrams per call means the sender trickles at about our pace: each
                # call then costs its syscall and per-batch work for one or two datagrams and
                # the socket never runs dry, so the linger above would never start. Sleep
                # here too, so the next call takes a batch.
                taken = 0
                self.wakeups += 1
                sleep(linger)

    def handle(self, buf: np.ndarray, bases: np.ndarray, lens: np.ndarray) -> None:
        """Validate and place one batch: datagram i is ``lens[i]`` bytes at ``buf[bases[i]:]``
        (``buf`` a uint8 array). Every transport's receive path ends here (UDP's recvmmsg
        ring, the verbs receive ring: checkmate.shadow.verbs), so the checks exist once: one
        compiled pass (checkmate.shadow.ingest.scan: MAC, header, session, CRC32C, range,
        drops by reason), then Python per run of contiguous pieces, each placed by one
        compiled copy; per datagram only control fragments, "gone" answers, float16 pieces
        and pieces that overlap what arrived. Callers hold ``self._lock``: the assembler is
        not thread-safe, and the key must not change between the check and the placing."""
        k = len(lens)
        b = self._batch
        b.fit(k)
        asm = self.asm
        key = self.mac_key
        p = b.params
        p[:] = (self.job, self.epoch, self.token, self.partition, self.grad_dtype,
                asm.start if asm is not None else 0, asm.end if asm is not None else 0,
                asm is not None, key is not None, key[0] if key else 0, key[1] if key else 0,
                self._crc_fn)
        ne = ingest.scan(buf, bases, lens, p, b.counts, b.ok, b.offs, b.events)
        c = b.counts
        if c[ingest.TOTAL]:
            drops = self.drops
            for r, name in enumerate(ingest.REASONS):
                if c[r]:
                    drops[name] += int(c[r])
        if c[ingest.ANSWERS]:
            self.repair_stats["answers"] += int(c[ingest.ANSWERS])
            self.repair_stats["answer_bytes"] += int(c[ingest.ANSWER_BYTES])
        if not ne:
            return
        run = ingest.RUN
        for kind, i0, i1, it, lo, hi, x, m in b.events[:ne].tolist():
            if kind == run:
                self._place_run(asm, buf, bases, lens, i0, i1, it, lo, hi, x, m)
            elif kind == ingest.GONE:
                self.repair_stats["gone"] += 1
                if asm is not None:
                    asm.on_gone(it)
            else:  # CTRL: control bytes [lo, lo+hi) of x; ONE: elements [lo, lo+hi), dtype x
                base, n = int(bases[i0]), int(lens[i0])
                payload = memoryview(buf)[base + wire.HEADER_LEN:base + n]
                if kind == ingest.CTRL:
                    asm.place_control(it, lo, hi, x, payload)
                else:
                    asm.place(it, lo, hi, x, payload)

    def _place_run(self, asm: Assembler, buf: np.ndarray, bases: np.ndarray,
                   lens: np.ndarray, i0: int, i1: int, it: int, lo: int, hi: int, dtype: int,
                   m: int) -> None:
        """Place the ``m`` pieces of one run (elements [lo, hi) of iteration ``it``): one
        compiled copy when none of it arrived yet, else piece by piece through
        ``asm.place`` (duplicates and overlaps are counted and placed there)."""
        st = asm.admit(it, m)
        if st is None:
            return
        a, e = lo - asm.start, hi - asm.start
        cov = st.cov
        b = self._batch
        if cov.free(a, e):
            cov.add(a, e)
            ingest.scatter(buf, bases, lens, b.ok, b.offs, i0, i1, st.u8, np.uint64(asm.start),
                           dtype)
            asm.placed_bytes += 4 * (e - a)
            if cov.total == asm.size and st.control is not None and it == asm.next_dispatch:
                asm._dispatch()
            return
        view, hl, size = memoryview(buf), wire.HEADER_LEN, _SIZES[dtype]
        ok, offs = b.ok, b.offs
        for i in range(i0, i1):
            if ok[i]:
                base, n = int(bases[i]), int(lens[i])
                asm.place(it, int(offs[i]), (n - hl) // size, dtype, view[base + hl:base + n])

    def _tick(self, now: float | None) -> float:
        t0 = time.perf_counter()
        with self._lock:
            wait = self.asm.tick(now)
        self.ticks += 1
        self.tick_seconds += time.perf_counter() - t0
        return wait

    def stats(self) -> dict[str, Any]:
        t = self._thread
        return {"received": self.received, "wakeups": self.wakeups, "ticks": self.ticks,
                "tick_seconds": round(self.tick_seconds, 6),
                "alive": t is not None and t.is_alive() and not self.failed,
                "restarts": self.restarts, "failed": self.failed,
                "last_error": self.last_error}

    def repair_status(self) -> dict[str, int]:
        r = self.repair_stats
        return {k: int(r[k]) for k in ("requests", "ranges", "control_requests", "answers",
                                       "answer_bytes", "gone", "no_peers", "send_errors")}
