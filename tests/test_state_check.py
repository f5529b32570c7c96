"""The shadows' state check (issue 35 item 1): every ``verify_every`` iterations the trainers
send digests of their shares of each partition's state, and a shadow whose committed state
differs says so in one line, withdraws what it holds since the last iteration known to be
the trainers' (memory, disk) and is re-seeded live.

Unit: the digest, the control message's form, and a real ShadowState (AdamW partition, its
Persister wired as the node wires it) stepped beside a reference one whose digests play the
trainers'. Launch: examples/train.py, 4 trainers and 2 shadows, ``--verify-every 2``, 150
iterations (time for the trainers to notice the shadow's ask and re-seed it), and a bit
flipped in one shadow's committed state (CHECKMATE_SHADOW_FLIP_AT, test only): named at
the next check, re-seeded, and checked equal to the trainers' again; the other shadow's
checks all pass.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from shadow_cluster import make_spec

from checkmate.errors import CheckmateError
from checkmate.protocol import state_digest
from checkmate.protocol.state_digest import (
    StreamDigest,
    digest,
    digest_key,
    digest_pieces,
    valid_rows,
    word_count,
)
from checkmate.shadow import disk, persist
from checkmate.shadow.control_message import Control, parse_control
from checkmate.spec.partition import share_bounds

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"


def test_the_digest_is_keyed_and_sees_one_bit():
    a = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    key = digest_key(b"k" * 32)
    d = digest(key, [a, a[:10]])
    assert d == digest(key, [a.copy(), a[:10].copy()]) and len(d) == 32
    assert d == digest(key, [a.astype(np.float64), a[:10]])  # hashed as the shadow holds it
    assert d != digest(digest_key(b"j" * 32), [a, a[:10]])  # another run's key
    assert d != digest(digest_key(None), [a, a[:10]])
    b = a.copy()
    b[500:501].view(np.int32)[0] ^= 1
    assert digest(key, [b, a[:10]]) != d
    assert valid_rows([[d, d], [d, d]])
    for bad in ([], [[d], [d, d]], [[d.upper()]], [["0" * 31]], [[1]], {"0": [d]}):
        assert not valid_rows(bad), bad


def test_pieces_anywhere_and_the_device_path_give_the_one_digest():
    """The trainers hash their tensors a piece at a time where they are (a GPU's on the
    GPU: the torch path, run here on CPU tensors), the shadows one array: every way gives
    the same digest, a stream cut at any word, across block edges."""
    rng = np.random.default_rng(1)
    key = digest_key(b"k" * 32)
    a = rng.standard_normal(3 * state_digest.BLOCK + 77).astype(np.float32)
    whole = digest(key, [a])
    for cuts in ([0, 1, 2050, len(a)], [0, 777, 1024, 1025, 4000, len(a)],
                 sorted({0, len(a), *rng.integers(0, len(a), 6).tolist()})):
        numba_way, device_way = (StreamDigest(key, 2 * len(a)) for _ in range(2))
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            numba_way.add(2 * lo, a[lo:hi])
            # the device path's sums, forced for a CPU tensor
            b, sums = state_digest._device_sums(torch.from_numpy(a[lo:hi].copy()), 2 * lo,
                                                state_digest.coefficients(key))
            device_way.v[b:b + len(sums)] = (device_way.v[b:b + len(sums)] + sums) \
                % state_digest.P
        assert numba_way.hexdigest() == device_way.hexdigest() == whole, cuts
    # bytes of any dtype (replica agreement): an odd byte count is padded, the length kept
    odd = np.arange(5, dtype=np.uint8)
    assert word_count(odd) == 3 and digest_pieces(b"", [odd]) != digest_pieces(b"", [odd[:4]])
    with pytest.raises(ValueError, match="outside the stream"):
        StreamDigest(key, 4).add(2, a[:2])


def test_threads_cut_a_large_piece_at_block_edges_and_change_nothing(monkeypatch):
    key = digest_key(b"k" * 32)
    a = np.random.default_rng(3).standard_normal(3 * state_digest._PARALLEL_WORDS // 2 + 7
                                                 ).astype(np.float32)
    monkeypatch.setattr(state_digest, "THREADS", 3)
    state_digest._pool.cache_clear()
    got = StreamDigest(key, 2 * len(a) + 5)
    got.add(5, a)  # starts mid-block
    monkeypatch.setattr(state_digest, "THREADS", 1)
    one = StreamDigest(key, 2 * len(a) + 5)
    one.add(5, a)
    state_digest._pool.cache_clear()
    assert (got.v == one.v).all() and got.hexdigest() == one.hexdigest()


def test_the_digest_is_what_docs_protocol_md_says():
    """docs/protocol.md's formula, written out in plain Python from the text, against the
    module, on a stream of three blocks and a bit."""
    import hashlib
    import hmac
    import struct

    text = (ROOT / "docs" / "protocol.md").read_text()
    assert '"checkmate state digest v2"' in text and "mod (2^31 - 2)" in text
    p, block = 2**31 - 1, 2048
    k = hmac.new(b"c" * 32, b"checkmate state digest v2", hashlib.sha256).digest()
    stream = np.random.default_rng(2).standard_normal(3 * block // 2 + 5).astype(np.float32)
    words = struct.unpack(f"<{stream.size * 2}H", stream.tobytes())
    shake = hashlib.shake_256(b"checkmate state digest v2 coefficients" + k).digest(2 * block * 8)
    coef = [[1 + int.from_bytes(shake[8 * (block * lane + j):8 * (block * lane + j) + 8],
                                "little") % (p - 1) for j in range(block)] for lane in range(2)]
    h = hashlib.blake2b(digest_size=16, key=k)
    h.update(b"checkmate state digest v2" + struct.pack("<Q", len(words)))
    for b in range(-(-len(words) // block)):
        for lane in range(2):
            v = sum(coef[lane][j] * w for j, w in enumerate(words[b * block:(b + 1) * block]))
            h.update(struct.pack("<I", v % p))
    assert digest(digest_key(b"c" * 32), [stream]) == h.hexdigest()


def test_control_digests_are_checked_for_their_form():
    def body(digests: object) -> bytes:
        return json.dumps({"iteration": 3, "lrs": [0.1], "digests": digests}).encode()

    good = [["ab" * 16, "cd" * 16]] * 3
    assert parse_control(body(good), 3, 1).digests == good
    assert parse_control(json.dumps({"iteration": 3, "lrs": [0.1]}).encode(), 3, 1
                         ).digests is None
    with pytest.raises(ValueError, match="control digests must be"):
        parse_control(body([["ab" * 16], ["zz" * 16]]), 3, 1)


class _Shadow:
    """A real ShadowState of partition ``p``, stepping AdamW, its Persister wired."""

    def __init__(self, spec, p: int, root: Path | None = None, retain: int = 16) -> None:
        from checkmate.shadow.state import ShadowState

        self.spec, self.p = spec, p
        self.a, self.b = spec.bounds(p)
        self.state = ShadowState(p, spec.partitions, spec.job, retain=retain)
        self.state.set_spec(spec)
        self.state.control_key = b"c" * 32
        self.per = None
        if root is not None:
            self.per = persist.Persister(root, p, self.state, every=1, keep=16)
            self.state.on_commit = self.per.on_commit
            self.state.on_diverged = self.per.drop_from
        arrays = {s: np.zeros(self.b - self.a, np.float32) for s in spec.slots}
        arrays[spec.slots[0]][:] = 0.5  # the parameters; no optimizer state before a step
        self.state.install(0, 0, arrays)

    def step(self, it: int, digests: list[list[str]] | None = None) -> None:
        g = np.random.default_rng(it).standard_normal(self.b - self.a).astype(np.float32)
        self.state.apply(it, g, Control(it, [0.01] * len(self.spec.groups), None, False, {},
                                        {}, digests=digests))

    def shares(self, world: int) -> list[str]:
        """What each of ``world`` trainers would send for this partition (its newest)."""
        v = self.state.versions[-1]
        key = digest_key(self.state.control_key)
        return [digest(key, [v.slots[s][a - self.a:b - self.a] for s in self.spec.slots])
                for a, b in (share_bounds(self.a, self.b, r, world) for r in range(world))]


def test_the_check_request_checks_the_newest_version_and_refuses_changing_nothing():
    """``finish()``'s check of a last iteration that was not a checked one: the newest
    version against the trainers' digests; refused, with the state unchanged, for another
    iteration or digests of another form."""
    from checkmate.shadow.state_check import check_newest

    spec = make_spec(partitions=2)
    ref, got = _Shadow(spec, 1), _Shadow(spec, 1)
    for it in (1, 2, 3):
        ref.step(it)
        got.step(it)
    rows = [["0" * 32, d] for d in ref.shares(2)]
    for it, bad in ((2, rows), (4, rows), (3, [["xy"]]), (3, None), (3, [[rows[0][1]], []])):
        with pytest.raises(CheckmateError, match="check"):
            check_newest(got.state, it, bad)
        assert got.state.check.checks == 0 and got.state.retained() == [0, 1, 2, 3]
    assert check_newest(got.state, 3, rows) == {"iteration": 3, "verified": True,
                                                "diverged": ""}
    got.state.check.flip_at = 4
    for s in (ref, got):
        s.step(4)
    # as a mesh job's shadow of data-parallel group 1 (its job id's top byte): named so
    from checkmate.protocol.wire import group_job_id

    got.state.job = group_job_id(spec.job, 1, 2)
    said = check_newest(got.state, 4, [["0" * 32, d] for d in ref.shares(2)])
    assert not said["verified"] and said["diverged"].startswith(
        "group 1 partition 1: iteration 4: the committed state differs") and \
        got.state.retained() == [0, 1, 2, 3]


def test_the_newest_verified_version_outlives_the_window():
    """A rewind after the trainers' replicas diverge resumes at the newest verified
    iteration, which may be more than the window old: the shadow keeps it beside the
    window until a newer one is verified."""
    spec = make_spec(partitions=2)
    ref, got = _Shadow(spec, 1), _Shadow(spec, 1, retain=3)
    for it in range(1, 10):
        ref.step(it)
        got.step(it, [["0" * 32, d] for d in ref.shares(2)] if it in (2, 8) else None)
        if it == 7:
            assert got.state.retained() == [2, 5, 6, 7]
    assert got.state.check.verified == 8 and got.state.retained() == [7, 8, 9]
    assert got.state.verified_retained() == [8]


def test_a_failed_check_withdraws_the_state_until_a_reseed(tmp_path, caplog):
    spec = make_spec(partitions=2)
    ref = _Shadow(spec, 1)  # the trainers' state of partition 1
    got = _Shadow(spec, 1, tmp_path)
    got.state.check.flip_at = 3  # its memory flips a bit after iteration 3

    def checked(it: int) -> None:
        ref.step(it)
        rows = [["0" * 32, d] for d in ref.shares(3)]  # 3 ranks; partition 0 not ours
        got.step(it, rows)

    for it in (1, 2):
        checked(it)
    assert got.state.check.verified == 2 and got.state.retained()[-1] == 2
    got.step(3)  # not a checked iteration: the flip is not seen yet
    ref.step(3)
    deadline = time.monotonic() + 30
    while 3 not in disk.list_iterations(tmp_path / "part1"):  # the writer is behind
        assert time.monotonic() < deadline, disk.list_iterations(tmp_path / "part1")
        time.sleep(0.05)
    # the checked iterations' checkpoints are marked verified, the unchecked one is not
    assert [disk.is_verified(tmp_path / "part1", it) for it in (1, 2, 3)] == \
        [True, True, False]
    checked(4)
    line = [r.getMessage() for r in caplog.records if "differs from the trainers'" in
            r.getMessage()]
    a, b = share_bounds(*spec.bounds(1), 0, 3)  # the flipped element is the partition's first
    assert line == [f"partition 1: iteration 4: the committed state differs from the trainers' "
                    f"(1 of 3 ranks' shares; the first, rank 0's, elements [{a}, {b}) of emb, "
                    "w1): nothing after iteration 2 is restorable until the trainers re-seed the "
                    "partition, asked for now"], line
    assert got.state.check.status()["diverged"] == line[0]
    # withdrawn: memory, restore and disk (3 removed, 4 never written)
    assert got.state.retained() == [0, 1, 2]
    with pytest.raises(CheckmateError, match="after iteration 2 none is"):
        got.state.pin(4)
    assert disk.list_iterations(tmp_path / "part1") == [0, 1, 2]
    checked(5)  # still different: said once
    assert sum("differs from the trainers'" in r.getMessage() for r in caplog.records) == 1
    # the trainers' re-seed installs their state: restorable, checked equal again
    v = ref.state.versions[-1]
    got.state.install(5, v.step, {s: v.slots[s].copy() for s in spec.slots})
    assert got.state.retained() == [5] and got.state.check.status()["diverged"] == ""
    checked(6)
    assert got.state.check.verified == 6 and got.state.retained() == [5, 6]
    assert any("iteration 6: the state matches the trainers' again" in r.getMessage()
               for r in caplog.records)
    got.per.stop()


def test_a_flipped_bit_in_a_shadow_is_named_reseeded_and_checked_equal_again(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "4",
         "--shadows", "2", "--progress-every", "0", "--verify-every", "2",
         "--dir", str(tmp_path / "run"), str(EXAMPLE), "--steps", "151",
         "--out", str(tmp_path / "out.pt")],
        capture_output=True, text=True, timeout=400,
        env={**os.environ, "NUMBA_NUM_THREADS": "1", "CHECKMATE_SHADOW_FLIP_AT": "1:3"})
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "Traceback" not in out, out[-4000:]
    assert ("re-seeding the shadow of partition 1 while training runs (the state check of "
            "iteration 4 failed)") in out, out[-3000:]
    # 151 is not a checked iteration: finish() checks it (equal, so protected)
    assert "the shadows hold iteration 151 " in out, out[-3000:]
    log1 = (tmp_path / "run" / "shadow-1.log").read_text()
    said = re.findall(r"partition 1: iteration (\d+): the committed state differs from the "
                      r"trainers'", log1)
    assert said == ["4"], log1[-3000:]
    again = re.findall(r"partition 1: iteration (\d+): the state matches the trainers' again",
                       log1)
    assert len(again) == 1 and 4 < int(again[0]) <= 150, log1[-3000:]
    assert "differs" not in (tmp_path / "run" / "shadow-0.log").read_text()


def test_finish_checks_a_last_iteration_the_steps_did_not(tmp_path):
    """9 iterations checked every 4: the shadow's bit flips after 9, which only finish()'s
    check can see; the job ends saying the last iteration is not protected, and why."""
    p = subprocess.run(
        [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "2",
         "--shadows", "2", "--progress-every", "0", "--verify-every", "4",
         "--dir", str(tmp_path / "run"), str(EXAMPLE), "--steps", "9"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "NUMBA_NUM_THREADS": "1", "CHECKMATE_SHADOW_FLIP_AT": "1:9"})
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "Traceback" not in out, out[-4000:]
    assert ("training finished at iteration 9 but it is not protected: the shadow of "
            "partition 1") in out and "partition 1: iteration 9: the committed state differs " \
        "from the trainers'" in out, out[-3000:]
    assert "the shadows hold iteration 8 (per shadow: [9, 8])" in out, out[-3000:]


def _same_crc(payload: bytes, flip_bit: int, fix_byte: int) -> bytes:
    """``payload`` with bit ``flip_bit`` flipped and the 4 bytes from ``fix_byte`` set so
    that its CRC32C is unchanged: what an on-path host without the secret can do (a CRC
    is affine over GF(2), so 32 free bits absorb any change)."""
    import crc32c

    base = crc32c.crc32c(payload)

    def delta(bit: int) -> int:  # the CRC's change when one bit flips
        b = bytearray(payload)
        b[bit // 8] ^= 1 << (bit % 8)
        return crc32c.crc32c(bytes(b)) ^ base

    basis: dict[int, tuple[int, int]] = {}  # pivot bit -> (combined delta, chosen bits)
    for k in range(32):
        d, chosen = delta(8 * fix_byte + k), 1 << k
        for pivot in sorted(basis, reverse=True):
            if d >> pivot & 1:
                d, chosen = d ^ basis[pivot][0], chosen ^ basis[pivot][1]
        if d:
            basis[d.bit_length() - 1] = (d, chosen)
    want, chosen = delta(flip_bit), 0
    for pivot in sorted(basis, reverse=True):
        if want >> pivot & 1:
            want, chosen = want ^ basis[pivot][0], chosen ^ basis[pivot][1]
    assert want == 0  # 32 consecutive bits always suffice for a CRC-32
    b = bytearray(payload)
    b[flip_bit // 8] ^= 1 << (flip_bit % 8)
    for k in range(32):
        if chosen >> k & 1:
            b[fix_byte + k // 8] ^= 1 << (k % 8)
    assert crc32c.crc32c(bytes(b)) == base and bytes(b) != payload
    return bytes(b)


def test_a_payload_swapped_in_flight_under_its_crc_is_caught_by_the_next_check():
    """docs/security.md's residual: an on-path host swaps a gradient payload for another of
    the same CRC32C, which the datagram's tag (over the CRC) cannot see. Real shadows on
    loopback take it; the state check of that iteration names the partition and the
    trainers' share it landed in, and the other partition verifies."""
    from shadow_cluster import LRS, Cluster

    from checkmate.protocol import datamac, wire
    from checkmate.protocol.auth import load_secret
    from checkmate.shadow.feed import control_datagrams, grad_datagrams

    spec = make_spec(partitions=2)
    key = digest_key(datamac.control_key(load_secret()))
    world = 3
    c = Cluster(spec)
    try:
        c.seed(world)
        swapped = []
        for it in (1, 2):
            grad = c.rng.standard_normal(spec.total).astype(np.float32)
            c.step_ref(it, grad)
            ref = c.refs[it]
            rows = []
            for r in range(world):
                row = []
                for p in range(spec.partitions):
                    a, b = share_bounds(*spec.bounds(p), r, world)
                    row.append(digest(key, [ref[s][a:b] for s in spec.slots]))
                rows.append(row)
            for p in range(spec.partitions):
                a, b = spec.bounds(p)
                addr = ("127.0.0.1", c.nodes[p].udp_port)
                for d in grad_datagrams(spec.job, it, p, a, grad[a:b], chunk=50):
                    if it == 2 and p == 1 and not swapped:  # the swap, on the path
                        h = wire.decode_header(d)
                        body = _same_crc(d[wire.HEADER_LEN:], 8 * 4 * 3 + 20, 4 * 7)
                        d = d[:wire.HEADER_LEN] + body
                        assert wire.decode_header(d) == h
                        swapped.append(h.offset)
                    c.tx.sendto(d, addr)
                body = json.dumps({"iteration": it, "lrs": LRS, "clip_coef": None,
                                   "skip": False, "buffers": {"bn.mean": "A" * 16},
                                   "extra": {}, "digests": rows}).encode()
                for d in control_datagrams(spec.job, it, body, frag=200, partition=p):
                    c.tx.sendto(d, addr)
        sts = c.wait(lambda sts: all(s["state_check"]["checks"] == 2 for s in sts))
        assert sts[0]["state_check"]["verified_iteration"] == 2, sts[0]
        assert sts[0]["state_check"]["diverged"] == ""
        said = sts[1]["state_check"]
        assert said["verified_iteration"] == 1, said
        a, b = share_bounds(*spec.bounds(1), 0, world)  # the swap is the partition's first
        assert swapped == [spec.bounds(1)[0]] and said["diverged"].startswith(
            f"partition 1: iteration 2: the committed state differs from the trainers' (1 of "
            f"3 ranks' shares; the first, rank 0's, elements [{a}, {b})"), said
        assert sts[1]["latest"] == 1  # iteration 2 is not restorable
    finally:
        c.close()


def test_a_shadow_reloaded_from_disk_trusts_only_a_verified_checkpoint(tmp_path):
    """A restarted shadow that reloads its newest checkpoint takes it as the trainers'
    state only if that iteration passed the state check; the holdings say which are."""
    from shadow_cluster import Cluster

    from checkmate.train.shadow_client import ShadowClient

    spec = make_spec(partitions=1)
    ref, src = _Shadow(spec, 0), _Shadow(spec, 0, tmp_path)
    ref.step(1)
    src.step(1, [[d] for d in ref.shares(1)])
    src.step(2)  # unchecked
    src.per.stop()
    pdir = tmp_path / "part0"
    assert disk.list_iterations(pdir) == [0, 1, 2] and disk.is_verified(pdir, 1)
    for newest, trusted in ((2, None), (1, 1)):
        if newest == 1:
            persist.purge(tmp_path, 0, 2)
        c = Cluster(spec, dir=str(tmp_path), persist_every=1)
        try:
            with ShadowClient(c.addrs[0]) as cl:
                st, held = cl.status(), cl.holdings()
            assert st["state_check"]["trusted_iteration"] == trusted, st["state_check"]
            assert held["verified"] == [1] and held["memory"] == [newest], held
        finally:
            c.close()

