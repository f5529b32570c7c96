"""Hostile input at a real ``shadow serve`` process on loopback, at scale, with figures.

    .venv/bin/python scripts/hostile_input.py [--datagrams N] [--idle M]

Starts one shadow (its own job secret, partition 0/1, loopback), then from this process
sends N garbage and forged datagrams (random bytes; ckm headers with random fields and no
valid tag; real-looking gradient datagrams whose tag was made with another secret), opens M
connections that never authenticate (slowloris), four that announce 256 MiB frames, and one
with a deeply nested header. Prints the shadow's resident memory and thread count before
and after, whether every datagram was counted as a drop, and whether the process is still
serving. tests/test_hostile_input.py and tests/test_shadow_service_bounds.py assert the
same things at a smaller scale.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from checkmate.protocol import auth, datamac, wire
from checkmate.train.shadow_client import ShadowClient


def _proc(pid: int) -> tuple[int, int]:
    """(resident bytes, threads) of ``pid``."""
    rss = threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, threads


def _forged(rng: np.random.Generator, n: int) -> list[bytes]:
    stranger = datamac.data_key(bytes(32))
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            out.append(rng.bytes(int(rng.integers(0, 9000))))
            continue
        payload = rng.bytes(4 * int(rng.integers(1, 2000)))
        h = wire.Header(flags=int(wire.Flags.REPLICATE), job_id=int(rng.integers(1, 9)),
                        iteration=int(rng.integers(1, 50)), offset=int(rng.integers(0, 1000)),
                        count=len(payload) // 4, partition=0)
        if kind == 2:  # a tag, made with the wrong secret
            t = datamac.data_tag(stranger, h.job_id, h.flags, h.iteration, h.offset, h.count,
                                 0, 0, wire.crc(payload))
            h = h.with_(fec_index=t[0], fec_k=t[1], fec_m=t[2], fec_group=t[3])
        out.append(wire.encode(h, payload))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datagrams", type=int, default=400_000)
    ap.add_argument("--idle", type=int, default=200)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckm-hostile-"))
    key_file = auth.create_secret(work / "job.key")
    env = {**os.environ, auth.SECRET_ENV: str(key_file)}
    ip = "127.0.0.1"
    probe = socket.socket()
    probe.bind((ip, 0))
    tcp_port = probe.getsockname()[1]
    probe.close()
    log = open(work / "shadow.log", "wb")  # noqa: SIM115
    shadow = subprocess.Popen(
        [sys.executable, "-m", "checkmate.shadow.cli", "serve", "--partition", "0/1",
         "--bind", ip, "--port", "0", "--restore-port", str(tcp_port), "--no-register"],
        env=env, stdout=log, stderr=log)
    secret = auth.load_secret(key_file)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with ShadowClient((ip, tcp_port), secret=secret) as c:
                    st = c.status()
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline or shadow.poll() is not None:
                    print("shadow did not start; log:", (work / "shadow.log").read_text())
                    return 1
                time.sleep(0.2)
        udp_port = int(next(line.split("udp ")[1].split()[0].split(":")[1]
                            for line in (work / "shadow.log").read_text().splitlines()
                            if " udp " in line))
        rss0, thr0 = _proc(shadow.pid)
        print(f"before: RSS {rss0 / 2**20:.1f} MiB, {thr0} threads, drops {st['drops']}")
        rng = np.random.default_rng(3)
        batch = _forged(rng, 20_000)
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        t0, sent = time.monotonic(), 0
        while sent < a.datagrams:
            for d in batch[:a.datagrams - sent]:
                tx.sendto(d, (ip, udp_port))
                sent += 1
                if sent % 500 == 0:
                    time.sleep(0.001)  # stay within the socket buffer: a loss hides nothing
        secs = time.monotonic() - t0
        conns = []
        for _ in range(a.idle):
            s = socket.create_connection((ip, tcp_port))
            conns.append(s)
        for _ in range(4):
            s = socket.create_connection((ip, tcp_port))
            s.sendall(struct.pack("!I", 256 << 20))
            conns.append(s)
        s = socket.create_connection((ip, tcp_port))
        deep = b"[" * 4000
        s.sendall(struct.pack("!I", len(deep)) + deep)
        conns.append(s)
        time.sleep(1.0)
        rss1, thr1 = _proc(shadow.pid)
        print(f"{sent} datagrams in {secs:.1f} s, {a.idle} idle + 4 oversize + 1 nested "
              f"connections open: RSS {rss1 / 2**20:.1f} MiB, {thr1} threads")
        time.sleep(6.0)  # past the 5 s authentication deadline
        for s in conns:
            s.close()
        time.sleep(0.5)
        with ShadowClient((ip, tcp_port), secret=secret) as c:
            st = c.status()
        rss2, thr2 = _proc(shadow.pid)
        dropped = sum(v for k, v in st["drops"].items() if not k.startswith("tcp_"))
        print(f"after: RSS {rss2 / 2**20:.1f} MiB, {thr2} threads, received {st['received']}, "
              f"dropped {dropped} ({st['drops']}), still serving: {shadow.poll() is None}")
        ok = (st["received"] == sent and dropped == sent and shadow.poll() is None
              and st["latest"] is None)
        print(f"every datagram counted as dropped, nothing committed: {ok}")
        return 0 if ok else 1
    finally:
        shadow.terminate()
        shadow.wait(10)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
