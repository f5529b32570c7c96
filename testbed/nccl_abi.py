"""The NCCL net-plugin ABI (ncclNet_v10/v11/v12) as ctypes declarations, and the documented
layout they must have (docs/nccl_plugin.md, "ABI"): the harness calls the plugin through
these, and tests/test_nccl_abi.py checks both the declarations and the plugin against
``LAYOUT``. Written from NCCL's plugin interface documentation (plugins/net), LP64."""

from __future__ import annotations

import ctypes as C

RESULT = C.c_int  # ncclResult_t
SUCCESS, SYSTEM_ERROR, INTERNAL_ERROR, INVALID_ARGUMENT, INVALID_USAGE, REMOTE_ERROR = (
    0, 2, 3, 4, 5, 6)
HANDLE_MAXSIZE = 128
PTR_HOST = 1
#: The versions the loader tries, newest first (NCCL 2.30 tries v12 down to v6).
LOADER_ORDER = ("v12", "v11", "v10", "v9", "v8", "v7", "v6")


class DeviceHandle(C.Structure):
    _fields_ = [("netDeviceType", C.c_int), ("netDeviceVersion", C.c_int),
                ("handle", C.c_void_p), ("size", C.c_size_t), ("needsProxyProgress", C.c_int)]


class VProps10(C.Structure):
    _fields_ = [("ndevs", C.c_int), ("devs", C.c_int * 4)]


class VProps12(C.Structure):
    _fields_ = [("ndevs", C.c_int), ("devs", C.c_int * 8)]


def _props_fields(vprops: type) -> list[tuple[str, object]]:
    return [("name", C.c_char_p), ("pciPath", C.c_char_p), ("guid", C.c_uint64),
            ("ptrSupport", C.c_int), ("regIsGlobal", C.c_int), ("forceFlush", C.c_int),
            ("speed", C.c_int), ("port", C.c_int), ("latency", C.c_float),
            ("maxComms", C.c_int), ("maxRecvs", C.c_int), ("netDeviceType", C.c_int),
            ("netDeviceVersion", C.c_int), ("vProps", vprops), ("maxP2pBytes", C.c_size_t),
            ("maxCollBytes", C.c_size_t)]


class Properties10(C.Structure):
    _fields_ = _props_fields(VProps10)


class Properties11(C.Structure):
    _fields_ = [*_props_fields(VProps10), ("maxMultiRequestSize", C.c_int)]


class Properties12(C.Structure):
    _fields_ = [*_props_fields(VProps12), ("maxMultiRequestSize", C.c_int),
                ("railId", C.c_int16), ("planeId", C.c_int16)]


class CommConfig(C.Structure):
    _fields_ = [("trafficClass", C.c_int)]


class CommAttr(C.Structure):
    _fields_ = [("maxConcurrentPeers", C.c_int32), ("minConcurrentPeers", C.c_int32),
                ("maxFlowsPerPeer", C.c_int32), ("minFlowsPerPeer", C.c_int32)]


class NetAttr(C.Structure):
    _fields_ = [("sendCommAttr", CommAttr), ("recvCommAttr", CommAttr), ("op", C.c_uint32),
                ("algo", C.c_uint32), ("proto", C.c_uint32)]


_P, _PP, _SZ = C.c_void_p, C.POINTER(C.c_void_p), C.c_size_t
_F = C.CFUNCTYPE


def _tail(vprops: type) -> list[tuple[str, object]]:
    """The members every version from v10 on has after ``accept``, in order."""
    return [
        ("regMr", _F(RESULT, _P, _P, _SZ, C.c_int, _PP)),
        ("regMrDmaBuf", _F(RESULT, _P, _P, _SZ, C.c_int, C.c_uint64, C.c_int, _PP)),
        ("deregMr", _F(RESULT, _P, _P)),
        ("isend", _F(RESULT, _P, _P, _SZ, C.c_int, _P, _P, _PP)),
        ("irecv", _F(RESULT, _P, C.c_int, _PP, C.POINTER(_SZ), C.POINTER(C.c_int), _PP, _PP,
                     _PP)),
        ("iflush", _F(RESULT, _P, C.c_int, _PP, C.POINTER(C.c_int), _PP, _PP)),
        ("test", _F(RESULT, _P, C.POINTER(C.c_int), C.POINTER(C.c_int))),
        ("closeSend", _F(RESULT, _P)),
        ("closeRecv", _F(RESULT, _P)),
        ("closeListen", _F(RESULT, _P)),
        ("getDeviceMr", _F(RESULT, _P, _P, _PP)),
        ("irecvConsumed", _F(RESULT, _P, C.c_int, _P)),
        ("makeVDevice", _F(RESULT, C.POINTER(C.c_int), C.POINTER(vprops))),
    ]


def _v11_like(props: type, vprops: type) -> list[tuple[str, object]]:
    return [
        ("name", C.c_char_p),
        # logFunction (variadic) and profFunction: raw pointers; the harness passes NULL
        ("init", _F(RESULT, _PP, C.c_uint64, C.POINTER(CommConfig), _P, _P)),
        ("devices", _F(RESULT, C.POINTER(C.c_int))),
        ("getProperties", _F(RESULT, C.c_int, C.POINTER(props))),
        ("listen", _F(RESULT, _P, C.c_int, _P, _PP)),
        ("connect", _F(RESULT, _P, C.c_int, _P, _PP, C.POINTER(C.POINTER(DeviceHandle)))),
        ("accept", _F(RESULT, _P, _PP, C.POINTER(C.POINTER(DeviceHandle)))),
        *_tail(vprops),
        ("finalize", _F(RESULT, _P)),
        ("setNetAttr", _F(RESULT, _P, C.POINTER(NetAttr))),
    ]


class Net12(C.Structure):
    _fields_ = _v11_like(Properties12, VProps12)


class Net11(C.Structure):
    _fields_ = _v11_like(Properties11, VProps10)


class Net10(C.Structure):
    _fields_ = [
        ("name", C.c_char_p),
        ("init", _F(RESULT, _P, _P)),
        ("devices", _F(RESULT, C.POINTER(C.c_int))),
        ("getProperties", _F(RESULT, C.c_int, C.POINTER(Properties10))),
        ("listen", _F(RESULT, C.c_int, _P, _PP)),
        ("connect", _F(RESULT, C.c_int, C.POINTER(CommConfig), _P, _PP,
                       C.POINTER(C.POINTER(DeviceHandle)))),
        ("accept", _F(RESULT, _P, _PP, C.POINTER(C.POINTER(DeviceHandle)))),
        *_tail(VProps10),
    ]


VTABLES = {"v12": Net12, "v11": Net11, "v10": Net10}

# ----- the profiler plugin (ncclProfiler_v6): the events the identity path uses ----------
PROFILE_COLL, PROFILE_PROXY_OP, PROFILE_PROXY_STEP, PROFILE_NET_PLUGIN = 2, 8, 16, 128
PROFILE_GROUP_API, PROFILE_COLL_API = 256, 512
NET_EVENT_START, NET_EVENT_STOP = 0, 1


class _Coll(C.Structure):
    _fields_ = [("seqNumber", C.c_uint64), ("func", C.c_char_p), ("sendBuff", C.c_void_p),
                ("recvBuff", C.c_void_p), ("count", C.c_size_t), ("root", C.c_int),
                ("datatype", C.c_char_p), ("nChannels", C.c_uint8), ("nWarps", C.c_uint8),
                ("algo", C.c_char_p), ("proto", C.c_char_p), ("parentGroup", C.c_void_p)]


class _ProxyOp(C.Structure):
    _fields_ = [("pid", C.c_int), ("channelId", C.c_uint8), ("peer", C.c_int),
                ("nSteps", C.c_int), ("chunkSize", C.c_int), ("isSend", C.c_int)]


class _ProxyStep(C.Structure):
    _fields_ = [("step", C.c_int)]


class _NetPlugin(C.Structure):
    _fields_ = [("id", C.c_int64), ("data", C.c_void_p)]


class _Descr(C.Union):
    _fields_ = [("coll", _Coll), ("proxyOp", _ProxyOp), ("proxyStep", _ProxyStep),
                ("netPlugin", _NetPlugin), ("largest", C.c_char * 88)]


class EventDescr6(C.Structure):
    _anonymous_ = ("u",)
    _fields_ = [("type", C.c_uint64), ("parentObj", C.c_void_p), ("rank", C.c_int),
                ("u", _Descr)]


PROF_CALLBACK = C.CFUNCTYPE(RESULT, _PP, C.c_int, _P, C.c_int64, _P)


class Profiler6(C.Structure):
    _fields_ = [
        ("name", C.c_char_p),
        ("init", _F(RESULT, _PP, C.c_uint64, C.POINTER(C.c_int), C.c_char_p, C.c_int, C.c_int,
                    C.c_int, _P)),
        ("startEvent", _F(RESULT, _P, _PP, C.POINTER(EventDescr6))),
        ("stopEvent", _F(RESULT, _P)),
        ("recordEventState", _F(RESULT, _P, C.c_int, _P)),
        ("finalize", _F(RESULT, _P)),
    ]


class Tuner5(C.Structure):
    """ncclTuner_v5_t (NCCL 2.28-2.30: src/include/plugin/tuner/tuner_v5.h): init(ctx,
    commId, nRanks, nNodes, logger, nvlDomainInfo, constants), getCollInfo(ctx, collType,
    nBytes, numPipeOps, costTable, numAlgo, numProto, regBuff, nChannels), finalize(ctx)."""

    _fields_ = [
        ("name", C.c_char_p),
        ("init", _F(RESULT, _PP, C.c_uint64, C.c_size_t, C.c_size_t, _P, _P, _P)),
        ("getCollInfo", _F(RESULT, _P, C.c_int, C.c_size_t, C.c_int, _P, C.c_int, C.c_int,
                           C.c_int, C.POINTER(C.c_int))),
        ("finalize", _F(RESULT, _P)),
    ]


#: Offsets inside the descriptor's union members (from the descriptor's start).
DESCR_MEMBERS = {"coll.seqNumber": 24, "coll.count": 56, "coll.datatype": 72,
                 "coll.nChannels": 80, "coll.algo": 88, "coll.proto": 96,
                 "proxyOp.channelId": 28, "proxyOp.peer": 32, "proxyOp.nSteps": 36,
                 "proxyOp.isSend": 44, "proxyStep.step": 24, "netPlugin.id": 24,
                 "netPlugin.data": 32}

_VT_COMMON = ["name", "init", "devices", "getProperties", "listen", "connect", "accept",
              "regMr", "regMrDmaBuf", "deregMr", "isend", "irecv", "iflush", "test",
              "closeSend", "closeRecv", "closeListen", "getDeviceMr", "irecvConsumed",
              "makeVDevice"]
_PROPS_COMMON = {"name": 0, "pciPath": 8, "guid": 16, "ptrSupport": 24, "regIsGlobal": 28,
                 "forceFlush": 32, "speed": 36, "port": 40, "latency": 44, "maxComms": 48,
                 "maxRecvs": 52, "netDeviceType": 56, "netDeviceVersion": 60, "vProps": 64}

#: The documented layout: member -> byte offset, and "sizeof". A vtable is its members in
#: this order, one pointer (8 bytes) each.
LAYOUT: dict[str, dict[str, int]] = {
    "ncclNet_v12_t": {**{n: 8 * i for i, n in enumerate(_VT_COMMON + ["finalize",
                                                                        "setNetAttr"])},
                      "sizeof": 176},
    "ncclNet_v11_t": {**{n: 8 * i for i, n in enumerate(_VT_COMMON + ["finalize",
                                                                        "setNetAttr"])},
                      "sizeof": 176},
    "ncclNet_v10_t": {**{n: 8 * i for i, n in enumerate(_VT_COMMON)}, "sizeof": 160},
    "ncclNetProperties_v12_t": {**_PROPS_COMMON, "maxP2pBytes": 104, "maxCollBytes": 112,
                                "maxMultiRequestSize": 120, "railId": 124, "planeId": 126,
                                "sizeof": 128},
    "ncclNetProperties_v11_t": {**_PROPS_COMMON, "maxP2pBytes": 88, "maxCollBytes": 96,
                                "maxMultiRequestSize": 104, "sizeof": 112},
    "ncclNetProperties_v10_t": {**_PROPS_COMMON, "maxP2pBytes": 88, "maxCollBytes": 96,
                                "sizeof": 104},
    "ncclNetDeviceHandle_t": {"netDeviceType": 0, "netDeviceVersion": 4, "handle": 8,
                              "size": 16, "needsProxyProgress": 24, "sizeof": 32},
    "ncclNetAttr_t": {"sendCommAttr": 0, "recvCommAttr": 16, "op": 32, "algo": 36,
                      "proto": 40, "sizeof": 44},
    "ncclProfilerEventDescr_v6_t": {"type": 0, "parentObj": 8, "rank": 16, "u": 24,
                                    "sizeof": 112},
    "ncclProfiler_v6_t": {"name": 0, "init": 8, "startEvent": 16, "stopEvent": 24,
                          "recordEventState": 32, "finalize": 40, "sizeof": 48},
    "ncclTuner_v5_t": {"name": 0, "init": 8, "getCollInfo": 16, "finalize": 24, "sizeof": 32},
}

CTYPES = {"ncclNet_v12_t": Net12, "ncclNet_v11_t": Net11, "ncclNet_v10_t": Net10,
          "ncclNetProperties_v12_t": Properties12, "ncclNetProperties_v11_t": Properties11,
          "ncclNetProperties_v10_t": Properties10, "ncclNetDeviceHandle_t": DeviceHandle,
          "ncclNetAttr_t": NetAttr, "ncclProfilerEventDescr_v6_t": EventDescr6,
          "ncclProfiler_v6_t": Profiler6, "ncclTuner_v5_t": Tuner5}


class PluginError(RuntimeError):
    """A plugin call failed, or the harness driving it did."""


def ok(res: int, what: str) -> None:
    """An ncclResult_t that must be ncclSuccess."""
    if res != SUCCESS:
        raise PluginError(f"{what} returned ncclResult {res}")


def load(path: str) -> tuple[C.CDLL, str, C.Structure]:
    """NCCL's rule: the newest ``ncclNetPlugin_vN`` the library exports. Returns (library,
    version, vtable)."""
    lib = C.CDLL(path)
    for v in LOADER_ORDER:
        if v in VTABLES:
            try:
                return lib, v, VTABLES[v].in_dll(lib, f"ncclNetPlugin_{v}")
            except ValueError:
                continue
    raise OSError(f"{path} exports no ncclNetPlugin_v10..v12")


def resolve(net_plugin: str, order: tuple[str, ...] = LOADER_ORDER
            ) -> tuple[str, str] | None:
    """NCCL's loader rules for ``NCCL_NET_PLUGIN``: a comma list; each name is tried as a
    path, then as ``libnccl-net-<name>.so`` (the dynamic linker's search path); the first
    library that opens is asked for ``ncclNetPlugin_<v>`` in ``order``. Returns (library
    name that opened, version) or None: NCCL then uses its internal transports."""
    for name in (n.strip() for n in net_plugin.split(",") if n.strip()):
        for cand in (name, f"libnccl-net-{name}.so"):
            try:
                lib = C.CDLL(cand)
            except OSError:
                continue
            for v in order:
                try:
                    C.c_void_p.in_dll(lib, f"ncclNetPlugin_{v}")
                except ValueError:
                    continue
                return cand, v
            break  # opened but exports no version this NCCL knows: next name
    return None
