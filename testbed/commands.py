"""`testbed up|down|status|exec`: the namespace testbed's life cycle from the shell.

``main(argv)`` takes the subcommand as argv[0] (see testbed/cli.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import warnings

from checkmate.config import cluster as config
from checkmate.dataplane.switch import KernelSwitch, SwitchUnreachable, netns_exists
from checkmate.errors import CheckmateError, cli_guard
from checkmate.testbed.topology import Testbed


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as CheckmateError (one line, exit 2 via cli_guard)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CheckmateError(message)


def _load(path: str | None) -> tuple[config.ClusterConfig, str]:
    p = path or str(config.default_path())
    return config.load(p), p


def _parser(cmd: str) -> argparse.ArgumentParser:
    ap = _Parser(prog=f"testbed {cmd}")
    ap.add_argument("--config", help="cluster config YAML (default: the embedded default)")
    if cmd == "up":
        ap.add_argument("--no-controller", action="store_true",
                        help="do not start the controller service in the switch namespace")
    if cmd == "status":
        ap.add_argument("--json", action="store_true", help="machine-readable inventory")
    if cmd == "exec":
        ap.add_argument("host", help="host name from the config (or the switch name)")
        ap.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return ap


def _up(args: argparse.Namespace) -> int:
    cfg, path = _load(args.config)
    if cfg.switch.target != "kernel":
        raise CheckmateError(f"the namespace testbed runs the kernel switch; config has "
                             f"switch.target={cfg.switch.target}")
    tb = Testbed(cfg, controller=not args.no_controller, config_path=path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tb.up()
    for w in caught:
        print(f"testbed up: warning: {w.message}", file=sys.stderr)
    st = tb.status()
    pid = st["switch"]["controller_pid"]
    print(f"testbed {cfg.network.prefix}: switch {cfg.switch.name} ({st['switch']['namespace']}, "
          f"{cfg.switch.ip}), {len(cfg.trainers)} trainers, {len(cfg.shadows)} shadows; "
          f"controller {'pid ' + str(pid) if pid else 'not running'}")
    return 0


def _down(args: argparse.Namespace) -> int:
    cfg, _ = _load(args.config)
    Testbed(cfg).down()
    print(f"testbed {cfg.network.prefix}: down")
    return 0


def _port_counters(cfg: config.ClusterConfig) -> dict[str, dict[str, int]] | None:
    """The switch's per-port counters (rx, tx, replicated, ..., malformed, no_entry, spoofed)
    while its BPF is attached, else None: status shows at a glance which port sends spoofed
    or malformed ckm traffic."""
    sw = KernelSwitch(cfg)
    if not sw.is_up():
        return None
    try:
        return sw.counters()["ports"]
    except SwitchUnreachable:  # torn down between the check and the read
        return None


def _status(args: argparse.Namespace) -> int:
    cfg, _ = _load(args.config)
    st = Testbed(cfg).status()
    ports = _port_counters(cfg)
    if ports is not None:
        st["switch"]["counters"] = ports
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    sw = st["switch"]
    print(f"prefix {st['prefix']}: {'up' if st['up'] else 'down'}")
    print(f"switch {sw['name']}  ns={sw['namespace']}  ip={sw['ip']}  mac={sw['mac']}  "
          f"bpf={'attached' if sw['bpf_attached'] else 'absent'}  "
          f"controller={sw['controller_pid'] or '-'}")
    for h in st["hosts"]:
        tag = f"rank {h['rank']}" if "rank" in h else f"partition {h['partition']}"
        print(f"  {h['name']:<6} {h['role']:<8} {tag:<12} ns={h['namespace']:<10} "
              f"if={h['interface']:<10} {h['ip']:<15} {h['mac']}  {'up' if h['up'] else 'down'}")
    if ports is not None:
        print("switch ports:")
        for name, d in ports.items():
            print(f"  {name:<10} " + " ".join(f"{k}={v}" for k, v in d.items()))
    return 0


def _exec(args: argparse.Namespace) -> int:
    cfg, _ = _load(args.config)
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise CheckmateError("exec needs a command: testbed exec HOST -- CMD [ARGS...]")
    tb = Testbed(cfg)
    ns = tb.netns_of(args.host)
    if not netns_exists(ns):
        raise CheckmateError(f"namespace {ns} does not exist (run `testbed up`)")
    try:
        return tb.run_in(args.host, argv).returncode
    except FileNotFoundError as e:
        raise CheckmateError(f"cannot run {argv[0]}: {e.strerror}") from None


_HANDLERS = {"up": _up, "down": _down, "status": _status, "exec": _exec}


@cli_guard("testbed")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _HANDLERS:
        raise CheckmateError(f"expected one of {', '.join(_HANDLERS)} as the subcommand")
    cmd = argv[0]
    rest = argv[1:]
    if cmd == "exec" and "--" in rest:
        cut = rest.index("--")
        args = _parser(cmd).parse_args(rest[:cut])
        args.argv = rest[cut + 1:]
    else:
        args = _parser(cmd).parse_args(rest)
    try:
        return _HANDLERS[cmd](args)
    except subprocess.SubprocessError as e:
        raise CheckmateError(str(e)) from None
    except PermissionError:
        raise
    except OSError as e:  # netlink and syscall failures: one line, not a traceback
        raise CheckmateError(f"{cmd}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
