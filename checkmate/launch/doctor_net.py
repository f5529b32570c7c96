"""``checkmate doctor``'s network checks: the shadows and the controller answer and prove
the job secret, the kernel's socket buffers, the MTU towards the shadows, and whether torch's
rendezvous will find this node (checkmate.launch.hostcheck)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

from checkmate.errors import CheckmateError
from checkmate.launch import hostcheck
from checkmate.launch.doctor import FAIL, PASS, WARN, Check
from checkmate.protocol import wire
from checkmate.protocol.frames import Addr

#: The largest ckm datagram as an IP packet: a jumbo frame's payload (checkmate.protocol.wire).
DATAGRAM_MTU = wire.MAX_PAYLOAD_JUMBO + wire.HEADER_LEN + 8 + 20


def _addr(a: Addr) -> str:
    return f"{a[0]}:{a[1]}"


def check_shadows(addrs: list[Addr], timeout: float = 5.0, groups: int = 1) -> list[Check]:
    """Each shadow answers on its TCP service, both sides prove the job secret
    (checkmate.train.shadow_client's hello), and it serves partition p of len(addrs) (a
    mesh job's ``groups`` equal sets each number theirs from 0)."""
    from checkmate.train.shadow_client import ShadowClient

    out = []
    n = max(1, len(addrs) // groups)
    for q, a in enumerate(addrs):
        p = q % n
        name = f"shadow {_addr(a)}"
        try:  # reachable at all, before the hello that proves the secret
            socket.create_connection(a, timeout).close()
        except OSError as e:
            out.append(Check(FAIL, name, f"not reachable ({e.strerror or e}): is it running, "
                             f"is the address right, does a firewall drop TCP {a[1]}?"))
            continue
        try:
            with ShadowClient(a, timeout) as c:
                st = c.status()
        except (CheckmateError, OSError) as e:
            out.append(Check(FAIL, name, f"{e}: give every process of the job the same "
                             "CHECKMATE_SECRET_FILE as the shadow"))
            continue
        group = f" of group {q // n}" if groups > 1 else ""
        if st.get("partition") != p or st.get("partitions") != n:
            out.append(Check(FAIL, name, f"serves partition {st.get('partition')}/"
                             f"{st.get('partitions')}, but shadow number {q + 1} must serve "
                             f"{p}/{n}{group}: give --shadow in partition order"))
            continue
        out.append(Check(PASS, name, f"answers, authenticated, partition {p}/{n}{group}, "
                         f"job {st.get('job') or 'not yet seeded'}"))
    return out


def check_controller(addr: Addr, job_id: int, timeout: float = 5.0
                     ) -> tuple[Check, list[Addr], int]:
    """The controller answers an authenticated handshake request; with it, the shadows it
    has registered for ``job_id`` (TCP service addresses, partition order) and how many
    data-parallel groups its config cuts them into."""
    from checkmate.config.cluster import RESTORE_PORT
    from checkmate.train.layout import query_registrations

    name = f"controller {_addr(addr)}"
    try:
        regs, expected, groups = query_registrations(addr, job_id, timeout=timeout)
    except CheckmateError as e:
        hint = (f": is it running at that address, does a firewall drop UDP {addr[1]}?"
                if "did not answer" in str(e) else "")
        return Check(FAIL, name, f"{e}{hint}"), [], 1
    except OSError as e:
        return Check(FAIL, name, f"not reachable ({e.strerror or e})"), [], 1
    missing = sorted(set(range(expected)) - set(regs))
    if missing:
        return Check(WARN, name, f"answers, authenticated; no shadow registered yet for "
                     f"partition(s) {missing} of job {job_id} (start them; the launcher "
                     "waits up to 120 s)"), [], groups
    per = f" ({groups} data-parallel groups)" if groups > 1 else ""
    return (Check(PASS, name, f"answers, authenticated; {expected} shadow(s){per} "
                  f"registered for job {job_id}"),
            [(regs[p]["ip"], RESTORE_PORT) for p in range(expected)], groups)


def check_buffers(want: int | None = None) -> Check:
    """The receive buffer a trainer's ring socket gets (checkmate.train.transport asks for
    SOCKET_BUFFER; root may force it past net.core.rmem_max): a smaller one drops a burst,
    which the ring then repairs, slowly."""
    from checkmate.train import transport

    want = transport.SOCKET_BUFFER if want is None else want
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), want)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, want)
        got = transport.receive_buffer(s)
    sysctl = {k: _read(f"/proc/sys/net/core/{k}") for k in ("rmem_max", "wmem_max")}
    seen = ", ".join(f"net.core.{k}={v}" for k, v in sysctl.items())
    if got >= want:
        return Check(PASS, "socket buffers", f"a ring socket gets {got >> 20} MiB of "
                     f"receive buffer ({seen})")
    return Check(WARN, "socket buffers", f"a ring socket gets {got >> 10} KiB of the "
                 f"{want >> 20} MiB it asks for ({seen}): sysctl -w net.core.rmem_max={want} "
                 f"net.core.wmem_max={want} (or run the job as root)")


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


def route_mtu(ip: str) -> tuple[str, int]:
    """The interface the kernel routes ``ip`` through and the path's MTU (the route's own
    ``mtu`` if it has one, else the interface's)."""
    try:
        text = subprocess.run(["ip", "-o", "route", "get", ip], capture_output=True,
                              text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CheckmateError(f"ip route get {ip}: {e}") from None
    dev = re.search(r"\bdev (\S+)", text)
    if dev is None:
        raise CheckmateError(f"no route to {ip}")
    mtu = re.search(r"\bmtu (\d+)", text)
    if mtu:
        return dev.group(1), int(mtu.group(1))
    return dev.group(1), int(_read(f"/sys/class/net/{dev.group(1)}/mtu"))


def check_mtu(hosts: list[str], need: int = DATAGRAM_MTU) -> list[Check]:
    """The MTU on the way to each shadow: ckm datagrams are up to ``need`` bytes; smaller
    links fragment them (the host path copes, slower; a switch copies only whole frames)."""
    out = []
    for host in dict.fromkeys(hosts):
        name = f"MTU to {host}"
        try:
            ip = socket.gethostbyname(host)
            dev, mtu = route_mtu(ip)
        except (OSError, CheckmateError) as e:
            out.append(Check(FAIL, name, f"{e}"))
            continue
        if mtu >= need:
            out.append(Check(PASS, name, f"{mtu} on {dev} (datagrams up to {need} B)"))
        else:
            out.append(Check(WARN, name, f"{mtu} on {dev}, below the {need} B of a ckm "
                             f"datagram: ip link set {dev} mtu 9000, and the switch ports too "
                             "(else every datagram is IP-fragmented)"))
    return out


def check_hostname(endpoint: str | None, max_nodes: int, backend: str,
                   local_addr: str | None, rdzv_conf: str, worker_ip: str | None) -> Check:
    """Item 5's rule (checkmate.launch.hostcheck) for the job's flags; without
    --rdzv-endpoint, whether a job of several nodes would need --local-addr here."""
    name = "rendezvous host"
    if endpoint:
        host = endpoint.rpartition(":")[0] if ":" in endpoint else endpoint
        found = hostcheck.problems(hostcheck.gather(host), host, max_nodes, backend,
                                   local_addr, hostcheck.parse_conf(rdzv_conf),
                                   os.environ.get("GLOO_SOCKET_IFNAME"), worker_ip)
        if found:
            return Check(FAIL, name, "; ".join(found))
        return Check(PASS, name, f"torch's rendezvous at {endpoint} will find this node")
    addrs = hostcheck.resolve(socket.gethostname())
    if not addrs or hostcheck.is_loopback(addrs[0]):
        return Check(WARN, name, f"hostname {socket.gethostname()} resolves to "
                     f"{', '.join(addrs) or 'nothing'} (loopback): a job of several nodes "
                     "needs --local-addr IP and GLOO_SOCKET_IFNAME=IFACE on this node (give "
                     "doctor the job's --rdzv-endpoint to check it all)")
    return Check(PASS, name, f"hostname {socket.gethostname()} resolves to {addrs[0]}")
