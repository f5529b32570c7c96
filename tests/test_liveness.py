"""Liveness: the trainers know within about 2 s that shadows are gone or silent, say so in
one line, report "unprotected since iteration N", and protection returns by itself.

Real shadow nodes on loopback (real UDP/TCP, real DCP checkpoints) on fixed ports, so they
can die and come back where the trainer's monitor looks for them; a silent shadow is a TCP
listener that accepts and never speaks (a stopped or wedged process). The session is a
stand-in (layout, done_iteration): the monitor reads nothing else of it here.
"""

from __future__ import annotations

import logging
import socket
import time
from types import SimpleNamespace

import numpy as np
from fakes import free_port
from shadow_cluster import make_spec

from checkmate.shadow.feed import control_body, control_datagrams, grad_datagrams
from checkmate.shadow.node import NodeOptions, ShadowNode
from checkmate.train.protection import ProtectionMonitor
from checkmate.train.repair import owners_body
from checkmate.train.shadow_client import seed_share


def _node(spec, p, udp, tcp, d):
    return ShadowNode(NodeOptions(p, spec.partitions, spec.job, bind="127.0.0.1", port=udp,
                                  restore_bind="127.0.0.1", restore_port=tcp, dir=d,
                                  persist_every=1, keep=3)).start()


def _send(spec, nodes, it, rng, tx):
    grad = rng.standard_normal(spec.total).astype(np.float32)
    for p, n in enumerate(nodes):
        a, b = spec.bounds(p)
        for d in grad_datagrams(spec.job, it, p, a, grad[a:b], chunk=50,
                                dtype=spec.grad_dtype):
            tx.sendto(d, ("127.0.0.1", n.udp_port))
        body = control_body(it, [0.01, 0.003], None, False, {"bn.mean": "AAAAAAAAAAAAAAAA"},
                            {"it": it})
        for d in control_datagrams(spec.job, it, body, frag=40, partition=p):
            tx.sendto(d, ("127.0.0.1", n.udp_port))


def _session(spec, addrs):
    """The monitor's view of a CheckmateSession: the layout, the trainers' iteration, and the
    peers request (one trainer, repair off); models no training, so no re-seed starts."""
    sess = SimpleNamespace(layout=SimpleNamespace(rank=0, world=1, shadow_tcp=addrs,
                                                  tcp_sets=[addrs]),
                           done_iteration=0, model=None)
    sess.peers_body = lambda p: owners_body([("127.0.0.1", free_port())], [], 0)
    return sess


def _until(cond, timeout, what):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what()
        time.sleep(0.02)
    return time.monotonic() - t0


def test_all_shadows_down_is_known_within_two_seconds_and_protection_returns(
        tmp_path, caplog):
    spec = make_spec()
    ports = [(free_port(), free_port()) for _ in range(2)]
    nodes = [_node(spec, p, u, t, str(tmp_path)) for p, (u, t) in enumerate(ports)]
    addrs = [("127.0.0.1", t) for _, t in ports]
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rng = np.random.default_rng(3)
    flat = {s: np.zeros(spec.total, np.float32) for s in spec.slots}
    flat["param"][:] = rng.standard_normal(spec.total).astype(np.float32)
    sess = _session(spec, addrs)
    mon = None
    caplog.set_level(logging.WARNING, logger="checkmate.train")
    try:
        seed_share(addrs, spec, flat, 0, 1)
        mon = ProtectionMonitor(sess, poll=0.1)
        mon.start()
        for it in range(1, 4):
            _send(spec, nodes, it, rng, tx)
            sess.done_iteration = it
        prot = mon.protection
        _until(lambda: prot()["newest_consistent"] == 3, 15, prot)
        p = prot()
        assert p["protected_now"] and p["unprotected_since"] is None
        assert all(s["up"] and s["lag"] == 0 for s in p["shadows"].values()), p
        # Every shadow dies; the trainers train on (iteration 4 is covered by nothing).
        for n in nodes:
            n.stop()
        t0 = time.monotonic()
        sess.done_iteration = 4
        took = _until(lambda: not prot()["protected_now"], 5, prot)
        assert took <= 2.5, took
        took = _until(lambda: not any(s["up"] for s in prot()["shadows"].values()), 5, prot)
        assert took <= 2.5, took
        p = prot()
        assert p["unprotected_since"] == 4 and p["newest_consistent"] is None, p
        assert all(s["latest"] is None and s["lag"] is None for s in p["shadows"].values())
        _until(lambda: "UNPROTECTED" in caplog.text, 5, lambda: caplog.text)
        lines = [r.getMessage() for r in caplog.records if "UNPROTECTED" in r.getMessage()]
        assert len(lines) == 1 and time.monotonic() - t0 <= 3.5, lines
        assert lines[0].startswith("checkmate: UNPROTECTED since iteration 4: shadow of "
                                   "partition 0 (127.0.0.1:"), lines
        assert "has not answered for" in lines[0] and "Connection refused" in lines[0]
        time.sleep(0.5)  # it stays lost, said once
        assert sum("UNPROTECTED" in r.getMessage() for r in caplog.records) == 1
        # They come back from disk (iteration 3) on the same addresses: answering is not
        # enough, iteration 4 is still uncovered ...
        nodes = [_node(spec, p, u, t, str(tmp_path)) for p, (u, t) in enumerate(ports)]
        _until(lambda: all(s["up"] for s in prot()["shadows"].values()), 10, prot)
        time.sleep(0.3)
        p = prot()
        assert not p["protected_now"] and p["unprotected_since"] == 4, p
        assert p["newest_consistent"] == 3, p  # what exists now: both hold 3 again
        assert any("holds iteration 3, not yet 4" in w for w in p["unprotected_why"]), p
        # ... until the trainers' iteration 4 reaches them: protection returns by itself,
        # with one line.
        _send(spec, nodes, 4, rng, tx)
        _until(lambda: prot()["protected_now"], 10, prot)
        p = prot()
        assert p["newest_consistent"] == 4 and p["unprotected_since"] is None, p
        assert p["protection_lost"] == 1
        _until(lambda: all(s["lag"] == 0 for s in prot()["shadows"].values()), 5, prot)
        _until(lambda: "protected again" in caplog.text, 5, lambda: caplog.text)
        assert ("checkmate: protected again: every shadow answers and holds iteration 4 or "
                "newer (unprotected from iteration 4)") in caplog.text
    finally:
        if mon is not None:
            mon.close()
        for n in nodes:
            n.stop()
        tx.close()


def test_a_silent_shadow_is_down_within_two_seconds(tmp_path, caplog):
    """A shadow that accepts connections but never answers (stopped, wedged): the status
    request times out and, 2 s after its last answer, the shadow is down."""
    spec = make_spec(partitions=1)
    u, t = free_port(), free_port()
    node = _node(spec, 0, u, t, None)
    silent = None
    sess = _session(spec, [("127.0.0.1", t)])
    caplog.set_level(logging.WARNING, logger="checkmate.train")
    mon = None
    try:
        flat = {s: np.zeros(spec.total, np.float32) for s in spec.slots}
        seed_share([("127.0.0.1", t)], spec, flat, 0, 1)
        mon = ProtectionMonitor(sess, poll=0.1)
        mon.start()
        _until(lambda: mon.protection()["newest_consistent"] == 0, 10, mon.protection)
        node.stop()
        # The same address now accepts connections (in the kernel's backlog) and never
        # speaks: what a stopped or wedged shadow looks like to its clients.
        silent = socket.create_server(("127.0.0.1", t))
        took = _until(lambda: not mon.protection()["protected_now"], 5, mon.protection)
        assert took <= 2.5, took
        _until(lambda: "UNPROTECTED since iteration 1" in caplog.text, 5,
               lambda: caplog.text)
        assert "timed out" in caplog.text or "has not answered" in caplog.text
    finally:
        if mon is not None:
            mon.close()
        if silent is not None:
            silent.close()
        node.stop()


def test_a_restarted_empty_shadow_is_seen_at_once_not_at_the_next_regular_poll(tmp_path):
    """Regular polls 5 s apart: a shadow that is down is polled every FAST_POLL, so the
    restarted, empty one is seen answering (without state: its re-seed can start) within a
    fraction of a second of its service coming up, not up to 5 s later."""
    from checkmate.train.protection import FAST_POLL

    spec = make_spec(partitions=1)
    u, t = free_port(), free_port()
    node = _node(spec, 0, u, t, None)
    sess = _session(spec, [("127.0.0.1", t)])
    mon = None
    try:
        flat = {s: np.zeros(spec.total, np.float32) for s in spec.slots}
        seed_share([("127.0.0.1", t)], spec, flat, 0, 1)
        mon = ProtectionMonitor(sess, poll=5.0)
        mon.start()
        view = mon.views[0]
        _until(lambda: view.reachable and view.seeded, 10, lambda: view)
        node.stop()
        _until(lambda: not view.reachable, 10, lambda: view)  # found at a regular poll
        node = _node(spec, 0, u, t, None)  # back, empty (no directory, no seed)
        took = _until(lambda: view.reachable and not view.seeded, 10, lambda: view)
        assert took < 10 * FAST_POLL + 0.5, took
    finally:
        if mon is not None:
            mon.close()
        node.stop()
