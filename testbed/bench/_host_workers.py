"""What the in-process host-mode benches share (ddp, verify, replicas, colocate; a leading
underscore: not a bench of its own in `testbed bench`): two real ``shadow serve`` processes
on a loopback /24, trainer processes of a bench module run as ``--worker`` with
torch's rendezvous variables, and the JobLayout those trainers use.

Why one place: the benches run the same job shape -- two shadows, ``--world`` trainers
meeting at a free local port -- and compare variants inside it; only the worker differs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from checkmate.config import cluster as cfgmod
from checkmate.errors import CheckmateError
from checkmate.launch.local_shadows import stop_processes
from checkmate.protocol import auth
from checkmate.testbed import lifeline


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The options every host-mode bench takes (the job's shape) and the hidden ones its
    workers are started with; a bench adds its own."""
    ap = argparse.ArgumentParser(prog=f"testbed bench {name}", description=doc)
    ap.add_argument("--model", default="gpt", choices=("gpt", "cnn"))
    ap.add_argument("--width", type=int, default=256, help="model width")
    ap.add_argument("--world", type=int, default=2, help="trainer processes")
    ap.add_argument("--rounds", type=int, default=4, help="alternated rounds (medians)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--net", help=argparse.SUPPRESS)
    ap.add_argument("--shadows", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap


def end_worker(code: int) -> NoReturn:
    """End a bench worker the way `checkmate launch` ends its workers
    (checkmate.train.run_script): streams flushed, then ``os._exit``. The interpreter's own
    teardown can abort in gloo's C++ threads ("terminate called without an active
    exception", seen in about one run of ten with the trainers pinned to one core), which
    fails the run after its figures were written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def layout(net: str, ips: list[str], rank: int, world: int, replicas: int = 1) -> Any:
    """The host-mode JobLayout of trainer ``rank`` of ``world`` with shadows at ``ips``
    (``replicas`` whole sets of them, one after the other)."""
    from checkmate.train import JobLayout, ShadowTarget

    n = len(ips) // replicas
    sets = [ips[k * n:(k + 1) * n] for k in range(replicas)]
    return JobLayout(
        job_id=7, rank=rank, world=world,
        trainers=[(f"{net}.{10 + r}", cfgmod.TRAINER_PORT) for r in range(world)],
        shadows=[ShadowTarget(p, ip, cfgmod.SHADOW_PORT) for p, ip in enumerate(sets[0])],
        shadow_tcp=[(ip, cfgmod.RESTORE_PORT) for ip in sets[0]], mode="host", seed=1,
        replica_shadows=[[ShadowTarget(p, ip, cfgmod.SHADOW_PORT) for p, ip in enumerate(s)]
                         for s in sets[1:]],
        replica_tcp=[[(ip, cfgmod.RESTORE_PORT) for ip in s] for s in sets[1:]])


def pinned(cores: str | None, argv: list[str]) -> list[str]:
    """``argv`` run on the CPU list ``cores`` (taskset's form, ``0,2-3``); None: unpinned."""
    return argv if cores is None else ["taskset", "-c", cores, *argv]


def run(module: str, net: str, work: Path, world: int, worker_args: list[str],
        replicas: int = 1, trainer_cores: str | None = None,
        shadow_cores: str | None = None) -> dict:
    """Start the shadows (``replicas`` of each partition) and ``world`` workers (``python -m
    module --worker ARGS --net --shadows --out``), each set on its CPU list when given,
    wait for them, stop everything, and return the JSON rank 0 wrote. A job secret of the
    run's own is made when none is set (as the launcher does)."""
    if not os.environ.get(auth.SECRET_ENV):
        auth.create_secret(work / "job.key")
        os.environ[auth.SECRET_ENV] = str(work / "job.key")
    shadows, ips = start_shadows(net, work, replicas, shadow_cores)
    out = work / "result.json"
    out.unlink(missing_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for r in range(world):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1"}
            procs.append(lifeline.popen(pinned(trainer_cores, [
                sys.executable, "-m", module, "--worker", *worker_args, "--net", net,
                "--shadows", ",".join(ips), "--out", str(out)]),
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                start_new_session=True))
        errs = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=900)
            except subprocess.TimeoutExpired:
                err = b"timed out"
            errs.append(err.decode(errors="replace").strip().splitlines()[-3:])
    finally:
        stop_processes(procs)
        stop_processes(shadows)
    if any(p.returncode for p in procs) or not out.exists():
        codes = [p.returncode for p in procs]
        raise CheckmateError(f"benchmark workers failed (exit {codes}): {errs}")
    return json.loads(out.read_text())


def start_shadows(net: str, work: Path, replicas: int = 1, cores: str | None = None
                  ) -> tuple[list[subprocess.Popen], list[str]]:
    """Two ``shadow serve`` processes (partitions 0/2 and 1/2) per replica on ``net``, on
    the CPU list ``cores`` when given, ready to seed: replica k of partition p at .100 +
    2k + p."""
    ips = [f"{net}.{100 + i}" for i in range(2 * replicas)]
    procs = []
    for i, ip in enumerate(ips):
        p = i % 2
        log = open(work / f"shadow{i}.log", "wb")  # noqa: SIM115
        procs.append(lifeline.popen(pinned(cores, [
            sys.executable, "-m", "checkmate.shadow.cli", "serve", "--partition", f"{p}/2",
            "--config", str(cfgmod.default_path()), "--bind", ip, "--no-register",
            "--window", "64"]), stdout=log, stderr=log, start_new_session=True))
        log.close()
    deadline = time.monotonic() + 120
    for p, (ip, proc) in enumerate(zip(ips, procs, strict=True)):
        while True:
            if proc.poll() is not None:
                tail = (work / f"shadow{p}.log").read_text(errors="replace")[-300:]
                raise CheckmateError(f"shadow {ip} exited at start: {tail.strip()}")
            try:
                socket.create_connection((ip, cfgmod.RESTORE_PORT), 0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise CheckmateError(f"shadow {p} did not start in 120 s") from None
                time.sleep(0.2)
    return procs, ips
