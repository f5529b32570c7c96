"""`testbed bench schemes`: every checkpoint scheme on one workload where checkpoints matter.

One harness, one model, one run; the schemes are alternated in ``--rounds`` rounds (the
order reversed every other round) and reported as medians:

  none           no checkpoint (the reference)
  torchsave      rank 0 torch.save of model + optimizer, synchronous
  dcp            torch.distributed.checkpoint.async_save, defaults (thread)
  dcp-process    async_save in process mode with the DefaultStager (shared memory, staging
                 in the background; pinned memory only where an accelerator exists)
  checkfreq      CheckFreq-style: synchronous snapshot to CPU buffers, background persist
  gockpt         GoCkpt mode: state transfer spread over k >= 2 steps, rolled forward on a
                 local CPU process per rank, persisted with DCP (checkmate.gockpt.trainer); run at
                 ``--interval`` only, with k = min(4, interval)
  proc-copy      GoCkpt's machinery with k = 1 at every iteration: the whole partition is
                 copied to the local process at each checkpoint, nothing is spread over
                 steps, so it is not GoCkpt and is not called so
  checkmate      Checkmate host mode: trainers send the copies, shadows on this machine
  none-switch,   the same two on the namespace testbed through the kernel (eBPF) switch, where
  checkmate-switch  the switch copies the gradients (root only; --no-switch skips them)

Periodic schemes run at every iteration and at ``--interval``; GoCkpt needs an interval of
at least 2 to spread its transfer, so at every iteration its machinery runs as
``proc-copy`` (k = 1) and GoCkpt itself runs at ``--interval`` only. Throughput is rank
0's mean rate over the timed iterations (a median step interval would hide a checkpoint
taken every 8th step). From the every-iteration runs the bench derives each scheme's stall
per checkpoint and, with ``--mtbf`` and ``--load``, its Young/Daly best interval and
effective throughput (checkmate.launch.plan); the ``--interval`` runs check that model against a
measurement. Each run also reports the trainers' and the shadows' CPU per iteration, and of
the trainers' the part in the kernel (system time: on the namespace testbed the kernel
switch's copies are made in the sending trainer's context).

The workload (``--width``/``--layers``, default 25.4 M parameters: 102 MB of parameters, 305
MB of model + AdamW state) runs with the accelerator stand-in by default (``--stand-in``
seconds of compute per step instead of forward/backward: checkmate.testbed.models.StandIn),
so the checkpoint-cost-to-step-time ratio is that of a GPU job, not of this CPU's forward
pass; the allreduce, the checkpoint work and the shadows are real and share this machine's
cores. Ends with ``checkmate vs dcp-async ratio: <x>`` (every-iteration throughputs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from math import nan
from pathlib import Path
from typing import Any

import yaml

from checkmate.config import cluster as cfgmod
from checkmate.errors import CheckmateError, cli_guard
from checkmate.extras import needs

SCHEMES = ("none", "torchsave", "dcp", "dcp-process", "checkfreq", "proc-copy", "gockpt",
           "checkmate", "none-switch", "checkmate-switch")
PERIODIC = ("torchsave", "dcp", "dcp-process", "checkfreq")
#: Schemes run at ``--interval`` only (GoCkpt spreads its transfer over k = min(4, interval)).
INTERVAL_ONLY = ("gockpt",)
#: Schemes run at every iteration only (proc-copy: GoCkpt's process with k = 1).
EVERY_ONLY = ("proc-copy",)


def mean_rate(times: list[float], warmup: int) -> float:
    """Iterations per second over the timed window (first timed step to the last)."""
    t = times[warmup:]
    if len(t) < 3:
        raise CheckmateError("too few iterations to measure; raise --steps")
    return (len(t) - 1) / (t[-1] - t[0])


def _keep_logs(d: Path) -> str:
    """Copy a failed run's logs out of the bench's temporary directory; where that fails
    too (a full disk), say so instead of losing the rounds."""
    import shutil

    try:
        keep = Path(tempfile.mkdtemp(prefix=f"ckm-bench-failed-{d.name}-"))
        for f in d.glob("*.log"):
            shutil.copy(f, keep)
    except OSError as e:
        return f"not kept: {e}"
    return f"kept in {keep}"


def _configs(schemes: list[str], interval: int, switch: bool) -> list[tuple[str, int]]:
    out = []
    for s in schemes:
        if s.endswith("-switch") and not switch:
            continue
        if s in INTERVAL_ONLY:
            if interval > 1:
                out.append((s, interval))
            else:
                print(f"{s}: skipped (it needs --interval >= 2 to spread its transfer)",
                      flush=True)
            continue
        out.append((s, 1))
        if s in PERIODIC and interval > 1:
            out.append((s, interval))
    return out


def _job(scheme: str, every: int, ckdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    base = scheme.removesuffix("-switch")
    job: dict[str, Any] = {"ckpt": base, "ckpt_dir": str(ckdir), "ckpt_every": every,
                           "model_kw": {"width": args.width, "layers": args.layers},
                           "stand_in": args.stand_in if args.stand_in > 0 else None}
    if base == "gockpt":
        job["ckpt_steps"] = min(4, every)
    elif base == "proc-copy":  # the worker knows it as GoCkpt mode with one step per window
        job["ckpt"], job["ckpt_steps"] = "gockpt", 1
    return job


@dataclass(frozen=True)
class Measured:
    """One run's figures: rank 0's mean rate, trainer and shadow CPU ms per iteration, and
    of the trainers' CPU the part in the kernel (system time)."""

    rate: float
    trainer_cpu: float
    shadow_cpu: float
    trainer_sys: float = float("nan")


@dataclass
class Rounds:
    """Every configuration's figures per round, None where that round's run failed, and
    the failures themselves (round, error)."""

    rates: dict[str, list[float | None]] = field(default_factory=dict)
    trainer_cpu: dict[str, list[float | None]] = field(default_factory=dict)
    shadow_cpu: dict[str, list[float | None]] = field(default_factory=dict)
    trainer_sys: dict[str, list[float | None]] = field(default_factory=dict)
    failed: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def run_rounds(configs: list[tuple[str, int]], n: int,
               one: Callable[[str, int, int], Measured]) -> Rounds:
    """Run every configuration once per round, the order reversed every other round. A run
    that fails (CheckmateError) costs its own cell, not the other rounds: it is recorded as
    None with its error, printed, and the rounds go on; the caller exits non-zero."""
    out = Rounds()
    for scheme, every in configs:
        key = f"{scheme}@{every}"
        for table in (out.rates, out.trainer_cpu, out.shadow_cpu, out.trainer_sys):
            table[key] = []
    for rnd in range(n):
        for scheme, every in (configs if rnd % 2 == 0 else configs[::-1]):
            key = f"{scheme}@{every}"
            try:
                m: Measured | None = one(scheme, every, rnd)
            except CheckmateError as e:
                m = None
                out.failed.setdefault(key, []).append({"round": rnd + 1, "error": str(e)})
                print(f"round {rnd + 1} {key:<22} FAILED: {e}", flush=True)
            out.rates[key].append(None if m is None else m.rate)
            out.trainer_cpu[key].append(None if m is None else m.trainer_cpu)
            out.shadow_cpu[key].append(None if m is None else m.shadow_cpu)
            out.trainer_sys[key].append(None if m is None else m.trainer_sys)
            if m is not None:
                print(f"round {rnd + 1} {key:<22} {m.rate:7.3f} it/s  trainers "
                      f"{m.trainer_cpu:7.1f} CPU ms/it (kernel {m.trainer_sys:6.1f})  "
                      f"shadows {m.shadow_cpu:6.1f}", flush=True)
    return out


def planned(results: dict[str, Any], mtbf_s: float, load_s: float) -> dict[str, Any]:
    """Per scheme, from the every-iteration medians: stall per checkpoint, best interval,
    waste and effective throughput by the Young/Daly model (checkmate.launch.plan)."""
    from checkmate.launch.plan import Scheme, plan

    out: dict[str, Any] = {}
    for key, ref in (("", "none"), ("-switch", "none-switch")):
        base = results.get(f"{ref}@1")
        if base is None:
            continue
        step = 1.0 / base
        for name, rate in results.items():
            scheme, every = name.split("@")
            if every != "1" or scheme == ref or not scheme.endswith(key) or (
                    not key and scheme.endswith("-switch")):
                continue
            stall = max(0.0, 1.0 / rate - step)
            every_step = scheme.startswith("checkmate")
            # Checkmate's checkpoint is every step and its cost is in the step itself (its
            # measured rate), not a stall the model adds on top.
            p = plan(Scheme(scheme, 0.0 if every_step else stall, load_s, every_step), step,
                     mtbf_s)
            eff = (rate / base if every_step else 1.0) * p.throughput
            out[scheme] = {"stall_s": stall, "best_interval": p.interval,
                           "n_star": p.n_star, "waste": p.waste,
                           "lost_per_failure_s": p.lost_per_failure_s,
                           "effective_vs_none": eff}
    return out


@cli_guard("testbed bench schemes")
def main(argv: list[str] | None = None) -> int:
    from checkmate.launch.plan import _seconds
    from checkmate.testbed.bench.training import _Window
    from checkmate.testbed.cluster import LOOPBACK_NET, Cluster
    from checkmate.testbed.runner import Run
    from checkmate.testbed.scenario import Scenario
    from checkmate.testbed.topology import config_to_dict

    ap = argparse.ArgumentParser(prog="testbed bench schemes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default=",".join(SCHEMES),
                    help="comma-separated subset (none is always run)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--stand-in", type=float, default=0.5, metavar="SECONDS",
                    help="accelerator stand-in compute per step; 0: real CPU forward/backward")
    ap.add_argument("--steps", type=int, default=26)
    ap.add_argument("--warmup", type=int, default=8,
                    help="untimed iterations; at least --interval, so that every scheme's "
                    "first checkpoint (process start-up, compilation) is not timed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--interval", type=int, default=8,
                    help="the periodic schemes' second interval (0: every iteration only)")
    ap.add_argument("--mtbf", default="3h", help="for the Young/Daly best interval")
    ap.add_argument("--load", default="30s", help="time to load a checkpoint after a failure")
    ap.add_argument("--no-switch", action="store_true",
                    help="skip the switch-mode pair (needs root and the namespace testbed)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    if args.steps < args.warmup + 3 or args.rounds < 1 or args.interval < 0:
        raise CheckmateError("need --steps > --warmup + 2, --rounds >= 1, --interval >= 0")
    if args.interval and args.steps - args.warmup < 2 * args.interval:
        raise CheckmateError("--steps must time at least two --interval periods")
    chosen = ["none"] + [s for s in args.schemes.split(",") if s and s != "none"]
    unknown = sorted(set(chosen) - set(SCHEMES))
    if unknown:
        raise CheckmateError(f"unknown scheme(s) {', '.join(unknown)} (known: "
                             f"{', '.join(SCHEMES)})")
    if any(s.endswith("-switch") for s in chosen) and "none-switch" not in chosen:
        chosen.append("none-switch")
    switch = not args.no_switch and os.geteuid() == 0
    mtbf_s, load_s = _seconds(args.mtbf), _seconds(args.load)
    configs = _configs(chosen, args.interval, switch)
    sc = Scenario("bench-schemes", "gpt", args.steps, 0)
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckm-bench-")))
        clusters: dict[str, Any] = {}
        for kind in ("host", "switch") if switch else ("host",):
            cfg = cfgmod.with_prefix(cfgmod.load(cfgmod.default_path()), "tebs")
            cfg_path = work / f"cluster-{kind}.yaml"
            cfg_path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
            clusters[kind] = Cluster(cfg, kind, cfg_path,
                                     "127.77.11" if kind == "host" else LOOPBACK_NET, stack)
        def one(scheme: str, every: int, rnd: int) -> Measured:
            cl = clusters["switch" if scheme.endswith("-switch") else "host"]
            win = _Window(args.warmup + 1, args.steps)
            run = Run(cl, sc, work, f"{scheme}-{every}-{rnd}", win.progress)
            win.run = run
            ckdir = work / f"ckpt-{scheme}-{every}-{rnd}"
            ckdir.mkdir()
            run.extra_job = _job(scheme, every, ckdir, args)
            try:
                if scheme.startswith("checkmate"):
                    run.start_shadows()
                run.start_trainers(resume=False)
                run.follow(None, timeout=900)
            except CheckmateError as e:
                run.stop()
                raise CheckmateError(f"{e} (logs {_keep_logs(run.dir)})") from None
            finally:
                run.stop()
                # A run's checkpoints are not needed once it is measured; kept, 14
                # configurations x 5 rounds of up to three 305 MB checkpoints each filled
                # the disk (ENOSPC surfaced as torch.save's "unexpected pos" in dcp-process).
                shutil.rmtree(ckdir, ignore_errors=True)
            got = Measured(mean_rate(run.result.times, args.warmup),
                           win.per_iter_ms("trainers"), win.per_iter_ms("shadows"),
                           win.per_iter_ms("trainers", kernel=True))
            # Measured: its directory (logs, and each rank's 305 MB final state, 1.2 GB a
            # run, 70 runs in 5 rounds) would fill the disk before the last round.
            shutil.rmtree(run.dir, ignore_errors=True)
            return got

        got = run_rounds(configs, args.rounds, one)
    rates, cpu, shadow_cpu, failed = got.rates, got.trainer_cpu, got.shadow_cpu, got.failed
    med = medians(rates)
    plan = planned(med, mtbf_s, load_s)
    _print(med, plan, cpu, args, got.trainer_sys)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "width": args.width, "layers": args.layers, "stand_in": args.stand_in,
            "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
            "interval": args.interval, "mtbf_s": mtbf_s, "load_s": load_s,
            "rates": rates, "median": med, "plan": plan, "failed": failed,
            "trainer_cpu_ms": medians(cpu), "shadow_cpu_ms": medians(shadow_cpu),
            "trainer_cpu_rounds": cpu, "shadow_cpu_rounds": shadow_cpu,
            "trainer_sys_ms": medians(got.trainer_sys), "trainer_sys_rounds": got.trainer_sys,
            "state_mb": state_mb(args.width, args.layers),
            "command": " ".join(["testbed bench schemes", *(argv if argv is not None
                                                            else sys.argv[1:])])},
            indent=1))
    ratio = med["checkmate@1"] / med["dcp@1"] if {"checkmate@1", "dcp@1"} <= set(med) \
        else float("nan")
    runs = sum(len(v) for v in rates.values())
    lost = sum(len(v) for v in failed.values())
    if lost:
        print(f"{lost} of {runs} runs failed: "
              + ", ".join(f"{k} round {f['round']}" for k, fs in failed.items() for f in fs)
              + " (their cells are left out of the medians)", flush=True)
    print(f"checkmate vs dcp-async ratio: {ratio:.3f}")
    return 1 if lost else 0


def medians(per_round: dict[str, list[float | None]]) -> dict[str, float]:
    """Each key's median over the rounds whose run succeeded; a key that failed in every
    round has no median and is left out."""
    out = {}
    for k, v in per_round.items():
        ok = [x for x in v if x is not None]
        if ok:
            out[k] = statistics.median(ok)
    return out


def state_mb(width: int, layers: int) -> dict[str, float]:
    """Parameter and model + AdamW state sizes of the bench's GPT, in MB."""
    from checkmate.testbed.models import build

    w = build("gpt", 0, 2, width=width, layers=layers)
    n = sum(p.numel() for p in w.model.parameters())
    return {"params_m": n / 1e6, "params_mb": 4 * n / 1e6, "state_mb": 12 * n / 1e6}


def _print(med: dict[str, float], plan: dict[str, Any], cpu: dict[str, list[float]],
           args: argparse.Namespace, kernel: dict[str, list[float | None]] | None = None
           ) -> None:
    with needs("bench"):
        from rich.console import Console
        from rich.table import Table

    t = Table(title=f"checkpoint schemes: gpt width {args.width} x {args.layers} layers, "
                    f"stand-in {args.stand_in} s/step, mean of iterations "
                    f"{args.warmup + 1}..{args.steps}, median of {args.rounds} rounds")
    for col in ("scheme @ interval", "it/s", "vs none", "trainer CPU ms/it", "of it kernel",
                "stall/ckpt s", "best N", "effective (Young/Daly)"):
        t.add_column(col, justify="right" if col != "scheme @ interval" else "left")
    for key, rate in med.items():
        scheme, every = key.split("@")
        ref = med.get("none-switch@1" if scheme.endswith("-switch") else "none@1", nan)
        p = plan.get(scheme) if every == "1" else None
        t.add_row(key, f"{rate:.3f}", f"{rate / ref:.3f}",
                  f"{medians(cpu).get(key, nan):.0f}",
                  f"{medians(kernel or {}).get(key, nan):.0f}",
                  "-" if p is None else f"{p['stall_s']:.3f}",
                  "-" if p is None else str(p["best_interval"]),
                  "-" if p is None else f"{p['effective_vs_none']:.3f}")
    Console(width=140).print(t)
    gk = next((k for k in med if k.startswith("gockpt@")), None)
    for a, b in (("checkmate@1", "torchsave@1"), ("checkmate@1", "dcp-process@1"),
                 ("checkmate@1", "proc-copy@1"), ("checkmate@1", "checkfreq@1"),
                 (gk or "gockpt@-", "none@1"),
                 ("checkmate-switch@1", "none-switch@1"), ("checkmate@1", "none@1")):
        if a in med and b in med:
            print(f"{a} / {b} throughput: {med[a] / med[b]:.3f}")
    tc, tk = medians(cpu), medians(kernel or {})
    for a, b in (("checkmate-switch@1", "none-switch@1"), ("checkmate@1", "none@1")):
        if {a, b} <= set(tc) and {a, b} <= set(tk):
            print(f"{a} / {b} trainer CPU: {tc[a] / tc[b]:.3f}; outside the kernel "
                  f"(user time) {(tc[a] - tk[a]) / (tc[b] - tk[b]):.3f}, in it (system "
                  f"time) {tk[a] / tk[b]:.3f}")
