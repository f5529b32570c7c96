"""`testbed bench ddp`: stock DistributedDataParallel (gloo) with and without Checkmate's hook.

One run, loopback, host mode: ``--world`` trainer processes each hold two copies of the same
model, one wrapped in plain ``DistributedDataParallel`` (no hook, no shadows: the baseline)
and one in ``DistributedDataParallel`` driven by ``checkmate.train.ddp_hook.DDPSession``
(the comm hook sends each rank's share of the reduced gradient to two real ``shadow serve``
processes, rank 0 sends the control message, repair and the protection monitor run). The
two variants alternate in ``--rounds`` rounds of ``--iters`` iterations, the order swapped
every round; every iteration (forward, backward, step) is timed on rank 0 after a barrier
at the round start. After a Checkmate round rank 0 waits until both shadows committed its
last iteration (reported, not counted), so the shadows' work never lands in a stock round.
Prints the median iteration time of each variant, per round and overall, and ends with one
line ``ddp ratio: <x>``: the median over rounds of the baseline's median iteration time
over Checkmate's in the same round (Checkmate's throughput relative to stock DDP; higher is
better, 1.0 means free; per round because the load of a shared machine drifts). The
shadows run on the same cores as the trainers.
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

VARIANTS = ("stock", "checkmate")


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
    steps = args.rounds * args.iters
    plain = build(args.model, 1, steps, width=args.width)
    ours = build(args.model, 1, steps, width=args.width)
    models = {"stock": DDP(plain.model), "checkmate": DDP(ours.model)}
    layout = host_workers.layout(args.net, ips, rank, world)
    sess = DDPSession(models["checkmate"], ours.optimizer, ours.scheduler, layout,
                      ours.max_grad_norm)
    sess.start()
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    done = {k: 0 for k in VARIANTS}
    catchup: list[float] = []
    for rnd in range(args.rounds):
        for kind in (VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]):
            w, ddp = (plain, models[kind]) if kind == "stock" else (ours, models[kind])
            dist.barrier()
            for _ in range(args.iters):
                it = done[kind] = done[kind] + 1
                t0 = time.perf_counter()
                if kind == "checkmate":
                    sess.begin(it)
                else:
                    torch.manual_seed(it)
                x, y = w.batch(rank, it)
                w.optimizer.zero_grad()
                w.loss(ddp(x), y).backward()
                if kind == "checkmate":
                    sess.step()
                else:
                    if w.max_grad_norm is not None:
                        torch.nn.utils.clip_grad_norm_(w.model.parameters(), w.max_grad_norm)
                    w.optimizer.step()
                    w.scheduler.step()
                times[kind].append(time.perf_counter() - t0)
            if kind == "checkmate" and rank == 0:
                # Let the shadows catch up before the next round, so their work does not
                # slow a stock round; the wait is reported, not counted in iterations.
                t0 = time.perf_counter()
                sess.wait_shadows(done[kind], 120.0)
                catchup.append(time.perf_counter() - t0)
    prot = sess.finish(60.0)
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "times": times, "catchup": catchup, "protected": prot["protected"],
            "params": sum(p.numel() for p in ours.model.parameters()),
            "copy_bytes": sess.sender.copy_bytes, "control_bytes": sess.control_bytes,
            "hook": sess.hook_stats}))
    sess.close()
    dist.destroy_process_group()
    return 0


@cli_guard("testbed bench ddp")
def main(argv: list[str] | None = None) -> int:
    ap = host_workers.parser("ddp", __doc__)
    ap.add_argument("--iters", type=int, default=8, help="iterations per round")
    ap.add_argument("--warmup", type=int, default=1,
                    help="first iterations of each variant left out of the medians")
    ap.add_argument("--json", metavar="OUT", help="write the per-iteration times here")
    args = ap.parse_args(argv)
    if args.worker:
        host_workers.end_worker(_worker(args))
    if not 1 <= args.world <= 8 or args.rounds < 2 or args.iters < 2 or args.width < 8:
        raise CheckmateError("need 1 <= --world <= 8, --rounds >= 2, --iters >= 2, "
                             "--width >= 8")
    if not 0 <= args.warmup <= args.rounds * args.iters - 2:
        raise CheckmateError("--warmup must leave at least 2 timed iterations per variant")
    load = os.getloadavg()[0]
    net = f"127.83.{random.randrange(1, 255)}"
    with tempfile.TemporaryDirectory(prefix="ckm-bench-ddp-") as tmp:
        work = Path(tmp)
        data = host_workers.run(
            "checkmate.testbed.bench.ddp", net, work, args.world,
            ["--model", args.model, "--width", str(args.width), "--rounds", str(args.rounds),
             "--iters", str(args.iters)])
    # The first iterations of each variant (DDP's first pass, allocator, caches) are warm-up.
    times = {k: v[args.warmup:] for k, v in data["times"].items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    # Per round: the median of each variant's iterations, and their ratio. The machine's load
    # drifts between rounds; two neighbouring rounds see about the same load.
    n = args.iters
    rounds = [{k: statistics.median(v[max(r * n, args.warmup):(r + 1) * n])
               for k, v in data["times"].items()}
              for r in range(args.rounds) if (r + 1) * n > args.warmup]
    ratios = [m["stock"] / m["checkmate"] for m in rounds]
    print(f"stock DDP (gloo) with and without Checkmate: {args.model} width {args.width} "
          f"({data['params']} parameters), {args.world} trainers, 2 shadows, host mode, "
          f"{args.rounds} alternated rounds of {args.iters} iterations (first "
          f"{args.warmup} of each left out), load {load:.2f}")
    print(f"{'variant':<12} {'median ms/it':>13} {'it/s':>8} {'min ms':>8} {'max ms':>8}")
    for k in VARIANTS:
        v = times[k]
        print(f"{k:<12} {1000 * med[k]:>13.2f} {1 / med[k]:>8.2f} {1000 * min(v):>8.2f} "
              f"{1000 * max(v):>8.2f}")
    print("per round, median ms/it stock / checkmate (ratio): " + ", ".join(
        f"{1000 * m['stock']:.0f}/{1000 * m['checkmate']:.0f} ({x:.2f})"
        for m, x in zip(rounds, ratios, strict=True)))
    print(f"median over all iterations: stock / checkmate = {med['stock'] / med['checkmate']:.3f}")
    print(f"after each checkmate round the shadows needed a median "
          f"{1000 * statistics.median(data['catchup']):.1f} ms more to commit its last "
          f"iteration (not counted above)")
    steps = len(data["times"]["checkmate"])  # every iteration sends, warm-up ones too
    per_it = data["copy_bytes"] / steps
    print(f"rank 0 sent the shadows {per_it / 1e6:.2f} "
          f"MB of gradient and {data['control_bytes']} control bytes per iteration; "
          f"last iteration protected: {data['protected']}")
    print(f"rank 0's comm hook spent {1000 * data['hook']['seconds'] / steps:.1f} ms per "
          f"iteration copying and sending its share (replica log, datagrams)")
    if args.json:
        Path(args.json).write_text(json.dumps({**data, "median_s": med, "round_ratios": ratios},
                                              indent=1))
    if not data["protected"]:
        raise CheckmateError("the shadows did not commit the last iteration")
    print(f"ddp ratio: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
