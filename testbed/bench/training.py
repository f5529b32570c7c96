"""`testbed bench training`: training throughput with and without per-iteration checkpoints.

One run, same model, same trainers, same ckm ring transport, five ways, alternated in
``--rounds`` rounds (medians reported; the machine is shared and noisy):

  (a) none        no checkpoint at all (ring without REPLICATE tags, no shadows);
  (b) checkmate   per-iteration Checkmate (switch copies the gradients in switch mode; the
                  trainers send 1/N copies themselves in host mode) + rank 0's control message,
                  with repair (replica log, repair thread, protection monitor);
  (b') no-repair  the same without repair (what repair costs a loss-free job);
  (c) dcp-async   torch.distributed.checkpoint.async_save of model + optimizer every iteration;
  (d) torch.save  rank 0 torch.save of model + optimizer every iteration.

Throughput is rank 0's iterations per second (median step interval) after ``--warmup``
iterations. Also reports the CPU the trainers (and, for (b), the shadows, per thread) used
per iteration in that timed window: on a small testbed machine the shadows share the
trainers' cores. Prints a table, the (b)/(c) and (b)/(d) comparisons, and ends with the one
headline line ``checkmate vs no-checkpoint throughput ratio: <x>``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from checkmate.config import cluster as cfgmod
from checkmate.errors import CheckmateError, cli_guard
from checkmate.extras import needs
from checkmate.testbed.bench import rounds

VARIANTS = (("none", "(a) no checkpoint"), ("checkmate", "(b) checkmate"),
            ("norepair", "(b') checkmate, no repair"),
            ("dcp", "(c) dcp async_save"), ("torchsave", "(d) torch.save"))


#: /proc/PID/task/TID/stat fields (after the command) for user and system CPU time.
USER_SYS, SYS = (11, 12), (12,)


def _cpu(pids: list[int], fields: tuple[int, ...] = USER_SYS) -> dict[str, float]:
    """CPU seconds (user + system, or only ``fields``) per thread name over the given
    processes, read from /proc/PID/task/*/stat; a process that exited counts nothing."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                raw = (task / "stat").read_text()
            except OSError:
                continue
            name = raw[raw.index("(") + 1:raw.rindex(")")]
            f = raw.rsplit(")", 1)[1].split()
            out[name] = out.get(name, 0.0) + sum(int(f[i]) for i in fields) / tick
    return out


def _diff(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a.get(k, 0.0) for k in b if b[k] - a.get(k, 0.0) > 0}


class _Window:
    """CPU of shadows and trainers between rank 0's first timed iteration and its last,
    and the part of it spent in the kernel (system time: on the namespace testbed the
    kernel switch's copies run in the sending trainer's context, a Tofino's do not)."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.run = None
        self.start: dict[str, dict[str, float]] = {}
        self.used: dict[str, dict[str, float]] = {}
        self.start_sys: dict[str, dict[str, float]] = {}
        self.used_sys: dict[str, dict[str, float]] = {}

    def _pids(self) -> dict[str, list[int]]:
        return {"shadows": [p.pid for p in self.run.shadows],
                "trainers": [p.pid for p in self.run.trainers]}

    def progress(self, _label: str, it: int, _loss: float) -> None:
        if self.run is None:
            return
        if it == self.first:
            self.start = {k: _cpu(v) for k, v in self._pids().items()}
            self.start_sys = {k: _cpu(v, SYS) for k, v in self._pids().items()}
        elif it == self.last and self.start:
            self.used = {k: _diff(self.start[k], _cpu(v)) for k, v in self._pids().items()}
            self.used_sys = {k: _diff(self.start_sys[k], _cpu(v, SYS))
                             for k, v in self._pids().items()}

    def per_iter_ms(self, who: str, kernel: bool = False) -> float:
        """CPU ms per iteration of ``who`` (all of it, or with ``kernel`` its system time)."""
        used = self.used_sys if kernel else self.used
        return 1000 * sum(used.get(who, {}).values()) / (self.last - self.first)


def _throughput(times: list[float], warmup: int) -> float:
    """Iterations per second from the median step interval after warmup: the machine is
    shared and small, so one descheduled step must not decide the result."""
    import statistics

    if len(times) <= warmup + 2:
        raise CheckmateError("too few iterations to measure; raise --steps")
    gaps = [b - a for a, b in zip(times[warmup:], times[warmup + 1:], strict=False)]
    return 1.0 / statistics.median(gaps)


def _repair_cost(run: Any, steps: int) -> dict[str, float]:
    """Per iteration: assembler ticks and their ms (all shadows), replica log ms (all
    trainers), as the processes counted them."""
    rx = [s.get("receiver") or {} for s in run.shadow_statuses()]
    logs = [st.get("repair") or {} for st in run.result.stats]
    return {"ticks": sum(r.get("ticks", 0) for r in rx) / steps,
            "tick_ms": 1000 * sum(r.get("tick_seconds", 0) for r in rx) / steps,
            "log_ms": 1000 * sum(x.get("log_seconds", 0) for x in logs) / steps}


@cli_guard("testbed bench training")
def main(argv: list[str] | None = None) -> int:
    import statistics

    from checkmate.testbed.cluster import LOOPBACK_NET, Cluster
    from checkmate.testbed.runner import Run
    from checkmate.testbed.scenario import Scenario
    from checkmate.testbed.topology import config_to_dict

    ap = argparse.ArgumentParser(prog="testbed bench training", description=__doc__)
    ap.add_argument("--mode", choices=("switch", "host"),
                    default="switch" if os.geteuid() == 0 else "host")
    ap.add_argument("--config", help="cluster config (default: embedded, prefix 'tebt')")
    ap.add_argument("--model", default="gpt", choices=("gpt", "cnn"))
    ap.add_argument("--width", type=int, default=256, help="model width")
    ap.add_argument("--steps", type=int, default=48,
                    help="iterations per run (12 timed ones left rounds ±5%% apart)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds (medians)")
    ap.add_argument("--variants", default=",".join(k for k, _ in VARIANTS),
                    help="comma-separated subset of " + ", ".join(k for k, _ in VARIANTS)
                    + " (none and checkmate are always run)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    if args.steps < args.warmup + 3:
        raise CheckmateError("--steps must exceed --warmup by at least 3")
    if args.rounds < 1:
        raise CheckmateError("--rounds must be >= 1")
    labels = dict(VARIANTS)
    chosen = set(args.variants.split(",")) | {"none", "checkmate"}
    if chosen - set(labels):
        raise CheckmateError(f"unknown variant(s) {', '.join(sorted(chosen - set(labels)))} "
                             f"(known: {', '.join(labels)})")
    kinds = [k for k, _ in VARIANTS if k in chosen]
    cfg = cfgmod.load(args.config) if args.config else cfgmod.with_prefix(
        cfgmod.load(cfgmod.default_path()), "tebt")
    sc = Scenario("bench", args.model, args.steps, 0)
    its: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    shadow_ms: list[float] = []
    # What repair costs per iteration on a loss-free job, measured where it is spent rather
    # than in throughput (which drowns it in this machine's noise): the shadows' assembler
    # ticks (repair scheduling) and the trainers' time retaining pieces in the replica log,
    # all processes together.
    costs: dict[str, list[dict[str, float]]] = {"checkmate": [], "norepair": []}
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckm-bench-")))
        cfg_path = work / "cluster.yaml"
        cfg_path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        cl = Cluster(cfg, args.mode, cfg_path, "127.77.9" if args.mode == "host"
                     else LOOPBACK_NET, stack)
        for rnd in range(args.rounds):
            # Alternate the order each round so no variant always runs first (warm caches)
            # or last (a machine that got busier).
            for kind in (kinds if rnd % 2 == 0 else kinds[::-1]):
                win = _Window(args.warmup + 1, args.steps)
                run = Run(cl, sc, work, f"{kind}-{rnd}", win.progress)
                win.run = run
                ckdir = work / f"ckpt-{kind}-{rnd}"
                ckdir.mkdir()
                ckpt = "checkmate" if kind == "norepair" else kind
                run.extra_job = {"ckpt": ckpt, "ckpt_dir": str(ckdir),
                                 "model_kw": {"width": args.width},
                                 "repair": kind != "norepair"}
                try:
                    if ckpt == "checkmate":
                        run.start_shadows()
                    run.start_trainers(resume=False)
                    run.follow(None)
                    if ckpt == "checkmate":
                        costs[kind].append(_repair_cost(run, args.steps))
                finally:
                    run.stop()
                its[kind].append(_throughput(run.result.times, args.warmup))
                cpu[kind].append(win.per_iter_ms("trainers"))
                if kind == "checkmate":
                    shadow_ms.append(win.per_iter_ms("shadows"))
                print(f"round {rnd + 1} {labels[kind]:<26} {its[kind][-1]:8.3f} it/s   "
                      f"trainers {cpu[kind][-1]:6.1f} CPU ms/iteration", flush=True)
    med = {k: statistics.median(v) for k, v in its.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    with needs("bench"):
        from rich.console import Console
        from rich.table import Table

    t = Table(title=f"training throughput, {args.model} width {args.width}, "
                    f"{len(cfg.trainers)} trainers, {args.mode} mode, iterations "
                    f"{args.warmup + 1}..{args.steps}, median of {args.rounds} rounds")
    t.add_column("variant")
    t.add_column("it/s", justify="right")
    t.add_column("vs (a)", justify="right")
    t.add_column("rounds: median (range)")
    t.add_column("trainer CPU ms/it", justify="right")
    t.add_column("CPU vs (a)", justify="right")
    for kind in kinds:
        rs = rounds.paired(its[kind], its["none"])
        t.add_row(labels[kind], f"{med[kind]:.3f}",
                  f"{statistics.median(rs):.3f}" if rs else "-",
                  "-" if kind == "none" else rounds.verdict(rs),
                  f"{med_cpu[kind]:.1f}", f"{med_cpu[kind] / med_cpu['none']:.3f}")
    Console().print(t)
    print(f"shadows: {statistics.median(shadow_ms):.1f} CPU ms per timed iteration (median)")
    for kind, cs in costs.items():
        if cs:
            med_cost = {k: statistics.median(c[k] for c in cs) for k in cs[0]}
            print(f"{labels[kind]}: shadows' assembler ticks {med_cost['ticks']:.1f} per "
                  f"iteration taking {med_cost['tick_ms']:.3f} ms, trainers' replica log "
                  f"{med_cost['log_ms']:.3f} ms per iteration (medians)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "mode": args.mode, "width": args.width, "steps": args.steps,
            "rounds": args.rounds, "its": its, "median_its": med,
            "trainer_cpu_ms_per_iter": med_cpu, "shadow_ms_per_iter": shadow_ms,
            "repair_cost_per_iter": costs}, indent=1))
    # Only the headline line may match "ratio: " (the bench convention: exactly one).
    for kind, label in (("dcp", "(b)/(c) checkmate vs dcp async_save"),
                        ("torchsave", "(b)/(d) checkmate vs torch.save"),
                        ("norepair", "(b)/(b') checkmate with vs without repair")):
        if kind in med:
            print(f"{label} throughput: "
                  f"{rounds.verdict(rounds.paired(its['checkmate'], its[kind]))}")
    if "norepair" in med:
        pr = rounds.paired(its["checkmate"], its["norepair"])
        print(f"(b)/(b') per round: {' '.join(f'{x:.3f}' for x in pr)} "
              f"(median {statistics.median(pr):.3f})")
        print(f"(b')/(a) checkmate without repair vs no checkpoint throughput: "
              f"{rounds.verdict(rounds.paired(its['norepair'], its['none']))}")
    head = rounds.paired(its["checkmate"], its["none"])
    print(f"(b)/(a) per round: {' '.join(f'{x:.3f}' for x in head)}; trainer CPU ms per "
          f"iteration {med_cpu['checkmate']:.1f} vs {med_cpu['none']:.1f} "
          f"({med_cpu['checkmate'] / med_cpu['none']:.3f})")
    print(f"checkmate vs no-checkpoint throughput ratio: {statistics.median(head):.3f}"
          + ("" if rounds.resolved(head, 1.0) else
             f" (unresolved: rounds {rounds.spread(head)})"))
    return 0
