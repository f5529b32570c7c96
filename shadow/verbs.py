"""RDMA (verbs) ingress for the shadow: a UD queue pair whose completions feed the same
validation and placement code as the UDP receiver (``Receiver.handle``).

Why UD: one UD QP takes datagrams from every trainer (and, in switch mode, every copy the
switch makes) like one UDP socket does, with no connection per sender; a ckm datagram
fits in one message (payload at most the path MTU). UC would need a QP and a connection
per sender, RC adds acknowledgements the replica stream does not want (repair is ours).

The receive ring is one registered memory region cut into slots of ``GRH + slot_bytes``;
every slot is posted once at start and re-posted in batches as its completion is
consumed. A UD receive writes the 40-byte GRH first (for RoCEv2 over IPv4, the IPv4
header in its last 20 bytes), so the ckm datagram starts at slot + 40 and is
``byte_len - 40`` bytes long. Bookkeeping (which slot is posted, what a completion means)
lives in :class:`RecvRing`, which needs no device and is tested on the host; the pyverbs
objects live in :class:`VerbsReceiver` and :class:`VerbsSender`.

pyverbs is imported only when a device is opened: without it (or without the device) the
shadow says so in one line (CheckmateError).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from checkmate.errors import CheckmateError

log = logging.getLogger("checkmate.shadow")

#: Bytes a UD receive writes before the message (the global route header).
GRH = 40
#: The Q_Key the shadow's UD QP accepts (a sender must use it; others are dropped by the
#: device). Documented in docs/verbs.md; not a secret: every datagram carries its MAC.
QKEY = 0x11C4_0001
#: Longest sleep between two polls of an idle completion queue (see VerbsReceiver._run).
IDLE_MAX = 0.005
#: A completion's status that means the receive worked.
_WC_SUCCESS = 0


@dataclass(frozen=True)
class QPAddress:
    """What a sender needs to reach a UD QP: the device's GID, the QP number, the Q_Key."""

    gid: str
    qpn: int
    qkey: int = QKEY

    def to_json(self) -> dict[str, Any]:
        return {"gid": self.gid, "qpn": self.qpn, "qkey": self.qkey}


class RecvRing:
    """Slot bookkeeping of a UD receive ring (no device needed).

    Slot i spans ``[i * stride, (i + 1) * stride)`` of one buffer, stride = GRH + payload
    bytes; its work request id is i. ``take(completions)`` turns completions into the
    (offset, length) of each ckm datagram and frees their slots; ``to_post()`` returns the
    free slots to post again once at least ``refill`` are free (posting in batches).
    Completions that do not name a posted slot, failed ones and ones shorter than the GRH
    are counted in ``errors`` by reason, never placed.
    """

    def __init__(self, slots: int, slot_bytes: int, refill: int = 32) -> None:
        if slots < 1 or slot_bytes < 1:
            raise CheckmateError(f"verbs ring: need slots >= 1 and slot bytes >= 1, got "
                                 f"{slots} and {slot_bytes}")
        self.slots, self.slot_bytes = slots, slot_bytes
        self.stride = GRH + slot_bytes
        self.refill = max(1, min(refill, slots))
        self.posted = np.zeros(slots, bool)
        self._free: list[int] = list(range(slots))
        self.errors: Counter = Counter()
        self.completed = 0

    @property
    def size(self) -> int:
        return self.slots * self.stride

    def to_post(self, force: bool = False) -> list[int]:
        """Free slots to post now (all of them, when at least ``refill`` are free or
        ``force``); marks them posted."""
        if not self._free or (len(self._free) < self.refill and not force):
            return []
        out, self._free = self._free, []
        self.posted[out] = True
        return out

    def take(self, completions: list[tuple[int, int, int]]
             ) -> tuple[np.ndarray, np.ndarray]:
        """``completions``: (wr_id, status, byte_len) each. Returns the offsets and lengths
        of the datagrams to check and place, in completion order."""
        bases: list[int] = []
        lens: list[int] = []
        for wr_id, status, byte_len in completions:
            if not 0 <= wr_id < self.slots or not self.posted[wr_id]:
                self.errors["unknown_wr"] += 1  # not ours: never free a slot twice
                continue
            self.posted[wr_id] = False
            self._free.append(wr_id)
            self.completed += 1
            if status != _WC_SUCCESS:
                self.errors["status"] += 1
                continue
            if byte_len < GRH or byte_len > self.stride:
                self.errors["grh" if byte_len < GRH else "oversize"] += 1
                continue
            bases.append(wr_id * self.stride + GRH)
            lens.append(byte_len - GRH)
        return np.asarray(bases, np.int64), np.asarray(lens, np.int64)


def _enums() -> Any:
    """pyverbs' enums module (renamed libibverbs_enums in rdma-core 59)."""
    try:
        import pyverbs.libibverbs_enums as e
    except ImportError:
        import pyverbs.enums as e
    return e


def open_device(name: str) -> Any:
    """A pyverbs Context on device ``name``; one CheckmateError line when pyverbs or the
    device is missing."""
    try:
        from pyverbs.device import Context, get_device_list
    except ImportError as exc:
        raise CheckmateError(f"--transport verbs needs pyverbs (python3-pyverbs or rdma-core's "
                             f"pyverbs): {exc}") from None
    try:
        names = [d.name.decode() for d in get_device_list()]
    except Exception as exc:  # pyverbs raises its own PyverbsError types
        raise CheckmateError(f"cannot list RDMA devices: {exc}") from None
    if name not in names:
        raise CheckmateError(f"no RDMA device {name!r} (devices: {', '.join(names) or 'none'};"
                             " for soft-RoCE: rdma link add rxe0 type rxe netdev IFACE)")
    try:
        return Context(name=name)
    except Exception as exc:
        raise CheckmateError(f"cannot open RDMA device {name}: {exc}") from None


def pick_gid(ctx: Any, port: int = 1) -> tuple[int, str]:
    """The GID index and GID to use: the first IPv4-mapped one (RoCEv2 over IPv4), else the
    first non-zero one."""
    first: tuple[int, str] | None = None
    attr = ctx.query_port(port)
    for i in range(attr.gid_tbl_len):
        try:
            g = str(ctx.query_gid(port, i))
        except Exception:
            continue
        if g.replace(":", "").strip("0") == "":
            continue
        if g.startswith("0000:0000:0000:0000:0000:ffff:") or g.startswith("::ffff:"):
            return i, g
        if first is None:
            first = (i, g)
    if first is None:
        raise CheckmateError("the RDMA device has no usable GID (is its netdev up?)")
    return first


class _UDQueuePair:
    """A UD QP in RTS on ``device`` with one CQ for both directions."""

    def __init__(self, device: str, port: int, send_wr: int, recv_wr: int, cqe: int) -> None:
        ctx = open_device(device)  # first: a missing pyverbs or device is one line
        from pyverbs.cq import CQ
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        e = _enums()
        self.e = e
        self.port = port
        self.ctx = ctx
        self.gid_index, self.gid = pick_gid(self.ctx, port)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, cqe)
        cap = QPCap(max_send_wr=send_wr, max_recv_wr=recv_wr, max_send_sge=1,
                    max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_UD, scq=self.cq, rcq=self.cq, cap=cap)
        attr = QPAttr()
        attr.qkey, attr.port_num = QKEY, port
        self.qp = QP(self.pd, init, attr)  # with an attr, pyverbs takes a UD QP to RTS
        self.qpn = self.qp.qp_num

    def address(self) -> QPAddress:
        return QPAddress(self.gid, self.qpn)

    def close(self) -> None:
        for o in (self.qp, self.cq, self.pd, self.ctx):
            try:
                o.close()
            except Exception:  # closing what a failed start left half made
                pass


class RingConsumer:
    """Turns a batch of completions of ``ring`` (over the memory ``buf``) into datagrams
    for ``receiver.handle``: slot bookkeeping, the GRH skipped, then the shared compiled
    checks (the MAC tags among them) and placement under the receiver's lock. No device needed: the
    tests drive it with a plain buffer."""

    def __init__(self, receiver: Any, ring: RecvRing, buf: Any) -> None:
        self.receiver, self.ring, self.buf = receiver, ring, buf
        self.view = memoryview(buf).cast("B")
        self.u8 = np.frombuffer(buf, np.uint8)
        self.stats: Counter = Counter()

    def consume(self, completions: list[tuple[int, int, int]]) -> int:
        """``completions``: (wr_id, status, byte_len) each; returns datagrams handed on."""
        self.stats["completions"] += len(completions)
        bases, lens = self.ring.take(completions)
        k = len(lens)
        if not k:
            return 0
        rx = self.receiver
        rx.received += k
        with rx._lock:  # the key cannot change between the check and the placing
            rx.handle(self.u8, bases, lens)
        self.stats["datagrams"] += k
        return k


class VerbsReceiver:
    """Receives ckm datagrams on a UD QP and hands each batch of completions to
    ``receiver.handle`` (checkmate.shadow.receiver.Receiver) under its lock.

    ``start()`` runs the polling thread; ``address`` is what senders need (carried in the
    shadow's registration and status, see docs/verbs.md). Stats: completions, datagrams
    placed through the shared path, ring errors by reason, polls that found nothing.
    """

    def __init__(self, receiver: Any, device: str, port: int = 1, slots: int = 1024,
                 slot_bytes: int = 4096, batch: int = 64, idle_sleep: float = 0.0005
                 ) -> None:
        self.receiver = receiver
        self.ring = RecvRing(slots, slot_bytes, refill=min(batch, slots))
        self.batch, self.idle_sleep = batch, idle_sleep
        self.qp = _UDQueuePair(device, port, send_wr=1, recv_wr=slots, cqe=slots + 16)
        from pyverbs.mr import MR

        e = self.qp.e
        try:
            self.mr = MR(self.qp.pd, self.ring.size, e.IBV_ACCESS_LOCAL_WRITE)
        except Exception as exc:
            self.qp.close()
            raise CheckmateError(f"cannot register {self.ring.size} bytes on {device}: "
                                 f"{exc}") from None
        self._arr = (ctypes.c_ubyte * self.ring.size).from_address(self.mr.buf)
        self.consumer = RingConsumer(receiver, self.ring, self._arr)
        self.address = self.qp.address()
        self.stats = self.consumer.stats
        from pyverbs.wr import SGE, RecvWR

        stride, lkey, buf = self.ring.stride, self.mr.lkey, self.mr.buf
        self._wrs = [RecvWR(wr_id=i, num_sge=1, sg=[SGE(buf + i * stride, stride, lkey)])
                     for i in range(slots)]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._post(force=True)

    def _post(self, force: bool = False) -> None:
        slots = self.ring.to_post(force)
        if not slots:
            return
        post, wrs = self.qp.qp.post_recv, self._wrs
        for i in slots:
            post(wrs[i])  # each slot's work request is built once and posted again
        self.stats["post_calls"] += 1

    def poll_once(self) -> int:
        """Take up to ``batch`` completions, place their datagrams, re-post; returns how
        many completions were taken."""
        n, wcs = self.qp.cq.poll(self.batch)
        if n <= 0:
            return 0
        self.consumer.consume([(wc.wr_id, wc.status, wc.byte_len) for wc in wcs[:n]])
        self._post()
        return n

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="shadow-verbs", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from checkmate.shadow import ingest
        from checkmate.shadow.osname import name_thread

        name_thread()
        ingest.warm()  # the receiver's compiled pass, before the first completion
        # Idle: sleep between polls, doubling from ``idle_sleep`` up to IDLE_MAX while
        # nothing arrives (a busy poll would take a core the trainers share); the ring
        # holds what arrives meanwhile (1024 slots: 5 ms at 200k datagrams/s).
        nap = self.idle_sleep
        try:
            while not self._stop.is_set():
                if self.poll_once():
                    nap = self.idle_sleep
                    continue
                self.stats["idle_polls"] += 1
                self._post(force=True)
                time.sleep(nap)
                nap = min(nap * 2, IDLE_MAX)
        except Exception:  # visible in status, never a silently dead ingress
            log.exception("verbs receive thread failed")
            self.receiver.drops["verbs_crashed"] += 1

    def status(self) -> dict[str, Any]:
        return {**self.address.to_json(), "slots": self.ring.slots,
                "slot_bytes": self.ring.slot_bytes,
                **{k: int(v) for k, v in self.stats.items()},
                "ring_errors": {k: int(v) for k, v in self.ring.errors.items()}}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        try:
            self.mr.close()
        except Exception:
            pass
        self.qp.close()


class VerbsSender:
    """Sends ckm datagrams as UD messages to a shadow's QP (the trainers' side in host
    mode, and the tests' and bench's). Each datagram is copied into a registered send
    slot; at most ``depth`` sends are in flight."""

    def __init__(self, device: str, dest: QPAddress, port: int = 1, depth: int = 64,
                 slot_bytes: int = 4096) -> None:
        self.qp = _UDQueuePair(device, port, send_wr=depth, recv_wr=1, cqe=depth + 16)
        from pyverbs.addr import AH, GID, AHAttr, GlobalRoute
        from pyverbs.mr import MR

        e = self.qp.e
        self.e = e
        self.depth, self.slot_bytes = depth, slot_bytes
        self.mr = MR(self.qp.pd, depth * slot_bytes, e.IBV_ACCESS_LOCAL_WRITE)
        self._arr = (ctypes.c_ubyte * (depth * slot_bytes)).from_address(self.mr.buf)
        self.view = memoryview(self._arr).cast("B")
        gr = GlobalRoute(dgid=GID(dest.gid), sgid_index=self.qp.gid_index)
        self.ah = AH(self.qp.pd, attr=AHAttr(port_num=port, is_global=1, gr=gr))
        self.dest = dest
        self._next = 0
        self._inflight = 0
        self.sent = 0
        self.errors = 0

    def send(self, datagram: bytes | memoryview) -> None:
        from pyverbs.wr import SGE, SendWR

        n = len(datagram)
        if n > self.slot_bytes:
            raise CheckmateError(f"verbs: a {n}-byte datagram exceeds the {self.slot_bytes}-"
                                 "byte UD message size (the path MTU)")
        while self._inflight >= self.depth:
            self._reap()
        i = self._next
        self._next = (i + 1) % self.depth
        off = i * self.slot_bytes
        self.view[off:off + n] = datagram
        wr = SendWR(wr_id=i, opcode=self.e.IBV_WR_SEND, num_sge=1,
                    sg=[SGE(self.mr.buf + off, n, self.mr.lkey)],
                    send_flags=self.e.IBV_SEND_SIGNALED)
        wr.set_wr_ud(self.ah, self.dest.qpn, self.dest.qkey)
        self.qp.qp.post_send(wr)
        self._inflight += 1
        self.sent += 1

    def _reap(self) -> None:
        n, wcs = self.qp.cq.poll(self.depth)
        for wc in wcs[:max(n, 0)]:
            self._inflight -= 1
            if wc.status != _WC_SUCCESS:
                self.errors += 1

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every send completed."""
        end = time.monotonic() + timeout
        while self._inflight and time.monotonic() < end:
            self._reap()
        if self._inflight:
            raise CheckmateError(f"verbs: {self._inflight} sends not completed in {timeout} s")

    def close(self) -> None:
        for o in (self.ah, self.mr):
            try:
                o.close()
            except Exception:
                pass
        self.qp.close()
