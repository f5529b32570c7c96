"""NCCL's profiler core as the harness (checkmate.testbed.nccl_harness) plays it for the
ckm plugin's identity path: the events NCCL 2.29+ starts (src/plugin/profiler.cc) and its
profiler callback for net-plugin events."""

from __future__ import annotations

import ctypes as C
import os

from checkmate.testbed import nccl_abi as abi
from checkmate.testbed.nccl_abi import ok as _ok


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

    def group(self) -> int | None:
        """The outermost group's GroupApi event (profiler.cc:246-262)."""
        return self._start(abi.PROFILE_GROUP_API, None)

    def coll_api(self, group: int | None) -> int | None:
        """A collective call's CollApi event, child of its group (profiler.cc:319-330)."""
        return self._start(abi.PROFILE_COLL_API, group)

    def coll(self, count: int, channels: int, algo: str = "", proto: str = "Simple",
             parent: int | None = None) -> int | None:
        self.seq += 1
        return self._start(abi.PROFILE_COLL, parent, seqNumber=self.seq - 1, func=b"AllReduce",
                           count=count, datatype=b"ncclFloat32", nChannels=channels, nWarps=16,
                           algo=(algo.encode() or self.algo), proto=proto.encode())

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
