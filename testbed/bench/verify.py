"""`testbed bench verify`: what ``--verify-every K`` costs the trainers' iterations.

One run, loopback, host mode: ``--world`` trainer processes train one stock
``DistributedDataParallel`` model driven by ``checkmate.train.ddp_hook.DDPSession`` with two
real ``shadow serve`` processes, and alternate, in ``--rounds`` rounds of ``--iters``
iterations (the order swapped every round), between ``verify_every = 0`` (off) and
``verify_every = K`` (``--every``; ``auto``: K chosen by measurement, the launcher's
default, its schedule kept across the rounds): every K-th iteration the ranks compare a
digest of their state (replica agreement) and send the digests of their shares, which the
shadows check their committed state against (the state check). The check's cost falls on
one iteration in K, so each round's figure is its mean iteration time, not a median; rank
0 waits for the shadows after every round (not counted), so a round never pays for the one
before.
Ends with ``verify ratio: <x>``: the median over rounds of off's mean iteration time over
the checked variant's in the same round (1.0: free; 0.99: the check costs 1%). The shadows
run on the trainers' cores, so their share of the check shows here too.
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
from checkmate.testbed.bench.rounds import verdict
from checkmate.train import check_schedule

VARIANTS = ("off", "checked")


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checkmate.testbed.models import build
    from checkmate.train.ddp_hook import DDPSession

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ips = args.shadows.split(",")
    w = build(args.model, 1, args.rounds * 2 * args.iters, width=args.width)
    layout = host_workers.layout(args.net, ips, rank, world)
    ddp = DDP(w.model)
    sess = DDPSession(ddp, w.optimizer, w.scheduler, layout, w.max_grad_norm)
    sess.start()
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    it = 0
    for rnd in range(args.rounds):
        for kind in (VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]):
            sess.verify_every = args.every if kind == "checked" else 0
            dist.barrier()
            spent = 0.0
            for _ in range(args.iters):
                it += 1
                t0 = time.perf_counter()
                sess.begin(it)
                x, y = w.batch(rank, it)
                w.optimizer.zero_grad()
                w.loss(ddp(x), y).backward()
                sess.step()
                spent += time.perf_counter() - t0
            times[kind].append(spent / args.iters)
            if rank == 0:
                sess.wait_shadows(it, 120.0)
            dist.barrier()
    prot = sess.finish(60.0)
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "times": times, "protected": prot["protected"],
            "checks": sess._schedule.count, "k": sess._schedule.k,
            "params": sum(p.numel() for p in w.model.parameters())}))
    sess.close()
    dist.destroy_process_group()
    return 0


def _failed_checks(work: Path) -> int:
    """State checks the shadows found different (each is a line of their logs)."""
    return sum(p.read_text(errors="replace").count("differs from the trainers'")
               for p in work.glob("shadow*.log"))


@cli_guard("testbed bench verify")
def main(argv: list[str] | None = None) -> int:
    ap = host_workers.parser("verify", __doc__)
    ap.add_argument("--every", type=check_schedule.parse, default=10,
                    help="K: a checked iteration in K, or auto")
    ap.add_argument("--iters", type=int, default=20, help="iterations per round and variant")
    args = ap.parse_args(argv)
    if args.worker:
        host_workers.end_worker(_worker(args))
    if not 1 <= args.world <= 8 or args.rounds < 2 or args.width < 8 or args.every == 0:
        raise CheckmateError("need 1 <= --world <= 8, --rounds >= 2, --width >= 8, "
                             "--every >= 1 or auto")
    if args.iters < args.every:
        raise CheckmateError("--iters must be at least --every: a round must hold a check")
    load = os.getloadavg()[0]
    net = f"127.84.{random.randrange(1, 255)}"
    with tempfile.TemporaryDirectory(prefix="ckm-bench-verify-") as tmp:
        work = Path(tmp)
        data = host_workers.run(
            "checkmate.testbed.bench.verify", net, work, args.world,
            ["--model", args.model, "--width", str(args.width), "--rounds", str(args.rounds),
             "--iters", str(args.iters), "--every", check_schedule.describe(args.every)])
        failed = _failed_checks(work)
    t = data["times"]
    ratios = [a / b for a, b in zip(t["off"], t["checked"], strict=True)]
    print(f"--verify-every {check_schedule.describe(args.every)} against off: {args.model} "
          f"width {args.width} ({data['params']} parameters), {args.world} trainers (stock "
          f"DDP + hook), 2 shadows, host mode, {args.rounds} alternated rounds of "
          f"{args.iters} iterations each, load {load:.2f}")
    print("per round, mean ms/it off / checked (ratio): " + ", ".join(
        f"{1000 * a:.1f}/{1000 * b:.1f} ({a / b:.3f})"
        for a, b in zip(t["off"], t["checked"], strict=True)))
    print(f"off {1000 * statistics.median(t['off']):.1f} ms/it, checked "
          f"{1000 * statistics.median(t['checked']):.1f} ms/it (medians of the round means); "
          f"ratio {verdict(ratios)}; {data['checks']} checks, the last K {data['k']}; shadow "
          f"checks failed: {failed}")
    if not data["protected"] or failed:
        raise CheckmateError("the shadows did not commit the last iteration, or a state "
                             "check failed")
    print(f"verify ratio: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
