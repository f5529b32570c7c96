"""The shadow's per-datagram Python ingest loop, kept as the reference the compiled path
(checkmate.shadow.ingest, through Receiver.handle) is tested against
(tests/test_ingest_compiled.py). It was ``Receiver.handle`` until the compiled scan replaced
it (issue 21); unchanged but for taking the receiver as an argument."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from crc32c import crc32c

from checkmate.protocol import wire

_CTRL = int(wire.Flags.CONTROL)
_ACK, _NACK = int(wire.Flags.ACK), int(wire.Flags.NACK)
_PARITY = int(wire.Flags.PARITY)
_BAD_FLAGS = int(wire.Flags.HANDSHAKE | wire.Flags.SEED)
_SIZES = {int(k): v for k, v in wire.DTYPE_SIZE.items()}
_BYTES_DT = int(wire.DType.BYTES)


def reference_handle(rx: Any, buf: Any, view: memoryview, bases: Iterable[int],
                     lens: Sequence[int], mask: int, all_ok: bool) -> None:
    """Validate and place one batch on receiver ``rx``: datagram i is ``lens[i]`` bytes at
    ``buf[bases[i]:]`` (``view`` is a memoryview of ``buf``); bit i of ``mask`` says its
    data MAC verified (``all_ok``: every bit set)."""
    unpack = wire.STRUCT.unpack_from
    hl = wire.HEADER_LEN
    sizes = _SIZES
    drops = rx.drops
    magic_ok, version_ok = wire.MAGIC, wire.VERSION
    bytes_dt = _BYTES_DT
    job_ok, epoch_ok, token_ok = rx.job, rx.epoch, rx.token
    for i, (base, n) in enumerate(zip(bases, lens, strict=True)):
        if n < hl:
            drops["short"] += 1
            continue
        (magic, version, flags, job, epoch, token, it, offset, count, _seq, _bucket,
         part, dtype, _fi, _fk, _fm, group, crc) = unpack(buf, base)
        if magic != magic_ok:
            drops["magic"] += 1
            continue
        if version != version_ok:
            drops["version"] += 1
            continue
        if flags & _BAD_FLAGS:
            drops["flags"] += 1
            continue
        if not all_ok and not mask >> i & 1:
            drops["mac"] += 1  # not made with the job secret (or changed on the way)
            continue
        if flags & _NACK:
            # Only a trainer's "gone" answer may carry NACK here; requests go to
            # trainers, never to a shadow.
            if not flags & _ACK or count or n != hl:
                drops["flags"] += 1
                continue
        if flags & _ACK:
            if job != rx.job:
                drops["job"] += 1
                continue
            if flags & _NACK:
                if epoch != rx.epoch or token != rx.token:
                    drops["epoch" if epoch != rx.epoch else "token"] += 1
                    continue
                rx.repair_stats["gone"] += 1
                if rx.asm is not None:
                    rx.asm.on_gone(it)
                continue
            rx.repair_stats["answers"] += 1
            rx.repair_stats["answer_bytes"] += n - hl
        if job != job_ok:
            drops["job"] += 1
            continue
        if epoch != epoch_ok:
            drops["epoch"] += 1
            continue
        if token != token_ok:
            drops["token"] += 1
            continue
        size = sizes.get(dtype)
        if size is None or count * size != n - hl:
            drops["length"] += 1
            continue
        payload = view[base + hl:base + n]
        if crc32c(payload) != crc:
            drops["crc"] += 1
            continue
        asm = rx.asm
        if asm is None:
            drops["not_ready"] += 1
            continue
        if flags & _CTRL:
            if dtype != bytes_dt:
                drops["dtype"] += 1
                continue
            if part != rx.partition:  # another shadow's copy (issue 35 item 4)
                drops["partition"] += 1
                continue
            asm.place_control(it, offset, count, group, payload)
            continue
        if flags & _PARITY:  # FEC parity: no longer sent (docs/reliability.md, "FEC")
            drops["flags"] += 1
            continue
        if dtype != rx.grad_dtype:
            drops["dtype"] += 1
            continue
        if part != rx.partition:
            drops["partition"] += 1
            continue
        if offset < asm.start or offset + count > asm.end or count == 0:
            drops["range"] += 1
            continue
        # Fast path: float32 that extends the newest run of an open iteration (a
        # sender streaming its chunk in order); everything else takes asm.place.
        st = asm.open.get(it) if dtype == 0 else None
        if st is not None and asm._reset_to is None:
            cov = st.cov
            ends = cov.ends
            a = offset - asm.start
            if ends and ends[-1] == a:
                b = a + count
                ends[-1] = b
                cov.total += count
                st.raw[4 * a:4 * b] = payload
                asm.placed_bytes += 4 * count
                if cov.total == asm.size and st.control is not None \
                        and it == asm.next_dispatch:
                    asm._dispatch()
                continue
        asm.place(it, offset, count, dtype, payload)
