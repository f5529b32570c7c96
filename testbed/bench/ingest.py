"""Bench: gradient bytes/s the shadow receiver places vs a raw UDP receive loop.

One run, same path for all (loopback UDP, one sender process, jumbo-sized ckm datagrams of
float32 gradient): raw loops that only receive datagrams and count bytes (recv_into per
datagram, and recvmmsg batches as the shadow's receiver uses), then the shadow's real
receive path (checkmate.shadow.receiver + assembler: one compiled call per batch,
checkmate.shadow.ingest, for the per-datagram MAC check, header and session checks and
CRC32C, then per run coverage and a compiled copy into the fp32 staging buffer, control
message parsing and MAC), and the same path without the MAC checks, to price them. The
headline divides the shipped path by the faster raw loop.

By default each receiver drains a full queue: the sender puts every iteration into the
receive buffer (512 MiB) before the receiver starts and its clock runs, so the rate is the
receiver's and the headline can fail. ``--paced`` is the earlier method: the sender waits
for the receiver (at most ``--depth`` iterations in flight, acknowledged through shared
memory), which measures whichever side is slower -- on loopback mostly the sender. Paths
alternate for ``--rounds`` rounds and report medians (the machine is shared). The optimizer
step is not part of the headline. Unless ``--no-node``, the whole node (receive, check,
place, AdamW, retained version) then runs ``--rounds`` times, alternated with a copy loop
that moves the node's bytes per parameter (BYTES_PER_PARAM) over buffers of the same size:
the shadow's capacity in parameters per second per core (all node threads' CPU) against
that memory-bandwidth bound (``shadow capacity vs memory-copy bound ratio``).

    testbed bench ingest [--elements N] [--iterations K] [--rounds R] [--paced] [--no-node]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import select
import socket
import statistics
import threading
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np

from checkmate.protocol import datamac, wire

JOB, EPOCH, TOKEN = 7, 3, 0x5EED
#: The bench's own job secret (the tags cost the same whatever the key).
SECRET = bytes(range(32))
_CPU: list[float] = []


def _datagrams(total: int, chunk: int) -> list[bytearray]:
    """One iteration's datagrams (iteration and tag fields patched by the sender)."""
    rng = np.random.default_rng(1)
    grad = rng.standard_normal(total).astype(np.float32)
    out = []
    for off in range(0, total, chunk):
        c = min(chunk, total - off)
        h = wire.Header(flags=wire.Flags.REPLICATE, job_id=JOB, epoch=EPOCH, token=TOKEN,
                        iteration=1, offset=off, count=c, partition=0)
        out.append(bytearray(wire.encode(h, grad[off:off + c].tobytes())))
    return out


def _control(it: int, mac: bool) -> bytes:
    body = json.dumps({"iteration": it, "lrs": [1e-3], "clip_coef": None, "skip": False,
                       "buffers": {}, "extra": {}}).encode()
    if mac:
        body += datamac.control_mac(datamac.control_key(SECRET), JOB, it, body)
    h = wire.Header(flags=wire.Flags.CONTROL, job_id=JOB, epoch=EPOCH, token=TOKEN,
                    iteration=it, offset=0, count=len(body), dtype=wire.DType.BYTES,
                    fec_group=len(body), crc32c=wire.crc(body))
    if mac:  # the fragment's own tag, as a trainer sends it
        h = replace(h, seq=datamac.control_tag(datamac.data_key(SECRET), wire.pack_header(h)))
    return wire.encode(h, body)


def _tag(d: bytearray, it: int, key: tuple[int, int]) -> None:
    """Write datagram ``d``'s tag for iteration ``it`` (what a trainer's ring does)."""
    h = wire.decode_header(d)
    t = int(datamac.tag56(key[0], key[1], JOB, h.flags, it, h.offset, h.count, 0, 0,
                          h.crc32c))
    d[45:52] = t.to_bytes(7, "big")


def _sender(port: int, total: int, chunk: int, iterations: int, depth: int,
            acked: Any, control: bool, ready: Any, mac: bool = False) -> None:
    dgrams = _datagrams(total, chunk)
    key = datamac.data_key(SECRET)
    # Tags for every iteration made ahead, and written by both variants (zeros without the
    # MAC): the two senders do the same work, so a difference is the receiver's.
    tagged = {}
    for it in range(1, iterations + 1):
        for i, d in enumerate(dgrams):
            if mac:
                _tag(d, it, key)
            tagged[it, i] = bytes(d[45:52])
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(("127.0.0.1", port))
    send = s.send
    ready.value = 1
    for it in range(1, iterations + 1):
        while depth and acked.value < it - depth:  # depth 0: fill the socket, no pacing
            time.sleep(0.0001)
        for i, d in enumerate(dgrams):
            d[16:24] = it.to_bytes(8, "big")
            d[45:52] = tagged[it, i]
            send(d)
        if control:
            send(_control(it, mac))
    ready.value = 2
    s.close()


def _run(port_sock: socket.socket, total: int, chunk: int, iterations: int, depth: int,
         consume, control: bool, mac: bool = False) -> tuple[float, int]:
    """Start the sender, run ``consume`` (which sets ``acked``), return (seconds, bytes)."""
    ctx = mp.get_context("fork")
    acked = ctx.Value("q", 0, lock=False)
    ready = ctx.Value("q", 0, lock=False)
    port = port_sock.getsockname()[1]
    proc = ctx.Process(target=_sender, args=(port, total, chunk, iterations, depth, acked,
                                             control, ready, mac), daemon=True)
    proc.start()
    # Datagram building is not timed; with depth 0 the sender fills the receive buffer with
    # every iteration first, so the receiver drains a full queue: receiver-bound.
    while ready.value < (2 if depth == 0 else 1) and proc.is_alive():
        time.sleep(0.001)
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        nbytes = consume(acked)
        secs = time.perf_counter() - t0
        _CPU.append(time.thread_time() - c0)  # receiving thread's CPU (user + system)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return secs, nbytes


def _raw(total: int, chunk: int, iterations: int, depth: int,
         batched: bool = False) -> tuple[float, int]:
    """Receive and count only: recv_into per datagram, or recvmmsg batches (the same
    batching the shadow's receiver uses)."""
    from checkmate.shadow.mmsg import BatchReceiver
    from checkmate.shadow.receiver import open_socket

    sock, _ = open_socket("127.0.0.1", 0)
    per_iter = -(-total // chunk)

    def consume(acked: Any) -> int:
        buf = bytearray(65536)
        recv_into = sock.recv_into
        got = nbytes = 0
        want = per_iter * iterations
        hl = wire.HEADER_LEN
        if batched:
            sock.setblocking(False)
            recv = BatchReceiver(sock, 64, 65536).recv
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            deadline = time.monotonic() + 120
            while got < want and time.monotonic() < deadline:
                try:
                    lens = recv()
                except BlockingIOError:
                    poller.poll(100)  # wait like the shadow's receiver does
                    continue
                for n in lens:
                    nbytes += n - hl
                got += len(lens)
                acked.value = got // per_iter
            return nbytes
        sock.settimeout(10)
        while got < want:
            n = recv_into(buf)
            nbytes += n - hl
            got += 1
            if got % per_iter == 0:
                acked.value = got // per_iter
        return nbytes

    try:
        return _run(sock, total, chunk, iterations, depth, consume, control=False)
    finally:
        sock.close()


def _ingest(total: int, chunk: int, iterations: int, depth: int,
            mac: bool = True) -> tuple[float, int, dict]:
    """The real Receiver + Assembler; completed iterations are released at once. ``mac``:
    check the datagrams' tags and the control message's MAC, as a shadow does (False only
    to measure what that costs)."""
    from checkmate.shadow.assembler import Assembler
    from checkmate.shadow.receiver import Receiver, open_socket

    sock, _ = open_socket("127.0.0.1", 0)
    drops: Counter = Counter()
    rx = Receiver(sock, JOB, 0, drops, EPOCH, TOKEN,
                  mac_key=datamac.data_key(SECRET) if mac else None)
    box: dict[str, Any] = {}

    def done(it: int, staging: np.ndarray, _control: Any) -> None:
        asm.committed = it
        asm.release(staging)
        box["acked"].value = it
        if it == iterations:
            rx._stop.set()

    asm = Assembler(0, total, 1, done, drops, window=max(depth, 1) + 2, job=JOB,
                    control_key=datamac.control_key(SECRET) if mac else None)
    asm.committed = 0
    rx.attach(asm, "float32")

    def consume(acked: Any) -> int:
        box["acked"] = acked
        guard = threading.Timer(120, rx._stop.set)  # never hang the bench on a lost datagram
        guard.start()
        rx.run()
        guard.cancel()
        return asm.placed_bytes

    try:
        secs, nbytes = _run(sock, total, chunk, iterations, depth, consume, control=True,
                            mac=mac)
    finally:
        sock.close()
    return secs, nbytes, dict(drops)


def _node(total: int, chunk: int, iterations: int, depth: int
          ) -> tuple[float, int, dict, float]:
    """The whole node (receiver, AdamW step, retained versions) via its public pieces;
    also the CPU seconds this process spent from the node's start to its last commit (every
    node thread; the sender is another process)."""
    from checkmate.shadow.node import NodeOptions, ShadowNode
    from checkmate.spec.model import ModelSpec

    spec = ModelSpec.build(JOB, [("w", (total,))], "adamw", [{"params": ["w"], "lr": 1e-3}], 1)
    node = ShadowNode(NodeOptions(0, 1, JOB, bind="127.0.0.1", port=0,
                                  restore_bind="127.0.0.1", restore_port=0, epoch=EPOCH,
                                  token=TOKEN, secret=SECRET,
                                  # prefilled: every iteration is queued before the stepper
                                  # (another thread) commits the first
                                  window=(depth or iterations) + 2))
    node.state.set_spec(spec)
    node.state.install(0, 0, {s: np.zeros(total, np.float32) for s in spec.slots})
    cpu0 = time.process_time()
    node.start()
    box: dict[str, float] = {}

    def consume(acked: Any) -> int:
        deadline = time.monotonic() + 120
        while (node.state.latest or 0) < iterations and time.monotonic() < deadline:
            acked.value = node.state.latest or 0
            time.sleep(0.0005)
        box["cpu"] = time.process_time() - cpu0
        return (node.state.latest or 0) * total * 4

    try:
        secs, nbytes = _run(node.sock, total, chunk, iterations, depth, consume, True,
                            mac=True)
    finally:
        node.stop()
    return secs, nbytes, dict(node.drops), box.get("cpu", float("nan"))


#: Bytes per parameter the node moves at least (beside the kernel's socket copies): the
#: received gradient written to staging (4); AdamW reads it (4), reads the parameter and
#: both moments from the newest version (12) and writes them into the next one (12). (Until
#: the step wrote the next version itself, a copy pass retained it: 24 more, 56 in all.)
BYTES_PER_PARAM = 32
_COPIES = BYTES_PER_PARAM // 8  # float32 copies: 4 B read + 4 B written each


def _copy_bound(total: int, iterations: int) -> float:
    """Parameters per CPU second of one core copying BYTES_PER_PARAM bytes per parameter
    over buffers of the partition's size (_COPIES float32 copies): the memory-bandwidth
    bound for the node's bytes on this machine."""
    src = [np.ones(total, np.float32) for _ in range(_COPIES)]
    dst = [np.zeros(total, np.float32) for _ in range(_COPIES)]
    for a, b in zip(src, dst, strict=True):  # touch every page before timing
        np.copyto(b, a)
    c0 = time.thread_time()
    for _ in range(iterations):
        for a, b in zip(src, dst, strict=True):
            np.copyto(b, a)
    return iterations * total / (time.thread_time() - c0)


def _commit_lag(total: int, rounds: int) -> dict[str, list[float]]:
    """Commit lag after an iteration's last datagram on an idle shadow: the time from the
    complete gradient and control message to the committed version (ShadowState.apply),
    per round for the shipped step, which writes the next retained version itself
    ("into"), and for the step in place followed by a copy into the version ("copy", the
    path before issue 21), alternated. Seconds."""
    from checkmate.shadow.control_message import Control
    from checkmate.shadow.state import ShadowState
    from checkmate.spec.model import ModelSpec

    spec = ModelSpec.build(JOB, [("w", (total,))], "adamw", [{"params": ["w"], "lr": 1e-3}], 1)
    st = ShadowState(0, 1, JOB, retain=4)
    st.set_spec(spec)
    st.install(0, 0, {s: np.zeros(total, np.float32) for s in spec.slots})
    grad = np.random.default_rng(0).standard_normal(total).astype(np.float32)
    out: dict[str, list[float]] = {"into": [], "copy": []}
    it = 0
    try:
        for r in range(2 * rounds + 2):  # the first pair warms every array set: untimed
            for way in ("into", "copy") if r % 2 == 0 else ("copy", "into"):
                it += 1
                ctl = Control(it, [1e-3], None, False, {}, {})
                t0 = time.perf_counter()
                if way == "into":
                    st.apply(it, grad, ctl)
                else:
                    with st.lock:
                        st.opt.step(grad, ctl.lrs, None)
                        st._commit(it, {}, {}, ctl.lrs)
                if r >= 2:
                    out[way].append(time.perf_counter() - t0)
    finally:
        st.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="testbed bench ingest")
    p.add_argument("--elements", type=int, default=1 << 21, help="partition size (floats)")
    p.add_argument("--iterations", type=int, default=None,
                   help="per round (default 16 prefilled, 40 paced)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--paced", action="store_true",
                   help="the sender waits for the receiver (at most --depth iterations in "
                        "flight) instead of filling the socket buffer first")
    p.add_argument("--depth", type=int, default=3, help="iterations in flight with --paced")
    p.add_argument("--chunk", type=int, default=wire.MAX_PAYLOAD_JUMBO // 4,
                   help="float32 elements per datagram")
    p.add_argument("--no-node", action="store_true", help="skip the whole-node reference run")
    a = p.parse_args(argv)
    if a.iterations is None:
        a.iterations = 40 if a.paced else 16
    if not a.paced:
        a.depth = 0
    elif a.depth < 1:
        p.error("--depth must be >= 1")
    if min(a.elements, a.iterations, a.rounds) < 1 or not 0 < a.chunk <= 16000:
        p.error("--elements, --iterations, --rounds must be >= 1, --chunk 1..16000")
    mb = a.elements * 4 / 1e6
    how = (f"paced (sender waits, {a.depth} iterations in flight)" if a.paced else
           "receiver-bound (the socket buffer is filled before each receiver starts)")
    print(f"ingest bench: {a.iterations} iterations x {mb:.1f} MB fp32 gradient, "
          f"{a.chunk * 4} B payload per datagram, loopback, {how}")
    # Alternate the paths round by round and report medians: on a shared 2-core machine
    # other processes steal time from whichever run they happen to overlap.
    raw_rates, mm_rates, ing_rates, plain_rates, drops = [], [], [], [], {}
    cpu: dict[str, list[float]] = {"raw": [], "mm": [], "ing": [], "plain": []}
    dgrams = a.iterations * -(-a.elements // a.chunk)
    # The shadow compiles its ingest once when it starts (checkmate.shadow.ingest); done
    # here before timing, as a started shadow has.
    from checkmate.shadow import ingest

    ingest.warm()
    for _ in range(a.rounds):
        raw_s, raw_b = _raw(a.elements, a.chunk, a.iterations, a.depth)
        raw_rates.append(raw_b / raw_s)
        cpu["raw"].append(_CPU[-1] / dgrams)
        mm_s, mm_b = _raw(a.elements, a.chunk, a.iterations, a.depth, batched=True)
        mm_rates.append(mm_b / mm_s)
        cpu["mm"].append(_CPU[-1] / dgrams)
        # With and without the MAC check, in alternating order from round to round.
        for mac in ((True, False) if len(ing_rates) % 2 == 0 else (False, True)):
            ing_s, ing_b, d = _ingest(a.elements, a.chunk, a.iterations, a.depth, mac)
            (ing_rates if mac else plain_rates).append(ing_b / ing_s)
            cpu["ing" if mac else "plain"].append(_CPU[-1] / dgrams)
            for k, v in d.items():
                drops[k] = drops.get(k, 0) + v
    # Medians over rounds; the headline compares with the faster of the two raw loops.
    med = statistics.median
    raw_rate, ing_rate = max(med(raw_rates), med(mm_rates)), med(ing_rates)
    gb = " ".join
    print(f"{'path':<40}{'GB/s':>10}{'CPU us/dgram':>14}   rounds (GB/s)")
    for name, rates, key in (("raw UDP receive loop (recv_into)", raw_rates, "raw"),
                             ("raw UDP receive loop (recvmmsg)", mm_rates, "mm"),
                             ("shadow ingest, no MAC check", plain_rates, "plain"),
                             ("shadow ingest (MAC+validate+CRC+place)", ing_rates, "ing")):
        print(f"{name:<40}{med(rates) / 1e9:>10.3f}{med(cpu[key]) * 1e6:>14.2f}   "
              f"{gb(f'{r / 1e9:.3f}' for r in rates)}")
    if drops:
        print(f"ingest drops: {drops}")
    cap_ratio = None
    if not a.no_node:
        # Capacity: the whole node, alternated with the copy loop, a.rounds rounds each.
        node_rates, caps, bounds, n_drops = [], [], [], {}
        _node(a.elements, a.chunk, 2, a.depth)  # untimed: the optimizer's kernels loaded
        for _ in range(a.rounds):
            n_s, n_b, d, n_cpu = _node(a.elements, a.chunk, a.iterations, a.depth)
            node_rates.append(n_b / n_s)
            caps.append(a.iterations * a.elements / n_cpu)
            bounds.append(_copy_bound(a.elements, a.iterations))
            for k, v in d.items():
                n_drops[k] = n_drops.get(k, 0) + v
        print(f"{'whole node incl. AdamW step':<40}{med(node_rates) / 1e9:>10.3f}{'':>14}   "
              f"{gb(f'{r / 1e9:.3f}' for r in node_rates)}")
        if n_drops:
            print(f"node drops: {n_drops}")
        cap_ratio = med(caps) / med(bounds)
        print(f"shadow capacity (receive+check+place+AdamW, all node threads' CPU): "
              f"{med(caps) / 1e6:.1f} M params/s per core; rounds "
              f"{gb(f'{c / 1e6:.1f}' for c in caps)}")
        print(f"memory-copy bound ({BYTES_PER_PARAM} B/param over the same buffer sizes, one "
              f"core): {med(bounds) / 1e6:.1f} M params/s; rounds "
              f"{gb(f'{b / 1e6:.1f}' for b in bounds)}")
        lag = _commit_lag(a.elements, 2 * a.rounds)
        print(f"commit lag after the last datagram (idle shadow: step + commit, median of "
              f"{len(lag['into'])}): step into the next version {med(lag['into']) * 1e3:.2f} ms, "
              f"step in place then copy {med(lag['copy']) * 1e3:.2f} ms; into/copy ratio "
              f"{med(lag['into']) / med(lag['copy']):.3f}")
    print("GB/s and CPU us/dgram are medians over rounds. CPU us/dgram: the receiving thread's\n"
          "CPU time (user+system) per datagram, i.e. the cost when the receiver and not the\n"
          "loopback sender is the bottleneck. The ratio is against the faster raw loop.")
    print(f"MAC check: ingest with vs without it: bytes/s {ing_rate / med(plain_rates):.3f}, "
          f"CPU per datagram {med(cpu['ing']) / med(cpu['plain']):.3f} (one run, alternated)")
    if cap_ratio is not None:
        print(f"shadow capacity vs memory-copy bound ratio: {cap_ratio:.3f}")
    print(f"ingest vs raw UDP receive bytes/s ratio: {ing_rate / raw_rate:.3f}")
    return 0
