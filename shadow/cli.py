"""`shadow`: run a shadow node, or restore the consistent point from shadows or disk.

    shadow serve --partition I/N [--config FILE] [--host NAME] [--dir DIR]
                 [--persist-every K] [--persist-seconds T] [--bind IP] [--no-register] ...
    shadow serve --partition I/N --placed --controller HOST[:PORT] --job ID --bind IP ...
    shadow restore --config FILE [--out FILE] [--from-disk DIR] [--addr HOST:PORT ...]
    shadow status --config FILE [--addr HOST:PORT ...]
    shadow export --out DIR [--iteration N] DIR ...

Without --config, ``serve`` runs on the documented defaults (docs/usage.md): UDP 47001 and
TCP 47100 on --bind (0.0.0.0), no controller registration (host replication: trainers send
the copies), and the job id is learned from the first seed the trainers send. With
--placed (a shadow `checkmate launch --colocate --mode switch` starts on a trainer node) it
does not register either: the launcher's rendezvous placed it and rank 0's attempt tells the
controller where (control/service.py, ``attempt``); it takes its session from the controller
when asked, found there by its address.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from checkmate.config import cluster as cfgmod
from checkmate.errors import CheckmateError, cli_guard

if TYPE_CHECKING:
    from checkmate.shadow.node import NodeOptions


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one CheckmateError line (exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CheckmateError(message)


def _nonneg_int(s: str) -> int:
    if not s.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {s!r}")
    return int(s)


def _nonneg_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {s!r}")
    return v


def _port(s: str) -> int:
    if not s.isdigit() or not 0 <= int(s) < 65536:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535, got {s!r}")
    return int(s)


def _ip(s: str) -> str:
    import ipaddress

    try:
        return str(ipaddress.IPv4Address(s))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an IPv4 address, got {s!r}") from None


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="shadow", description="Checkmate shadow node")
    sub = p.add_subparsers(dest="cmd", parser_class=_Parser)
    s = sub.add_parser("serve", help="receive replicated gradients for one partition")
    s.add_argument("--partition", required=True, help="I/N: partition I (0-based) of N")
    s.add_argument("--config", help="cluster config YAML (default: none; host replication, "
                   "the job id learned from the seed)")
    s.add_argument("--host", help="this shadow's host name in the config")
    s.add_argument("--dir", help="persist checkpoints under DIR/part<I>; restore from it")
    s.add_argument("--persist-every", type=_nonneg_int, default=0, metavar="K",
                   help="persist every K iterations (iteration %% K == 0); 0: off")
    s.add_argument("--persist-seconds", type=_nonneg_float, default=0.0, metavar="T",
                   help="without --persist-every: persist when T seconds passed since the "
                   "last write (not aligned across partitions); 0: off")
    s.add_argument("--keep", type=_nonneg_int, default=3, help="checkpoints kept on disk")
    s.add_argument("--bind", type=_ip, default="0.0.0.0", help="UDP bind address")
    s.add_argument("--port", type=_port, default=cfgmod.SHADOW_PORT, help="UDP port")
    s.add_argument("--restore-bind", type=_ip, default=None,
                   help="TCP service bind address (default: --bind)")
    s.add_argument("--restore-port", type=_port, default=cfgmod.RESTORE_PORT)
    s.add_argument("--retain", type=_nonneg_int, default=4,
                   help="committed iterations kept in memory for consistent restore")
    s.add_argument("--window", type=_nonneg_int, default=8,
                   help="iterations ahead of the last commit accepted")
    s.add_argument("--gap-timeout", type=_nonneg_float, default=2.0,
                   help="seconds newer iterations may arrive before a gap is reported")
    s.add_argument("--no-register", action="store_true",
                   help="do not register with the controller (host-replication / loopback)")
    s.add_argument("--controller", help="HOST:PORT of the controller "
                   "(default: switch ip and the controller port from the config)")
    s.add_argument("--placed", action="store_true",
                   help="co-located in switch mode: the launcher's attempt placed this "
                   "shadow at the controller (--controller, --job): it does not register "
                   "and takes its session, found by --bind and --port, when asked")
    s.add_argument("--job", type=_nonneg_int, default=None,
                   help="the job id, with --placed (the controller keys sessions by it)")
    s.add_argument("--epoch", type=_nonneg_int, default=0, help="epoch with --no-register")
    s.add_argument("--token", type=_nonneg_int, default=0, help="token with --no-register")
    s.add_argument("--register-timeout", type=_nonneg_float, default=30.0)
    s.add_argument("--secret-file", default=None,
                   help="the job secret's file (default: $CHECKMATE_SECRET_FILE)")
    s.add_argument("--transport", choices=("udp", "verbs"), default="udp",
                   help="verbs: also take the replica stream on a UD queue pair of --device "
                   "(docs/verbs.md); repair stays on UDP")
    s.add_argument("--device", default="", metavar="RDMA_DEV",
                   help="RDMA device for --transport verbs (e.g. rxe0)")
    s.add_argument("--metrics-port", type=_port, default=None,
                   help="serve Prometheus metrics on --bind:PORT (0: any free port; "
                        "CHECKMATE_METRICS_PORT overrides)")
    s.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    r = sub.add_parser("restore", help="print the consistent point and write the state")
    r.add_argument("--config", required=True)
    r.add_argument("--out", help="torch.save the restored state dicts to FILE")
    r.add_argument("--from-disk", metavar="DIR", help="read persisted checkpoints, not shadows")
    r.add_argument("--addr", action="append", default=[], metavar="HOST:PORT",
                   help="shadow service address, in partition order (default: the config)")
    r.add_argument("--timeout", type=_nonneg_float, default=60.0)

    t = sub.add_parser("status", help="print each shadow's status as JSON")
    t.add_argument("--config", required=True)
    t.add_argument("--addr", action="append", default=[], metavar="HOST:PORT")
    t.add_argument("--commit-times", action="store_true",
                   help="include every recent commit's (iteration, time)")

    e = sub.add_parser("export", help="join persisted partition dirs (e.g. copied from "
                       "shadows with separate disks) into one checkpoint torch's dcp.load reads")
    e.add_argument("--out", required=True, help="new directory for the joined checkpoint")
    e.add_argument("--iteration", type=_nonneg_int, default=None,
                   help="this iteration (default: the newest every partition holds)")
    e.add_argument("dirs", nargs="+", metavar="DIR",
                   help="a --dir of shadows (holding part<I>/) or part<I> dirs themselves")
    return p


@cli_guard("shadow")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd == "serve":
        return _serve(args)
    if args.cmd == "restore":
        return _restore(args)
    if args.cmd == "status":
        return _status(args)
    if args.cmd == "export":
        return _export(args)
    print("usage: shadow {serve,restore,status,export} ... (shadow -h for help)", file=sys.stderr)
    return 2


def _serve(args: argparse.Namespace) -> int:
    from checkmate.shadow.node import NodeOptions
    from checkmate.spec.partition import parse_partition_arg
    from checkmate.train.shadow_client import parse_addr

    index, count = parse_partition_arg(args.partition)
    if args.persist_every and args.persist_seconds:
        raise CheckmateError("--persist-seconds applies only without --persist-every (the "
                             "partitions must write the same iterations)")
    if args.placed or args.job is not None:
        return _serve_placed(args, index, count)
    if args.config is None:
        return _serve_without_config(args, index, count)
    cfg = cfgmod.load(args.config)
    if cfg.num_partitions and count != cfg.num_partitions:
        raise CheckmateError(f"--partition says {count} partitions, the config has "
                             f"{cfg.num_partitions} shadows")
    if args.host:
        host = cfg.host(args.host)
        if host.role != "shadow" or host.partition != index:
            raise CheckmateError(f"host {args.host!r} is not the shadow of partition {index}")
    else:
        host = cfg.shadow_for(index)
    if args.no_register:
        controller = None
    elif args.controller:
        controller = parse_addr(args.controller, cfgmod.CONTROLLER_PORT)
    else:
        controller = (cfg.switch.ip, cfgmod.CONTROLLER_PORT)
    if controller is not None and host is None:
        raise CheckmateError(f"no shadow host for partition {index} in the config; "
                             "registration needs its address (or use --no-register)")
    if args.epoch or args.token:
        if not args.no_register:
            raise CheckmateError("--epoch/--token only apply with --no-register")
    # a mesh job's group (job.groups > 1): its own wire job id, partitions numbered in it,
    # its files under DIR/group<g> as the launcher's own shadows keep them
    job, part, parts = cfg.wire_place(index)
    where = {} if cfg.groups == 1 else {"control_job": cfg.job_id, "control_partition": index}
    pdir = args.dir if args.dir is None or cfg.groups == 1 else str(
        Path(args.dir) / f"group{index // parts}")
    opts = NodeOptions(
        partition=part, partitions=parts, job=job, bind=args.bind, port=args.port,
        restore_bind=args.restore_bind or args.bind, restore_port=args.restore_port,
        dir=pdir, persist_every=args.persist_every, persist_seconds=args.persist_seconds,
        keep=max(args.keep, 1), retain=max(args.retain, 1), window=max(args.window, 1),
        gap_timeout=args.gap_timeout, epoch=args.epoch, token=args.token,
        controller=controller, host=host.name if host else "", ip=host.ip if host else "",
        mac=host.mac if host else "", register_deadline=args.register_timeout,
        **where, **_transport(args),
    )
    return _run_node(args, opts)


def _transport(args: argparse.Namespace) -> dict[str, str]:
    """NodeOptions' transport fields; --device without verbs, or verbs without a device, is
    one error line."""
    if args.transport == "verbs" and not args.device:
        raise CheckmateError("--transport verbs needs --device (an RDMA device, e.g. rxe0)")
    if args.device and args.transport != "verbs":
        raise CheckmateError("--device only applies with --transport verbs")
    return {"transport": args.transport, "device": args.device}


def _serve_placed(args: argparse.Namespace, index: int, count: int) -> int:
    """``serve --placed``: a co-located shadow of a switch-mode job (see the module's
    docstring); its address is --bind (not 0.0.0.0: the controller finds it by it)."""
    from checkmate.shadow.node import NodeOptions
    from checkmate.train.shadow_client import parse_addr

    if not args.placed:
        raise CheckmateError("--job applies with --placed")
    missing = [f for f, v in (("--controller", args.controller), ("--job", args.job)) if not v]
    if missing:
        raise CheckmateError(f"--placed needs {' and '.join(missing)}")
    if args.config or args.host or args.no_register or args.epoch or args.token:
        raise CheckmateError("--placed takes its session from the controller: not with "
                             "--config, --host, --no-register or --epoch/--token")
    if args.bind == "0.0.0.0":
        raise CheckmateError("--placed needs --bind IP: the controller knows the shadow by "
                             "its address")
    opts = NodeOptions(
        partition=index, partitions=count, job=args.job, bind=args.bind, port=args.port,
        restore_bind=args.restore_bind or args.bind, restore_port=args.restore_port,
        dir=args.dir, persist_every=args.persist_every, persist_seconds=args.persist_seconds,
        keep=max(args.keep, 1), retain=max(args.retain, 1), window=max(args.window, 1),
        gap_timeout=args.gap_timeout,
        controller=parse_addr(args.controller, cfgmod.CONTROLLER_PORT), ip=args.bind,
        placed=True, **_transport(args),
    )
    return _run_node(args, opts)


def _serve_without_config(args: argparse.Namespace, index: int, count: int) -> int:
    """``serve`` on defaults: no registration, the job id taken from the seed."""
    from checkmate.shadow.node import NodeOptions
    from checkmate.shadow.state import ANY_JOB

    if args.host:
        raise CheckmateError("--host names a host of the config: give --config too")
    if args.controller and not args.no_register:
        raise CheckmateError("registering with a controller needs --config (this shadow's "
                             "address and MAC come from it); use --no-register or --config")
    if (args.epoch or args.token) and not args.no_register:
        raise CheckmateError("--epoch/--token only apply with --no-register")
    opts = NodeOptions(
        partition=index, partitions=count, job=ANY_JOB, bind=args.bind, port=args.port,
        restore_bind=args.restore_bind or args.bind, restore_port=args.restore_port,
        dir=args.dir, persist_every=args.persist_every, persist_seconds=args.persist_seconds,
        keep=max(args.keep, 1), retain=max(args.retain, 1), window=max(args.window, 1),
        gap_timeout=args.gap_timeout, epoch=args.epoch, token=args.token, controller=None,
        **_transport(args),
    )
    return _run_node(args, opts)


def _run_node(args: argparse.Namespace, opts: NodeOptions) -> int:
    """Start the node, serve until SIGTERM/SIGINT, stop it."""
    from checkmate.metrics_port import port_from_env
    from checkmate.protocol import auth
    from checkmate.shadow.node import ShadowNode

    opts.secret = auth.load_secret(args.secret_file)  # before anything binds: one clear line

    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s shadow[%(threadName)s] %(levelname)s %(message)s")
    mport = port_from_env(args.metrics_port)
    if mport is not None:  # prometheus-client (the [metrics] extra) only when metrics are on
        from checkmate import metrics
    node = ShadowNode(opts).start()
    exporter = None
    if mport is not None:
        try:
            exporter = metrics.serve(metrics.ShadowCollector(node.status), mport, opts.bind)
        except CheckmateError:
            node.stop()
            raise
        node.metrics = exporter  # status shows whether it still serves
        print(f"shadow: metrics on http://{opts.bind}:{exporter.port}/metrics", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    fatal: list[str] = []

    def on_fatal(why: str) -> None:  # a receive thread that gave up: never up but deaf
        fatal.append(why)
        stop.set()

    node.receiver.on_fatal = on_fatal
    index, count = opts.partition, opts.partitions
    group = "" if opts.control_partition is None else \
        f" of group {opts.control_partition // count} (job {opts.job:#x})"
    print(f"shadow: partition {index}/{count}{group} serving udp {opts.bind}:{node.udp_port} "
          f"tcp {opts.restore_bind}:{node.tcp_port}", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        node.stop()
        if exporter is not None:
            exporter.close()
    if fatal:
        raise CheckmateError(f"shadow partition {index}: {fatal[0]}")
    return 0


def _addrs(args: argparse.Namespace, cfg: cfgmod.ClusterConfig) -> list[tuple[str, int]]:
    from checkmate.train.shadow_client import addrs_from_config, parse_addr

    if args.addr:
        return [parse_addr(a) for a in args.addr]
    addrs = addrs_from_config(cfg)
    if not addrs:
        raise CheckmateError("the config lists no shadows")
    return addrs


def _restore(args: argparse.Namespace) -> int:
    cfg = cfgmod.load(args.config)
    if args.from_disk:
        from checkmate.shadow.checkpoint_load import load_full_state

        full = load_full_state(args.from_disk)
        spec, iteration = full.spec, full.iteration
        buffers = spec.decode_buffers(full.buffers)
        model_sd, optim_sd = spec.state_dicts(full.slots, full.step, buffers, full.lrs)
        extra = full.extra
    else:
        from checkmate.train.shadow_client import restore_state_dicts

        model_sd, optim_sd, iteration, buffers, extra = restore_state_dicts(
            _addrs(args, cfg), timeout=args.timeout)
    print(f"consistent point: iteration {iteration}")
    if args.out:
        import torch

        state = {"model": model_sd, "optim": optim_sd, "iteration": iteration,
                 "buffers": buffers, "extra": extra}
        try:
            torch.save(state, args.out)
        except OSError as e:
            raise CheckmateError(f"cannot write {args.out}: {e.strerror or e}") from None
        print(f"wrote {args.out}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from checkmate.train.shadow_client import ShadowClient

    cfg = cfgmod.load(args.config)
    out = []
    for a in _addrs(args, cfg):
        with ShadowClient(a, 10.0) as c:
            out.append(c.request({"op": "status", "commit_times": args.commit_times})[0])
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0


def _export(args: argparse.Namespace) -> int:
    from checkmate.shadow.export import export

    out = export(args.dirs, args.out, args.iteration,
                 on_skip=lambda text: print(f"shadow: {text}", file=sys.stderr))
    info = json.loads((out / "checkmate.json").read_text())
    parts = info["partitions"]
    what = (f"{parts} partitions" if isinstance(parts, int) else
            f"{len(parts)} data-parallel groups ({sum(parts)} partitions)")
    print(f"exported iteration {info['iteration']} of {what} to {out} (load it with "
          "torch.distributed.checkpoint.load)")
    return 0


if __name__ == "__main__":
    from checkmate import fastexit

    fastexit.install()
    sys.exit(main())
