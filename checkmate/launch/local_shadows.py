"""The shadows of one ``checkmate launch``: started here on loopback, or found elsewhere.

Host mode on one machine gives every trainer rank and every shadow its own loopback address
in one 127.X.Y.0/24 (trainers .10+rank, shadows .100+partition): the ports are the fixed
ckm ports (trainer ring 47000, shadow UDP 47001, trainer repair 47002, shadow TCP 47100)
and a job's layout has one repair port for all ranks, so two ranks cannot share an IP.
Linux answers every 127.0.0.0/8 address on ``lo`` without configuration. The /24 is picked
at random among those whose ports are all free, so concurrent jobs do not collide.

Shadows started here run ``shadow serve`` without a config (the job id comes from the
seed). The workers start only when every shadow is ready (:meth:`LocalShadows.start`):
answering on its TCP port with its Numba kernels compiled. A fresh install has an empty
Numba cache and each shadow compiles for a minute or two; trainers started meanwhile would
time out seeding and fail with nothing to restore, so the launcher waits, says so on one
line, and fails in one line only past START_TIMEOUT. The shadow compiles in the background
behind a service that already answers (not before it listens): so the wait can tell a
compiling shadow from a dead or unreachable one, show how long it has compiled, and fail
at once when the compile fails; trainers started without the launcher wait the same way
(checkmate.train.shadow_client.wait_ready). Shadows are stopped by PID: at exit,
on Ctrl-C or an error, and -- through the kernel's parent-death signal -- even when the
launcher itself is SIGKILLed.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from checkmate.config import cluster as config
from checkmate.errors import CheckmateError
from checkmate.protocol.frames import Addr, ShadowError
from checkmate.train.shadow_client import READY_TIMEOUT, ShadowClient, wait_ready

#: Host numbers inside the /24: trainers from .10, shadows from .100.
TRAINER_BASE, SHADOW_BASE = 10, 100
MAX_TRAINERS, MAX_SHADOWS = SHADOW_BASE - TRAINER_BASE, 254 - SHADOW_BASE
#: Iterations a shadow accepts ahead of its last commit (trainers may run ahead while a
#: fresh shadow compiles its first optimizer step).
SHADOW_WINDOW = 64
#: Seconds shadows get to come up: bind, answer, and compile their kernels from a cold Numba
#: cache (about two minutes on a loaded 2-core machine; checkmate.train.shadow_client).
START_TIMEOUT = READY_TIMEOUT
#: Seconds of waiting after which the launcher says the shadows compile their kernels.
SAY_AFTER = 3.0  # loading them from the cache takes under a second
#: Times one shadow is started again after it exited while the job ran (a shadow that
#: keeps dying is left down, said once: the job says it is unprotected).
RESTARTS = 5
#: Seconds between two looks at whether the shadows still run.
SUPERVISE_EVERY = 0.25


def _bindable(ip: str, port: int, kind: int) -> bool:
    with socket.socket(socket.AF_INET, kind) as s:
        if kind == socket.SOCK_STREAM:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def pick_loopback_net(world: int, shadows: int, tries: int = 50) -> str:
    """A random ``127.X.Y`` whose trainer and shadow addresses have all their ports free."""
    rng = random.Random()
    for _ in range(tries):
        net = f"127.{rng.randrange(90, 200)}.{rng.randrange(1, 255)}"
        ok = all(_bindable(f"{net}.{TRAINER_BASE + r}", p, socket.SOCK_DGRAM)
                 for r in range(world) for p in (config.TRAINER_PORT, config.REPAIR_PORT))
        ok = ok and all(
            _bindable(f"{net}.{SHADOW_BASE + p}", config.SHADOW_PORT, socket.SOCK_DGRAM)
            and _bindable(f"{net}.{SHADOW_BASE + p}", config.RESTORE_PORT, socket.SOCK_STREAM)
            for p in range(shadows))
        if ok:
            return net
    raise CheckmateError("found no loopback /24 with free ckm ports (47000-47002, 47100)")


def trainer_addrs(net: str, world: int) -> list[Addr]:
    """Each rank's ring address on ``net``."""
    return [(f"{net}.{TRAINER_BASE + r}", config.TRAINER_PORT) for r in range(world)]


#: Ports between two workers that share a node's IP (ring port, its repair port at +2).
WORKER_PORT_STRIDE = 4


def node_worker_addrs(ip: str, local_world: int) -> list[Addr]:
    """Ring addresses of a node's workers on its one IP: local rank L on the trainer port
    + 4L (its repair port 2 above, checkmate.train.layout.JobLayout.repair_addr)."""
    return [(ip, config.TRAINER_PORT + WORKER_PORT_STRIDE * lr) for lr in range(local_world)]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _start_child(cores: frozenset[int] | None) -> Callable[[], None]:
    """What a shadow's child runs before exec: die with the launcher, and keep to ``cores``
    (None: the launcher's own) so that it takes only the cores left spare for it."""
    def run() -> None:
        _die_with_parent()
        if cores is not None:
            os.sched_setaffinity(0, cores)

    return run


class LocalShadows:
    """``count`` shadow processes on ``net`` (.100, .101, ...), logs under ``logdir``; a
    mesh job's ``groups`` data-parallel groups take ``count // groups`` each, in order
    (each set is partitions 0.. of its group, persisting under a folder of its own)."""

    def __init__(self, net: str, count: int, logdir: Path, persist_dir: Path | None = None,
                 persist_every: int = 0, groups: int = 1, replicas: int = 1,
                 cores: frozenset[int] | None = None,
                 addrs: Sequence[tuple[str, int, int]] | None = None,
                 mine: Sequence[int] | None = None,
                 placed_by: tuple[tuple[str, int], int] | None = None) -> None:
        self.net, self.count, self.logdir, self.groups = net, count, logdir, groups
        #: co-located in switch mode: (the controller's address, the job id); each shadow
        #: is ``serve --placed`` (each attempt tells the controller where it runs), not
        #: ``--no-register`` (the trainers send its copies)
        self.placed_by = placed_by
        #: the CPU cores every shadow is pinned to (``--shadow-cores``; None: not pinned)
        self.cores = cores
        #: ``count`` is ``replicas`` whole sets, one after the other (replica k of every
        #: partition: the k-th; it persists under ``replica<k>`` beside the first's files)
        self.replicas = replicas
        self.persist_dir, self.persist_every = persist_dir, persist_every
        #: every shadow's (IP, UDP port, TCP port): on ``net`` by default, one IP each; the
        #: job's nodes' addresses when the shadows are spread over them (``--colocate``)
        self.addrs = list(addrs) if addrs is not None else [
            (f"{net}.{SHADOW_BASE + i}", config.SHADOW_PORT, config.RESTORE_PORT)
            for i in range(count)]
        #: the shadows this launcher runs (all of them unless they are spread over nodes)
        self.mine = list(range(count)) if mine is None else list(mine)
        self.procs: dict[int, subprocess.Popen] = {}
        self.argvs: dict[int, list[str]] = {}
        self.restarts: dict[int, int] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # procs: the watcher and a re-placement both change it
        self._watcher: threading.Thread | None = None
        self.max_restarts = RESTARTS

    @property
    def tcp(self) -> list[Addr]:
        """Every shadow's TCP service, this launcher's and the other nodes'."""
        return [(ip, tcp) for ip, _, tcp in self.addrs]

    @property
    def udp(self) -> list[Addr]:
        """Every shadow's UDP address (where the trainers send its copies)."""
        return [(ip, udp) for ip, udp, _ in self.addrs]

    def log(self, partition: int) -> Path:
        return self.logdir / f"shadow-{partition}.log"

    def start(self, out: TextIO | None = None, which: Sequence[int] | None = None
              ) -> LocalShadows:
        """Start every shadow of ``which`` (default: all this launcher runs) and wait until
        each is ready: it answers on its TCP port and its kernels are compiled (a cold Numba
        cache: one progress line on ``out``)."""
        self.logdir.mkdir(parents=True, exist_ok=True)
        which = self.mine if which is None else list(which)
        for p in which:
            self.argvs[p] = self._argv(p)
            self.restarts[p] = 0
            with self._lock:
                self.procs[p] = self._spawn(p)
        progress = Progress(out if out is not None else sys.stdout)
        try:
            waited = wait_ready([self.tcp[p] for p in which], START_TIMEOUT,
                                on_wait=progress, check=self._check_alive, poll=0.2)
        except ShadowError as e:
            progress.end(None, 0.0)
            raise CheckmateError(f"the shadows were not ready in {START_TIMEOUT:.0f}s: {e} "
                                 f"(logs: {self.logdir})") from None
        except BaseException:
            progress.end(None, 0.0)
            raise
        progress.end(True, waited)
        return self

    def _argv(self, p: int) -> list[str]:
        """``shadow serve`` for shadow ``p`` at its address."""
        per = self.count // self.replicas // self.groups
        ip, udp, tcp = self.addrs[p]
        k, g, q = self.place(p)
        argv = [sys.executable, "-m", "checkmate.shadow.cli", "serve", "--partition",
                f"{q}/{per}", "--bind", ip, "--port", str(udp), "--restore-port",
                str(tcp), "--window", str(SHADOW_WINDOW)]
        if self.placed_by is None:
            argv.append("--no-register")
        else:
            (cip, cport), job = self.placed_by
            argv += ["--placed", "--controller", f"{cip}:{cport}", "--job", str(job)]
        if self.persist_dir is not None:
            pdir = self.persist_dir if self.groups == 1 else self.persist_dir / f"group{g}"
            argv += ["--dir", str(pdir / f"replica{k}" if k else pdir)]
            if self.persist_every:
                argv += ["--persist-every", str(self.persist_every)]
        return argv

    def move(self, addrs: Sequence[tuple[str, int, int]], mine: Sequence[int],
             out: TextIO | None = None) -> tuple[list[int], list[int]]:
        """The shadows were placed anew (checkmate.launch.colocation): every shadow's
        address is now ``addrs`` and this launcher runs ``mine``. Stops (by PID) the ones
        it ran that are placed elsewhere now, starts the ones newly placed here (empty: the
        trainers have them adopt a sibling's state) and waits until they are ready;
        returns (started, stopped). A shadow that stays keeps running as it is."""
        mine = list(mine)
        gone = [i for i in self.mine if i not in mine or self.addrs[i] != tuple(addrs[i])]
        with self._lock:
            procs = [self.procs.pop(i) for i in gone if i in self.procs]
        stop_processes(procs)
        new = [i for i in mine if i not in self.mine or i in gone]
        self.addrs = [tuple(a) for a in addrs]  # type: ignore[misc]
        self.mine = mine
        if new:
            self.start(out, new)
        return new, gone

    def _spawn(self, i: int) -> subprocess.Popen:
        with open(self.log(i), "ab") as log:
            try:
                return subprocess.Popen(self.argvs[i], stdout=log, stderr=log,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=_start_child(self.cores))
            except (OSError, subprocess.SubprocessError) as e:
                raise CheckmateError(f"cannot start {self.name(i)} on cores "
                                     f"{sorted(self.cores or [])}: {e}") from None

    def place(self, i: int) -> tuple[int, int, int]:
        """Shadow ``i``'s (replica, data-parallel group, partition in the group)."""
        whole = self.count // self.replicas  # one replica of every partition
        k, q = divmod(i, whole)
        g, p = divmod(q, whole // self.groups)
        return k, g, p

    def name(self, i: int) -> str:
        """Shadow ``i`` as a line names it: its address, partition (group, replica)."""
        k, g, p = self.place(i)
        group = f" of group {g}" if self.groups > 1 else ""
        rep = f" replica {k}" if self.replicas > 1 else ""
        ip, tcp = self.tcp[i]
        where = ip if tcp == config.RESTORE_PORT else f"{ip}:{tcp}"
        return f"shadow {where} (partition {p}{group}{rep})"

    def supervise(self, restarts: int = RESTARTS, out: TextIO | None = None) -> None:
        """While the job runs, start again every shadow that exits (up to ``restarts`` times
        each), one line each time: it comes back empty (or from its checkpoints with
        ``--persist-every``), and the trainers bring it current again: from a sibling
        replica where one is current (shadow.sibling), else by a live re-seed."""
        self.max_restarts = restarts
        self._watcher = threading.Thread(target=self._watch, args=(out or sys.stdout,),
                                         name="ckm-shadows", daemon=True)
        self._watcher.start()

    def _watch(self, out: TextIO) -> None:
        while not self._stopping.wait(SUPERVISE_EVERY):
            with self._lock:
                self._look(out)

    def _look(self, out: TextIO) -> None:
        for i, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None or self._stopping.is_set():
                continue
            why = (f"signal {signal.Signals(-code).name}" if code < 0
                   and -code in signal.valid_signals() else f"exit code {code}")
            if self.restarts[i] >= self.max_restarts:
                if self.restarts[i] == self.max_restarts:
                    self.restarts[i] += 1
                    out.write(f"checkmate launch: {self.name(i)} exited ({why}) after "
                              f"{self.max_restarts} restart(s) (--shadow-restarts): left "
                              f"down (log: {self.log(i)})\n")
                    out.flush()
                continue
            self.restarts[i] += 1
            last = f"; {_last_line(self.log(i))}" if code > 0 else ""  # its own words
            self.procs[i] = self._spawn(i)
            out.write(f"checkmate launch: {self.name(i)} exited ({why}{last}): started "
                      "it again\n")
            out.flush()

    def _check_alive(self) -> None:
        for p, proc in list(self.procs.items()):
            if proc.poll() is not None:
                raise CheckmateError(f"shadow {p} exited ({proc.returncode}): "
                                     f"{_last_line(self.log(p))} (log: {self.log(p)})")

    def stop(self) -> None:
        """SIGTERM every shadow this object started, by PID; SIGKILL what outlives 10 s."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(5)
        stop_processes(list(self.procs.values()))


def stop_processes(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM ``procs`` (the caller's own, by PID; those already ended are left), SIGKILL
    what outlives 10 s."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


PROG_LINE = "checkmate launch: compiling the shadow kernels once (Numba cache)"


class Progress:
    """The one line shown while the shadows compile their kernels: rewritten in place every
    second on a terminal, else written once and closed with the time it took."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.shown, self.seconds = out, False, 0.0
        self.tty = bool(getattr(out, "isatty", lambda: False)())

    def __call__(self, seconds: float) -> None:
        if seconds < SAY_AFTER or (self.shown and (not self.tty or seconds - self.seconds < 1)):
            return
        self.seconds = seconds
        text = f"{PROG_LINE}, {seconds:.0f} s"
        self.out.write(f"\r{text}" if self.tty else f"{text}; the workers start when done\n")
        self.out.flush()
        self.shown = True

    def end(self, ok: bool | None, seconds: float) -> None:
        """Close the line: ``ok`` says the kernels are ready after ``seconds``, None that
        the wait failed (its error line follows)."""
        if not self.shown:
            return
        if self.tty:
            self.out.write(f"\r{PROG_LINE}, {seconds:.0f} s: ready\n" if ok else "\n")
        elif ok:
            self.out.write(f"checkmate launch: the shadow kernels are ready after "
                           f"{seconds:.0f} s (cached for the next run)\n")
        self.out.flush()


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return lines[-1] if lines else "no output"


def check_shadows(addrs: list[Addr], groups: int = 1) -> int:
    """Shadows started elsewhere (``--shadow``, or registered with the controller): each
    must answer, serve its partition (of ``len(addrs)``; a mesh job's ``groups`` equal sets
    each number theirs from 0) and have its kernels compiled (waited for, as for local
    shadows); returns the job id they serve (0: none yet, learned from the seed)."""
    from checkmate.protocol.wire import GROUP_SHIFT

    jobs = set()
    n = len(addrs) // groups
    for q, a in enumerate(addrs):
        try:
            with ShadowClient(a, 10.0) as c:
                st = c.status()
        except (CheckmateError, OSError) as e:
            raise CheckmateError(f"shadow {a[0]}:{a[1]} does not answer: {e}") from None
        p = q % n
        if st.get("partition") != p or st.get("partitions") != n:
            group = f" of group {q // n}" if groups > 1 else ""
            raise CheckmateError(
                f"shadow {a[0]}:{a[1]} serves partition {st.get('partition')}/"
                f"{st.get('partitions')}, shadow number {q + 1} must serve {p}/{n}{group}")
        if st.get("job"):
            job = int(st["job"])
            if groups > 1:  # a group's wire id: the job's own, its group + 1 on top
                if job >> GROUP_SHIFT != q // n + 1:
                    raise CheckmateError(f"shadow {a[0]}:{a[1]} serves job {job:#x}, not "
                                         f"one of group {q // n}")
                job &= (1 << GROUP_SHIFT) - 1
            jobs.add(job)
    if len(jobs) > 1:
        raise CheckmateError(f"the shadows serve different jobs: {sorted(jobs)}")
    # Started just before the launcher (a fresh install), they may still be compiling.
    progress = Progress(sys.stdout)
    try:
        waited = wait_ready(addrs, START_TIMEOUT, on_wait=progress)
    except ShadowError as e:
        progress.end(None, 0.0)
        raise CheckmateError(f"the shadows were not ready in {START_TIMEOUT:.0f}s: {e}") from None
    progress.end(True, waited)
    return jobs.pop() if jobs else 0


def shadows_latest(addrs: list[Addr]) -> tuple[list[int | None], list[int | None]]:
    """Each shadow's newest committed iteration and newest iteration a state check passed
    (None: unreachable, empty, or never checked)."""
    latest: list[int | None] = []
    verified: list[int | None] = []
    for a in addrs:
        try:
            with ShadowClient(a, 5.0) as c:
                st = c.status()
            latest.append(st.get("latest"))
            verified.append((st.get("state_check") or {}).get("verified_iteration"))
        except (CheckmateError, OSError):
            latest.append(None)
            verified.append(None)
    return latest, verified
