"""What ``checkmate launch`` does with its arguments (checkmate.launch.options): start or
find the shadows, put the job's addresses in the workers' environment, and run the workers
through torch's elastic agent, restarting the group after a failure.

It starts ``n`` shadows on loopback (or checks the ones ``--shadow`` names, or finds them
through ``--controller``), puts the job's addresses in the environment
(checkmate.train.env), and runs N workers of SCRIPT through torch's elastic agent
(torch.distributed.launcher.api), exactly as ``torchrun --standalone`` would (or as one
node of a job whose nodes meet at ``--rdzv-endpoint``). When a worker dies the agent stops
the group and starts it again, up to R times; the new workers see
TORCHELASTIC_RESTART_COUNT > 0 and ``CheckmateSession.from_env`` restores them from the
shadows (in GoCkpt mode: from the newest checkpoint under DIR/gockpt, written by a local
process per rank; no shadows). Shadows started here are stopped by PID at exit, also on
Ctrl-C, an error, or a SIGKILL of the launcher (parent-death signal). See docs/usage.md.

GPUs: with CUDA devices visible (``--device auto``, the default, or ``cuda``) N defaults to
their number (checkmate.launch.placement), and each worker is bound to the device of its
LOCAL_RANK before the script runs (checkmate.train.run_script); ``from_env`` then puts the
job's collectives on NCCL and Checkmate's own small messages on a gloo group beside it.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from checkmate.errors import CheckmateError
from checkmate.launch import master_port, placement
from checkmate.launch.forked_workers import START_METHOD
from checkmate.launch.local_shadows import (
    LocalShadows,
    check_shadows,
    node_worker_addrs,
    pick_loopback_net,
    shadows_latest,
    trainer_addrs,
)
from checkmate.launch.options import (
    PROG,
    colocated,
    controller_addr,
    format_cores,
    gockpt_dir,
    loopback,
    multinode,
    nodes,
    parse,
    rdzv_addr,
)
from checkmate.protocol.auth import SECRET_ENV
from checkmate.train import check_schedule, failures
from checkmate.train import env as envmod
from checkmate.train.shadow_client import parse_addr

#: Seconds a multi-node job's ring waits for a silent peer before the worker fails and its
#: agent re-runs the rendezvous (a lost node); a single node's agent notices by itself.
MULTINODE_STALL = 15
#: Seconds ``--controller`` waits for a shadow to be registered for every partition (shadows
#: started at the same time as the launcher register within seconds; under load, tens).
REGISTER_WAIT = 120.0


def _quiet_agent() -> None:
    """torch's agent logs its restarts at INFO, below its default level: show those as one
    line of ours, keep its warnings, drop the rest of its INFO chatter."""
    import torch.distributed.elastic.agent.server.api as agent_api  # sets its level on import

    agent_log = logging.getLogger(agent_api.__name__)
    agent_log.setLevel(logging.INFO)
    if any(getattr(f, "checkmate", False) for f in agent_log.filters):
        return  # a second launch in this process (tests)

    def only_restarts(rec: logging.LogRecord) -> bool:
        if rec.levelno >= logging.WARNING:
            return True
        msg = rec.getMessage()
        if "will restart worker group" in msg and "new nodes" in msg:
            print(f"{PROG}: a node joined the rendezvous; restarting the worker group with "
                  "it; it resumes from its checkpoints", flush=True)
        elif "will restart worker group" in msg:
            from checkmate.launch.restart_line import restart_line

            print(restart_line(msg, PROG), flush=True)
        return False

    only_restarts.checkmate = True  # type: ignore[attr-defined]
    agent_log.addFilter(only_restarts)
    # A worker that died is logged with the agent's own traceback (where it noticed, not
    # why the worker died): its line stays, the traceback goes (the failure's line is ours).
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_no_trace)


def _no_trace(rec: logging.LogRecord) -> bool:
    rec.exc_info, rec.exc_text = None, None
    return True


#: torch's C++ log level, read once when its library loads in a process
CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"
_quieted: list[bool] = []  # the launcher set it (not the user)


def _quiet_cpp_logs() -> None:
    """This process's torch logs nothing below FATAL from C++: a store connection that
    fails (a node the rendezvous host cannot reach) printed its whole C++ stack, some 40
    lines, before the exception the launcher turns into one line. Set before torch loads
    here (unless the user set it), and taken out of what the workers inherit
    (``_worker_env``): their torch keeps its default."""
    if CPP_LOG_LEVEL not in os.environ and "torch" not in sys.modules:
        os.environ[CPP_LOG_LEVEL] = "FATAL"
        _quieted.append(True)
        import torch  # noqa: F401 - loads the C++ library under the quiet level


def _worker_env(args: argparse.Namespace, job_id: int, trainers: list, tcp: list,
                logdir: Path | None = None, udp: list | None = None) -> None:
    """The variables every worker inherits (checkmate.train.env, and where workers record
    why they failed: checkmate.train.failures)."""
    from checkmate.train import world

    if _quieted:
        os.environ.pop(CPP_LOG_LEVEL, None)  # the launcher's own, not the workers'
        _quieted.clear()
    if logdir is not None:
        os.environ[failures.LOG_DIR] = str(Path(logdir).resolve())
    os.environ[world.FIXED_WORLD] = "1" if args.fixed_world else "0"
    os.environ.update({
        envmod.JOB_ID: str(job_id), envmod.MODE: args.mode, envmod.DEVICE: args.device,
        envmod.SEED: str(args.seed), envmod.PROGRESS_EVERY: str(args.progress_every),
        envmod.RESUME: "1" if args.resume or args.resume_at is not None else "0",
        envmod.GROUPS: str(args.pp * args.tp),
        envmod.REPLICAS: str(args.replicas),
        envmod.VERIFY_EVERY: check_schedule.describe(args.verify_every),
        envmod.ON_DIVERGENCE: args.on_divergence,
        "PYTHONUNBUFFERED": "1",
    })
    for name in (envmod.TRAINERS, envmod.LOCAL_TRAINERS, envmod.RDZV_STORE,
                 envmod.CONTROLLER, envmod.RESUME_AT, envmod.SHADOWS_FILE, envmod.PLACED):
        os.environ.pop(name, None)
    if args.colocate is not None and args.mode == "switch":
        os.environ[envmod.PLACED] = "1"  # each attempt tells the controller where they run
    if args.resume_at is not None:
        os.environ[envmod.RESUME_AT] = str(args.resume_at)
    if multinode(args):  # ranks come from the rendezvous: the workers exchange addresses
        os.environ[envmod.LOCAL_TRAINERS] = envmod.format_addrs(trainers)
        os.environ[envmod.RDZV_STORE] = envmod.format_addrs([rdzv_addr(args)])
        os.environ.setdefault(envmod.STALL_TIMEOUT, str(MULTINODE_STALL))
    else:
        os.environ[envmod.TRAINERS] = envmod.format_addrs(trainers)
    if args.controller:
        os.environ[envmod.CONTROLLER] = envmod.format_addrs([controller_addr(args)])
    if tcp:
        os.environ[envmod.SHADOWS] = envmod.format_addrs(tcp)
        if udp:
            os.environ[envmod.SHADOWS_UDP] = envmod.format_addrs(udp)
        else:
            os.environ.pop(envmod.SHADOWS_UDP, None)
    if args.mode == "gockpt":
        os.environ[envmod.GOCKPT] = f"{gockpt_dir(args)},{args.gockpt}"
    if all(loopback(h) for h, _ in trainers):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every address is on loopback
    if args.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does


def _job_secret(running_shadows: bool, logdir: Path) -> Path | None:
    """Make every shadow and worker share the job secret (checkmate.protocol.auth): the one
    $CHECKMATE_SECRET_FILE names, else a new one in the log dir for the local shadows
    (returned: the launcher removes it when the job ends)."""
    from checkmate.protocol import auth

    if os.environ.get(auth.SECRET_ENV):
        auth.load_secret()  # a bad file is one line now, not a failure in every worker
        return None
    if running_shadows:
        raise CheckmateError(f"shadows on several machines (--shadow, --colocate) share one "
                             f"job secret: set {auth.SECRET_ENV} to its file on every node")
    path = auth.create_secret(logdir / "job.key")
    os.environ[auth.SECRET_ENV] = str(path)
    return path


def _failure_line(err: Any, restarts: int, logdir: Path | None = None) -> str:
    from checkmate.train.failures import first_failure

    failed = getattr(err, "failures", {})
    first = first_failure(logdir, restarts, failed) if logdir is not None else None
    if first is not None:  # the rank that set the others off, and why
        others = sorted(r for r in failed if r != first[0])
        also = f"; then rank(s) {', '.join(map(str, others))}" if others else ""
        return (f"the trainers failed after {restarts} restart(s): rank {first[0]} "
                f"({first[1]}) failed first{also}")
    parts = []
    for rank, f in sorted(getattr(err, "failures", {}).items()):
        code = f.exitcode
        why = (f"signal {signal.Signals(-code).name}" if code < 0 and -code in
               signal.valid_signals() else f"exit code {code}")
        parts.append(f"rank {rank} ({why})")
    return (f"the trainers failed after {restarts} restart(s): "
            f"{', '.join(parts) or 'see the output above'}")


def shadows_from_controller(args: argparse.Namespace, job_id: int, wait: float | None = None,
                            groups: int = 1) -> tuple[list, list]:
    """The shadows the controller has registered for ``job_id``: TCP service and UDP
    addresses in partition order. Shadows started beside the launcher may not have
    registered yet: it asks again every second, up to ``wait`` seconds (REGISTER_WAIT),
    for a shadow for every partition of the controller's config, saying once what it
    waits for; then one line that names the partitions still missing. The controller's
    config must cut its shadows into as many data-parallel groups (``job.groups``) as this
    launch has (--pp x --tp, ``groups``): each group's ring goes to its own set."""
    from checkmate.config.cluster import RESTORE_PORT
    from checkmate.train.layout import query_registrations

    wait = REGISTER_WAIT if wait is None else wait
    deadline, said = time.monotonic() + wait, False
    while True:
        regs, expected, told = query_registrations(controller_addr(args), job_id, timeout=5.0)
        if told != groups:
            raise CheckmateError(
                f"the controller's config has {told} data-parallel group(s) (job.groups), "
                f"this launch {groups} (--pp {args.pp} --tp {args.tp}): set job.groups to "
                f"{groups} and give each group its shadows")
        missing = sorted(set(range(expected)) - set(regs))
        extra = sorted(set(regs) - set(range(expected)))
        if extra:  # a controller that contradicts itself: no layout can be trusted
            raise CheckmateError(
                f"the controller has registered shadows for partitions {extra} of job "
                f"{job_id}, beyond the {expected} partition(s) of its config")
        if regs and not missing:
            break
        if time.monotonic() >= deadline:
            raise CheckmateError(
                f"the controller has registered shadows for partitions {sorted(regs)} of "
                f"job {job_id}; its config has {expected} partition(s) and every one needs a "
                f"shadow (waited {wait:.0f}s)")
        if not said:
            print(f"{PROG}: waiting up to {wait:.0f}s for the controller to register shadows "
                  f"for partition(s) {missing} of job {job_id}", flush=True)
            said = True
        time.sleep(1.0)
    tcp = [(regs[p]["ip"], RESTORE_PORT) for p in range(len(regs))]
    udp = [(regs[p]["ip"], int(regs[p]["port"])) for p in range(len(regs))]
    return tcp, udp


def _best_replica(per_shadow: list[int | None], replicas: int) -> list[int | None]:
    """Per partition the newest of its replicas' values (``per_shadow``: whole sets one
    after the other); None where no replica has one."""
    n = len(per_shadow) // replicas
    out: list[int | None] = []
    for p in range(n):
        got = [x for x in per_shadow[p::n] if x is not None]
        out.append(max(got) if got else None)
    return out


def launch_config(args: argparse.Namespace, logdir: Path, colo: Any = None) -> Any:
    """torch's LaunchConfig for this node: torchrun --standalone, or one node of a job
    whose nodes meet at --rdzv-endpoint (torchrun's flags, torchrun's meanings); with
    ``colo`` (--colocate) the rendezvous places the shadows after each round."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
    from torch.distributed.launcher.api import LaunchConfig

    common = {"nproc_per_node": args.nproc_per_node, "max_restarts": args.max_restarts,
              "start_method": START_METHOD,
              # the agent's per-attempt files go with the job's logs (torch's default is
              # a /tmp/torchelastic_* directory nobody removes)
              "logs_specs": DefaultLogsSpecs(log_dir=str(logdir / "elastic"))}
    backend = "c10d" if not multinode(args) else args.rdzv_backend
    if colo is not None:
        from checkmate.launch import colocation

        backend = colocation.use(colo, backend)
    if not multinode(args):
        return LaunchConfig(min_nodes=1, max_nodes=1, run_id=str(uuid.uuid4()),
                            rdzv_backend=backend, rdzv_endpoint="localhost:0",
                            monitor_interval=0.1, local_addr="127.0.0.1", **common)
    lo, hi = nodes(args)
    try:
        conf = _parse_rendezvous_config(args.rdzv_conf)
    except ValueError as e:
        raise CheckmateError(f"--rdzv-conf: {e}") from None
    if args.rdzv_backend == "static":
        conf["rank"] = args.node_rank
    host, port = rdzv_addr(args)
    local = args.local_addr or ("127.0.0.1" if loopback(host) else None)
    return LaunchConfig(min_nodes=lo, max_nodes=hi, run_id=args.rdzv_id,
                        rdzv_backend=backend, rdzv_endpoint=f"{host}:{port}",
                        rdzv_configs=conf, monitor_interval=0.5, local_addr=local, **common)


def _run_agent(args: argparse.Namespace, logdir: Path, colo: Any = None) -> None:
    from torch.distributed.launcher.api import elastic_launch

    # A restarted group must not meet the previous attempt's keys: with the agent's shared
    # TCPStore (torch's default) gloo reads the dead workers' addresses and is refused. Off,
    # rank 0 of each attempt hosts a fresh store.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    master_port.use()  # rank 0's store port: one no ephemeral socket takes meanwhile
    cfg = launch_config(args, logdir, colo)
    if args.worker_start == "exec":
        elastic_launch(cfg, sys.executable)("-u", "-m", "checkmate.train.run_script",
                                            args.script, *args.args)
        return
    from checkmate.launch.forked_workers import use_fork_server
    from checkmate.train import run_script

    use_fork_server()
    elastic_launch(cfg, run_script.worker)(args.script, *args.args)


def _rendezvous_line(args: argparse.Namespace, err: Exception) -> str:
    """One line for a rendezvous that failed (torch's RendezvousError family)."""
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousTimeoutError,
    )

    where = (f"the rendezvous at {args.rdzv_endpoint} (id {args.rdzv_id})"
             if multinode(args) else "the local rendezvous")
    if isinstance(err, RendezvousTimeoutError):
        why = (f"did not complete in time: fewer than {nodes(args)[0]} node(s) joined, or the "
               "job ended or lost its rendezvous store while this node waited")
    elif isinstance(err, RendezvousClosedError):
        why = "is closed: the job has ended or given up"
    else:
        why = f"failed: {type(err).__name__}: {' '.join(str(err).split())[:200]}"
    return f"{where} {why}"


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def launch(argv: list[str]) -> int:
    """``checkmate launch ARGS``: run the job; 0 when it ended well, 130 when stopped by a
    signal. Bad arguments and failures raise one CheckmateError line."""
    _quiet_cpp_logs()
    args = parse(argv, placement.cuda_device_count())
    if args.colocate is not None:  # the node's address is in the list: its workers' too
        ips, _ = colocated(args)
        if args.node in ips:
            if args.worker_ip and args.worker_ip[0] != ips[args.node]:
                raise CheckmateError(f"--worker-ip {args.worker_ip[0]} is not {args.node}'s "
                                     f"address in --colocate ({ips[args.node]})")
            args.worker_ip = [ips[args.node]]
        elif not args.worker_ip:
            raise CheckmateError(f"{args.node} is not in --colocate (it hosts no shadow): "
                                 "give its --worker-ip")
        if args.node in ips and args.mode == "switch":
            from checkmate.launch.hostcheck import refuse_dropped_copies

            refuse_dropped_copies(args.node, ips[args.node])
    if multinode(args):  # would torch's rendezvous find this node? (before it runs)
        from checkmate.launch.hostcheck import refuse

        refuse(rdzv_addr(args)[0], nodes(args)[1], args.rdzv_backend, args.local_addr,
               args.rdzv_conf, args.worker_ip)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    groups = args.pp * args.tp  # data-parallel groups, each with its own shadows
    count = 0 if args.mode in ("off", "gockpt") else (len(args.shadow)
                                                      or (args.shadows or 2) * groups
                                                      * args.replicas)
    if count % groups:
        raise CheckmateError(f"--shadow names {count} shadows for {groups} data-parallel "
                             f"groups (--pp {args.pp} --tp {args.tp}): give each group as many")
    colo = None  # --colocate: the shadows, placed on the job's nodes at every rendezvous
    if args.colocate is not None:
        from checkmate.launch import shadow_placement

        ips, domains = colocated(args)
        # all of them could not hold the replicas: one line now, before any rendezvous
        shadow_placement.place(list(ips), count // args.replicas, args.replicas, domains)
    running = bool(args.shadow or args.controller)
    # Without --dir the logs go to a temporary directory, kept only if the job fails.
    own_logdir = args.dir is None
    logdir = args.dir or Path(tempfile.mkdtemp(prefix="checkmate-launch-"))
    # what an earlier launch in the same --dir left for its own attempts (failure lines,
    # rewinds, a stop) is not this launch's
    shutil.rmtree(Path(logdir) / "failures", ignore_errors=True)
    made_secret: Path | None = None
    succeeded = False
    if args.worker_ip:
        net = args.worker_ip[0]
        trainers = node_worker_addrs(net, args.nproc_per_node)
    else:
        net = pick_loopback_net(args.nproc_per_node, 0 if running else count)
        trainers = trainer_addrs(net, args.nproc_per_node)
    udp: list = []
    local: LocalShadows | None = None
    # SIGTERM before the agent runs must unwind through `finally` too (the agent installs
    # its own handlers while it runs).
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        if count:  # shadows on several nodes share one secret: the one the user gives
            made_secret = _job_secret(running or args.colocate is not None, logdir)
        if args.controller and count and args.colocate is None:
            job_id = args.job_id or 1
            tcp, udp = shadows_from_controller(args, job_id, groups=groups)
            check_shadows(tcp, groups)
            print(f"{PROG}: {len(tcp)} shadow(s) registered with the controller "
                  f"{args.controller}: {', '.join(f'{h}:{p}' for h, p in tcp)}", flush=True)
        elif args.shadow:
            tcp = [parse_addr(a) for a in args.shadow]
            job_id = args.job_id or check_shadows(tcp, groups) or 1
            print(f"{PROG}: {count} running shadow(s): "
                  f"{', '.join(f'{h}:{p}' for h, p in tcp)}", flush=True)
        elif args.colocate is not None:  # started in each rendezvous round
            from checkmate.launch.colocation import Colocation

            job_id = args.job_id or 1
            # switch mode: each attempt tells the controller where the round placed them
            placed_by = (controller_addr(args), job_id) if args.mode == "switch" else None

            def make(addrs: list, mine: list[int]) -> LocalShadows:
                shadows = LocalShadows(net, count, logdir, args.dir / "checkpoints"
                                       if args.persist_every else None, args.persist_every,
                                       groups, args.replicas, args.shadow_cores, addrs, mine,
                                       placed_by)
                shadows.supervise(args.shadow_restarts)
                return shadows

            colo = Colocation(args.node, ips, domains, count // args.replicas, args.replicas,
                              make, Path(logdir) / "shadows.json")
            tcp = []
        elif count:
            local = LocalShadows(net, count, logdir,
                                 args.dir / "checkpoints" if args.persist_every else None,
                                 args.persist_every, groups, args.replicas,
                                 args.shadow_cores)
            kept = ", kept if the job fails" if own_logdir else ""
            per = f" ({count // groups} per data-parallel group)" if groups > 1 else ""
            if args.replicas > 1:
                per = (f" ({args.replicas} replicas of each of {count // args.replicas} "
                       "partitions)")
            pinned = ("" if args.shadow_cores is None else
                      f", pinned to core(s) {format_cores(args.shadow_cores)}")
            print(f"{PROG}: starting {count} shadow(s){per} on {net}.100+{pinned} (logs: "
                  f"{logdir}{kept})", flush=True)
            local.start()
            local.supervise(args.shadow_restarts)  # one that exits is started again
            tcp, job_id = local.tcp, args.job_id or 1
        else:
            tcp, job_id = [], args.job_id or 1
        _worker_env(args, job_id, trainers, tcp, Path(logdir), udp)
        on = f", on {args.gpus_used} GPU(s)" if args.device == "cuda" else ""
        where = (f"{net} ports {trainers[0][1]}+" if args.worker_ip else f"{net}.10+")
        job = ""
        if multinode(args):
            host, port = rdzv_addr(args)
            job = (f", one node of {args.nnodes} ({args.rdzv_backend} rendezvous at "
                   f"{host}:{port}, id {args.rdzv_id})")
        print(f"{PROG}: {args.nproc_per_node} trainer(s) on {where}{on}, mode {args.mode}, "
              f"max {args.max_restarts} restart(s){job}", flush=True)
        _quiet_agent()
        try:
            _run_agent(args, Path(logdir), colo)
            stopped = failures.stopped(logdir)
            if stopped is not None:
                raise CheckmateError(f"the job stopped after a divergence of the "
                                     f"data-parallel copies: {stopped}")
        except ChildFailedError as e:
            stopped = failures.stopped(logdir)  # --max-restarts 0: no attempt to end clean
            if stopped is not None:
                raise CheckmateError(f"the job stopped after a divergence of the "
                                     f"data-parallel copies: {stopped}") from None
            raise CheckmateError(_failure_line(e, args.max_restarts, Path(logdir))) from None
        except RendezvousError as e:
            raise CheckmateError(_rendezvous_line(args, e)) from None
        except SignalException as e:
            print(f"{PROG}: stopped by {e.sigval.name}", file=sys.stderr)
            return 130
        if args.mode == "gockpt":
            from checkmate.shadow.checkpoint_load import newest_common

            print(f"{PROG}: done; the newest GoCkpt checkpoint is of iteration "
                  f"{newest_common(gockpt_dir(args), args.nproc_per_node)} (under "
                  f"{gockpt_dir(args)})", flush=True)
        if colo is not None:
            tcp = colo.tcp  # as the last round placed them
        if tcp:
            per_shadow, verified = shadows_latest(tcp)
            latest = per_shadow
            if args.replicas > 1:  # per partition its best replica (a dead one holds None)
                latest, verified = _best_replica(latest, args.replicas), \
                    _best_replica(verified, args.replicas)
            held = min(latest) if None not in latest else None
            checked = min(verified) if None not in verified else None
            said = ("; their state equals the trainers' there (checked)" if checked == held
                    and held is not None else f"; checked against the trainers' up to "
                    f"iteration {checked}" if checked is not None else "")
            print(f"{PROG}: done; the shadows hold iteration {held} (per shadow: "
                  f"{per_shadow})"
                  f"{said}", flush=True)
        succeeded = True
        return 0
    finally:
        if local is not None:
            local.stop()
        if colo is not None:
            colo.stop()
        if made_secret is not None:  # this job's secret dies with the job
            made_secret.unlink(missing_ok=True)
            os.environ.pop(SECRET_ENV, None)
        if own_logdir and (succeeded or not any(logdir.iterdir())):
            shutil.rmtree(logdir, ignore_errors=True)
        signal.signal(signal.SIGTERM, old_term)
