"""`testbed device-check`: Checkmate on one GPU, in one command with a global time budget.

Run by a person with one GPU after ``make setup`` (or ``scripts/device-check.sh``, which
also brings the project's small dependencies onto a machine that lacks them). Prints one
line per check -- ``PASS``, ``FAIL`` or ``SKIP`` with the reason -- and a summary line;
with CUDA it writes the figures into docs/gpu.md (``--doc``). Checks (docs/gpu.md):

  optim[CASE]     each checkmate optimizer and option, 10M+ parameters, 50 steps: the CUDA
                  result vs the shadows' CPU Numba kernel (FlatOptimizer) fed the same
                  gradients, learning rates and clip factors, bit for bit (int32 views)
  optim-speed     checkmate AdamW on CUDA vs torch's fused CUDA AdamW, 100M parameters
  ddp             2-rank DDP on NCCL on the one GPU (a NCCL_HOSTID per rank), 2 shadows,
                  under `checkmate launch`; a worker SIGKILLed at a random iteration and
                  restarted; final state bit-identical to a failure-free run
  fsdp            the same with FSDP2
  schemes         none, torch.save, DCP async (stager, pinned memory), CheckFreq, GoCkpt,
                  Checkmate (DDP hook, host mode) on >= 1 GB of model + optimizer state

Without CUDA every CUDA part is a SKIP line that names it; ``--cpu-smoke`` runs the
optimizer harness on CPU tensors at a small size (the harness itself, not the device).
A check that does not fit the remaining budget is skipped and says so. Exit status: 0
when nothing failed, 1 otherwise; bad arguments are one line and 2.

The workers (``--worker ddp|fsdp|bench``) are this file run by `checkmate launch`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "gpu.md"
BEGIN, END = "<!-- device-check results: begin -->", "<!-- device-check results: end -->"
#: Modules the launcher, the shadows and the sessions import (not the optimizer check).
PROJECT_DEPS = ("crc32c", "pydantic", "yaml", "numba")
#: Environment for two NCCL ranks on one GPU: each rank its own host id (set by the worker
#: from LOCAL_RANK), so NCCL sees two nodes and uses its network transport.
NCCL_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL, SKIP
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.reason}"


class Budget:
    """The check's global time budget: what is left, and whether a step fits."""

    def __init__(self, seconds: float) -> None:
        self.total, self.t0 = seconds, time.monotonic()

    def left(self) -> float:
        return self.total - (time.monotonic() - self.t0)

    def fits(self, need: float) -> bool:
        return self.left() >= need


# ----------------------------------------------------------------------------- helpers

def _cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _missing(mods: tuple[str, ...]) -> list[str]:
    import importlib.util

    return [m for m in mods if importlib.util.find_spec(m) is None]


def environment() -> dict[str, str]:
    """The card and the versions the results belong to."""
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": str(torch.version.cuda), "card": "none (no CUDA device)", "nccl": "-"}
    if _cuda():
        env["card"] = torch.cuda.get_device_name(0)
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            env["nccl"] = f"unknown ({e})"
    for mod in ("numba", "triton"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            env[mod] = "absent"
    return env


def same_bits(a: Any, b: Any, where: str = "") -> str | None:
    """None when ``a`` and ``b`` (nested state dicts) are bit for bit equal, else where not."""
    import torch

    if torch.is_tensor(a):
        if not torch.is_tensor(b) or a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: dtype/shape differ"
        x = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        y = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return None if torch.equal(x, y) else f"{where}: values differ"
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return f"{where}: keys differ"
        for k in a:
            why = same_bits(a[k], b[k], f"{where}/{k}")
            if why:
                return why
        return None
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            why = same_bits(x, y, f"{where}/{i}")
            if why:
                return why
        return None
    return None if a == b else f"{where}: {a!r} != {b!r}"


def _short(text: str, n: int = 300) -> str:
    """The last meaningful line of a process's output, for a one-line FAIL."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower() or "Error" in ln]
    pick = (errs or lines or ["(no output)"])[-1]
    return pick[:n]


# ------------------------------------------------------------------ (a) the optimizers

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

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None
         ) -> tuple[int, str]:
    """Run a command in a session of its own; on timeout its whole process group (ours)
    is killed. Returns (exit status, output); status -999 for a timeout."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, **env}, start_new_session=True, cwd=cwd)
    try:
        out, _ = p.communicate(timeout=max(1.0, timeout))
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return -999, out + f"\n(timed out after {timeout:.0f} s)"


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
    argv = [sys.executable, "-m", "checkmate.launch", "launch", "--nproc-per-node", str(nproc),
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


def _worker_device() -> Any:
    """GPU 0 for every rank, or the CPU where the check runs its launcher parts on CPU
    (``CKM_DEVCHECK_DEVICE=cpu``: the launcher, kill and comparison logic without a GPU)."""
    import torch

    if os.environ.get("CKM_DEVCHECK_DEVICE", "cuda") == "cpu":
        torch.set_num_threads(1)
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _worker_ddp_fsdp(kind: str, argv: list[str]) -> int:
    """A 2-rank job on GPU 0 under `checkmate launch` (model, optimizer, session)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from checkmate.optim import AdamW

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ["NCCL_HOSTID"] = f"ckm-devcheck-{local}"  # read at NCCL's init, below
    backend = os.environ.get("CKM_DEVCHECK_BACKEND", "nccl")
    dev = _worker_device()  # every rank on the one GPU
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10)).to(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        from checkmate.train import DDPSession

        wrapped = DistributedDataParallel(model, device_ids=[0] if dev.type == "cuda" else None)
        optimizer = AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 8))
        sess = DDPSession.from_env(wrapped, optimizer, sched, max_grad_norm=1.0)
    else:
        from torch.distributed.fsdp import fully_shard

        from checkmate.train import FSDPSession

        for i in (0, 2, 4):
            fully_shard(model[i])
        fully_shard(model)
        wrapped = model
        optimizer = AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 8))
        sess = FSDPSession.from_env(model, optimizer, sched, max_grad_norm=1.0)
    for it in range(sess.done_iteration + 1, args.steps + 1):
        sess.begin(it)
        x = torch.randn(64, 256, device=dev)
        y = x[:, :10].argmax(dim=1)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(sess.model(x), y)
        loss.backward()
        sess.step()
    sess.finish()
    if args.out:
        from torch.distributed.tensor import DTensor

        def full(v: Any) -> Any:
            v = v.full_tensor() if isinstance(v, DTensor) else v
            return v.detach().cpu() if torch.is_tensor(v) else v

        osd = optimizer.state_dict()
        state = {"model": {k: full(v) for k, v in model.state_dict().items()},
                 "optimizer": {"state": {i: {k: full(v) for k, v in st.items()}
                                         for i, st in sorted(osd["state"].items())},
                               "param_groups": osd["param_groups"]},
                 "scheduler": sched.state_dict()}
        if sess.layout.rank == 0:
            torch.save(state, args.out)
    sess.close()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------- (d) the schemes

#: Baseline kinds alternated inside one launch (mode off); GoCkpt and Checkmate need a
#: session mode of their own, so each gets a launch.
ALTERNATED = ("none", "torchsave", "dcp", "dcp-process", "checkfreq")


def _worker_bench(argv: list[str]) -> int:
    """One launch of the schemes bench on GPU 0: rounds of timed steps per scheme."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from checkmate.optim import AdamW
    from checkmate.train import DDPSession
    from checkmate.train.baselines import Baseline

    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", required=True)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round")
    ap.add_argument("--batch", type=int, default=4096,
                    help="rows per step: about 50 ms of fp32 compute on an H100 at width 4096")
    ap.add_argument("--ckdir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    dev = _worker_device()
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers).to(dev)
    dist.init_process_group(os.environ.get("CKM_DEVCHECK_BACKEND", "nccl"))
    ddp = DistributedDataParallel(model, device_ids=[0] if dev.type == "cuda" else None)
    optimizer = AdamW(model.parameters(), lr=1e-4)
    sess = DDPSession.from_env(ddp, optimizer, None)
    schemes = args.schemes.split(",")
    rank = dist.get_rank()
    rates: dict[str, list[float]] = {s: [] for s in schemes}
    it = sess.done_iteration
    x = torch.randn(args.batch, args.width, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def one_step(ck: Baseline | None) -> None:
        nonlocal it
        it += 1
        sess.begin(it)
        optimizer.zero_grad()
        sess.model(x).float().pow(2).mean().backward()
        if ck is not None:
            ck.before_step()
        sess.step()
        if ck is not None:
            ck.save(it, model, optimizer)

    for rnd in range(args.rounds):
        for s in (schemes if rnd % 2 == 0 else schemes[::-1]):
            d = Path(args.ckdir) / f"{s}-{rnd}"
            d.mkdir(parents=True, exist_ok=True)
            ck = Baseline(s, str(d), rank, 1) if s in ALTERNATED else None
            one_step(ck)  # untimed: a scheme's first save starts its threads/processes
            sync()
            t = time.perf_counter()
            for _ in range(args.steps):
                one_step(ck)
            if ck is not None:
                ck.finish()  # the checkpoints taken are paid for inside the round
            sync()
            rates[s].append(args.steps / (time.perf_counter() - t))
            shutil.rmtree(d, ignore_errors=True)  # 1.2 GB per checkpoint: the disk is finite
    n = sum(p.numel() for p in model.parameters())
    if rank == 0:
        Path(args.out).write_text(json.dumps({"rates": rates, "params": n,
                                              "state_gb": 12 * n / 1e9}))
    if sess.layout.mode != "off":
        sess.finish()
    sess.close()
    dist.destroy_process_group()
    return 0


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

def _doc_table(results: list[Result], env: dict[str, str], seconds: float) -> str:
    head = (f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on **{env['card']}**: "
            f"torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, numba "
            f"{env['numba']}, triton {env['triton']}, Python {env['python']}; "
            f"{seconds:.0f} s in all.\n\n")
    rows = ["| check | result | figures |", "|---|---|---|"]
    for r in results:
        figs = json.dumps(r.figures, sort_keys=True) if r.figures else ""
        rows.append(f"| {r.name} | {r.status} | {r.reason.replace('|', '/')}"
                    f"{' `' + figs + '`' if figs else ''} |")
    return head + "\n".join(rows) + "\n"


def write_doc(path: Path, results: list[Result], env: dict[str, str], seconds: float) -> None:
    text = path.read_text() if path.exists() else f"# GPU results\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path} lacks the markers {BEGIN} / {END}")
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    path.write_text(text[:a] + "\n" + _doc_table(results, env, seconds) + text[b:])


def run_checks(args: argparse.Namespace, emit: Callable[[Result], None]) -> list[Result]:
    budget = Budget(args.budget)
    results: list[Result] = []

    def add(r: Result) -> None:
        results.append(r)
        emit(r)

    def guarded(name: str, fn: Callable[[], Any]) -> None:
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001 - every failure is one FAIL line
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            add(Result(name, "FAIL", f"{type(e).__name__}: {msg}"))
            return
        for r in got if isinstance(got, list) else [got]:
            add(r)

    cuda = _cuda() and not args.cpu_smoke
    only = set(args.only.split(",")) if args.only else None

    def wanted(name: str) -> bool:
        return only is None or name in only

    no_cuda = "no CUDA device" if not _cuda() else "--cpu-smoke given"
    # (a) optimizers
    if wanted("optim"):
        if not _cuda() or args.cpu_smoke:
            for name in OPTIM_CASES:
                if not budget.fits(5):
                    add(Result(f"optim-cpu[{name}]", "SKIP", "does not fit the time budget"))
                    continue
                guarded(f"optim-cpu[{name}]",
                        lambda n=name: _relabel(optim_case(n, "cpu", args.cpu_n, args.cpu_steps),
                                                "optim-cpu"))
        for name in OPTIM_CASES:
            if not cuda:
                add(Result(f"optim[{name}]", "SKIP", f"CUDA vs shadow kernel: {no_cuda}"))
            elif not budget.fits(15):
                add(Result(f"optim[{name}]", "SKIP", f"does not fit the time budget "
                           f"({budget.left():.0f} s left)"))
            else:
                guarded(f"optim[{name}]",
                        lambda n=name: optim_case(n, "cuda", args.params, args.steps))
    if wanted("optim-speed"):
        if not cuda:
            add(Result("optim-speed", "SKIP", f"checkmate vs fused CUDA AdamW: {no_cuda}"))
        elif not budget.fits(20):
            add(Result("optim-speed", "SKIP", "does not fit the time budget"))
        else:
            guarded("optim-speed", lambda: optim_speed(args.speed_params))
    # (b)-(d) need the launcher, shadows and sessions: the project's own dependencies
    later = [c for c in ("ddp", "fsdp", "schemes") if wanted(c)]
    if not later:
        return results
    if args.cpu_launch:  # the launcher parts on CPU tensors with gloo: logic, not device
        if _missing(PROJECT_DEPS):
            for c in later:
                add(Result(f"{c}-cpu", "FAIL", f"needs {', '.join(_missing(PROJECT_DEPS))}"))
            return results
        for c in ("ddp", "fsdp"):
            if c in later:
                guarded(f"{c}-cpu", lambda c=c: kill_restore(c, "gloo", budget, args.job_steps,
                                                             "cpu"))
        if "schemes" in later:
            guarded("schemes-cpu", lambda: schemes_check("gloo", budget, args.bench_width,
                                                         args.bench_layers, args.rounds, "cpu"))
    if not cuda:
        what = {"ddp": "2-rank DDP on NCCL on one GPU, SIGKILL + restart, bit-identical",
                "fsdp": "2-rank FSDP2 on one GPU, SIGKILL + restart, bit-identical",
                "schemes": "checkpoint schemes on the GPU with >= 1 GB of state"}
        for c in later:
            add(Result(c, "SKIP", f"{what[c]}: {no_cuda}"))
        return results
    missing = _missing(PROJECT_DEPS)
    if missing:
        for c in later:
            add(Result(c, "FAIL", f"needs {', '.join(missing)} (the launcher, shadows and "
                       "sessions import them); scripts/device-check.sh installs them from "
                       "build/device-wheels"))
        return results
    backend, how = (None, "")
    if budget.fits(30):
        try:
            backend, how = probe_backend(budget)
        except Exception as e:  # noqa: BLE001
            how = f"probe failed: {e}"
    else:
        how = "no time left in the budget to probe"
    note = " (NCCL refused: the checks below run on gloo)" if backend == "gloo" else ""
    add(Result("backend", "FAIL" if backend is None else "PASS", how + note,
               {"backend": backend}))
    if backend is None:
        for c in later:
            add(Result(c, "FAIL", "no backend runs 2 ranks on this GPU (see backend)"))
        return results
    for c in ("ddp", "fsdp"):
        if c not in later:
            continue
        if c == "fsdp" and backend != "nccl":
            add(Result(c, "SKIP", "FSDP2 needs NCCL's reduce-scatter on CUDA; gloo ran"))
        elif not budget.fits(90):
            add(Result(c, "SKIP", f"does not fit the time budget ({budget.left():.0f} s "
                       "left, about 90 s needed)"))
        else:
            guarded(c, lambda c=c: kill_restore(c, backend, budget, args.job_steps))
    if "schemes" in later:
        guarded("schemes", lambda: schemes_check(backend, budget, args.bench_width,
                                                 args.bench_layers, args.rounds))
    return results


def _relabel(r: Result, prefix: str) -> Result:
    r.name = r.name.replace("optim", prefix, 1)
    return r


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"] and len(argv) > 1:
        kind = argv[1]
        if kind in ("ddp", "fsdp"):
            return _worker_ddp_fsdp(kind, argv[2:])
        if kind == "bench":
            return _worker_bench(argv[2:])
    if argv[:1] == ["--probe"] and len(argv) > 1:
        return _probe(argv[1])
    return _main(argv)


def _positive(kind: type) -> Callable[[str], Any]:
    def conv(s: str) -> Any:
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
        return v
    return conv


def _main(argv: list[str]) -> int:
    from checkmate.errors import cli_guard

    @cli_guard("testbed device-check")
    def run() -> int:
        ap = argparse.ArgumentParser(prog="testbed device-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--budget", type=_positive(float), default=450.0, metavar="SECONDS",
                        help="global time budget; what does not fit is skipped (default 450)")
        ap.add_argument("--cpu-smoke", action="store_true",
                        help="run the optimizer harness on CPU tensors at a small size and "
                        "skip every CUDA part")
        ap.add_argument("--cpu-launch", action="store_true",
                        help="also run the launcher checks (ddp, fsdp, schemes) on CPU tensors "
                        "with gloo at the sizes given: their logic, not the device")
        ap.add_argument("--only", help="comma-separated subset: optim, optim-speed, ddp, "
                        "fsdp, schemes")
        ap.add_argument("--params", type=_positive(int), default=10_500_000,
                        help="elements per optimizer case on CUDA (10M+)")
        ap.add_argument("--steps", type=_positive(int), default=50)
        ap.add_argument("--cpu-n", type=_positive(int), default=20_011)
        ap.add_argument("--cpu-steps", type=_positive(int), default=5)
        ap.add_argument("--speed-params", type=_positive(int), default=100_000_000)
        ap.add_argument("--job-steps", type=_positive(int), default=24)
        ap.add_argument("--bench-width", type=_positive(int), default=4096)
        ap.add_argument("--bench-layers", type=_positive(int), default=6)
        ap.add_argument("--rounds", type=_positive(int), default=5)
        ap.add_argument("--doc", type=Path, default=None,
                        help=f"write the results table here (default with CUDA: {DOC})")
        ap.add_argument("--no-doc", action="store_true", help="write no results table")
        args = ap.parse_args(argv)
        known = {"optim", "optim-speed", "ddp", "fsdp", "schemes"}
        if args.only and not set(args.only.split(",")) <= known:
            from checkmate.errors import CheckmateError

            raise CheckmateError(f"--only takes {', '.join(sorted(known))}; got {args.only}")
        t0 = time.monotonic()
        env = environment()
        print("device-check: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
        results = run_checks(args, lambda r: print(r.line(), flush=True))
        secs = time.monotonic() - t0
        counts = {s: sum(1 for r in results if r.status == s) for s in ("PASS", "FAIL", "SKIP")}
        doc = args.doc if args.doc is not None else (DOC if _cuda() and not args.cpu_smoke
                                                     else None)
        if doc is not None and not args.no_doc:
            write_doc(doc, results, env, secs)
        print(f"device-check summary: {counts['PASS']} passed, {counts['FAIL']} failed, "
              f"{counts['SKIP']} skipped in {secs:.0f} s on {env['card']}"
              + (f"; figures written to {doc}" if doc is not None and not args.no_doc
                 else ""), flush=True)
        return 1 if counts["FAIL"] else 0

    return run()


if __name__ == "__main__":
    sys.exit(main())
