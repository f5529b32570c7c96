"""The namespace testbed with bmv2 for its switch: the cluster config as a mininet network
around bmv2 simple_switch running the v1model Checkmate program, programmed by the
controller through bmv2's Thrift runtime (control/drivers/bmv2_thrift.py).

Mininet builds the hosts and the switch (each its own network namespace) and their links;
simple_switch runs in the switch's namespace, bound to the host-facing ports by the
controller's port rule (``switch_port``, else 1 + the host's index) and, as its CPU port, to
one end of a veth pair whose other end carries the switch's own IP and MAC: there the
controller (`control serve`, in the switch's namespace like on the kernel switch) receives
the punted handshakes and reaches the Thrift server on loopback. Every namespace is then
given the name the kernel testbed uses (``ip netns attach``), so the scenario runner starts
trainers and shadows in it the same way (:class:`Bmv2Testbed`). The switch starts without a
program; the controller's first deploy loads the compiled JSON (``--enable-swap``).

Needs mininet (Debian's package for ``mnexec``, the Python package from PyPI), p4c-bm2-ss
and simple_switch (the toolchain: scripts/p4-toolchain.sh); :func:`missing` names what is
absent and the tests skip with that reason.

    python -m checkmate.testbed.mininet_bmv2 [--config FILE]   # build it, print, wait
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from checkmate.config import cluster as config
from checkmate.control import pipeline
from checkmate.control.plan import switch_port
from checkmate.errors import CheckmateError, cli_guard
from checkmate.extras import needs
from checkmate.testbed.topology import Testbed, _no_ipv6, _sh, proc_start_time

THRIFT_PORT = 9090
BINARIES = ("mnexec", "p4c-bm2-ss", "simple_switch")


def _have_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def missing() -> str | None:
    """Why this topology cannot run here (every absent piece, by name), or None."""
    absent = [t for t in BINARIES if shutil.which(t) is None]
    if not _have_module("mininet"):
        absent.insert(0, "mininet (python package)")
    if not _have_module("thrift"):
        absent.insert(0, "thrift (python package)")
    if not absent:
        return None
    return f"{', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not installed"


def bmv2_config(cfg: config.ClusterConfig) -> config.ClusterConfig:
    """The same cluster with its switch as bmv2 simple_switch, programmed over Thrift on the
    switch namespace's loopback."""
    return replace(cfg, switch=replace(cfg.switch, target="bmv2", runtime="thrift",
                                       address=f"127.0.0.1:{THRIFT_PORT}"))


def cpu_ifnames(cfg: config.ClusterConfig) -> tuple[str, str]:
    """(bmv2's CPU port, the controller's interface): a veth pair in the switch namespace."""
    return f"{cfg.network.prefix}-cpu", f"{cfg.network.prefix}-ctl"


def ports(cfg: config.ClusterConfig) -> list[tuple[int, str]]:
    """(bmv2 port, switch-side interface) of every host, then the CPU port."""
    out = [(switch_port(cfg, h), cfg.switch_ifname(h.name)) for h in cfg.port_hosts]
    return [*out, (cfg.switch.cpu_port, cpu_ifnames(cfg)[0])]


def switch_argv(cfg: config.ClusterConfig, state_dir: Path) -> list[str]:
    """simple_switch: every port bound to its number, no program (the controller loads it,
    so swapping is on), a priority queue per class (the ckm class, priority 3, has its own),
    its notification socket in the testbed's state dir (two testbeds never share one)."""
    argv = ["simple_switch", "--device-id", str(cfg.switch.device_id), "--thrift-port",
            str(THRIFT_PORT), "--notifications-addr", f"ipc://{state_dir / 'bmv2.ipc'}"]
    for port, ifname in ports(cfg):
        argv += ["-i", f"{port}@{ifname}"]
    return [*argv, "--no-p4", "--", "--enable-swap", "--priority-queues", "8"]


def compile_p4() -> Path:
    """The v1model JSON the controller loads, compiled unless the build folder holds this
    exact build (checkmate.control.p4build, `make p4`)."""
    from checkmate.control import p4build

    res = p4build.compile_program("v1model")
    return res.out / f"{pipeline.PROGRAMS['v1model']}.json"


class Bmv2Switch:
    """What the testbed asks of its switch, for simple_switch: attach waits until its
    Thrift server answers; the process itself is one of the testbed's recorded ones."""

    def __init__(self, cfg: config.ClusterConfig, state_dir: Path) -> None:
        self.cfg = cfg
        self.pin_dir = state_dir / "no-bpf"  # nothing pinned (the kernel switch's field)

    def _answers(self) -> bool:
        from checkmate.testbed.netsock import call_in_netns

        def probe() -> bool:
            try:
                socket.create_connection(("127.0.0.1", THRIFT_PORT), timeout=0.5).close()
                return True
            except OSError:
                return False

        try:
            return call_in_netns(self.cfg.netns(self.cfg.switch.name), probe)
        except (OSError, CheckmateError):
            return False

    def attach(self) -> None:
        deadline = time.monotonic() + 15
        while not self._answers():
            if time.monotonic() > deadline:
                raise CheckmateError("bmv2 simple_switch did not open its Thrift port in 15 s "
                                     "(its log: bmv2.log in the testbed's state dir)")
            time.sleep(0.1)

    def detach(self) -> None:
        pass

    def is_up(self) -> bool:
        return self._answers()


class Bmv2Testbed(Testbed):
    """The namespace testbed (same names, processes, controller and state file) with a
    mininet network and bmv2 in place of the veths, the bridge and the tc-eBPF switch."""

    #: simple_switch reads its ports through packet sockets into a bounded input queue: on
    #: a loaded machine a few frames are lost before its pipeline sees them (measured: 6 of
    #: 4544 hijack frames beside another namespace test). The attack checks allow 5%: far
    #: less than one of a hijack round's four frames passing would leave uncounted.
    INGRESS_LOSS = 0.05

    def __init__(self, cfg: config.ClusterConfig, controller: bool = False,
                 config_path: str | Path | None = None) -> None:
        super().__init__(cfg, controller, config_path)
        if cfg.switch.target != "bmv2" or cfg.switch.runtime != "thrift":
            raise CheckmateError("the bmv2 testbed runs simple_switch over Thrift: "
                                 "switch: {target: bmv2, runtime: thrift}")
        self.switch = Bmv2Switch(cfg, self.state_dir)  # type: ignore[assignment]
        self.net: Any = None

    def up(self) -> None:
        why = missing()
        if why:
            raise CheckmateError(f"cannot build the bmv2 testbed: {why}")
        compile_p4()
        super().up()

    def _build_links(self) -> None:
        """Mininet's network, its namespaces named like the kernel testbed's, addresses,
        MTU, offloads and neighbours as there."""
        self.net = build_network(self.cfg, self.state_dir)
        state = self._read_state()
        for node in self.net.hosts + self.net.switches:
            name = self.cfg.netns(node.name)
            _sh(["ip", "netns", "attach", name, str(node.pid)])
            state["procs"].append({"name": f"mininet:{node.name}", "host": node.name,
                                   "pid": node.pid, "start": proc_start_time(node.pid)})
        bmv2 = self.net.switches[0].proc
        state["procs"].append({"name": "bmv2", "host": self.cfg.switch.name, "pid": bmv2.pid,
                               "start": proc_start_time(bmv2.pid)})
        self._write_state(state)
        for name in self.namespaces:
            _no_ipv6(name)
        self._static_l2()
        self._colocated_nodes()

    @property
    def controller_ifname(self) -> str:
        """The veth end facing bmv2's CPU port, with the switch's IP."""
        return cpu_ifnames(self.cfg)[1]

    def down(self) -> None:
        """Mininet's own stop when this process built the network (it talks to its node
        shells, so before they are stopped), then what the state file records: after a crash,
        bmv2 and the shells by PID, which takes the namespaces and links with them."""
        if self.net is not None:
            net, self.net = self.net, None
            net.stop()
        super().down()

    def replicated_packets(self) -> int:
        return sum(int(e["packets"] or 0) for e in self.switch_status()["entries"]
                   if e["entry"].startswith("ckm_replicate "))

    def switch_status(self) -> dict:
        """The controller's view of bmv2 (entries with counters, groups, ckm_stats)."""
        from checkmate.control.drivers import for_switch
        from checkmate.testbed.netsock import call_in_netns

        def read() -> dict:
            driver = for_switch(self.cfg)
            try:
                return driver.status()
            finally:
                driver.close()

        return call_in_netns(self.cfg.netns(self.cfg.switch.name), read)

    def source_drops(self, host: str) -> dict[str, int]:
        """bmv2 counts source-check drops per reason for all ports together: a test that
        reads this has one attacker."""
        stats = self.switch_status()["ckm_stats"]
        return {k: int(stats.get(k, 0)) for k in ("bad_src_mac", "bad_src_ip")}

    def forwarding_port(self, mac: str) -> str | None:
        """The interface of the port the switch's l2_fwd entry for ``mac`` sends to."""
        want = f"l2_fwd [dst_mac={int(mac.replace(':', ''), 16):#x}]"
        names = dict(ports(self.cfg))
        for e in self.switch_status()["entries"]:
            if e["entry"].startswith(want):
                return names.get(int(e["entry"].rsplit("port=", 1)[1].rstrip(")"), 16))
        return None


def build_network(cfg: config.ClusterConfig, state_dir: Path) -> Any:  # mininet
    """A started mininet network: a host per config host, the switch in its own namespace
    running simple_switch (switch_argv), a link per host on its port."""
    with needs("testbed"):
        from mininet.net import Mininet
        from mininet.node import Switch

    plen = ipaddress.IPv4Network(cfg.network.subnet).prefixlen
    cpu_port_if, ctl_if = cpu_ifnames(cfg)
    mtu = cfg.network.mtu

    class SimpleSwitch(Switch):
        """bmv2 simple_switch as a mininet switch in its own namespace."""

        def start(self, controllers: list) -> None:
            for cmd in (f"ip link add {cpu_port_if} type veth peer name {ctl_if}",
                        f"ip link set {ctl_if} address {cfg.switch.mac}",
                        f"ip addr add {cfg.switch.ip}/{plen} dev {ctl_if}",
                        f"ethtool -K {ctl_if} tx off",
                        *(f"ip link set {i} mtu {mtu} up" for _, i in ports(cfg)),
                        f"ip link set {ctl_if} mtu {mtu} up", "ip link set lo up"):
                self.cmd(cmd)
            log = open(state_dir / "bmv2.log", "w")  # noqa: SIM115 - the switch's stdout
            self.proc = self.popen(switch_argv(cfg, state_dir), stdout=log,
                                   stderr=subprocess.STDOUT)
            log.close()

        def stop(self, deleteIntfs: bool = True) -> None:  # noqa: N803 - mininet's name
            proc = getattr(self, "proc", None)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            super().stop(deleteIntfs)

    net = Mininet(controller=None, autoSetMacs=False, build=False, cleanup=False)
    sw = net.addSwitch(cfg.switch.name, cls=SimpleSwitch, inNamespace=True, dpid="1")
    for h in cfg.port_hosts:  # a co-located shadow runs on a trainer's node: no link
        host = net.addHost(h.name, ip=f"{h.ip}/{plen}", mac=h.mac)
        net.addLink(host, sw, port2=switch_port(cfg, h), intfName1=cfg.host_ifname(h.name),
                    intfName2=cfg.switch_ifname(h.name))
    try:
        net.start()
    except BaseException:
        net.stop()  # the shells and links built so far
        raise
    for h in net.hosts:
        intf = cfg.host_ifname(h.name)
        # complete UDP checksums on the wire (see topology.Testbed._build_links)
        h.cmd(f"ip link set {intf} mtu {mtu}; ethtool -K {intf} tx off")
    return net


@cli_guard("mininet_bmv2")
def main(argv: list[str] | None = None) -> int:  # pragma: no cover - interactive
    ap = argparse.ArgumentParser(prog="mininet_bmv2", description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=None)
    args = ap.parse_args(argv)
    cfg = bmv2_config(config.load(args.config or config.default_path()))
    with Bmv2Testbed(cfg, controller=True) as tb:
        print(f"bmv2 testbed up: namespaces {', '.join(tb.namespaces)}; controller log "
              f"{tb.state_dir / 'controller.log'}; Ctrl-C removes it", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
