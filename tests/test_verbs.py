"""The verbs (RDMA UD) receiver of the shadow.

Host part (no device): the receive ring's bookkeeping and the completion path, which ends
in the same ``Receiver.handle`` as UDP, driven with a plain buffer laid out as the device
lays out UD receives (40-byte GRH, then the datagram).

Guest part: the soft-RoCE guest (checkmate.testbed.guest: QEMU/TCG, Debian's kernel with
rdma_rxe, pyverbs) boots once and runs checkmate.testbed.verbs_checks: a shadow fed over
a UD QP on rxe0 and one fed over UDP get the same datagrams (shuffled, duplicated, one
iteration's pieces held back and sent late, bad input) through a 128-slot ring that wraps
several times; both must commit the bytes of an optimizer stepped directly. Skipped, with
the reason naming what is missing, where the guest cannot boot.
"""

from __future__ import annotations

import ctypes
import json
import socket
from collections import Counter

import numpy as np
import pytest

from checkmate.errors import CheckmateError
from checkmate.protocol import auth, datamac
from checkmate.shadow.feed import grad_datagrams
from checkmate.shadow.receiver import Receiver
from checkmate.shadow.verbs import GRH, RecvRing, RingConsumer, open_device

JOB = 21


# ----------------------------------------------------------------------------- host
def test_verbs_ring_posts_in_batches_and_frees_each_slot_once():
    ring = RecvRing(8, 100, refill=3)
    assert ring.to_post() == list(range(8)) and ring.posted.all()
    assert ring.to_post() == []  # nothing free
    bases, lens = ring.take([(2, 0, GRH + 10), (5, 0, GRH + 56)])
    assert bases.tolist() == [2 * 140 + GRH, 5 * 140 + GRH] and lens.tolist() == [10, 56]
    assert ring.to_post() == []  # 2 free < refill 3: wait for a batch
    assert ring.to_post(force=True) == [2, 5]
    # a slot completed twice, an id out of range: never freed again, counted
    ring.take([(1, 0, GRH + 8)])
    bases, _ = ring.take([(1, 0, GRH + 8), (99, 0, GRH), (-1, 0, GRH)])
    assert bases.size == 0 and ring.errors["unknown_wr"] == 3
    # failed, GRH-short and oversize completions free their slot and place nothing
    bases, _ = ring.take([(3, 12, GRH + 8), (4, 0, GRH - 1), (6, 0, 141)])
    assert bases.size == 0
    assert (ring.errors["status"], ring.errors["grh"], ring.errors["oversize"]) == (1, 1, 1)
    assert sorted(ring.to_post()) == [1, 3, 4, 6]
    assert ring.completed == 6
    with pytest.raises(CheckmateError):
        RecvRing(0, 100)


def test_verbs_completions_take_the_udp_checks(tmp_path, monkeypatch):
    """Datagrams written after a GRH in ring slots reach Receiver.handle, are MAC-checked
    per batch and dropped by reason exactly as over UDP."""
    key = tmp_path / "job.key"
    auth.create_secret(key)
    secret = auth.load_secret(key)
    good = list(grad_datagrams(JOB, 1, 0, 0, np.arange(30, dtype=np.float32), chunk=10,
                               secret=secret))
    forged = bytearray(good[1])
    forged[50] ^= 0x01  # a tag bit: the MAC check must catch it
    short = good[2][:30]
    sent = [good[0], bytes(forged), short, good[2]]
    ring = RecvRing(4, 256, refill=1)
    ring.to_post()
    buf = (ctypes.c_ubyte * ring.size)()
    view = memoryview(buf).cast("B")
    comps = []
    for i, d in zip([3, 0, 2, 1], sent, strict=True):
        at = i * ring.stride
        view[at:at + GRH] = b"\xee" * GRH  # a GRH: never read as data
        view[at + GRH:at + GRH + len(d)] = d
        comps.append((i, 0, GRH + len(d)))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx = Receiver(sock, job=JOB, partition=0, drops=Counter(),
                      mac_key=datamac.data_key(secret))
        consumer = RingConsumer(rx, ring, buf)
        assert consumer.consume(comps) == 4
    finally:
        sock.close()
    # good ones pass every check and stop only because no state is attached yet
    assert dict(rx.drops) == {"mac": 1, "short": 1, "not_ready": 2}
    assert rx.received == 4 and consumer.stats["completions"] == 4


def test_verbs_without_pyverbs_or_device_is_one_line():
    with pytest.raises(CheckmateError) as e:
        open_device("ckmnone0")
    assert "\n" not in str(e.value)
    assert any(w in str(e.value) for w in ("pyverbs", "RDMA device")), str(e.value)


def test_verbs_shadow_cli_errors_are_one_line(capsys):
    from checkmate.shadow.cli import main

    for argv, needle in ((["--transport", "verbs"], "needs --device"),
                         (["--device", "rxe0"], "only applies with --transport verbs")):
        assert main(["serve", "--partition", "0/2", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err


# ----------------------------------------------------------------------------- guest
_GUEST: dict[str, object] = {}  # the one guest run's result, or why it failed


def _run_guest_checks() -> dict | str:
    from checkmate.testbed import guest

    try:
        rc, out, share = guest.run(
            ".venv/bin/python -m checkmate.testbed.verbs_checks checks "
            "$CKM_SHARE/result.json",
            timeout=900, env={"CKM_VERBS_SLOTS": "128", "CKM_VERBS_ITERATIONS": "16"})
    except CheckmateError as e:
        return f"the guest run failed: {e}"
    if rc != 0:
        return f"the guest's checks exited {rc}: {out[-4000:]}"
    if "rxe0" not in (share / "rdma-link").read_text():
        return "no rxe0 in the guest's rdma link list"
    return json.loads((share / "result.json").read_text())


@pytest.fixture(scope="module")
def guest_checks():
    """The guest boots once per session: a failed run fails every guest test with its
    reason instead of booting again for each."""
    from checkmate.testbed import guest

    why = guest.unavailable()
    if why is not None:
        pytest.skip(f"soft-RoCE guest unavailable: {why}")
    if "result" not in _GUEST:
        _GUEST["result"] = _run_guest_checks()
    result = _GUEST["result"]
    if isinstance(result, str):
        pytest.fail(result)
    return result


@pytest.mark.slow
def test_verbs_fed_shadow_commits_the_same_bytes_as_udp(guest_checks):
    r = guest_checks
    assert r["verbs_equals_reference"] and r["udp_equals_reference"], r
    assert r["verbs_equals_udp"] and r["verbs_bytes"] == r["udp_bytes"], r
    assert r["latest_after_bad"] == {"udp": r["iterations"], "verbs": r["iterations"]}


@pytest.mark.slow
def test_verbs_ring_under_load_wraps_and_loses_nothing(guest_checks):
    r = guest_checks
    st = r["verbs_status"]
    assert st["slots"] == 128 and r["datagrams_sent"] > 4 * st["slots"], st
    assert st["completions"] == st["datagrams"] == r["datagrams_sent"], (st, r)
    assert st["ring_errors"] == {} and st["post_calls"] > r["datagrams_sent"] // 128, st
    assert r["received"]["verbs"] == r["received"]["udp"] == r["datagrams_sent"]


@pytest.mark.slow
def test_verbs_grh_is_skipped_and_is_the_packets_ipv4_header(guest_checks):
    g = guest_checks["grh"]
    assert g == {"ipv4_version": 4, "protocol": 17, "src": "10.99.0.2",
                 "datagram_magic": "c4ec"}, g


@pytest.mark.slow
def test_verbs_out_of_order_late_and_duplicate_datagrams(guest_checks):
    r = guest_checks
    # pieces of iteration 3 held back: both stop at 2 and never step over the hole ...
    assert r["held_back_latest"] == {"udp": 2, "verbs": 2}, r["held_back_latest"]
    # ... and commit once they arrive; the 5 duplicates of iteration 2 counted, not placed
    assert r["drops_before_bad"]["verbs"] == r["drops_before_bad"]["udp"], r
    assert r["drops_before_bad"]["verbs"].get("stale", 0) \
        + r["drops_before_bad"]["verbs"].get("duplicate", 0) == 5, r


@pytest.mark.slow
def test_verbs_bad_input_is_dropped_and_counted_like_udp(guest_checks):
    bad = guest_checks["bad_input"]
    want = {"short": 3, "magic": 3, "mac": 3, "crc": 3, "length": 3}
    for name in ("verbs", "udp"):
        got = {k: v for k, v in bad[name].items() if v}
        assert got == want, (name, bad)


@pytest.mark.slow
def test_verbs_trainer_sender_cuts_copies_to_ud_messages(guest_checks):
    """ShadowSender.use_verbs (host mode over RDMA): one copy of the whole partition is cut
    into pieces that fit a 1024-byte UD message; the shadow commits the reference bytes."""
    ts = guest_checks["trainer_sender"]
    assert ts["equals_reference"], ts
    per_piece = (1024 - 56) // 4
    assert ts["pieces"] == -(-ts["floats"] // per_piece) + 1, ts  # + the control message


def test_verbs_device_is_for_host_mode_only():
    from checkmate.train import JobLayout, ShadowTarget

    with pytest.raises(CheckmateError, match="host mode"):
        JobLayout(job_id=1, rank=0, world=1, trainers=[("127.0.0.1", 1)],
                  shadows=[ShadowTarget(0, "127.0.0.1", 2)], shadow_tcp=[("127.0.0.1", 3)],
                  mode="switch", verbs_device="rxe0")
