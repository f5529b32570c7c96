"""`testbed run`: train a real small model with N trainers and n shadows, inject a failure.

    testbed run --scenario NAME|FILE [--config FILE] [--mode switch|host] [--json OUT]

Scenarios live in testbed/scenarios/*.yaml (found by name) or any YAML file:
``{name, model: gpt|cnn, steps, seed, kill_at: ITER|random, kill_phase: PHASE}``. Without
``kill_at`` the job runs once (failure-free). With it, the job runs twice on fresh shadows:
once failure-free (the reference), once with every trainer SIGKILLed and then restored from
the shadows' consistent point. ``kill_phase: after-step`` (default): the launcher kills all
trainers when rank 0 reports iteration ``kill_at``; ``before-control``: rank 0 SIGKILLs
itself after its optimizer step of ``kill_at`` but before the control message (so the shadows
cannot commit that iteration while other ranks finished it), and the launcher kills the rest
when it sees rank 0 die. The final model and optimizer state of the two
runs must be equal (torch.equal on every tensor), and at most one iteration may be repeated.
Each run also checks that the shadows' final state equals the trainers'.

Modes: ``switch`` runs every host in its namespace behind the eBPF switch (root; the
testbed is brought up if it is not already); ``host`` runs plain processes on loopback
addresses 127.77.N.x and the trainers send the shadow copies themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkmate import auth
from checkmate import config as cfgmod
from checkmate.errors import CheckmateError, cli_guard
from checkmate.testbed import lifeline
from checkmate.testbed.scenario import (  # noqa: F401 - re-exported for the benches
    KILL_PHASES,
    SCENARIO_DIR,
    Scenario,
    load_scenario,
    scenario_names,
)

MODES = ("switch", "host")
#: Loopback /24 (first three octets) used in host mode unless --loopback-net says otherwise.
LOOPBACK_NET = "127.77.0"
#: Iterations a shadow accepts beyond its last commit (shadow serve --window).
SHADOW_WINDOW = 64


# ----------------------------------------------------------------------------- cluster
class Cluster:
    """Where each host runs and how to start a process there (namespaces or loopback)."""

    def __init__(self, cfg: cfgmod.ClusterConfig, mode: str, config_path: Path,
                 loopback_net: str, stack: ExitStack) -> None:
        self.cfg, self.mode, self.config_path = cfg, mode, config_path
        self.testbed = None
        if mode == "switch":
            if os.geteuid() != 0:
                raise CheckmateError("switch mode needs root (namespaces, BPF); "
                                     "use --mode host to run on loopback")
            from checkmate.dataplane.switch import KernelSwitch
            from checkmate.testbed.topology import Testbed

            tb = Testbed(cfg, controller=True, config_path=config_path)
            tb.tied = True  # what this command starts ends with it (testbed.lifeline)
            if not KernelSwitch(cfg).is_up():
                tb.tied_controller = True  # this command builds the testbed: it owns all
                stack.enter_context(tb)
            self.testbed = tb
            self.ip = {h.name: h.ip for h in cfg.hosts}
        else:
            self.registry = Path(tempfile.gettempdir()) / f"checkmate-run-{loopback_net}.json"
            self.clear_leftovers()
            stack.callback(self.clear_leftovers)
            self.secret_file = self._host_secret(loopback_net, stack)
            self.ip = {}
            for h in cfg.trainers:
                self.ip[h.name] = f"{loopback_net}.{10 + h.rank}"
            for h in cfg.shadows:
                self.ip[h.name] = f"{loopback_net}.{100 + h.partition}"

    @staticmethod
    def _host_secret(loopback_net: str, stack: ExitStack) -> Path:
        """Host mode's job secret: $CHECKMATE_SECRET_FILE, else a fresh one for this run."""
        env = os.environ.get(auth.SECRET_ENV)
        if env:
            return auth.create_secret(env)
        path = Path(tempfile.gettempdir()) / f"checkmate-run-{loopback_net}.key"
        path.unlink(missing_ok=True)
        stack.callback(path.unlink, missing_ok=True)
        return auth.create_secret(path)

    def popen(self, host: str, argv: list[str], env: dict[str, str], **kw: Any
              ) -> subprocess.Popen:
        """Start a process on ``host``, recorded so that a later run (or `testbed down` in
        switch mode) stops it if this launcher dies without cleaning up."""
        full_env = {**os.environ, **env}
        kw.pop("start_new_session", None)
        name = f"{host}:{argv[2] if len(argv) > 2 else argv[0]}"
        if self.testbed is not None:
            return self.testbed.spawn(host, argv, name, env=full_env, **kw)
        full_env[auth.SECRET_ENV] = str(self.secret_file)
        p = lifeline.popen(argv, env=full_env, start_new_session=True, **kw)
        self._record(p.pid)
        return p

    # Host mode has no testbed state dir: leftovers are listed in a file per loopback net.
    def _record(self, pid: int) -> None:
        from checkmate.testbed.topology import proc_start_time

        procs = self._recorded()
        procs.append({"pid": pid, "start": proc_start_time(pid)})
        self.registry.write_text(json.dumps(procs))

    def _recorded(self) -> list[dict]:
        try:
            data = json.loads(self.registry.read_text())
        except (OSError, ValueError):
            return []
        return [d for d in data if isinstance(d, dict) and isinstance(d.get("pid"), int)]

    def clear_leftovers(self) -> None:
        """Stop processes an earlier, killed launcher left on this loopback net."""
        from checkmate.testbed.topology import stop_pid

        for d in self._recorded():
            stop_pid(d["pid"], d.get("start"), timeout=2.0)
        self.registry.unlink(missing_ok=True)

    def run(self, host: str, argv: list[str]) -> subprocess.CompletedProcess:
        if self.testbed is not None:
            return self.testbed.run_in(host, argv, capture_output=True, text=True)
        return subprocess.run(argv, capture_output=True, text=True,
                              env={**os.environ, auth.SECRET_ENV: str(self.secret_file)})

    def ifname(self, host: str) -> str:
        return self.cfg.host_ifname(host) if self.mode == "switch" else "lo"


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip if ip.startswith("127.") else "127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- one run
@dataclass
class RunResult:
    label: str
    finals: list[Path] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # rank 0's wall clock after each step
    iter_times: list[tuple[int, float]] = field(default_factory=list)  # (iteration, time)
    killed_at: int | None = None
    max_done_before_kill: int | None = None
    restored_from: int | None = None
    restored_sources: list[str] | None = None  # per partition: memory or disk
    seconds: float = 0.0
    stats: list[dict] = field(default_factory=list)
    shadow_matches_trainer: bool | None = None
    shadow_restarts: int = 0
    restarts: list[dict] = field(default_factory=list)
    protected: bool | None = None
    shadow_status: list[dict] = field(default_factory=list)
    gockpt_iteration: int | None = None  # newest GoCkpt checkpoint (GoCkpt scenarios)


class Run:
    """One training job: its shadows, its trainers, their progress."""

    def __init__(self, cl: Cluster, sc: Scenario, workdir: Path, label: str,
                 progress: Any) -> None:
        self.cl, self.sc, self.label, self.progress = cl, sc, label, progress
        self.dir = workdir / label
        self.dir.mkdir(parents=True)
        self.events: queue.Queue = queue.Queue()
        self.shadows: list[subprocess.Popen] = []
        self.trainers: list[subprocess.Popen] = []
        self.result = RunResult(label)
        self.extra_job: dict[str, Any] = {}  # merged into the job file (benchmarks)
        self.actions: dict[int, list[Any]] = {}
        self.last_reported = 0  # newest iteration rank 0 reported
        self.action_errors: list[str] = []
        self.mounts: list[Path] = []
        self.by_partition: dict[int, int] = {}

    # -- processes -----------------------------------------------------------------------
    def _shadow_argv(self, h: Any, disk: bool) -> list[str]:
        cl, sc = self.cl, self.sc
        argv = [sys.executable, "-m", "checkmate.shadow.cli", "serve",
                "--partition", f"{h.partition}/{cl.cfg.num_partitions}",
                "--config", str(cl.config_path), "--host", h.name, "--bind", cl.ip[h.name],
                # Trainers may run ahead while a shadow JIT-compiles its first step.
                "--window", str(SHADOW_WINDOW)]
        if cl.mode == "host":
            argv.append("--no-register")
        if sc.persist_every:
            # A restart "without disk" gets a fresh directory: it comes back empty.
            d = self.dir / "ckpt" if disk else self.dir / f"ckpt-{len(self.shadows)}"
            argv += ["--dir", str(d), "--persist-every", str(sc.persist_every),
                     "--keep", str(sc.keep)]
        return argv

    def _spawn_shadow(self, h: Any, disk: bool = True) -> subprocess.Popen:
        log = open(self.dir / f"shadow-{h.name}.log", "ab")  # noqa: SIM115
        # One kernel thread per shadow: on a small testbed machine the shadows share the
        # trainers' cores (results do not depend on the thread count).
        env = {"NUMBA_NUM_THREADS": "1"}
        try:
            return self.cl.popen(h.name, self._shadow_argv(h, disk), env, stdout=log,
                                 stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def start_shadows(self) -> None:
        cfg = self.cl.cfg
        self.by_partition: dict[int, int] = {}
        for h in cfg.shadows:
            self.by_partition[h.partition] = len(self.shadows)
            self.shadows.append(self._spawn_shadow(h))
        deadline = time.monotonic() + 60
        for h in cfg.shadows:
            self._wait_shadow(h, deadline)

    def _wait_shadow(self, h: Any, deadline: float) -> None:
        p = self.shadows[self.by_partition[h.partition]]
        while True:
            if p.poll() is not None:
                raise CheckmateError(f"shadow {h.name} exited ({p.returncode}); see "
                                     f"{self.dir / f'shadow-{h.name}.log'}")
            if self._probe(h.name):
                return
            if time.monotonic() > deadline:
                raise CheckmateError(f"shadow {h.name} did not come up")
            time.sleep(0.2)

    def kill_restart_shadow(self, partition: int, disk: bool, restart: bool = True) -> None:
        """SIGKILL the shadow of ``partition`` and (unless ``restart`` is False) start it
        again while training runs."""
        h = self.cl.cfg.shadow_for(partition)
        if h is None:
            raise CheckmateError(f"no shadow serves partition {partition}")
        i = self.by_partition[partition]
        old = self.shadows[i]
        if old.poll() is None:
            os.kill(old.pid, signal.SIGKILL)
        old.wait()
        if not restart:
            return
        self.shadows[i] = self._spawn_shadow(h, disk)
        self.result.shadow_restarts += 1
        self.result.restarts.append({"partition": partition, "at": self.last_reported,
                                     "disk": disk})

    def limit_disk(self, partition: int, kib: int) -> None:
        """Put the checkpoint directory of ``partition``'s shadow on a tmpfs of ``kib`` KiB
        (root): a disk that fills up mid-run. Unmounted by ``stop``."""
        from checkmate.shadow.persist import part_dir

        if os.geteuid() != 0:
            raise CheckmateError("disk_limit mounts a tmpfs: run as root")
        d = part_dir(self.dir / "ckpt", partition)
        d.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k",
                            f"ckm-disk-{partition}", str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            raise CheckmateError(f"cannot mount a tmpfs on {d}: {r.stderr.strip()}")
        self.mounts.append(d)

    def at_iteration(self, it: int, action: Any) -> None:
        """Run ``action()`` (in a thread) when rank 0 reports iteration ``it``."""
        self.actions.setdefault(it, []).append(action)

    def _fire(self, it: int) -> None:
        for a in self.actions.pop(it, []):
            threading.Thread(target=self._guarded, args=(a,), daemon=True).start()

    def _guarded(self, action: Any) -> None:
        try:
            action()
        except Exception as e:  # noqa: BLE001 - reported with the run's problems
            self.action_errors.append(f"{self.label}: injected action failed: {e}")

    def _probe(self, host: str) -> bool:
        if self.cl.mode == "host":
            try:
                with socket.create_connection((self.cl.ip[host], cfgmod.RESTORE_PORT), 0.5):
                    return True
            except OSError:
                return False
        code = ("import socket,sys;socket.create_connection((sys.argv[1],int(sys.argv[2])),"
                "0.5)")
        r = self.cl.run(self.cl.cfg.trainers[0].name,
                        [sys.executable, "-c", code, self.cl.ip[host],
                         str(cfgmod.RESTORE_PORT)])
        return r.returncode == 0

    def job_file(self) -> Path:
        cfg, cl = self.cl.cfg, self.cl
        job = {
            "job_id": cfg.job_id, "mode": cl.mode, "model": self.sc.model,
            "steps": self.sc.steps, "seed": self.sc.seed, "out": str(self.dir),
            "trainers": [[cl.ip[h.name], cfgmod.TRAINER_PORT] for h in cfg.trainers],
            "shadows": [{"partition": h.partition, "ip": cl.ip[h.name],
                         "port": cfgmod.SHADOW_PORT} for h in cfg.shadows],
            "shadow_tcp": [[cl.ip[h.name], cfgmod.RESTORE_PORT] for h in cfg.shadows],
            "finish_timeout": self.sc.finish_timeout,
            "controller": ([cfg.switch.ip, cfgmod.CONTROLLER_PORT] if cl.mode == "switch"
                           else None),
        }
        job.update(self.extra_job)
        path = self.dir / "job.json"
        path.write_text(json.dumps(job, indent=1))
        return path

    def start_trainers(self, resume: bool, fail_at: int | None = None) -> None:
        """Start every rank; ``fail_at``: rank 0 kills itself before that iteration's
        control message (checkmate.train.worker's failure injector)."""
        cfg, cl = self.cl.cfg, self.cl
        job = self.job_file()
        master = cl.ip[cfg.trainers[0].name]
        port = _free_port(master)
        self.trainers = []
        for h in cfg.trainers:
            env = {"RANK": str(h.rank), "WORLD_SIZE": str(len(cfg.trainers)),
                   "MASTER_ADDR": master, "MASTER_PORT": str(port),
                   "GLOO_SOCKET_IFNAME": cl.ifname(h.name), "OMP_NUM_THREADS": "1",
                   "PYTHONUNBUFFERED": "1"}
            if fail_at is not None and h.rank == 0:
                from checkmate.train.worker import FAIL_AT_ENV

                env[FAIL_AT_ENV] = f"{fail_at}:before-control"
            argv = [sys.executable, "-m", "checkmate.train.worker", "--job", str(job)]
            if resume:
                argv.append("--resume")
            err = open(self.dir / f"trainer-{h.name}{'-resumed' if resume else ''}.log",
                       "ab")  # noqa: SIM115
            p = cl.popen(h.name, argv, env, stdout=subprocess.PIPE, stderr=err,
                         stdin=subprocess.DEVNULL, start_new_session=True)
            err.close()
            threading.Thread(target=self._read, args=(h.rank, p), daemon=True).start()
            self.trainers.append(p)

    def _read(self, rank: int, p: subprocess.Popen) -> None:
        for line in p.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict):
                ev["pid"] = p.pid
                self.events.put(ev)
        self.events.put({"event": "exit", "rank": rank, "pid": p.pid})

    def kill_trainers(self) -> None:
        for p in self.trainers:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
        for p in self.trainers:
            p.wait()

    def stop(self) -> None:
        for p in self.trainers + self.shadows:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
        for p in self.trainers + self.shadows:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        while self.mounts:
            subprocess.run(["umount", str(self.mounts.pop())], capture_output=True)

    # -- following -----------------------------------------------------------------------
    def _killed(self, at: int, max_done: int, pids: set[int]) -> str:
        self.kill_trainers()
        # Drain what the pipes still held: steps finished before the kill.
        time.sleep(0.3)
        while not self.events.empty():
            e = self.events.get_nowait()
            if e.get("event") == "iter" and e.get("pid") in pids:
                max_done = max(max_done, e["iteration"])
        self.result.killed_at = at
        self.result.max_done_before_kill = max_done
        return "killed"

    def follow(self, kill_at: int | None, timeout: float = 600,
               fail_at: int | None = None) -> str:
        """Consume events until all trainers are done ("done") or killed ("killed").

        ``kill_at``: kill every trainer when rank 0 reports that iteration; ``fail_at``:
        rank 0 dies by itself at that iteration, then the others are killed.
        """
        world = len(self.trainers)
        pids = {p.pid for p in self.trainers}
        done, exited = set(), set()
        deadline = time.monotonic() + timeout
        max_done = 0
        while len(exited) < world:
            try:
                ev = self.events.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise CheckmateError(f"{self.label}: trainers made no progress") from None
                continue
            if ev.get("pid") not in pids:
                continue  # a line from a killed incarnation
            kind = ev.get("event")
            if kind == "iter":
                max_done = max(max_done, ev["iteration"])
                if ev["rank"] == 0:
                    self.result.losses.append(ev["loss"])
                    self.result.times.append(ev["t"])
                    self.result.iter_times.append((ev["iteration"], ev["t"]))
                    self.progress(self.label, ev["iteration"], ev["loss"])
                    self.last_reported = ev["iteration"]
                    self._fire(ev["iteration"])
                    if kill_at is not None and ev["iteration"] >= kill_at:
                        return self._killed(ev["iteration"], max_done, pids)
            elif kind == "started":
                if ev.get("resumed") and ev["rank"] == 0:
                    self.result.restored_from = ev["iteration"]
                    self.result.restored_sources = ev.get("sources")
            elif kind == "done":
                done.add(ev["rank"])
                self.result.stats.append({"rank": ev["rank"], **ev.get("stats", {}),
                                          "control_bytes": ev.get("control_bytes"),
                                          "copy_bytes": ev.get("copy_bytes"),
                                          "parity_bytes": ev.get("parity_bytes"),
                                          "repair": ev.get("repair"),
                                          "reseeds": ev.get("reseeds", 0)})
                if ev["rank"] == 0:
                    self.result.protected = ev.get("protected")
            elif kind == "exit":
                exited.add(ev["rank"])
                if fail_at is not None and ev["rank"] == 0 and 0 not in done:
                    return self._killed(fail_at, max_done, pids)
        if len(done) < world:
            bad = sorted(set(range(world)) - done)
            raise CheckmateError(f"{self.label}: trainer(s) {bad} failed; see "
                                 f"{self.dir}/trainer-*.log")
        for p in self.trainers:
            p.wait()
        self.result.finals = [self.dir / f"final-rank{r}.pt" for r in range(world)]
        return "done"

    def shadow_statuses(self) -> list[dict]:
        """Every shadow's status op, asked from inside the cluster."""
        argv = [sys.executable, "-m", "checkmate.shadow.cli", "status", "--commit-times",
                "--config", str(self.cl.config_path)]
        for h in self.cl.cfg.shadows:
            argv += ["--addr", f"{self.cl.ip[h.name]}:{cfgmod.RESTORE_PORT}"]
        r = self.cl.run(self.cl.cfg.trainers[0].name, argv)
        if r.returncode != 0:
            raise CheckmateError(f"shadow status failed: {(r.stderr or r.stdout)[-300:]}")
        out = json.loads(r.stdout)
        return out if isinstance(out, list) else [out]

    def shadow_state(self) -> Path:
        """The shadows' state at the last iteration, fetched from inside the cluster."""
        out = self.dir / "shadows-final.pt"
        argv = [sys.executable, "-m", "checkmate.train.restore", "--iteration",
                str(self.sc.steps), "--out", str(out)]
        for h in self.cl.cfg.shadows:
            argv += ["--shadow", f"{self.cl.ip[h.name]}:{cfgmod.RESTORE_PORT}"]
        r = self.cl.run(self.cl.cfg.trainers[0].name, argv)
        if r.returncode != 0:
            raise CheckmateError(f"fetching the shadows' state failed: "
                                 f"{(r.stderr or r.stdout).strip()[-300:]}")
        return out


# ----------------------------------------------------------------------------- compare
def _equal(a: Any, b: Any, path: str, diffs: list[str]) -> None:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
            diffs.append(path)
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                diffs.append(f"{path}.{k} (missing on one side)")
            else:
                _equal(a[k], b[k], f"{path}.{k}", diffs)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            diffs.append(f"{path} (length)")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _equal(x, y, f"{path}[{i}]", diffs)
    elif a != b:
        diffs.append(path)


def compare_states(a: dict, b: dict, keys: tuple[str, ...] = ("model", "optimizer")
                   ) -> list[str]:
    """Paths where two saved states differ (tensors by torch.equal); empty if identical."""
    diffs: list[str] = []
    for k in keys:
        _equal(a[k], b[k], k, diffs)
    return diffs


def check_run(run: Run) -> list[str]:
    """Problems with one finished run: ranks that disagree, shadows that differ."""
    import torch

    problems = []
    finals = [torch.load(p, weights_only=False) for p in run.result.finals]
    for r, f in enumerate(finals[1:], start=1):
        d = compare_states(finals[0], f)
        if d:
            problems.append(f"{run.label}: rank {r} differs from rank 0 at {d[:3]}")
    if run.sc.gockpt is not None:
        return problems + _check_gockpt(run, finals[0])
    shadows = torch.load(run.shadow_state(), weights_only=False)
    d = compare_states(finals[0], shadows, ("model",))
    sd_t, sd_s = finals[0]["optimizer"], shadows["optimizer"]
    d += compare_states({"s": sd_t["state"]}, {"s": sd_s["state"]}, ("s",))
    lr_t = [g["lr"] for g in sd_t["param_groups"]]
    run.result.shadow_matches_trainer = not d
    if d:
        problems.append(f"{run.label}: shadows' state differs from the trainers' at {d[:3]} "
                        f"(lrs {lr_t})")
    return problems


def gockpt_dir(run: Run) -> Path:
    """Where a GoCkpt scenario's trainers write their checkpoints."""
    return run.dir / "gockpt"


def _check_gockpt(run: Run, final: dict) -> list[str]:
    """GoCkpt runs: the newest checkpoint every partition wrote must be the trainers' state
    of its iteration; when that is the last iteration, compare it with rank 0's final."""
    from checkmate.shadow import persist

    try:
        model_sd, optim_sd, it = persist.load_full(gockpt_dir(run))
    except CheckmateError as e:
        return [f"{run.label}: no GoCkpt checkpoint: {e}"]
    run.result.gockpt_iteration = it
    if it != run.sc.steps:
        return [f"{run.label}: the newest GoCkpt checkpoint is of iteration {it}, not of the "
                f"last ({run.sc.steps}): choose steps so that a window ends there"]
    d = compare_states(final, {"model": model_sd, "optimizer": optim_sd}, ("model",))
    d += compare_states({"s": final["optimizer"]["state"]}, {"s": optim_sd["state"]}, ("s",))
    run.result.shadow_matches_trainer = not d
    return [f"{run.label}: the GoCkpt checkpoint differs from the trainers at {d[:3]}"] if d \
        else []


# ----------------------------------------------------------------------------- chaos
def _inject(run: Run) -> None:
    """Set the scenario's switch faults and schedule its shadow kills / controller restart."""
    sc, cl = run.sc, run.cl
    if sc.faults:
        from checkmate.dataplane.switch import KernelSwitch

        sw = KernelSwitch(cl.cfg)
        for f in sc.faults:
            cl.cfg.host(f.port)  # ConfigError names an unknown host
            sw.set_fault(cl.cfg.switch_ifname(f.port), f.drop, f.corrupt,
                         from_iteration=f.start, until_iteration=f.until)
    for k in sc.shadow_kills:
        run.at_iteration(k.at, lambda k=k: run.kill_restart_shadow(k.partition, k.disk,
                                                                   k.restart))
    if sc.disk_limit is not None:
        run.limit_disk(*sc.disk_limit)
    if sc.controller_restart_at is not None:
        if cl.testbed is None:
            raise CheckmateError("controller_restart_at needs --mode switch")
        run.at_iteration(sc.controller_restart_at, cl.testbed.restart_controller)


def _clear_faults(run: Run) -> dict[str, int]:
    """Turn the scenario's knobs off; returns the frames each knob dropped."""
    dropped: dict[str, int] = {}
    if run.sc.faults and run.cl.mode == "switch":
        from checkmate.dataplane.switch import KernelSwitch

        sw = KernelSwitch(run.cl.cfg)
        ports = sw.counters().get("ports", {})
        for f in run.sc.faults:
            ifname = run.cl.cfg.switch_ifname(f.port)
            dropped[f.port] = int(ports.get(ifname, {}).get("dropped", 0))
            sw.set_fault(ifname, 0.0, 0.0)
    return dropped


def reliability_summary(r: RunResult) -> dict[str, Any]:
    """Commit lag (iterations the trainers were ahead when a shadow committed), repairs,
    re-seeds and drops, from the shadows' statuses and rank 0's step times."""
    import bisect

    first_done: dict[int, float] = {}
    for it, t in r.iter_times:  # a restore repeats iterations: the first time counts
        first_done.setdefault(it, t)
    its = sorted(first_done)
    times = [first_done[i] for i in its]
    lags = []
    for st in r.shadow_status:
        for i, c in st.get("commit_times") or []:
            k = bisect.bisect_right(times, c)
            if i >= 1 and k:
                lags.append(max(0, its[k - 1] - i))
    lags.sort()
    rejoins = []
    for rs in r.restarts:  # the restarted shadow's first commit: where it rejoined
        st = next((s for s in r.shadow_status if s.get("partition") == rs["partition"]), {})
        first = min((i for i, _ in st.get("commit_times") or [] if i > rs["at"]),
                    default=None)
        rejoins.append({**rs, "rejoined_at": first,
                        "iterations": None if first is None else first - rs["at"]})
    repair = [s.get("repair") or {} for s in r.shadow_status]
    # What the shadows received as repair answers (payload bytes): complete even when a
    # trainer incarnation was killed before reporting what it sent.
    received = sum(x.get("answer_bytes", 0) for x in repair)
    # Every iteration must be committed by every shadow that was never restarted nor
    # re-seeded (a re-seed replaces the state, skipping the iterations in between; the
    # re-seeds are counted below and the final state is compared with the trainers').
    restarted = {rs["partition"] for rs in r.restarts}
    missing = {}
    for st in r.shadow_status:
        if st.get("partition") in restarted or (st.get("reseed") or {}).get("count"):
            continue
        done = {i for i, _ in st.get("commit_times") or []}
        gone = sorted(set(first_done) - done)
        if gone:
            missing[st.get("partition")] = gone[:20]
    total = max(((s.get("range") or [0, 0])[1] for s in r.shadow_status), default=0)
    replica = 4 * total * len(first_done)
    repair_bytes = received
    return {
        "rejoins": rejoins,
        "commits_missing": missing,
        "commit_lag_max": lags[-1] if lags else None,
        "commit_lag_median": lags[len(lags) // 2] if lags else None,
        "repair_requests": sum(x.get("requests", 0) for x in repair),
        "repair_answers": sum(x.get("answers", 0) for x in repair),
        "repair_gone": sum(x.get("gone", 0) for x in repair),
        "repair_bytes": repair_bytes,
        "replica_bytes": replica,
        "repair_overhead": round(repair_bytes / replica, 5) if replica else None,
        "reseeds": sum((s.get("reseed") or {}).get("count", 0) for s in r.shadow_status),
        "persist": [{k: (s.get("persist") or {}).get(k) for k in
                     ("written", "errors", "last_error", "alive", "last_iteration")}
                    for s in r.shadow_status if s.get("persist")],
        "shadow_drops": [s.get("drops", {}) for s in r.shadow_status],
        "shadow_receivers": [s.get("receiver", {}) for s in r.shadow_status],
    }


# ----------------------------------------------------------------------------- main
def execute(sc: Scenario, cl: Cluster, workdir: Path, progress: Any) -> dict[str, Any]:
    """Run the scenario; returns the report (``ok`` False with ``problems`` on failure)."""
    import torch

    report: dict[str, Any] = {"scenario": sc.name, "mode": cl.mode, "model": sc.model,
                              "steps": sc.steps, "trainers": len(cl.cfg.trainers),
                              "shadows": cl.cfg.num_partitions, "kill_at": sc.kill_at,
                              "kill_phase": sc.kill_phase, "gockpt": sc.gockpt,
                              "runs": {}}
    problems: list[str] = []
    if sc.faults and cl.mode != "switch":
        raise CheckmateError("scenario faults act on the switch's ports: use --mode switch")
    second = "chaos" if sc.chaos else "kill-restore"
    runs = [("failure-free", None)] + ([(second, sc.kill_at)] if sc.kill_at or sc.chaos
                                       else [])
    finished: dict[str, Run] = {}
    for label, kill in runs:
        run = Run(cl, sc, workdir, label, progress)
        if sc.gockpt is not None:  # no shadows: each trainer's GoCkpt process checkpoints
            run.extra_job = {"ckpt": "gockpt", "ckpt_dir": str(gockpt_dir(run)),
                             "ckpt_every": sc.gockpt[0], "ckpt_steps": sc.gockpt[1]}
        t0 = time.perf_counter()
        try:
            if sc.gockpt is None:
                run.start_shadows()
            if label == "chaos":
                _inject(run)
            self_kill = kill is not None and sc.kill_phase == "before-control"
            run.start_trainers(resume=False, fail_at=kill if self_kill else None)
            outcome = (run.follow(None, fail_at=kill) if self_kill else run.follow(kill))
            if outcome == "killed":
                run.start_trainers(resume=True)
                run.follow(None)
            problems += check_run(run)
            run.result.shadow_status = run.shadow_statuses() if sc.gockpt is None else []
        finally:
            if label == "chaos":
                report["faults_dropped"] = _clear_faults(run)
            run.stop()
        problems += run.action_errors
        run.result.seconds = round(time.perf_counter() - t0, 2)
        finished[label] = run
        r = run.result
        summary = reliability_summary(r)
        if r.protected is False:
            problems.append(f"{label}: the last iteration was not protected by every shadow")
        if summary["commits_missing"]:
            problems.append(f"{label}: shadows skipped iterations {summary['commits_missing']}")
        report["runs"][label] = {
            "seconds": r.seconds, "first_loss": r.losses[0] if r.losses else None,
            "last_loss": r.losses[-1] if r.losses else None, "killed_at": r.killed_at,
            "max_done_before_kill": r.max_done_before_kill, "restored_from": r.restored_from,
            "restored_sources": r.restored_sources,
            "shadows_match_trainers": r.shadow_matches_trainer, "ring": r.stats,
            "protected": r.protected, "shadow_restarts": r.shadow_restarts,
            "gockpt_checkpoint": r.gockpt_iteration, **summary,
        }
    if cl.mode == "switch":
        from checkmate.dataplane.switch import KernelSwitch

        entries = KernelSwitch(cl.cfg).counters().get("entries", [])
        report["switch_replicated_packets"] = sum(int(e.get("packets", 0)) for e in entries)
    ff = finished["failure-free"].result
    if ff.losses and not ff.losses[-1] < ff.losses[0]:
        problems.append(f"loss did not fall ({ff.losses[0]} -> {ff.losses[-1]})")
    if second in finished:
        kr = finished[second].result
        a = torch.load(ff.finals[0], weights_only=False)
        b = torch.load(kr.finals[0], weights_only=False)
        diffs = compare_states(a, b, ("model", "optimizer", "scheduler"))
        report["bit_identical"] = not diffs
        if diffs:
            problems.append(f"kill-restore final state differs from failure-free at "
                            f"{diffs[:5]}")
        if kr.restored_from is None and kr.killed_at is not None:
            problems.append("the restarted trainers did not report a restore point")
        elif kr.restored_from is not None:
            repeated = (kr.max_done_before_kill or 0) - kr.restored_from
            report["repeated_iterations"] = repeated
            # With faults, the newest iterations may still be under repair when every trainer
            # (every holder of the missing pieces) dies: the commit-lag bound is 2 more.
            # GoCkpt checkpoints every `every` iterations, each complete `steps` later.
            allowed = (3 if sc.chaos else 1) if sc.gockpt is None else sum(sc.gockpt)
            if "disk" in (kr.restored_sources or []):
                # A shadow died shortly before the trainers (a correlated failure): no
                # iteration was in every shadow's memory any more, so the resume came from
                # the newest checkpoint every partition held, one persist interval (or one
                # more while a write was in flight) before that shadow's kill.
                first = min((rs["at"] for rs in kr.restarts), default=kr.killed_at or 0)
                allowed = (kr.max_done_before_kill or 0) - first + 2 * sc.persist_every + 3
            if repeated > allowed and kr.killed_at is not None:
                problems.append(f"{repeated} iterations repeated (at most {allowed} allowed)")
    report["ok"] = not problems
    report["problems"] = problems
    return report


def _table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    gk = report.get("gockpt")
    who = (f"GoCkpt every {gk[0]} over {gk[1]} steps" if gk
           else f"{report['shadows']} shadows")
    t = Table(title=f"testbed run {report['scenario']} ({report['mode']} mode, "
                    f"{report['model']}, {report['trainers']} trainers x {who}, "
                    f"{report['steps']} iterations)")
    t.add_column("run", no_wrap=True)
    for col in ("seconds", "loss first -> last", "killed at", "restored from",
                "checkpoint = trainers" if gk else "shadows = trainers"):
        t.add_column(col, justify="right")
    for label, r in report["runs"].items():
        loss = ("-" if r["first_loss"] is None
                else f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}")
        t.add_row(label, f"{r['seconds']:.1f}", loss,
                  str(r["killed_at"] or "-"), str(r["restored_from"] or "-"),
                  {True: "yes", False: "NO", None: "-"}[r["shadows_match_trainers"]])
    c = Console(width=max(Console().width, 100))
    c.print(t)
    if "bit_identical" in report:
        c.print(f"final model+optimizer bit-identical to failure-free: "
                f"{'yes' if report['bit_identical'] else 'NO'}; repeated iterations: "
                f"{report.get('repeated_iterations')}")
    for p in report["problems"]:
        c.print(f"[red]problem:[/red] {p}")
    c.print("[green]OK[/green]" if report["ok"] else "[red]FAILED[/red]")


@cli_guard("testbed run")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="testbed run", description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", required=True, help="scenario name or YAML file")
    ap.add_argument("--config", help="cluster config (default: the embedded default)")
    ap.add_argument("--mode", choices=MODES, default="switch")
    ap.add_argument("--json", metavar="OUT", help="write the JSON report to OUT")
    ap.add_argument("--workdir", help="keep logs and states here (default: a temp dir)")
    ap.add_argument("--loopback-net", default=LOOPBACK_NET,
                    help="host mode: first three octets of the loopback addresses")
    ap.add_argument("--seed", type=int, help="seed for a random kill_at")
    args = ap.parse_args(argv)
    sc = load_scenario(args.scenario, random.Random(args.seed))
    config_path = Path(args.config).resolve() if args.config else cfgmod.default_path()
    cfg = cfgmod.load(config_path)
    if len(cfg.trainers) < 2 or not cfg.shadows:
        raise CheckmateError("the config needs at least 2 trainers and 1 shadow")
    parts = args.loopback_net.split(".")
    if len(parts) != 3 or parts[0] != "127" or not all(p.isdigit() and int(p) < 256
                                                       for p in parts):
        raise CheckmateError(f"--loopback-net must look like 127.X.Y, got {args.loopback_net}")
    from rich.console import Console

    console = Console(stderr=True)

    def progress(label: str, it: int, loss: float) -> None:
        console.print(f"[{label}] iteration {it}/{sc.steps} loss {loss:.4f}", highlight=False)

    with ExitStack() as stack:
        if args.workdir:
            workdir = Path(args.workdir)
            workdir.mkdir(parents=True, exist_ok=True)
            workdir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckm-run-")))
        cl = Cluster(cfg, args.mode, config_path, args.loopback_net, stack)
        report = execute(sc, cl, workdir, progress)
    _table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
