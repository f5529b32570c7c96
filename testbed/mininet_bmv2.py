"""The cluster config as a mininet network around bmv2 simple_switch_grpc running the v1model
Checkmate program; `control deploy` then programs it over P4Runtime like any switch.

The switch starts empty (``--no-p4``) and receives the program the way a production switch
does: the compiler's P4Info and JSON through P4Runtime SetForwardingPipelineConfig
(:func:`push_pipeline`). The program is compiled into the one build folder the controller
reads too (checkmate.control.pipeline: ``build/p4/checkmate_v1model/`` or
``$CHECKMATE_P4_BUILD``), from the P4 sources installed as package data (checkmate.p4).

Needs mininet, p4c (p4c-bm2-ss) and bmv2 (simple_switch_grpc), which this machine does not
have; :func:`missing` names everything absent and the tests skip with that reason. Port
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

from checkmate.config import cluster as config
from checkmate.control import pipeline
from checkmate.control.plan import switch_port
from checkmate.errors import CheckmateError, cli_guard

GRPC_PORT = 9559
CTL_HOST = "ctl"
BINARIES = ("p4c-bm2-ss", "simple_switch_grpc")


def _have_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def missing() -> str | None:
    """Why this topology cannot run here (every absent piece, by name), or None."""
    absent = [t for t in BINARIES if shutil.which(t) is None]
    if not _have_module("mininet"):
        absent.insert(0, "mininet (python package)")
    if not absent:
        return None
    return f"{', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not installed"


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


def switch_argv(cfg: config.ClusterConfig) -> list[str]:
    """simple_switch_grpc command line: every link's interface bound to its port number, a
    priority queue per class so the ckm class (priority 3) has its own queue, and no program
    (--no-p4): the pipeline arrives over P4Runtime."""
    argv = ["simple_switch_grpc", "--device-id", str(cfg.switch.device_id),
            "--priority-queues", "8"]
    for link in links(cfg):
        argv += ["-i", f"{link.port}@{link.intf}"]
    argv += ["--no-p4", "--", "--grpc-server-addr", f"0.0.0.0:{GRPC_PORT}"]
    return argv


def compile_argv() -> list[str]:
    """p4c-bm2-ss into the build folder the controller reads (JSON and P4Info)."""
    src = pipeline.p4_source("v1model")
    out = pipeline.program_dir("v1model")
    return ["p4c-bm2-ss", "--arch", "v1model", "-I", str(src.parent / "include"),
            "--p4runtime-files", str(out / "p4info.txtpb"),
            "-o", str(out / f"{pipeline.PROGRAMS['v1model']}.json"), str(src)]


def compile_p4() -> Path:
    """Compile the v1model program (compile_argv); returns the JSON path."""
    argv = compile_argv()
    pipeline.program_dir("v1model").mkdir(parents=True, exist_ok=True)
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode != 0:
        first = (res.stderr.strip().splitlines() or ["no output"])[0]
        raise CheckmateError(f"p4c-bm2-ss failed: {first}")
    return Path(argv[argv.index("-o") + 1])


def push_pipeline(cfg: config.ClusterConfig, timeout: float = 10.0) -> None:
    """Load the compiled program into the switch: P4Info and bmv2 JSON through
    SetForwardingPipelineConfig, as the switch's primary controller."""
    from checkmate.control.p4rt_client import P4RuntimeClient

    loaded = pipeline.compiled_p4info("v1model")
    assert cfg.switch.address is not None
    with P4RuntimeClient(cfg.switch.address, cfg.switch.device_id, timeout=timeout) as c:
        c.set_pipeline(loaded.p4info, pipeline.device_config("v1model"))


def bmv2_config(cfg: config.ClusterConfig) -> config.ClusterConfig:
    """The same cluster, with the switch as a bmv2 target reachable on loopback."""
    return replace(cfg, switch=replace(cfg.switch, target="bmv2",
                                       address=f"127.0.0.1:{GRPC_PORT}"))


def build_network(cfg: config.ClusterConfig):  # pragma: no cover - mininet
    """A started mininet Mininet with the hosts, the ctl host and the bmv2 switch."""
    from mininet.net import Mininet
    from mininet.node import Switch
    from mininet.topo import Topo

    class Bmv2Switch(Switch):
        """simple_switch_grpc as a mininet switch (its own process, ports from links())."""

        def start(self, controllers) -> None:
            log = open(f"/tmp/{self.name}-bmv2.log", "w")  # noqa: SIM115
            self.proc = subprocess.Popen(switch_argv(cfg), stdout=log,
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
    compile_p4()
    net = build_network(cfg)
    try:
        push_pipeline(cfg)
        cfg_path = pipeline.build_dir() / "mininet-bmv2.yaml"
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
