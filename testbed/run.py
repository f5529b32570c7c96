"""`testbed run`: train a real small model with N trainers and n shadows, inject a failure.

    testbed run --scenario NAME|FILE [--config FILE] [--mode switch|host] [--json OUT]

Scenarios live in testbed/scenarios/*.yaml (found by name) or any YAML file:
``{name, model: gpt|cnn, steps, seed, kill_at: ITER|random, kill_phase: PHASE}``. Without
``kill_at`` the job runs once (failure-free). With it, the job runs twice on fresh shadows:
once failure-free (the reference), once with every trainer SIGKILLed and then restored from
the shadows' consistent point. ``kill_phase: after-step`` (default): the launcher kills all
trainers when rank 0 reports iteration ``kill_at``; ``before-control``: rank 0 SIGKILLs
itself after its optimizer step of ``kill_at`` but before the control message (so the shadows
cannot commit that iteration while other ranks finished it), and the launcher kills the rest
when it sees rank 0 die. The final model and optimizer state of the two
runs must be equal (torch.equal on every tensor), and at most one iteration may be repeated.
Each run also checks that the shadows' final state equals the trainers'.

Modes: ``switch`` runs every host in its namespace behind the eBPF switch (root; the
testbed is brought up if it is not already); ``host`` runs plain processes on loopback
addresses 127.77.N.x and the trainers send the shadow copies themselves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from checkmate.config import cluster as cfgmod
from checkmate.errors import CheckmateError, cli_guard
from checkmate.extras import needs
from checkmate.testbed import fault_verdicts as verdicts
from checkmate.testbed.cluster import LOOPBACK_NET, MODES, Cluster
from checkmate.testbed.comparison import check_run, compare_states, gockpt_dir, reliability_summary
from checkmate.testbed.runner import Run
from checkmate.testbed.scenario import (
    Scenario,
    load_scenario,
)
from checkmate.testbed.topology import config_to_dict

# ----------------------------------------------------------------------------- chaos


def _inject(run: Run) -> None:
    """Set the scenario's switch faults and schedule its shadow kills / controller restart."""
    sc, cl = run.sc, run.cl
    if sc.faults and cl.cfg.switch.target != "kernel":
        raise CheckmateError("scenario faults are the kernel switch's knobs (tc-eBPF); "
                             f"a {cl.cfg.switch.target} switch has none")
    if sc.faults:
        from checkmate.dataplane.switch import KernelSwitch

        sw = KernelSwitch(cl.cfg)
        for f in sc.faults:
            cl.cfg.host(f.port)  # ConfigError names an unknown host
            sw.set_fault(cl.cfg.switch_ifname(f.port), f.drop, f.corrupt,
                         from_iteration=f.start, until_iteration=f.until, swap=f.swap)
    for k in sc.shadow_kills:
        run.at_iteration(k.at, lambda k=k: run.kill_restart_shadow(k.partition, k.disk,
                                                                   k.restart, k.replica))
    if sc.disk_limit is not None:
        run.limit_disk(*sc.disk_limit)
    if sc.cpu_load:
        run.load_cpu(sc.cpu_load)
    if sc.controller_restart_at is not None:
        if cl.testbed is None:
            raise CheckmateError("controller_restart_at needs --mode switch")
        run.at_iteration(sc.controller_restart_at, cl.testbed.restart_controller)
    for a in sc.attacks:
        from checkmate.testbed.attacks import Attack

        attack = Attack(run, a.kind, a.source, a.target)
        run.attacks.append(attack)
        run.at_iteration(a.at, attack.start)


def _stop_attacks(run: Run) -> list[dict[str, Any]]:
    """Stop the run's attacks; what each did, its problems added to the run's."""
    out = []
    for attack in run.attacks:
        did, problems = attack.stop()
        out.append(did)
        run.action_errors += [f"{run.label}: {p}" for p in problems]
    return out


_REGISTERED = b"control serve: registered "


def _controller_log_mark(cl: Cluster) -> int | None:
    """Where the namespace testbed's controller log ends now (None: no such log)."""
    tb = cl.testbed
    if tb is None or cl.mode != "switch":  # host mode: shadows do not register
        return None
    path = tb.state_dir / "controller.log"
    return path.stat().st_size if path.exists() else None


def _epochs_minted(cl: Cluster, mark: int | None) -> int | None:
    """Registrations the controller made (each mints an epoch) since ``mark``; a retry of
    one it made is answered again without a line (control/service.py)."""
    if mark is None or cl.testbed is None:
        return None
    with open(cl.testbed.state_dir / "controller.log", "rb") as f:
        f.seek(mark)
        return f.read().count(_REGISTERED)


def _clear_faults(run: Run) -> dict[str, int]:
    """Turn the scenario's knobs off; returns the frames each knob dropped."""
    dropped: dict[str, int] = {}
    if run.sc.faults and run.cl.mode == "switch" and run.cl.cfg.switch.target == "kernel":
        from checkmate.dataplane.switch import KernelSwitch

        sw = KernelSwitch(run.cl.cfg)
        ports = sw.counters().get("ports", {})
        for f in run.sc.faults:
            ifname = run.cl.cfg.switch_ifname(f.port)
            dropped[f.port] = int(ports.get(ifname, {}).get("dropped", 0))
            sw.set_fault(ifname, 0.0, 0.0)
    return dropped


# ----------------------------------------------------------------------------- main


@dataclass
class Reference:
    """A finished failure-free run, shared by every scenario of the same model, steps and
    seed (``testbed chaos``): training is deterministic, so one reference serves them all."""

    run: Run
    entry: dict[str, Any]  # its report["runs"]["failure-free"]
    problems: list[str]


def reference(sc: Scenario, cl: Cluster, workdir: Path, progress: Any) -> Reference:
    """Run ``sc``'s job once, failure-free, to serve as the reference of its scenarios."""
    base = dataclasses.replace(sc, kill_at=None, faults=[], shadow_kills=[], cpu_load=0,
                               controller_restart_at=None, disk_limit=None, persist_every=0)
    finished: dict[str, Run] = {}
    rep = execute(base, cl, workdir, progress, finished=finished)
    return Reference(finished["failure-free"], rep["runs"]["failure-free"], rep["problems"])


def execute(sc: Scenario, cl: Cluster, workdir: Path, progress: Any,
            ref: Reference | None = None,
            finished: dict[str, Run] | None = None) -> dict[str, Any]:
    """Run the scenario; returns the report (``ok`` False with ``problems`` on failure).

    ``ref``: a failure-free run of the same model, steps and seed taken as the reference
    instead of running one; ``finished`` receives the runs (label -> Run).
    """
    import torch

    report: dict[str, Any] = {"scenario": sc.name, "mode": cl.mode, "model": sc.model,
                              "steps": sc.steps, "trainers": len(cl.cfg.trainers),
                              "shadows": cl.cfg.num_partitions, "kill_at": sc.kill_at,
                              "kill_phase": sc.kill_phase, "gockpt": sc.gockpt,
                              "runs": {}}
    problems: list[str] = []
    if sc.faults and cl.mode != "switch":
        raise CheckmateError("scenario faults act on the switch's ports: use --mode switch")
    second = "chaos" if sc.chaos else "kill-restore"
    runs = [("failure-free", None)] + ([(second, sc.kill_at)] if sc.kill_at or sc.chaos
                                       else [])
    finished = {} if finished is None else finished
    if ref is not None:
        if (ref.run.sc.model, ref.run.sc.steps, ref.run.sc.seed) != (sc.model, sc.steps,
                                                                      sc.seed):
            raise CheckmateError("the reference run trained another job (model, steps, seed)")
        runs = runs[1:]
        finished["failure-free"] = ref.run
        report["runs"]["failure-free"] = ref.entry
        problems += [f"reference: {p}" for p in ref.problems]
    from checkmate.testbed import stream_attacks

    captures = (stream_attacks.capture_run(sc, cl, workdir, progress)
                if "replay-other-run" in sc.stream_attacks else [])
    for label, kill in runs:
        run = Run(cl, sc, workdir, label, progress)
        attackers: list[Any] = []
        if sc.gockpt is not None:  # no shadows: each trainer's GoCkpt process checkpoints
            run.extra_job = {"ckpt": "gockpt", "ckpt_dir": str(gockpt_dir(run)),
                             "ckpt_every": sc.gockpt[0], "ckpt_steps": sc.gockpt[1]}
        t0 = time.perf_counter()
        log_mark = _controller_log_mark(cl)
        try:
            if sc.gockpt is None:
                run.start_shadows()
            if label == "chaos":
                _inject(run)
                if sc.stream_attacks:
                    attackers = stream_attacks.start(run, captures)
            self_kill = kill is not None and sc.kill_phase == "before-control"
            run.start_trainers(resume=False, fail_at=kill if self_kill else None)
            outcome = (run.follow(None, fail_at=kill) if self_kill else run.follow(kill))
            if outcome == "killed":
                run.start_trainers(resume=True)
                run.follow(None)
            elif outcome == "diverged":  # a rank's copy differed: rewind to the verified one
                run.start_trainers(resume=False, resume_at=run.result.diverged["rewind"])
                run.follow(None)
            sent = stream_attacks.stop(attackers)
            problems += check_run(run)
            run.result.shadow_status = run.shadow_statuses() if sc.gockpt is None else []
            if label == "chaos" and sc.trainer_flip is not None:
                problems += verdicts.trainer_flip(sc, run.result.diverged)
                report["diverged"] = run.result.diverged
            found = verdicts.state_faults(sc, cl)
            if label == "chaos" and found:
                problems += [p for part, at in found
                             for p in verdicts.fault_found(sc, run.result.shadow_status, part, at)]
                report["state_checks"] = [s.get("state_check") for s in
                                          run.result.shadow_status]
            if attackers:
                more, report["stream_attacks"] = stream_attacks.check(run, sent)
                problems += more
                print(f"testbed: {sc.name}: attacks sent {sent}, shadows dropped "
                      f"{report['stream_attacks']['drops']}", file=sys.stderr, flush=True)
        finally:
            stream_attacks.stop(attackers)
            if label == "chaos":
                report["faults_dropped"] = _clear_faults(run)
                if run.attacks:
                    report["attacks"] = _stop_attacks(run)
            run.stop()
        problems += run.action_errors
        run.result.seconds = round(time.perf_counter() - t0, 2)
        finished[label] = run
        r = run.result
        summary = reliability_summary(r)
        if r.protected is False:
            problems.append(f"{label}: the last iteration was not protected by every shadow")
        if summary["commits_missing"]:
            problems.append(f"{label}: shadows skipped iterations {summary['commits_missing']}")
        minted = _epochs_minted(cl, log_mark) if sc.gockpt is None else None
        starts = len(cl.cfg.shadow_hosts) + r.shadow_restarts  # replicas register each
        # Registration converges: one epoch per shadow process start, however many tries
        # its registration took (a restarted controller may see a shadow register again).
        if minted is not None and minted != starts and sc.controller_restart_at is None:
            problems.append(f"{label}: the controller minted {minted} epochs for {starts} "
                            "shadow starts (registration retries must reuse their epoch)")
        report["runs"][label] = {
            "seconds": r.seconds, "first_loss": r.losses[0] if r.losses else None,
            "last_loss": r.losses[-1] if r.losses else None, "killed_at": r.killed_at,
            "max_done_before_kill": r.max_done_before_kill, "restored_from": r.restored_from,
            "restored_sources": r.restored_sources,
            "shadows_match_trainers": r.shadow_matches_trainer, "ring": r.stats,
            "protected": r.protected, "shadow_restarts": r.shadow_restarts,
            "epochs_minted": minted,
            "gockpt_checkpoint": r.gockpt_iteration, **summary,
        }
    if cl.testbed is not None:
        report["switch_replicated_packets"] = cl.testbed.replicated_packets()
        if cl.cfg.replicas > 1 and cl.cfg.switch.target == "kernel":
            report["switch_replicated_by_replica"] = cl.testbed.replicated_by_replica()
    ff = finished["failure-free"].result
    if ff.losses and not ff.losses[-1] < ff.losses[0]:
        problems.append(f"loss did not fall ({ff.losses[0]} -> {ff.losses[-1]})")
    if second in finished:
        kr = finished[second].result
        a = torch.load(ff.finals[0], weights_only=False)
        b = torch.load(kr.finals[0], weights_only=False)
        diffs = compare_states(a, b, ("model", "optimizer", "scheduler"))
        report["bit_identical"] = not diffs
        if diffs:
            problems.append(f"kill-restore final state differs from failure-free at "
                            f"{diffs[:5]}")
        if kr.restored_from is None and kr.killed_at is not None:
            problems.append("the restarted trainers did not report a restore point")
        elif kr.restored_from is not None:
            repeated = (kr.max_done_before_kill or 0) - kr.restored_from
            report["repeated_iterations"] = repeated
            # With faults, the newest iterations may still be under repair when every trainer
            # (every holder of the missing pieces) dies: the commit-lag bound is 2 more.
            # GoCkpt checkpoints every `every` iterations, each complete `steps` later.
            allowed = (3 if sc.chaos else 1) if sc.gockpt is None else sum(sc.gockpt)
            if "disk" in (kr.restored_sources or []):
                # A shadow died shortly before the trainers (a correlated failure): no
                # iteration was in every shadow's memory any more, so the resume came from
                # the newest checkpoint every partition held: every partition writes every
                # multiple of persist_every, at most (backlog 2 + 1) intervals behind its
                # commits (shadow/persist.py, docs/reliability.md), before that shadow's kill.
                first = min((rs["at"] for rs in kr.restarts), default=kr.killed_at or 0)
                allowed = (kr.max_done_before_kill or 0) - first + 3 * sc.persist_every + 3
            if repeated > allowed and kr.killed_at is not None:
                problems.append(f"{repeated} iterations repeated (at most {allowed} allowed)")
    report["ok"] = not problems
    report["problems"] = problems
    return report


def _table(report: dict[str, Any]) -> None:
    with needs("testbed"):
        from rich.console import Console
        from rich.table import Table

    gk = report.get("gockpt")
    who = (f"GoCkpt every {gk[0]} over {gk[1]} steps" if gk
           else f"{report['shadows']} shadows")
    t = Table(title=f"testbed run {report['scenario']} ({report['mode']} mode, "
                    f"{report['model']}, {report['trainers']} trainers x {who}, "
                    f"{report['steps']} iterations)")
    t.add_column("run", no_wrap=True)
    for col in ("seconds", "loss first -> last", "killed at", "restored from",
                "checkpoint = trainers" if gk else "shadows = trainers"):
        t.add_column(col, justify="right")
    for label, r in report["runs"].items():
        loss = ("-" if r["first_loss"] is None
                else f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}")
        t.add_row(label, f"{r['seconds']:.1f}", loss,
                  str(r["killed_at"] or "-"), str(r["restored_from"] or "-"),
                  {True: "yes", False: "NO", None: "-"}[r["shadows_match_trainers"]])
    c = Console(width=max(Console().width, 100))
    c.print(t)
    if "bit_identical" in report:
        c.print(f"final model+optimizer bit-identical to failure-free: "
                f"{'yes' if report['bit_identical'] else 'NO'}; repeated iterations: "
                f"{report.get('repeated_iterations')}")
    for p in report["problems"]:
        c.print(f"[red]problem:[/red] {p}")
    c.print("[green]OK[/green]" if report["ok"] else "[red]FAILED[/red]")


def _multinode(args: argparse.Namespace, multinode: Any) -> int:
    """A multi-node scenario (testbed/multinode.py): one `checkmate launch` per node."""
    sc = multinode.SCENARIOS[args.scenario]
    config_path = (Path(args.config).resolve() if args.config
                   else multinode.default_config(args.scenario))
    cfg = cfgmod.load(config_path)
    with needs("testbed"):
        from rich.console import Console

    console = Console(stderr=True)
    with ExitStack() as stack:
        if args.workdir:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
            workdir = Path(tempfile.mkdtemp(prefix="run-", dir=args.workdir))
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckm-run-")))
        cl = Cluster(cfg, args.mode, config_path, args.loopback_net, stack)
        report = multinode.execute(sc, cl, workdir, lambda *a: None,
                                   random.Random(args.seed))
    console.print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"{sc.name}: {'OK' if report['ok'] else 'FAILED'}"
          + "".join(f"\nproblem: {p}" for p in report["problems"]))
    return 0 if report["ok"] else 1


def _replica_case(args: argparse.Namespace, replica_cases: Any) -> int:
    """A case with two shadows per partition (testbed/replica_cases.py): host mode, one
    `checkmate launch --replicas 2` on this machine."""
    if args.switch is not None or args.config:
        raise CheckmateError(f"{args.scenario} runs one `checkmate launch --replicas 2` in "
                             "host mode: no --switch or --config")
    with ExitStack() as stack:
        if args.workdir:  # kept
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
            workdir = Path(tempfile.mkdtemp(prefix="run-", dir=args.workdir))
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckm-run-")))
        report = replica_cases.execute(args.scenario, workdir, random.Random(args.seed))
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"{args.scenario}: {'OK' if report['ok'] else 'FAILED'}"
          + "".join(f"\nproblem: {p}" for p in report["problems"]))
    return 0 if report["ok"] else 1


@cli_guard("testbed run")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="testbed run", description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", required=True, help="scenario name or YAML file")
    ap.add_argument("--config", help="cluster config (default: the embedded default)")
    ap.add_argument("--mode", choices=MODES, default="switch")
    ap.add_argument("--json", metavar="OUT", help="write the JSON report to OUT")
    ap.add_argument("--workdir", help="keep logs and states here (default: a temp dir)")
    ap.add_argument("--loopback-net", default=LOOPBACK_NET,
                    help="host mode: first three octets of the loopback addresses")
    ap.add_argument("--seed", type=int, help="seed for a random kill_at")
    ap.add_argument("--switch", choices=("kernel", "bmv2"), default=None,
                    help="switch mode: the config's switch (default), the tc-eBPF kernel "
                         "switch, or bmv2 simple_switch in a mininet network")
    args = ap.parse_args(argv)
    from checkmate.testbed import multinode

    if args.scenario in multinode.SCENARIOS:
        return _multinode(args, multinode)
    from checkmate.testbed import replica_cases

    if args.scenario in replica_cases.CASES:
        return _replica_case(args, replica_cases)
    sc = load_scenario(args.scenario, random.Random(args.seed))
    config_path = Path(args.config).resolve() if args.config else cfgmod.default_path()
    cfg = cfgmod.load(config_path)
    if args.switch is not None and args.mode != "switch":
        raise CheckmateError("--switch picks the switch of --mode switch")
    if args.switch == "bmv2":
        from checkmate.testbed import mininet_bmv2

        cfg = mininet_bmv2.bmv2_config(cfg)
    elif args.switch == "kernel":
        cfg = replace(cfg, switch=replace(cfg.switch, target="kernel"))
    if len(cfg.trainers) < 2 or not cfg.shadows:
        raise CheckmateError("the config needs at least 2 trainers and 1 shadow")
    parts = args.loopback_net.split(".")
    if len(parts) != 3 or parts[0] != "127" or not all(p.isdigit() and int(p) < 256
                                                       for p in parts):
        raise CheckmateError(f"--loopback-net must look like 127.X.Y, got {args.loopback_net}")
    with needs("testbed"):
        from rich.console import Console

    console = Console(stderr=True)

    def progress(label: str, it: int, loss: float) -> None:
        console.print(f"[{label}] iteration {it}/{sc.steps} loss {loss:.4f}", highlight=False)

    with ExitStack() as stack:
        if args.workdir:
            workdir = Path(args.workdir)
            workdir.mkdir(parents=True, exist_ok=True)
            workdir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckm-run-")))
        if args.switch is not None:  # every process reads the switch it asked for
            config_path = workdir / f"cluster-{args.switch}.yaml"
            config_path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        cl = Cluster(cfg, args.mode, config_path, args.loopback_net, stack)
        report = execute(sc, cl, workdir, progress)
    _table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
