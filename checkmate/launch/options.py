"""The launcher's argument surface: ``checkmate launch``'s flags (torchrun's multi-node
flags with torchrun's meanings, Checkmate's own beside them), the checks of how they
combine (one CheckmateError line each), and the readings of them the launcher shares
(nodes, rendezvous and controller addresses, the GoCkpt directory).

What the launcher does with them is checkmate.launch.launcher; where the workers run
(their count and device kind) is checkmate.launch.placement.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from checkmate.errors import CheckmateError
from checkmate.launch.local_shadows import MAX_SHADOWS, MAX_TRAINERS
from checkmate.launch.placement import DEVICES, place
from checkmate.train import check_schedule
from checkmate.train import env as envmod

PROG = "checkmate launch"
#: torchrun's default rendezvous port.
RDZV_PORT = 29400


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one CheckmateError line (exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CheckmateError(message)


#: How the agent starts a worker (checkmate.launch.forked_workers).
WORKER_STARTS = ("forkserver", "exec")


def _count(lo: int, hi: int) -> Any:
    def parse(s: str) -> int:
        if not s.isdigit() or not lo <= int(s) <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer {lo}..{hi}, got {s!r}")
        return int(s)
    return parse


def _verify_every(s: str) -> int:
    try:
        k = check_schedule.parse(s)
    except CheckmateError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if k > 2**31:
        raise argparse.ArgumentTypeError(f"expected at most {2**31} iterations, got {s!r}")
    return k


def parser(gpus: int) -> argparse.ArgumentParser:
    """``checkmate launch``'s flags on a machine with ``gpus`` CUDA devices (the help names
    the default worker count; checkmate.launch.placement decides it)."""
    p = _Parser(prog=PROG, description="Run a training script on N local workers with "
                "Checkmate shadows and automatic restart (torchrun --standalone style).")
    # required without GPUs so that argparse names it with any other missing argument;
    # the count itself (None: one per GPU) is placement.place's to decide
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=_count(1, MAX_TRAINERS),
                   required=not gpus, default=None, metavar="N",
                   help="trainer processes (ranks); default with CUDA devices: one per "
                        f"device ({gpus} here)" if gpus else "trainer processes (ranks)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="cuda: bind each worker to the GPU of its LOCAL_RANK (NCCL for the "
                        "job, gloo beside it for Checkmate); cpu: no GPU; auto (default): "
                        "cuda when a CUDA device is visible")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--shadows", type=_count(1, MAX_SHADOWS), metavar="n",
                   help="start n shadows on loopback per data-parallel group (default 2; one "
                        "node only)")
    g.add_argument("--shadow", action="append", default=[], metavar="HOST[:PORT]",
                   help="use a running shadow (TCP service address, default port 47100; "
                        "UDP on 47001 of the same host), once per partition, in order "
                        "(a mesh job: group 0's partitions, then group 1's, ...)")
    p.add_argument("--replicas", type=_count(1, 3), default=1, metavar="r",
                   help="shadows per partition, started here (default 1): the trainers send "
                        "each its copies, and a partition stays protected while one of its "
                        "replicas is current")
    p.add_argument("--colocate", default=None, metavar="NODE=IP,...",
                   help="run the shadows on the job's own nodes, named here with their IPs "
                        "(every node's launcher gets the same list): each partition's "
                        "--replicas go to different nodes (and --domain's domains), and "
                        "this node (--node) starts its share; needs CHECKMATE_SECRET_FILE. "
                        "With --mode switch the switch copies to them: each rendezvous "
                        "tells the controller where they are")
    p.add_argument("--node", default=None, metavar="NAME",
                   help="this node's name in --colocate (another name: a node, such as a "
                        "spare, that hosts no shadow)")
    p.add_argument("--domain", default=None, metavar="NODE=DOMAIN,...",
                   help="failure domains (racks) of --colocate's nodes: no two replicas of "
                        "a partition in one (default: each node its own)")
    p.add_argument("--shadow-cores", type=_cores, default=None, metavar="LIST",
                   help="pin the shadows started here to these CPU cores (0,2-5: the "
                        "cores the trainers leave spare on a co-located node); default: the "
                        "launcher's own")
    p.add_argument("--shadow-restarts", type=_count(0, 100), default=5, metavar="N",
                   help="start a shadow started here again when it exits while the job "
                        "runs, up to N times each (default 5; 0: never): the trainers bring "
                        "it current, from a sibling replica or by a live re-seed")
    p.add_argument("--pp", type=_count(1, 256), default=1, metavar="P",
                   help="the script's pipeline-parallel degree (its DeviceMesh's pp "
                        "dimension): shadows are per data-parallel group, P x T groups")
    p.add_argument("--tp", type=_count(1, 256), default=1, metavar="T",
                   help="the script's tensor-parallel degree (its DeviceMesh's tp dimension)")
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
    p.add_argument("--resume-at", type=_count(0, 2**62), default=None, metavar="ITERATION",
                   help="the first attempt resumes at ITERATION (held by every partition, "
                        "in memory or on disk; `checkmate checkpoints` lists them) and the "
                        "shadows drop what they hold after it: a rewind")
    p.add_argument("--verify-every", type=_verify_every, default=check_schedule.AUTO,
                   metavar="K|auto",
                   help="every K iterations (and at the end) the data-parallel ranks compare "
                        "a digest of their model and optimizer state and every shadow checks "
                        "its state against theirs; a rank that differs is named and the job "
                        "restarts from the shadows, a shadow that differs is re-seeded (0: "
                        "never; default auto: K chosen by measurement so the checks cost "
                        "under 1%%)")
    p.add_argument("--on-divergence", choices=envmod.DIVERGENCE_ACTIONS, default="stop",
                   help="when the data-parallel copies differ (silent data corruption): "
                        "stop the job (default), or restore every rank from the shadows at "
                        "the newest iteration the ranks verified and go on")
    p.add_argument("--fixed-world", action="store_true",
                   help="refuse to resume the job on another number of ranks than it ran on "
                        "(default: allowed, announced in one line on every rank)")
    p.add_argument("--worker-start", choices=WORKER_STARTS, default="forkserver",
                   help="forkserver: every worker is forked from one server that imported "
                        "torch once (a restart resumes seconds sooner); exec: every worker is a "
                        "fresh Python (default: forkserver)")
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


def loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback."""
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
    if args.mode in ("host", "switch") and not (args.shadow or args.controller
                                                or args.colocate):
        raise CheckmateError("a job of several nodes needs shadows every node reaches: give "
                             "--shadow HOST[:PORT] per partition, --controller HOST[:PORT] "
                             "or --colocate NODE=IP,...")
    if args.worker_ip and len(args.worker_ip) != 1:
        raise CheckmateError("--worker-ip once: this node's address (its workers take "
                             "ports of their own on it)")
    if not args.worker_ip and not loopback(rdzv_addr(args)[0]):
        raise CheckmateError("give --worker-ip IP: the address of this node the other nodes "
                             "and the shadows reach its workers at")


def check(args: argparse.Namespace) -> None:
    """One CheckmateError line for flags that do not go together (or name no script)."""
    _check_multinode(args)
    if args.mode == "off" and (args.shadows or args.shadow or args.resume
                               or args.controller or args.resume_at is not None):
        raise CheckmateError("--mode off runs without shadows: drop --shadows/--shadow/"
                             "--resume/--resume-at")
    if args.resume_at is not None and args.mode == "gockpt":
        raise CheckmateError("--resume-at rewinds the shadows: GoCkpt mode has none (it "
                             "resumes from its newest checkpoint)")
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
    placing = args.colocate is not None and args.mode == "switch"  # co-located, switch
    if args.replicas > 1 and (args.shadow or args.pp * args.tp > 1 or not (
            args.mode == "host" and not args.controller or placing)):
        raise CheckmateError("--replicas applies to the shadows started here, for a "
                             "data-parallel job: in host mode, or in switch mode with "
                             "--colocate (not with --shadow or --pp/--tp; a controller's "
                             "own shadows have the replicas its config gives)")
    if args.colocate is not None:
        colocated(args)  # one line for a bad list, before anything starts
        if args.shadow or args.mode not in ("host", "switch") or args.pp * args.tp > 1:
            raise CheckmateError("--colocate places the shadows this job starts, in host or "
                                 "switch mode, for a data-parallel job (not with --shadow, "
                                 "--mode off/gockpt or --pp/--tp)")
        if args.mode == "host" and args.controller:
            raise CheckmateError("--colocate in host mode has no controller (the trainers "
                                 "send the copies): drop --controller, or --mode switch")
        if args.rdzv_backend == "static":
            raise CheckmateError("--colocate places the shadows anew at every rendezvous "
                                 "round: not with --rdzv-backend static (use c10d)")
    elif args.node is not None or args.domain is not None:
        raise CheckmateError("--node and --domain name the nodes of --colocate: give it")
    if args.shadow_cores is not None and (args.shadow or args.controller and not placing
                                          or args.mode in ("off", "gockpt")):
        raise CheckmateError("--shadow-cores pins the shadows started here: not with "
                             "--shadow, --controller or --mode off/gockpt")
    if args.persist_every and args.dir is None:
        raise CheckmateError("--persist-every writes under --dir: give --dir")
    if args.persist_every and args.shadow:
        raise CheckmateError("--persist-every applies to shadows started here, not --shadow")
    if not Path(args.script).is_file():
        raise CheckmateError(f"no such script: {args.script}")
    if len(args.shadow) > MAX_SHADOWS:
        raise CheckmateError(f"at most {MAX_SHADOWS} shadows")


def parse_cores(s: str) -> frozenset[int]:
    """A CPU list as taskset and cpusets write it (``0,2-5``), each core online here; one
    CheckmateError line otherwise."""
    cores: set[int] = set()
    for part in s.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise CheckmateError(f"expected a CPU list such as 0,2-5, got {s!r}")
        cores.update(range(int(lo), int(hi or lo) + 1))
    online = os.cpu_count() or 1
    off = sorted(c for c in cores if c >= online)
    if off:
        raise CheckmateError(f"core(s) {off} not on this machine (cores 0-{online - 1})")
    return frozenset(cores)


def format_cores(cores: frozenset[int]) -> str:
    """``0,2-5``: a core set as parse_cores reads it."""
    out: list[list[int]] = []
    for c in sorted(cores):
        if out and c == out[-1][-1] + 1:
            out[-1].append(c)
        else:
            out.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out)


def _cores(s: str) -> frozenset[int]:
    try:
        return parse_cores(s)
    except CheckmateError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse(argv: list[str], gpus: int) -> argparse.Namespace:
    """The launcher's arguments with their placement decided (``device``: cuda or cpu,
    ``nproc_per_node``: a count, ``gpus_used``) and their combinations checked."""
    args = parser(gpus).parse_args(argv)
    placed = place(args.device, args.nproc_per_node, gpus)
    args.device, args.nproc_per_node, args.gpus_used = (placed.device, placed.nproc,
                                                        placed.gpus_used)
    check(args)
    return args


def _pairs(text: str, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or not key or not value or key in out:
            raise CheckmateError(f"{what} must be NAME=VALUE,... with each name once, got "
                                 f"{text!r}")
        out[key] = value
    return out


def colocated(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str] | None]:
    """``--colocate``'s nodes (name -> IP, in order) and ``--domain``'s domains, checked:
    every IP an IPv4 address. A ``--node`` outside the list (a spare) hosts no shadow."""
    import ipaddress

    nodes = _pairs(args.colocate, "--colocate")
    for name, ip in nodes.items():
        try:
            ipaddress.IPv4Address(ip)
        except ValueError:
            raise CheckmateError(f"--colocate: {name}'s address {ip!r} is not an IPv4 "
                                 "address") from None
    if not args.node:
        raise CheckmateError("--colocate needs --node: this node's name (one of "
                             f"{', '.join(nodes)}, or another for a node that hosts none)")
    domains = _pairs(args.domain, "--domain") if args.domain else None
    return nodes, domains


def gockpt_dir(args: argparse.Namespace) -> Path:
    """GoCkpt mode's checkpoint directory (part<rank>/ per rank, the joins beside)."""
    return (args.dir / "gockpt").resolve()


def controller_addr(args: argparse.Namespace) -> tuple[str, int]:
    """``--controller HOST[:PORT]`` (default port: the handshake's)."""
    from checkmate.config.cluster import CONTROLLER_PORT

    host, sep, port = args.controller.rpartition(":")
    if not sep:
        host, port = args.controller, str(CONTROLLER_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CheckmateError(f"--controller must be HOST[:PORT], got {args.controller!r}")
    return host, int(port)
