"""Attacks a chaos case runs against a live job (issue 23), each from one host's namespace.

- ``mac_hijack``: from host ``source``, frames claiming ``target``'s MAC (with the
  attacker's IP, with the target's IP, an ARP reply claiming the target's address) and an
  ARP reply with the attacker's MAC claiming the target's IP, 4 every 20 ms. The switch must
  drop every one where it entered (``bad_src_mac`` 3 and ``bad_src_ip`` 1 per round, on the
  attacker's port, exactly) and keep the target's forwarding entry on its port; the job must
  stay protected and end bit-exact (its copies and control messages keep reaching it).
- ``conn_flood``: from host ``source``, TCP connections to ``target``'s shadow service
  (one every 2 ms), half of them stalling on a partial header, up to 256 held. The target
  must keep serving the trainers (status polls, and a re-seed when the case restarts it),
  with a bounded number of threads, and count what it closed.

Each attack is a process in the source's namespace (``python -m
checkmate.testbed.attacks KIND ...``) that prints one JSON line of what it did when it gets
SIGTERM; ``Attack.stop`` checks the switch's and the target's side and returns problems.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

from checkmate.config import cluster as cfgmod
from checkmate.errors import CheckmateError

KINDS = ("mac_hijack", "conn_flood")
#: Seconds between two rounds of hijack frames.
HIJACK_PERIOD = 0.02
#: Flood connections held at once, and seconds between two (a flood at the rate a 2-core
#: testbed machine can take next to the job: the point is the slots, not the CPU).
FLOOD_HELD = 256
FLOOD_GAP = 0.002
#: Threads a shadow under the flood may have (it starts about a dozen; the flood must add
#: none: connections that have not authenticated get no thread).
SHADOW_THREADS_MAX = 64


class Attack:
    """One attack of a chaos run: start() at its iteration, stop() at the end of the run."""

    def __init__(self, run: Any, kind: str, source: str, target: str) -> None:
        if kind not in KINDS:
            raise CheckmateError(f"unknown attack {kind!r} (one of {', '.join(KINDS)})")
        if run.cl.mode != "switch":
            raise CheckmateError("attacks run from the hosts' namespaces: use --mode switch")
        cfg = run.cl.cfg
        cfg.host(source), cfg.host(target)  # ConfigError names an unknown host
        if kind == "conn_flood" and cfg.host(target).role != "shadow":
            raise CheckmateError(f"conn_flood targets a shadow, not {target}")
        self.run, self.kind, self.source, self.target = run, kind, source, target
        self.proc: subprocess.Popen | None = None
        self.before: dict[str, Any] = {}

    def start(self) -> None:
        cfg, ip = self.run.cl.cfg, self.run.cl.ip
        if self.kind == "mac_hijack":
            self.before = self.run.cl.testbed.source_drops(self.source)
            t, s = cfg.host(self.target), cfg.host(self.source)
            args = [cfg.host_ifname(self.source), s.mac, s.ip, t.mac, t.ip]
        else:
            args = [ip[self.target], str(cfgmod.RESTORE_PORT)]
        argv = [sys.executable, "-m", "checkmate.testbed.attacks", self.kind, *args]
        self.proc = self.run.cl.popen(self.source, argv, {}, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)

    def stop(self) -> tuple[dict[str, Any], list[str]]:
        """(what the attack did and what it met, problems)."""
        if self.proc is None:
            return {"kind": self.kind, "started": False}, [f"{self.kind}: never started"]
        problems: list[str] = []
        report: dict[str, Any] = {"kind": self.kind, "from": self.source, "to": self.target}
        if self.kind == "conn_flood":
            report["target_threads"] = self._target_threads()
            if report["target_threads"] is not None and \
                    report["target_threads"] > SHADOW_THREADS_MAX:
                problems.append(f"conn_flood: {self.target} had {report['target_threads']} "
                                f"threads under the flood (at most {SHADOW_THREADS_MAX})")
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, err = self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        lines = out.decode(errors="replace").strip().splitlines()
        try:
            did = json.loads(lines[-1])
        except (IndexError, ValueError):
            return report, [f"{self.kind}: the attack process said nothing "
                            f"({err.decode(errors='replace').strip()[-200:]})"]
        problems += (self._check_hijack(did) if self.kind == "mac_hijack"
                     else self._check_flood(did))
        report.update(did)  # with what the switch's or target's side counted
        return report, problems

    def _target_threads(self) -> int | None:
        h = self.run.cl.cfg.host(self.target)
        p = self.run.shadows[self.run.by_partition[h.partition]]
        try:
            with open(f"/proc/{p.pid}/status") as f:
                return next(int(ln.split()[1]) for ln in f if ln.startswith("Threads:"))
        except (OSError, StopIteration):
            return None

    def _check_hijack(self, did: dict[str, Any]) -> list[str]:
        cfg, tb = self.run.cl.cfg, self.run.cl.testbed
        port = cfg.switch_ifname(self.source)
        rounds = int(did.get("rounds", 0))
        want = {"bad_src_mac": 3 * rounds, "bad_src_ip": rounds}
        got = self._settled_drops(want)
        did.update(got)
        problems = []
        if rounds < 10:
            problems.append(f"mac_hijack: only {rounds} rounds sent")
        # Every frame the program saw must be dropped and counted: exactly what was sent,
        # less what a software switch may lose before its program (INGRESS_LOSS, none on
        # the kernel switch). A check that let one of the round's 4 frames through would
        # miss a quarter of one reason's count.
        slack = {k: int(v * tb.INGRESS_LOSS) for k, v in want.items()}
        if any(not want[k] - slack[k] <= got[k] <= want[k] for k in want):
            problems.append(f"mac_hijack: {4 * rounds} frames sent from {port}, the switch "
                            f"dropped {got}")
        where = tb.forwarding_port(cfg.host(self.target).mac)
        if where != cfg.switch_ifname(self.target):
            problems.append(f"mac_hijack: {self.target}'s forwarding entry is on {where}")
        return problems

    def _settled_drops(self, want: dict[str, int]) -> dict[str, int]:
        """The switch's drop counts for the attacker's port since start(), read until they
        equal ``want`` or stop moving: a software switch (bmv2) may still hold the last
        frames in its queue when the attack process has exited."""
        tb, deadline, last, still = self.run.cl.testbed, time.monotonic() + 10, None, 0.0
        while True:
            after = tb.source_drops(self.source)
            got = {k: after[k] - self.before.get(k, 0) for k in want}
            if got == want or time.monotonic() > deadline or still >= 1.0:
                return got
            still = still + 0.1 if got == last else 0.0
            last = got
            time.sleep(0.1)

    def _check_flood(self, did: dict[str, Any]) -> list[str]:
        problems = []
        if int(did.get("opened", 0)) < FLOOD_HELD:
            problems.append(f"conn_flood: only {did.get('opened')} connections opened")
        try:
            statuses = self.run.shadow_statuses()
        except CheckmateError as e:
            return [*problems, f"conn_flood: status after the flood failed: {e}"]
        part = self.run.cl.cfg.host(self.target).partition
        st = next((s for s in statuses if s.get("partition") == part), {})
        svc = st.get("tcp_service") or {}
        drops = st.get("drops") or {}
        closed = drops.get("tcp_evicted", 0) + drops.get("tcp_unauthenticated", 0)
        did["target_closed"] = closed
        if not svc.get("alive"):
            problems.append(f"conn_flood: {self.target}'s service thread is not alive: {svc}")
        if closed == 0:
            problems.append(f"conn_flood: {self.target} closed none of the flood's "
                            "connections (did it reach the service?)")
        return problems


# ----- the attack processes (run in the source host's namespace) ------------------------
_stop = False


def _on_term(*_: Any) -> None:
    global _stop
    _stop = True


def _mac(s: str) -> bytes:
    return bytes(int(x, 16) for x in s.split(":"))


def _ip_udp(src_ip: str, dst_ip: str, dport: int, payload: bytes) -> bytes:
    udp = struct.pack("!HHHH", 40000, dport, 8 + len(payload), 0) + payload
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0,
                      socket.inet_aton(src_ip), socket.inet_aton(dst_ip))
    s = sum(struct.unpack("!10H", hdr))
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return hdr[:10] + struct.pack("!H", ~s & 0xFFFF) + hdr[12:] + udp


def _arp_reply(sha: str, spa: str) -> bytes:
    return struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 2, _mac(sha),
                       socket.inet_aton(spa), b"\xff" * 6, socket.inet_aton(spa))


def hijack_frames(my_mac: str, my_ip: str, mac: str, ip: str) -> list[bytes]:
    """One round: 3 frames with the target's MAC, 1 ARP with ours claiming the target's IP."""
    bcast, eth_ip, eth_arp = b"\xff" * 6, b"\x08\x00", b"\x08\x06"
    return [bcast + _mac(mac) + eth_ip + _ip_udp(my_ip, "255.255.255.255", 9, b"hijack"),
            bcast + _mac(mac) + eth_ip + _ip_udp(ip, "255.255.255.255", 9, b"hijack"),
            bcast + _mac(mac) + eth_arp + _arp_reply(mac, ip),
            bcast + _mac(my_mac) + eth_arp + _arp_reply(my_mac, ip)]


def _hijack(ifname: str, my_mac: str, my_ip: str, mac: str, ip: str) -> dict[str, Any]:
    frames = hijack_frames(my_mac, my_ip, mac, ip)
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    s.bind((ifname, 0))
    rounds = 0
    while not _stop:
        for f in frames:
            s.send(f)
        rounds += 1
        time.sleep(HIJACK_PERIOD)
    return {"rounds": rounds, "frames": 4 * rounds}


def _flood(ip: str, port: int) -> dict[str, Any]:
    held: list[socket.socket] = []
    opened = refused = 0
    half = struct.pack("!I", 4000) + b'{"op": "auth", "nonce": "'
    while not _stop:
        try:
            s = socket.create_connection((ip, port), timeout=1)
            if opened % 2:
                s.sendall(half)
            held.append(s)
            opened += 1
            time.sleep(FLOOD_GAP)
        except OSError:
            refused += 1  # the target restarting, or its backlog full
            time.sleep(0.05)
        while len(held) > FLOOD_HELD:
            held.pop(0).close()
    for s in held:
        s.close()
    return {"opened": opened, "refused": refused}


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _on_term)
    kind, *args = argv
    did = _hijack(*args) if kind == "mac_hijack" else _flood(args[0], int(args[1]))
    print(json.dumps(did), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
