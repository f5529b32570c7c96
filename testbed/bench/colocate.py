"""`testbed bench colocate`: what a shadow on the trainers' own cores costs them.

Host mode, loopback: ``--world`` trainer processes pinned to ``--trainer-cores`` train one
model through Checkmate's own ring (``CheckmateSession``, the worker of `testbed bench
replicas`) with two real ``shadow serve`` processes, pinned either to ``--spare-cores``
("spare": cores the trainers do not use, as `checkmate launch --shadow-cores` gives a
co-located shadow; on one machine also the nearest stand-in for a shadow on a machine of
its own, though it still shares memory bandwidth and caches) or to the trainers' own cores
("shared": a co-located shadow without cores of its own). The trainers do the same work in
both (they send the same copies); only where the shadows run differs. Whole runs,
alternated in ``--rounds`` rounds (the order swapped every round); each run's figure is its
mean iteration time after ``--warmup`` iterations; rank 0 waits for the shadows at the end
of each run (not counted).
Ends with ``colocate ratio: <x>``: the median over rounds of spare's mean iteration time
over shared's in the same round (1.0: sharing the cores is free; 0.8: it costs the
trainers 25% more time per iteration).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from checkmate.errors import CheckmateError, cli_guard
from checkmate.launch.options import format_cores, parse_cores
from checkmate.testbed.bench import _host_workers as host_workers
from checkmate.testbed.bench.rounds import iteration_lines

#: The worker that trains (one job's trainers; its options are the job's shape).
WORKER = "checkmate.testbed.bench.replicas"


@cli_guard("testbed bench colocate")
def main(argv: list[str] | None = None) -> int:
    ap = host_workers.parser("colocate", __doc__)
    ap.add_argument("--iters", type=int, default=30, help="timed iterations per run")
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations per run")
    ap.add_argument("--trainer-cores", default="0", help="the trainers' CPU list (default 0)")
    ap.add_argument("--spare-cores", default="1",
                    help="the shadows' CPU list in the spare variant (default 1)")
    args = ap.parse_args(argv)
    if not 1 <= args.world <= 8 or args.rounds < 2 or args.width < 8 or args.iters < 1 \
            or args.warmup < 0:
        raise CheckmateError("need 1 <= --world <= 8, --rounds >= 2, --width >= 8, "
                             "--iters >= 1, --warmup >= 0")
    trainers, spare = parse_cores(args.trainer_cores), parse_cores(args.spare_cores)
    if trainers & spare:
        raise CheckmateError(f"--trainer-cores {args.trainer_cores} and --spare-cores "
                             f"{args.spare_cores} share core(s) {format_cores(trainers & spare)}")
    variants = {"spare": args.spare_cores, "shared": args.trainer_cores}
    load = os.getloadavg()[0]
    got: dict[str, list[dict]] = {k: [] for k in variants}
    with tempfile.TemporaryDirectory(prefix="ckm-bench-colocate-") as tmp:
        work = Path(tmp)
        for rnd in range(args.rounds):
            for kind in (list(variants) if rnd % 2 == 0 else list(variants)[::-1]):
                net = f"127.86.{random.randrange(1, 255)}"
                got[kind].append(host_workers.run(
                    WORKER, net, work, args.world,
                    ["--model", args.model, "--width", str(args.width), "--iters",
                     str(args.iters), "--warmup", str(args.warmup)],
                    trainer_cores=args.trainer_cores, shadow_cores=variants[kind]))
    spare_t = [d["mean"] for d in got["spare"]]
    shared_t = [d["mean"] for d in got["shared"]]
    ratios = [a / b for a, b in zip(spare_t, shared_t, strict=True)]
    print(f"shadows on the trainers' cores against spare cores: {args.model} width "
          f"{args.width} ({got['spare'][0]['params']} parameters), {args.world} trainers "
          f"(own ring) on core(s) {args.trainer_cores}, 2 shadows on {args.spare_cores} "
          f"(spare) or {args.trainer_cores} (shared), host mode, {args.rounds} alternated "
          f"rounds of one run each ({args.iters} timed iterations after {args.warmup}), "
          f"load {load:.2f}")
    print("\n".join(iteration_lines(("spare", "shared"), spare_t, shared_t)))
    if not all(d["protected"] for v in got.values() for d in v):
        raise CheckmateError("a run's shadows did not commit its last iteration")
    print(f"colocate ratio: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
