"""The ckm NCCL plugin's transport and its refusals, one process talking to itself over
loopback through the plugin's interface (ctypes, as NCCL calls it): many requests in
flight, a full request pool, datagrams from outside the session, a message larger than the
posted receive, and what tagging refuses: isends the schedule did not predict, a tag that is
not this rank, more connections than channels. A refusal stops tagging with one line and the
isend goes out plain (NCCL keeps working untagged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from checkmate.testbed.nccl_harness import plugin_env

REPO = Path(__file__).resolve().parent.parent

# One connection from this process to itself; SCENARIO picks what to do with it.
PROGRAM = textwrap.dedent("""
    import ctypes as C, json, socket, sys, time
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from checkmate.protocol import wire
    from checkmate.testbed import nccl_abi as abi
    scenario, out = sys.argv[3], {}
    tagging = scenario in ("wrong_size", "wrong_tag", "channels")
    if tagging:  # a supported NCCL's ncclGetVersion, as libnccl would export it
        C.CDLL(sys.argv[1].replace("libnccl-net-ckm.so", "libnccl-standin.so"),
               mode=C.RTLD_GLOBAL)
    lib, v, net = abi.load(sys.argv[1])
    ctx = C.c_void_p()
    assert net.init(C.byref(ctx), 1, C.byref(abi.CommConfig(-1)), None, None) == 0
    if tagging:  # NCCL initializes the tuner for the communicator
        tuner, tctx = abi.Tuner5.in_dll(lib, "ncclTunerPlugin_v5"), C.c_void_p()
        assert tuner.init(C.byref(tctx), 1, 2, 2, None, None, None) == 0
    def connect_pair(junk=False):
        h, lc = (C.c_char * 128)(), C.c_void_p()
        assert net.listen(ctx, 0, h, C.byref(lc)) == 0
        if tagging:  # the handle of rank 1's listener: this rank 0's next
            h[32:36] = (1).to_bytes(4, "big")  # struct handle.rank (ckm_setup.c)
        if junk:  # datagrams from outside any session, queued before accept
            ip = socket.inet_ntoa(bytes(h)[4:8]); port = int.from_bytes(bytes(h)[8:10], "big")
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.sendto(b"short", (ip, port))
            s.sendto(wire.encode(wire.Header(job_id=99, count=4, dtype=3), b"abcd"), (ip, port))
            s.close()
        sc, rc = C.c_void_p(), C.c_void_p()
        dev = C.POINTER(abi.DeviceHandle)()
        end = time.monotonic() + 20
        while not (sc.value and rc.value):
            if not sc.value:
                r = net.connect(ctx, 0, h, C.byref(sc), C.byref(dev))
                if r:
                    return r, None, None
            if not rc.value:
                assert net.accept(lc, C.byref(rc), C.byref(dev)) == 0
            assert time.monotonic() < end
        net.closeListen(lc)
        return 0, sc, rc
    def wait(req):
        done, size = C.c_int(), C.c_int()
        end = time.monotonic() + 20
        while True:
            r = net.test(req, C.byref(done), C.byref(size))
            if r or done.value:
                return r, size.value
            assert time.monotonic() < end
    def post_recv(rc, buf):
        req = C.c_void_p()
        r = net.irecv(rc, 1, (C.c_void_p * 1)(buf.ctypes.data), (C.c_size_t * 1)(buf.nbytes),
                      (C.c_int * 1)(1), None, None, C.byref(req))
        return r, req
    def isend(sc, arr, tag=0):
        req = C.c_void_p()
        r = net.isend(sc, C.c_void_p(arr.ctypes.data), arr.nbytes, tag, None, None,
                      C.byref(req))
        return r, req
    if scenario == "inflight":
        _, sc, rc = connect_pair(junk=True)
        msgs = [np.arange(i * 1000, i * 1000 + 3000 + i, dtype=np.float32) for i in range(64)]
        sends = [isend(sc, m) for m in msgs]
        out["sends_posted"] = sum(1 for r, q in sends if r == 0 and q.value)
        out["65th"] = isend(sc, msgs[0])[1].value  # the pool is full: NULL, try again
        bufs = [np.zeros(4000 + 64, np.float32) for _ in msgs]
        recvs = [post_recv(rc, b) for b in bufs]
        out["recvs_posted"] = sum(1 for r, q in recvs if r == 0 and q.value)
        sizes = [wait(q)[1] for _, q in recvs]
        out["send_results"] = [wait(q)[0] for _, q in sends]
        out["exact"] = all(s == m.nbytes and np.array_equal(b[:m.size], m)
                           for s, b, m in zip(sizes, bufs, msgs))
        zero = np.zeros(0, np.float32)
        _, q = isend(sc, zero)
        _, rq = post_recv(rc, bufs[0])
        out["zero"] = [wait(rq)[1], wait(q)[0]]
        net.closeSend(sc)
        net.closeRecv(rc)
    elif scenario == "too_big":
        _, sc, rc = connect_pair()
        _, q = isend(sc, np.ones(5000, np.float32))
        _, rq = post_recv(rc, np.zeros(100, np.float32))
        out["recv"] = wait(rq)[0]
    elif scenario in ("wrong_size", "wrong_tag"):
        pairs = [connect_pair() for _ in range(2)]  # both channels
        _, sc, rc = pairs[0]
        arr = np.ones(7, np.float32)
        r, q = isend(sc, arr, tag=1 if scenario == "wrong_tag" else 0)
        buf = np.zeros(16, np.float32)
        _, rq = post_recv(rc, buf)
        out["isend"] = [r, wait(q)[0], wait(rq)[1]]
        for _, s2, r2 in pairs:
            net.closeSend(s2)
            net.closeRecv(r2)
    elif scenario == "channels":
        out["connects"] = [connect_pair()[0] for _ in range(3)]
    net.finalize(ctx)
    print(json.dumps(out))
""")



def _run(plugin: Path, scenario: str, tmp_path: Path, tagging: bool = False
         ) -> tuple[dict, list[str], list[dict]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKM_NCCL", "NCCL_"))}
    # rank 0 of 2 talking to itself; with tagging, 2 channels and one bucket of 1000
    env.update(plugin_env(0, 2, 2, 1 << 15, [1000] if tagging else [], 2, 7, "127.0.0.1"))
    env["CKM_NCCL_STATS"] = str(tmp_path / f"{scenario}.jsonl")
    env["NCCL_STANDIN_VERSION"] = "22907"  # read by libnccl-standin.so's ncclGetVersion
    p = subprocess.run([sys.executable, "-c", PROGRAM, str(plugin), str(REPO), scenario],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    stats_file = tmp_path / f"{scenario}.jsonl"
    stats = ([json.loads(x) for x in stats_file.read_text().splitlines()]
             if stats_file.exists() else [])
    return (json.loads(p.stdout.splitlines()[-1]),
            [x for x in p.stderr.splitlines() if x.startswith("ckm-nccl:")], stats)


def test_nccl_transport_64_requests_in_flight_and_outsiders_dropped(nccl_plugin, tmp_path):
    out, lines, stats = _run(nccl_plugin, "inflight", tmp_path)
    assert out["sends_posted"] == 64 and out["65th"] is None and out["recvs_posted"] == 64
    assert out["send_results"] == [0] * 64 and out["exact"] is True
    assert out["zero"] == [0, 0] and lines == []
    recv = [s for s in stats if s["kind"] == "recv"]
    assert len(recv) == 1 and recv[0]["foreign"] + recv[0]["malformed"] == 2


def test_nccl_transport_message_larger_than_receive_fails_loudly(nccl_plugin, tmp_path):
    out, lines, _ = _run(nccl_plugin, "too_big", tmp_path)
    assert out["recv"] != 0
    assert len(lines) == 1 and "for a receive of 400" in lines[0]


@pytest.mark.parametrize("scenario,why", [
    ("wrong_size", "isend of 28 bytes where the schedule expects"),
    ("wrong_tag", "isend tag 1 is not this rank 0"),
    ("channels", "NCCL opened send connection 3 where CKM_NCCL_CHANNELS is 2"),
])
def test_nccl_tagging_refuses_what_the_schedule_did_not_predict(nccl_plugin, tmp_path, scenario,
                                                                why):
    """One line, tagging off, and the transport carries on: the isend is delivered plain."""
    out, lines, stats = _run(nccl_plugin, scenario, tmp_path, tagging=True)
    if scenario == "channels":
        assert out["connects"] == [0, 0, 0]
    else:
        assert out["isend"] == [0, 0, 28]  # posted, completed, received whole
        assert sum(s["replicated"] for s in stats if s["kind"] == "send") == 0
    assert len(lines) == 1 and why in lines[0] and "NCCL continues untagged" in lines[0], lines
