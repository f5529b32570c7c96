"""What a switch would copy of the ckm NCCL plugin's traffic, and the checks on it: an
AF_PACKET tap that collects REPLICATE datagrams where there is no switch (loopback), and the
check that they carry every reduced element exactly once with a valid CRC and data MAC and
the allreduce's values (tests/test_nccl_ring.py, the device check's nccl-plugin run)."""

from __future__ import annotations

import numpy as np


class ReplicaTap:
    """Every REPLICATE datagram of job ``job`` seen on interface ``ifname`` (an AF_PACKET
    socket: needs root), collected by a thread -- what the switch copies to the shadows.
    Used on loopback, where there is no switch."""

    def __init__(self, ifname: str, job: int) -> None:
        import socket
        import threading

        self.job, self.datagrams = job, []
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0800))
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE
        self.sock.bind((ifname, 0x0800))
        self.sock.settimeout(0.1)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        from checkmate.protocol import wire

        while not self._stop.is_set():
            try:
                pkt, addr = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            if addr[2] == 4:  # PACKET_OUTGOING: loopback shows each packet twice
                continue
            ihl = (pkt[0] & 0xF) * 4
            if pkt[9] != 17 or len(pkt) < ihl + 8 + wire.HEADER_LEN:
                continue
            dport = int.from_bytes(pkt[ihl + 2:ihl + 4], "big")
            body = pkt[ihl + 8:]
            if (wire.is_ckm_port(dport) and body[3] & wire.Flags.REPLICATE
                    and int.from_bytes(body[4:8], "big") == self.job):
                self.datagrams.append(bytes(body))

    def close(self) -> list[bytes]:
        self._stop.set()
        self._t.join(2)
        self.sock.close()
        return self.datagrams


def check_replicas(datagrams: list[bytes], key: tuple[int, int], job: int,
                   buckets: list[int], first_iteration: int, iterations: int, partitions: int,
                   expect: dict[int, np.ndarray]) -> dict[str, int]:
    """Raises AssertionError unless the REPLICATE datagrams carry every reduced element of
    every iteration exactly once (a resent datagram is the same bytes: the shadow drops it
    as a duplicate), at its flat offset, with its owner partition, a valid CRC and a valid
    data MAC, and the value the allreduce produced (``expect[iteration]``)."""
    from checkmate.protocol import datamac, wire
    from checkmate.spec.partition import partition_bounds

    total = sum(buckets)
    bounds = partition_bounds(total, partitions)
    seen: dict[tuple[int, int, int], bytes] = {}
    resent = 0
    for d in datagrams:
        h, payload = wire.decode(d)  # raises on a bad CRC or length
        assert h.dtype == wire.DType.FLOAT32, h
        tag = datamac.data_tag(key, job, h.flags, h.iteration, h.offset, h.count, h.partition,
                               h.dtype, h.crc32c)
        assert tag == (h.fec_index, h.fec_k, h.fec_m, h.fec_group), f"bad MAC: {h}"
        lo, hi = bounds[h.partition]
        assert lo <= h.offset and h.offset + h.count <= hi, f"piece outside partition: {h}"
        assert h.count <= wire.MAX_PAYLOAD_JUMBO // 4, h
        k = (h.iteration, h.offset, h.count)
        if k in seen:
            assert seen[k] == bytes(payload), f"two different payloads for {k}"
            resent += 1
        seen[k] = bytes(payload)
    its = range(first_iteration, first_iteration + iterations)
    cover = {it: np.zeros(total, np.int32) for it in its}
    for (it, off, n), payload in seen.items():
        assert it in cover, f"iteration {it} outside {list(its)}"
        cover[it][off:off + n] += 1
        got = np.frombuffer(payload, "<f4")
        assert np.array_equal(got, expect[it][off:off + n]), f"wrong values at {it}:{off}"
    for it, c in cover.items():
        assert c.min() == 1 and c.max() == 1, (
            f"iteration {it}: {int((c == 0).sum())} elements missing, "
            f"{int((c > 1).sum())} sent more than once")
    return {"pieces": len(seen), "resent": resent}
