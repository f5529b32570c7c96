"""`control`: deploy the plan to a switch, show its state, run the handshake service.

    control deploy --switch NAME [--config FILE] [--dry-run]
    (without --config: the shipped config whose switch is NAME, sw0 or tofino0)
    control status --switch NAME [--config FILE] [--json]
    control serve [--config FILE] [--bind IP]

Every user-facing failure (unknown switch, unreachable target, bad config or arguments) is
one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from checkmate.config import cluster as config
from checkmate.control import drivers, sessions
from checkmate.control import plan as plan_mod
from checkmate.errors import CheckmateError, cli_guard


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage too)
        print(f"control: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="control", description="Checkmate controller")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", type=Path, default=None,
                        help="cluster config (default: the embedded testbed/default.yaml)")
        sp.add_argument("--state", type=Path, default=None,
                        help="controller state file (default /run/checkmate/<prefix>/"
                             "controller-<switch>.json)")

    d = sub.add_parser("deploy", help="program the switch from the config")
    d.add_argument("--switch", required=True)
    d.add_argument("--dry-run", action="store_true", help="print the plan, touch nothing")
    common(d)
    s = sub.add_parser("status", help="print the switch's tables and counters")
    s.add_argument("--switch", required=True)
    s.add_argument("--json", action="store_true")
    s.add_argument("--secret-file", default=None,
                   help="the job secret's file, to ask the handshake service for its "
                        "counters (default: $CHECKMATE_SECRET_FILE)")
    common(s)
    v = sub.add_parser("serve", help="run the shadow handshake service until SIGTERM")
    v.add_argument("--bind", default=None, help="address to listen on (default switch.ip)")
    v.add_argument("--secret-file", default=None,
                   help="the job secret's file (default: $CHECKMATE_SECRET_FILE)")
    common(v)
    return p


#: Configs shipped with the package (checkmate.testbed), found by their switch's name when
#: no --config is given: sw0 (kernel testbed) and tofino0 (a Tofino with dev ports).
SHIPPED = ("default.yaml", "tofino0.yaml")


def _shipped(switch: str | None) -> Path:
    """The shipped config whose switch is ``switch`` (the default one when none is)."""
    from importlib.resources import files

    if switch is None:
        return config.default_path()
    paths = [Path(str(files("checkmate.testbed") / name)) for name in SHIPPED]
    names = []
    for p in paths:
        cfg = config.load(p)
        if cfg.switch.name == switch:
            return p
        names.append(cfg.switch.name)
    raise CheckmateError(f"unknown switch {switch!r} (the shipped configs have "
                         f"{', '.join(repr(n) for n in names)}; pass --config FILE)")


def _load(args: argparse.Namespace) -> config.ClusterConfig:
    if args.config is not None:
        return config.load(args.config)
    return config.load(_shipped(getattr(args, "switch", None)))


def _store(args: argparse.Namespace, cfg: config.ClusterConfig) -> sessions.SessionStore:
    return sessions.SessionStore(args.state or sessions.default_path(cfg))


def _dry_run(cfg: config.ClusterConfig, plan: plan_mod.Plan) -> None:
    print(plan_mod.describe(plan))
    if cfg.switch.target in ("bmv2", "tofino"):
        from checkmate.control.drivers import p4tables

        print(f"P4Runtime entries ({p4tables.ARCHS[cfg.switch.target]}):")
        for e in p4tables.entries(plan):
            print(f"  {e.label()}")
    if cfg.switch.target == "tofino":
        from checkmate.control.drivers.tofino import bfrt_script, write_script

        print(f"bfrt_python port script (written to {write_script(plan)}):")
        print(bfrt_script(plan))
        print(_packed(cfg))


def _packed(cfg: config.ClusterConfig) -> str:
    """What a deploy would push as the pipeline: the compiled TNA folder packed for the
    config's P4Runtime server, or why there is none (the dry run needs no build)."""
    import hashlib

    from checkmate.control import pipeline

    sw = cfg.switch
    try:
        blob = pipeline.device_config("tna", sw.tofino_server, list(range(sw.tofino_pipes)))
    except CheckmateError as e:
        return f"pipeline config: none to push yet ({e}; `make p4` builds it)"
    return (f"pipeline config: {len(blob)} bytes packed for {sw.tofino_server} from "
            f"{pipeline.program_dir('tna')} (sha256 {hashlib.sha256(blob).hexdigest()[:16]})")


def deploy(args: argparse.Namespace) -> int:
    cfg = _load(args)
    if args.switch != cfg.switch.name:
        raise CheckmateError(f"unknown switch {args.switch!r} (the config has "
                             f"{cfg.switch.name!r})")
    store = _store(args, cfg)
    plan = plan_mod.build(cfg, store.for_config(cfg), store.rings)
    if args.dry_run:
        _dry_run(cfg, plan)
        return 0
    drv = drivers.for_switch(cfg, args.switch)
    try:
        res = drv.apply(plan)
    finally:
        drv.close()
    for kind, items in (("+", res.added), ("~", res.changed), ("-", res.removed)):
        for item in items:
            print(f"{kind} {item}")
    for note in res.notes:
        print(f"note: {note}")
    print(f"deployed to {cfg.switch.name} ({cfg.switch.target}): {res.summary()}")
    return 0


def _print_status(st: dict) -> None:
    print(f"switch {st['switch']} ({st['target']})")
    if st["target"] == "kernel":
        c = st["counters"]
        print("replication entries:")
        for e in c["entries"]:
            rep = f" replica {e['replica']}" if e.get("replica") else ""
            print(f"  job {e['job_id']} {e['src_ip']} -> {e['dst_ip']} part {e['partition']}"
                  f"{rep} from {e.get('ingress_ifname', '?')} => {e['shadow_ifname']}: "
                  f"{e['packets']} pkts {e['bytes']} bytes")
        print("ports:")
        for name, d in sorted(c["ports"].items()):
            print(f"  {name}: " + " ".join(f"{k}={v}" for k, v in d.items()))
        if c.get("dscp") is None:
            print("ckm by DSCP: not counted by the loaded program (run `testbed up` again)")
        else:
            print("ckm by DSCP (well-formed datagrams entering each port):")
            for name, d in sorted(c["dscp"].items()):
                print(f"  {name}: " + (" ".join(f"dscp{k}={v}" for k, v in sorted(d.items()))
                                       or "none"))
        return
    print("table entries:")
    for e in st["entries"]:
        if e["packets"] is None:
            print(f"  {e['entry']}: counter not readable over P4Runtime")
        else:
            print(f"  {e['entry']}: {e['packets']} pkts {e['bytes']} bytes")
    print("multicast groups:")
    for g, reps in sorted(st["groups"].items()):
        print(f"  {g}: {reps}")
    print("ckm counters: " + " ".join(f"{k}={v}" for k, v in st["ckm_stats"].items()))
    for note in st.get("notes", ()):
        print(f"note: {note}")


def status(args: argparse.Namespace) -> int:
    cfg = _load(args)
    drv = drivers.for_switch(cfg, args.switch)
    try:
        st = drv.status()
    finally:
        drv.close()
    regs = _store(args, cfg).for_config(cfg)
    st["sessions"] = {h.name: {"partition": h.partition, "epoch": r.epoch, "ip": r.ip,
                               "port": r.port, **({"node": r.node} if r.node else {})}
                      for h in cfg.shadow_hosts if (r := regs.get(h.name)) is not None}
    st["handshake"] = _service_counters(cfg, args.secret_file)
    if args.json:
        print(json.dumps(st, indent=1, sort_keys=True))
        return 0
    _print_status(st)
    print("sessions: " + (", ".join(f"partition {d['partition']}: {name}"
                                     + (f" on {d['node']}" if "node" in d else "")
                                     + f" epoch {d['epoch']}"
                                     for name, d in st["sessions"].items()) or "none"))
    hs = st["handshake"]
    print("handshake service: " + (", ".join(f"{k} {v}" for k, v in
                                             sorted(hs["counters"].items())) or "nothing counted")
          if hs["running"] else f"handshake service: not asked ({hs['error']})")
    return 0


def _service_counters(cfg: config.ClusterConfig, secret_file: str | None) -> dict:
    """The running handshake service's counters, asked over its authenticated request
    (`{"running": False, "error"}` when it does not answer or there is no secret)."""
    from checkmate.control.handshake_client import controller_request
    from checkmate.protocol import auth

    try:
        secret = auth.load_secret(secret_file)
        body = controller_request((cfg.switch.ip, config.CONTROLLER_PORT), cfg.job_id,
                                  {"op": "counters"}, timeout=1.0, tries=2, secret=secret)
    except (CheckmateError, OSError) as e:
        return {"running": False, "error": " ".join(str(e).split())}
    counters = body.get("counters")
    return {"running": True, "counters": counters if isinstance(counters, dict) else {}}


def serve(args: argparse.Namespace) -> int:
    from checkmate.control.service import HandshakeService
    from checkmate.protocol import auth

    cfg = _load(args)
    secret = auth.load_secret(args.secret_file)
    drv = drivers.for_switch(cfg)
    svc = HandshakeService(cfg, drv, _store(args, cfg), secret, bind_ip=args.bind)

    def stop(signum, frame) -> None:
        svc.stop_event.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        svc.deploy()  # first: "switch not up" is the clearest error when nothing is there
        svc.bind()
        svc.serve_forever()
    finally:
        svc.close()
        drv.close()
    print(f"control serve: stopped ({dict(svc.stats)})", flush=True)
    return 0


@cli_guard("control")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return {"deploy": deploy, "status": status, "serve": serve}[args.cmd](args)
    except PermissionError:
        raise
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        raise CheckmateError(f"{e.strerror or e}{where}") from None
    except ImportError as e:
        if isinstance(e, CheckmateError):  # checkmate.extras.MissingExtra: names its extra
            raise
        raise CheckmateError(f"missing python package: {e.name or e}") from None


if __name__ == "__main__":
    sys.exit(main())
