"""`testbed chaos`: the reliability suite -- every fault case checked bit-exact.

    testbed chaos [--cases NAME,...] [--repeat N] [--seed S] [--steps N] [--out FILE]

Each case is a scenario (testbed.scenario) run in switch mode on the namespace testbed: the
job with the case's faults, whose final model, optimizer and scheduler state must be
bit-identical to a failure-free reference run of the same job (one per step count, shared by
the cases: training is deterministic); the shadows must end
equal to the trainers and protecting the last iteration. Cases with a random iteration are
repeated ``--repeat`` times with draws from ``--seed``. A table goes to the terminal and,
with ``--out``, a Markdown report (docs/reliability.md) with the command and seed. The
last line is ``chaos ratio: <passed/total>``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from checkmate.config import cluster as cfgmod
from checkmate.errors import CheckmateError, cli_guard
from checkmate.extras import needs
from checkmate.testbed.scenario import parse_scenario


def cases(steps: int) -> dict[str, dict[str, Any]]:
    """Case name -> scenario body (without name/model; ``steps`` only where a case needs
    fewer iterations than ``steps``), in report order.

    Cases that restart a process mid-run (seconds to start, at tens of ms per iteration)
    or wait out a 5 s repair escalation take ``steps``; loss, corruption, trainer kills and
    the full disk prove their point in ``short`` (2/5 of it, 120 of the default 300).
    """
    short = max(30, steps * 2 // 5)
    late = short - short // 4
    out: dict[str, dict[str, Any]] = {}
    for p in (0.001, 0.01, 0.05):
        for s in ("s0", "s1"):
            out[f"replica-drop-{p * 100:g}%-{s}"] = {
                "faults": [{"port": s, "drop": p}], "kill_at": late, "steps": short}
    for s in ("s0", "s1"):
        out[f"replica-corrupt-1%-{s}"] = {"faults": [{"port": s, "corrupt": 0.01}],
                                          "kill_at": late, "steps": short}
    # Every datagram of one iteration to s0 is lost, repair answers included: the shadow
    # must give up on repair, ask for a re-seed and end protected.
    out["blackout-one-iteration-s0"] = {"faults": [{"port": "s0", "drop": 1.0,
                                                    "from": steps // 3, "until": steps // 3}]}
    for p in (0.01, 0.05):
        out[f"trainer-drop-{p * 100:g}%-t1"] = {"faults": [{"port": "t1", "drop": p}],
                                                "kill_at": late, "steps": short}
    # "R": a random partition; "E": a random iteration in the first third, so a shadow
    # restarted mid-run (seconds to start) rejoins before the job ends.
    out["shadow-restart-empty"] = {"shadow_kills": [{"partition": "R", "at": "E"}]}
    out["shadow-restart-disk"] = {"shadow_kills": [{"partition": "R", "at": "E",
                                                    "disk": True}], "persist_every": 5}
    # A correlated failure (a rack or power domain): a shadow and then every trainer die a
    # few iterations apart, before the restarted shadow is current again; the resume must
    # come from disk (checkmate.train.resume_point). "kill_after_shadow": kill_at is that
    # many iterations after the shadow kill.
    out["shadow-and-trainers-kill"] = {"shadow_kills": [{"partition": "R", "at": "E",
                                                         "disk": True}],
                                       "persist_every": 5, "kill_after_shadow": 6}
    # Every shadow SIGKILLed at one iteration and restarted from disk: the trainers must say
    # at once that the job is unprotected, and protection must return by itself.
    out["all-shadows-restart-disk"] = {"every_shadow": {"disk": True}, "persist_every": 5}
    # Every shadow restarted empty while 2 busy processes per core load the machine: the
    # registrations must converge (one epoch each) and the re-seeds finish.
    out["shadows-restart-under-load"] = {"every_shadow": {"disk": False}, "cpu_load": 4}
    # A bit of one shadow's committed state flips (silent data corruption in its memory):
    # the trainers' state digests every 5 iterations must find it at the first check after
    # it, the partition be re-seeded live and equal to the trainers' again (issue 35).
    out["shadow-bit-flip"] = {"shadow_flip": {"partition": "R", "at": "E"}, "verify_every": 5,
                              "steps": short}
    # A bit of one trainer's parameters flips (silent data corruption on a GPU): replica
    # agreement every 5 iterations must name that rank at the first check after it, and the
    # job rewind to the check before (the corrupted copy fed the shadows since) and end
    # bit-identical (issue 35).
    out["trainer-bit-flip"] = {"trainer_flip": {"rank": "R", "at": "E"}, "verify_every": 5,
                               "steps": short}
    # Every gradient copy to s1 of one iteration rewritten on the path keeping its CRC32C
    # (the switch's swap knob: what docs/security.md says the tags cannot see): the state
    # check must find it at the first check after, and s1 be re-seeded.
    out["payload-swap-s1"] = {"faults": [{"port": "s1", "swap": 1.0, "from": short // 5,
                                          "until": short // 5}],
                              "verify_every": 5, "steps": short}
    out["trainer-kill-after-step"] = {"kill_at": "random", "steps": short}
    out["trainer-kill-before-control"] = {"kill_at": "random", "kill_phase": "before-control",
                                          "steps": short}
    out["controller-restart"] = {"controller_restart_at": "random",
                                 "kill_at": steps - steps // 4}
    # Partition 1's checkpoints (~775 KiB each in the torch layout) go to a 1800 KiB tmpfs:
    # two fit, then the disk is full.
    out["disk-full-s1"] = {"persist_every": 10, "keep": 2, "kill_at": late, "steps": short,
                           "disk_limit": {"partition": 1, "kib": 1800}}
    # Issue 23's attacks on the live job, from another host's port. t3 claims s0's MAC and
    # address all run long (the switch must drop it all and keep s0's entry; the trainers
    # then die and resume from the shadows, so s0 must have kept every copy). s1 floods
    # s0's TCP service, and s0 is restarted empty meanwhile: the trainers must still get
    # through to re-seed it.
    out["attack-mac-hijack-s0"] = {"attacks": [{"kind": "mac_hijack", "from": "t3",
                                                "target": "s0", "at": 2}], "kill_at": late,
                                   "steps": short}
    out["attack-conn-flood-s0"] = {"attacks": [{"kind": "conn_flood", "from": "s1",
                                                "target": "s0", "at": 2}],
                                   "shadow_kills": [{"partition": 0, "at": "E"}]}
    # Hostile datagrams and messages at the shadows while the job trains
    # (checkmate.testbed.stream_attacks); each must end bit-exact and protected, its
    # datagrams counted as dropped, no receive thread lost.
    for a in ("forged-control", "deep-json", "other-partition", "refused-peers",
              "replay-other-run"):
        out[f"attack-{a}"] = {"stream_attacks": [a]}
    # A node lost (testbed/multinode.py): one `checkmate launch` per node on its own
    # cluster (testbed/multinode.yaml), a spare replacing it or the job shrinking.
    from checkmate.testbed import multinode

    for name in multinode.SCENARIOS:
        out[name] = {"multinode": True}
    # Two shadows per partition (testbed/replica_cases.py): one `checkmate launch
    # --replicas 2` in host mode, a replica lost, or both of a partition's and a trainer.
    from checkmate.testbed import replica_cases

    for name in replica_cases.CASES:
        out[name] = {"replicas": True}
    return out


RANDOM = {"multinode-kill-node", "multinode-shrink", "multinode-colocate-kill-node",
          "multinode-colocate-kill-replica", "multinode-colocate-kill-replicas-and-node",
          "attack-conn-flood-s0",
          "replicas-kill-one", "replicas-kill-both-and-trainer",
          "shadow-restart-empty", "shadow-restart-disk", "shadow-bit-flip", "trainer-bit-flip",
          "shadow-and-trainers-kill", "all-shadows-restart-disk", "shadows-restart-under-load",
          "trainer-kill-after-step",
          "trainer-kill-before-control", "controller-restart"}


def _row(name: str, rep: dict[str, Any], seconds: float) -> dict[str, Any]:
    run = rep["runs"].get("chaos") or rep["runs"].get("kill-restore") or {}
    rj = run.get("rejoins") or []
    return {"case": name, "ok": rep["ok"], "bit_identical": rep.get("bit_identical"),
            "kill_at": rep.get("kill_at"), "repeated": rep.get("repeated_iterations"),
            "lag_max": run.get("commit_lag_max"), "repair_overhead": run.get(
                "repair_overhead"), "repairs": run.get("repair_answers"),
            "reseeds": run.get("reseeds"), "rejoin": rj[0].get("iterations") if rj else None,
            "to_current_s": rj[0].get("reseed_seconds") if rj else None,
            "epochs": run.get("epochs_minted"),
            "persist_errors": sum(p.get("errors") or 0 for p in run.get("persist") or []),
            "restart_at": rj[0].get("at") if rj else None,
            "problems": "; ".join(rep.get("problems", []))[:200], "seconds": round(seconds, 1)}


_COLS = ("case", "ok", "bit_identical", "kill_at", "repeated", "lag_max", "repair_overhead",
         "repairs", "reseeds", "restart_at", "rejoin", "to_current_s", "epochs",
         "persist_errors", "seconds")


#: The generated part of docs/reliability.md lies between these lines; the prose around
#: them is kept when ``--out`` names a file that has them.
BEGIN, END = "<!-- testbed chaos: begin -->", "<!-- testbed chaos: end -->"


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per case over its repeats: passes, worst lag, median repair overhead,
    rejoin range, most repeated iterations."""
    out: list[dict[str, Any]] = []
    for name in dict.fromkeys(r["case"] for r in rows):
        rs = [r for r in rows if r["case"] == name]
        lags = [r["lag_max"] for r in rs if r["lag_max"] is not None]
        over = [r["repair_overhead"] for r in rs if r["repair_overhead"] is not None]
        rj = [r["rejoin"] for r in rs if r["rejoin"] is not None]
        rep = [r["repeated"] for r in rs if r["repeated"] is not None]
        cur = [r["to_current_s"] for r in rs if r.get("to_current_s") is not None]
        med = _median(over)
        out.append({
            "case": name, "passed": f"{sum(bool(r['ok']) for r in rs)}/{len(rs)}",
            "lag_max": max(lags) if lags else None,
            "repair_overhead_median": None if med is None else f"{med * 100:.2f}%",
            "rejoin_min/median/max": (f"{min(rj)}/{_median(rj):g}/{max(rj)}" if rj else None),
            "to_current_s_max": max(cur) if cur else None,
            "repeated_max": max(rep) if rep else None,
            "persist_errors": sum(r["persist_errors"] or 0 for r in rs)})
    return out


def _table(rows: list[dict[str, Any]], cols: tuple[str, ...]) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r[c] is None else str(r[c]) for c in cols)
                     + " |")
    return lines


_SUMMARY_COLS = ("case", "passed", "lag_max", "repair_overhead_median",
                 "rejoin_min/median/max", "to_current_s_max", "repeated_max",
                 "persist_errors")


def markdown(rows: list[dict[str, Any]], argv: list[str], seed: int) -> str:
    """The generated block: command, seed, summary per case, every run, failures."""
    cmd = " ".join(["sudo .venv/bin/testbed chaos", *argv])
    lines = [BEGIN, "", "Generated by:", "", f"    {cmd}", "",
             f"Seed {seed}. Each case runs a 4-trainer x 2-shadow GPT job on the namespace "
             "testbed (kernel switch) twice -- failure-free, then with the case's faults -- "
             "and checks the final model, optimizer and scheduler state bit for bit, the "
             "shadows against the trainers, and that the last iteration ends protected. "
             "`lag_max` is the most iterations the trainers were ahead of a shadow's commit; "
             "`repair_overhead` the repair answer bytes over the replica bytes; `rejoin` the "
             "iterations from a shadow's SIGKILL to its first commit after restarting "
             "(restart, re-register, re-seed); `to_current_s` the seconds from the "
             "re-seed being asked for to the restarted shadow's commit; `epochs` the "
             "registrations the controller made (one per shadow start); `repeated` the "
             "iterations a restore recomputed.", "", "Per case:", ""]
    lines += _table(summary(rows), _SUMMARY_COLS)
    lines += ["", "Every run:", ""]
    lines += _table(rows, _COLS)
    bad = [r for r in rows if not r["ok"]]
    lines += ["", f"{len(rows) - len(bad)} of {len(rows)} runs passed."]
    for r in bad:
        lines.append(f"- {r['case']}: {r['problems']}")
    lines += ["", END]
    return "\n".join(lines) + "\n"


def write_report(path: Path, block: str) -> None:
    """Replace the generated block of ``path`` (keeping the prose around it), or write a
    new file holding only the block."""
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        path.write_text(head + block.rstrip("\n") + tail)
    else:
        path.write_text("# Reliability: the chaos suite\n\n" + block)


def draw(name: str, body: dict[str, Any], steps: int, seed: int, partitions: int,
         rng: random.Random, trainers: int = 2) -> Any:
    """The case's scenario with its random partition ("R"), early iteration ("E"),
    ``every_shadow`` (one kill per partition at one early iteration) and
    ``kill_after_shadow`` resolved (draws from ``rng`` in a fixed order)."""
    body = dict(body)
    steps = body.pop("steps", steps)
    body["shadow_kills"] = [{**k, "partition": rng.randrange(partitions)
                             if k.get("partition", "R") == "R" else k["partition"],
                             "at": rng.randint(max(1, steps // 10), steps // 3)}
                            for k in body.get("shadow_kills", [])]
    every = body.pop("every_shadow", None)
    if every is not None:  # every partition's shadow, at one drawn early iteration
        at = rng.randint(max(1, steps // 10), steps // 3)
        body["shadow_kills"] = [{**every, "partition": p, "at": at} for p in range(partitions)]
    for key, who, count in (("shadow_flip", "partition", partitions),
                            ("trainer_flip", "rank", trainers)):
        f = body.get(key)
        if f is not None:  # "R": a random partition or rank; "E": an early iteration
            body[key] = {who: rng.randrange(count) if f[who] == "R" else f[who],
                         "at": rng.randint(max(1, steps // 10), steps // 3)
                         if f["at"] == "E" else f["at"]}
    after = body.pop("kill_after_shadow", None)
    if after is not None:
        body["kill_at"] = min(body["shadow_kills"][0]["at"] + after, steps - 1)
    return parse_scenario({"name": name, "model": "gpt", "steps": steps, "seed": seed,
                           **body}, name, rng)


def _remove_if_empty(d: Path) -> None:
    """The suite's work directory goes once no failed case's logs are left in it."""
    try:
        d.rmdir()
    except OSError:
        pass


def _multinode(name: str, case_dir: Path, rng: random.Random) -> dict[str, Any]:
    """A multi-node case on its own namespace cluster (testbed/multinode.yaml), brought
    up for the case and down after it (its prefix differs from the suite's)."""
    from checkmate.testbed import multinode
    from checkmate.testbed.cluster import Cluster

    case_dir.mkdir(parents=True, exist_ok=True)
    path = multinode.default_config(name)
    with ExitStack() as stack:
        cl = Cluster(cfgmod.load(path), "switch", path, "", stack)
        rep = multinode.execute(multinode.SCENARIOS[name], cl, case_dir, None, rng)
    rep.setdefault("runs", {})
    return rep


@cli_guard("testbed chaos")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="testbed chaos", description=__doc__.splitlines()[0])
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each random case")
    ap.add_argument("--seed", type=int, default=0)
    # The GPT's iterations take tens of ms here; a restarted shadow takes seconds to start.
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--config", help="cluster config (default: the embedded default)")
    ap.add_argument("--out", help="write the Markdown report here (docs/reliability.md)")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    args = ap.parse_args(argv)
    known = cases(args.steps)
    if args.list:
        print("\n".join(known))
        return 0
    names = args.cases.split(",") if args.cases else list(known)
    bad = [n for n in names if n not in known]
    if bad:
        raise CheckmateError(f"unknown case(s) {', '.join(bad)} (known: {', '.join(known)})")
    if args.repeat < 1 or args.steps < 30:
        raise CheckmateError("--repeat must be >= 1 and --steps >= 30")
    from checkmate.testbed.cluster import Cluster
    from checkmate.testbed.run import execute, reference

    rng = random.Random(args.seed)
    config_path = Path(args.config).resolve() if args.config else cfgmod.default_path()
    cfg = cfgmod.load(config_path)
    rows: list[dict[str, Any]] = []

    def progress(label: str, it: int, loss: float) -> None:
        pass

    # A passed case's logs are removed; a failed case's are kept (their path is printed and
    # in its problems), so its cause can be known after the suite.
    # Training is deterministic: one failure-free reference run per step count serves every
    # case (each case used to run its own, half the suite's time).
    workdir = Path(tempfile.mkdtemp(prefix="ckm-chaos-"))
    refs: dict[int, Any] = {}
    with ExitStack() as stack:
        stack.callback(_remove_if_empty, workdir)
        cl = Cluster(cfg, "switch", config_path, "", stack)
        for name in names:
            for rep_i in range(args.repeat if name in RANDOM else 1):
                multi = bool(known[name].get("multinode") or known[name].get("replicas"))
                sc = None if multi else draw(name, known[name], args.steps, args.seed,
                                             cfg.num_partitions, rng, len(cfg.trainers))
                t0 = time.perf_counter()
                if sc is not None and sc.steps not in refs:
                    ref_dir = workdir / f"reference-{sc.steps}"
                    ref = reference(sc, cl, ref_dir, progress)
                    if ref.problems:
                        raise CheckmateError(f"the failure-free reference run failed "
                                             f"({'; '.join(ref.problems)[:300]}); logs kept "
                                             f"in {ref_dir}")
                    # kept with the failed cases' logs (their reference), else removed
                    stack.callback(lambda d=ref_dir: all(r["ok"] for r in rows)
                                   and shutil.rmtree(d, ignore_errors=True))
                    refs[sc.steps] = ref
                    print(f"reference run of {sc.steps} iterations: "
                          f"{time.perf_counter() - t0:.0f}s", flush=True)
                    t0 = time.perf_counter()
                case_dir = workdir / f"{name}-{rep_i}"
                try:
                    if sc is None and known[name].get("replicas"):
                        from checkmate.testbed import replica_cases

                        rep = replica_cases.execute(name, case_dir, rng)
                    elif sc is None:
                        rep = _multinode(name, case_dir, rng)
                    else:
                        rep = execute(sc, cl, case_dir, progress, refs[sc.steps])
                except CheckmateError as e:
                    rep = {"ok": False, "runs": {}, "problems": [str(e)]}
                if rep["ok"]:
                    shutil.rmtree(case_dir, ignore_errors=True)
                else:
                    rep["problems"] = [*rep.get("problems", []), f"logs kept in {case_dir}"]
                    print(f"testbed chaos: {name} failed; logs kept in {case_dir}",
                          file=sys.stderr, flush=True)
                row = _row(name, rep, time.perf_counter() - t0)
                rows.append(row)
                print(" ".join(f"{c}={row[c]}" for c in _COLS), flush=True)
                for a in rep.get("attacks", []):  # what an attack did and what it met
                    print(f"  attack {json.dumps(a, sort_keys=True)}", flush=True)
    with needs("testbed"):
        from rich.console import Console
        from rich.table import Table

    t = Table(title="testbed chaos")
    for c in _COLS:
        t.add_column(c)
    for r in rows:
        t.add_row(*("-" if r[c] is None else str(r[c]) for c in _COLS))
    Console(width=160).print(t)
    if args.out:
        write_report(Path(args.out), markdown(rows, argv, args.seed))
    passed = sum(r["ok"] for r in rows)
    print(f"chaos ratio: {passed / len(rows):.3f}")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
