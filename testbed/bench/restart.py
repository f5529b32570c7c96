"""`testbed bench restart`: how soon a killed job trains again, its workers forked from the
launcher's server (``--worker-start forkserver``, the default) or each a fresh Python
(``--worker-start exec``).

One launch per variant and round, on loopback: ``checkmate launch --nproc-per-node
--world --shadows 2 --max-restarts 1`` of examples/train_lm.py (the restart matrix's tied
language model, own wrapper), with the last rank SIGKILLed after iteration ``--kill-at``
(CHECKMATE_KILL_AT). The variants alternate in ``--rounds`` rounds, the order swapped every
round. From the launcher's own lines, stamped as they arrive, each launch gives:

- start: launch to ``attempt 0: seeded`` (workers started, the shadows seeded);
- recovery: ``a trainer failed`` to ``attempt 1: resumed from the shadows`` (what a
  failure costs before training goes on: the new workers start and restore);
- total: launch to the launcher's exit.

Prints every launch, the medians and the per-round ratios exec / forkserver (above 1: the
fork server is faster), and ends with ``restart ratio: <x>``: the median over rounds of
exec's recovery over the fork server's. The fork server's own start (torch imported once,
before the first worker) is inside its first ``start``; CPU time is not compared, since the
server's workers are not the launcher's children and their CPU is not counted with it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checkmate.errors import CheckmateError, cli_guard
from checkmate.testbed.bench.rounds import paired, verdict

VARIANTS = ("exec", "forkserver")
LM = Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"
MARKS = {"start": "attempt 0: seeded", "failed": "a trainer failed",
         "resumed": "attempt 1: resumed from the shadows"}


def _once(variant: str, args: argparse.Namespace, tmp: Path) -> dict[str, float] | None:
    """One launch; its three times in seconds, or None (with the reason printed)."""
    argv = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node",
            str(args.world), "--shadows", "2", "--max-restarts", "1", "--progress-every", "0",
            "--worker-start", variant, str(LM), "--steps", str(args.steps),
            "--out", str(tmp / f"{variant}.pt")]
    env = {**os.environ, "NUMBA_NUM_THREADS": "1",
           "CHECKMATE_KILL_AT": f"{args.world - 1}:{args.kill_at}"}
    t0 = time.monotonic()
    seen: dict[str, float] = {}
    lines = []
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as p:
        for line in p.stdout:
            lines.append(line)
            for name, mark in MARKS.items():
                if mark in line and name not in seen:
                    seen[name] = time.monotonic() - t0
        rc = p.wait()
    total = time.monotonic() - t0
    if rc != 0 or len(seen) != len(MARKS):
        print(f"  {variant}: the launch failed (exit {rc}, saw {sorted(seen)}): "
              f"{''.join(lines[-3:]).strip()}", flush=True)
        return None
    return {"start": seen["start"], "recovery": seen["resumed"] - seen["failed"],
            "total": total}


def _run(args: argparse.Namespace) -> int:
    if not LM.is_file():
        raise CheckmateError(f"bench restart needs the repository's examples ({LM} is missing)")
    got: dict[str, list[dict[str, float] | None]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="ckm-bench-restart-") as d:
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for v in order:
                t = _once(v, args, Path(d))
                got[v].append(t)
                if t is not None:
                    print(f"round {r + 1} {v:10s} start {t['start']:6.2f} s  recovery "
                          f"{t['recovery']:6.2f} s  total {t['total']:6.2f} s", flush=True)
    print(f"{args.world} ranks, kill after iteration {args.kill_at} of {args.steps}, "
          f"{args.rounds} rounds; medians, then exec / forkserver per round (median, spread)")
    head = []
    for key in ("start", "recovery", "total"):
        col = {v: [t[key] if t else None for t in got[v]] for v in VARIANTS}
        med = {v: statistics.median([x for x in col[v] if x is not None] or [float("nan")])
               for v in VARIANTS}
        ratios = paired(col["exec"], col["forkserver"])
        print(f"  {key:9s} exec {med['exec']:6.2f} s  forkserver {med['forkserver']:6.2f} s  "
              f"ratio {verdict(ratios)}")
        if key == "recovery":
            head = ratios
    if not head:
        raise CheckmateError("no round completed both variants")
    print(f"restart ratio: {statistics.median(head):.3f}")
    return 0


@cli_guard("testbed bench restart")
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="testbed bench restart", description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4, help="trainers (2 to 8)")
    p.add_argument("--steps", type=int, default=10, help="iterations of each launch")
    p.add_argument("--kill-at", type=int, default=5, help="the last rank dies after this one")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds (medians)")
    args = p.parse_args(argv)
    if not 2 <= args.world <= 8 or args.rounds < 1:
        raise CheckmateError("need 2 <= --world <= 8 and --rounds >= 1")
    if not 1 <= args.kill_at < args.steps:
        raise CheckmateError("--kill-at must be at least 1 and below --steps")
    return _run(args)
