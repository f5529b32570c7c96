"""The device check's checks: (a) each optimizer on CUDA against the shadow's kernel and
its speed against fused AdamW, (b, c) DDP and FSDP2 kill and restart under checkmate launch,
(d) the checkpoint schemes on >= 1 GB of state."""

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
import time
from pathlib import Path
from typing import Any

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

#: name -> (class, param groups' options, clip max norm as a multiple of the gradient's
#: expected norm (about half the steps clip) or None, scheduler)
OPTIM_CASES: dict[str, tuple[str, list[dict[str, Any]], float | None, bool]] = {
    "sgd": ("SGD", [{"lr": 0.05}], None, False),
    "sgd-momentum-dampening": ("SGD", [{"lr": 0.05, "momentum": 0.9, "dampening": 0.3}],
                               None, False),
    "sgd-nesterov-weight-decay": ("SGD", [{"lr": 0.05, "momentum": 0.9, "nesterov": True,
                                           "weight_decay": 1e-3}], None, False),
    "sgd-maximize": ("SGD", [{"lr": 0.01, "momentum": 0.5, "weight_decay": 1e-4,
                              "maximize": True}], None, False),
    "adam": ("Adam", [{"lr": 1e-3, "weight_decay": 1e-2}], None, False),
    "adam-amsgrad": ("Adam", [{"lr": 1e-3, "amsgrad": True, "betas": (0.8, 0.99)}], None,
                     False),
    "adamw": ("AdamW", [{"lr": 1e-3, "weight_decay": 0.1}], None, False),
    "adamw-maximize-eps": ("AdamW", [{"lr": 1e-3, "maximize": True, "eps": 1e-6}], None,
                           False),
    "adamw-groups-scheduler": ("AdamW", [{"lr": 1e-3, "weight_decay": 0.1},
                                         {"lr": 3e-4, "weight_decay": 0.0, "amsgrad": True}],
                               None, True),
    "adamw-clip": ("AdamW", [{"lr": 1e-3, "weight_decay": 0.01}], 1.0, False),
    "sgd-groups-scheduler-clip": ("SGD", [{"lr": 0.05, "momentum": 0.9},
                                          {"lr": 0.01, "momentum": 0.9, "nesterov": True}],
                                  1.0, True),
}

_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening", "nesterov",
          "maximize")


def optim_case(name: str, device: str, n: int, steps: int, seed: int = 0) -> Result:
    """One optimizer case: ``steps`` steps of checkmate.optim on ``device`` tensors vs the
    shadow's FlatOptimizer on the CPU, from the same gradients, rates and clip factors."""
    import numpy as np
    import torch

    import checkmate.optim as co

    cls_name, opts, clip, sched = OPTIM_CASES[name]
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    # Uneven tensors (a cut inside none of them is special), split over the groups.
    sizes = [n // 2 + 7, n // 3 - 5, n - (n // 2 + 7) - (n // 3 - 5)]
    params = [torch.nn.Parameter(torch.randn(k, generator=g, device=dev) * 0.1)
              for k in sizes]
    per = [params[:2], params[2:]] if len(opts) == 2 else [params]
    groups = [{"params": ps, **o} for ps, o in zip(per, opts, strict=True)]
    opt = getattr(co, cls_name)(groups)
    scheduler = (torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.97 ** i) if sched
                 else None)
    flat_order = [p for grp in per for p in grp]
    ranges, pos = [], 0
    for gi, (grp, pg) in enumerate(zip(per, opt.param_groups, strict=True)):
        k = sum(p.numel() for p in grp)
        ranges.append((pos, pos + k, {**{h: pg[h] for h in _HYPER if h in pg}, "group": gi}))
        pos += k
    shadow = co.FlatOptimizer(cls_name.lower(), ranges, pos)
    shadow.state["param"][:] = torch.cat([p.detach().reshape(-1) for p in flat_order]
                                         ).cpu().numpy()
    coefs = []
    t0 = time.perf_counter()
    for _ in range(steps):
        for p in flat_order:
            p.grad = torch.randn(p.shape, generator=g, device=dev) * 0.01
        sent = torch.cat([p.grad.reshape(-1) for p in flat_order]).cpu().numpy()
        coef = (co.clip_grad_norm_(flat_order, clip * 0.01 * pos ** 0.5)[1]
                if clip is not None else None)
        coefs.append(coef)
        lrs = [float(pg["lr"]) for pg in opt.param_groups]
        opt.step()
        if scheduler is not None:
            scheduler.step()
        shadow.step(sent, lrs, coef)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    bad = []
    got = torch.cat([p.detach().reshape(-1) for p in flat_order]).cpu().numpy()
    if not np.array_equal(got.view(np.int32), shadow.state["param"].view(np.int32)):
        bad.append(("param", got, shadow.state["param"]))
    for slot in shadow.slots[1:]:
        parts = []
        for p in flat_order:
            v = opt.state[p].get(slot)
            parts.append(torch.zeros_like(p).reshape(-1) if v is None else v.reshape(-1))
        mine = torch.cat(parts).detach().cpu().numpy()
        if not np.array_equal(mine.view(np.int32), shadow.state[slot].view(np.int32)):
            bad.append((slot, mine, shadow.state[slot]))
    figs = {"elements": pos, "steps": steps, "seconds": round(secs, 2),
            "clipped": sum(1 for c in coefs if c is not None and c < 1.0)}
    where = f"{device} tensors" if dev.type == "cpu" else "CUDA"
    if bad:
        slot, a, b = bad[0]
        diff = np.flatnonzero(a.view(np.int32) != b.view(np.int32))
        return Result(f"optim[{name}]", "FAIL",
                      f"{where} vs shadow kernel after {steps} steps: {len(diff)} of {pos} "
                      f"elements of {slot} differ (first at {diff[0]}: {a[diff[0]]!r} vs "
                      f"{b[diff[0]]!r}); slots differing: {', '.join(x[0] for x in bad)}",
                      figs)
    if clip is not None and figs["clipped"] == 0:
        return Result(f"optim[{name}]", "FAIL", "clipping never acted: the case tests "
                      "nothing about it", figs)
    return Result(f"optim[{name}]", "PASS",
                  f"{where} == shadow kernel bit for bit (int32 views), {pos} elements, "
                  f"{steps} steps, slots {', '.join(shadow.slots)}, {secs:.1f} s",
                  figs)


def optim_speed(n: int, steps: int = 20) -> Result:
    """checkmate AdamW vs torch's fused AdamW, both on CUDA, per step."""
    import torch

    import checkmate.optim as co

    dev = torch.device("cuda", 0)
    times = {}
    for label in ("checkmate", "fused"):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n // 4, device=dev) * 0.1) for _ in range(4)]
        for p in ps:
            p.grad = torch.randn_like(p) * 0.01
        opt = (co.AdamW(ps, lr=1e-3, weight_decay=0.01) if label == "checkmate"
               else torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True))
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            opt.step()
        torch.cuda.synchronize()
        times[label] = (time.perf_counter() - t) / steps
        del opt, ps
        torch.cuda.empty_cache()
    ratio = times["checkmate"] / times["fused"]
    figs = {"params_m": n / 1e6, "checkmate_ms": round(1e3 * times["checkmate"], 2),
            "fused_ms": round(1e3 * times["fused"], 2), "ratio": round(ratio, 3)}
    status = "PASS" if ratio <= 2.0 else "FAIL"
    return Result("optim-speed", status,
                  f"checkmate AdamW {figs['checkmate_ms']} ms/step vs torch fused AdamW "
                  f"{figs['fused_ms']} ms/step at {n / 1e6:.0f}M parameters: ratio "
                  f"{ratio:.2f} (target <= 2)", figs)


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


def _launch_argv(nproc: int, shadows: int | None, mode: str, d: Path, worker: str,
                 extra: list[str], gockpt: str | None = None, restarts: int = 1) -> list[str]:
    argv = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", str(nproc),
            "--max-restarts", str(restarts), "--progress-every", "0", "--dir", str(d),
            "--mode", mode]
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
        argv = _launch_argv(2, 2, "host", work / run, kind,
                            ["--steps", str(steps), "--out", str(out)])
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
                             "--out", str(res), *common], gockpt=gk, restarts=0)
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
