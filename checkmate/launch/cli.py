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
import uuid
from pathlib import Path
from typing import Any

from checkmate.errors import CheckmateError, cli_guard
from checkmate.launch.local_shadows import (
    MAX_SHADOWS,
    MAX_TRAINERS,
    LocalShadows,
    check_shadows,
    pick_loopback_net,
    shadows_latest,
    trainer_addrs,
)
from checkmate.protocol.auth import SECRET_ENV
from checkmate.train import env as envmod
from checkmate.train.shadow_client import parse_addr

PROG = "checkmate launch"


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
    p.add_argument("--nproc-per-node", type=_count(1, MAX_TRAINERS), required=not gpus,
                   default=gpus or None, metavar="N",
                   help="trainer processes (ranks); default with CUDA devices: one per "
                        f"device ({gpus} here)" if gpus else "trainer processes (ranks)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda: bind each worker to the GPU of its LOCAL_RANK (NCCL for the "
                        "job, gloo beside it for Checkmate); cpu: no GPU; auto (default): "
                        "cuda when a CUDA device is visible")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--shadows", type=_count(1, MAX_SHADOWS), metavar="n",
                   help="start n shadows on loopback (default 2)")
    g.add_argument("--shadow", action="append", default=[], metavar="HOST[:PORT]",
                   help="use a running shadow (TCP service address, default port 47100; "
                        "UDP on 47001 of the same host), once per partition, in order")
    p.add_argument("--mode", choices=envmod.ENV_MODES, default="host",
                   help="host: trainers send the shadow copies; off: no shadows; gockpt: no "
                        "shadows, periodic GoCkpt checkpoints under --dir (see --gockpt)")
    p.add_argument("--gockpt", default="50,4", metavar="EVERY,STEPS",
                   help="GoCkpt mode: a checkpoint every EVERY iterations, its transfer "
                        "spread over STEPS steps (default 50,4)")
    p.add_argument("--max-restarts", type=_count(0, 1000), default=0, metavar="R",
                   help="restarts of the worker group after a failure (default 0)")
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


def _check(args: argparse.Namespace) -> None:
    if args.mode == "off" and (args.shadows or args.shadow or args.resume):
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
        if "will restart worker group" in msg:
            left = msg.split(". ", 1)[1].split(";")[0] if ". " in msg else ""
            print(f"{PROG}: a trainer failed; restarting the worker group ({left}); it "
                  "resumes from its checkpoints", flush=True)
        return False

    only_restarts.checkmate = True  # type: ignore[attr-defined]
    agent_log.addFilter(only_restarts)


def gockpt_dir(args: argparse.Namespace) -> Path:
    """GoCkpt mode's checkpoint directory (part<rank>/ per rank, the joins beside)."""
    return (args.dir / "gockpt").resolve()


def _worker_env(args: argparse.Namespace, job_id: int, trainers: list, tcp: list,
                logdir: Path | None = None) -> None:
    """The variables every worker inherits (checkmate.train.env, and where workers record
    why they failed: checkmate.train.failures)."""
    from checkmate.train import failures, world

    if logdir is not None:
        os.environ[failures.LOG_DIR] = str(Path(logdir).resolve())
    os.environ[world.FIXED_WORLD] = "1" if args.fixed_world else "0"
    os.environ.update({
        envmod.JOB_ID: str(job_id), envmod.MODE: args.mode, envmod.DEVICE: args.device,
        envmod.TRAINERS: envmod.format_addrs(trainers),
        envmod.SEED: str(args.seed), envmod.PROGRESS_EVERY: str(args.progress_every),
        envmod.RESUME: "1" if args.resume else "0",
        "PYTHONUNBUFFERED": "1",
    })
    if tcp:
        os.environ[envmod.SHADOWS] = envmod.format_addrs(tcp)
        os.environ.pop(envmod.SHADOWS_UDP, None)
    if args.mode == "gockpt":
        os.environ[envmod.GOCKPT] = f"{gockpt_dir(args)},{args.gockpt}"
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


def _run_agent(args: argparse.Namespace, logdir: Path) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # A restarted group must not meet the previous attempt's keys: with the agent's shared
    # TCPStore (torch's default) gloo reads the dead workers' addresses and is refused. Off,
    # rank 0 of each attempt hosts a fresh store.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc_per_node,
                       run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                       rdzv_endpoint="localhost:0", max_restarts=args.max_restarts,
                       monitor_interval=0.1, local_addr="127.0.0.1",
                       # the agent's per-attempt files go with the job's logs (torch's
                       # default is a /tmp/torchelastic_* directory nobody removes)
                       logs_specs=DefaultLogsSpecs(log_dir=str(logdir / "elastic")))
    elastic_launch(cfg, sys.executable)("-u", "-m", "checkmate.train.run_script",
                                        args.script, *args.args)


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
    elif argv and not argv[0].startswith("-"):
        raise CheckmateError(f"unknown command {argv[0]!r}; usage: checkmate launch ... | "
                             "checkmate secret new FILE | checkmate plan ...")
    gpus = cuda_device_count()
    args = _parser(gpus).parse_args(argv)
    args.device = resolve_device(args, gpus)
    _check(args)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    count = 0 if args.mode in ("off", "gockpt") else (len(args.shadow) or args.shadows or 2)
    # Without --dir the logs go to a temporary directory, kept only if the job fails.
    own_logdir = args.dir is None
    logdir = args.dir or Path(tempfile.mkdtemp(prefix="checkmate-launch-"))
    made_secret: Path | None = None
    succeeded = False
    net = pick_loopback_net(args.nproc_per_node, 0 if args.shadow else count)
    trainers = trainer_addrs(net, args.nproc_per_node)
    local: LocalShadows | None = None
    # SIGTERM before the agent runs must unwind through `finally` too (the agent installs
    # its own handlers while it runs).
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        if count:
            made_secret = _job_secret(bool(args.shadow), logdir)
        if args.shadow:
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
        _worker_env(args, job_id, trainers, tcp, Path(logdir))
        on = (f", on {min(gpus, args.nproc_per_node)} GPU(s)" if args.device == "cuda"
              else "")
        print(f"{PROG}: {args.nproc_per_node} trainer(s) on {net}.10+{on}, mode {args.mode}, "
              f"max {args.max_restarts} restart(s)", flush=True)
        _quiet_agent()
        try:
            _run_agent(args, Path(logdir))
        except ChildFailedError as e:
            raise CheckmateError(_failure_line(e, args.max_restarts, Path(logdir))) from None
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
    sys.exit(main())
