"""One trainer process of a scenario: ``python -m checkmate.train.worker --job FILE``.

Launched torchrun-style (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment) by
``testbed run``. ``FILE`` is a JSON job description (addresses, model, steps; see
``testbed/run.py``). Progress goes to stdout as one JSON object per line, so the launcher
can follow it and kill the job at a chosen iteration. At the end every rank writes its final
model, optimizer and scheduler state with torch.save for the bit-exact comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from checkmate.errors import CheckmateError, cli_guard
from checkmate.train.baselines import Baseline
from checkmate.train.env import FLIP_AT, rank_iteration
from checkmate.train.layout import JobLayout
from checkmate.train.replica_check import ReplicaDivergence
from checkmate.train.replicate import ShadowTarget
from checkmate.train.session import CheckmateSession, flip_hook

#: Failure injector for scenarios: "ITERATION:PHASE" makes this trainer SIGKILL itself at that
#: point of that iteration (phase "before-control": after the optimizer step, before the
#: control message). Only the environment sets it; there is no command-line flag.
FAIL_AT_ENV = "CHECKMATE_FAIL_AT"


def _injector(spec: str | None):
    """A session hook that kills this process at the given (iteration, phase)."""
    if not spec:
        return None
    it, _, phase = spec.partition(":")
    if not it.isdigit() or phase != "before-control":
        raise CheckmateError(f"{FAIL_AT_ENV} must look like ITERATION:before-control, "
                             f"got {spec!r}")

    def hook(at_phase: str, iteration: int) -> None:
        if at_phase == phase and iteration == int(it):
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


def _emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def layout_from_job(job: dict, rank: int, world: int) -> JobLayout:
    return JobLayout(
        job_id=int(job["job_id"]), rank=rank, world=world,
        trainers=[tuple(a) for a in job["trainers"]],
        shadows=[ShadowTarget(**s) for s in job.get("shadows", [])],
        shadow_tcp=[tuple(a) for a in job.get("shadow_tcp", [])],
        replica_shadows=[[ShadowTarget(**s) for s in rs]
                         for rs in job.get("replica_shadows", [])],
        replica_tcp=[[tuple(a) for a in rs] for rs in job.get("replica_tcp", [])],
        mode=job["mode"] if job.get("ckpt", "checkmate") == "checkmate" else "off",
        controller=tuple(job["controller"]) if job.get("controller") else None,
        seed=int(job.get("seed", 0)),
        repair=bool(job.get("repair", True)),
        gockpt=((str(job["ckpt_dir"]), int(job["ckpt_every"]), int(job["ckpt_steps"]))
                if job.get("ckpt") == "gockpt" else None),
    )


def _env_int(name: str) -> int:
    v = os.environ.get(name)
    if v is None or not v.isdigit():
        raise CheckmateError(f"environment variable {name} must be set to an integer")
    return int(v)


@cli_guard("checkmate.train.worker")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkmate.train.worker")
    ap.add_argument("--job", required=True, help="job description (JSON)")
    ap.add_argument("--resume", action="store_true", help="restore from the shadows first")
    ap.add_argument("--resume-at", type=int, default=None, metavar="ITERATION",
                    help="restore that iteration, rewinding the shadows (0: start anew)")
    args = ap.parse_args(argv)
    try:
        job = json.loads(Path(args.job).read_text())
    except (OSError, ValueError) as e:
        raise CheckmateError(f"cannot read job file {args.job}: {e}") from None
    if not isinstance(job, dict):
        raise CheckmateError(f"job file {args.job} must hold a JSON object")
    missing = [k for k in ("job_id", "mode", "model", "steps", "trainers", "out") if k not in job]
    if missing:
        raise CheckmateError(f"job file {args.job} lacks {', '.join(missing)}")
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    _env_int("MASTER_PORT")
    if not os.environ.get("MASTER_ADDR"):
        raise CheckmateError("environment variable MASTER_ADDR must be set (torchrun-style)")
    try:
        layout = layout_from_job(job, rank, world)
    except (TypeError, ValueError, KeyError) as e:
        raise CheckmateError(f"job file {args.job}: bad entry ({e})") from None
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from checkmate.testbed.models import StandIn, build

    steps = int(job["steps"])
    w = build(job["model"], int(job.get("seed", 0)), steps, **job.get("model_kw", {}))
    # The accelerator stand-in: a real gradient taken once from the initial model, then a
    # configured compute time per iteration (checkmate.testbed.models.StandIn).
    stand_in = (StandIn(w, rank, float(job["stand_in"])) if job.get("stand_in") is not None
                else None)
    ckpt = Baseline(job.get("ckpt", "checkmate"), job.get("ckpt_dir"), rank,
                    int(job.get("ckpt_every", 1)))
    sess = CheckmateSession(w.model, w.optimizer, w.scheduler, layout, w.max_grad_norm)
    sess.injector = _injector(os.environ.get(FAIL_AT_ENV))
    flip = rank_iteration(os.environ, FLIP_AT)
    if flip is not None and flip[0] == rank and not args.resume and args.resume_at is None:
        sess.injector = flip_hook(flip[1], w.model)  # a silent corruption (test only)
    sess.verify_every = int(job.get("verify_every", 0))
    sess.on_divergence = "restore"  # the testbed's runner rewinds the job itself
    resume = args.resume
    if args.resume_at is not None:  # a rewind: after a divergence, to a verified iteration
        resume = args.resume_at > 0
        sess.resume_at = args.resume_at or None
    t0 = time.perf_counter()
    start = sess.start(resume=resume)
    sess.verified_iteration = start
    point = getattr(sess, "resume_point", None)
    _emit(event="started", rank=rank, iteration=start, resumed=args.resume,
          seconds=time.perf_counter() - t0,
          sources=point.sources if point is not None else None)
    for it in range(start + 1, steps + 1):
        sess.begin(it)
        w.optimizer.zero_grad()
        if stand_in is not None:
            loss = stand_in.loss(it)
        else:
            x, y = w.batch(rank, it)
            loss = w.loss(sess.model(x), y)
        loss.backward()
        ckpt.before_step()
        try:
            sess.step(extra={"data": {"iteration": it}})
        except ReplicaDivergence as e:  # said on every rank; the runner rewinds the job
            _emit(event="diverged", rank=rank, iteration=it, rewind=sess.verified_iteration,
                  line=str(e))
            return 4
        ckpt.save(it, w.model, w.optimizer)
        _emit(event="iter", rank=rank, iteration=it, loss=round(float(loss.detach()), 5),
              t=time.time())
    ckpt.finish()
    prot = (sess.finish(float(job.get("finish_timeout", 30.0)))
            if sess.layout.mode != "off" else {"protected": True})
    out = Path(job["out"])
    torch.save({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict(),
                "scheduler": w.scheduler.state_dict() if w.scheduler else None,
                "iteration": steps}, out / f"final-rank{rank}.pt")
    _emit(event="done", rank=rank, iteration=steps, stats=sess.ring.stats,
          control_bytes=sess.control_bytes, copy_bytes=sess.sender.copy_bytes,
          protected=prot["protected"], repair=prot.get("repair"),
          reseeds=prot.get("reseeds", 0), saves=ckpt.saves,
          gockpt=None if sess.gockpt is None else {**sess.gockpt.stats,
                                                   "committed": sess.gockpt.committed,
                                                   "errors": sess.gockpt.errors})
    dist.barrier()
    sess.close()
    dist.destroy_process_group()
    if not prot["protected"]:
        if rank == 0:
            print(f"checkmate.train.worker: error: iteration {steps} finished but is not "
                  "protected by every shadow (see the warning above)", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    from checkmate import fastexit

    fastexit.install()
    sys.exit(main())
