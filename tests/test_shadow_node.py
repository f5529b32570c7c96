"""Shadow nodes on loopback: real UDP and TCP sockets, real FlatOptimizer steps."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch
from shadow_cluster import JOB, LRS, Cluster, make_spec

from checkmate.protocol import auth, datamac, handshake, wire
from checkmate.train.shadow_client import (
    ShadowClient,
    ShadowError,
    consistent_point,
    fetch_all,
    restore_state_dicts,
)


@pytest.fixture
def cluster_factory():
    made = []

    def make(spec=None, **kw):
        c = Cluster(spec or make_spec(), **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def assert_equal_ref(cluster, it):
    full = fetch_all(cluster.addrs, it, spec=cluster.spec)
    ref = cluster.refs[it]
    for s in cluster.spec.slots:
        assert np.array_equal(full.slots[s], ref[s]), (it, s)
    return full


@pytest.mark.parametrize("kind, grad_dtype", [("adamw", "float32"), ("sgd", "bfloat16"),
                                              ("adam", "float16")])
def test_steps_equal_flat_optimizer_run_directly(cluster_factory, kind, grad_dtype):
    c = cluster_factory(make_spec(kind, grad_dtype=grad_dtype))
    c.seed()
    c.wait(lambda sts: all(s["seeded"] for s in sts))
    for it in range(1, 7):
        g = c.rng.standard_normal(c.spec.total).astype(np.float32)
        clip, skip = (0.37 if it % 2 else None), it == 4
        c.send(it, g, clip=clip, skip=skip)
        c.step_ref(it, g, clip, skip)
    sts = c.wait(lambda sts: all(s["latest"] == 6 for s in sts))
    assert all(s["retained"] == [3, 4, 5, 6] for s in sts)
    for it in (3, 4, 6):
        full = assert_equal_ref(c, it)
        assert full.extra == {"it": it}
    assert full.step == 5  # iteration 4 was skipped
    assert all(not s["drops"] for s in sts), sts


def test_duplicates_and_reordering_change_nothing(cluster_factory):
    c = cluster_factory()
    c.seed()
    c.wait(lambda sts: all(s["seeded"] for s in sts))
    g1 = c.rng.standard_normal(c.spec.total).astype(np.float32)
    g2 = c.rng.standard_normal(c.spec.total).astype(np.float32)
    c.send(2, g2)  # iteration 2 first: held until 1 completes
    c.send(1, g1)
    c.send(1, g1 * 5)  # a late full resend of 1: stale or duplicate, never applied
    c.step_ref(1, g1)
    c.step_ref(2, g2)
    # The late resend may still be queued when iteration 2 commits: wait for its drops too.
    sts = c.wait(lambda sts: all(s["latest"] == 2 and s["drops"].get("stale", 0)
                                 + s["drops"].get("duplicate", 0) > 0 for s in sts))
    assert_equal_ref(c, 2)
    assert all(s["drops"].get("stale", 0) + s["drops"].get("duplicate", 0) > 0 for s in sts)


def test_foreign_and_damaged_datagrams_are_dropped_by_reason(cluster_factory):
    c = cluster_factory(epochs={0: 5, 1: 5})
    c.seed()
    c.wait(lambda sts: all(s["seeded"] for s in sts))
    n0 = c.nodes[0]
    addr = ("127.0.0.1", n0.udp_port)
    a, b = c.spec.bounds(0)
    good = wire.Header(flags=wire.Flags.REPLICATE, job_id=JOB, epoch=5, iteration=1,
                       offset=a, count=4, partition=0)
    payload = np.ones(4, "<f4").tobytes()
    key = datamac.data_key(auth.load_secret())

    def tagged(h: wire.Header, data: bytes = payload) -> bytes:
        """Made with the job secret, so the drop reason is the one being tested."""
        t = datamac.data_tag(key, h.job_id, h.flags, h.iteration, h.offset, h.count,
                             h.partition, h.dtype, wire.crc(data))
        return wire.encode(h.with_(fec_index=t[0], fec_k=t[1], fec_m=t[2], fec_group=t[3]),
                           data)
    bad = {
        "job": tagged(good.with_(job_id=JOB + 1)),
        "epoch": tagged(good.with_(epoch=4)),
        "token": tagged(good.with_(token=9)),
        "partition": tagged(good.with_(partition=1)),
        "range": tagged(good.with_(offset=b - 2)),
        "dtype": tagged(good.with_(dtype=wire.DType.FLOAT16, count=8)),
        "short": b"\xc4\xec\x01",
        "magic": b"\x00" * 60,
        "length": tagged(good)[:-4],
        "flags": tagged(good.with_(flags=wire.Flags.REPLICATE | wire.Flags.SEED)),
        # FEC parity is no longer part of the protocol: dropped as a flag, even tagged
        "parity": tagged(good.with_(flags=wire.Flags.PARITY, dtype=wire.DType.BYTES,
                                    count=16)),
        "mac": wire.encode(good, payload),  # right session, no tag: not from a trainer
    }
    crc_bad = bytearray(tagged(good))
    crc_bad[-1] ^= 0xFF
    bad["crc"] = bytes(crc_bad)
    for d in bad.values():
        c.tx.sendto(d, addr)
    sts = c.wait(lambda sts: sum(sts[0]["drops"].values()) >= len(bad))
    want = {**dict.fromkeys(bad, 1), "flags": 2}
    del want["parity"]
    assert sts[0]["drops"] == want
    assert sts[0]["pending"] == []  # nothing was placed
    # the right session still gets through and steps
    g = c.rng.standard_normal(c.spec.total).astype(np.float32)
    c.send(1, g, epoch=5)
    c.step_ref(1, g)
    c.wait(lambda sts: all(s["latest"] == 1 for s in sts))
    assert_equal_ref(c, 1)


def test_gap_is_reported_in_status_and_never_stepped_over(cluster_factory):
    c = cluster_factory(gap_timeout=0.2)
    c.seed()
    c.wait(lambda sts: all(s["seeded"] for s in sts))
    a, _ = c.spec.bounds(0)
    lost = a + 100  # the datagram starting at this offset never arrives

    def drop(p, h):
        return p == 0 and h.offset == lost

    for it in (1, 2, 3):
        g = c.rng.standard_normal(c.spec.total).astype(np.float32)
        c.send(it, g, drop=drop if it == 1 else None)
        c.step_ref(it, g)
    time.sleep(0.3)
    g = c.rng.standard_normal(c.spec.total).astype(np.float32)
    c.send(4, g)  # newer traffic keeps arriving past the timeout
    c.step_ref(4, g)
    # wait for both: the gap report at partition 0 and iteration 4 committed at partition 1
    # (the receiver may hold a trickle's last datagrams for its linger time)
    sts = c.wait(lambda sts: sts[0]["gap_count"] >= 1 and sts[1]["latest"] == 4)
    gap = sts[0]["gaps"][0]
    assert gap["iteration"] == 1 and gap["missing"] == [[lost, lost + 50]]
    assert sts[0]["latest"] == 0 and sts[1]["latest"] == 4
    # partition 0 never steps past the gap; partition 1 moved on beyond its retention, so
    # there is no consistent point to restore from (the shadow must be re-seeded)
    assert sts[0]["retained"] == [0] and sts[1]["retained"] == [1, 2, 3, 4]
    with pytest.raises(ShadowError, match="no iteration is retained"):
        consistent_point(c.addrs)
    # recovery: the trainers re-seed partition 0 with their state at iteration 4
    a, b = c.spec.bounds(0)
    with ShadowClient(c.addrs[0]) as cl:
        for s in c.spec.slots:
            cl.seed(4, s, a, c.refs[4][s][a:b], 4)
    g = c.rng.standard_normal(c.spec.total).astype(np.float32)
    c.send(5, g)
    c.step_ref(5, g)
    sts = c.wait(lambda sts: all(s["latest"] == 5 for s in sts))
    assert sts[0]["retained"] == [4, 5] and sts[0]["gaps"][0]["iteration"] == 1
    assert consistent_point(c.addrs) == 5
    assert_equal_ref(c, 5)


def test_consistent_point_across_shadows_and_retention(cluster_factory):
    c = cluster_factory(retain=3)
    c.seed()
    c.wait(lambda sts: all(s["seeded"] for s in sts))
    for it in range(1, 7):
        g = c.rng.standard_normal(c.spec.total).astype(np.float32)
        c.send(it, g, parts=[0, 1] if it <= 4 else [0])  # partition 1 lags at 4
        c.step_ref(it, g)
    sts = c.wait(lambda sts: sts[0]["latest"] == 6 and sts[1]["latest"] == 4)
    assert sts[0]["retained"] == [4, 5, 6] and sts[1]["retained"] == [2, 3, 4]
    assert consistent_point(c.addrs) == 4
    model_sd, optim_sd, it, buffers, extra = restore_state_dicts(c.addrs)
    assert it == 4 and extra == {"it": 4}
    assert torch.equal(buffers["bn.mean"], torch.zeros(3))
    ref_m, ref_o = c.spec.state_dicts(c.refs[4], 4, buffers, LRS)
    for k in ref_m:
        assert torch.equal(model_sd[k], ref_m[k]), k
    for i in ref_o["state"]:
        for k in ref_o["state"][i]:
            assert torch.equal(optim_sd["state"][i][k], ref_o["state"][i][k])
    # one more iteration at partition 0 only: 4 falls out of its retention -> no common point
    g = c.rng.standard_normal(c.spec.total).astype(np.float32)
    c.send(7, g, parts=[0])
    c.wait(lambda sts: sts[0]["latest"] == 7)
    with pytest.raises(ShadowError, match="no iteration is retained by every shadow"):
        consistent_point(c.addrs)


def test_service_refusals(cluster_factory):
    c = cluster_factory()
    with ShadowClient(c.addrs[0]) as cl:
        with pytest.raises(ShadowError, match="no spec yet"):
            cl.seed(0, "param", 0, np.zeros(3, np.float32), 0)
        cl.send_spec(c.spec)
        cl.send_spec(c.spec)  # idempotent
        other = make_spec(partitions=2, kind="sgd")
        with pytest.raises(ShadowError, match="different spec"):
            cl.send_spec(other)
        _, b = c.spec.bounds(0)
        with pytest.raises(ShadowError, match="outside partition 0"):
            cl.seed(0, "param", b - 1, np.zeros(3, np.float32), 0)
        with pytest.raises(ShadowError, match="unknown slot"):
            cl.seed(0, "momentum_buffer", 0, np.zeros(3, np.float32), 0)
        with pytest.raises(ShadowError, match="not retained"):
            cl.fetch(0)
        with pytest.raises(ShadowError, match="unknown op"):
            cl.request({"op": "reboot"})
        assert cl.get_spec() == c.spec
        assert cl.status()["seeded"] is False


class MiniController:
    """A minimal stand-in for the controller: checks each request's MAC with ``secret`` (a
    refusal without a MAC if it fails, as the real one), answers register after ``ignore``
    tries. Does not model the switch, the session store or the config's host checks."""

    def __init__(self, ignore=0, refuse=False, secret=None, check=True):
        self.key = auth.handshake_key(secret if secret is not None else auth.load_secret())
        self.guard = auth.ReplayGuard()
        self.check = check  # False: a forger that answers everything with its own key
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.addr = self.sock.getsockname()
        self.ignore, self.refuse = ignore, refuse
        self.requests = []
        self.epoch = 41
        self._stop = False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self._stop:
            try:
                data, peer = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            m = handshake.parse(data)
            try:
                if self.check:
                    handshake.verify_request(self.key, m, self.guard)
            except auth.AuthError:
                self.sock.sendto(handshake.refusal(m.header), peer)
                continue
            body = {k: v for k, v in m.body.items() if k not in ("nonce", "ts")}
            self.requests.append(body)
            if len(self.requests) <= self.ignore:
                continue
            if self.refuse:
                self.sock.sendto(handshake.reply(self.key, m, {"op": "error",
                                                               "reason": "no such job"},
                                                 ok=False), peer)
                continue
            self.epoch += 1
            self.sock.sendto(handshake.reply(self.key, m, {
                "op": "registered", "job": body["job"], "partition": body["partition"],
                "epoch": self.epoch, "token": 777}), peer)

    def close(self):
        self._stop = True
        self.t.join(2)
        self.sock.close()


def test_registration_retries_then_session_filters_datagrams(cluster_factory):
    ctl = MiniController(ignore=2)
    try:
        spec = make_spec(partitions=1)
        c = cluster_factory(spec, controller=ctl.addr, host="s0", ip="127.0.0.1",
                            mac="02:00:7f:00:00:01")
        assert len(ctl.requests) == 3
        # Every try is the same registration: one instance id (the controller answers a
        # repeat with the same session).
        inst = {r.pop("instance") for r in ctl.requests}
        assert len(inst) == 1 and len(inst.pop()) == 16
        assert ctl.requests[-1] == {"op": "register", "job": JOB, "partition": 0,
                                    "host": "s0", "ip": "127.0.0.1",
                                    "mac": "02:00:7f:00:00:01",
                                    "port": c.nodes[0].udp_port}
        c.seed(1)
        c.wait(lambda sts: sts[0]["seeded"] and sts[0]["epoch"] == 42)
        g = c.rng.standard_normal(spec.total).astype(np.float32)
        c.send(1, g, epoch=41, token=777)  # the previous session: dropped
        c.send(1, g, epoch=42, token=776)  # wrong token: dropped
        c.send(1, g, epoch=42, token=777)
        c.step_ref(1, g)
        sts = c.wait(lambda sts: sts[0]["latest"] == 1)
        assert sts[0]["drops"]["epoch"] > 0 and sts[0]["drops"]["token"] > 0
        assert_equal_ref(c, 1)
    finally:
        ctl.close()


def test_registration_refused_or_unanswered_is_a_clear_error():
    from checkmate.errors import CheckmateError
    from checkmate.shadow.register import register

    ctl = MiniController(refuse=True)
    try:
        with pytest.raises(CheckmateError, match="refused registration: no such job"):
            register(auth.load_secret(), ctl.addr, JOB, 0, "s0", "127.0.0.1",
                     "02:00:00:00:00:01", 47001, 5)
    finally:
        ctl.close()
    ctl = MiniController(ignore=10**6)
    try:
        with pytest.raises(CheckmateError, match="did not answer"):
            register(auth.load_secret(), ctl.addr, JOB, 0, "s0", "127.0.0.1",
                     "02:00:00:00:00:01", 47001, 0.5)
    finally:
        ctl.close()
    # A controller with another job secret: its refusal can only say so.
    ctl = MiniController(secret=bytes(32))
    try:
        with pytest.raises(CheckmateError, match="refused registration: not authenticated"):
            register(auth.load_secret(), ctl.addr, JOB, 0, "s0", "127.0.0.1",
                     "02:00:00:00:00:01", 47001, 5)
        assert ctl.requests == []
    finally:
        ctl.close()


def test_a_forged_controller_answer_is_ignored():
    """A reply that does not carry the MAC bound to the request (made without the secret)
    is not believed: registration times out rather than take a forged epoch/token."""
    from checkmate.errors import CheckmateError
    from checkmate.shadow.register import register

    forger = MiniController(secret=bytes(32), check=False)
    try:
        with pytest.raises(CheckmateError, match="did not answer"):
            register(auth.load_secret(), forger.addr, JOB, 0, "s0", "127.0.0.1",
                     "02:00:00:00:00:01", 47001, 1.0)
        assert forger.requests  # it did answer, with a registration it could not sign
    finally:
        forger.close()


@pytest.mark.parametrize("native", [True, False])
def test_batch_receiver_native_and_fallback(native):
    from checkmate.shadow.mmsg import BatchReceiver

    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.bind(("127.0.0.1", 0))
        rx.setblocking(False)
        br = BatchReceiver(rx, batch=4, slot=100)
        assert br.native  # recvmmsg exists in this libc
        br.native = native
        sent = [bytes([i]) * (10 + i) for i in range(6)] + [b"x" * 150]  # last: truncated
        for d in sent:
            tx.sendto(d, rx.getsockname())
        got = []
        end = time.monotonic() + 5
        while len(got) < len(sent) and time.monotonic() < end:
            try:
                lens = br.recv()
            except BlockingIOError:
                time.sleep(0.01)
                continue
            assert 1 <= len(lens) <= (4 if native else 1)
            got += [bytes(br.view[i * 100:i * 100 + n]) for i, n in enumerate(lens)]
        assert got[:6] == sent[:6]
        assert got[6] == b"x" * 100  # cut at the slot size; the receiver's length check drops it
        with pytest.raises(BlockingIOError):
            br.recv()
    finally:
        rx.close()
        tx.close()
