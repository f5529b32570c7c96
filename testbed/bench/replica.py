"""`testbed bench replica`: repair alone vs FEC + repair on a lossy replica path.

    sudo testbed bench replica [--loss 0,0.001,0.01,0.05] [--fec 16,2] [--rounds 2]

For every loss rate, the shadow port of partition 1 (the switch's fault knob, so the copies
of the replica stream to that shadow are lost) drops that fraction of frames for the whole
run; the job runs with repair alone and with FEC (k data pieces + m parity) plus repair, the
two alternated in rounds. Measured per run: the extra bytes the trainers sent for
reliability (repair answers + parity) over the bytes replicated, the commit lag (how many
iterations the trainers were ahead when a shadow committed; max and median), the trainers'
CPU per timed iteration, throughput; every run must also end with the shadows equal to the
trainers. Medians over rounds. The one headline line, ``replica ratio: <x>``, is FEC's extra
bytes over repair's at 1% loss (above 1: FEC costs more bytes there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path

import yaml

from checkmate.config import cluster as cfgmod
from checkmate.errors import CheckmateError, cli_guard


def _floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise CheckmateError(f"--loss must be comma-separated probabilities, got {text!r}") \
            from None
    if not out or not all(0 <= x < 1 for x in out):
        raise CheckmateError(f"--loss must be probabilities in [0, 1), got {text!r}")
    return out


@cli_guard("testbed bench replica")
def main(argv: list[str] | None = None) -> int:
    from checkmate.testbed.bench.training import _throughput, _Window
    from checkmate.testbed.cluster import Cluster
    from checkmate.testbed.comparison import check_run, reliability_summary
    from checkmate.testbed.run import _clear_faults, _inject
    from checkmate.testbed.runner import Run
    from checkmate.testbed.scenario import Fault, Scenario
    from checkmate.testbed.topology import config_to_dict

    ap = argparse.ArgumentParser(prog="testbed bench replica", description=__doc__)
    ap.add_argument("--loss", default="0,0.001,0.01,0.05")
    ap.add_argument("--fec", default="16,2", help="k,m of the FEC variant")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise CheckmateError("the lossy replica path is the switch's fault knob: run as root")
    losses = _floats(args.loss)
    try:
        k, m = (int(x) for x in args.fec.split(","))
    except ValueError:
        raise CheckmateError(f"--fec must be K,M, got {args.fec!r}") from None
    cfg = cfgmod.with_prefix(cfgmod.load(cfgmod.default_path()), "tebr")
    shadow = cfg.shadow_for(1) or cfg.shadows[-1]
    res: dict[tuple[float, str], list[dict]] = {}
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckm-bench-")))
        cfg_path = work / "cluster.yaml"
        cfg_path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        cl = Cluster(cfg, "switch", cfg_path, "", stack)
        for rnd in range(args.rounds):
            order = ("repair", "fec") if rnd % 2 == 0 else ("fec", "repair")
            for loss in losses:
                for variant in order:
                    faults = [Fault(shadow.name, loss)] if loss else []
                    sc = Scenario("bench", "gpt", args.steps, 0, faults=faults)
                    win = _Window(args.warmup + 1, args.steps)
                    run = Run(cl, sc, work, f"{variant}-{loss}-{rnd}", win.progress)
                    win.run = run
                    run.extra_job = {"fec": [k, m] if variant == "fec" else None}
                    try:
                        run.start_shadows()
                        _inject(run)
                        run.start_trainers(resume=False)
                        run.follow(None)
                        problems = check_run(run)
                        run.result.shadow_status = run.shadow_statuses()
                    finally:
                        _clear_faults(run)
                        run.stop()
                    s = reliability_summary(run.result)
                    # What the trainers sent (no trainer is killed here, so all reported).
                    parity = sum(r.get("parity_bytes") or 0 for r in run.result.stats)
                    sent = sum((r.get("repair") or {}).get("answered_bytes", 0)
                               for r in run.result.stats)
                    row = {"extra": (sent + parity) / s["replica_bytes"],
                           "repair_bytes": sent, "parity_bytes": parity,
                           "lag_max": s["commit_lag_max"], "lag_median": s["commit_lag_median"],
                           "cpu_ms": win.per_iter_ms("trainers"),
                           "its": _throughput(run.result.times, args.warmup),
                           "ok": not problems and not s["commits_missing"],
                           "fec": {k2: v for st in run.result.shadow_status
                                   for k2, v in (st.get("fec") or {}).items()}}
                    res.setdefault((loss, variant), []).append(row)
                    print(f"round {rnd + 1} loss {loss:<6} {variant:<6} extra "
                          f"{100 * row['extra']:6.2f}%  lag max {row['lag_max']} median "
                          f"{row['lag_median']}  trainers {row['cpu_ms']:6.1f} CPU ms/it  "
                          f"{row['its']:.2f} it/s  ok {row['ok']}", flush=True)
    from rich.console import Console
    from rich.table import Table

    def med(loss: float, v: str, key: str) -> float:
        return statistics.median(r[key] for r in res[(loss, v)])

    t = Table(title=f"replica path: repair alone vs FEC ({k},{m}) + repair, loss on "
                    f"{shadow.name}'s port, median of {args.rounds} rounds")
    for col in ("loss", "variant", "extra bytes", "lag max", "lag median",
                "trainer CPU ms/it", "it/s", "all ok"):
        t.add_column(col, justify="right")
    for loss in losses:
        for v in ("repair", "fec"):
            t.add_row(f"{100 * loss:g}%", v, f"{100 * med(loss, v, 'extra'):.2f}%",
                      f"{med(loss, v, 'lag_max'):g}", f"{med(loss, v, 'lag_median'):g}",
                      f"{med(loss, v, 'cpu_ms'):.1f}", f"{med(loss, v, 'its'):.2f}",
                      "yes" if all(r["ok"] for r in res[(loss, v)]) else "NO")
    Console(width=140).print(t)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {f"{loss}/{v}": rows for (loss, v), rows in res.items()}, indent=1))
    bad = [key for key, rows in res.items() if not all(r["ok"] for r in rows)]
    if bad:
        print(f"runs that did not end with every shadow equal to the trainers: {bad}")
    ref = 0.01 if 0.01 in losses else losses[-1]
    rep = med(ref, "repair", "extra")
    print(f"FEC vs repair trainer CPU per iteration at {100 * ref:g}% loss: "
          f"{med(ref, 'fec', 'cpu_ms') / med(ref, 'repair', 'cpu_ms'):.3f}")
    print(f"replica ratio: {med(ref, 'fec', 'extra') / rep if rep else float('inf'):.3f}")
    return 1 if bad else 0
