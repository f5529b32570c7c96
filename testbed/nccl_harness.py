"""NCCL stand-in: drives the ckm NCCL net plugin exactly as NCCL's ring allreduce with the
Simple protocol would, one process per rank (docs/nccl_plugin.md, "The harness").

Each rank dlopens the plugin, calls init/listen/connect/accept as NCCL's transport setup
does (connect and accept return NULL until done, the handle keeps connect's state), then
runs allreduces the way NCCL's proxy thread feeds a ring: per channel, the kernel steps of
testbed/nccl_schedule.py, one isend/irecv per slice, at most NCCL_STEPS / SLICESTEPS = 4 in
flight each way, receives posted ahead, every request polled with test() until done. The
reduction is done here on the host (NCCL does it on the GPU) in the kernel's step order.

With ``--profiler direct|callback`` it also plays NCCL's profiler core (NcclProfiler).

What it does not model: GPU kernels and their timing, NCCL's tuner (it always runs the
pinned ring/Simple schedule), LL/LL128, tree and NVLS algorithms, several communicators.

    python -m checkmate.testbed.nccl_harness --rank R --nranks N --dir D --plugin LIB --ip A ...
"""

from __future__ import annotations

import argparse
import ctypes as C
import json
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from checkmate.testbed import nccl_abi as abi
from checkmate.testbed.nccl_schedule import SLICES, Ring

DEPTH = 4  # slices in flight per direction and channel: NCCL_STEPS / ALLREDUCE_SLICESTEPS
SETUP_TIMEOUT = 60.0
RUN_TIMEOUT = 120.0


def inputs(seed: int, iteration: int, bucket: int, rank: int, n: int) -> np.ndarray:
    """A rank's gradient: multiples of 1/64 in [-8, 8], so every sum of a few ranks is exact
    in float32 whatever the order of the additions (NCCL's order differs from ours)."""
    g = np.random.default_rng([seed, iteration, bucket, rank])
    return (g.integers(-512, 513, n) / 64).astype(np.float32)


def expected(seed: int, iteration: int, bucket: int, nranks: int, n: int) -> np.ndarray:
    tot = sum(inputs(seed, iteration, bucket, r, n).astype(np.float64) for r in range(nranks))
    return tot.astype(np.float32)


def plugin_env(rank: int, nranks: int, channels: int, buffsize: int, buckets: list[int],
               partitions: int, job: int, ip: str, first_iteration: int = 1) -> dict[str, str]:
    """The environment a job sets for the plugin and NCCL (docs/nccl_plugin.md)."""
    env = {"CKM_NCCL_IP": ip, "CKM_NCCL_RANK": str(rank), "CKM_NCCL_NRANKS": str(nranks),
           "CKM_NCCL_CHANNELS": str(channels), "NCCL_BUFFSIZE": str(buffsize),
           "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": str(channels),
           "NCCL_MAX_NCHANNELS": str(channels), "CKM_NCCL_JOB": str(job),
           "CKM_NCCL_PARTITIONS": str(partitions),
           "CKM_NCCL_ITERATION": str(first_iteration), "CKM_NCCL_TIMEOUT": "60"}
    if buckets:
        env["CKM_NCCL_BUCKETS"] = ",".join(map(str, buckets))
    return env


class PluginError(RuntimeError):
    pass


def _ok(res: int, what: str) -> None:
    if res != abi.SUCCESS:
        raise PluginError(f"{what} returned ncclResult {res}")


@dataclass
class _Channel:
    send: C.c_void_p
    recv: C.c_void_p
    sends: deque = field(default_factory=deque)  # (index, array) ready to post, in order
    send_busy: list = field(default_factory=list)  # (request, array)
    recv_busy: deque = field(default_factory=deque)  # (request, buffer, size var, index)
    next_recv: int = 0
    done_recv: int = 0


class NcclProfiler:
    """NCCL's profiler core as far as the identity path needs it: ``ncclProfiler_v6`` from
    the plugin's library, Coll / ProxyOp / ProxyStep events started and stopped as NCCL
    does (a collective at enqueue, a send and a recv op per channel, a step per posted
    slice), and the net plugin's profiler callback answered as NCCL's core answers it (a
    NetPlugin event whose parent is the step's event). ``via_callback``: the phandle given
    to isend is an opaque token of ours (as NCCL passes its own object), so the plugin must
    take the callback route; else it is the step's event handle itself."""

    _MEMBER = {abi.PROFILE_COLL: "coll", abi.PROFILE_PROXY_OP: "proxyOp",
               abi.PROFILE_PROXY_STEP: "proxyStep", abi.PROFILE_NET_PLUGIN: "netPlugin"}

    def __init__(self, lib: C.CDLL, rank: int, nranks: int, comm_id: int, algo: str,
                 via_callback: bool) -> None:
        self.prof = abi.Profiler6.in_dll(lib, "ncclProfiler_v6")
        self.ctx, mask = C.c_void_p(), C.c_int(0)
        _ok(self.prof.init(C.byref(self.ctx), comm_id, C.byref(mask), b"harness", 1, nranks,
                           rank, None), "profiler init")
        self.mask, self.rank, self.algo = mask.value, rank, algo.encode()
        self.via_callback, self.seq = via_callback, 0
        self.tokens: dict[int, int] = {}
        self._token = 0x1000
        self.callback = abi.PROF_CALLBACK(self._callback)  # kept alive with self

    def _start(self, kind: int, parent: int | None, **fields: object) -> int | None:
        if not self.mask & kind:
            return None  # NCCL starts only the events the plugin activated
        d = abi.EventDescr6(type=kind, parentObj=parent, rank=self.rank)
        for k, v in fields.items():
            setattr(getattr(d, self._MEMBER[kind]), k, v)
        h = C.c_void_p()
        _ok(self.prof.startEvent(self.ctx, C.byref(h), C.byref(d)), "startEvent")
        return h.value

    def stop(self, h: int | None) -> None:
        if h:
            _ok(self.prof.stopEvent(h), "stopEvent")

    def coll(self, count: int, channels: int) -> int | None:
        self.seq += 1
        return self._start(abi.PROFILE_COLL, None, seqNumber=self.seq - 1, func=b"AllReduce",
                           count=count, datatype=b"ncclFloat32", nChannels=channels, nWarps=16,
                           algo=self.algo, proto=b"Simple")

    def op(self, coll: int | None, ch: int, peer: int, nsteps: int, chunk: int,
           is_send: bool) -> int | None:
        return self._start(abi.PROFILE_PROXY_OP, coll, pid=os.getpid(), channelId=ch,
                           peer=peer, nSteps=nsteps, chunkSize=chunk, isSend=int(is_send))

    def step(self, op: int | None, step: int) -> tuple[int | None, int | None]:
        """(the step's event, the phandle NCCL would pass to isend/irecv for it)."""
        h = self._start(abi.PROFILE_PROXY_STEP, op, step=step)
        if not self.via_callback or h is None:
            return h, h
        self._token += 8
        self.tokens[self._token] = h
        return h, self._token

    def end_step(self, h: int | None, phandle: int | None) -> None:
        self.tokens.pop(phandle, None)
        self.stop(h)

    def _callback(self, ehandle, kind, phandle, plugin_id, data):  # noqa: ANN001, ANN202
        if kind == abi.NET_EVENT_START:
            parent = self.tokens.get(phandle) if self.via_callback else phandle
            h = self._start(abi.PROFILE_NET_PLUGIN, parent, id=plugin_id, data=data)
            ehandle[0] = h
        elif kind == abi.NET_EVENT_STOP and ehandle[0]:
            self.stop(ehandle[0])
        return abi.SUCCESS


class Rank:
    """One rank: the plugin loaded, its ring connections, and allreduce()."""

    def __init__(self, plugin: str, rank: int, nranks: int, channels: int, buffsize: int,
                 rendezvous: Path, profiler: str = "off", algo: str = "Ring") -> None:
        self.lib, self.version, self.net = abi.load(plugin)
        if self.version != "v12":
            raise PluginError(f"expected ncclNetPlugin_v12, the loader found {self.version}")
        self.rank, self.nranks, self.ring = rank, nranks, Ring(nranks, channels, buffsize)
        self.slice_bytes = buffsize // 8 * 2  # a receive buffer: SLICESTEPS steps
        comm_id = 0x636B6D
        # NCCL initializes the profiler plugin before the net plugin of a communicator.
        self.prof = (NcclProfiler(self.lib, rank, nranks, comm_id, algo,
                                  profiler == "callback") if profiler != "off" else None)
        self.ctx = C.c_void_p()
        _ok(self.net.init(C.byref(self.ctx), comm_id, C.byref(abi.CommConfig(-1)), None,
                          C.cast(self.prof.callback, C.c_void_p) if self.prof else None),
            "init")
        n = C.c_int()
        _ok(self.net.devices(C.byref(n)), "devices")
        if n.value < 1:
            raise PluginError("the plugin reports no device")
        self.chans = self._connect(channels, rendezvous)

    def _connect(self, channels: int, rdv: Path) -> list[_Channel]:
        handles, listens = [], []
        for _ in range(channels):
            h = (C.c_char * abi.HANDLE_MAXSIZE)()
            lc = C.c_void_p()
            _ok(self.net.listen(self.ctx, 0, h, C.byref(lc)), "listen")
            handles.append(h)
            listens.append(lc)
        tmp = rdv / f".handles-{self.rank}.tmp"
        tmp.write_bytes(b"".join(bytes(h) for h in handles))
        tmp.rename(rdv / f"handles-{self.rank}.bin")
        peer = rdv / f"handles-{(self.rank + 1) % self.nranks}.bin"
        deadline = time.monotonic() + SETUP_TIMEOUT
        while not peer.exists():
            if time.monotonic() > deadline:
                raise PluginError(f"rank {(self.rank + 1) % self.nranks} published no handles")
            time.sleep(0.01)
        blob = peer.read_bytes()
        # NCCL's setup loop: connect and accept every channel, each call non-blocking.
        theirs = [(C.c_char * abi.HANDLE_MAXSIZE).from_buffer_copy(
            blob[i * abi.HANDLE_MAXSIZE:(i + 1) * abi.HANDLE_MAXSIZE]) for i in range(channels)]
        sends = [C.c_void_p() for _ in range(channels)]
        recvs = [C.c_void_p() for _ in range(channels)]
        dev = C.POINTER(abi.DeviceHandle)()
        while not all(s.value for s in sends) or not all(r.value for r in recvs):
            for i in range(channels):
                # Channel order: connection k of this communicator is channel k.
                if not sends[i].value and all(s.value for s in sends[:i]):
                    _ok(self.net.connect(self.ctx, 0, theirs[i], C.byref(sends[i]),
                                         C.byref(dev)), "connect")
                if not recvs[i].value:
                    _ok(self.net.accept(listens[i], C.byref(recvs[i]), C.byref(dev)), "accept")
            if time.monotonic() > deadline:
                raise PluginError("ring setup did not finish")
            time.sleep(0.0005)
        for lc in listens:
            _ok(self.net.closeListen(lc), "closeListen")
        return [_Channel(s, r) for s, r in zip(sends, recvs, strict=True)]

    def allreduce(self, x: np.ndarray) -> np.ndarray:
        """Sum of every rank's ``x`` (float32), by the ring schedule over the plugin."""
        ring, r, n = self.ring, self.rank, self.nranks
        count, y = x.size, np.zeros_like(x)
        steps = ring.kernel_steps() - 1  # sending (and receiving) steps per loop
        plans = []
        for ch, st in enumerate(self.chans):
            st.sends.clear()
            st.next_recv = st.done_recv = 0
            loops = ring.loops(count)
            # index -> (start, stop, kernel step) for sends (step t) and receives (step t+1)
            plan = [(a, b, t, lp) for lp in range(loops) for t in range(steps)
                    for a, b in ring.slices(*ring.chunk_range(count, lp, ch,
                                                              ring.step_chunk(r, t)))]
            rplan = [(a, b, t + 1, lp) for lp in range(loops) for t in range(steps)
                     for a, b in ring.slices(*ring.chunk_range(count, lp, ch,
                                                               ring.step_chunk(r, t + 1)))]
            assert [(a, b) for a, b, _, _ in plan] == [(a, b) for a, b, _ in
                                                       ring.sends(r, count, ch)]
            for i, (a, b, t, _) in enumerate(plan):
                if t == 0:  # send: own data, ready at once
                    st.sends.append((i, np.ascontiguousarray(x[a:b])))
            plans.append((plan, rplan))
        prof, chunk_bytes = self.prof, ring.chunk * 4
        coll = prof.coll(count, len(self.chans)) if prof else None
        ops = [(prof.op(coll, ch, (r + 1) % n, 2 * len(plans[ch][0]), chunk_bytes, True),
                prof.op(coll, ch, (r - 1) % n, 2 * len(plans[ch][1]), chunk_bytes, False))
               if prof else (None, None) for ch in range(len(self.chans))]
        pending = {ch: sorted(st.sends) for ch, st in enumerate(self.chans)}
        for ch, st in enumerate(self.chans):
            st.sends = deque(pending[ch])
        next_send = [0] * len(self.chans)
        ready: list[dict[int, np.ndarray]] = [dict(st.sends) for st in self.chans]
        deadline = time.monotonic() + RUN_TIMEOUT
        while any(st.done_recv < len(plans[ch][1]) or next_send[ch] < len(plans[ch][0])
                  or st.send_busy for ch, st in enumerate(self.chans)):
            if time.monotonic() > deadline:
                raise PluginError("allreduce made no progress in time")
            for ch, st in enumerate(self.chans):
                plan, rplan = plans[ch]
                # receives: posted in order, up to DEPTH ahead
                while len(st.recv_busy) < DEPTH and st.next_recv < len(rplan):
                    buf = np.zeros(self.slice_bytes // 4, np.float32)
                    req = C.c_void_p()
                    ptr = (C.c_void_p * 1)(buf.ctypes.data)
                    size = (C.c_size_t * 1)(self.slice_bytes)
                    tag = (C.c_int * 1)((r - 1) % n)
                    ev, ph = prof.step(ops[ch][1], 2 * st.next_recv) if prof else (None, None)
                    _ok(self.net.irecv(st.recv, 1, ptr, size, tag, None,
                                       (C.c_void_p * 1)(ph), C.byref(req)), "irecv")
                    if not req.value:
                        if prof:
                            prof.end_step(ev, ph)
                        break
                    st.recv_busy.append((req, buf, st.next_recv, ev, ph))
                    st.next_recv += 1
                while st.recv_busy:
                    req, buf, i, ev, ph = st.recv_busy[0]
                    done, got = C.c_int(), C.c_int()
                    _ok(self.net.test(req, C.byref(done), C.byref(got)), "test(recv)")
                    if not done.value:
                        break
                    st.recv_busy.popleft()
                    if prof:
                        prof.end_step(ev, ph)
                    st.done_recv += 1
                    a, b, t, _ = rplan[i]
                    if got.value != 4 * (b - a):
                        raise PluginError(f"received {got.value} bytes, expected {4 * (b - a)}")
                    data = buf[: b - a]
                    # Receive i is kernel step t; that step's send is send i + SLICES.
                    j = i + SLICES
                    if t < n - 1:  # recvReduceSend
                        ready[ch][j] = data + x[a:b]
                    elif t == n - 1:  # recvReduceCopySend: the final result
                        y[a:b] = data + x[a:b]
                        ready[ch][j] = y[a:b].copy()
                    else:  # recvCopySend, and the last recv
                        y[a:b] = data
                        if t < 2 * n - 2:
                            ready[ch][j] = data.copy()
                # sends: in order, when their data is ready, up to DEPTH in flight
                while (len(st.send_busy) < DEPTH and next_send[ch] < len(plan)
                       and next_send[ch] in ready[ch]):
                    arr = ready[ch][next_send[ch]]
                    req = C.c_void_p()
                    ev, ph = prof.step(ops[ch][0], 2 * next_send[ch]) if prof else (None, None)
                    _ok(self.net.isend(st.send, C.c_void_p(arr.ctypes.data), arr.nbytes,
                                       (r + 1) % n, None, ph, C.byref(req)), "isend")
                    if not req.value:
                        if prof:
                            prof.end_step(ev, ph)
                        break
                    del ready[ch][next_send[ch]]
                    st.send_busy.append((req, arr, ev, ph))
                    next_send[ch] += 1
                for item in list(st.send_busy):
                    done, got = C.c_int(), C.c_int()
                    _ok(self.net.test(item[0], C.byref(done), C.byref(got)), "test(send)")
                    if done.value:
                        st.send_busy.remove(item)
                        if prof:
                            prof.end_step(item[2], item[3])
        if prof:
            for sop, rop in ops:
                prof.stop(sop)
                prof.stop(rop)
            prof.stop(coll)
        return y

    def close(self) -> None:
        for st in self.chans:
            _ok(self.net.closeSend(st.send), "closeSend")
            _ok(self.net.closeRecv(st.recv), "closeRecv")
        _ok(self.net.finalize(self.ctx), "finalize")
        if self.prof:
            _ok(self.prof.prof.finalize(self.prof.ctx), "profiler finalize")


def run_rank(args: argparse.Namespace) -> None:
    buckets = [int(b) for b in args.buckets.split(",")]
    rdv = Path(args.dir)
    rank = Rank(args.plugin, args.rank, args.nranks, args.channels, args.buffsize, rdv,
                args.profiler, args.algo)
    outs = []
    for it in range(args.first_iteration, args.first_iteration + args.iterations):
        outs.append(np.concatenate([rank.allreduce(inputs(args.seed, it, b, args.rank, n))
                                    for b, n in enumerate(buckets)]))
    # Wait for every rank before closing, as NCCL's communicator teardown does.
    (rdv / f"done-{args.rank}").touch()
    deadline = time.monotonic() + SETUP_TIMEOUT
    while not all((rdv / f"done-{r}").exists() for r in range(args.nranks)):
        if time.monotonic() > deadline:
            raise PluginError("other ranks did not finish")
        time.sleep(0.01)
    rank.close()
    np.save(rdv / f"out-{args.rank}.npy", np.stack(outs))


def launch(nranks: int, workdir: Path, plugin: str, ips: list[str], *, channels: int = 4,
           buffsize: int = 1 << 16, buckets: list[int], iterations: int, seed: int = 1,
           partitions: int = 2, job: int = 7, first_iteration: int = 1, tag: bool = True,
           popen=None, timeout: float = 150.0, profiler: str = "off",
           algo: str = "Ring") -> list[np.ndarray]:
    """Run ``nranks`` rank processes (``popen(rank, argv, env)`` starts one, default a plain
    subprocess) and return each rank's results, shape (iterations, sum(buckets)).
    ``profiler``: off (the plugin places isends by the schedule model), direct or callback
    (by the profiler events the harness issues, see NcclProfiler)."""
    workdir.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for r in range(nranks):
            env = dict(os.environ)
            env.update(plugin_env(r, nranks, channels, buffsize, buckets if tag else [],
                                  partitions, job, ips[r], first_iteration))
            env["CKM_NCCL_STATS"] = str(workdir / f"stats-{r}.jsonl")
            argv = [sys.executable, "-m", "checkmate.testbed.nccl_harness", "--rank", str(r),
                    "--nranks", str(nranks), "--dir", str(workdir), "--plugin", plugin,
                    "--channels", str(channels), "--buffsize", str(buffsize),
                    "--buckets", ",".join(map(str, buckets)), "--iterations", str(iterations),
                    "--seed", str(seed), "--first-iteration", str(first_iteration),
                    "--profiler", profiler, "--algo", algo]
            if profiler != "off":
                env["CKM_NCCL_IDENTITY"] = "profiler"
            log = open(workdir / f"rank{r}.log", "wb")  # noqa: SIM115 - closed below
            start = popen or (lambda _r, a, e, log=log: subprocess.Popen(
                a, env=e, stdout=log, stderr=log, cwd=Path(__file__).resolve().parent.parent))
            procs.append((start(r, argv, env), log))
        deadline = time.monotonic() + timeout
        for p, _ in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    bad = [r for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if bad:
        logs = "".join(f"\n--- rank {r}\n" + (workdir / f"rank{r}.log").read_text()[-1500:]
                       for r in bad)
        raise PluginError(f"ranks {bad} failed:{logs}")
    return [np.load(workdir / f"out-{r}.npy") for r in range(nranks)]


def stats(workdir: Path, nranks: int) -> list[list[dict]]:
    """Each rank's per-connection counters (CKM_NCCL_STATS lines)."""
    return [[json.loads(line) for line in (workdir / f"stats-{r}.jsonl").read_text().split("\n")
             if line] for r in range(nranks)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--nranks", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--plugin", required=True)
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--buffsize", type=int, default=1 << 16)
    ap.add_argument("--buckets", required=True)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--first-iteration", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profiler", choices=["off", "direct", "callback"], default="off")
    ap.add_argument("--algo", default="Ring", help="what the Coll events report")
    run_rank(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ----- what a switch would copy ----------------------------------------------------------
class ReplicaTap:
    """Every REPLICATE datagram of job ``job`` seen on interface ``ifname`` (an AF_PACKET
    socket: needs root), collected by a thread -- what the switch copies to the shadows.
    Used on loopback, where there is no switch."""

    def __init__(self, ifname: str, job: int) -> None:
        import socket
        import threading

        self.job, self.datagrams = job, []
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0800))
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE
        self.sock.bind((ifname, 0x0800))
        self.sock.settimeout(0.1)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        from checkmate.protocol import wire

        while not self._stop.is_set():
            try:
                pkt, addr = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            if addr[2] == 4:  # PACKET_OUTGOING: loopback shows each packet twice
                continue
            ihl = (pkt[0] & 0xF) * 4
            if pkt[9] != 17 or len(pkt) < ihl + 8 + wire.HEADER_LEN:
                continue
            dport = int.from_bytes(pkt[ihl + 2:ihl + 4], "big")
            body = pkt[ihl + 8:]
            if (wire.is_ckm_port(dport) and body[3] & wire.Flags.REPLICATE
                    and int.from_bytes(body[4:8], "big") == self.job):
                self.datagrams.append(bytes(body))

    def close(self) -> list[bytes]:
        self._stop.set()
        self._t.join(2)
        self.sock.close()
        return self.datagrams


def check_replicas(datagrams: list[bytes], key: tuple[int, int], job: int,
                   buckets: list[int], first_iteration: int, iterations: int, partitions: int,
                   expect: dict[int, np.ndarray]) -> dict[str, int]:
    """Raises AssertionError unless the REPLICATE datagrams carry every reduced element of
    every iteration exactly once (a resent datagram is the same bytes: the shadow drops it
    as a duplicate), at its flat offset, with its owner partition, a valid CRC and a valid
    data MAC, and the value the allreduce produced (``expect[iteration]``)."""
    from checkmate.protocol import datamac, wire
    from checkmate.spec.partition import partition_bounds

    total = sum(buckets)
    bounds = partition_bounds(total, partitions)
    seen: dict[tuple[int, int, int], bytes] = {}
    resent = 0
    for d in datagrams:
        h, payload = wire.decode(d)  # raises on a bad CRC or length
        assert h.dtype == wire.DType.FLOAT32, h
        tag = datamac.data_tag(key, job, h.flags, h.iteration, h.offset, h.count, h.partition,
                               h.dtype, h.crc32c)
        assert tag == (h.fec_index, h.fec_k, h.fec_m, h.fec_group), f"bad MAC: {h}"
        lo, hi = bounds[h.partition]
        assert lo <= h.offset and h.offset + h.count <= hi, f"piece outside partition: {h}"
        assert h.count <= wire.MAX_PAYLOAD_JUMBO // 4, h
        k = (h.iteration, h.offset, h.count)
        if k in seen:
            assert seen[k] == bytes(payload), f"two different payloads for {k}"
            resent += 1
        seen[k] = bytes(payload)
    its = range(first_iteration, first_iteration + iterations)
    cover = {it: np.zeros(total, np.int32) for it in its}
    for (it, off, n), payload in seen.items():
        assert it in cover, f"iteration {it} outside {list(its)}"
        cover[it][off:off + n] += 1
        got = np.frombuffer(payload, "<f4")
        assert np.array_equal(got, expect[it][off:off + n]), f"wrong values at {it}:{off}"
    for it, c in cover.items():
        assert c.min() == 1 and c.max() == 1, (
            f"iteration {it}: {int((c == 0).sum())} elements missing, "
            f"{int((c > 1).sum())} sent more than once")
    return {"pieces": len(seen), "resent": resent}
