"""`testbed bench dataplane`: what replication costs the kernel switch's forwarding.

One run builds its own testbed (prefix "tabn"), installs one replication entry (t0 -> t1,
partition 0 -> shadow s0) and sends one ckm datagram size from t0 to t1 in rounds of equal
duration, three modes per block with plain in the middle (K P S, then S P K, ...):

- plain: no REPLICATE flag, no copies;
- replicated, shadow sink (K): REPLICATE; the copies go to s0's interface, where a tc
  ingress program (dataplane/bpf/ckm_sink.c) counts them, checks their addressing and
  epoch/token, and drops them before the IP stack. This stands in for a shadow on its own
  machine: the CPUs here pay the switch's clone and one veth hop per copy, not the shadow
  host's receive. It is the headline;
- replicated, shadow socket (S): REPLICATE; the sink only counts and passes, and the copies
  are received by a UDP socket in s0's namespace (a real receiving process). On this testbed
  that second receive runs on the same CPUs as the sender and the switch (end to end).

Per mode it reports the sender rate and the sender's CPU time per datagram (on veth the
forwarding, the copy and the socket deliveries run as softirq work in the sender's context
and are charged to it, so this is the per-datagram cost of send + switch, less sensitive to
outside load than rates), the goodput at t1 (and its loss), the copies the switch made, the
copies counted at the sink and the copies read from the shadow socket.

Headline: t1's goodput in a sink round over its goodput in the adjacent plain round, median
over blocks (robust to bursts of outside load on a shared machine). The end-to-end (socket)
median is printed on the line before it. The run fails unless the sink counted a correct
copy for >= 99% of the datagrams sent in sink rounds. Sender and receivers are separate
processes (fork), each with its socket inside its host's namespace.
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

from checkmate.config import cluster as config
from checkmate.errors import CheckmateError, cli_guard
from checkmate.protocol import wire

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
    count, the time and the CPU time used (the switch's softirq work runs in this process's
    context and is charged to it). Sends in batches of 256 between clock reads."""
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
        c0 = os.times()
        t0 = time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            for _ in range(256):
                send(d, dst)
            sent += 256
        took = time.perf_counter() - t0
        c1 = os.times()
        conn.send((sent, took, c1.user + c1.system - c0.user - c0.system))
    sock.close()


MODES = {
    "plain": "plain",
    "sink": "replicated, shadow sink",
    "socket": "replicated, shadow socket",
}
MIN_COPY_FRACTION = 0.99


def _snapshot(counts) -> tuple[int, int, int]:
    return counts[0], counts[1], counts[2]


def block_order(r: int) -> list[str]:
    """Modes of block ``r``: plain in the middle, so both replicated modes run next to a
    plain round; the replicated modes swap sides every block."""
    return ["sink", "plain", "socket"] if r % 2 == 0 else ["socket", "plain", "sink"]


def _entry_packets(switch) -> int:
    """Copies the switch made so far (all entries), straight from the pinned table: cheaper
    than KernelSwitch.counters(), which also walks the namespace's links."""
    from checkmate.dataplane import maps
    from checkmate.dataplane.bpfsys import PinnedMap

    with PinnedMap(str(switch.map_dir / "ckm_repl"), *maps.MAP_LAYOUT["ckm_repl"]) as m:
        return sum(maps.repl_counts(v)[0] for _, v in m.items())


def run(rounds: int, seconds: float, payload: int) -> dict[str, dict]:
    from checkmate.dataplane.sink import ShadowSink
    from checkmate.dataplane.switch import ReplicationEntry
    from checkmate.testbed.topology import Testbed

    cfg = config.with_prefix(config.load(config.default_path()), PREFIX)
    t0, t1, s0 = cfg.host("t0"), cfg.host("t1"), cfg.host("s0")
    n = payload // 4
    body = struct.pack(f"<{n}f", *range(n))
    base = wire.Header(job_id=cfg.job_id, epoch=1, token=2, iteration=1, count=n, partition=0)
    plain = wire.encode(base, body)
    repl = wire.encode(base.with_(flags=wire.Flags.REPLICATE), body)
    datagrams = {"plain": plain, "sink": repl, "socket": repl}
    ctx = mp.get_context("fork")
    totals: dict = {m: {"sent": 0, "send_s": 0.0, "dest": 0, "dest_bytes": 0, "copies": 0,
                        "copies_ok": 0, "sink": 0, "sink_ok": 0, "sink_dropped": 0,
                        "switch_copies": 0, "cpu_s": 0.0, "rounds": []} for m in MODES}
    sink = ShadowSink(cfg, "s0")
    with Testbed(cfg) as tb:
        tb.switch.add_replication(ReplicationEntry(
            cfg.job_id, t0.ip, t1.ip, 0, cfg.switch_ifname("s0"), s0.mac, s0.ip, s0.port,
            EPOCH, TOKEN, cfg.switch_ifname("t0")))
        sink.attach(EPOCH, TOKEN, drop=False)
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
            for r in range(rounds):
                for mode in block_order(r):
                    sink.set_drop(mode == "sink")
                    d0, sh0, k0 = _snapshot(c_dst), _snapshot(c_sh), sink.counts()
                    e0 = _entry_packets(tb.switch)
                    parent.send(("send", mode, seconds))
                    sent, took, cpu = parent.recv()
                    time.sleep(0.3)  # let the receivers drain their queues
                    d1, sh1, k1 = _snapshot(c_dst), _snapshot(c_sh), sink.counts()
                    dk = k1 - k0
                    t = totals[mode]
                    t["rounds"].append((d1[1] - d0[1]) / took)
                    t["sent"] += sent
                    t["send_s"] += took
                    t["cpu_s"] += cpu
                    t["dest"] += d1[0] - d0[0]
                    t["dest_bytes"] += d1[1] - d0[1]
                    t["copies"] += sh1[0] - sh0[0]
                    t["copies_ok"] += sh1[2] - sh0[2]
                    t["sink"] += dk.packets
                    t["sink_ok"] += dk.ok
                    t["sink_dropped"] += dk.dropped
                    t["switch_copies"] += _entry_packets(tb.switch) - e0
            parent.send(("stop",))
        finally:
            stop.set()
            for p in procs:
                p.join(timeout=3)
                if p.is_alive():
                    p.kill()
                    p.join()
            sink.detach()
    if sink.pin_dir.exists() or sink.is_attached():
        raise CheckmateError(f"shadow sink left behind ({sink.pin_dir})")
    return totals


def pair_ratios(totals: dict, mode: str = "sink") -> list[float]:
    """``mode`` / plain destination goodput of each block (the two rounds ran back to back,
    so a burst of outside load hits both sides of a pair alike)."""
    return [r / p for r, p in zip(totals[mode]["rounds"], totals["plain"]["rounds"],
                                  strict=True) if p > 0]


def copy_fraction(totals: dict, mode: str = "sink") -> float:
    """Correct copies counted at the sink per datagram sent in ``mode``'s rounds."""
    t = totals[mode]
    return t["sink_ok"] / t["sent"] if t["sent"] else 0.0


def _ratios_line(ratios: list[float], totals: dict, mode: str) -> str:
    rep, plain = totals[mode], totals["plain"]
    overall = (rep["dest_bytes"] / rep["send_s"]) / (plain["dest_bytes"] / plain["send_s"])
    return (f"min {ratios[0]:.3f}  median {statistics.median(ratios):.3f}  max "
            f"{ratios[-1]:.3f}; ratio of totals {overall:.3f}")


def _report(totals: dict, payload: int, dsize: int) -> float:
    print(f"dataplane bench: t0 -> t1 through the tc-eBPF switch, {dsize}-byte ckm datagrams "
          f"({payload} payload bytes), {len(totals['plain']['rounds'])} blocks")
    print(f"{'mode':<26} {'sent/s':>8} {'sent MB/s':>9} {'sender us/dg':>12} "
          f"{'dest recv/s':>11} {'dest MB/s':>9} {'dest loss':>9} {'switch copies':>13} "
          f"{'sink ok':>8} {'sink drop':>9} {'socket ok':>9}")
    for mode, label in MODES.items():
        t = totals[mode]
        secs = t["send_s"]
        loss = 1 - t["dest"] / t["sent"] if t["sent"] else 0.0
        us = t["cpu_s"] / t["sent"] * 1e6 if t["sent"] else 0.0
        print(f"{label:<26} {t['sent'] / secs:>8.0f} {t['sent'] * dsize / secs / 1e6:>9.1f} "
              f"{us:>12.2f} {t['dest'] / secs:>11.0f} {t['dest_bytes'] / secs / 1e6:>9.1f} "
              f"{loss:>9.2%} {t['switch_copies']:>13} {t['sink_ok']:>8} {t['sink_dropped']:>9} "
              f"{t['copies_ok']:>9}")
    sink, sock = totals["sink"], totals["socket"]
    frac = copy_fraction(totals, "sink")
    bad = sink["sink"] - sink["sink_ok"] + sock["sink"] - sock["sink_ok"]
    print(f"copies: sink rounds {frac:.2%} of replicated datagrams sent counted correct at the "
          f"sink (all dropped there: {sink['sink_dropped'] == sink['sink']}); socket rounds "
          f"{copy_fraction(totals, 'socket'):.2%} counted at the sink, "
          f"{sock['copies_ok'] / sock['sent'] if sock['sent'] else 0:.2%} read by the shadow's "
          f"socket; wrong copies {bad}; plain rounds made {totals['plain']['switch_copies']}")
    print(f"note: {os.cpu_count()} CPUs shared by the sender, the switch (softirq in the "
          "sender's context), the destination and the shadow; sender us/dg is the sender's CPU "
          "time per datagram (send + switch + delivery, less what ksoftirqd took over)")
    e2e = sorted(pair_ratios(totals, "socket"))
    print(f"end to end, copies read by a UDP socket on the shadow host (same CPUs), per block: "
          f"{_ratios_line(e2e, totals, 'socket')}")
    ratios = sorted(pair_ratios(totals, "sink"))
    print(f"switch only, copies counted and dropped by the shadow sink, per block: "
          f"{_ratios_line(ratios, totals, 'sink')}")
    if frac < MIN_COPY_FRACTION or bad or totals["plain"]["switch_copies"]:
        raise CheckmateError(
            f"copies missing or wrong: {frac:.2%} of replicated datagrams produced a correct "
            f"copy at the sink (need >= {MIN_COPY_FRACTION:.0%}), {bad} wrong copies, "
            f"{totals['plain']['switch_copies']} copies of plain datagrams")
    ratio = statistics.median(ratios)
    print(f"end-to-end (shadow socket) median {statistics.median(e2e):.3f}; headline is the "
          "shadow-sink median")
    print(f"replicated vs plain throughput ratio: {ratio:.3f}")
    return ratio


@cli_guard("testbed bench dataplane")
def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="testbed bench dataplane")
    ap.add_argument("--rounds", type=int, default=12,
                    help="blocks of one round per mode (default 12)")
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
