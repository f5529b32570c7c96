"""`testbed demo`: replicated and plain ckm traffic between trainer namespaces, then counters.

Every trainer rank r sends ``--count`` REPLICATE datagrams per partition and ``--count``
plain ones to rank r+1 (the ring hop), from real UDP sockets inside the trainers'
namespaces. Shadows receive the copies. If the controller has not installed replication
entries for the job yet, the demo installs the ring-hop entries itself (and removes them
afterwards), so it works on a bare `testbed up`.
"""

from __future__ import annotations

import argparse
import struct
import sys

from checkmate.config import cluster as config
from checkmate.dataplane.switch import KernelSwitch, ReplicationEntry
from checkmate.errors import CheckmateError, cli_guard
from checkmate.extras import needs
from checkmate.protocol import wire


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CheckmateError(message)


def ring_entries(cfg: config.ClusterConfig, epoch: int = 1, token: int = 0
                 ) -> list[ReplicationEntry]:
    """Entries for ring hops rank r -> rank (r+1) mod N, every partition to its shadow,
    copied only from the sending trainer's own port."""
    trainers = cfg.trainers
    out = []
    for i, src in enumerate(trainers):
        dst = trainers[(i + 1) % len(trainers)]
        if dst.name == src.name:
            continue
        for sh in cfg.shadows:
            out.append(ReplicationEntry(cfg.job_id, src.ip, dst.ip, sh.partition,
                                        cfg.switch_ifname(sh.name), sh.mac, sh.ip, sh.port,
                                        epoch, token, cfg.switch_ifname(src.name)))
    return out


def _datagram(cfg: config.ClusterConfig, rank: int, seq: int, partition: int,
              replicate: bool, n: int = 256) -> bytes:
    payload = struct.pack(f"<{n}f", *([float(rank * 1e6 + seq)] * n))
    h = wire.Header(flags=wire.Flags.REPLICATE if replicate else 0, job_id=cfg.job_id,
                    iteration=1, offset=seq * n, count=n, seq=seq, partition=partition)
    return wire.encode(h, payload)


def run_traffic(cfg: config.ClusterConfig, count: int) -> dict[str, dict[str, int]]:
    """Send the demo traffic; per host: datagrams received, replicated ones, CRC failures."""
    from checkmate.testbed.netsock import drain, udp_socket_in

    rx: dict = {}
    try:
        for h in cfg.port_hosts:
            rx[h.name] = udp_socket_in(cfg.netns(h.name), ("0.0.0.0", h.port), 8 << 20)
    except OSError as e:
        for s in rx.values():
            s.close()
        raise CheckmateError(f"cannot bind UDP port {h.port} in {cfg.netns(h.name)} "
                             f"({e.strerror}); is a trainer or shadow running there?") from None
    tx = {t.name: udp_socket_in(cfg.netns(t.name)) for t in cfg.trainers}
    stats = {h.name: {"received": 0, "replicate_flag": 0, "bad_crc": 0}
             for h in cfg.port_hosts}
    try:
        trainers = cfg.trainers
        for i, src in enumerate(trainers):
            dst = trainers[(i + 1) % len(trainers)]
            seq = 0
            for part in range(max(cfg.num_partitions, 1)):
                for _ in range(count):
                    tx[src.name].sendto(_datagram(cfg, i, seq, part, True), (dst.ip, dst.port))
                    tx[src.name].sendto(_datagram(cfg, i, seq + 1, part, False),
                                        (dst.ip, dst.port))
                    seq += 2
            for name, sock in rx.items():
                for d, _ in drain(sock, 0.1):
                    st = stats[name]
                    st["received"] += 1
                    try:
                        h, _ = wire.decode(d)
                    except wire.WireError:
                        st["bad_crc"] += 1
                        continue
                    st["replicate_flag"] += bool(h.flags & wire.Flags.REPLICATE)
    finally:
        for s in [*rx.values(), *tx.values()]:
            s.close()
    return stats


def _print(cfg: config.ClusterConfig, stats: dict, counters: dict, installed: bool) -> None:
    with needs("testbed"):
        from rich.console import Console
        from rich.table import Table

    con = Console()
    hosts = Table(title=f"hosts (job {cfg.job_id})")
    for col in ("host", "role", "ip", "received", "with REPLICATE", "bad CRC"):
        hosts.add_column(col, justify="right" if col in ("received", "with REPLICATE",
                                                          "bad CRC") else "left")
    for h in cfg.port_hosts:
        s = stats[h.name]
        hosts.add_row(h.name, h.role, h.ip, str(s["received"]), str(s["replicate_flag"]),
                      str(s["bad_crc"]))
    con.print(hosts)
    ports = Table(title=f"switch {cfg.switch.name} ports")
    ports.add_column("port")
    fields = list(next(iter(counters["ports"].values())).keys())
    for f in fields:
        ports.add_column(f, justify="right")
    for name, c in counters["ports"].items():
        ports.add_row(name, *(str(c[f]) for f in fields))
    con.print(ports)
    ent = Table(title="replication entries" + (" (installed by the demo)" if installed else ""))
    for col in ("job", "src", "from port", "dst", "partition", "shadow port", "packets",
                "bytes"):
        ent.add_column(col)
    for e in counters["entries"]:
        ent.add_row(str(e["job_id"]), e["src_ip"], e["ingress_ifname"], e["dst_ip"],
                    str(e["partition"]), e["shadow_ifname"], str(e["packets"]),
                    str(e["bytes"]))
    con.print(ent)


@cli_guard("testbed demo")
def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="testbed demo")
    ap.add_argument("--config", help="cluster config YAML (default: the embedded default)")
    ap.add_argument("--count", type=int, default=20,
                    help="datagrams per (trainer, partition), each kind (default 20)")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not 1 <= args.count <= 100_000:
        raise CheckmateError("--count must be in 1..100000")
    cfg = config.load(args.config or config.default_path())
    if cfg.colocated:  # no shadow namespace to receive the copies
        raise CheckmateError("the demo copies to shadow hosts of their own; this config's "
                             "shadows are co-located (a launcher's attempt places them)")
    sw = KernelSwitch(cfg)
    if not sw.is_up():
        raise CheckmateError(f"switch {cfg.switch.name} of prefix {cfg.network.prefix} is not "
                             "up; run `testbed up` first")
    have = {(e.job_id, e.src_ip, e.dst_ip, e.partition) for e in sw.replication_entries()}
    mine = [e for e in ring_entries(cfg)
            if (e.job_id, e.src_ip, e.dst_ip, e.partition) not in have]
    for e in mine:
        sw.add_replication(e)
    try:
        stats = run_traffic(cfg, args.count)
        counters = sw.counters()
    finally:
        for e in mine:
            sw.remove_replication(e.job_id, e.src_ip, e.dst_ip, e.partition, e.replica)
    _print(cfg, stats, counters, bool(mine))
    ring = len(cfg.trainers) if len(cfg.trainers) > 1 else 0
    expect = args.count * ring * cfg.num_partitions
    copies = sum(stats[s.name]["received"] for s in cfg.shadows)
    print(f"shadow copies: {copies} of {expect} expected")
    return 0 if copies == expect else 1


if __name__ == "__main__":
    sys.exit(main())
