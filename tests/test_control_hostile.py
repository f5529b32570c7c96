"""What a shadow accepts on its control path and across runs (issue 23): forged control
fragments with the clear-text session cost one counted drop and no memory; an incomplete
message expires and the iteration still completes; datagrams of another run (same secret,
same job id) are counted and dropped; a deeply nested or otherwise bad control message from
a holder of the secret is refused without killing the receive thread, unknown buffers are
refused, warnings about it are rate-limited; a receive loop that fails is restarted and the
status says so; the controller's state file is 0600.

Real shadows (ShadowNode in this process) on loopback, real datagrams; every commit is
compared with a twin shadow that saw no attack.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import stat
import time
from dataclasses import replace

import numpy as np
import pytest
from fakes import wait_status

from checkmate.protocol import datamac, jsonbound, wire
from checkmate.shadow.feed import control_body, control_datagrams, grad_datagrams
from checkmate.shadow.node import NodeOptions, ShadowNode
from checkmate.spec.model import ModelSpec
from checkmate.train.repair import owners_body
from checkmate.train.shadow_client import ShadowClient, seed_share

JOB, EPOCH, TOKEN = 7, 3, 0x5EED
RUN_A, RUN_B = "a" * 32, "b" * 32


def _spec() -> ModelSpec:
    return ModelSpec.build(JOB, [("w", (16, 8)), ("b", (8,))], "adamw",
                           [{"params": ["w", "b"], "lr": 1e-3}], 1,
                           buffers=[("bn.running_mean", (4,), "float32")])


def _node() -> ShadowNode:
    return ShadowNode(NodeOptions(partition=0, partitions=1, job=JOB, bind="127.0.0.1",
                                  port=0, restore_bind="127.0.0.1", restore_port=0,
                                  epoch=EPOCH, token=TOKEN)).start()


def _buffers(it: int) -> dict[str, str]:
    return {"bn.running_mean": base64.b64encode(
        np.full(4, it, "<f4").tobytes()).decode()}


def _iteration(it: int, grad: np.ndarray, run: str = "", body: bytes | None = None
               ) -> list[bytes]:
    out = list(grad_datagrams(JOB, it, 0, 0, grad, chunk=64, epoch=EPOCH, token=TOKEN,
                              run=run))
    if body is None:
        body = control_body(it, [1e-3], None, False, _buffers(it), {"it": it})
    return out + list(control_datagrams(JOB, it, body, frag=200, epoch=EPOCH, token=TOKEN,
                                        run=run))


class Pair:
    """An attacked shadow and a twin that sees only the trainers' datagrams."""

    def __init__(self, run: str = "") -> None:
        self.spec = _spec()
        rng = np.random.default_rng(5)
        self.flat = {s: np.zeros(self.spec.total, np.float32) for s in self.spec.slots}
        self.flat["param"][:] = rng.standard_normal(self.spec.total).astype(np.float32)
        self.grads = {it: rng.standard_normal(self.spec.total).astype(np.float32)
                      for it in range(1, 9)}
        self.nodes = [_node(), _node()]
        self.tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.clients = []
        for n in self.nodes:
            seed_share([("127.0.0.1", n.tcp_port)], self.spec, self.flat, 0, 1)
            c = ShadowClient(("127.0.0.1", n.tcp_port))
            if run:
                c.request(owners_body([("127.0.0.1", 9)], [], 0, run))
            self.clients.append(c)

    def send(self, i: int, datagrams: list[bytes]) -> None:
        for d in datagrams:
            self.tx.sendto(d, ("127.0.0.1", self.nodes[i].udp_port))
            time.sleep(0.0002)  # within the socket buffer: a loss would hide a bug

    def both(self, it: int, run: str = "") -> None:
        for i in (0, 1):
            self.send(i, _iteration(it, self.grads[it], run))

    def same(self, it: int) -> None:
        got, want = self.clients[0].fetch(it), self.clients[1].fetch(it)
        for s in self.spec.slots:
            assert np.array_equal(got.slots[s], want.slots[s]), s
        assert got.buffers == want.buffers and got.step == want.step

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.tx.close()
        for n in self.nodes:
            n.stop()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def _forged_fragment(it: int, total: int, rng: np.random.Generator, size: int = 1024
                     ) -> bytes:
    """What a host without the secret can make: the session from the clear text, a
    plausible fragment of a message of ``total`` bytes, no valid tag."""
    payload = rng.bytes(size)
    h = wire.Header(flags=wire.Flags.CONTROL, job_id=JOB, epoch=EPOCH, token=TOKEN,
                    iteration=it, offset=0, count=size, dtype=wire.DType.BYTES,
                    fec_group=total, seq=int(rng.integers(2**32)))
    return wire.encode(h, payload)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_forged_control_fragments_every_iteration_never_freeze_a_shadow(pair):
    rng = np.random.default_rng(1)
    forged = 0
    for it in range(1, 7):
        # Before the real message, as the attack of issue 23 did: the first fragment used
        # to fix the message length, and the real fragments were then dropped for good.
        frags = [_forged_fragment(it, int(t), rng) for t in (1024 + it, 5000, 64 << 20)]
        frags += [_forged_fragment(j, 64 << 20, rng) for j in range(it + 1, it + 4)]
        pair.send(0, frags)
        forged += len(frags)
        pair.both(it)
        for c in pair.clients:
            wait_status(c, lambda st, it=it: st["latest"] == it)
        pair.same(it)
    st = pair.clients[0].status()
    assert st["drops"].get("mac") == forged, st["drops"]
    assert not st["drops"].get("control_range") and not st["drops"].get("control_invalid")


def test_forged_datagrams_before_seeding_are_mac_drops():
    """docs/protocol.md: the tag is checked before anything but the header, in every state:
    forged datagrams to a shadow that holds no spec yet are ``mac``, a good one
    ``not_ready``."""
    node = _node()
    rng = np.random.default_rng(3)
    try:
        good = _iteration(1, np.ones(8, np.float32))
        forged = [_forged_fragment(1, 5000, rng)]
        forged += [d[:45] + bytes(7) + d[52:] for d in good[:-1]]  # gradients, tag zeroed
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with ShadowClient(("127.0.0.1", node.tcp_port)) as c:
            for d in forged + good[:1]:
                tx.sendto(d, ("127.0.0.1", node.udp_port))
            st = wait_status(c, lambda st: st["received"] >= len(forged) + 1)
        tx.close()
        assert st["drops"] == {"mac": len(forged), "not_ready": 1}, st["drops"]
    finally:
        node.stop()


def test_forged_fragments_reserve_no_memory(pair):
    """32 forged 1 KB fragments, each announcing a 64 MiB message of a different iteration
    in the window: they used to reserve 8 x 64 MiB."""
    rng = np.random.default_rng(2)
    c = pair.clients[0]
    before_rss, before = _rss(), c.status()
    pair.send(0, [_forged_fragment(1 + i % 8, (64 << 20) - i, rng) for i in range(32)])
    st = wait_status(c, lambda st: st["received"] - before["received"] >= 32)
    assert st["drops"].get("mac", 0) - before["drops"].get("mac", 0) == 32
    assert st["pending"] == []  # nothing was even opened
    assert _rss() - before_rss < (16 << 20), (_rss() - before_rss) >> 20


def test_an_incomplete_control_message_expires_and_the_iteration_completes(pair):
    """A verified fragment of a message that will never complete (another length; what a
    forged fragment would do in the 2^-32 case its tag passes) pins nothing: after
    CONTROL_EXPIRE without progress it is forgotten, and the message sent again (as a
    repair answer would) completes the iteration."""
    body = control_body(1, [1e-3], None, False, _buffers(1), {"it": 1})
    stray = next(control_datagrams(JOB, 1, b"x" * 4000, frag=200, epoch=EPOCH, token=TOKEN))
    pair.send(0, [stray])
    pair.send(0, _iteration(1, pair.grads[1], body=body))
    c = pair.clients[0]
    st = wait_status(c, lambda st: st["drops"].get("control_expired", 0) >= 1, timeout=10)
    assert st["latest"] is None or st["latest"] == 0
    assert st["drops"].get("control_range", 0) >= 1  # the real fragments, while it was held
    pair.send(0, list(control_datagrams(JOB, 1, body, frag=200, epoch=EPOCH, token=TOKEN)))
    pair.send(1, _iteration(1, pair.grads[1], body=body))
    for cl in pair.clients:
        wait_status(cl, lambda st: st["latest"] == 1)
    pair.same(1)


def test_a_control_message_for_another_partition_is_dropped_before_use(pair):
    """Issue 35 item 4: a valid control message (tagged with the job's keys) addressed to
    another partition -- e.g. that shadow's copy sent to this one's port -- is dropped and
    counted ``partition`` before any of its fields is used. Before, it was placed and its
    learning rate committed."""
    other = control_body(1, [0.5], None, False, _buffers(1), {"it": 1})
    theirs = list(control_datagrams(JOB, 1, other, frag=200, epoch=EPOCH, token=TOKEN,
                                    partition=1))
    pair.send(0, theirs)
    c = pair.clients[0]
    wait_status(c, lambda st: st["drops"].get("partition", 0) >= len(theirs), timeout=10)
    pair.both(1)
    for cl in pair.clients:
        wait_status(cl, lambda st: st["latest"] == 1)
    pair.same(1)
    assert c.fetch(1).lrs == [1e-3]
    assert c.status()["drops"].get("partition", 0) == len(theirs)


def test_datagrams_of_another_run_are_counted_and_dropped():
    """Run A and run B: same secret, same job id, same shadow. Everything captured in run A
    (gradients and control messages of iterations B has not reached) is sent to the shadow
    during run B, before B's own: every datagram is dropped as ``mac`` and the shadow
    commits exactly run B's state (its twin sees only run B)."""
    p = Pair(run=RUN_A)
    try:
        grads_a = {it: g * 3 for it, g in p.grads.items()}
        captured = [d for it in (1, 2, 3) for d in _iteration(it, grads_a[it], RUN_A)]
        p.send(0, _iteration(1, grads_a[1], RUN_A))  # run A works: the key is run A's
        wait_status(p.clients[0], lambda st: st["latest"] == 1)
        # run B starts: seeds (iteration 0 again) and names its run
        for n, c in zip(p.nodes, p.clients, strict=True):
            seed_share([("127.0.0.1", n.tcp_port)], p.spec, p.flat, 0, 1)
            c.request(owners_body([("127.0.0.1", 9)], [], 0, RUN_B))
            assert c.status()["run"] == RUN_B
        before = p.clients[0].status()
        p.send(0, captured)
        st = wait_status(p.clients[0], lambda st: st["received"] - before["received"]
                   >= len(captured))
        assert st["drops"]["mac"] - before["drops"].get("mac", 0) == len(captured)
        assert st["pending"] == []
        for it in (1, 2, 3):
            p.both(it, RUN_B)
            for c in p.clients:
                wait_status(c, lambda st, it=it: st["latest"] == it)
            p.same(it)
    finally:
        p.close()


def test_deep_json_and_unknown_buffers_are_refused_and_the_thread_lives(pair, caplog):
    """From a holder of the secret (the MAC verifies): ~2 KB of nested JSON, a buffer the
    spec does not list, one of the wrong size, and 40 more bad messages. Each is refused
    and counted; the receive thread lives on, the next real message commits, and the
    warnings are rate-limited (at most 5 lines, then a count)."""
    deep = b'{"iteration": 1, "lrs": [0.001], "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    assert 2000 < len(deep) < 2200
    bad = [deep,
           control_body(1, [1e-3], None, False, {"evil": "AAAA"}, {}),
           control_body(1, [1e-3], None, False, {"bn.running_mean": "AAAA"}, {})]
    bad += [b"{" * (i + 1) for i in range(40)]
    caplog.set_level(logging.WARNING, logger="checkmate.shadow")
    for b in bad:
        pair.send(0, list(control_datagrams(JOB, 1, b, frag=200, epoch=EPOCH, token=TOKEN)))
    c = pair.clients[0]
    st = wait_status(c, lambda st: st["drops"].get("control_invalid", 0) >= len(bad))
    assert st["drops"]["control_invalid"] == len(bad)
    assert st["receiver"]["alive"] and st["receiver"]["restarts"] == 0
    lines = [r.getMessage() for r in caplog.records if "control message" in r.getMessage()]
    assert len(lines) == 5, lines  # the burst; the rest counted, summed up a minute later
    assert any("nested 1001 levels" in x for x in lines), lines
    assert pair.nodes[0].state.asm._bad_log.suppressed == len(bad) - 5
    pair.both(1)
    for cl in pair.clients:
        wait_status(cl, lambda st: st["latest"] == 1)
    pair.same(1)


def test_unknown_buffer_is_named_in_the_gap_report(pair):
    """A control message naming a buffer the spec does not have is never committed."""
    body = control_body(1, [1e-3], None, False, {"evil": "AAAA"}, {})
    pair.send(0, _iteration(1, pair.grads[1], body=body))
    c = pair.clients[0]
    st = wait_status(c, lambda st: st["drops"].get("control_invalid", 0) >= 1)
    assert st["latest"] in (None, 0) and st["committed"] == 1  # only the seed
    from checkmate.shadow.control_message import parse_control

    with pytest.raises(ValueError, match="not in the spec"):
        parse_control(body, 1, 1, {"bn.running_mean": 16})


def test_a_failing_receive_loop_is_restarted_and_reported(pair, monkeypatch):
    """A bug (never bad input: that is dropped) that escapes the receive loop: it is
    logged, counted, everything half-assembled is dropped and the loop runs again."""
    node, c = pair.nodes[0], pair.clients[0]
    asm = node.state.asm
    real = asm.place_control
    calls = {"n": 0}

    def once(*a, **k):  # noqa: ANN002, ANN003
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real(*a, **k)

    monkeypatch.setattr(asm, "place_control", once)
    pair.send(0, _iteration(1, pair.grads[1]))
    st = wait_status(c, lambda st: st["receiver"]["restarts"] == 1)
    assert st["receiver"]["alive"] and "injected failure" in st["receiver"]["last_error"]
    assert st["drops"]["receiver_crashed"] == 1
    pair.send(0, _iteration(1, pair.grads[1]))  # what repair would fetch again
    pair.send(1, _iteration(1, pair.grads[1]))
    for cl in pair.clients:
        wait_status(cl, lambda st: st["latest"] == 1)
    pair.same(1)
    from checkmate import metrics

    text = metrics.render(metrics.ShadowCollector(node.status))
    assert "receiver_restarts_total" in text and "receiver_alive" in text


def test_the_trainers_refuse_a_control_message_over_the_spec_limit():
    from checkmate.errors import CheckmateError
    from checkmate.shadow.control_message import CONTROL_BASE, control_limit
    from checkmate.train.replicate import ShadowSender, ShadowTarget

    spec = _spec()
    s = ShadowSender(JOB, [ShadowTarget(0, "127.0.0.1", 9)], bytes(32))
    s.control_limit = control_limit(spec)
    try:
        s.control(1, {"iteration": 1, "extra": {"user": "x" * 1000}})
        with pytest.raises(CheckmateError, match="more than the"):
            s.control(1, {"iteration": 1, "extra": {"user": "x" * 2 * CONTROL_BASE}})
    finally:
        s.close()


def test_run_secret_and_tags():
    secret = bytes(range(32))
    assert datamac.run_secret(secret, "") == secret
    a, b = datamac.run_secret(secret, RUN_A), datamac.run_secret(secret, RUN_B)
    assert a != b and len(a) == 32 and a != secret
    with pytest.raises(ValueError):
        datamac.run_secret(secret, "A" * 32)
    # A control fragment's tag covers its message length: another length fails the check.
    d = next(control_datagrams(JOB, 1, b"y" * 100, epoch=EPOCH, token=TOKEN, secret=secret))
    key = datamac.data_key(secret)

    def ok(data: bytes) -> int:
        return int(datamac.check_batch(np.uint64(key[0]), np.uint64(key[1]),
                                       np.frombuffer(data, np.uint8), np.array([len(data)]),
                                       len(data), np.zeros(1, np.uint8))[0])

    assert ok(d) == 1
    h, payload = wire.decode(d)
    assert ok(wire.encode(replace(h, fec_group=h.fec_group + 1), payload)) == 0
    assert ok(wire.encode(replace(h, iteration=2), payload)) == 0


def test_bounded_json():
    assert jsonbound.loads(b'{"a": "[[[[[", "b": [1, [2]]}', 100, 3) == {
        "a": "[[[[[", "b": [1, [2]]}
    with pytest.raises(jsonbound.JsonBoundError, match="nested 5 levels"):
        jsonbound.loads(b"[[[[[]]]]]", 100, 4)
    with pytest.raises(jsonbound.JsonBoundError, match="exceeds"):
        jsonbound.loads(b"[1, 2, 3]", 5)
    with pytest.raises(jsonbound.JsonBoundError, match="not JSON"):
        jsonbound.loads(b"\xff{", 100)
    assert isinstance(jsonbound.JsonBoundError("x"), ValueError)
    json.loads(b"[" * 900 + b"]" * 900)  # what it guards against is below the limit here...
    with pytest.raises(jsonbound.JsonBoundError):  # ...and refused before json sees it
        jsonbound.loads(b"[" * 100000 + b"]" * 100000, 1 << 20)


def test_controller_state_file_is_private(tmp_path):
    from checkmate.control.sessions import SessionStore

    path = tmp_path / "controller.json"
    store = SessionStore(path)
    store.max_epoch = 3
    os.umask(0o022)
    store.save()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    store.save()  # and again over an existing file
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_each_start_draws_a_new_run_unless_one_is_given(monkeypatch, capsys):
    from checkmate.errors import CheckmateError
    from checkmate.train.session import RUN_ENV, draw_run

    monkeypatch.delenv(RUN_ENV, raising=False)
    monkeypatch.delenv("CKM_NCCL_BUCKETS", raising=False)
    a, b = draw_run(), draw_run()
    assert a != b and datamac.valid_run(a) and len(a) == 32
    monkeypatch.setenv(RUN_ENV, RUN_A)
    assert draw_run() == RUN_A
    monkeypatch.setenv(RUN_ENV, "not-hex")
    with pytest.raises(CheckmateError, match="32 lowercase hex"):
        draw_run()
    # the NCCL plugin tags with the job secret's own keys: the run stays the empty one, said
    monkeypatch.delenv(RUN_ENV)
    monkeypatch.setenv("CKM_NCCL_BUCKETS", "1024")
    assert draw_run() == ""
    assert "not bound" in capsys.readouterr().out
