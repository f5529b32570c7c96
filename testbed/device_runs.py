"""The device check's checks: (a) each optimizer on CUDA against the shadow's kernel and
its speed against fused AdamW (the comparison itself: checkmate.optim.device_check),
(b, c) DDP and FSDP2 kill and restart under checkmate launch, (d) the checkpoint schemes on
>= 1 GB of state."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from checkmate.launch import placement as launch_placement
from checkmate.testbed.device_common import (
    NCCL_ENV,
    Budget,
    Result,
    _free_port,
    _run,
    _short,
    same_bits,
)
from checkmate.testbed.device_workers import ALTERNATED


def optim_case(name: str, device: str, n: int, steps: int) -> Result:
    """(a) One optimizer case of checkmate.optim.device_check (the one CUDA-vs-shadow
    comparison) as a device-check line. On CPU tensors the exact torch path runs (the
    default there, Numba, is the shadow's own kernel: it would compare a thing to itself)."""
    from checkmate.optim import device_check as odc

    r = odc.check_case(odc.CASE_NAMES[name], n=n, steps=steps, device=device,
                       executor="auto" if device == "cuda" else "torch")
    where = "CUDA" if device == "cuda" else f"{device} tensors"
    label = "optim" if device == "cuda" else f"optim-{device}"
    if not r.ok:
        return Result(f"{label}[{name}]", "FAIL", f"{where} vs shadow kernel: {r.detail}",
                      r.figures)
    return Result(f"{label}[{name}]", "PASS", f"{where} == shadow kernel bit for bit: "
                  f"{r.detail}, {r.seconds:.1f} s", r.figures)


def optim_speed(n: int) -> Result:
    """(a) checkmate AdamW vs torch's fused AdamW on CUDA (checkmate.optim.device_check)."""
    from checkmate.optim import device_check as odc

    b = odc.bench_adamw(n=n)
    ok, line = odc.speed_verdict(b)
    figs = {k: round(v, 3) if isinstance(v, float) else v for k, v in b.items()}
    return Result("optim-speed", "PASS" if ok else "FAIL", line, figs)


# --------------------------------------------------------------- (b)(c) launcher checks


def probe_backend(budget: Budget) -> tuple[str | None, str]:
    """Which backend two ranks on the one GPU get: NCCL with a host id per rank, else gloo
    with CUDA tensors. Returns (backend or None, what happened)."""
    notes = []
    for backend in ("nccl", "gloo"):
        port = _free_port()
        procs = []
        for r in range(2):
            env = {**os.environ, **NCCL_ENV, "RANK": str(r), "WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "NCCL_HOSTID": f"ckm-devcheck-{r}"}
            procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--probe", backend],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
        outs, ok = [], True
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(5.0, min(45.0, budget.left())))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, _ = p.communicate()
                out += "\n(timed out)"
            outs.append(out)
            ok = ok and p.returncode == 0
        if ok:
            return backend, "; ".join(notes + [f"{backend}: 2 ranks on GPU 0 all-reduce ok"])
        notes.append(f"{backend} refused: {_short(' '.join(outs), 160)}")
    return None, "; ".join(notes)


def _probe(backend: str) -> int:
    """One rank of the backend probe: an all-reduce of a CUDA tensor."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group(backend, device_id=torch.device("cuda", 0)
                            if backend == "nccl" else None)
    x = torch.full((1 << 20,), float(dist.get_rank() + 1), device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    ok = bool((x == 3.0).all())
    dist.destroy_process_group()
    print("probe", backend, "ok" if ok else "wrong sum", flush=True)
    return 0 if ok else 1


#: Ranks of the kill/restart jobs (both on GPU 0: NCCL sees two hosts, NCCL_ENV).
JOB_RANKS = 2


def placement(cpu: bool, nproc: int = JOB_RANKS) -> launch_placement.Placement:
    """Where the device check's work runs: the launcher's own decision
    (checkmate.launch.placement) for ``nproc`` ranks, on the CPU when ``cpu`` (--cpu-smoke),
    else on CUDA where a device is visible."""
    return launch_placement.place("cpu" if cpu else "auto", nproc,
                                  launch_placement.cuda_device_count())


def _launch_argv(nproc: int, shadows: int | None, mode: str, d: Path, worker: str,
                 extra: list[str], gockpt: str | None = None, restarts: int = 1,
                 device: str = "cuda") -> list[str]:
    """`checkmate launch` of this file's ``worker`` on the device the check decided
    (placement), given to the launcher rather than decided there again."""
    argv = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node",
            str(nproc), "--device", device, "--max-restarts", str(restarts),
            "--progress-every", "0", "--dir", str(d), "--mode", mode]
    if shadows:
        argv += ["--shadows", str(shadows)]
    if gockpt:
        argv += ["--gockpt", gockpt]
    return argv + [str(Path(__file__).resolve()), "--worker", worker, *extra]


def kill_restore(kind: str, backend: str, budget: Budget, steps: int = 24,
                 device: str = "cuda") -> Result:
    """(b)/(c): clean and killed launches of a 2-rank job on GPU 0 (or the CPU), final
    state compared bit for bit."""
    import torch

    name = kind if device == "cuda" else f"{kind}-cpu"
    work = Path(tempfile.mkdtemp(prefix=f"ckm-devcheck-{kind}-"))
    rank, at = random.randrange(2), random.randrange(3, steps - 2)
    env = {**NCCL_ENV, "CKM_DEVCHECK_BACKEND": backend, "CKM_DEVCHECK_DEVICE": device,
           "NUMBA_NUM_THREADS": "4" if device == "cuda" else "1"}
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
    outs, states = {}, {}
    for run in ("clean", "killed"):
        left = budget.left()
        if left < 20:
            return Result(name, "SKIP", f"the time budget ran out before the {run} run "
                          f"({left:.0f} s left)")
        out = work / f"{run}.pt"
        renv = dict(env)
        if run == "killed":
            renv["CHECKMATE_KILL_AT"] = f"{rank}:{at}"
        argv = _launch_argv(JOB_RANKS, 2, "host", work / run, kind,
                            ["--steps", str(steps), "--out", str(out)], device=device)
        # a hung launch (a NCCL hang) must not eat the whole budget
        rc, text = _run(argv, renv, min(left - 5, 150.0 if device == "cuda" else 400.0))
        outs[run] = text
        (work / f"{run}.log").write_text(text)
        if rc != 0 or not out.exists():
            return Result(name, "FAIL", f"the {run} launch failed (exit {rc}): "
                          f"{_short(text)} (log: {work / (run + '.log')})")
        states[run] = torch.load(out, weights_only=False, map_location="cpu")
    why = f"rank {rank} SIGKILLed after iteration {at}"
    if "restarting the worker group" not in outs["killed"]:
        return Result(name, "FAIL", f"{why}, but the launcher never restarted the group "
                      f"(log: {work / 'killed.log'})")
    diff = same_bits(states["clean"], states["killed"], "state")
    figs = {"backend": backend, "steps": steps, "killed_rank": rank, "killed_at": at}
    if diff:
        return Result(name, "FAIL", f"{why} and restarted: final state differs from the "
                      f"failure-free run ({diff}; backend {backend})", figs)
    m = re.search(r"resumed from the shadows at iteration (\d+)", outs["killed"])
    figs["resumed_at"] = int(m.group(1)) if m else None
    shutil.rmtree(work, ignore_errors=True)  # kept only where something failed
    where = "one GPU" if device == "cuda" else "CPU"
    return Result(name, "PASS", f"{backend} on {where}, 2 ranks + 2 shadows: {why}, "
                  f"restarted (resumed at {figs['resumed_at']}), final state bit-identical "
                  f"to the failure-free run ({steps} steps)", figs)


def schemes_check(backend: str, budget: Budget, width: int, layers: int, rounds: int,
                  device: str = "cuda") -> list[Result]:
    """(d): the schemes on the GPU (or the CPU); a Result per failed or skipped launch and
    one with the medians and ratios."""
    work = Path(tempfile.mkdtemp(prefix="ckm-devcheck-schemes-"))
    env = {"CKM_DEVCHECK_BACKEND": backend, "CKM_DEVCHECK_DEVICE": device,
           "NUMBA_NUM_THREADS": "8" if device == "cuda" else "1"}
    common = ["--width", str(width), "--layers", str(layers), "--rounds", str(rounds),
              "--batch", "4096" if device == "cuda" else "64"]
    tag = "schemes" if device == "cuda" else "schemes-cpu"
    runs = [("alternated", "off", None, ",".join(ALTERNATED), None),
            ("checkmate", "host", 2, "checkmate", None),
            ("gockpt", "gockpt", None, "gockpt", "4,4")]
    rates: dict[str, list[float]] = {}
    out: list[Result] = []
    state_gb = None
    for label, mode, shadows, schemes, gk in runs:
        if not budget.fits(60):
            out.append(Result(f"{tag}[{label}]", "SKIP", f"does not fit the time budget "
                              f"({budget.left():.0f} s left, about 60 s needed)"))
            continue
        res = work / f"{label}.json"
        argv = _launch_argv(1, shadows, mode, work / label, "bench",
                            ["--schemes", schemes, "--ckdir", str(work / f"ck-{label}"),
                             "--out", str(res), *common], gockpt=gk, restarts=0,
                            device=device)
        rc, text = _run(argv, env, min(budget.left() - 5,
                                       150.0 if device == "cuda" else 400.0))
        (work / f"{label}.log").write_text(text)
        shutil.rmtree(work / f"ck-{label}", ignore_errors=True)  # GBs of checkpoints
        if rc != 0 or not res.exists():
            out.append(Result(f"{tag}[{label}]", "FAIL", f"launch failed (exit {rc}): "
                              f"{_short(text)} (log: {work / (label + '.log')})"))
            continue
        shutil.rmtree(work / label, ignore_errors=True)  # GoCkpt's checkpoints
        got = json.loads(res.read_text())
        state_gb = got["state_gb"]
        rates.update(got["rates"])
    if "none" not in rates:
        out.append(Result(tag, "FAIL" if any(r.status == "FAIL" for r in out) else "SKIP",
                          "no reference run (none), so no ratios"))
        return out
    med = {s: statistics.median(v) for s, v in rates.items()}
    figs = {"state_gb": round(state_gb or 0, 2), "rounds": rounds,
            "it_per_s": {s: round(v, 3) for s, v in med.items()},
            "vs_none": {s: round(v / med["none"], 3) for s, v in med.items()}}
    parts = [f"{s} {figs['vs_none'][s]:.3f}" for s in med if s != "none"]
    ratio = ""
    if "checkmate" in med and "dcp-process" in med:
        figs["checkmate_vs_dcp_async"] = round(med["checkmate"] / med["dcp-process"], 3)
        ratio = f"; checkmate / DCP async {figs['checkmate_vs_dcp_async']:.3f}"
    if "checkmate" in med and "torchsave" in med:
        figs["checkmate_vs_torchsave"] = round(med["checkmate"] / med["torchsave"], 3)
        ratio += f"; checkmate / torch.save {figs['checkmate_vs_torchsave']:.3f}"
    ok = all(r.status != "FAIL" for r in out)
    if ok:
        shutil.rmtree(work, ignore_errors=True)  # kept only where something failed
    out.append(Result(tag, "PASS" if ok else "FAIL",
                      f"{figs['state_gb']} GB state, median of {rounds} rounds, throughput vs "
                      f"none ({med['none']:.2f} it/s): {', '.join(parts)}{ratio}", figs))
    return out


# ------------------------------------------------------------------------------- main
