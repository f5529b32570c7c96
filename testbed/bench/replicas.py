"""`testbed bench replicas`: what a second shadow per partition costs the trainers.

Host mode, loopback: ``--world`` trainer processes train one model through Checkmate's own
ring (``CheckmateSession``) with real ``shadow serve`` processes, one replica of each of two
partitions ("one") or two ("two": the trainers send every copy and control message twice,
and the second set's shadows run on the same cores). A replica count is a property of a
job, so the variants are whole runs, alternated in ``--rounds`` rounds (the order swapped
every round); each run's figure is its mean iteration time after ``--warmup`` iterations
(start-up, seeding and the shadows' first steps not counted); rank 0 waits for the shadows
at the end of each run (not counted).
Ends with ``replicas ratio: <x>``: the median over rounds of one's mean iteration time over
two's in the same round (1.0: free; 0.9: the second replica costs 10%). The shadows share
the trainers' cores here, as they would co-located on the job's own nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from checkmate.errors import CheckmateError, cli_guard
from checkmate.testbed.bench import _host_workers as host_workers
from checkmate.testbed.bench.rounds import iteration_lines

VARIANTS = {"one": 1, "two": 2}


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from checkmate.testbed.models import build
    from checkmate.train import CheckmateSession

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ips = args.shadows.split(",")
    w = build(args.model, 1, args.warmup + args.iters, width=args.width)
    layout = host_workers.layout(args.net, ips, rank, world, args.replicas)
    sess = CheckmateSession(w.model, w.optimizer, w.scheduler, layout, w.max_grad_norm)
    sess.start()
    spent = 0.0
    for it in range(1, args.warmup + args.iters + 1):
        t0 = time.perf_counter()
        sess.begin(it)
        x, y = w.batch(rank, it)
        w.optimizer.zero_grad()
        w.loss(sess.model(x), y).backward()
        sess.step()
        if it > args.warmup:
            spent += time.perf_counter() - t0
    prot = sess.finish(60.0)
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "mean": spent / args.iters, "protected": prot["protected"],
            "copy_bytes": sess.sender.copy_bytes,
            "params": sum(p.numel() for p in w.model.parameters())}))
    sess.close()
    dist.destroy_process_group()
    return 0


@cli_guard("testbed bench replicas")
def main(argv: list[str] | None = None) -> int:
    ap = host_workers.parser("replicas", __doc__)
    ap.add_argument("--iters", type=int, default=30, help="timed iterations per run")
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations per run")
    ap.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        host_workers.end_worker(_worker(args))
    if not 1 <= args.world <= 8 or args.rounds < 2 or args.width < 8 or args.iters < 1 \
            or args.warmup < 0:
        raise CheckmateError("need 1 <= --world <= 8, --rounds >= 2, --width >= 8, "
                             "--iters >= 1, --warmup >= 0")
    load = os.getloadavg()[0]
    got: dict[str, list[dict]] = {k: [] for k in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="ckm-bench-replicas-") as tmp:
        work = Path(tmp)
        for rnd in range(args.rounds):
            for kind in (list(VARIANTS) if rnd % 2 == 0 else list(VARIANTS)[::-1]):
                net = f"127.85.{random.randrange(1, 255)}"
                got[kind].append(host_workers.run(
                    "checkmate.testbed.bench.replicas", net, work, args.world,
                    ["--model", args.model, "--width", str(args.width), "--iters",
                     str(args.iters), "--warmup", str(args.warmup), "--replicas",
                     str(VARIANTS[kind])], replicas=VARIANTS[kind]))
    one = [d["mean"] for d in got["one"]]
    two = [d["mean"] for d in got["two"]]
    ratios = [a / b for a, b in zip(one, two, strict=True)]
    print(f"two shadows per partition against one: {args.model} width {args.width} "
          f"({got['one'][0]['params']} parameters), {args.world} trainers (own ring), 2 "
          f"partitions, host mode, {args.rounds} alternated rounds of one run each "
          f"({args.iters} timed iterations after {args.warmup}), load {load:.2f}")
    rounds, medians = iteration_lines(("one", "two"), one, two)
    print(rounds)
    print(f"{medians}; copy bytes sent by rank 0 per run: one {got['one'][0]['copy_bytes']}, "
          f"two {got['two'][0]['copy_bytes']}")
    if not all(d["protected"] for v in got.values() for d in v):
        raise CheckmateError("a run's shadows did not commit its last iteration")
    print(f"replicas ratio: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
