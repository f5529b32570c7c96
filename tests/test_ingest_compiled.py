"""The compiled ingest (checkmate.shadow.ingest through Receiver.handle) against the Python
loop it replaced (tests/reference_ingest.py), on the same recorded batches: valid streams,
every drop reason, repair answers and "gone", parity, control fragments (good and bad),
out-of-order, duplicate and overlapping pieces, runs that cross iterations, float32,
bfloat16 and float16 gradients, UDP-like and verbs-like slot layouts, the CRC32C of the
crc32c package and the compiled table. Both must leave identical drop counters, repair
stats, dispatched iterations (bytes and control), staging bytes and coverage."""

from __future__ import annotations

import logging
import socket
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from checkmate.protocol import datamac, wire
from checkmate.shadow import ingest
from checkmate.shadow.assembler import Assembler
from checkmate.shadow.feed import control_body, control_datagrams, encode_grad
from checkmate.shadow.receiver import Receiver
from tests.reference_ingest import reference_handle

JOB, EPOCH, TOKEN, PART = 9, 4, 0x77, 1
START, SIZE = 1000, 2400
SECRET = bytes(range(32))
KEY = datamac.data_key(SECRET)
_DT = {"float32": 0, "bfloat16": 1, "float16": 2}
F = wire.Flags


def dgram(it: int, offset: int, count: int, rng: np.random.Generator, *, gdt: str = "float32",
          flags: int = int(F.REPLICATE), **over: int) -> bytes:
    """A tagged gradient piece; ``over`` changes header fields after tagging (the tag then
    no longer matches unless ``retag`` is given) or before (``job``, ``epoch``...)."""
    dtype = over.pop("dtype", _DT[gdt])
    payload = over.pop("payload", None)
    if payload is None:
        payload = (encode_grad(rng.standard_normal(count).astype(np.float32), gdt)
                   if dtype == _DT[gdt] else rng.bytes(count * wire.DTYPE_SIZE[dtype]))
    fields = dict(job_id=JOB, epoch=EPOCH, token=TOKEN, partition=PART)
    fields.update({k: over.pop(k) for k in list(over) if k in fields})
    crc = over.pop("claim_crc", None)  # a CRC the tag vouches for but the payload lacks
    crc = wire.crc(payload) if crc is None else crc
    tag = datamac.data_tag(KEY, fields["job_id"], flags, it, offset, count,
                           fields["partition"], dtype, crc)
    h = wire.Header(flags=flags, iteration=it, offset=offset, count=count, dtype=dtype,
                    fec_index=tag[0], fec_k=tag[1], fec_m=tag[2], fec_group=tag[3],
                    crc32c=crc, **fields)
    h = replace(h, **over)
    return wire.pack_header(h) + bytes(payload)


def control(it: int, frag: int = 40, body: bytes | None = None, **kw: object) -> list[bytes]:
    return list(control_datagrams(JOB, it, body or control_body(it, [0.01]), frag=frag,
                                  epoch=EPOCH, token=TOKEN, partition=PART, secret=SECRET,
                                  **kw))


def gone(it: int, **over: int) -> bytes:
    flags = int(F.ACK | F.NACK)
    tag = datamac.data_tag(KEY, JOB, flags, it, 0, 0, PART, 0, 0)
    h = wire.Header(flags=flags, job_id=JOB, epoch=EPOCH, token=TOKEN, iteration=it,
                    partition=PART, fec_index=tag[0], fec_k=tag[1], fec_m=tag[2],
                    fec_group=tag[3], crc32c=0)
    return wire.pack_header(replace(h, **over))


def stream(seed: int, gdt: str = "float32") -> list[bytes]:
    """Iterations 1..5 of the partition with every kind of datagram a shadow may see."""
    rng = np.random.default_rng(seed)
    out: list[bytes] = []
    size = 2 if gdt != "float32" else 4
    for it in range(1, 6):
        pieces, a = [], START
        while a < START + SIZE:
            c = min(int(rng.integers(50, 400)), START + SIZE - a)
            pieces.append(dgram(it, a, c, rng, gdt=gdt))
            a += c
        if it == 2:  # out of order: the second half first, then the first reversed
            h = len(pieces) // 2
            pieces = pieces[h:] + pieces[:h][::-1]
        if it == 3:  # duplicates and an overlapping piece, and one piece only as a repair
            pieces += [pieces[1], pieces[2]]
            pieces.insert(3, dgram(it, START + 10, 120, rng, gdt=gdt))
            hdr = wire.decode_header(pieces[0])
            pieces[0] = dgram(it, hdr.offset, hdr.count, rng, gdt=gdt,
                              flags=int(F.REPLICATE | F.ACK))
        if it == 4:  # the stream of 4 interleaved with a repeat of 3's (stale or duplicate)
            pieces = [p for pair in zip(pieces, out[-len(pieces):], strict=False)
                      for p in pair]
        out += pieces
        out += control(it, frag=int(rng.integers(20, 90)))
    # Every drop reason (and the assembler's), each a few times, spliced in at random.
    bad = [
        b"\xc4\xec\x01",  # short
        dgram(2, START, 10, rng, gdt=gdt, magic=0x1234),
        dgram(2, START, 10, rng, gdt=gdt, version=9),
        dgram(2, START, 10, rng, gdt=gdt, flags=int(F.REPLICATE | F.SEED)),
        dgram(2, START, 10, rng, gdt=gdt, flags=int(F.REPLICATE | F.PARITY)),
        dgram(2, START, 10, rng, gdt=gdt, flags=int(F.NACK)),  # NACK without ACK
        dgram(2, START, 10, rng, gdt=gdt, fec_group=1),  # mac
        dgram(2, START, 10, rng, gdt=gdt, job_id=JOB + 1),
        dgram(2, START, 10, rng, gdt=gdt, flags=int(F.ACK), job_id=JOB + 1),
        dgram(2, START, 10, rng, gdt=gdt, epoch=EPOCH + 1),
        dgram(2, START, 10, rng, gdt=gdt, token=TOKEN + 1),
        dgram(2, START, 10, rng, gdt=gdt, payload=b"\0" * (10 * size + 2)),  # length
        dgram(2, START, 10, rng, gdt=gdt, dtype=7, payload=b"\0" * 10),  # length (dtype)
        dgram(2, START, 10, rng, gdt=gdt, crc32c=5),  # mac: the tag covers the CRC
        dgram(2, START, 10, rng, gdt=gdt, claim_crc=5),  # crc
        dgram(2, START, 10, rng, gdt=gdt, payload=b"\1" * 10 * size, claim_crc=0),
        dgram(2, START, 10, rng, gdt=gdt, dtype=_DT[gdt] ^ 1 if gdt != "float16" else 0),
        dgram(2, START, 8, rng, gdt=gdt, dtype=3, payload=b"x" * 8),  # bytes, not control
        dgram(2, START, 10, rng, gdt=gdt, partition=PART + 1),
        # another partition's control message, validly tagged: dropped before use
        *control_datagrams(JOB, 3, control_body(3, [0.5]), frag=200, epoch=EPOCH,
                           token=TOKEN, partition=PART + 1, secret=SECRET),
        dgram(2, START - 5, 10, rng, gdt=gdt),  # range
        dgram(2, START + SIZE - 5, 10, rng, gdt=gdt),
        dgram(2, START, 0, rng, gdt=gdt, payload=b""),
        dgram(2, 2**64 - 3, 10, rng, gdt=gdt),
        dgram(2**64 - 2, START, 10, rng, gdt=gdt),  # window
        dgram(40, START, 10, rng, gdt=gdt),
        gone(5, epoch=EPOCH + 1), gone(5, token=TOKEN + 1),
        gone(4, count=1), gone(4, job_id=JOB + 2),
    ]
    # Iteration 6 never completes: a few pieces, bad control messages, "gone".
    six = [dgram(6, START + 100, 300, rng, gdt=gdt), dgram(6, START + 400, 300, rng, gdt=gdt),
           dgram(6, START + 1000, 50, rng, gdt=gdt),
           *control(6, body=b"{not json", frag=10_000),  # control_invalid
           control_mac_bad(6),  # control_mac
           fragment(6, b"x" * 10, 0, 2**32 - 1)]  # control_range: longer than allowed
    for b in bad + six:
        for _ in range(2):
            out.insert(int(rng.integers(0, len(out) + 1)), b)
    out.insert(len(out) * 3 // 4, gone(4))  # a "gone" for an iteration already complete
    # Runs of several pieces that are stale (1 is done) or past the window (30).
    late = [dgram(it, START + 200 * j, 200, rng, gdt=gdt) for it in (1, 30) for j in range(3)]
    return out + late + six + [gone(6)]  # ... and a "gone" that wants a re-seed


def fragment(it: int, part: bytes, offset: int, total: int) -> bytes:
    """A tagged control fragment: bytes [offset, offset+len(part)) of a ``total``-byte
    message."""
    h = wire.Header(flags=F.CONTROL, job_id=JOB, epoch=EPOCH, token=TOKEN, iteration=it,
                    offset=offset, count=len(part), dtype=wire.DType.BYTES, fec_group=total,
                    partition=PART, crc32c=wire.crc(part))
    h = replace(h, seq=datamac.control_tag(KEY, wire.pack_header(h)))
    return wire.encode(h, part)


def control_mac_bad(it: int) -> bytes:
    """A one-fragment control message whose HMAC is of another body."""
    body = control_body(it, [0.01])
    msg = body + datamac.control_mac(datamac.control_key(SECRET), JOB, it, b"other")
    return fragment(it, msg, 0, len(msg))


def batches(dgs: list[bytes], rng: np.random.Generator, verbs: bool):
    """Recorded batches: (buf, bases, lens), datagrams in random-size batches laid out in
    fixed slots (UDP's recvmmsg ring) or in slots taken in any order (the verbs ring)."""
    slot = 10_048
    i = 0
    while i < len(dgs):
        k = int(rng.integers(1, 70))
        part = dgs[i:i + k]
        i += k
        buf = np.zeros(slot * len(part) + 64, np.uint8)
        order = rng.permutation(len(part)) if verbs else np.arange(len(part))
        bases = (order * slot + (40 if verbs else 0)).astype(np.int64)
        for b, d in zip(bases, part, strict=True):
            buf[b:b + len(d)] = np.frombuffer(d, np.uint8)
        yield buf, bases, np.array([len(d) for d in part], np.int64)


def make(gdt: str, ready: bool = True) -> tuple[Receiver, list]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx = Receiver(sock, JOB, PART, Counter(), EPOCH, TOKEN, mac_key=KEY)
    sock.close()
    done: list = []
    if not ready:
        return rx, done

    def complete(it: int, staging: np.ndarray, ctl: object) -> None:
        done.append((it, staging.tobytes(), repr(ctl)))
        asm.committed = it
        asm.release(staging)

    asm = Assembler(START, START + SIZE, 1, complete, rx.drops, window=4, job=JOB,
                    control_key=datamac.control_key(SECRET))
    rx.attach(asm, gdt)
    return rx, done


def state(rx: Receiver, done: list) -> dict:
    out = {"drops": dict(rx.drops), "repair": dict(rx.repair_stats), "done": done}
    asm = rx.asm
    if asm is not None:
        out["asm"] = (asm.next_dispatch, asm.placed_bytes, asm.newest_seen,
                      asm.reseed_wanted)
        out["open"] = {it: (st.cov.starts, st.cov.ends, st.cov.total,
                            [st.staging[s:e].tobytes() for s, e in
                             zip(st.cov.starts, st.cov.ends, strict=True)],
                            st.ctrl_len, st.ctrl_cov.starts, st.ctrl_cov.ends,
                            repr(st.control), st.ctrl_error)
                       for it, st in sorted(asm.open.items())}
    return out


def run_both(dgs: list[bytes], seed: int, gdt: str, verbs: bool, ready: bool = True,
             table: bool = False) -> tuple[dict, dict]:
    new, new_done = make(gdt, ready)
    ref, ref_done = make(gdt, ready)
    if table:
        new._crc_fn = 0
    for buf, bases, lens in batches(dgs, np.random.default_rng(seed), verbs):
        new.handle(buf, bases, lens)
        ok = datamac.check_at(np.uint64(KEY[0]), np.uint64(KEY[1]), buf, bases, lens,
                              np.zeros(len(lens), np.uint8))
        mask = sum(1 << i for i in range(len(lens)) if ok[i])
        reference_handle(ref, buf, memoryview(buf), bases.tolist(), lens.tolist(), mask,
                         mask == (1 << len(lens)) - 1)
    return state(new, new_done), state(ref, ref_done)


@pytest.mark.parametrize("gdt,verbs,table", [("float32", False, False),
                                             ("float32", True, False),
                                             ("float32", False, True),
                                             ("bfloat16", True, False),
                                             ("float16", False, False)])
def test_compiled_ingest_matches_the_python_loop(gdt, verbs, table):
    for seed in range(3):
        dgs = stream(seed, gdt)
        new, ref = run_both(dgs, seed, gdt, verbs, table=table)
        assert new == ref, f"seed {seed}"
        # The streams exercise what they claim: every reason, repairs, dispatches.
        assert set(new["drops"]) >= {*ingest.REASONS} - {"not_ready"} | {
            "stale", "window", "duplicate", "control_range", "control_invalid", "control_mac"}
        assert new["repair"]["answers"] >= 1 and new["repair"]["gone"] == 2
        assert [d[0] for d in new["done"]] == [1, 2, 3, 4, 5] and new["asm"][3]  # re-seed
        if gdt == "float32":
            assert new["open"], "nothing left open: the coverage check saw nothing"


def test_compiled_ingest_matches_before_the_assembler_exists():
    dgs = stream(7)
    new, ref = run_both(dgs, 7, "float32", False, ready=False)
    assert new == ref and new["drops"]["not_ready"] > 10 and new["repair"]["gone"] == 2


def test_a_run_crossing_iterations_is_placed_as_two():
    """One batch: the tail of iteration 1, its control, the head of 2 (a run that crosses
    an iteration boundary), the rest of 2 and its control; and the same with 2's pieces
    ahead of 1's control. Both paths dispatch 1 and 2 with the same bytes."""
    rng = np.random.default_rng(3)
    one = [dgram(1, a, 200, rng) for a in range(START, START + SIZE, 200)]
    two = [dgram(2, a, 200, rng) for a in range(START, START + SIZE, 200)]
    for dgs in (one + control(1) + two + control(2),
                one[:-1] + two[:3] + [one[-1]] + control(1) + two[3:] + control(2)):
        b = ingest.Batch(len(dgs))
        buf, bases, lens = next(batches(dgs, np.random.default_rng(0), False)) \
            if len(dgs) < 70 else (None, None, None)
        if buf is None:
            buf = np.zeros(10_048 * len(dgs), np.uint8)
            bases = np.arange(len(dgs), dtype=np.int64) * 10_048
            for at, d in zip(bases, dgs, strict=True):
                buf[at:at + len(d)] = np.frombuffer(d, np.uint8)
            lens = np.array([len(d) for d in dgs], np.int64)
        b.params[:] = (JOB, EPOCH, TOKEN, PART, 0, START, START + SIZE, 1, 1, *KEY,
                       ingest.crc_function())
        ne = ingest.scan(buf, bases, lens, b.params, b.counts, b.ok, b.offs, b.events)
        kinds = [(int(e[0]), int(e[3])) for e in b.events[:ne]]
        runs = [k for k in kinds if k[0] == ingest.RUN]
        assert runs[:2] == [(ingest.RUN, 1), (ingest.RUN, 2)] and b.counts[ingest.TOTAL] == 0
        new, ref = make("float32"), make("float32")
        new[0].handle(buf, bases, lens)
        reference_handle(ref[0], buf, memoryview(buf), bases.tolist(), lens.tolist(), 0, True)
        assert state(*new) == state(*ref)
        assert [d[0] for d in new[1]] == [1, 2]


def test_crc32c_of_the_package_and_of_the_table_agree(monkeypatch, caplog):
    crc32c = pytest.importorskip("crc32c")
    rng = np.random.default_rng(0)
    fn = ingest.crc_function()
    assert fn != 0, "the crc32c package's C function was not taken"
    for n in (0, 1, 3, 8, 9, 15, 16, 17, 100, 4097, 8916):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        want = crc32c.crc32c(data.tobytes())
        assert int(ingest.crc_of(fn, data)) == want == int(ingest.crc_of(0, data))
    # A package whose function disagrees: the table, said in one line.
    monkeypatch.setattr(ingest, "_CRC_FN", None)
    monkeypatch.setattr(crc32c, "crc32c", lambda b: 12345)
    with caplog.at_level(logging.WARNING, "checkmate.shadow"):
        assert ingest.crc_function() == 0
    lines = [r for r in caplog.records if "CRC32C" in r.getMessage()]
    assert len(lines) == 1 and "compiled table" in lines[0].getMessage()
    assert ingest.crc_function(force_table=True) == 0


def test_interval_free_matches_a_bitmap():
    """IntervalSet.free (whether a run may be placed in one copy) against a bitmap."""
    from checkmate.shadow.intervals import IntervalSet

    rng = np.random.default_rng(5)
    for _ in range(200):
        iv, bitmap = IntervalSet(), np.zeros(80, bool)
        for _ in range(int(rng.integers(0, 8))):
            a = int(rng.integers(0, 70))
            b = a + int(rng.integers(1, 10))
            iv.add(a, b)
            bitmap[a:b] = True
        for _ in range(20):
            a = int(rng.integers(0, 75))
            b = a + int(rng.integers(1, 6))
            assert iv.free(a, b) == (not bitmap[a:b].any()), (iv.starts, iv.ends, a, b)
