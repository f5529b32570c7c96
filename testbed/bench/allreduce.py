"""`testbed bench allreduce`: our ckm ring allreduce vs gloo's allreduce, same hosts, same sizes.

Four trainer processes (in their namespaces behind the eBPF switch as root, else on
loopback) each run, for every size (default 1, 4, 16, 64 MB of float32), alternating rounds
of ``RingAllreduce.allreduce`` over ckm/UDP and ``torch.distributed.all_reduce`` over gloo
(TCP), a barrier before each. Throughput is the buffer size over rank 0's median time (the
"algorithm bandwidth"), and the CPU seconds all ranks spent per operation (user + system of each
rank's process, summed over ranks; median of rounds): on a shared machine the CPU an
operation costs is the figure that load disturbs least. Prints both per size and ends with
``ckm ring vs gloo allreduce throughput ratio: <x>``, the geometric mean over the sizes of
4 MB and more (gradient buckets of real models); sizes below are reported apart, so a fast
small size cannot lift the headline.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from checkmate.config import cluster as cfgmod
from checkmate.errors import CheckmateError, cli_guard

SIZES_MB = (1, 4, 16, 64)
#: Sizes from here up make the headline.
HEADLINE_MIN_MB = 4


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from checkmate.train.ring import RingAllreduce
    from checkmate.train.transport import open_socket

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ips = args.ips.split(",")
    sizes = [int(float(s) * (1 << 20)) // 4 for s in args.sizes.split(",")]
    sock = open_socket(ips[rank], cfgmod.TRAINER_PORT)
    dist.barrier()
    ring = RingAllreduce(rank, world, sock, (ips[(rank + 1) % world], cfgmod.TRAINER_PORT),
                         (ips[(rank - 1) % world], cfgmod.TRAINER_PORT), 7, 77, max(sizes), 1,
                         tag=False)
    out: dict[str, dict[str, list[float]]] = {}
    it = 0
    for n in sizes:
        x = torch.ones(n)
        reps = max(2, min(args.reps, int(64 * 2**20 / 4 / n * 2)))
        res: dict[str, list[float]] = {"ckm": [], "gloo": [], "ckm_cpu": [], "gloo_cpu": []}
        for _ in range(reps):
            for kind in ("ckm", "gloo"):
                # CPU from before the barrier: work a ring thread finishes after its future
                # (acknowledgements) is charged to the round after it, whichever kind.
                c0 = _cpu()
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "ckm":
                    it += 1
                    ring.allreduce(x, 0, it, 0)
                else:
                    dist.all_reduce(x)
                res[kind].append(time.perf_counter() - t0)
                res[kind + "_cpu"].append(_cpu() - c0)
                x.fill_(1.0)
        out[str(n * 4)] = res
    dist.barrier()
    ring.close()
    every: list = [None] * world
    dist.all_gather_object(every, out)
    if rank == 0:
        for key, res in out.items():  # CPU summed over ranks, per round
            for kind in ("ckm_cpu", "gloo_cpu"):
                res[kind] = [sum(r[key][kind][i] for r in every) for i in range(len(res[kind]))]
        Path(args.out).write_text(json.dumps({"results": out, "ring": ring.stats}))
    dist.destroy_process_group()
    return 0


def _cpu() -> float:
    """User + system seconds of this process, every thread."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@cli_guard("testbed bench allreduce")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="testbed bench allreduce", description=__doc__)
    ap.add_argument("--mode", choices=("switch", "host"),
                    default="switch" if os.geteuid() == 0 else "host")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES_MB),
                    help="comma-separated sizes in MB")
    ap.add_argument("--reps", type=int, default=5, help="rounds per size (fewer for large)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ips", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    try:
        sizes = [float(s) for s in args.sizes.split(",")]
    except ValueError:
        raise CheckmateError(f"--sizes must be numbers in MB, got {args.sizes!r}") from None
    if not sizes or any(s <= 0 or s > 1024 for s in sizes) or args.reps < 1:
        raise CheckmateError("sizes must be in (0, 1024] MB and --reps >= 1")
    import yaml

    from checkmate.testbed.cluster import Cluster
    from checkmate.testbed.topology import config_to_dict

    cfg = cfgmod.with_prefix(cfgmod.load(cfgmod.default_path()), "teba")
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckm-bench-")))
        cfg_path = work / "cluster.yaml"
        cfg_path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        cl = Cluster(cfg, args.mode, cfg_path, "127.77.8", stack)
        trainers = cfg.trainers
        ips = ",".join(cl.ip[h.name] for h in trainers)
        master = cl.ip[trainers[0].name]
        out = work / "result.json"
        procs = []
        for h in trainers:
            env = {"RANK": str(h.rank), "WORLD_SIZE": str(len(trainers)),
                   "MASTER_ADDR": master, "MASTER_PORT": "29611",
                   "GLOO_SOCKET_IFNAME": cl.ifname(h.name), "OMP_NUM_THREADS": "1"}
            argv = [sys.executable, "-m", "checkmate.testbed.bench.allreduce", "--worker",
                    "--ips", ips, "--sizes", args.sizes, "--reps", str(args.reps),
                    "--out", str(out)]
            procs.append(cl.popen(h.name, argv, env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, start_new_session=True))
        errs = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=300)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            errs.append(err.decode(errors="replace").strip().splitlines()[-1:] if err else [])
        if any(p.returncode for p in procs) or not out.exists():
            raise CheckmateError(f"benchmark workers failed: {errs}")
        data = json.loads(out.read_text())
    print(f"allreduce of float32 buffers, {len(trainers)} ranks, {args.mode} mode "
          f"(median of rounds, algorithm bandwidth = size / time)")
    print(f"{'size':>8} {'ckm ring MB/s':>14} {'gloo MB/s':>10} {'ratio':>6}"
          f" {'ckm CPU ms':>11} {'gloo CPU ms':>12} {'CPU ratio':>10}")
    big, small = [], []
    for nbytes, res in data["results"].items():
        mb = int(nbytes) / 2**20
        ckm = int(nbytes) / statistics.median(res["ckm"]) / 1e6
        gloo = int(nbytes) / statistics.median(res["gloo"]) / 1e6
        cc = statistics.median(res["ckm_cpu"]) * 1e3
        gc = statistics.median(res["gloo_cpu"]) * 1e3
        (big if mb >= HEADLINE_MIN_MB else small).append(ckm / gloo)
        print(f"{mb:>6.0f}MB {ckm:>14.1f} {gloo:>10.1f} {ckm / gloo:>6.2f}"
              f" {cc:>11.1f} {gc:>12.1f} {gc / cc:>10.2f}")
    print("CPU ms: user + system of all ranks per operation; CPU ratio: gloo / ckm "
          "(above 1: the ring costs less CPU)")
    print(f"ring datagrams: sent {data['ring']['sent']}, resent {data['ring']['resent']}")

    def geo(xs: list[float]) -> float:
        return math.exp(sum(math.log(r) for r in xs) / len(xs))
    if small:
        print(f"below {HEADLINE_MIN_MB} MB (not in the headline): {geo(small):.3f}")
    if not big:
        raise CheckmateError(f"the headline needs a size of at least {HEADLINE_MIN_MB} MB")
    print(f"ckm ring vs gloo allreduce throughput ratio: {geo(big):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
