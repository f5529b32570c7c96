"""Will torch's c10d rendezvous find this node? A check before a job of several nodes.

torch decides three things from the machine's hostname, and Debian's default /etc/hosts
(``127.0.1.1 HOSTNAME``) makes all three wrong on a real cluster, with ~60 lines of C++
frames after 80-128 s instead of one line:

- **Who hosts the rendezvous store.** ``c10d_rendezvous_backend._create_tcp_store`` hosts
  it when ``--rdzv-conf is_host`` says so, else when ``utils._matches_machine_hostname``
  recognises the endpoint's host: ``localhost``, a loopback IP, the hostname itself, its
  FQDN, or an address the *hostname* resolves to. The node that holds the endpoint's IP on
  a NIC but whose hostname resolves to 127.0.1.1 does not recognise it; no node hosts the
  store and every node times out.
- **The address this node gives the others.** Without ``--local-addr`` the rendezvous
  names a node by ``socket.getfqdn()`` (``dynamic_rendezvous._NodeDescGenerator``), and
  rank 0's becomes the workers' MASTER_ADDR (``RendezvousStoreInfo.build``).
- **The address gloo listens on.** Without ``GLOO_SOCKET_IFNAME`` gloo binds the first
  address the hostname resolves to: 127.0.1.1, which no other node reaches.

:func:`gather` reads those facts from this machine, :func:`problems` is the rule on them
(pure, so every case is unit tested), :func:`refuse` is the launcher's one call.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from checkmate.errors import CheckmateError

_TRUE = {"1", "true", "t", "yes", "y"}
_FALSE = {"0", "false", "f", "no", "n"}
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class HostFacts:
    """What torch's rendezvous and gloo will see on this machine."""

    hostname: str
    #: the hostname's addresses in getaddrinfo's order ([]: it does not resolve)
    hostname_addrs: tuple[str, ...]
    #: the endpoint's host is an address of this machine (a socket binds to it)
    endpoint_local: bool
    #: torch's own verdict: utils._matches_machine_hostname(endpoint host)
    torch_hosts: bool


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP literal (what torch treats as this machine)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> tuple[str, ...]:
    """``host``'s addresses in getaddrinfo's order, without repeats; () if it fails."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return ()
    return tuple(dict.fromkeys(str(i[4][0]) for i in infos))


def is_local_address(addr: str) -> bool:
    """Whether ``addr`` is configured on this machine (the kernel lets a socket bind it)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError:
            return False
    return True


def interface_of(addr: str) -> str | None:
    """The network interface that holds IPv4 ``addr`` (its primary address), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:
                continue
            if got == addr:
                return name
    return None


def refuse_dropped_copies(node: str, addr: str, conf: Path = Path("/proc/sys/net/ipv4/conf")
                          ) -> None:
    """Co-located shadows in switch mode: the switch's copy of a datagram this node sent
    comes back to it with the node's own address as its source, which Linux drops as a
    martian unless ``accept_local`` is on for the interface; every shadow here would miss
    the copies of the ring hop that starts here (left to repair). One line naming the fix
    (the launcher changes no system setting); nothing when ``addr`` is on no interface."""
    ifname = interface_of(addr)
    if ifname is None:
        return
    try:
        on = (conf / ifname / "accept_local").read_text().strip() != "0"
    except OSError:
        return  # no such setting to read (not Linux's /proc): nothing to say
    if not on:
        raise CheckmateError(
            f"{node}'s kernel would drop the switch's copies of what {node} sends (their "
            f"source is its own address {addr}) before its co-located shadows see them: run "
            f"`sysctl -w net.ipv4.conf.{ifname}.accept_local=1` on {node}")


def gather(endpoint_host: str) -> HostFacts:
    """The facts :func:`problems` judges, read from this machine and torch."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    name = socket.gethostname()
    try:
        torch_hosts = _matches_machine_hostname(endpoint_host)
    except OSError:  # torch resolves the hostname too; unresolvable: it recognises nothing
        torch_hosts = False
    return HostFacts(name, resolve(name),
                     any(is_local_address(a) for a in resolve(endpoint_host)), torch_hosts)


def conf_is_host(rdzv_conf: dict[str, str]) -> bool | None:
    """``is_host`` of --rdzv-conf as torch reads it (None: not given)."""
    v = str(rdzv_conf.get("is_host", "")).strip().lower()
    return True if v in _TRUE else False if v in _FALSE else None


def problems(facts: HostFacts, endpoint_host: str, max_nodes: int, backend: str,
             local_addr: str | None, rdzv_conf: dict[str, str], gloo_ifname: str | None,
             worker_ip: str | None = None) -> list[str]:
    """What would keep this node of a c10d job from meeting the others, each with what to
    pass; [] when nothing. A job on one machine (a loopback endpoint) has none of these."""
    if backend != "c10d" or is_loopback(endpoint_host):
        return []
    out = []
    is_host = conf_is_host(rdzv_conf)
    resolved = ", ".join(facts.hostname_addrs) or "nothing"
    if is_host is None and facts.endpoint_local and not facts.torch_hosts:
        out.append(f"this machine holds the rendezvous endpoint {endpoint_host} but torch "
                   f"will not host the store here (hostname {facts.hostname} resolves to "
                   f"{resolved}), so no node would: pass --rdzv-conf is_host=1 on this node")
    if is_host and not facts.endpoint_local:
        out.append(f"--rdzv-conf is_host=1 but {endpoint_host} is not an address of this "
                   "machine: only the node that holds it hosts the store; drop it here")
    # gloo binds the first address that resolves; none at all: it falls back to loopback
    first = facts.hostname_addrs[0] if facts.hostname_addrs else "127.0.0.1"
    if max_nodes > 1 and is_loopback(first):
        ip = worker_ip or "THIS_NODE_IP"
        fixes = []
        if not local_addr:
            fixes.append(f"--local-addr {ip}")
        if not gloo_ifname:
            iface = (interface_of(worker_ip) if worker_ip else None) or "IFACE"
            fixes.append(f"GLOO_SOCKET_IFNAME={iface} in the environment")
        if fixes:
            out.append(f"hostname {facts.hostname} resolves to loopback ({resolved}), which "
                       f"torch would give the other nodes as this node's address: pass "
                       f"{' and '.join(fixes)} (the address and interface the other nodes "
                       "reach this node at)")
    return out


def parse_conf(text: str) -> dict[str, str]:
    """--rdzv-conf as torch parses it ({} if it does not: the launcher says why later)."""
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    try:
        return _parse_rendezvous_config(text)
    except ValueError:
        return {}


def refuse(endpoint_host: str, max_nodes: int, backend: str, local_addr: str | None,
           rdzv_conf: str, worker_ips: list[str]) -> None:
    """The launcher's check, before the rendezvous: one CheckmateError line naming what to
    pass when this node could not meet the others."""
    found = problems(gather(endpoint_host), endpoint_host, max_nodes, backend, local_addr,
                     parse_conf(rdzv_conf), os.environ.get("GLOO_SOCKET_IFNAME"),
                     worker_ips[0] if worker_ips else None)
    if found:
        raise CheckmateError("; ".join(found))
