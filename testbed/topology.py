"""The namespace testbed: one network namespace per host plus one for the switch.

``Testbed(cfg).up()`` builds it with pyroute2 from the cluster config (veth pairs, addresses
and MACs from the config, MTU, the bridge carrying the switch's own IP), attaches the BPF
switch and optionally starts the controller service in the switch namespace. ``down()``
removes exactly what ``up()`` created, found from the config's names and from the state file
in /run/checkmate/<prefix>/, so a crashed run never blocks the next one.

Processes inside a host namespace are started with ``nsenter --net`` (not ``ip netns
exec``, which remounts /sys and so hides the pinned BPF maps).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import yaml

from checkmate.config.cluster import ClusterConfig
from checkmate.dataplane.switch import KernelSwitch, netns_exists, nsenter_argv
from checkmate.errors import CheckmateError
from checkmate.extras import needs

STATE_ROOT = Path("/run/checkmate")
NUD_PERMANENT = 0x80
CONTROLLER_MODULE = "checkmate.control.cli"


def config_to_dict(cfg: ClusterConfig) -> dict[str, Any]:
    """The YAML document that checkmate.config.cluster.parse turns back into ``cfg``."""
    sw = cfg.switch
    switch: dict[str, Any] = {"name": sw.name, "target": sw.target, "ip": sw.ip, "mac": sw.mac,
                              "device_id": sw.device_id, "cpu_port": sw.cpu_port,
                              "cable_m": sw.cable_m, "speed_gbps": sw.speed_gbps}
    if sw.address:
        switch["address"] = sw.address
    if sw.runtime != "p4runtime":
        switch["runtime"] = sw.runtime
    hosts = []
    for h in cfg.hosts:
        d: dict[str, Any] = ({"name": h.name, "role": h.role, "colocated": True}
                             if h.colocated else  # no address of its own
                             {"name": h.name, "role": h.role, "ip": h.ip, "mac": h.mac})
        if h.rank is not None:
            d["rank"] = h.rank
        if h.partition is not None:
            d["partition"] = h.partition
        if h.switch_port is not None:
            d["switch_port"] = h.switch_port
        hosts.append(d)
    job: dict[str, Any] = {"id": cfg.job_id, "name": cfg.job_name}
    if cfg.groups > 1:
        job["groups"] = cfg.groups
    doc = {"job": job, "switch": switch,
           "network": {"subnet": cfg.network.subnet, "mtu": cfg.network.mtu,
                       "prefix": cfg.network.prefix},
           "hosts": hosts}
    doc.update(cfg.extra)
    return doc


def proc_start_time(pid: int) -> int | None:
    """Kernel start time of ``pid`` (clock ticks since boot), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive(pid: int, start: int | None) -> bool:
    """Still the process we started (same PID and start time, not a zombie)?"""
    if start is None or proc_start_time(pid) != start:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_pid(pid: int, start: int | None, timeout: float = 5.0) -> bool:
    """SIGTERM, then SIGKILL after ``timeout``; only if ``pid`` is still the process that
    started at ``start`` (a recycled PID is left alone)."""
    if not _alive(pid, start):
        _reap(pid)
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(pid)
        if not _alive(pid, start):
            return True
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _reap(pid)
    return True


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _sh(argv: list[str]) -> None:
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode != 0:
        first = (res.stderr.strip().splitlines() or ["no output"])[0]
        raise CheckmateError(f"{' '.join(argv[-4:])}: {first}")


def _no_bridge_netfilter(netns: str) -> None:
    """A switch does not run iptables on bridged frames: where br_netfilter is loaded, turn
    its hooks off in the switch namespace (per-namespace sysctls; absent otherwise)."""
    from checkmate.testbed.netsock import call_in_netns

    def write() -> None:
        for fam in ("iptables", "ip6tables", "arptables"):
            path = Path(f"/proc/sys/net/bridge/bridge-nf-call-{fam}")
            if path.exists():
                path.write_text("0\n")

    call_in_netns(netns, write)


def _no_ipv6(netns: str) -> None:
    """The testbed is IPv4-only: without IPv6, no neighbour-discovery or router-solicitation
    frames appear on the ports after `up`, so per-port counters count only test traffic."""
    from checkmate.testbed.netsock import call_in_netns

    def write() -> None:
        for conf in ("all", "default"):
            path = Path(f"/proc/sys/net/ipv6/conf/{conf}/disable_ipv6")
            if path.exists():
                path.write_text("1\n")

    call_in_netns(netns, write)


def _accept_local(netns: str, ifname: str) -> None:
    """Let the host take datagrams whose source is its own address from the wire: a
    co-located shadow's copies of the hop its own node sends leave the switch through that
    node's port with the node's address as source, which Linux drops ("martian source")
    unless ``accept_local`` is set on the interface."""
    from checkmate.testbed.netsock import call_in_netns

    def write() -> None:
        Path(f"/proc/sys/net/ipv4/conf/{ifname}/accept_local").write_text("1\n")

    call_in_netns(netns, write)


class Testbed:
    """Build and remove one cluster's namespaces; a context manager (up on enter, down on
    exit, down even when the body raised)."""

    #: Frames can be lost before the switch's program sees them: 0 here (the tc-eBPF
    #: program runs in the sender's context, on every frame the veth carries).
    INGRESS_LOSS = 0.0

    def __init__(self, cfg: ClusterConfig, controller: bool = False,
                 config_path: str | Path | None = None) -> None:
        self.cfg = cfg
        self.controller = controller
        self.config_path = Path(config_path).resolve() if config_path else None
        self.switch = KernelSwitch(cfg)
        self.state_dir = STATE_ROOT / cfg.network.prefix
        #: Processes started end with this process (a command that owns them); False for
        #: `testbed up`, whose controller outlives it. ``tied_controller``: the controller
        #: too (False when a command uses a testbed that `testbed up` built: a controller it
        #: restarts must outlive it as the first one does).
        self.tied = False
        self.tied_controller = False

    # -- names ---------------------------------------------------------------------------
    def netns_of(self, host: str) -> str:
        """Namespace of a host, or of the switch when ``host`` is the switch's name."""
        if host == self.cfg.switch.name:
            return self.cfg.netns(host)
        return self.cfg.netns(self.cfg.host(host).name)

    @property
    def namespaces(self) -> list[str]:
        return [self.cfg.netns(self.cfg.switch.name)] + [self.cfg.netns(h.name)
                                                         for h in self.cfg.port_hosts]

    @property
    def secret_file(self) -> Path:
        """The job secret every process of this testbed uses: $CHECKMATE_SECRET_FILE when
        set, else job.key in the state dir (a new one each `up`: `down` removes it)."""
        from checkmate.protocol import auth

        env = os.environ.get(auth.SECRET_ENV)
        return Path(env) if env else self.state_dir / "job.key"

    def _with_secret(self, kw: dict[str, Any]) -> dict[str, Any]:
        from checkmate.protocol import auth

        env = kw.get("env")
        kw["env"] = {**(os.environ if env is None else env),
                     auth.SECRET_ENV: str(self.secret_file)}
        return kw

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    def _read_state(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def _write_state(self, state: dict[str, Any]) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)

    # -- up ------------------------------------------------------------------------------
    def up(self) -> None:
        """Build everything; clears stale objects of this prefix first."""
        if os.geteuid() != 0:
            raise CheckmateError("the testbed needs root (network namespaces, BPF)")
        self.down()
        state: dict[str, Any] = {"prefix": self.cfg.network.prefix,
                                 "namespaces": self.namespaces,
                                 "pin_dir": str(self.switch.pin_dir), "procs": []}
        self._write_state(state)
        try:
            from checkmate.protocol import auth

            auth.create_secret(self.secret_file)
            self._build_links()
            self.switch.attach()
            if self.controller:
                self._start_controller()
        except BaseException:
            self.down()
            raise

    def _build_links(self) -> None:
        with needs("testbed"):
            from pyroute2 import NetNS, netns

        cfg = self.cfg
        plen = ipaddress.IPv4Network(cfg.network.subnet).prefixlen
        mtu = cfg.network.mtu
        for name in self.namespaces:
            netns.create(name)
            _no_ipv6(name)
        sw_ns = cfg.netns(cfg.switch.name)
        with NetNS(sw_ns, flags=0) as sw:
            sw.link("set", index=sw.link_lookup(ifname="lo")[0], state="up")
            sw.link("add", ifname=cfg.bridge_name, kind="bridge", address=cfg.switch.mac,
                    mtu=mtu)
            br = sw.link_lookup(ifname=cfg.bridge_name)[0]
            sw.addr("add", index=br, address=cfg.switch.ip, prefixlen=plen)
            for h in cfg.port_hosts:
                sw.link("add", ifname=cfg.switch_ifname(h.name), kind="veth",
                        peer={"ifname": cfg.host_ifname(h.name), "net_ns_fd": cfg.netns(h.name)})
                idx = sw.link_lookup(ifname=cfg.switch_ifname(h.name))[0]
                sw.link("set", index=idx, mtu=mtu, master=br)
            sw.link("set", index=br, state="up")
        for h in cfg.port_hosts:
            with NetNS(cfg.netns(h.name), flags=0) as hn:
                hn.link("set", index=hn.link_lookup(ifname="lo")[0], state="up")
                idx = hn.link_lookup(ifname=cfg.host_ifname(h.name))[0]
                hn.link("set", index=idx, address=h.mac, mtu=mtu)
                hn.addr("add", index=idx, address=h.ip, prefixlen=plen)
                hn.link("set", index=idx, state="up")
        # veth offloads UDP checksums (CHECKSUM_PARTIAL): the datagram would carry only the
        # pseudo-header sum on the wire. Turned off so every frame, and so every shadow copy
        # the switch rewrites, carries a complete checksum.
        for h in cfg.port_hosts:
            _sh(nsenter_argv(cfg.netns(h.name),
                             ["ethtool", "-K", cfg.host_ifname(h.name), "tx", "off"]))
        _no_bridge_netfilter(sw_ns)
        self._static_l2()
        self._colocated_nodes()
        with NetNS(sw_ns, flags=0) as sw:
            for h in cfg.port_hosts:
                idx = sw.link_lookup(ifname=cfg.switch_ifname(h.name))[0]
                sw.link("set", index=idx, state="up")

    def _colocated_nodes(self) -> None:
        """A config of co-located shadows: every trainer node takes the copies the switch
        sends it from its own address (``_accept_local``)."""
        if self.cfg.colocated:
            for h in self.cfg.trainers:
                _accept_local(self.cfg.netns(h.name), self.cfg.host_ifname(h.name))

    def _static_l2(self) -> None:
        """Permanent neighbour entries on every host and on the switch: no ARP round trip at
        the start of a burst, so the first datagrams of a test or bench are not queued or
        dropped. The bridge's forwarding entries are the switch's own (static, sticky, no
        learning: KernelSwitch.bind_ports, run by attach)."""
        with needs("testbed"):
            from pyroute2 import NetNS

        cfg = self.cfg
        peers = [(h.ip, h.mac) for h in cfg.port_hosts] + [(cfg.switch.ip, cfg.switch.mac)]
        for h in cfg.port_hosts:
            with NetNS(cfg.netns(h.name), flags=0) as hn:
                idx = hn.link_lookup(ifname=cfg.host_ifname(h.name))[0]
                for ip, mac in peers:
                    if ip != h.ip:
                        hn.neigh("replace", dst=ip, lladdr=mac, ifindex=idx,
                                 state=NUD_PERMANENT)
        self._switch_neighbours()

    @property
    def controller_ifname(self) -> str:
        """The switch namespace's interface that carries the switch's own IP, where the
        controller answers from: the bridge here."""
        return self.cfg.bridge_name

    def _switch_neighbours(self) -> None:
        """Every host's MAC, permanent, on the controller's interface."""
        with needs("testbed"):
            from pyroute2 import NetNS

        cfg = self.cfg
        with NetNS(cfg.netns(cfg.switch.name), flags=0) as sw:
            idx = sw.link_lookup(ifname=self.controller_ifname)[0]
            for h in cfg.port_hosts:
                sw.neigh("replace", dst=h.ip, lladdr=h.mac, ifindex=idx, state=NUD_PERMANENT)

    def _effective_config(self) -> Path:
        if self.config_path and self.config_path.exists():
            return self.config_path
        path = self.state_dir / "config.yaml"
        path.write_text(yaml.safe_dump(config_to_dict(self.cfg), sort_keys=False))
        return path

    def _start_controller(self) -> int | None:
        if importlib.util.find_spec(CONTROLLER_MODULE) is None:
            warnings.warn(f"{CONTROLLER_MODULE} is not installed; controller not started",
                          stacklevel=2)
            return None
        log = open(self.state_dir / "controller.log", "ab")  # noqa: SIM115
        argv = [sys.executable, "-m", CONTROLLER_MODULE, "serve", "--config",
                str(self._effective_config())]
        tied, self.tied = self.tied, self.tied_controller
        try:
            proc = self.spawn(self.cfg.switch.name, argv, "controller",
                              stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        finally:
            self.tied = tied
        log.close()
        (self.state_dir / "controller.pid").write_text(f"{proc.pid}\n")
        time.sleep(0.5)
        if proc.poll() is not None:
            tail = (self.state_dir / "controller.log").read_text(errors="replace")
            last = (tail.strip().splitlines() or ["no output"])[-1]
            warnings.warn(f"controller exited at start ({proc.returncode}): {last}",
                          stacklevel=2)
            return None
        return proc.pid

    # -- down ----------------------------------------------------------------------------
    def down(self) -> None:
        """Remove processes (by recorded PID), namespaces, pinned BPF objects, state dir."""
        with needs("testbed"):
            from pyroute2 import netns

        state = self._read_state()
        for p in state.get("procs", []):
            if isinstance(p, dict) and isinstance(p.get("pid"), int):
                stop_pid(p["pid"], p.get("start"))
        self.switch.detach()
        stale_pin = state.get("pin_dir")
        if stale_pin and Path(stale_pin).parent == Path("/sys/fs/bpf"):
            shutil.rmtree(stale_pin, ignore_errors=True)
        names = set(self.namespaces) | set(state.get("namespaces", []))
        prefix = self.cfg.network.prefix + "-"
        for name in sorted(names):
            if name.startswith(prefix) and netns_exists(name):
                netns.remove(name)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self) -> Testbed:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- processes -----------------------------------------------------------------------
    def argv_in(self, host: str, argv: list[str]) -> list[str]:
        return nsenter_argv(self.netns_of(host), list(argv))

    def run_in(self, host: str, argv: list[str], **kw: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` to completion inside ``host``'s namespace (subprocess.run kwargs)."""
        return subprocess.run(self.argv_in(host, argv), **self._with_secret(kw))

    def popen_in(self, host: str, argv: list[str], **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace; the caller stops it by its PID. With
        ``tied`` set (a command that owns what it starts), the process ends with this one
        (checkmate.testbed.lifeline)."""
        if self.tied:
            from checkmate.testbed import lifeline

            return lifeline.popen(self.argv_in(host, argv), **self._with_secret(kw))
        return subprocess.Popen(self.argv_in(host, argv), **self._with_secret(kw))

    def spawn(self, host: str, argv: list[str], name: str, **kw: Any) -> subprocess.Popen:
        """Like popen_in, in its own session, and recorded (PID + start time) in the state
        file so that ``down()`` stops it, even from another process after a crash."""
        proc = self.popen_in(host, argv, start_new_session=True, **kw)
        state = self._read_state()
        state.setdefault("procs", []).append(
            {"name": name, "host": host, "pid": proc.pid, "start": proc_start_time(proc.pid)})
        self._write_state(state)
        return proc

    def restart_controller(self) -> int | None:
        """SIGKILL the running controller (by its recorded PID and start time) and start a new
        one; for failure scenarios. Returns the new PID."""
        state = self._read_state()
        for p in [p for p in state.get("procs", []) if p.get("name") == "controller"]:
            if _alive(p["pid"], p.get("start")):
                os.kill(p["pid"], signal.SIGKILL)
                deadline = time.monotonic() + 2.0
                while _alive(p["pid"], p.get("start")) and time.monotonic() < deadline:
                    _reap(p["pid"])
                    time.sleep(0.02)
        state["procs"] = [p for p in state.get("procs", []) if p.get("name") != "controller"]
        self._write_state(state)
        return self._start_controller()

    # -- the switch's view -----------------------------------------------------------------
    def replicated_packets(self) -> int:
        """Datagrams the switch copied to shadows (its replication entries' counters)."""
        return sum(int(e.get("packets", 0)) for e in self.switch.counters().get("entries", []))

    def replicated_by_replica(self) -> dict[int, int]:
        """Datagrams the switch copied, per replica number (a partition's k-th shadow)."""
        out: dict[int, int] = {}
        for e in self.switch.counters().get("entries", []):
            k = int(e.get("replica", 0))
            out[k] = out.get(k, 0) + int(e.get("packets", 0))
        return out

    def source_drops(self, host: str) -> dict[str, int]:
        """Frames the switch dropped at ``host``'s port for a source MAC or IP not bound to
        it ({"bad_src_mac": n, "bad_src_ip": n})."""
        port = self.switch.counters()["ports"][self.cfg.switch_ifname(host)]
        return {k: int(port.get(k, 0)) for k in ("bad_src_mac", "bad_src_ip")}

    def forwarding_port(self, mac: str) -> str | None:
        """The switch port (interface name) frames to ``mac`` leave on, None if unknown."""
        return self.switch.fdb().get(mac.lower())

    # -- inventory -----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        cfg = self.cfg
        state = self._read_state()
        ctl = [p for p in state.get("procs", []) if p.get("name") == "controller"]
        pid = ctl[0]["pid"] if ctl and _alive(ctl[0]["pid"], ctl[0].get("start")) else None
        sw_ns = cfg.netns(cfg.switch.name)
        hosts = []
        for h in cfg.port_hosts:
            d: dict[str, Any] = {
                "name": h.name, "role": h.role, "namespace": cfg.netns(h.name),
                "interface": cfg.host_ifname(h.name), "switch_interface":
                cfg.switch_ifname(h.name), "ip": h.ip, "mac": h.mac, "port": h.port,
                "up": netns_exists(cfg.netns(h.name))}
            if h.rank is not None:
                d["rank"] = h.rank
            if h.partition is not None:
                d["partition"] = h.partition
            hosts.append(d)
        return {
            "prefix": cfg.network.prefix,
            "up": all(netns_exists(n) for n in self.namespaces) and self.switch.is_up(),
            "switch": {"name": cfg.switch.name, "target": cfg.switch.target,
                       "namespace": sw_ns, "bridge": cfg.bridge_name, "ip": cfg.switch.ip,
                       "mac": cfg.switch.mac, "bpf_pin_dir": str(self.switch.pin_dir),
                       "bpf_attached": self.switch.is_up(),
                       "controller_pid": pid},
            "hosts": hosts,
        }
