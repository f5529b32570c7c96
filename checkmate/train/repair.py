"""A trainer's repair service: answer shadows' requests for pieces they missed.

One thread per trainer with its own UDP socket on ``config.REPAIR_PORT`` (the ring's
communication thread is never involved, so repair cannot slow an allreduce). A request
(checkmate.protocol.repair) names an iteration, a partition and element ranges (or the control
message); the answer is the retained datagrams again, cut to the ranges, flagged ACK and
sent straight to that partition's shadow. Answers are paced by a token bucket
(``rate`` bytes per second, ``burst`` bytes), so a shadow that lost a whole iteration
cannot take the trainer's network away from the ring. A request for an iteration the
trainer no longer retains gets a "gone" answer. Everything else -- malformed, foreign job,
unknown partition, a future iteration -- is dropped and counted.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from typing import Any

from checkmate.protocol import datamac, repair, wire
from checkmate.train.replica_log import ReplicaLog
from checkmate.train.replicate import CONTROL_FRAGMENT, ShadowTarget

log = logging.getLogger("checkmate.train")

#: Default pacing of repair answers: bytes per second and bucket depth.
REPAIR_RATE = 64 << 20
REPAIR_BURST = 1 << 20
_PACK = wire.STRUCT.pack
_F32, _BYTES = int(wire.DType.FLOAT32), int(wire.DType.BYTES)


class TokenBucket:
    """``rate`` bytes per second with at most ``burst`` saved up; ``take`` sleeps for more."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = float(rate), float(burst)
        self.tokens = self.burst
        self.at = time.monotonic()
        self.waits = 0

    def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        if self.tokens < 0:
            self.waits += 1
            time.sleep(-self.tokens / self.rate)


class RepairServer:
    """Answers repair requests from the retained replica log of one trainer."""

    def __init__(self, bind: tuple[str, int], job_id: int, log_: ReplicaLog,
                 targets: dict[int, ShadowTarget], rate: float = REPAIR_RATE,
                 burst: float = REPAIR_BURST, data_key: tuple[int, int] | None = None,
                 mirrors: dict[int, list[ShadowTarget]] | None = None) -> None:
        self.job_id = job_id
        #: checkmate.protocol.datamac key: answers carry the tag a shadow checks, like any copy.
        self.data_key = data_key
        self.log = log_
        self.targets = targets
        #: a partition's further replicas: a request from one of them is answered to it
        self.mirrors = mirrors or {}
        self.bucket = TokenBucket(rate, burst)
        self.stats: Counter = Counter()
        from checkmate.control.pfc import mark_ckm

        self.sock = mark_ckm(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))  # the ckm class
        try:
            self.sock.bind(bind)
        except OSError as e:
            self.sock.close()
            from checkmate.errors import CheckmateError

            raise CheckmateError(f"cannot bind repair socket {bind[0]}:{bind[1]}: "
                                 f"{e.strerror or e}") from None
        # Block without a timeout: a thread that woke periodically would take the GIL from
        # the ring's thread each time. close() wakes it with a datagram to itself.
        self.sock.settimeout(None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckm-repair", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.sendto(b"", self.sock.getsockname())
        except OSError:
            pass
        self._thread.join(2.0)
        self.sock.close()

    def status(self) -> dict[str, int]:
        return {"requests": self.stats["requests"], "answered_elements":
                self.stats["elements"], "answered_bytes": self.stats["bytes"],
                "gone": self.stats["gone"], "rate_limited": self.bucket.waits,
                "dropped": sum(v for k, v in self.stats.items() if k.startswith("drop_")),
                "log_added": self.log.added, "log_seconds": round(self.log.seconds, 6)}

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, src = self.sock.recvfrom(65536)
            except OSError:
                if self._stop.is_set():
                    return
                continue
            if self._stop.is_set():
                return
            try:
                self.handle(data, src)
            except Exception as e:  # noqa: BLE001 - one bad request must not end the service
                self.stats["drop_error"] += 1
                log.warning("repair request failed: %s", e)

    def handle(self, data: bytes, src: tuple[str, int] | None = None) -> None:
        """Validate one request and answer it: to the partition's shadow, or to the replica
        of it that asked (``src``, its receive address); never to any other address."""
        try:
            h, payload = wire.decode(data)
        except wire.WireError:
            self.stats["drop_malformed"] += 1
            return
        if h.job_id != self.job_id:
            self.stats["drop_job"] += 1
            return
        if h.flags not in (repair.REQUEST, repair.REQUEST_CONTROL) or h.dtype != _BYTES:
            self.stats["drop_flags"] += 1
            return
        if self.data_key is not None and (h.fec_index, h.fec_k, h.fec_m, h.fec_group) != \
                self._tag(h.flags, h.iteration, h.offset, h.count, h.partition, h.dtype,
                          h.crc32c):
            self.stats["drop_mac"] += 1  # not from a shadow of this job
            return
        t = self.targets.get(h.partition)
        if t is None:
            self.stats["drop_partition"] += 1
            return
        try:
            ranges = repair.decode_ranges(payload)
        except wire.WireError:
            self.stats["drop_malformed"] += 1
            return
        self.stats["requests"] += 1
        addr = (t.ip, t.port)
        for m in self.mirrors.get(h.partition, ()):
            if src == (m.ip, m.port):
                addr = src
                break
        if not self.log.holds(h.iteration):
            if h.iteration > self.log.newest:
                self.stats["future"] += 1  # not sent yet: the shadow asked early
                return
            self.stats["gone"] += 1
            c = wire.crc(b"")
            gone = _PACK(wire.MAGIC, wire.VERSION, repair.GONE, self.job_id, h.epoch,
                         h.token, h.iteration, 0, 0, 0, 0, h.partition, _BYTES,
                         *self._tag(repair.GONE, h.iteration, 0, 0, h.partition, _BYTES, c),
                         c)
            self._send([gone], addr)
            return
        if h.flags == repair.REQUEST_CONTROL:
            self._answer_control(h, ranges, addr)
            return
        pieces = self.log.pieces(h.iteration, h.partition, ranges)
        for off, n, bucket, chunk in pieces or ():
            c = wire.crc(chunk)
            hdr = _PACK(wire.MAGIC, wire.VERSION, repair.ANSWER, self.job_id, h.epoch,
                        h.token, h.iteration, off, n, 0, bucket, h.partition, _F32,
                        *self._tag(repair.ANSWER, h.iteration, off, n, h.partition, _F32, c),
                        c)
            self.stats["elements"] += n  # before sending: a reader of the answer sees it
            self._send([hdr, chunk], addr)

    def _tag(self, flags: int, iteration: int, offset: int, count: int, partition: int,
             dtype: int, crc: int) -> tuple[int, int, int, int]:
        if self.data_key is None:
            return (0, 0, 0, 0)
        return datamac.data_tag(self.data_key, self.job_id, flags, iteration, offset, count,
                                partition, dtype, crc)

    def _answer_control(self, h: wire.Header, ranges: list[tuple[int, int]],
                        addr: tuple[str, int]) -> None:
        data = self.log.control(h.iteration)
        if data is None:
            self.stats["not_held"] += 1  # another rank's, or not sent yet
            return
        want = ranges or [(0, len(data))]
        for off in range(0, len(data), CONTROL_FRAGMENT):
            end = min(len(data), off + CONTROL_FRAGMENT)
            if not any(a < end and off < b for a, b in want):
                continue
            frag = data[off:end]
            fields = [wire.MAGIC, wire.VERSION, repair.ANSWER_CONTROL, self.job_id, h.epoch,
                      h.token, h.iteration, off, len(frag), 0, 0, h.partition, _BYTES, 0, 0,
                      0, len(data), wire.crc(frag)]
            if self.data_key is not None:  # a fragment's tag, as rank 0's copy carried
                fields[9] = datamac.control_tag(self.data_key, _PACK(*fields))
            hdr = _PACK(*fields)
            self._send([hdr, frag], addr)

    def _send(self, parts: list[bytes], addr: tuple[str, int]) -> None:
        n = sum(len(p) for p in parts)
        self.bucket.take(n)
        try:
            self.sock.sendmsg(parts, (), 0, addr)
        except OSError:
            self.stats["send_errors"] += 1
            return
        self.stats["bytes"] += n - len(parts[0])  # payload bytes, as replica bytes count


def owners_body(trainers: list[tuple[str, int]], owners: list[tuple[int, int, int]],
                control_rank: int = 0, run: str = "") -> dict[str, Any]:
    """The ``peers`` request telling a shadow whom to ask for which of its ranges, and the
    run whose keys tag everything it takes (checkmate.protocol.datamac.run_secret)."""
    return {"op": "peers", "trainers": [[ip, port] for ip, port in trainers],
            "owners": [list(o) for o in owners], "control": control_rank, "run": run}
