"""NCCL stand-in: drives the ckm NCCL net plugin the way a given NCCL release runs a ring
allreduce with the Simple protocol, one process per rank (docs/nccl_plugin.md, "The
harness"). What NCCL does comes from checkmate.testbed.nccl_release, written from NCCL's
source, not from the plugin's schedule: the two can disagree. Per rank: a stand-in libnccl
answering ncclGetVersion, the plugin's net/tuner/profiler called as NCCL's setup, planner
and proxy thread call them (isends tagged with this rank, receives with the previous one,
4 in flight, test() until done), the reduction on the host.

    python -m checkmate.testbed.nccl_harness --rank R --nranks N --dir D --plugin LIB --ip A ...
"""

from __future__ import annotations

import argparse
import ctypes as C
import dataclasses
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
from checkmate.testbed import nccl_release as nr
from checkmate.testbed.nccl_abi import PluginError
from checkmate.testbed.nccl_abi import ok as _ok
from checkmate.testbed.nccl_profiler_core import NcclProfiler

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


@dataclass
class _Channel:
    send: C.c_void_p
    recv: C.c_void_p
    send_busy: list = field(default_factory=list)  # (request, array, event, phandle)
    recv_busy: deque = field(default_factory=deque)  # (request, buffer, index, event, ph)
    next_recv: int = 0
    done_recv: int = 0


@dataclass(frozen=True)
class _Slice:
    """One kernel slice on a channel: what its isend or irecv carries."""

    task: int
    key: tuple  # (task, call index on the channel, slice): a recv and its send share it
    kind: str
    start: int
    n: int
    op: int  # index of its proxy op in the plan


ALGOS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
PROTOS = ("LL", "LL128", "Simple")  # NCCL_ALGO_* / NCCL_PROTO_* indices (nccl_tuner.h)
FUNC_ALLREDUCE = 4  # ncclFuncAllReduce (nccl_common.h)


class Rank:
    """One rank: the plugin loaded, its ring connections, and run_plan()."""

    def __init__(self, plugin: str, rank: int, nranks: int, channels: int, buffsize: int,
                 rendezvous: Path, profiler: str = "off", algo: str = "Ring",
                 version: str = "2.29.7", standin: str | None = None,
                 tuner: bool = True, plays: str | None = None,
                 ring: list[int] | None = None) -> None:
        code = nr.version_code(version)
        rel = nr.release_of(code)
        # An unsupported release runs with the newest profile: the plugin must refuse it.
        # ``plays``: run another release's schedule than the one reported (a mismatch test).
        self.rel = (next(r for r in nr.RELEASES if r.name == plays) if plays
                    else rel or nr.RELEASES[-1])
        os.environ["NCCL_STANDIN_VERSION"] = str(code)
        if standin:  # libnccl's ncclGetVersion, global as in a process running NCCL
            C.CDLL(standin, mode=C.RTLD_GLOBAL)
        self.lib, self.version, self.net = abi.load(plugin)
        if self.version != "v12":
            raise PluginError(f"expected ncclNetPlugin_v12, the loader found {self.version}")
        self.rank, self.nranks, self.channels = rank, nranks, channels
        # The ring's order (NCCL's topology search picks it; rank order unless given): next,
        # previous and the ring index = distance from rank 0 (init.cc, setupChannel).
        order = ring or list(range(nranks))
        pos = order.index(rank)
        self.next, self.prev = order[(pos + 1) % nranks], order[pos - 1]
        self.ring_index = (pos - order.index(0)) % nranks
        self.buffsize, self.algo = buffsize, algo
        self.recv_bytes = buffsize // nr.NCCL_STEPS * nr.SLICESTEPS  # net.cc:1480
        comm_id = 0x636B6D
        # Profiler v6 exists from 2.29: an older NCCL never calls ncclProfiler_v6.
        use_prof = profiler != "off" and self.rel.profiler_v6
        self.prof = (NcclProfiler(self.lib, rank, nranks, comm_id, algo, True)
                     if use_prof else None)
        self.ctx = C.c_void_p()
        _ok(self.net.init(C.byref(self.ctx), comm_id, C.byref(abi.CommConfig(-1)), None,
                          C.cast(self.prof.callback, C.c_void_p) if self.prof else None),
            "init")
        n = C.c_int()
        _ok(self.net.devices(C.byref(n)), "devices")
        if n.value < 1:
            raise PluginError("the plugin reports no device")
        self.tuner = self.tctx = None
        if tuner:  # init.cc:1447: the tuner is initialized per communicator
            self.tuner = abi.Tuner5.in_dll(self.lib, "ncclTunerPlugin_v5")
            self.tctx = C.c_void_p()
            _ok(self.tuner.init(C.byref(self.tctx), comm_id, nranks, nranks, None, None, None),
                "tuner init")
        self.chans = self._connect(channels, rendezvous)

    def _tune(self, count: int) -> tuple[int, str, str]:
        """ncclGetAlgoInfo (enqueue.cc:2030-2087) as far as the tuner decides: its cost table
        and nChannels; topoGetAlgoInfo then takes the cheapest entry left."""
        if not self.tuner:
            return self.channels, self.algo, "Simple"
        table = (C.c_float * (len(ALGOS) * len(PROTOS)))(*([1.0] * len(ALGOS) * len(PROTOS)))
        nch = C.c_int(0)
        _ok(self.tuner.getCollInfo(self.tctx, FUNC_ALLREDUCE, count * 4, 1,
                                   C.cast(table, C.c_void_p), len(ALGOS), len(PROTOS), 0,
                                   C.byref(nch)), "getCollInfo")
        costs = [(v, i) for i, v in enumerate(table) if v >= 0]
        best = min(costs)[1]
        algo, proto = ALGOS[best // len(PROTOS)], PROTOS[best % len(PROTOS)]
        if self.algo != "Ring":  # a test makes NCCL report another algorithm
            algo = self.algo
        return nch.value or self.channels, algo, proto

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
        peer = rdv / f"handles-{self.next}.bin"
        deadline = time.monotonic() + SETUP_TIMEOUT
        while not peer.exists():
            if time.monotonic() > deadline:
                raise PluginError(f"rank {self.next} published no handles")
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
        """Sum of every rank's ``x`` (float32): one collective in its own kernel plan."""
        return self.run_plan([x])[0]

    def run_plan(self, xs: list[np.ndarray]) -> list[np.ndarray]:
        """Allreduces of ``xs`` in one kernel plan, as NCCL runs a group of collectives
        (more than one: collective packing)."""
        n = self.nranks
        # ncclPrepareTasks (enqueue.cc:389-466): the group's allreduces come out of the size
        # sorter largest first and are binned LIFO, so they are planned smallest first;
        # neighbours within 4x of the first of a run are aggregated, and the tuner is asked
        # once per aggregate, about its summed size.
        order = sorted(range(len(xs)), key=lambda t: -xs[t].size)[::-1]
        tuned: list[tuple[int, str, str]] = [(0, "", "")] * len(xs)
        i = 0
        while i < len(order):
            j = i + 1
            while j < len(order) and xs[order[j]].size < 4 * xs[order[i]].size:
                j += 1
            t = self._tune(sum(xs[k].size for k in order[i:j]))
            for k in order[i:j]:
                tuned[k] = t
            i = j
        n_max = min(t[0] for t in tuned)
        ops, used = nr.plan([xs[t].size for t in order], n, n_max, self.channels,
                            self.buffsize, self.rel)
        ops = [nr.ProxyOp(order[o.task], *dataclasses.astuple(o)[1:]) for o in ops]
        used = [used[order.index(t)] for t in range(len(xs))]
        ys = [np.zeros_like(x) for x in xs]
        # per channel: its kernel slices in order (tasks of the plan in order, then loops)
        sends: list[list[_Slice]] = [[] for _ in self.chans]
        recvs: list[list[_Slice]] = [[] for _ in self.chans]
        for k, op in enumerate(ops):
            base = len(sends[op.channel]) + len(recvs[op.channel])  # unique keys per channel
            for ci, (kind, _loop, off, nelem) in enumerate(nr.kernel_ops(op, n,
                                                                         self.ring_index)):
                for j, (a, m) in enumerate(nr.slices(nelem, self.buffsize)):
                    sl = _Slice(op.task, (op.task, base + ci, j), kind, off + a, m, k)
                    if kind in nr.SENDS:
                        sends[op.channel].append(sl)
                    if kind in nr.RECEIVES:
                        recvs[op.channel].append(sl)
        prof = self.prof
        colls: list[int | None] = [None] * len(xs)
        if prof:  # the group's API events, then each task's Coll at plan launch
            group = prof.group()
            apis = [prof.coll_api(group) for _ in xs]
            for h in (*apis, group):
                prof.stop(h)
            colls = [prof.coll(x.size, used[t], tuned[t][1], tuned[t][2], apis[t])
                     for t, x in enumerate(xs)]
        pops = [(prof.op(colls[op.task], op.channel, self.next, op.prof_nsteps,
                         op.prof_chunk, True),
                 prof.op(colls[op.task], op.channel, self.prev, op.prof_nsteps,
                         op.prof_chunk, False)) if prof else (None, None) for op in ops]
        step_of: dict[tuple, int] = {}  # ProxyStep step: slices of its op before it, per side
        for lst in (*sends, *recvs):
            per_op: dict[int, int] = {}
            for sl in lst:
                step_of[(id(lst), sl.key)] = per_op.get(sl.op, 0)
                per_op[sl.op] = per_op.get(sl.op, 0) + 1
        ready: list[dict[tuple, np.ndarray]] = [
            {sl.key: np.ascontiguousarray(xs[sl.task][sl.start:sl.start + sl.n])
             for sl in sends[ch] if sl.kind == nr.SEND} for ch in range(len(self.chans))]
        next_send = [0] * len(self.chans)
        for st in self.chans:
            st.next_recv = st.done_recv = 0
        deadline = time.monotonic() + RUN_TIMEOUT
        while any(st.done_recv < len(recvs[ch]) or next_send[ch] < len(sends[ch])
                  or st.send_busy for ch, st in enumerate(self.chans)):
            if time.monotonic() > deadline:
                raise PluginError("allreduce made no progress in time")
            for ch, st in enumerate(self.chans):
                self._progress_recv(ch, st, recvs[ch], xs, ys, ready[ch], pops, step_of)
                self._progress_send(ch, st, sends[ch], ready[ch], next_send, pops, step_of)
        if prof:
            for sop, rop in pops:
                prof.stop(sop)
                prof.stop(rop)
            for c in colls:
                prof.stop(c)
        return ys

    def _progress_recv(self, ch: int, st: _Channel, plan: list[_Slice], xs: list, ys: list,
                       ready: dict, pops: list, step_of: dict) -> None:
        prof = self.prof
        while len(st.recv_busy) < DEPTH and st.next_recv < len(plan):  # net.cc:1450-1510
            sl = plan[st.next_recv]
            buf = np.zeros(self.recv_bytes // 4, np.float32)
            req = C.c_void_p()
            ptr = (C.c_void_p * 1)(buf.ctypes.data)
            size = (C.c_size_t * 1)(self.recv_bytes)
            tag = (C.c_int * 1)(self.prev)  # tpRemoteRank
            ev, ph = (prof.step(pops[sl.op][1], step_of[(id(plan), sl.key)]) if prof
                      else (None, None))
            _ok(self.net.irecv(st.recv, 1, ptr, size, tag, None, (C.c_void_p * 1)(ph),
                               C.byref(req)), "irecv")
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
            sl = plan[i]
            if got.value != 4 * sl.n:
                raise PluginError(f"received {got.value} bytes, expected {4 * sl.n}")
            data = buf[:sl.n]
            a, b, x, y = sl.start, sl.start + sl.n, xs[sl.task], ys[sl.task]
            if sl.kind == nr.RRS:
                ready[sl.key] = data + x[a:b]
            elif sl.kind == nr.RRCS:  # the final result, sent on
                y[a:b] = data + x[a:b]
                ready[sl.key] = y[a:b].copy()
            else:  # recvCopySend, recv
                y[a:b] = data
                if sl.kind == nr.RCS:
                    ready[sl.key] = data.copy()

    def _progress_send(self, ch: int, st: _Channel, plan: list[_Slice], ready: dict,
                       next_send: list[int], pops: list, step_of: dict) -> None:
        prof = self.prof
        while (len(st.send_busy) < DEPTH and next_send[ch] < len(plan)
               and plan[next_send[ch]].key in ready):  # net.cc:1291-1353
            sl = plan[next_send[ch]]
            arr = ready[sl.key]
            req = C.c_void_p()
            ev, ph = (prof.step(pops[sl.op][0], step_of[(id(plan), sl.key)]) if prof
                      else (None, None))
            _ok(self.net.isend(st.send, C.c_void_p(arr.ctypes.data), arr.nbytes, self.rank,
                               None, ph, C.byref(req)), "isend")  # tag: own tpRank
            if not req.value:
                if prof:
                    prof.end_step(ev, ph)
                break
            del ready[sl.key]
            st.send_busy.append((req, arr, ev, ph))
            next_send[ch] += 1
        for item in list(st.send_busy):
            done, got = C.c_int(), C.c_int()
            _ok(self.net.test(item[0], C.byref(done), C.byref(got)), "test(send)")
            if done.value:
                st.send_busy.remove(item)
                if prof:
                    prof.end_step(item[2], item[3])

    def close(self) -> None:
        for st in self.chans:
            _ok(self.net.closeSend(st.send), "closeSend")
            _ok(self.net.closeRecv(st.recv), "closeRecv")
        _ok(self.net.finalize(self.ctx), "finalize")
        if self.tuner:
            _ok(self.tuner.finalize(self.tctx), "tuner finalize")
        if self.prof:
            _ok(self.prof.prof.finalize(self.prof.ctx), "profiler finalize")


def run_rank(args: argparse.Namespace) -> None:
    buckets = [int(b) for b in args.buckets.split(",")]
    rdv = Path(args.dir)
    rank = Rank(args.plugin, args.rank, args.nranks, args.channels, args.buffsize, rdv,
                args.profiler, args.algo, args.version,
                str(Path(args.plugin).with_name("libnccl-standin.so")), args.tuner == "on",
                args.plays, [int(x) for x in args.ring.split(",")] if args.ring else None)
    outs = []
    for it in range(args.first_iteration, args.first_iteration + args.iterations):
        xs = [inputs(args.seed, it, b, args.rank, n) for b, n in enumerate(buckets)]
        ys: list[np.ndarray] = []
        for g in range(0, len(xs), args.group):  # a group of collectives: one kernel plan
            ys += rank.run_plan(xs[g:g + args.group])
        outs.append(np.concatenate(ys))
    # Wait for every rank before closing, as NCCL's communicator teardown does.
    (rdv / f"done-{args.rank}").touch()
    deadline = time.monotonic() + SETUP_TIMEOUT
    while not all((rdv / f"done-{r}").exists() for r in range(args.nranks)):
        if time.monotonic() > deadline:
            raise PluginError("other ranks did not finish")
        time.sleep(0.01)
    rank.close()
    np.save(rdv / f"out-{args.rank}.npy", np.stack(outs))
    # A trainer outlives its last allreduce: its repair service (the plugin's thread) answers
    # the shadows' requests until the caller creates the linger file.
    deadline = time.monotonic() + 120.0
    while args.linger and not Path(args.linger).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def launch(nranks: int, workdir: Path, plugin: str, ips: list[str], *, channels: int = 4,
           buffsize: int = 1 << 16, buckets: list[int], iterations: int, seed: int = 1,
           partitions: int = 2, job: int = 7, first_iteration: int = 1, tag: bool = True,
           popen=None, timeout: float = 150.0, profiler: str = "off",
           algo: str = "Ring", version: str = "2.29.7", tuner: bool = True,
           group: int = 1, plays: str | None = None,
           linger: Path | None = None, ring: list[int] | None = None) -> list[np.ndarray]:
    """Run ``nranks`` rank processes (``popen(rank, argv, env)`` starts one, default a plain
    subprocess) and return each rank's results, shape (iterations, sum(buckets)); each
    rank's output is in ``workdir/rank<r>.log``. ``version``: the NCCL release played;
    ``profiler``: off (the plugin places isends by its schedule alone) or callback (by the
    profiler events, as NCCL 2.29+ issues them); ``tuner``: NCCL loads the plugin's tuner;
    ``group``: allreduces per kernel plan (over 1: collective packing); ``plays``: the
    release profile whose schedule is run while ``version`` is reported (a mismatch);
    ``linger``: ranks stay up (repair service on) until this file exists; ``ring``: the
    ring's order (default the rank order). Ranks sharing an
    address keep no pieces for repair (one repair port per address)."""
    workdir.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for r in range(nranks):
            env = dict(os.environ)
            env.update(plugin_env(r, nranks, channels, buffsize, buckets if tag else [],
                                  partitions, job, ips[r], first_iteration))
            env["CKM_NCCL_STATS"] = str(workdir / f"stats-{r}.jsonl")
            if len(set(ips)) < nranks:
                env["CKM_NCCL_REPAIR_KEEP"] = "0"
            argv = [sys.executable, "-m", "checkmate.testbed.nccl_harness", "--rank", str(r),
                    "--nranks", str(nranks), "--dir", str(workdir), "--plugin", plugin,
                    "--channels", str(channels), "--buffsize", str(buffsize),
                    "--buckets", ",".join(map(str, buckets)), "--iterations", str(iterations),
                    "--seed", str(seed), "--first-iteration", str(first_iteration),
                    "--profiler", profiler, "--algo", algo, "--version", version,
                    "--tuner", "on" if tuner else "off", "--group", str(group)]
            if plays:
                argv += ["--plays", plays]
            if linger:
                argv += ["--linger", str(linger)]
            if ring:
                argv += ["--ring", ",".join(map(str, ring))]
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


def _stat_lines(workdir: Path, r: int) -> list[dict]:
    return [json.loads(line) for line in (workdir / f"stats-{r}.jsonl").read_text().split("\n")
            if line]


def stats(workdir: Path, nranks: int) -> list[list[dict]]:
    """Each rank's per-connection counters (CKM_NCCL_STATS lines)."""
    return [[x for x in _stat_lines(workdir, r) if x["kind"] != "repair"] for r in range(nranks)]


def repair_stats(workdir: Path, nranks: int) -> list[dict]:
    """Each rank's repair service counters (requests, answered, gone, dropped); {} if none."""
    return [next((x for x in _stat_lines(workdir, r) if x["kind"] == "repair"), {})
            for r in range(nranks)]


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
    ap.add_argument("--profiler", choices=["off", "callback"], default="off")
    ap.add_argument("--algo", default="Ring", help="what the Coll events report")
    ap.add_argument("--version", default="2.29.7", help="the NCCL release played")
    ap.add_argument("--tuner", choices=["on", "off"], default="on")
    ap.add_argument("--group", type=int, default=1, help="allreduces per kernel plan")
    ap.add_argument("--plays", default=None, help="release profile run instead (a mismatch)")
    ap.add_argument("--linger", default=None, help="stay up until this file exists")
    ap.add_argument("--ring", default=None, help="the ring's order, e.g. 0,4,1,2,3")
    run_rank(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
