"""`testbed bench training`: training throughput with and without per-iteration checkpoints.

One run, same model, same trainers, same ckm ring transport, four ways:

  (a) none        no checkpoint at all (ring without REPLICATE tags, no shadows);
  (b) checkmate   per-iteration Checkmate (switch copies the gradients in switch mode; the
                  trainers send 1/N copies themselves in host mode) + rank 0's control message;
  (c) dcp-async   torch.distributed.checkpoint.async_save of model + optimizer every iteration;
  (d) torch.save  rank 0 torch.save of model + optimizer every iteration.

Throughput is rank 0's iterations per second (median step interval) after ``--warmup``
iterations. Prints a table,
``checkmate vs dcp async_save throughput ratio: <x>`` and ends with
``checkmate vs no-checkpoint throughput ratio: <x>``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path

import yaml

from checkmate import config as cfgmod
from checkmate.errors import CheckmateError, cli_guard

VARIANTS = (("none", "(a) no checkpoint"), ("checkmate", "(b) checkmate"),
            ("dcp", "(c) dcp async_save"), ("torchsave", "(d) torch.save"))


def _throughput(times: list[float], warmup: int) -> float:
    """Iterations per second from the median step interval after warmup: the machine is
    shared and small, so one descheduled step must not decide the result."""
    import statistics

    if len(times) <= warmup + 2:
        raise CheckmateError("too few iterations to measure; raise --steps")
    gaps = [b - a for a, b in zip(times[warmup:], times[warmup + 1:], strict=False)]
    return 1.0 / statistics.median(gaps)


@cli_guard("testbed bench training")
def main(argv: list[str] | None = None) -> int:
    from checkmate.testbed.run import LOOPBACK_NET, Cluster, Run, Scenario
    from checkmate.testbed.topology import config_to_dict

    ap = argparse.ArgumentParser(prog="testbed bench training", description=__doc__)
    ap.add_argument("--mode", choices=("switch", "host"),
                    default="switch" if os.geteuid() == 0 else "host")
    ap.add_argument("--config", help="cluster config (default: embedded, prefix 'tebt')")
    ap.add_argument("--model", default="gpt", choices=("gpt", "cnn"))
    ap.add_argument("--width", type=int, default=256, help="model width")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    if args.steps < args.warmup + 3:
        raise CheckmateError("--steps must exceed --warmup by at least 3")
    cfg = cfgmod.load(args.config) if args.config else cfgmod.with_prefix(
        cfgmod.load(cfgmod.default_path()), "tebt")
    sc = Scenario("bench", args.model, args.steps, 0)
    results: dict[str, float] = {}
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckm-bench-")))
        cfg_path = work / "cluster.yaml"
        cfg_path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        cl = Cluster(cfg, args.mode, cfg_path, "127.77.9" if args.mode == "host"
                     else LOOPBACK_NET, stack)
        for kind, label in VARIANTS:
            run = Run(cl, sc, work, kind, lambda *a: None)
            ckdir = work / f"ckpt-{kind}"
            ckdir.mkdir()
            run.extra_job = {"ckpt": kind, "ckpt_dir": str(ckdir),
                             "model_kw": {"width": args.width}}
            try:
                if kind == "checkmate":
                    run.start_shadows()
                run.start_trainers(resume=False)
                run.follow(None)
                shadow_cpu = run.shadow_cpu_seconds()
            finally:
                run.stop()
            if kind == "checkmate":
                # On this testbed the shadows share the trainers' cores; in a deployment they
                # are separate machines. Report what they took.
                print(f"    shadows used {shadow_cpu:.1f} CPU seconds during the run", flush=True)
                results["shadow_cpu_s"] = shadow_cpu
            results[kind] = _throughput(run.result.times, args.warmup)
            print(f"{label:<22} {results[kind]:8.3f} it/s", flush=True)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"training throughput, {args.model} width {args.width}, "
                    f"{len(cfg.trainers)} trainers, {args.mode} mode, iterations "
                    f"{args.warmup + 1}..{args.steps}")
    t.add_column("variant")
    t.add_column("it/s", justify="right")
    t.add_column("vs (a)", justify="right")
    for kind, label in VARIANTS:
        t.add_row(label, f"{results[kind]:.3f}", f"{results[kind] / results['none']:.3f}")
    Console().print(t)
    if args.json:
        Path(args.json).write_text(json.dumps({"mode": args.mode, "width": args.width,
                                               "steps": args.steps, "its": results}, indent=1))
    print(f"checkmate vs dcp async_save throughput ratio: "
          f"{results['checkmate'] / results['dcp']:.3f}")
    print(f"checkmate vs torch.save throughput ratio: "
          f"{results['checkmate'] / results['torchsave']:.3f}")
    print(f"checkmate vs no-checkpoint throughput ratio: "
          f"{results['checkmate'] / results['none']:.3f}")
    return 0
