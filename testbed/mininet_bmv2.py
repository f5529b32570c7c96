"""The cluster config as a mininet network around bmv2 simple_switch_grpc running the v1model
Checkmate program; `control deploy` then programs it over P4Runtime like any switch.

Needs mininet, p4c (p4c-bm2-ss) and bmv2 (simple_switch_grpc), which this machine does not
have; :func:`missing` names what is absent and the tests skip with that reason. Port
numbers follow the controller's rule (``switch_port`` from the config, else 1 + the host's
index in the config), and the switch's CPU port is a link to a "ctl" host that carries the
switch's own IP and MAC, where `control serve` runs and receives the punted handshake
datagrams as ordinary frames.

    python -m checkmate.testbed.mininet_bmv2 [--config FILE] [--cli]
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from checkmate import config
from checkmate.control.plan import switch_port
from checkmate.errors import CheckmateError, cli_guard

REPO = Path(__file__).resolve().parent.parent
P4_SRC = REPO / "p4" / "checkmate_v1model.p4"
BUILD = REPO / "build" / "p4"
GRPC_PORT = 9559
CTL_HOST = "ctl"


def missing() -> str | None:
    """Why this topology cannot run here, or None when everything is installed."""
    if importlib.util.find_spec("mininet") is None:
        return "mininet (python package) is not installed"
    for tool in ("p4c-bm2-ss", "simple_switch_grpc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


@dataclass(frozen=True)
class Link:
    host: str
    ip: str
    mac: str
    port: int  # switch port number == bmv2 port
    intf: str  # switch-side interface name


def links(cfg: config.ClusterConfig) -> list[Link]:
    """One link per host plus the CPU-port link to the controller host."""
    out = [Link(h.name, h.ip, h.mac, switch_port(cfg, h), f"{cfg.switch.name}-eth"
                f"{switch_port(cfg, h)}") for h in cfg.hosts]
    out.append(Link(CTL_HOST, cfg.switch.ip, cfg.switch.mac, cfg.switch.cpu_port,
                    f"{cfg.switch.name}-eth{cfg.switch.cpu_port}"))
    return out


def switch_argv(cfg: config.ClusterConfig, json_path: Path) -> list[str]:
    """simple_switch_grpc command line: every link's interface bound to its port number,
    a priority queue per class so the ckm class (priority 3) has its own queue."""
    argv = ["simple_switch_grpc", "--device-id", str(cfg.switch.device_id),
            "--priority-queues", "8"]
    for link in links(cfg):
        argv += ["-i", f"{link.port}@{link.intf}"]
    argv += [str(json_path), "--", "--grpc-server-addr", f"0.0.0.0:{GRPC_PORT}"]
    return argv


def compile_p4(out_dir: Path = BUILD) -> Path:
    """p4c-bm2-ss the v1model program into out_dir; returns the JSON path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "checkmate_v1model.json"
    cmd = ["p4c-bm2-ss", "--arch", "v1model", "-I", str(P4_SRC.parent / "include"),
           "--p4runtime-files", str(out_dir / "checkmate_v1model.p4info.txtpb"),
           "-o", str(json_path), str(P4_SRC)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        first = (res.stderr.strip().splitlines() or ["no output"])[0]
        raise CheckmateError(f"p4c-bm2-ss failed: {first}")
    return json_path


def bmv2_config(cfg: config.ClusterConfig) -> config.ClusterConfig:
    """The same cluster, with the switch as a bmv2 target reachable on loopback."""
    return replace(cfg, switch=replace(cfg.switch, target="bmv2",
                                       address=f"127.0.0.1:{GRPC_PORT}"))


def build_network(cfg: config.ClusterConfig, json_path: Path):  # pragma: no cover - mininet
    """A started mininet Mininet with the hosts, the ctl host and the bmv2 switch."""
    from mininet.net import Mininet
    from mininet.node import Switch
    from mininet.topo import Topo

    class Bmv2Switch(Switch):
        """simple_switch_grpc as a mininet switch (its own process, ports from links())."""

        def start(self, controllers) -> None:
            log = open(f"/tmp/{self.name}-bmv2.log", "w")  # noqa: SIM115
            self.proc = subprocess.Popen(switch_argv(cfg, json_path), stdout=log,
                                         stderr=subprocess.STDOUT)

        def stop(self, deleteIntfs: bool = True) -> None:
            if getattr(self, "proc", None) is not None:
                self.proc.terminate()
                self.proc.wait(timeout=10)
            super().stop(deleteIntfs)

    class CheckmateTopo(Topo):
        def build(self) -> None:
            sw = self.addSwitch(cfg.switch.name, cls=Bmv2Switch)
            for link in links(cfg):
                h = self.addHost(link.host, ip=f"{link.ip}/24", mac=link.mac)
                self.addLink(h, sw, port2=link.port, intfName2=link.intf)

    net = Mininet(topo=CheckmateTopo(), controller=None, autoSetMacs=False)
    net.start()
    for h in net.hosts:
        for off in ("rx", "tx", "sg"):
            h.cmd(f"ethtool --offload {h.defaultIntf()} {off} off")
        h.cmd(f"ip link set {h.defaultIntf()} mtu {cfg.network.mtu}")
    return net


@cli_guard("mininet_bmv2")
def main(argv: list[str] | None = None) -> int:  # pragma: no cover - needs mininet/bmv2
    ap = argparse.ArgumentParser(prog="mininet_bmv2")
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--cli", action="store_true", help="drop into the mininet CLI")
    args = ap.parse_args(argv)
    why = missing()
    if why:
        raise CheckmateError(f"cannot run the bmv2 topology: {why}")
    cfg = bmv2_config(config.load(args.config or config.default_path()))
    json_path = compile_p4()
    net = build_network(cfg, json_path)
    try:
        cfg_path = BUILD / "mininet-bmv2.yaml"
        import yaml

        from checkmate.testbed.topology import config_to_dict

        cfg_path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        subprocess.run([sys.executable, "-m", "checkmate.control.cli", "deploy", "--switch",
                        cfg.switch.name, "--config", str(cfg_path)], check=True)
        ctl = net.get(CTL_HOST)
        ctl.cmd(f"{sys.executable} -m checkmate.control.cli serve --config {cfg_path} "
                f"> /tmp/ckm-bmv2-serve.log 2>&1 &")
        if args.cli:
            from mininet.cli import CLI

            CLI(net)
    finally:
        net.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
