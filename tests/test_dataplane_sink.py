"""The shadow sink (dataplane/bpf/ckm_sink.c) and the dataplane bench's verdict on copies.

The netns tests run one testbed (prefix "tas") with the real switch and the sink on s0's
interface, and send real datagrams from t0's socket.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import time

import pytest

from checkmate.config import cluster as config
from checkmate.errors import CheckmateError
from checkmate.protocol import wire

_needs = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bpftool") is None,
                            reason="needs root for namespaces and BPF, and bpftool")


def netns(fn):
    """Mark a test as needing root, namespaces and BPF."""
    return pytest.mark.netns(_needs(fn))


EPOCH, TOKEN = 0x0BADCAFE, 0x12345678
N = 200


@pytest.fixture(scope="module")
def bed():
    from checkmate.dataplane.sink import ShadowSink
    from checkmate.dataplane.switch import ReplicationEntry
    from checkmate.testbed.netsock import udp_socket_in
    from checkmate.testbed.topology import Testbed

    cfg = config.with_prefix(config.load(config.default_path()), "tas")
    tb = Testbed(cfg)
    sink = ShadowSink(cfg, "s0")
    socks: list[socket.socket] = []
    try:
        tb.up()
        t0, t1, s0 = cfg.host("t0"), cfg.host("t1"), cfg.host("s0")
        tb.switch.add_replication(ReplicationEntry(
            cfg.job_id, t0.ip, t1.ip, 0, cfg.switch_ifname("s0"), s0.mac, s0.ip, s0.port,
            EPOCH, TOKEN, cfg.switch_ifname("t0")))
        sink.attach(EPOCH, TOKEN, drop=True)
        socks = [udp_socket_in(cfg.netns("t1"), ("0.0.0.0", t1.port), 8 << 20),
                 udp_socket_in(cfg.netns("s0"), ("0.0.0.0", s0.port), 8 << 20),
                 udp_socket_in(cfg.netns("t0"))]
        yield cfg, tb, sink, *socks
    finally:
        for s in socks:
            s.close()
        sink.detach()
        tb.down()


def _datagram(cfg, seq: int, replicate: bool = True) -> bytes:
    h = wire.Header(job_id=cfg.job_id, epoch=1, token=2, iteration=3, seq=seq, count=64,
                    partition=0, flags=wire.Flags.REPLICATE if replicate else 0)
    return wire.encode(h, struct.pack("<64f", *range(64)))


def _received(sock: socket.socket, quiet: float = 0.3) -> list[bytes]:
    from checkmate.testbed.netsock import drain

    return [d for d, _ in drain(sock, quiet=quiet)]


def _send(cfg, tx: socket.socket, n: int, replicate: bool = True) -> None:
    t1 = cfg.host("t1")
    for i in range(n):
        tx.sendto(_datagram(cfg, i, replicate), (t1.ip, t1.port))
        if i % 50 == 49:
            time.sleep(0.002)  # stay well inside every queue


@netns
def test_drop_mode_counts_correct_copies_and_keeps_them_from_the_socket(bed):
    cfg, tb, sink, rx_t1, rx_s0, tx = bed
    sink.set_drop(True)
    before = sink.counts()
    _send(cfg, tx, N)
    originals = _received(rx_t1)
    got = sink.counts() - before
    assert len(originals) == N
    assert (got.packets, got.ok, got.dropped) == (N, N, N)
    assert got.bytes == N * (14 + 20 + 8 + len(_datagram(cfg, 0)))
    assert _received(rx_s0, quiet=0.1) == []  # dropped before the IP stack


@netns
def test_pass_mode_counts_and_delivers_copies(bed):
    cfg, tb, sink, rx_t1, rx_s0, tx = bed
    sink.set_drop(False)
    before = sink.counts()
    _send(cfg, tx, N)
    _received(rx_t1)
    copies = _received(rx_s0)
    got = sink.counts() - before
    assert (got.packets, got.ok, got.dropped) == (N, N, 0)
    assert len(copies) == N  # the kernel's UDP checksum check passed them all
    assert all(wire.decode(c)[0].epoch == EPOCH for c in copies)


@netns
def test_wrong_session_is_counted_but_not_ok(bed):
    cfg, tb, sink, rx_t1, rx_s0, tx = bed
    sink.set_drop(True)
    sink.configure(EPOCH + 1, TOKEN, drop=True)  # the copies carry EPOCH: all wrong now
    try:
        before = sink.counts()
        _send(cfg, tx, 50)
        _received(rx_t1)
        got = sink.counts() - before
        assert (got.packets, got.ok, got.dropped) == (50, 0, 50)
    finally:
        sink.configure(EPOCH, TOKEN, drop=True)


@netns
def test_plain_and_non_ckm_traffic_pass_untouched(bed):
    from checkmate.testbed.netsock import udp_socket_in

    cfg, tb, sink, rx_t1, rx_s0, tx = bed
    s0 = cfg.host("s0")
    sink.set_drop(True)
    other = udp_socket_in(cfg.netns("s0"), ("0.0.0.0", 40000))
    try:
        before = sink.counts()
        _send(cfg, tx, 20, replicate=False)  # no copies at all
        for i in range(20):
            tx.sendto(b"not ckm %d" % i, (s0.ip, 40000))
        assert len(_received(rx_t1)) == 20
        assert len(_received(other)) == 20  # a non-ckm port is never dropped
        assert sink.counts() - before == type(before)(0, 0, 0, 0)
    finally:
        other.close()


@netns
def test_detach_removes_filter_and_pins_and_attach_recovers_stale_pins(bed):
    cfg, tb, sink, *_ = bed
    assert sink.is_attached() and sink.pin_dir.exists()
    sink.detach()
    assert not sink.is_attached() and not sink.pin_dir.exists()
    (sink.pin_dir / "junk").mkdir(parents=True)  # what a crashed run might leave
    sink.attach(EPOCH, TOKEN, drop=True)
    assert sink.is_attached() and (sink.pin_dir / "progs" / "ckm_sink").exists()
    assert not (sink.pin_dir / "junk").exists()


def test_sink_on_a_missing_namespace_is_one_clear_error():
    from checkmate.dataplane.sink import ShadowSink

    cfg = config.with_prefix(config.load(config.default_path()), "taszz")
    with pytest.raises(CheckmateError, match="does not exist"):
        ShadowSink(cfg, "s0").attach(EPOCH, TOKEN)
    with pytest.raises(CheckmateError, match="not attached"):
        ShadowSink(cfg, "s0").counts()


# -- the bench's verdict (no network needed) ----------------------------------------------

def _totals(sent: int, sink_ok: int, wrong: int = 0, plain_copies: int = 0) -> dict:
    def mode(rate: float, **kw: int) -> dict:
        t = {"sent": sent, "send_s": 1.0, "dest": sent, "dest_bytes": int(rate), "copies": 0,
             "copies_ok": 0, "sink": 0, "sink_ok": 0, "sink_dropped": 0, "switch_copies": 0,
             "cpu_s": 0.001, "rounds": [rate, rate]}
        t.update(kw)
        return t

    return {"plain": mode(100.0, switch_copies=plain_copies),
            "sink": mode(95.0, sink=sink_ok + wrong, sink_ok=sink_ok,
                         sink_dropped=sink_ok + wrong, switch_copies=sink_ok + wrong),
            "socket": mode(70.0, sink=sent, sink_ok=sent, copies=sent, copies_ok=sent,
                           switch_copies=sent)}


def test_bench_headline_is_the_sink_ratio(capsys):
    from checkmate.testbed.bench import dataplane

    assert dataplane._report(_totals(1000, 1000), 256, 312) == pytest.approx(0.95)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "replicated vs plain throughput ratio: 0.950"
    assert "end-to-end (shadow socket) median 0.700" in out[-2]
    assert sum("ratio:" in line for line in out) == 1


@pytest.mark.parametrize("kw", [{"sink_ok": 989}, {"sink_ok": 1000, "wrong": 1},
                                {"sink_ok": 1000, "plain_copies": 3}])
def test_bench_fails_when_copies_are_missing_or_wrong(kw, capsys):
    from checkmate.testbed.bench import dataplane

    with pytest.raises(CheckmateError, match="copies missing or wrong"):
        dataplane._report(_totals(1000, **kw), 256, 312)
    assert "throughput ratio:" not in capsys.readouterr().out


def test_blocks_put_plain_next_to_both_replicated_modes():
    from checkmate.testbed.bench.dataplane import block_order

    for r in range(4):
        order = block_order(r)
        assert sorted(order) == ["plain", "sink", "socket"] and order[1] == "plain"
    assert block_order(0)[0] != block_order(1)[0]


@pytest.mark.skipif(shutil.which("clang") is None or shutil.which("bpftool") is None
                    or os.geteuid() != 0, reason="needs clang, bpftool and root")
def test_sink_object_builds_and_passes_the_verifier():
    from checkmate.dataplane import build
    from checkmate.dataplane.switch import ensure_bpffs

    obj = build.ensure_built(name="ckm_sink")
    assert obj.name == "ckm_sink.o" and build.ensure_built(name="ckm_sink") == obj
    ensure_bpffs()
    pin = f"/sys/fs/bpf/tas-verify-{os.getpid()}"
    try:
        import subprocess

        res = subprocess.run(["bpftool", "prog", "loadall", str(obj), pin, "type",
                              "classifier"], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-2000:]
        assert os.listdir(pin) == ["ckm_sink"]
    finally:
        shutil.rmtree(pin, ignore_errors=True)
    with pytest.raises(CheckmateError, match="unknown BPF program"):
        build.ensure_built(name="nope")
