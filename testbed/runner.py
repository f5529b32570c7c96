"""One training run on a cluster: shadows and trainers started, followed to the end or to an
injected failure, restarted, and their final states collected."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkmate.config import cluster as cfgmod
from checkmate.errors import CheckmateError
from checkmate.testbed.cluster import Cluster, _free_port
from checkmate.testbed.scenario import (
    Scenario,
)

#: Iterations a shadow accepts beyond its last commit (shadow serve --window).
SHADOW_WINDOW = 64


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
    #: replica agreement stopped the job: {"at", "rewind", "line"} (rank 0's words)
    diverged: dict | None = None


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
        self.hogs: list[subprocess.Popen] = []  # busy processes of a cpu_load scenario
        self.by_partition: dict[int, int] = {}  # a partition's first shadow in ``shadows``
        self.by_host: dict[str, int] = {}  # every shadow (replicas too) in ``shadows``
        self.attacks: list[Any] = []  # checkmate.testbed.attacks.Attack, stopped by run.py

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
            # A partition's further replicas keep their own files (ckpt-replicaK).
            k = cl.cfg.replica_index(h)
            d = (self.dir / ("ckpt" if k == 0 else f"ckpt-replica{k}") if disk
                 else self.dir / f"ckpt-{len(self.shadows)}")
            argv += ["--dir", str(d), "--persist-every", str(sc.persist_every),
                     "--keep", str(sc.keep)]
        return argv

    def _spawn_shadow(self, h: Any, disk: bool = True) -> subprocess.Popen:
        log = open(self.dir / f"shadow-{h.name}.log", "ab")  # noqa: SIM115
        # One kernel thread per shadow: on a small testbed machine the shadows share the
        # trainers' cores (results do not depend on the thread count).
        env = {"NUMBA_NUM_THREADS": "1"}
        flip = self.sc.shadow_flip
        if self.label == "chaos" and flip is not None and flip[0] == h.partition:
            from checkmate.shadow.state_check import FLIP_AT

            env[FLIP_AT] = f"{flip[0]}:{flip[1]}"
        try:
            return self.cl.popen(h.name, self._shadow_argv(h, disk), env, stdout=log,
                                 stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def start_shadows(self) -> None:
        """Every shadow of the config, a partition's replicas too (the switch copies to
        each: control/plan.py)."""
        cfg = self.cl.cfg
        if cfg.colocated:
            raise CheckmateError("the config's shadows are co-located: each node's `checkmate "
                                 "launch --colocate` starts them, not the testbed")
        self.by_partition, self.by_host = {}, {}
        for h in cfg.shadow_hosts:
            self.by_partition.setdefault(h.partition, len(self.shadows))
            self.by_host[h.name] = len(self.shadows)
            self.shadows.append(self._spawn_shadow(h))
        deadline = time.monotonic() + 60
        for h in cfg.shadow_hosts:
            self._wait_shadow(h, deadline)

    def _wait_shadow(self, h: Any, deadline: float) -> None:
        p = self.shadows[self.by_host[h.name]]
        while True:
            if p.poll() is not None:
                raise CheckmateError(f"shadow {h.name} exited ({p.returncode}); see "
                                     f"{self.dir / f'shadow-{h.name}.log'}")
            if self._probe(h.name):
                return
            if time.monotonic() > deadline:
                raise CheckmateError(f"shadow {h.name} did not come up")
            time.sleep(0.2)

    def kill_restart_shadow(self, partition: int, disk: bool, restart: bool = True,
                            replica: int = 0) -> None:
        """SIGKILL the ``replica``-th shadow of ``partition`` and (unless ``restart`` is
        False) start it again while training runs."""
        mine = self.cl.cfg.shadows_for(partition)
        if replica >= len(mine):
            raise CheckmateError(f"partition {partition} has no shadow of replica {replica}")
        h = mine[replica]
        i = self.by_host[h.name]
        old = self.shadows[i]
        if old.poll() is None:
            os.kill(old.pid, signal.SIGKILL)
        old.wait()
        if not restart:
            return
        self.shadows[i] = self._spawn_shadow(h, disk)
        self.result.shadow_restarts += 1
        self.result.restarts.append({"partition": partition, "at": self.last_reported,
                                     "disk": disk, "time": time.time()})

    def load_cpu(self, n: int) -> None:
        """Start ``n`` busy processes (ended by ``stop``, and with this command): the
        machine loaded while shadows restart and register."""
        from checkmate.testbed import lifeline

        for _ in range(n):
            self.hogs.append(lifeline.popen([sys.executable, "-c", "while True: pass"],
                                            stdin=subprocess.DEVNULL, start_new_session=True))

    def limit_disk(self, partition: int, kib: int) -> None:
        """Put the checkpoint directory of ``partition``'s shadow on a tmpfs of ``kib`` KiB
        (root): a disk that fills up mid-run. Unmounted by ``stop``."""
        from checkmate.shadow.disk import part_dir

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
            # a partition's further shadows, set k holding every partition's k-th
            "replica_shadows": [[{"partition": h.partition, "ip": cl.ip[h.name],
                                  "port": cfgmod.SHADOW_PORT} for h in rs]
                                for rs in self.replica_sets()[1:]],
            "replica_tcp": [[[cl.ip[h.name], cfgmod.RESTORE_PORT] for h in rs]
                            for rs in self.replica_sets()[1:]],
            "finish_timeout": self.sc.finish_timeout,
            "verify_every": self.sc.verify_every,
            "controller": ([cfg.switch.ip, cfgmod.CONTROLLER_PORT] if cl.mode == "switch"
                           else None),
        }
        job.update(self.extra_job)
        path = self.dir / "job.json"
        path.write_text(json.dumps(job, indent=1))
        return path

    def start_trainers(self, resume: bool, fail_at: int | None = None,
                       resume_at: int | None = None) -> None:
        """Start every rank; ``fail_at``: rank 0 kills itself before that iteration's
        control message (checkmate.train.worker's failure injector); ``resume_at``: a
        rewind to that iteration (0: start anew), after a divergence."""
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
            flip = self.sc.trainer_flip
            if (self.label == "chaos" and flip is not None and flip[0] == h.rank
                    and not resume and resume_at is None):
                from checkmate.train.env import FLIP_AT

                env[FLIP_AT] = f"{flip[0]}:{flip[1]}"
            argv = [sys.executable, "-m", "checkmate.train.worker", "--job", str(job)]
            if resume:
                argv.append("--resume")
            if resume_at is not None:
                argv += ["--resume-at", str(resume_at)]
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
        while self.hogs:
            h = self.hogs.pop()
            h.kill()
            h.wait()
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
    def _killed(self, at: int, max_done: int, pids: set[int], outcome: str = "killed"
                ) -> str:
        self.kill_trainers()
        # Drain what the pipes still held: steps finished before the kill.
        time.sleep(0.3)
        while not self.events.empty():
            e = self.events.get_nowait()
            if e.get("event") == "iter" and e.get("pid") in pids:
                max_done = max(max_done, e["iteration"])
        if outcome == "killed":
            self.result.killed_at = at
        self.result.max_done_before_kill = max_done
        return outcome

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
                                          "repair": ev.get("repair"),
                                          "reseeds": ev.get("reseeds", 0)})
                if ev["rank"] == 0:
                    self.result.protected = ev.get("protected")
            elif kind == "diverged" and ev["rank"] == 0:  # every rank stops with it
                self.result.diverged = {k: ev.get(k) for k in ("iteration", "rewind", "line")}
                return self._killed(ev["iteration"], max_done, pids, "diverged")
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

    def replica_sets(self) -> list[list[Any]]:
        """The config's shadows as replica sets: set k holds every partition's k-th."""
        cfg = self.cl.cfg
        return [[cfg.shadows_for(p)[k] for p in range(cfg.num_partitions)]
                for k in range(cfg.replicas)]

    def _alive(self, h: Any) -> bool:
        i = self.by_host.get(h.name)
        return i is not None and self.shadows[i].poll() is None

    def live_sets(self) -> list[list[Any]]:
        """Replica sets of the shadows still running: set k holds each partition's k-th
        live shadow (its last live one where it has fewer), so every live shadow is in one.
        A partition whose shadows all died keeps them (asking them then fails loudly)."""
        cfg = self.cl.cfg
        live = [[h for h in cfg.shadows_for(p) if self._alive(h)] or cfg.shadows_for(p)
                for p in range(cfg.num_partitions)]
        return [[hs[min(k, len(hs) - 1)] for hs in live]
                for k in range(max(len(hs) for hs in live))]

    def shadow_statuses(self) -> list[dict]:
        """Every shadow's status op, asked from inside the cluster (replicas too; a
        replica killed for good is left out while a sibling of it runs)."""
        argv = [sys.executable, "-m", "checkmate.shadow.cli", "status", "--commit-times",
                "--config", str(self.cl.config_path)]
        for h in {h.name: h for hs in self.live_sets() for h in hs}.values():
            argv += ["--addr", f"{self.cl.ip[h.name]}:{cfgmod.RESTORE_PORT}"]
        r = self.cl.run(self.cl.cfg.trainers[0].name, argv)
        if r.returncode != 0:
            raise CheckmateError(f"shadow status failed: {(r.stderr or r.stdout)[-300:]}")
        out = json.loads(r.stdout)
        return out if isinstance(out, list) else [out]

    def shadow_state(self, replica: int = 0) -> Path:
        """The state replica set ``replica`` holds at the last iteration, fetched from
        inside the cluster."""
        out = self.dir / ("shadows-final.pt" if replica == 0
                          else f"shadows-final-replica{replica}.pt")
        argv = [sys.executable, "-m", "checkmate.train.restore", "--iteration",
                str(self.sc.steps), "--out", str(out)]
        for h in self.live_sets()[replica]:
            argv += ["--shadow", f"{self.cl.ip[h.name]}:{cfgmod.RESTORE_PORT}"]
        r = self.cl.run(self.cl.cfg.trainers[0].name, argv)
        if r.returncode != 0:
            raise CheckmateError(f"fetching the shadows' state failed: "
                                 f"{(r.stderr or r.stdout).strip()[-300:]}")
        return out
