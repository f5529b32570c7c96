"""``checkmate launch``: torchrun for a Checkmate job on one machine.

    checkmate launch [--nproc-per-node N] [--device auto|cuda|cpu]
                     [--shadows n | --shadow ADDR ...] [--mode host|off|gockpt]
                     [--gockpt EVERY,STEPS] [--max-restarts R]
                     [--dir DIR] [--persist-every K] [--resume] [--progress-every K]
                     [--seed S] [--job-id J] SCRIPT [ARGS ...]

It starts ``n`` shadows on loopback (or checks the ones ``--shadow`` names), puts the job's
addresses in the environment (checkmate.train.env), and runs N workers of SCRIPT through
torch's elastic agent (torch.distributed.launcher.api), exactly as ``torchrun --standalone``
would. When a worker dies the agent stops the group and starts it again, up to R times;
the new workers see TORCHELASTIC_RESTART_COUNT > 0 and ``CheckmateSession.from_env``
restores them from the shadows (in GoCkpt mode: from the newest checkpoint under
DIR/gockpt, written by a local process per rank; no shadows). Shadows started here are
stopped by PID at exit, also on Ctrl-C, an error, or a SIGKILL of the launcher
(parent-death signal). See docs/usage.md.

GPUs: with CUDA devices visible (``--device auto``, the default, or ``cuda``) N defaults to
their number, and each worker is bound to the device of its LOCAL_RANK before the script
runs (checkmate.train.run_script); ``from_env`` then puts the job's collectives on NCCL and
Checkmate's own small messages on a gloo group beside it.
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

from checkmate.errors import CheckmateError, cli_guard
from checkmate.launch.local_shadows import (
    MAX_SHADOWS,
    MAX_TRAINERS,
    LocalShadows,
    check_shadows,
    node_worker_addrs,
    pick_loopback_net,
    shadows_latest,
    trainer_addrs,
)
from checkmate.protocol.auth import SECRET_ENV
from checkmate.train import env as envmod
from checkmate.train.shadow_client import parse_addr

PROG = "checkmate launch"
#: torchrun's default rendezvous port.
RDZV_PORT = 29400
#: Seconds a multi-node job's ring waits for a silent peer before the worker fails and its
#: agent re-runs the rendezvous (a lost node); a single node's agent notices by itself.
MULTINODE_STALL = 15
#: Seconds ``--controller`` waits for a shadow to be registered for every partition (shadows
#: started at the same time as the launcher register within seconds; under load, tens).
REGISTER_WAIT = 120.0


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one CheckmateError line (exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CheckmateError(message)


def _count(lo: int, hi: int) -> Any:
    def parse(s: str) -> int:
        if not s.isdigit() or not lo <= int(s) <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer {lo}..{hi}, got {s!r}")
        return int(s)
    return parse


def cuda_device_count() -> int:
    """CUDA devices this process sees (torch.cuda.device_count(); 0 without CUDA). Tests
    replace this function to play a machine with GPUs."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _parser(gpus: int) -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Run a training script on N local workers with "
                "Checkmate shadows and automatic restart (torchrun --standalone style).")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=_count(1, MAX_TRAINERS),
                   required=not gpus,
                   default=gpus or None, metavar="N",
                   help="trainer processes (ranks); default with CUDA devices: one per "
                        f"device ({gpus} here)" if gpus else "trainer processes (ranks)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda: bind each worker to the GPU of its LOCAL_RANK (NCCL for the "
                        "job, gloo beside it for Checkmate); cpu: no GPU; auto (default): "
                        "cuda when a CUDA device is visible")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--shadows", type=_count(1, MAX_SHADOWS), metavar="n",
                   help="start n shadows on loopback (default 2; one node only)")
    g.add_argument("--shadow", action="append", default=[], metavar="HOST[:PORT]",
                   help="use a running shadow (TCP service address, default port 47100; "
                        "UDP on 47001 of the same host), once per partition, in order")
    p.add_argument("--mode", choices=envmod.ENV_MODES, default="host",
                   help="host: trainers send the shadow copies; switch: the switch copies "
                        "them (needs --controller); off: no shadows; gockpt: no shadows, "
                        "periodic GoCkpt checkpoints under --dir (see --gockpt)")
    p.add_argument("--gockpt", default="50,4", metavar="EVERY,STEPS",
                   help="GoCkpt mode: a checkpoint every EVERY iterations, its transfer "
                        "spread over STEPS steps (default 50,4)")
    p.add_argument("--max-restarts", "--max_restarts", type=_count(0, 1000), default=0,
                   metavar="R", help="restarts of the worker group after a failure "
                   "(default 0; several nodes: failures of the job, as torchrun counts them)")
    # torchrun's multi-node flags, with torchrun's meanings (torch.distributed.run)
    p.add_argument("--nnodes", default="1", metavar="MIN[:MAX]",
                   help="nodes of the job, or the range an elastic job may run on "
                        "(default 1: this machine only)")
    p.add_argument("--node-rank", "--node_rank", type=_count(0, 10**6), default=0,
                   metavar="K", help="this node's rank: static rendezvous only (c10d "
                   "assigns the ranks, as torchrun)")
    p.add_argument("--rdzv-backend", "--rdzv_backend", choices=("c10d", "static"),
                   default="c10d", help="rendezvous backend (default c10d)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="", metavar="HOST[:PORT]",
                   help="the rendezvous store's address, the same on every node (port "
                        f"default {RDZV_PORT})")
    p.add_argument("--rdzv-id", "--rdzv_id", default="none", metavar="ID",
                   help="the job's id in the rendezvous, the same on every node")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="", metavar="K=V,...",
                   help="rendezvous options (torchrun's: join_timeout, last_call_timeout, "
                        "close_timeout, ...)")
    p.add_argument("--standalone", action="store_true",
                   help="one node with a rendezvous of its own (what no --rdzv-endpoint "
                        "means anyway)")
    p.add_argument("--local-addr", "--local_addr", default=None, metavar="ADDR",
                   help="this node's address for the rendezvous (torchrun's)")
    p.add_argument("--worker-ip", action="append", default=[], metavar="IP",
                   help="several nodes: the IP of this node whose ckm ports its workers "
                        "use (each worker takes its own ports on it); default with a "
                        "loopback --rdzv-endpoint: a loopback address per worker")
    p.add_argument("--controller", default=None, metavar="HOST[:PORT]",
                   help="the controller's handshake address: the shadows are found "
                        "through it, and (--mode switch) it programs the switch for "
                        "every rendezvous")
    p.add_argument("--dir", type=Path, metavar="DIR",
                   help="shadow logs and (with --persist-every) checkpoints (default: a "
                        "temporary folder for the logs, no checkpoints on disk)")
    p.add_argument("--persist-every", type=_count(0, 10**9), default=0, metavar="K",
                   help="shadows write a DCP checkpoint under DIR every K iterations")
    p.add_argument("--resume", action="store_true",
                   help="the first attempt resumes from the shadows too (--shadow, or "
                        "shadows that load --dir's checkpoints)")
    p.add_argument("--fixed-world", action="store_true",
                   help="refuse to resume the job on another number of ranks than it ran on "
                        "(default: allowed, announced in one line on every rank)")
    p.add_argument("--progress-every", type=_count(0, 10**9), default=10, metavar="K",
                   help="rank 0 prints iteration, loss and protection every K iterations "
                        "(CheckmateSession.report; 0: never)")
    p.add_argument("--seed", type=_count(0, 2**63 - 1), default=0,
                   help="seed of the per-iteration RNG reseeding")
    p.add_argument("--job-id", type=_count(1, 2**32 - 1), default=None,
                   help="ckm job id (default: the --shadow shadows' job, else 1)")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


def resolve_device(args: argparse.Namespace, gpus: int) -> str:
    """The workers' device kind (``cuda`` or ``cpu``) for ``--device`` on a machine with
    ``gpus`` CUDA devices; one line if cuda is asked for and there is none."""
    if args.device == "cuda" and not gpus:
        raise CheckmateError("--device cuda but no CUDA device is visible")
    return "cuda" if args.device == "cuda" or (args.device == "auto" and gpus) else "cpu"


def nodes(args: argparse.Namespace) -> tuple[int, int]:
    """``--nnodes MIN[:MAX]`` as torchrun reads it; one line when it is not that."""
    lo, sep, hi = args.nnodes.partition(":")
    hi = hi if sep else lo
    if not (lo.isdigit() and hi.isdigit() and 0 < int(lo) <= int(hi)):
        raise CheckmateError(f"--nnodes must be N or MIN:MAX with 0 < MIN <= MAX, got "
                             f"{args.nnodes!r}")
    return int(lo), int(hi)


def multinode(args: argparse.Namespace) -> bool:
    """Whether this launcher is one node of a job with a rendezvous of its own (the job
    may span several nodes), as opposed to torchrun --standalone."""
    return bool(args.rdzv_endpoint) and not args.standalone


def rdzv_addr(args: argparse.Namespace) -> tuple[str, int]:
    """``--rdzv-endpoint`` as (host, port), torchrun's default port when none is given."""
    host, sep, port = args.rdzv_endpoint.rpartition(":")
    if not sep:
        host, port = args.rdzv_endpoint, str(RDZV_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CheckmateError(f"--rdzv-endpoint must be HOST[:PORT], got "
                             f"{args.rdzv_endpoint!r}")
    return host, int(port)


def _loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.")


def _check_multinode(args: argparse.Namespace) -> None:
    lo, hi = nodes(args)
    if args.standalone and (args.rdzv_endpoint or hi > 1):
        raise CheckmateError("--standalone is one node with its own rendezvous: drop "
                             "--rdzv-endpoint/--nnodes")
    if hi > 1 and not args.rdzv_endpoint:
        raise CheckmateError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST[:PORT], "
                             "the same on every node")
    if args.rdzv_backend == "static" and lo != hi:
        raise CheckmateError("the static rendezvous has a fixed number of nodes: --nnodes N")
    if args.rdzv_backend == "static" and args.node_rank >= hi:
        raise CheckmateError(f"--node-rank {args.node_rank} is not below --nnodes {hi}")
    if args.mode == "switch" and not args.controller:
        raise CheckmateError("--mode switch needs --controller HOST[:PORT]: the controller "
                             "programs the switch for every rendezvous")
    if args.controller and args.shadow:
        raise CheckmateError("give the shadows with --shadow or find them through "
                             "--controller, not both")
    if not multinode(args):
        if args.worker_ip:
            raise CheckmateError("--worker-ip is for jobs of several nodes (--rdzv-endpoint)")
        return
    if args.mode == "gockpt":
        raise CheckmateError("--mode gockpt runs on one node: its checkpoints are per rank on "
                             "local disks")
    if args.mode in ("host", "switch") and not (args.shadow or args.controller):
        raise CheckmateError("a job of several nodes needs shadows every node reaches: give "
                             "--shadow HOST[:PORT] per partition or --controller HOST[:PORT]")
    if args.worker_ip and len(args.worker_ip) != 1:
        raise CheckmateError("--worker-ip once: this node's address (its workers take "
                             "ports of their own on it)")
    if not args.worker_ip and not _loopback(rdzv_addr(args)[0]):
        raise CheckmateError("give --worker-ip IP: the address of this node the other nodes "
                             "and the shadows reach its workers at")


def _check(args: argparse.Namespace) -> None:
    _check_multinode(args)
    if args.mode == "off" and (args.shadows or args.shadow or args.resume
                               or args.controller):
        raise CheckmateError("--mode off runs without shadows: drop --shadows/--shadow/"
                             "--resume")
    if args.mode == "gockpt":
        if args.shadows or args.shadow or args.persist_every:
            raise CheckmateError("--mode gockpt runs without shadows: drop --shadows/--shadow/"
                                 "--persist-every")
        if args.dir is None:
            raise CheckmateError("--mode gockpt writes its checkpoints under --dir: give --dir")
        every, _, steps = args.gockpt.partition(",")
        if not (every.isdigit() and steps.isdigit() and 1 <= int(steps) <= int(every)):
            raise CheckmateError(f"--gockpt must be EVERY,STEPS with 1 <= STEPS <= EVERY, got "
                                 f"{args.gockpt!r}")
    if args.persist_every and args.dir is None:
        raise CheckmateError("--persist-every writes under --dir: give --dir")
    if args.persist_every and args.shadow:
        raise CheckmateError("--persist-every applies to shadows started here, not --shadow")
    if not Path(args.script).is_file():
        raise CheckmateError(f"no such script: {args.script}")
    if len(args.shadow) > MAX_SHADOWS:
        raise CheckmateError(f"at most {MAX_SHADOWS} shadows")


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


def gockpt_dir(args: argparse.Namespace) -> Path:
    """GoCkpt mode's checkpoint directory (part<rank>/ per rank, the joins beside)."""
    return (args.dir / "gockpt").resolve()


def _worker_env(args: argparse.Namespace, job_id: int, trainers: list, tcp: list,
                logdir: Path | None = None, udp: list | None = None) -> None:
    """The variables every worker inherits (checkmate.train.env, and where workers record
    why they failed: checkmate.train.failures)."""
    from checkmate.train import failures, world

    if logdir is not None:
        os.environ[failures.LOG_DIR] = str(Path(logdir).resolve())
    os.environ[world.FIXED_WORLD] = "1" if args.fixed_world else "0"
    os.environ.update({
        envmod.JOB_ID: str(job_id), envmod.MODE: args.mode, envmod.DEVICE: args.device,
        envmod.SEED: str(args.seed), envmod.PROGRESS_EVERY: str(args.progress_every),
        envmod.RESUME: "1" if args.resume else "0",
        "PYTHONUNBUFFERED": "1",
    })
    for name in (envmod.TRAINERS, envmod.LOCAL_TRAINERS, envmod.RDZV_STORE,
                 envmod.CONTROLLER):
        os.environ.pop(name, None)
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
    if all(_loopback(h) for h, _ in trainers):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every address is on loopback
    if args.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does


def _secret_command(argv: list[str]) -> int:
    """``checkmate secret new FILE``: a job secret for machines set up by hand."""
    from checkmate.protocol import auth

    if len(argv) != 2 or argv[0] != "new":
        raise CheckmateError("usage: checkmate secret new FILE")
    path = Path(argv[1])
    if path.exists():
        raise CheckmateError(f"{path} exists; a new secret goes to a new file")
    auth.create_secret(path)
    print(f"{PROG}: wrote a new job secret to {path} (mode 600); give every process of the "
          f"job {auth.SECRET_ENV}={path}")
    return 0


def _job_secret(running_shadows: bool, logdir: Path) -> Path | None:
    """Make every shadow and worker share the job secret (checkmate.protocol.auth): the one
    $CHECKMATE_SECRET_FILE names, else a new one in the log dir for the local shadows
    (returned: the launcher removes it when the job ends)."""
    from checkmate.protocol import auth

    if os.environ.get(auth.SECRET_ENV):
        auth.load_secret()  # a bad file is one line now, not a failure in every worker
        return None
    if running_shadows:
        raise CheckmateError(f"--shadow names running shadows: set {auth.SECRET_ENV} to "
                             "the job secret they were started with")
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


def controller_addr(args: argparse.Namespace) -> tuple[str, int]:
    """``--controller HOST[:PORT]`` (default port: the handshake's)."""
    from checkmate.config.cluster import CONTROLLER_PORT

    host, sep, port = args.controller.rpartition(":")
    if not sep:
        host, port = args.controller, str(CONTROLLER_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CheckmateError(f"--controller must be HOST[:PORT], got {args.controller!r}")
    return host, int(port)


def shadows_from_controller(args: argparse.Namespace, job_id: int,
                            wait: float | None = None) -> tuple[list, list]:
    """The shadows the controller has registered for ``job_id``: TCP service and UDP
    addresses in partition order. Shadows started beside the launcher may not have
    registered yet: it asks again every second, up to ``wait`` seconds (REGISTER_WAIT),
    for a shadow for every partition of the controller's config, saying once what it
    waits for; then one line that names the partitions still missing."""
    from checkmate.config.cluster import RESTORE_PORT
    from checkmate.train.layout import query_registrations

    wait = REGISTER_WAIT if wait is None else wait
    deadline, said = time.monotonic() + wait, False
    while True:
        regs, expected = query_registrations(controller_addr(args), job_id, timeout=5.0)
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


def launch_config(args: argparse.Namespace, logdir: Path) -> Any:
    """torch's LaunchConfig for this node: torchrun --standalone, or one node of a job
    whose nodes meet at --rdzv-endpoint (torchrun's flags, torchrun's meanings)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
    from torch.distributed.launcher.api import LaunchConfig

    common = {"nproc_per_node": args.nproc_per_node, "max_restarts": args.max_restarts,
              # the agent's per-attempt files go with the job's logs (torch's default is
              # a /tmp/torchelastic_* directory nobody removes)
              "logs_specs": DefaultLogsSpecs(log_dir=str(logdir / "elastic"))}
    if not multinode(args):
        return LaunchConfig(min_nodes=1, max_nodes=1, run_id=str(uuid.uuid4()),
                            rdzv_backend="c10d", rdzv_endpoint="localhost:0",
                            monitor_interval=0.1, local_addr="127.0.0.1", **common)
    lo, hi = nodes(args)
    try:
        conf = _parse_rendezvous_config(args.rdzv_conf)
    except ValueError as e:
        raise CheckmateError(f"--rdzv-conf: {e}") from None
    if args.rdzv_backend == "static":
        conf["rank"] = args.node_rank
    host, port = rdzv_addr(args)
    local = args.local_addr or ("127.0.0.1" if _loopback(host) else None)
    return LaunchConfig(min_nodes=lo, max_nodes=hi, run_id=args.rdzv_id,
                        rdzv_backend=args.rdzv_backend, rdzv_endpoint=f"{host}:{port}",
                        rdzv_configs=conf, monitor_interval=0.5, local_addr=local, **common)


def _run_agent(args: argparse.Namespace, logdir: Path) -> None:
    from torch.distributed.launcher.api import elastic_launch

    # A restarted group must not meet the previous attempt's keys: with the agent's shared
    # TCPStore (torch's default) gloo reads the dead workers' addresses and is refused. Off,
    # rank 0 of each attempt hosts a fresh store.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cfg = launch_config(args, logdir)
    elastic_launch(cfg, sys.executable)("-u", "-m", "checkmate.train.run_script",
                                        args.script, *args.args)


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


@cli_guard(PROG)
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # `checkmate launch ...` (the console script is `checkmate`)
        argv = argv[1:]
    elif argv[:1] == ["secret"]:
        return _secret_command(argv[1:])
    elif argv[:1] == ["plan"]:
        from checkmate.launch import plan

        return plan.main(argv[1:])
    elif argv[:1] == ["doctor"]:
        from checkmate.launch import doctor

        return doctor.main(argv[1:])
    elif argv and not argv[0].startswith("-"):
        raise CheckmateError(f"unknown command {argv[0]!r}; usage: checkmate launch ... | "
                             "checkmate secret new FILE | checkmate plan|doctor ...")
    gpus = cuda_device_count()
    args = _parser(gpus).parse_args(argv)
    args.device = resolve_device(args, gpus)
    _check(args)
    if multinode(args):  # would torch's rendezvous find this node? (before it runs)
        from checkmate.launch.hostcheck import refuse

        refuse(rdzv_addr(args)[0], nodes(args)[1], args.rdzv_backend, args.local_addr,
               args.rdzv_conf, args.worker_ip)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    count = 0 if args.mode in ("off", "gockpt") else (len(args.shadow) or args.shadows or 2)
    running = bool(args.shadow or args.controller)
    # Without --dir the logs go to a temporary directory, kept only if the job fails.
    own_logdir = args.dir is None
    logdir = args.dir or Path(tempfile.mkdtemp(prefix="checkmate-launch-"))
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
        if count:
            made_secret = _job_secret(running, logdir)
        if args.controller and count:
            job_id = args.job_id or 1
            tcp, udp = shadows_from_controller(args, job_id)
            check_shadows(tcp)
            print(f"{PROG}: {len(tcp)} shadow(s) registered with the controller "
                  f"{args.controller}: {', '.join(f'{h}:{p}' for h, p in tcp)}", flush=True)
        elif args.shadow:
            tcp = [parse_addr(a) for a in args.shadow]
            job_id = args.job_id or check_shadows(tcp) or 1
            print(f"{PROG}: {count} running shadow(s): "
                  f"{', '.join(f'{h}:{p}' for h, p in tcp)}", flush=True)
        elif count:
            local = LocalShadows(net, count, logdir,
                                 args.dir / "checkpoints" if args.persist_every else None,
                                 args.persist_every)
            kept = ", kept if the job fails" if own_logdir else ""
            print(f"{PROG}: starting {count} shadow(s) on {net}.100+ (logs: {logdir}{kept})",
                  flush=True)
            local.start()
            tcp, job_id = local.tcp, args.job_id or 1
        else:
            tcp, job_id = [], args.job_id or 1
        _worker_env(args, job_id, trainers, tcp, Path(logdir), udp)
        on = (f", on {min(gpus, args.nproc_per_node)} GPU(s)" if args.device == "cuda"
              else "")
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
            _run_agent(args, Path(logdir))
        except ChildFailedError as e:
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
        if tcp:
            latest = shadows_latest(tcp)
            print(f"{PROG}: done; the shadows hold iteration "
                  f"{min(latest) if None not in latest else None} "
                  f"(per shadow: {latest})", flush=True)
        succeeded = True
        return 0
    finally:
        if local is not None:
            local.stop()
        if made_secret is not None:  # this job's secret dies with the job
            made_secret.unlink(missing_ok=True)
            os.environ.pop(SECRET_ENV, None)
        if own_logdir and (succeeded or not any(logdir.iterdir())):
            shutil.rmtree(logdir, ignore_errors=True)
        signal.signal(signal.SIGTERM, old_term)


if __name__ == "__main__":
    from checkmate import fastexit

    fastexit.install()
    sys.exit(main())
