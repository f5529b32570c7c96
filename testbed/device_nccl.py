"""The device check's real-NCCL run of the ckm plugin (issue 22; docs/nccl_plugin.md, "The
real thing"): NCCL's own allreduce through torch.distributed, 2 ranks on one GPU with
distinct NCCL_HOSTID (NCCL sees two nodes and routes the ring through its network plugin),
``NCCL_NET=ckm`` so NCCL cannot silently fall back to its own sockets, the ckm tuner pinning
Ring/Simple and the channels, tagging on. What a switch would copy to the 2 shadows is taken
off host loopback by an AF_PACKET tap; the check then asks: every rank's result exact, every
reduced element tagged exactly once with a valid CRC and data MAC, and each shadow's share
(its partition, assembled from those copies) equal to the trainers' result. It records the
NCCL release that ran. On a release outside the checked range the plugin must refuse with
one line per rank while the results stay exact; that is what is checked there.

Not modelled here: a real switch (test_nccl_switch.py runs the kernel switch on CPU) and the
shadows' optimizer step on these copies. The pure parts (environment, verdict) are tested on
CPU in tests/test_device_nccl.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from checkmate.testbed.device_common import (
    CHECKOUT,
    ROOT,
    Budget,
    Result,
    _free_port,
    _short,
)

PLUGIN = CHECKOUT / "build" / "nccl" / "libnccl-net-ckm.so"
BUCKETS = [262_147, 70_001, 3]  # elements; none a chunk multiple
ITERATIONS = 3
CHANNELS = 2
BUFFSIZE = 1 << 20
PARTITIONS = 2
SEED = 29


def device_env(rank: int, world: int, plugin: Path, secret: Path, job: int, stats: Path,
               identity: str, port: int) -> dict[str, str]:
    """One rank's environment: torch.distributed's, NCCL's (one GPU shared by distinct
    host ids, network only, the plugin as net, tuner and profiler) and the plugin's."""
    from checkmate.testbed.nccl_harness import plugin_env

    # one loopback address per rank: each rank's repair service has its own port
    env = plugin_env(rank, world, CHANNELS, BUFFSIZE, BUCKETS, PARTITIONS, job,
                     f"127.0.0.{10 + rank}")
    env.update({
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "NCCL_HOSTID": f"ckm-devcheck-host-{rank}",  # two "nodes" on one GPU
        "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
        "NCCL_NVLS_ENABLE": "0", "NCCL_COLLNET_ENABLE": "0",
        "NCCL_NET_PLUGIN": str(plugin), "NCCL_NET": "ckm",  # no silent fallback
        "NCCL_TUNER_PLUGIN": str(plugin), "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "CHECKMATE_SECRET_FILE": str(secret), "CKM_NCCL_STATS": str(stats),
        "CKM_NCCL_IDENTITY": identity, "CUDA_VISIBLE_DEVICES":
            os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
    })
    if identity == "profiler":
        env["NCCL_PROFILER_PLUGIN"] = str(plugin)
    return env


def identity_for(version: tuple[int, ...]) -> str:
    """The profiler path where NCCL has profiler v6 (2.29+), else the model path."""
    return "profiler" if tuple(version[:2]) >= (2, 29) else "model"


def supported(version: tuple[int, ...]) -> bool:
    from checkmate.testbed import nccl_release

    code = version[0] * 10000 + version[1] * 100 + version[2]
    return nccl_release.release_of(code) is not None


def verdict(version: tuple[int, ...], outs: list[Any], datagrams: list[bytes],
            stats: list[list[dict]], logs: list[str], key: tuple[int, int], job: int
            ) -> Result:
    """The check's result from what the run left: each rank's outputs (iterations x
    total), the tapped REPLICATE datagrams, the plugin's counters and each rank's log."""
    import numpy as np

    from checkmate.testbed import nccl_harness as H
    from checkmate.testbed import nccl_replicas as R
    from checkmate.testbed.nccl_release import version_code

    rel = ".".join(map(str, version))
    figs: dict[str, Any] = {"nccl": rel, "buckets": BUCKETS, "iterations": ITERATIONS}
    world = len(outs)
    expect = {it: np.concatenate([H.expected(SEED, it, b, world, n)
                                  for b, n in enumerate(BUCKETS)])
              for it in range(1, ITERATIONS + 1)}
    for r, o in enumerate(outs):
        for i, it in enumerate(expect):
            if not np.array_equal(o[i], expect[it]):
                bad = int((o[i] != expect[it]).sum())
                return Result("nccl-plugin", "FAIL", f"NCCL {rel}: rank {r}'s allreduce of "
                              f"iteration {it} differs from the exact sum in {bad} elements",
                              figs)
    if not all("NET/ckm" in log or "Using network ckm" in log for log in logs):
        return Result("nccl-plugin", "FAIL", f"NCCL {rel} did not report the ckm network "
                      "on every rank (NCCL_DEBUG=INFO): the run did not go through the plugin",
                      figs)
    refusals = [[x for x in log.splitlines() if "ckm-nccl: not tagging" in x] for log in logs]
    sent = sum(s["repl_elems"] for per in stats for s in per if s["kind"] == "send")
    figs["tagged_elements"] = sent
    if not supported(version):
        if all(len(x) == 1 for x in refusals) and sent == 0 and not datagrams:
            return Result("nccl-plugin", "PASS", f"NCCL {rel} is outside the checked range "
                          f"(code {version_code(rel)}): exact results, the plugin refused to "
                          "tag with one line per rank, nothing tagged", figs)
        return Result("nccl-plugin", "FAIL", f"NCCL {rel} is outside the checked range but "
                      f"the plugin did not refuse cleanly (lines {refusals}, {sent} elements "
                      "tagged)", figs)
    if any(refusals):
        first = next(x for x in refusals if x)[0]
        return Result("nccl-plugin", "FAIL", f"NCCL {rel}: the plugin refused to tag: "
                      f"{first}", figs)
    try:
        summary = R.check_replicas(datagrams, key, job, BUCKETS, 1, ITERATIONS, PARTITIONS,
                                   expect)
    except AssertionError as e:
        return Result("nccl-plugin", "FAIL", f"NCCL {rel}: the copies a switch would make "
                      f"are wrong: {str(e).splitlines()[0]}", figs)
    # each shadow's share, assembled from the copies, equals the trainers' result
    from checkmate.protocol import wire
    from checkmate.spec.partition import partition_bounds

    total = sum(BUCKETS)
    bounds = partition_bounds(total, PARTITIONS)
    for it in expect:
        for p, (lo, hi) in enumerate(bounds):
            share = np.full(hi - lo, np.nan, np.float32)
            for d in datagrams:
                h, payload = wire.decode(d)
                if h.iteration == it and h.partition == p:
                    share[h.offset - lo:h.offset - lo + h.count] = np.frombuffer(payload, "<f4")
            if not np.array_equal(share, outs[0][it - 1][lo:hi]):
                return Result("nccl-plugin", "FAIL", f"NCCL {rel}: shadow {p}'s share of "
                              f"iteration {it} differs from the trainers' result", figs)
    figs.update(summary)
    return Result("nccl-plugin", "PASS", f"NCCL {rel}, 2 ranks on one GPU through the ckm "
                  f"plugin ({identity_for(version)} path): exact results, all {total} reduced "
                  f"elements of each of {ITERATIONS} iterations tagged exactly once with a "
                  f"valid MAC, both shadows' shares equal to the trainers'", figs)


def nccl_plugin_check(budget: Budget) -> Result:
    """Runs the check (CUDA present; the caller skips it otherwise)."""
    import torch

    if os.geteuid() != 0:
        return Result("nccl-plugin", "SKIP", "the tap standing in for the switch's copies is "
                      "an AF_PACKET socket on lo: run the device check as root")
    if not budget.fits(60):
        return Result("nccl-plugin", "SKIP", f"does not fit the time budget "
                      f"({budget.left():.0f} s left, about 60 s needed)")
    try:
        build = subprocess.run(["make", "-s", "-C", str(ROOT / "nccl_plugin"),
                                f"OUT={PLUGIN.parent}"], capture_output=True, text=True)
        built = build.returncode == 0
        why = _short(build.stdout + build.stderr)
    except FileNotFoundError:  # no make here: a library built elsewhere and carried along
        built, why = PLUGIN.exists(), "no make on this machine and no build/nccl library"
    if not built:
        return Result("nccl-plugin", "FAIL", f"building the plugin failed: {why}")
    from checkmate.protocol import auth, datamac
    from checkmate.testbed import nccl_replicas as R

    version = tuple(torch.cuda.nccl.version())
    work = Path(tempfile.mkdtemp(prefix="ckm-devcheck-nccl-"))
    secret = auth.create_secret(work / "job.key")
    key = datamac.data_key(auth.load_secret(secret))
    job = random.randrange(1 << 20, 1 << 31)
    port, ident = _free_port(), identity_for(version)
    tap = R.ReplicaTap("lo", job)
    procs = []
    try:
        for r in range(2):
            env = {**os.environ, **device_env(r, 2, PLUGIN, secret, job, work / f"stats-{r}",
                                              ident, port)}
            log = open(work / f"rank{r}.log", "wb")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "checkmate.testbed.device_check", "--worker",
                 "nccl-plugin", "--out", str(work / f"out-{r}.json")], env=env, stdout=log,
                stderr=subprocess.STDOUT, cwd=ROOT), log))
        timeout = min(budget.left() - 5, 180.0)
        for p, _ in procs:
            try:
                p.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    finally:
        for _, log in procs:
            log.close()
        datagrams = tap.close()
    logs = [(work / f"rank{r}.log").read_text(errors="replace") for r in range(2)]
    bad = [r for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if bad:
        return Result("nccl-plugin", "FAIL", f"NCCL {'.'.join(map(str, version))}: rank "
                      f"{bad[0]} exited {procs[bad[0]][0].returncode}: {_short(logs[bad[0]])} "
                      f"(logs in {work})")
    outs = [json.loads((work / f"out-{r}.json").read_text()) for r in range(2)]
    stats = [[json.loads(x) for x in (work / f"stats-{r}").read_text().splitlines() if x]
             for r in range(2)]
    import numpy as np

    return verdict(version, [np.array(o["out"], np.float32) for o in outs], datagrams, stats,
                   logs, key, job)


def worker(argv: list[str]) -> int:
    """One rank: NCCL allreduces of the check's buckets, in order, one per call (as DDP
    issues them: never grouped), then the results as JSON."""
    import argparse

    import numpy as np
    import torch
    import torch.distributed as dist

    from checkmate.testbed import nccl_harness as H

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    # a barrier on the NCCL group would be an allreduce the model path does not expect
    sync = dist.new_group(backend="gloo")
    outs = []
    for it in range(1, ITERATIONS + 1):
        row = []
        for b, n in enumerate(BUCKETS):
            x = torch.from_numpy(H.inputs(SEED, it, b, rank, n)).cuda()
            dist.all_reduce(x)
            row.append(x.cpu().numpy())
        outs.append(np.concatenate(row).tolist())
    torch.cuda.synchronize()
    dist.barrier(group=sync)
    Path(args.out).write_text(json.dumps({"out": outs,
                                          "nccl": list(torch.cuda.nccl.version())}))
    dist.destroy_process_group()
    return 0
