"""The hosts a testbed run starts its processes on: namespaces behind the switch, or
loopback addresses in host mode; every process recorded so that a later run can stop what a
crashed one left behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from checkmate.config import cluster as cfgmod
from checkmate.errors import CheckmateError
from checkmate.protocol import auth
from checkmate.testbed import lifeline

MODES = ("switch", "host")
#: Loopback /24 (first three octets) used in host mode unless --loopback-net says otherwise.
LOOPBACK_NET = "127.77.0"
# ----------------------------------------------------------------------------- cluster


class Cluster:
    """Where each host runs and how to start a process there (namespaces or loopback)."""

    def __init__(self, cfg: cfgmod.ClusterConfig, mode: str, config_path: Path,
                 loopback_net: str, stack: ExitStack) -> None:
        self.cfg, self.mode, self.config_path = cfg, mode, config_path
        self.testbed = None
        if mode == "switch":
            if os.geteuid() != 0:
                raise CheckmateError("switch mode needs root (namespaces, BPF); "
                                     "use --mode host to run on loopback")
            from checkmate.dataplane.switch import KernelSwitch
            from checkmate.testbed.topology import Testbed

            if cfg.switch.target == "bmv2":
                from checkmate.testbed.mininet_bmv2 import Bmv2Testbed

                tb = Bmv2Testbed(cfg, controller=True, config_path=config_path)
            elif cfg.switch.target == "kernel":
                tb = Testbed(cfg, controller=True, config_path=config_path)
            else:
                raise CheckmateError(f"the testbed runs a kernel or bmv2 switch, not "
                                     f"{cfg.switch.target} (the config's switch.target)")
            tb.tied = True  # what this command starts ends with it (testbed.lifeline)
            if cfg.switch.target == "bmv2" or not KernelSwitch(cfg).is_up():
                tb.tied_controller = True  # this command builds the testbed: it owns all
                stack.enter_context(tb)
            self.testbed = tb
            # a co-located shadow has no address of its own: its launcher places it on a node
            self.ip = {h.name: h.ip for h in cfg.port_hosts}
        else:
            self.registry = Path(tempfile.gettempdir()) / f"checkmate-run-{loopback_net}.json"
            self.clear_leftovers()
            stack.callback(self.clear_leftovers)
            self.secret_file = self._host_secret(loopback_net, stack)
            self.ip = {}
            for h in cfg.trainers:
                self.ip[h.name] = f"{loopback_net}.{10 + h.rank}"
            for i, h in enumerate(cfg.shadow_hosts):  # by partition, then replica
                if not h.colocated:
                    self.ip[h.name] = f"{loopback_net}.{100 + i}"

    @staticmethod
    def _host_secret(loopback_net: str, stack: ExitStack) -> Path:
        """Host mode's job secret: $CHECKMATE_SECRET_FILE, else a fresh one for this run."""
        env = os.environ.get(auth.SECRET_ENV)
        if env:
            return auth.create_secret(env)
        path = Path(tempfile.gettempdir()) / f"checkmate-run-{loopback_net}.key"
        path.unlink(missing_ok=True)
        stack.callback(path.unlink, missing_ok=True)
        return auth.create_secret(path)

    def popen(self, host: str, argv: list[str], env: dict[str, str], **kw: Any
              ) -> subprocess.Popen:
        """Start a process on ``host``, recorded so that a later run (or `testbed down` in
        switch mode) stops it if this launcher dies without cleaning up."""
        full_env = {**os.environ, **env}
        kw.pop("start_new_session", None)
        name = f"{host}:{argv[2] if len(argv) > 2 else argv[0]}"
        if self.testbed is not None:
            return self.testbed.spawn(host, argv, name, env=full_env, **kw)
        full_env[auth.SECRET_ENV] = str(self.secret_file)
        p = lifeline.popen(argv, env=full_env, start_new_session=True, **kw)
        self._record(p.pid)
        return p

    # Host mode has no testbed state dir: leftovers are listed in a file per loopback net.
    def _record(self, pid: int) -> None:
        from checkmate.testbed.topology import proc_start_time

        procs = self._recorded()
        procs.append({"pid": pid, "start": proc_start_time(pid)})
        self.registry.write_text(json.dumps(procs))

    def _recorded(self) -> list[dict]:
        try:
            data = json.loads(self.registry.read_text())
        except (OSError, ValueError):
            return []
        return [d for d in data if isinstance(d, dict) and isinstance(d.get("pid"), int)]

    def clear_leftovers(self) -> None:
        """Stop processes an earlier, killed launcher left on this loopback net."""
        from checkmate.testbed.topology import stop_pid

        for d in self._recorded():
            stop_pid(d["pid"], d.get("start"), timeout=2.0)
        self.registry.unlink(missing_ok=True)

    def run(self, host: str, argv: list[str]) -> subprocess.CompletedProcess:
        if self.testbed is not None:
            return self.testbed.run_in(host, argv, capture_output=True, text=True)
        return subprocess.run(argv, capture_output=True, text=True,
                              env={**os.environ, auth.SECRET_ENV: str(self.secret_file)})

    def ifname(self, host: str) -> str:
        return self.cfg.host_ifname(host) if self.mode == "switch" else "lo"


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip if ip.startswith("127.") else "127.0.0.1", 0))
        return s.getsockname()[1]
