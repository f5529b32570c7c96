"""`testbed bench dataplane`: what replication costs the kernel switch's forwarding.

One run builds its own testbed (prefix "tabn"), installs one replication entry (t0 -> t1,
partition 0 -> shadow s0) and alternates rounds of plain ckm and REPLICATE ckm traffic
from t0 to t1 (order ABBA...), same datagram size, same duration. Per mode it reports:

- sender rate (datagrams and MB/s out of t0's socket; on veth the forwarding path and the
  socket delivery run in the sender's softirq context, so this is the switch's capacity),
- goodput at the destination (what t1's socket received, and the loss),
- copies that reached the shadow with the entry's epoch/token (replicated rounds).

Headline: destination goodput with replication / without it, the median over rounds of the
ratio between back-to-back rounds (robust to bursts of outside load on a shared machine).
Sender and receivers are separate processes (fork), each with its socket inside its host's
namespace.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import struct
import sys
import time
from multiprocessing.connection import Connection

from checkmate import config, wire
from checkmate.errors import CheckmateError, cli_guard

PREFIX = "tabn"
EPOCH, TOKEN = 0x11223344, 0x55667788


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CheckmateError(message)


def _receiver(netns: str, port: int, counts, check_session: bool, stop) -> None:
    """Count datagrams and bytes (and, for the shadow, copies carrying the entry's session)."""
    from checkmate.testbed.netsock import udp_socket_in

    sock = udp_socket_in(netns, ("0.0.0.0", port), 32 << 20)
    sock.setblocking(False)
    gc.disable()  # the loop allocates nothing cyclic; keep collector pauses out of the rates
    buf = bytearray(65536)
    session = struct.pack("!II", EPOCH, TOKEN)
    n = nbytes = ok = 0
    recv_into = sock.recv_into
    while not stop.is_set():
        # Drain, then nap: a receiver that is not waiting on the socket costs the sender no
        # wake-up per datagram (the socket buffer is large enough for the nap).
        try:
            while True:
                got = recv_into(buf)
                n += 1
                nbytes += got
                if check_session and buf[8:16] == session:
                    ok += 1
        except BlockingIOError:
            pass
        counts[0], counts[1], counts[2] = n, nbytes, ok
        time.sleep(0.0005)
    sock.close()


def _sender(netns: str, dst: tuple[str, int], datagrams: dict[str, bytes],
            conn: Connection) -> None:
    """On ("send", mode, seconds): send that mode's datagram as fast as possible; reply the
    count. Sends in batches of 256 between clock reads."""
    from checkmate.testbed.netsock import udp_socket_in

    sock = udp_socket_in(netns)
    gc.disable()
    send = sock.sendto
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, mode, seconds = msg
        d = datagrams[mode]
        sent = 0
        t0 = time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            for _ in range(256):
                send(d, dst)
            sent += 256
        conn.send((sent, time.perf_counter() - t0))
    sock.close()


def _snapshot(counts) -> tuple[int, int, int]:
    return counts[0], counts[1], counts[2]


def run(rounds: int, seconds: float, payload: int) -> dict[str, dict[str, float]]:
    from checkmate.dataplane.switch import ReplicationEntry
    from checkmate.testbed.topology import Testbed

    cfg = config.with_prefix(config.load(config.default_path()), PREFIX)
    t0, t1, s0 = cfg.host("t0"), cfg.host("t1"), cfg.host("s0")
    n = payload // 4
    body = struct.pack(f"<{n}f", *range(n))
    base = wire.Header(job_id=cfg.job_id, epoch=1, token=2, iteration=1, count=n, partition=0)
    datagrams = {
        "plain": wire.encode(base, body),
        "replicated": wire.encode(base.with_(flags=wire.Flags.REPLICATE), body),
    }
    ctx = mp.get_context("fork")
    totals: dict = {m: {"sent": 0, "send_s": 0.0, "dest": 0, "dest_bytes": 0, "copies": 0,
                        "copies_ok": 0, "rounds": []} for m in datagrams}
    with Testbed(cfg) as tb:
        tb.switch.add_replication(ReplicationEntry(
            cfg.job_id, t0.ip, t1.ip, 0, cfg.switch_ifname("s0"), s0.mac, s0.ip, s0.port,
            EPOCH, TOKEN))
        stop = ctx.Event()
        c_dst = ctx.RawArray("Q", 3)
        c_sh = ctx.RawArray("Q", 3)
        procs = [ctx.Process(target=_receiver, args=(cfg.netns("t1"), t1.port, c_dst, False,
                                                     stop), daemon=True),
                 ctx.Process(target=_receiver, args=(cfg.netns("s0"), s0.port, c_sh, True,
                                                     stop), daemon=True)]
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=_sender, args=(cfg.netns("t0"), (t1.ip, t1.port),
                                                       datagrams, child), daemon=True))
        for p in procs:
            p.start()
        try:
            time.sleep(0.5)  # receivers bound
            order = ["plain", "replicated"]
            for r in range(rounds):
                for mode in (order if r % 2 == 0 else order[::-1]):
                    d0, s0c = _snapshot(c_dst), _snapshot(c_sh)
                    parent.send(("send", mode, seconds))
                    sent, took = parent.recv()
                    time.sleep(0.3)  # let the receivers drain their queues
                    d1, s1c = _snapshot(c_dst), _snapshot(c_sh)
                    t = totals[mode]
                    t["rounds"].append((d1[1] - d0[1]) / took)
                    t["sent"] += sent
                    t["send_s"] += took
                    t["dest"] += d1[0] - d0[0]
                    t["dest_bytes"] += d1[1] - d0[1]
                    t["copies"] += s1c[0] - s0c[0]
                    t["copies_ok"] += s1c[2] - s0c[2]
            parent.send(("stop",))
        finally:
            stop.set()
            for p in procs:
                p.join(timeout=3)
                if p.is_alive():
                    p.kill()
                    p.join()
        counters = tb.switch.counters()
    for t in totals.values():
        t["entry_packets"] = counters["entries"][0]["packets"] if counters["entries"] else 0
    return totals


def pair_ratios(totals: dict) -> list[float]:
    """Replicated / plain destination goodput of each round (both modes ran back to back,
    so a burst of outside load hits both sides of a pair alike)."""
    return [r / p for r, p in zip(totals["replicated"]["rounds"], totals["plain"]["rounds"],
                                  strict=True) if p > 0]


def _report(totals: dict, payload: int, dsize: int) -> float:
    print(f"dataplane bench: t0 -> t1 through the tc-eBPF switch, {dsize}-byte ckm datagrams "
          f"({payload} payload bytes)")
    hdr = (f"{'mode':<11} {'sent/s':>9} {'sent MB/s':>10} {'dest recv/s':>12} "
           f"{'dest MB/s':>10} {'dest loss':>10} {'copies':>9} {'copies ok':>10}")
    print(hdr)
    for mode, t in totals.items():
        secs = t["send_s"]
        loss = 1 - t["dest"] / t["sent"] if t["sent"] else 0.0
        print(f"{mode:<11} {t['sent'] / secs:>9.0f} {t['sent'] * dsize / secs / 1e6:>10.1f} "
              f"{t['dest'] / secs:>12.0f} {t['dest_bytes'] / secs / 1e6:>10.1f} "
              f"{loss:>10.2%} {t['copies']:>9} {t['copies_ok']:>10}")
    rep, plain = totals["replicated"], totals["plain"]
    copy_frac = rep["copies_ok"] / rep["sent"] if rep["sent"] else 0.0
    print(f"copies with the entry's epoch/token at the shadow: {copy_frac:.2%} of replicated "
          f"datagrams sent; plain rounds produced {plain['copies']} copies")
    print(f"note: {os.cpu_count()} CPUs shared by the sender, the switch (softirq in the "
          "sender's context), the destination and the shadow receiver")
    overall = (rep["dest_bytes"] / rep["send_s"]) / (plain["dest_bytes"] / plain["send_s"])
    ratios = sorted(pair_ratios(totals))
    ratio = statistics.median(ratios)
    print(f"per-round ratios: min {ratios[0]:.3f}  median {ratio:.3f}  max {ratios[-1]:.3f}; "
          f"ratio of totals {overall:.3f}")
    print(f"replicated vs plain throughput ratio: {ratio:.3f}")
    return ratio


@cli_guard("testbed bench dataplane")
def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="testbed bench dataplane")
    ap.add_argument("--rounds", type=int, default=16, help="rounds per mode (default 16)")
    ap.add_argument("--seconds", type=float, default=0.75,
                    help="seconds per round (default 0.75)")
    ap.add_argument("--payload", type=int, default=8192,
                    help="payload bytes per datagram, multiple of 4, <= "
                         f"{wire.MAX_PAYLOAD_JUMBO} (default 8192)")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not 1 <= args.rounds <= 100 or not 0.1 <= args.seconds <= 60:
        raise CheckmateError("--rounds must be in 1..100 and --seconds in 0.1..60")
    if args.payload % 4 or not 4 <= args.payload <= wire.MAX_PAYLOAD_JUMBO:
        raise CheckmateError(f"--payload must be a multiple of 4 in 4..{wire.MAX_PAYLOAD_JUMBO}")
    if os.geteuid() != 0:
        raise CheckmateError("the dataplane bench needs root (namespaces, BPF)")
    totals = run(args.rounds, args.seconds, args.payload)
    _report(totals, args.payload, args.payload + wire.HEADER_LEN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
