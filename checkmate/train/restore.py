"""Restore a trainer job from the shadows' consistent point.

``restore_session`` is what ``CheckmateSession.start(resume=True)`` runs on every rank:
rank 0 waits for shadows that cannot be reached yet (restarting), waits until the shadows
stop committing (the killed job's last datagrams may still be in flight), picks the newest
iteration every partition holds in memory or on disk (checkmate.train.resume_point) and
broadcasts it with each partition's source, so all ranks load the same one. Each rank
then loads model parameters and buffers, optimizer state (step counts, moments, param-group
learning rates), the scheduler, and returns the iteration; the user's ``extra`` (data
position) is in ``session.restored_extra``. RNG needs nothing: it is reseeded per (rank,
iteration).

A shadow that already committed an iteration newer than the restore point simply ignores
its repeated gradients: training is deterministic, so its state is the one the restored
job recomputes.

``python -m checkmate.train.restore --shadow HOST:PORT ... [--out FILE]`` prints the
consistent point and optionally writes ``{"model", "optimizer", "iteration", "extra"}``
with torch.save.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from checkmate.errors import CheckmateError, cli_guard
from checkmate.train import resume_point
from checkmate.train.resume_point import ResumePoint
from checkmate.train.shadow_client import (
    ShadowClient,
    parse_addr,
    restore_point,
)


def settle(addrs: list[tuple[str, int]], quiet: float = 0.5, timeout: float = 10.0) -> None:
    """Wait until no shadow committed an iteration or took in a datagram for ``quiet``
    seconds: the killed job's last datagrams (still queued, or placed but not yet stepped
    on a loaded host) are committed before the resume point is picked."""
    deadline = time.monotonic() + timeout
    last: list[Any] | None = None
    since = time.monotonic()
    while time.monotonic() < deadline:
        now = []
        for a in addrs:
            with ShadowClient(a) as c:
                st = c.status()
            now.append((st.get("latest"), st.get("received"), st.get("pending")))
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.05)


def load_trainer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       scheduler: Any, model_sd: dict, optim_sd: dict, extra: dict,
                       scaler: Any = None) -> None:
    """Load restored state dicts into live objects, keeping what the shadows do not hold.

    The restored tensors are host tensors; each lands on its parameter's device (CUDA
    included) by an exact copy: the module's ``load_state_dict`` copies into the live
    parameters and buffers, the optimizer's casts every state tensor but ``step`` to its
    parameter's device and dtype (torch.optim's rule); ``check_placement`` verifies it.
    ``scaler``: the job's GradScaler, given the restored iteration's scale and growth
    tracker."""
    model.load_state_dict(model_sd, strict=True)
    # Keys only the live param groups have (the scheduler's initial_lr) survive the load.
    kept = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(optim_sd)
    for g, old in zip(optimizer.param_groups, kept, strict=True):
        for k, v in old.items():
            g.setdefault(k, v)
    hyper = extra.get("hyper")  # the groups' settings of the restored step (mid-run changes)
    if hyper is not None:
        if len(hyper) != len(optimizer.param_groups):
            raise CheckmateError(f"restore: the shadows hold {len(hyper)} param groups' "
                                 f"settings, this optimizer has {len(optimizer.param_groups)}")
        for g, h in zip(optimizer.param_groups, hyper, strict=True):
            g.update({k: tuple(v) if k == "betas" else v for k, v in h.items()})
    sched = extra.get("scheduler")
    if scheduler is not None and sched is not None:
        scheduler.load_state_dict(sched)
        # The groups must hold the rate of the *next* step, which the scheduler computed.
        for g, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            g["lr"] = lr
    saved = extra.get("scaler")
    if scaler is not None and saved:
        scaler.load_state_dict(saved)
    check_placement(optimizer)


def check_placement(optimizer: torch.optim.Optimizer) -> None:
    """Every restored optimizer state tensor is where its parameter is (one line if not: a
    state on the wrong device would fail or silently copy at every step)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and v.dim() and v.device != p.device:
                    raise CheckmateError(f"restore: optimizer state {k} is on {v.device}, "
                                         f"its parameter on {p.device}")


def restore_trainer(addrs: list[tuple[str, int]], model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, scheduler: Any = None,
            iteration: int | None = None, scaler: Any = None) -> tuple[int, dict]:
    """Load the shadows' consistent point (or ``iteration``) into live trainer objects.

    The one call for a single process; ``restore_session`` is the same for every rank of a
    job at once. Returns ``(iteration, user extra)``; training continues at iteration + 1,
    with torch's RNG reseeded per iteration (``CheckmateSession.begin``).
    """
    from checkmate.spec.model import ModelSpec, difference

    with ShadowClient(addrs[0]) as c:
        theirs = c.get_spec()
    why = difference(theirs, ModelSpec.from_torch(theirs.job, model, optimizer,
                                                  theirs.partitions))
    if why is not None:
        raise CheckmateError(f"restore: {why}")
    sources = None
    if iteration is None:
        point = resume_point.choose(resume_point.ask(addrs))
        iteration, sources = point.iteration, point.sources
    r = restore_point(addrs, theirs, iteration, sources=sources)
    model_sd, optim_sd, it, extra = r.model_sd, r.optim_sd, r.iteration, r.extra
    load_trainer_state(model, optimizer, scheduler, model_sd, optim_sd, extra, scaler)
    return it, extra.get("user", {})


def check_holdings(addrs: list[tuple[str, int]], spec: Any,
                   wait: float | None = None) -> list[Any]:
    """What every shadow holds (checkmate.train.resume_point.Holding), after checking that
    every shadow holds state of a job whose spec equals ``spec`` (this trainer's model and
    optimizer) and waiting until they stop committing; CheckmateError with one line naming
    the first difference, or what is missing when there is nothing."""
    wait = resume_point.RESUME_WAIT if wait is None else wait
    resume_point.choose(resume_point.survey(addrs, wait))  # nothing at all: fail first
    _same_spec(addrs, spec)
    settle(addrs)
    return resume_point.ask(addrs)


def _same_spec(addrs: list[tuple[str, int]], spec: Any) -> None:
    """Every shadow at ``addrs`` holds state of a job whose spec equals ``spec`` (this
    trainer's model and optimizer); one CheckmateError line naming the first difference."""
    from checkmate.spec.model import difference

    for a in addrs:
        with ShadowClient(a) as c:
            why = difference(c.get_spec(), spec)
        if why is not None:
            raise CheckmateError(f"resume: {why} (resume with the model and optimizer the "
                                 "job started with, or start it anew with resume=False)")


def check_resume(addrs: list[tuple[str, int]], spec: Any,
                 wait: float | None = None, at: int | None = None) -> ResumePoint:
    """Where to resume (checkmate.train.resume_point: the newest iteration every partition
    holds, memory first, then disk; or ``at``), after :func:`check_holdings`."""
    return resume_point.choose(check_holdings(addrs, spec, wait), at)


def check_replica_holdings(sets: list[list[tuple[str, int]]], spec: Any,
                           wait: float | None = None) -> tuple[list[list[Any]], list[Any]]:
    """:func:`check_holdings` for partitions with several replicas (``sets``: every
    replica set's addresses): each replica's holdings, and per partition what any of its
    replicas holds (resume_point.merge_replicas). Only a partition none of whose replicas
    answers is waited for; the replicas that answer holding something are checked and
    settled."""
    wait = resume_point.RESUME_WAIT if wait is None else wait
    deadline, told = time.monotonic() + wait, False
    while True:
        per_set = [resume_point.ask(addrs) for addrs in sets]
        merged = resume_point.merge_replicas(per_set)
        down = [h for h in merged if h.error]
        if not down or time.monotonic() >= deadline:
            break
        if not told:
            resume_point.say_line(f"checkmate: resume waits up to {wait:.0f}s for "
                                  + "; ".join(h.describe() for h in down))
            told = True
        time.sleep(0.5)
    resume_point.choose(merged)  # nothing at all: fail first
    # a replica that holds nothing (new, placed after a node's loss) has no spec to check
    # and nothing to settle: it adopts a sibling's state once training runs
    live = [h.addr for hs in per_set for h in hs if not h.error and (h.memory or h.disk)]
    _same_spec(live, spec)
    settle(live)
    per_set = [resume_point.ask(addrs) for addrs in sets]
    return per_set, resume_point.merge_replicas(per_set)


def restore_session(sess: Any) -> int:
    """Restore ``sess`` (a CheckmateSession) in place; returns the restored iteration.

    Rank 0 finds the resume point, prints the line saying which and why, and publishes it
    in the attempt's c10d store (checkmate.train.agreement); every other rank reads it
    there instead of asking the shadows itself, so all ranks load the same iteration and a
    refusal is the same one-line CheckmateError on every rank (never a rank left waiting).
    """
    from checkmate.train import agreement

    addrs = sess.layout.shadow_tcp

    at = getattr(sess, "resume_at", None)

    sets = sess.layout.tcp_sets

    def compute() -> dict[str, Any]:
        if len(sets) == 1:
            found = check_resume(addrs, sess.spec, at=at)
            resume_point.say_line(found.line)
            return {"iteration": found.iteration, "sources": found.sources,
                    "line": found.line}
        # several replicas per partition: each partition read from one that holds it
        per_set, merged = check_replica_holdings(sets, sess.spec)
        found = resume_point.choose(merged, at)
        picks = [resume_point.replica_for(per_set, p, found.iteration)
                 for p in range(len(merged))]
        used = [next(k for k, s in enumerate(sets) if s[p] == tuple(a))
                for p, (a, _) in enumerate(picks)]
        line = f"{found.line} (read from replica per partition: {' '.join(map(str, used))})"
        resume_point.say_line(line)
        return {"iteration": found.iteration, "sources": [s for _, s in picks],
                "line": line, "addrs": [list(a) for a, _ in picks]}

    mesh = getattr(sess, "mesh", None)
    if mesh is None:
        got = agreement.decide(agreement.attempt_store(), "resume-point", sess.layout.rank,
                               sess.layout.world, compute)
    else:
        from checkmate.train import mesh_restore

        got = mesh_restore.agree(sess, addrs)
    point = ResumePoint(int(got["iteration"]), list(got["sources"]), str(got["line"]))
    if got.get("addrs"):
        addrs = [(str(h), int(port)) for h, port in got["addrs"]]
    r = restore_point(addrs, sess.spec, point.iteration, sources=point.sources)
    from checkmate.train import world

    # A refusal of what was restored (another mesh shape, a fixed world of another size) is
    # decided once, by rank 0, for every rank: a rank refusing on its own would end before
    # slower ranks read the restore point, and take the attempt's store with it.
    place = mesh.place if mesh is not None else None
    rank, size = sess._job_place()

    def refusal() -> bool:
        world.check_mesh(r.extra, place)
        world.check(r.extra, sess.layout.rank, sess.layout.world, sess.layout.fixed_world,
                    quiet=True)
        return True

    agreement.decide(agreement.attempt_store(), "resume-checks", rank, size, refusal)
    world.check_mesh(r.extra, place)
    world.check(r.extra, sess.layout.rank, sess.layout.world, sess.layout.fixed_world)
    model_sd, optim_sd = sess.local_state_dicts(r.model_sd, r.optim_sd)
    load_trainer_state(sess.module, sess.optimizer, sess.scheduler, model_sd, optim_sd,
                       r.extra, sess.scaler)
    sess.restored_extra = r.extra.get("user", {})
    sess.restored_control = r.extra  # the whole extra: e.g. DDP's bucket layout (ddp_hook)
    sess.opt_step = r.step
    sess.resume_point = point
    if at is not None:
        rewind_shadows(sess, r.iteration, r.step, r.extra)
    return r.iteration


def rewind_shadows(sess: Any, iteration: int, step: int, extra: dict[str, Any]) -> None:
    """After a resume at an older iteration than the newest held (``--resume-at``): seed
    every shadow anew with the restored state at ``iteration``, with its control message's
    buffers and extra, so the shadows drop what they committed after it -- in memory, and
    on disk as a new lineage (shadow.persist) -- and follow the run as it goes on from
    here, whatever it does differently. Every rank sends its share; rank 0 then waits until
    every shadow has installed it."""
    import torch.distributed as dist

    from checkmate.train.shadow_client import seed_share

    lay = sess.layout
    every = [a for addrs in lay.tcp_sets for a in addrs]  # each replica of each partition
    before = _installs(every) if lay.rank == 0 else []
    dist.barrier(group=sess.group)  # counted before any rank's share can complete a seed
    context = {"buffers": sess.spec.encode_buffers(dict(sess.module.named_buffers())),
               "extra": extra}
    flat = sess._seed_flat()
    for addrs in lay.tcp_sets:
        seed_share(addrs, sess.spec, flat, lay.rank, lay.world, iteration=iteration,
                   step=step, context=context)
    if lay.rank == 0:
        _wait_installed(every, iteration, before)
        resume_point.say_line(f"checkmate: rewound the shadows to iteration {iteration}: "
                              "what they held after it is dropped, in memory and on disk")


def _installs(addrs: list[tuple[str, int]]) -> list[int]:
    out = []
    for a in addrs:
        with ShadowClient(a) as c:
            out.append(int(c.status().get("installs") or 0))
    return out


def _wait_installed(addrs: list[tuple[str, int]], iteration: int, before: list[int],
                    timeout: float = 60.0) -> None:
    """Until every shadow installed a new seed (its count past ``before``) at
    ``iteration``."""
    deadline = time.monotonic() + timeout
    while True:
        sts = []
        for a in addrs:
            with ShadowClient(a) as c:
                sts.append(c.status())
        if all(int(s.get("installs") or 0) > b and s.get("seeded_iteration") == iteration
               for s, b in zip(sts, before, strict=True)):
            return
        if time.monotonic() > deadline:
            raise CheckmateError(f"resume at iteration {iteration}: the shadows did not take "
                                 f"the rewound state within {timeout:.0f} s (latest per "
                                 f"shadow: {[s.get('latest') for s in sts]})")
        time.sleep(0.05)


@cli_guard("checkmate.train.restore")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m checkmate.train.restore",
        description="Fetch a job's state at the shadows' consistent point.")
    ap.add_argument("--shadow", action="append", default=[], metavar="HOST[:PORT]",
                    help="a shadow's TCP service, once per partition")
    ap.add_argument("--config", help="cluster config; its shadows are used if no --shadow")
    ap.add_argument("--iteration", type=int, help="restore this iteration, not the newest")
    ap.add_argument("--out", help="torch.save the restored state to FILE")
    args = ap.parse_args(argv)
    if args.shadow:
        addrs = [parse_addr(a) for a in args.shadow]
    elif args.config:
        from checkmate.config.cluster import load
        from checkmate.train.shadow_client import addrs_from_config

        addrs = addrs_from_config(load(args.config))
    else:
        raise CheckmateError("give --shadow HOST:PORT (once per partition) or --config")
    sources = None
    if args.iteration is None:
        found = resume_point.choose(resume_point.ask(addrs))
        point, sources = found.iteration, found.sources
        print(found.line)
    else:
        point = args.iteration
    r = restore_point(addrs, None, point, sources=sources)
    model_sd, optim_sd, it, extra = r.model_sd, r.optim_sd, r.iteration, r.extra
    print(f"consistent point: iteration {it} ({len(model_sd)} tensors, "
          f"{len(optim_sd['state'])} optimizer states)")
    if args.out:
        torch.save({"model": model_sd, "optimizer": optim_sd, "iteration": it,
                    "extra": extra}, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from checkmate import fastexit

    fastexit.install()
    sys.exit(main())
