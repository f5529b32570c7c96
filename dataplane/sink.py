"""Shadow sink: count (and optionally drop) shadow copies at a shadow host's interface.

Stands in for a shadow on a separate machine in the namespace testbed, where every "host"
shares the same CPUs: with the sink in drop mode a copy costs the switch its clone and one
veth hop, and nothing of the shadow host's IP/UDP/socket receive. The counters still prove
that each copy arrived, addressed to the shadow and stamped with the expected epoch/token
(see ``bpf/ckm_sink.c``). Used by ``testbed bench dataplane``.

The tc filter sits on ``cfg.host_ifname(host)`` inside ``cfg.netns(host)`` (so it also goes
away with the namespace); program and maps are pinned under
``/sys/fs/bpf/<prefix>-sink-<host>/``, removed by :meth:`ShadowSink.detach`, and cleared
first by :meth:`ShadowSink.attach` if a crashed run left them behind.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from dataclasses import dataclass

from checkmate.config.cluster import ClusterConfig
from checkmate.dataplane import maps
from checkmate.dataplane.bpfsys import BpfError, PinnedMap
from checkmate.dataplane.switch import BPFFS, ensure_bpffs, netns_exists, nsenter_argv
from checkmate.errors import CheckmateError

#: struct sink_cfg: epoch, token (host order), shadow IPv4, UDP port (big-endian), drop, pad
SINK_CFG = struct.Struct("<II4s2sBB")
#: struct sink_stats, in this order
SINK_FIELDS = ("packets", "bytes", "ok", "dropped")
SINK_STATS = struct.Struct("<" + "Q" * len(SINK_FIELDS))
_ZERO = maps.U32.pack(0)


@dataclass(frozen=True)
class SinkCounts:
    packets: int  # ckm-port UDP datagrams that reached the interface
    bytes: int
    ok: int  # copies with the expected addressing, epoch/token and a valid IPv4 checksum
    dropped: int  # discarded by the sink before the IP stack

    def __sub__(self, other: SinkCounts) -> SinkCounts:
        return SinkCounts(*(a - b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple[int, int, int, int]:
        return (self.packets, self.bytes, self.ok, self.dropped)


class ShadowSink:
    """The sink on one host of a running testbed; constructing it touches nothing."""

    def __init__(self, cfg: ClusterConfig, host: str) -> None:
        h = cfg.host(host)
        self.host = h
        self.netns = cfg.netns(host)
        self.ifname = cfg.host_ifname(host)
        self.pin_dir = BPFFS / f"{cfg.network.prefix}-sink-{host}"
        self.prog = self.pin_dir / "progs" / "ckm_sink"
        self.map_dir = self.pin_dir / "maps"

    def _tc(self, lines: list[str], check: bool = True) -> None:
        res = subprocess.run(nsenter_argv(self.netns, ["tc", "-force", "-batch", "-"]),
                             input="\n".join(lines) + "\n", capture_output=True, text=True)
        if check and res.returncode != 0:
            first = (res.stderr.strip().splitlines() or ["no output"])[0]
            raise CheckmateError(f"tc in {self.netns} failed: {first}")

    def _map(self, name: str, value_size: int) -> PinnedMap:
        try:
            return PinnedMap(str(self.map_dir / name), maps.U32.size, value_size)
        except BpfError as e:
            raise CheckmateError(f"shadow sink on {self.host.name} is not attached: {e}") from None

    def attach(self, epoch: int, token: int, drop: bool = True) -> None:
        """Load, pin and attach the sink on the host's interface (tc ingress)."""
        from checkmate.dataplane.build import ensure_built

        if not netns_exists(self.netns):
            raise CheckmateError(f"namespace {self.netns} does not exist (run `testbed up`)")
        if shutil.which("bpftool") is None:
            raise CheckmateError("bpftool not found; install bpftool (make setup)")
        obj = ensure_built(name="ckm_sink")
        ensure_bpffs()
        self.detach()
        self.pin_dir.mkdir(parents=True)
        res = subprocess.run(
            ["bpftool", "prog", "loadall", str(obj), str(self.prog.parent), "type",
             "classifier", "pinmaps", str(self.map_dir)], capture_output=True, text=True)
        if res.returncode != 0:
            self.detach()
            tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise CheckmateError(f"loading {obj.name} failed: {tail}")
        try:
            self.configure(epoch, token, drop)
            self._tc([f"qdisc add dev {self.ifname} clsact",
                      f"filter add dev {self.ifname} ingress bpf da pinned {self.prog}"])
        except BaseException:
            self.detach()
            raise

    def configure(self, epoch: int, token: int, drop: bool) -> None:
        """Expected session of the copies, and whether to drop them (True) or pass them on."""
        val = SINK_CFG.pack(epoch, token, maps.ip_bytes(self.host.ip),
                            self.host.port.to_bytes(2, "big"), int(drop), 0)
        with self._map("ckm_sink_cfg", SINK_CFG.size) as m:
            m.update(_ZERO, val)

    def set_drop(self, drop: bool) -> None:
        with self._map("ckm_sink_cfg", SINK_CFG.size) as m:
            raw = m.lookup(_ZERO)
            if raw is None:  # pragma: no cover - array maps always hold key 0
                raise CheckmateError("shadow sink config is missing")
            epoch, token, ip, port, _, pad = SINK_CFG.unpack(raw)
            m.update(_ZERO, SINK_CFG.pack(epoch, token, ip, port, int(drop), pad))

    def counts(self) -> SinkCounts:
        with self._map("ckm_sink_stats", SINK_STATS.size) as m:
            raw = m.lookup(_ZERO)
        return SinkCounts(*SINK_STATS.unpack(raw or bytes(SINK_STATS.size)))

    def is_attached(self) -> bool:
        """The tc filter is on the interface (pins aside)."""
        if not netns_exists(self.netns):
            return False
        res = subprocess.run(nsenter_argv(self.netns, ["tc", "filter", "show", "dev",
                                                       self.ifname, "ingress"]),
                             capture_output=True, text=True)
        return res.returncode == 0 and "ckm_sink" in res.stdout

    def detach(self) -> None:
        """Remove the tc filter (with its clsact qdisc) and the pins; idempotent."""
        if netns_exists(self.netns):
            self._tc([f"qdisc del dev {self.ifname} clsact"], check=False)
        if self.pin_dir.exists():
            shutil.rmtree(self.pin_dir, ignore_errors=True)

    def __enter__(self) -> ShadowSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

