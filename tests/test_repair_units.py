"""Repair and re-seed building blocks: the replica log, the repair protocol, the trainer's
repair service over real loopback UDP, the shadow assembler's repair trigger, and the
roll-forward of a live re-seed (bit-exact against one optimizer over the whole partition)."""

from __future__ import annotations

import random
import socket
import time
from collections import Counter

import numpy as np
import pytest

from checkmate.errors import CheckmateError
from checkmate.protocol import repair, wire
from checkmate.shadow.assembler import REPAIR_DELAY, Assembler
from checkmate.shadow.feed import control_body
from checkmate.shadow.kernels import make_optimizer
from checkmate.shadow.state import ShadowState
from checkmate.spec.model import ModelSpec
from checkmate.train.repair import RepairServer, TokenBucket
from checkmate.train.replica_log import ReplicaLog
from checkmate.train.replicate import ShadowTarget
from checkmate.train.ring import replica_owners

# ----- replica log ------------------------------------------------------------------------


def test_replica_log_keeps_the_last_k_iterations_and_cuts_pieces_to_ranges():
    log = ReplicaLog(keep=2)
    payload = np.arange(10, dtype="<f4").tobytes()
    for it in (1, 2, 3):
        log.add_piece(it, 0, 100, 1, payload)
    assert not log.holds(1) and log.holds(2) and log.holds(3)
    assert log.pieces(1, 1, [(100, 110)]) is None  # gone
    assert log.nbytes == 2 * len(payload)
    got = log.pieces(3, 1, [(103, 105), (108, 200)])
    assert [(o, n) for o, n, _, _ in got] == [(103, 2), (108, 2)]
    assert np.frombuffer(got[0][3], "<f4").tolist() == [3.0, 4.0]
    assert log.pieces(3, 0, [(100, 110)]) == []  # another partition: nothing held
    log.add_control(3, b"{}")
    assert log.control(3) == b"{}" and log.control(2) is None


def test_repair_ranges_round_trip_and_reject_garbage():
    rs = [(0, 5), (7, 2**40)]
    assert repair.decode_ranges(repair.encode_ranges(rs)) == rs
    with pytest.raises(wire.WireError):
        repair.decode_ranges(b"\x00" * 15)
    with pytest.raises(wire.WireError):
        repair.decode_ranges(repair.encode_ranges([(5, 5)]))
    with pytest.raises(wire.WireError):
        repair.encode_ranges([(0, 1)] * (repair.MAX_RANGES + 1))


def test_replica_owners_split_each_bucket_by_segment():
    # bucket [0, 12) over 3 ranks: segments [0,4) [4,8) [8,12) replicated by ranks 2, 0, 1.
    assert replica_owners([(0, 12)], 3, 0, 12) == [(0, 4, 2), (4, 8, 0), (8, 12, 1)]
    assert replica_owners([(0, 12)], 3, 6, 9) == [(6, 8, 0), (8, 9, 1)]


def test_token_bucket_paces_to_its_rate():
    b = TokenBucket(rate=1_000_000, burst=10_000)
    t0 = time.monotonic()
    for _ in range(30):
        b.take(10_000)  # 300 kB at 1 MB/s after a 10 kB burst: about 0.29 s
    took = time.monotonic() - t0
    assert 0.25 < took < 1.5 and b.waits > 0


# ----- trainer repair service over loopback -----------------------------------------------
@pytest.fixture
def served():
    net = f"127.{random.randrange(100, 200)}.{random.randrange(1, 250)}"
    shadow = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    shadow.bind((f"{net}.100", 0))
    shadow.settimeout(2.0)
    log = ReplicaLog(keep=3)
    targets = {1: ShadowTarget(1, f"{net}.100", shadow.getsockname()[1], 5, 6)}
    srv = RepairServer((f"{net}.10", 0), 7, log, targets)
    yield log, srv, shadow
    srv.close()
    shadow.close()


def _ask(shadow, srv, it, ranges, control=False, job=7, partition=1):
    dgram = repair.request(job, 5, 6, it, partition, ranges, control=control)
    shadow.sendto(dgram, srv.sock.getsockname())


def test_repair_server_answers_exactly_the_missing_ranges(served):
    log, srv, shadow = served
    vals = np.arange(1000, 1100, dtype="<f4")
    log.add_piece(4, 2, 500, 1, vals.tobytes())
    _ask(shadow, srv, 4, [(510, 520), (590, 700)])
    got = []
    for _ in range(2):
        h, p = wire.decode(shadow.recv(65536))
        got.append((h.offset, h.count, np.frombuffer(p, "<f4").tolist()))
        assert h.flags == repair.ANSWER and (h.epoch, h.token, h.iteration) == (5, 6, 4)
        assert h.partition == 1 and h.bucket == 2
    assert sorted(got) == [(510, 10, vals[10:20].tolist()), (590, 10, vals[90:].tolist())]
    assert srv.status()["answered_elements"] == 20


def test_repair_server_says_gone_for_old_iterations_and_answers_control(served):
    log, srv, shadow = served
    for it in range(1, 6):
        log.add_piece(it, 0, 500, 1, b"\0" * 8)
    body = control_body(5, [0.1]) * 500  # > one fragment
    log.add_control(5, body)
    _ask(shadow, srv, 1, [(500, 502)])
    h, p = wire.decode(shadow.recv(65536))
    assert h.flags == repair.GONE and h.iteration == 1 and h.count == 0
    _ask(shadow, srv, 5, [], control=True)
    frags = {}
    while sum(len(v) for v in frags.values()) < len(body):
        h, p = wire.decode(shadow.recv(65536))
        assert h.flags == repair.ANSWER_CONTROL and h.fec_group == len(body)
        frags[h.offset] = bytes(p)
    assert b"".join(frags[k] for k in sorted(frags)) == body


def test_repair_server_drops_foreign_and_malformed_requests(served):
    log, srv, shadow = served
    log.add_piece(4, 0, 500, 1, b"\0" * 8)
    _ask(shadow, srv, 4, [(500, 502)], job=8)
    _ask(shadow, srv, 4, [(500, 502)], partition=3)
    shadow.sendto(b"garbage", srv.sock.getsockname())
    _ask(shadow, srv, 9, [(500, 502)])  # not sent yet: no answer, not "gone"
    deadline = time.monotonic() + 2
    while srv.status()["dropped"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    shadow.settimeout(0.3)
    with pytest.raises(TimeoutError):
        shadow.recv(65536)
    assert srv.status()["dropped"] == 3 and srv.stats["future"] == 1


# ----- shadow assembler: when to ask ------------------------------------------------------
class _Requests:
    """Records what an Assembler asks for (stands in for RepairRequester's socket)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list, bool]] = []

    def request(self, it, missing, control, tries):
        self.calls.append((it, missing, control))


def _asm():
    done: list = []
    asm = Assembler(100, 200, 1, lambda it, g, c: done.append(it), Counter(), window=8)
    asm.repair = _Requests()
    return asm, done


def _grad(asm, it, a, b):
    asm.place(it, a, b - a, 0, memoryview(np.ones(b - a, "<f4").tobytes()))


def _control(asm, it, body=None):
    body = body or control_body(it, [0.1])
    asm.place_control(it, 0, len(body), len(body), memoryview(body))


def test_assembler_asks_for_exactly_the_hole_once_a_newer_iteration_arrives():
    asm, done = _asm()
    _grad(asm, 1, 100, 150)
    _grad(asm, 1, 160, 200)
    _control(asm, 1)
    t = time.monotonic()
    asm.tick(t)
    asm.tick(t + REPAIR_DELAY / 2)
    assert asm.repair.calls == []  # too early: the rest may still be in the socket queue
    asm.tick(t + 3 * REPAIR_DELAY)
    assert asm.repair.calls == [(1, [(150, 160)], False)]
    _grad(asm, 1, 150, 160)  # the answer
    assert done == [1]


def test_assembler_asks_for_a_whole_lost_iteration_and_backs_off():
    asm, done = _asm()
    _grad(asm, 2, 100, 200)  # iteration 1 never arrived, 2 did
    t = time.monotonic()
    asm.tick(t + 0.05)
    assert asm.repair.calls == [(1, [(100, 200)], True)]
    asm.tick(t + 0.06)
    assert len(asm.repair.calls) == 1  # backing off
    asm.tick(t + 0.2)
    assert len(asm.repair.calls) == 2


def test_invalid_control_is_forgotten_and_a_good_copy_completes_the_iteration():
    asm, done = _asm()
    _grad(asm, 1, 100, 200)
    bad = control_body(1, [0.1, 0.2])  # wrong number of lrs
    _control(asm, 1, bad)
    assert asm.drops["control_invalid"] == 1 and done == []
    _control(asm, 1)
    assert done == [1]


def test_gone_answer_marks_the_partition_for_a_reseed():
    asm, _ = _asm()
    asm.on_gone(0)  # stale: nothing wanted
    assert asm.reseed_wanted == ""
    asm.on_gone(1)
    assert "no longer retained" in asm.reseed_wanted


# ----- live re-seed: pieces rolled forward bit-exactly -------------------------------------
def _spec(kind="adamw"):
    groups = [{"params": ["a", "b"], "lr": 0.01, "weight_decay": 0.1}] if kind != "sgd" else \
        [{"params": ["a", "b"], "lr": 0.1, "momentum": 0.9}]
    return ModelSpec.build(3, [("a", (37, 11)), ("b", (300,))], kind, groups, 2)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("late", [False, True])
def test_reseed_pieces_roll_forward_to_the_reference_state(kind, late):
    spec = _spec(kind)
    p = 1
    start, end = spec.bounds(p)
    rng = np.random.default_rng(5)
    ref = make_optimizer(spec, start, end)
    ref.load({s: rng.standard_normal(end - start).astype(np.float32) if s == "param"
              else np.zeros(end - start, np.float32) for s in spec.slots}, 0)
    st = ShadowState(p, 2, 3, window=16)
    st.drops = Counter()
    st.set_spec(spec)
    grads = {it: rng.standard_normal(end - start).astype(np.float32) for it in range(1, 13)}
    t0 = 3
    for it in range(1, t0 + 1):
        ref.step(grads[it], [0.01], 0.5)
    st.begin_reseed(t0, "test")
    cuts = np.linspace(start, end, 5).astype(int)
    pieces = []
    from checkmate.shadow.control_message import Control

    def ctl(it):
        return Control(it, [0.01], 0.5, False, {}, {"it": it})

    for j, it in enumerate(range(t0 + 1, t0 + 8)):
        if j < 4:  # capture slice j right after the reference's step t0 + j
            a, b = cuts[j], cuts[j + 1]
            pieces.append((t0 + j, ref.step_count, a, b,
                           {s: ref.state[s][a - start:b - start].copy() for s in spec.slots}))
            if not late:
                st.reseed_piece(*pieces[-1][:2], a, b - a, pieces[-1][4])
        ref.step(grads[it], [0.01], 0.5)
        st.apply(it, grads[it], ctl(it))
    assert st.latest is None or late is False
    if late:  # every piece arrives after the shadow consumed the iterations
        for it_, step, a, b, arr in pieces:
            st.reseed_piece(it_, step, a, b - a, arr)
    assert st.reseed is None and st.latest == t0 + 7
    with st.pinned() as v:
        for s in spec.slots:
            assert np.array_equal(v.slots[s], ref.state[s]), s
        assert v.step == ref.step_count and v.extra == {"it": t0 + 7}
    st.stop()


def test_reseed_rejects_pieces_outside_the_partition_or_overlapping():
    spec = _spec()
    st = ShadowState(0, 2, 3)
    st.drops = Counter()
    st.set_spec(spec)
    with pytest.raises(CheckmateError):
        st.reseed_piece(0, 0, 0, 4, {s: np.zeros(4, np.float32) for s in spec.slots})
    st.begin_reseed(2, "test")
    a, b = spec.bounds(0)
    z = {s: np.zeros(10, np.float32) for s in spec.slots}
    with pytest.raises(CheckmateError, match="outside"):
        st.reseed_piece(2, 2, b - 5, 10, z)
    st.reseed_piece(2, 2, a, 10, z)
    with pytest.raises(CheckmateError, match="overlaps"):
        st.reseed_piece(2, 2, a + 5, 10, z)
    st.stop()


def test_with_the_job_key_only_tagged_requests_are_answered_and_answers_are_tagged():
    """A trainer answers only requests made with the job secret
    (checkmate.protocol.datamac), and its
    answers and "gone" carry the tag a shadow checks."""
    from checkmate.protocol import datamac

    net = f"127.{random.randrange(100, 200)}.{random.randrange(1, 250)}"
    key = datamac.data_key(bytes(range(32)))
    shadow = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    shadow.bind((f"{net}.100", 0))
    shadow.settimeout(1.0)
    log = ReplicaLog(keep=3)
    for it in range(1, 6):
        log.add_piece(it, 2, 500, 1, np.arange(4, dtype="<f4").tobytes())
    srv = RepairServer((f"{net}.10", 0), 7, log,
                       {1: ShadowTarget(1, f"{net}.100", shadow.getsockname()[1], 5, 6)},
                       data_key=key)
    try:
        to = srv.sock.getsockname()
        shadow.sendto(repair.request(7, 5, 6, 4, 1, [(500, 504)]), to)  # untagged
        shadow.sendto(repair.request(7, 5, 6, 4, 1, [(500, 504)],
                                     key=datamac.data_key(bytes(32))), to)  # another secret
        shadow.sendto(repair.request(7, 5, 6, 4, 1, [(500, 504)], key=key), to)
        shadow.sendto(repair.request(7, 5, 6, 1, 1, [(500, 504)], key=key), to)  # gone
        got = [shadow.recv(65536) for _ in range(2)]
        with pytest.raises(TimeoutError):
            shadow.recv(65536)
        assert srv.stats["drop_mac"] == 2
        for d in got:
            ring = np.frombuffer(d, np.uint8)
            ok = datamac.check_batch(np.uint64(key[0]), np.uint64(key[1]), ring,
                                     np.array([len(d)]), len(d), np.zeros(1, np.uint8))
            assert ok[0] == 1, wire.decode_header(d)
        assert sorted(wire.decode_header(d).flags for d in got) == sorted(
            [repair.ANSWER, repair.GONE])
    finally:
        srv.close()
        shadow.close()


def test_a_replica_of_the_partition_gets_its_own_answers_and_nobody_else_does():
    """With two replicas of partition 1, a request from the second replica's receive
    address is answered there; one from any other address is answered to the partition's
    first replica (the registered address), never to the asker."""
    net = f"127.{random.randrange(100, 200)}.{random.randrange(1, 250)}"
    socks = []
    for last in (100, 102, 150):  # first replica, second replica, a stranger
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((f"{net}.{last}", 0))
        s.settimeout(0.5)
        socks.append(s)
    first, second, stranger = socks
    log = ReplicaLog(keep=3)
    log.add_piece(4, 0, 500, 1, np.arange(8, dtype="<f4").tobytes())
    mirror = ShadowTarget(1, f"{net}.102", second.getsockname()[1], 5, 6)
    srv = RepairServer((f"{net}.10", 0), 7, log,
                       {1: ShadowTarget(1, f"{net}.100", first.getsockname()[1], 5, 6)},
                       mirrors={1: [mirror]})
    try:
        _ask(second, srv, 4, [(500, 504)])
        h, p = wire.decode(second.recv(65536))
        assert (h.flags, h.offset, h.count) == (repair.ANSWER, 500, 4)
        _ask(stranger, srv, 4, [(504, 508)])
        h, _ = wire.decode(first.recv(65536))
        assert (h.flags, h.offset, h.count) == (repair.ANSWER, 504, 4)
        with pytest.raises(TimeoutError):
            stranger.recv(65536)
    finally:
        srv.close()
        for s in socks:
            s.close()
