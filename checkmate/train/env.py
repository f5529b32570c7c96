"""The environment contract between ``checkmate launch`` and a training script.

The launcher (checkmate.launch.launcher) sets these variables, torch's elastic agent passes
them to every worker next to its own (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT), and ``CheckmateSession.from_env`` reads them back. Names and
formats live here only, so the two sides cannot disagree. Anyone may set them by hand to run
a script without the launcher.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from checkmate.config import cluster as config
from checkmate.errors import CheckmateError
from checkmate.train import check_schedule
from checkmate.train.replicate import ShadowTarget

#: ckm job id (default 1).
JOB_ID = "CHECKMATE_JOB_ID"
#: host (trainers send the shadow copies), off (no shadows: the no-checkpoint baseline) or
#: gockpt (no shadows: periodic GoCkpt checkpoints by a local process per rank).
MODE = "CHECKMATE_MODE"
#: GoCkpt mode's ``DIR,EVERY,STEPS``: checkpoint directory, interval, steps per transfer.
GOCKPT = "CHECKMATE_GOCKPT"
#: every rank's ring address ``IP:PORT``, comma separated, in rank order.
TRAINERS = "CHECKMATE_TRAINERS"
#: Multi-node jobs (``checkmate launch --nnodes``): the ring addresses of this node's workers
#: ``IP:PORT``, comma separated, in LOCAL_RANK order. Ranks are assigned by the rendezvous,
#: so no launcher knows every address beforehand: the workers exchange theirs after it
#: (CheckmateSession.from_env), in place of CHECKMATE_TRAINERS.
LOCAL_TRAINERS = "CHECKMATE_LOCAL_TRAINERS"
#: The job's rendezvous store ``HOST:PORT`` (the c10d TCPStore at --rdzv-endpoint), which
#: outlives every attempt: where the job records that its shadows were seeded
#: (checkmate.train.agreement).
RDZV_STORE = "CHECKMATE_RDZV_STORE"
#: switch mode under the launcher: the controller's handshake address ``IP:PORT``, told the
#: rank-to-host mapping after every rendezvous (checkmate.train.attempt).
CONTROLLER = "CHECKMATE_CONTROLLER"
#: Seconds a ring operation may make no progress before it fails (a peer is gone); a
#: multi-node job sets it low so that a lost node is noticed soon.
STALL_TIMEOUT = "CHECKMATE_STALL_TIMEOUT"
#: every shadow's TCP service address ``IP:PORT``, comma separated, in partition order.
SHADOWS = "CHECKMATE_SHADOWS"
#: every shadow's UDP address ``IP:PORT`` (default: the TCP address's IP, port 47001).
SHADOWS_UDP = "CHECKMATE_SHADOWS_UDP"
#: a JSON file whose ``CHECKMATE_SHADOWS``/``CHECKMATE_SHADOWS_UDP`` replace those
#: variables: ``checkmate launch --colocate`` places the shadows anew at every rendezvous
#: and rewrites it before the round's workers start (workers forked from the launcher's
#: fork server keep the environment of its first round).
SHADOWS_FILE = "CHECKMATE_SHADOWS_FILE"
#: "1": switch mode with co-located shadows (``checkmate launch --colocate --mode switch``):
#: the shadow lists are where the launchers placed them, and every attempt tells the
#: controller (checkmate.train.attempt)
PLACED = "CHECKMATE_SHADOWS_PLACED"
#: seed of the per-(rank, iteration) RNG reseeding (CheckmateSession.begin; default 0).
SEED = "CHECKMATE_SEED"
#: rank 0 prints a progress line every N iterations (CheckmateSession.report; 0: never).
PROGRESS_EVERY = "CHECKMATE_PROGRESS_EVERY"
#: ``1``: the first attempt resumes from the shadows too (``checkmate launch --resume``).
RESUME = "CHECKMATE_RESUME"
#: ``ITERATION``: the first attempt resumes at that iteration, not the newest, and the
#: shadows are rewound to it (``checkmate launch --resume-at``).
RESUME_AT = "CHECKMATE_RESUME_AT"
#: Test only: ``RANK:ITERATION`` makes that rank SIGKILL itself after that iteration's
#: optimizer step, before the control message, in the launcher's first attempt only.
KILL_AT = "CHECKMATE_KILL_AT"
#: ``K``: every K iterations the data-parallel ranks compare a digest of their state
#: (checkmate.train.replica_check) and the shadows check theirs against it
#: (``checkmate launch --verify-every``). 0: never; ``auto`` (unset): K chosen by
#: measurement (checkmate.train.check_schedule).
VERIFY_EVERY = "CHECKMATE_VERIFY_EVERY"
#: What a divergence of the data-parallel copies does (``checkmate launch
#: --on-divergence``): ``stop`` (the default) ends the job; ``restore`` has the launcher's
#: next attempt resume from the shadows at the newest verified iteration.
ON_DIVERGENCE = "CHECKMATE_ON_DIVERGENCE"
DIVERGENCE_ACTIONS = ("stop", "restore")
#: Test only: ``RANK:ITERATION`` makes that rank flip one bit of its first parameter after
#: that iteration's optimizer step, in the launcher's first attempt only (a silent data
#: corruption for replica_check to find).
FLIP_AT = "CHECKMATE_FLIP_AT"
#: The launcher's process id, for workers forked from its server (whose parent is that
#: server, which lives as long as they do): they end when the launcher is gone.
LAUNCHER_PID = "CHECKMATE_LAUNCHER_PID"
#: ``cuda``: the worker is bound to the GPU of its LOCAL_RANK (checkmate.train.run_script)
#: and the job's collectives run on NCCL; ``cpu`` (default): no GPU.
DEVICE = "CHECKMATE_DEVICE"
#: Data-parallel groups of a mesh job (``checkmate launch --pp P --tp T``: P x T): the
#: shadows in CHECKMATE_SHADOWS are that many equal sets, group g's the g-th
#: (CheckmateSession.from_env(..., mesh=...)). Default 1.
GROUPS = "CHECKMATE_GROUPS"
#: Shadows per partition (``checkmate launch --replicas r``): CHECKMATE_SHADOWS is that many
#: whole sets, one after the other (each cut into the groups as above), set 0 the first
#: replica of every partition. Default 1.
REPLICAS = "CHECKMATE_REPLICAS"
#: Set by torch's elastic agent: how many times the worker group was restarted.
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"

ENV_MODES = ("host", "off", "gockpt", "switch")
ENV_DEVICES = ("cpu", "cuda")


def backend_for(device: str) -> str:
    """The default process group's backend for a worker on ``device``: gloo on CPUs; on GPUs
    NCCL for CUDA tensors with gloo for CPU ones (torch's per-device backend string)."""
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"


@dataclass(frozen=True)
class EnvJob:
    """What the environment says about this process's job."""

    job_id: int
    mode: str
    rank: int
    world: int
    trainers: list[tuple[str, int]]
    shadow_tcp: list[tuple[str, int]]
    shadows: list[ShadowTarget]
    seed: int
    progress_every: int
    restart_count: int
    resume: bool
    kill_at: tuple[int, int] | None
    gockpt: tuple[str, int, int] | None = None
    device: str = "cpu"
    #: multi-node: this worker's ring address (``trainers`` is empty until exchanged)
    local_trainer: tuple[str, int] | None = None
    rdzv_store: tuple[str, int] | None = None
    controller: tuple[str, int] | None = None
    stall_timeout: float | None = None
    groups: int = 1
    resume_at: int | None = None
    verify_every: int = 0
    flip_at: tuple[int, int] | None = None
    on_divergence: str = "stop"
    #: the further replicas of every partition (``REPLICAS`` - 1 whole sets, each numbered
    #: from partition 0 as ``shadows``/``shadow_tcp``, which hold the first)
    replica_shadows: list[list[ShadowTarget]] = field(default_factory=list)
    replica_tcp: list[list[tuple[str, int]]] = field(default_factory=list)
    #: switch mode, co-located shadows: each attempt tells the controller where (PLACED)
    placed: bool = False


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    v = env.get(name)
    if v is None or v == "":
        if default is None:
            raise CheckmateError(f"environment variable {name} is not set: start the script "
                                 "with `checkmate launch` (or set it by hand)")
        return default
    if not v.isdigit():
        raise CheckmateError(f"environment variable {name} must be a non-negative integer, "
                             f"got {v!r}")
    return int(v)


def _addrs(env: Mapping[str, str], name: str) -> list[tuple[str, int]]:
    out = []
    for item in env.get(name, "").split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise CheckmateError(f"environment variable {name} must be IP:PORT[,IP:PORT...], "
                                 f"got {env.get(name, '')!r}")
        out.append((host, int(port)))
    return out


def format_addrs(addrs: list[tuple[str, int]]) -> str:
    """The inverse of the address-list parsing: ``IP:PORT,IP:PORT``."""
    return ",".join(f"{h}:{p}" for h, p in addrs)


def _round_shadows(env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` with the shadow lists of :data:`SHADOWS_FILE` where it names one."""
    path = env.get(SHADOWS_FILE)
    if not path:
        return env
    try:
        got = json.loads(Path(path).read_text())
        lists = {k: str(got[k]) for k in (SHADOWS, SHADOWS_UDP)}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckmateError(f"{SHADOWS_FILE} {path}: cannot read this round's shadows "
                             f"({e})") from None
    return {**env, **lists}


def read(env: Mapping[str, str] | None = None) -> EnvJob:
    """Parse the environment; every problem is one CheckmateError naming the variable."""
    env = _round_shadows(os.environ if env is None else env)
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if world < 1 or rank >= world:
        raise CheckmateError(f"RANK {rank} is not below WORLD_SIZE {world}")
    mode = env.get(MODE, "host")
    if mode not in ENV_MODES:
        raise CheckmateError(f"environment variable {MODE} must be one of "
                             f"{', '.join(ENV_MODES)}, got {mode!r}")
    if mode == "switch" and not env.get(CONTROLLER):
        raise CheckmateError(f"{MODE}=switch needs {CONTROLLER} (the controller's address)")
    local_trainer = None
    if env.get(LOCAL_TRAINERS) and not env.get(TRAINERS):
        local = _addrs(env, LOCAL_TRAINERS)
        lr = _int(env, "LOCAL_RANK")
        if lr >= len(local):
            raise CheckmateError(f"{LOCAL_TRAINERS} lists {len(local)} addresses, LOCAL_RANK "
                                 f"is {lr}")
        trainers, local_trainer = [], local[lr]
    else:
        trainers = _addrs(env, TRAINERS)
        if len(trainers) != world:
            raise CheckmateError(f"{TRAINERS} lists {len(trainers)} addresses for WORLD_SIZE "
                                 f"{world}")
    tcp: list[tuple[str, int]] = []
    udp: list[tuple[str, int]] = []
    gockpt = None
    if mode == "gockpt":
        d, _, rest = env.get(GOCKPT, "").rpartition(",")
        d, _, every = d.rpartition(",")
        if not d or not every.isdigit() or not rest.isdigit():
            raise CheckmateError(f"environment variable {GOCKPT} must be DIR,EVERY,STEPS, got "
                                 f"{env.get(GOCKPT, '')!r}")
        gockpt = (d, int(every), int(rest))
    elif mode != "off":
        tcp = _addrs(env, SHADOWS)
        udp = (_addrs(env, SHADOWS_UDP) if env.get(SHADOWS_UDP)
               else [(h, config.SHADOW_PORT) for h, _ in tcp])
        if len(udp) != len(tcp):
            raise CheckmateError(f"{SHADOWS_UDP} lists {len(udp)} addresses, {SHADOWS} "
                                 f"{len(tcp)}")
    kill_at, flip_at = rank_iteration(env, KILL_AT), rank_iteration(env, FLIP_AT)
    device = env.get(DEVICE) or "cpu"
    if device not in ENV_DEVICES:
        raise CheckmateError(f"environment variable {DEVICE} must be one of "
                             f"{', '.join(ENV_DEVICES)}, got {device!r}")
    store = _addrs(env, RDZV_STORE)[0] if env.get(RDZV_STORE) else None
    controller = _addrs(env, CONTROLLER)[0] if env.get(CONTROLLER) else None
    stall = env.get(STALL_TIMEOUT)
    if stall and not stall.isdigit():
        raise CheckmateError(f"environment variable {STALL_TIMEOUT} must be whole seconds, "
                             f"got {stall!r}")
    replicas = _int(env, REPLICAS, 1)
    if replicas < 1 or len(tcp) % replicas:
        raise CheckmateError(f"environment variable {REPLICAS} must divide the {len(tcp)} "
                             f"shadows of {SHADOWS} into whole sets, got {replicas}")
    n = len(tcp) // replicas
    sets = [([ShadowTarget(p, h, port) for p, (h, port) in enumerate(udp[k * n:(k + 1) * n])],
             tcp[k * n:(k + 1) * n]) for k in range(replicas)]
    placed = env.get(PLACED, "0")
    if placed not in ("0", "1") or placed == "1" and mode != "switch":
        raise CheckmateError(f"environment variable {PLACED} must be 0, or 1 in switch mode, "
                             f"got {placed!r} (mode {mode})")
    resume = env.get(RESUME, "0")
    if resume not in ("0", "1"):
        raise CheckmateError(f"environment variable {RESUME} must be 0 or 1, got {resume!r}")
    return EnvJob(
        job_id=_int(env, JOB_ID, 1), mode=mode, rank=rank, world=world, trainers=trainers,
        shadow_tcp=sets[0][1], shadows=sets[0][0],
        replica_shadows=[s[0] for s in sets[1:]], replica_tcp=[s[1] for s in sets[1:]],
        seed=_int(env, SEED, 0), progress_every=_int(env, PROGRESS_EVERY, 0),
        restart_count=_int(env, RESTART_COUNT, 0), resume=resume == "1", kill_at=kill_at,
        gockpt=gockpt, device=device, local_trainer=local_trainer, rdzv_store=store,
        controller=controller, stall_timeout=float(stall) if stall else None,
        groups=_groups(env, n),
        resume_at=_int(env, RESUME_AT) if env.get(RESUME_AT) else None,
        verify_every=check_schedule.parse(env.get(VERIFY_EVERY, "auto")), flip_at=flip_at,
        on_divergence=_divergence(env), placed=placed == "1")


def _divergence(env: Mapping[str, str]) -> str:
    v = env.get(ON_DIVERGENCE, "stop")
    if v not in DIVERGENCE_ACTIONS:
        raise CheckmateError(f"environment variable {ON_DIVERGENCE} must be stop or restore, "
                             f"got {v!r}")
    return v


def rank_iteration(env: Mapping[str, str], name: str) -> tuple[int, int] | None:
    """A test-only ``RANK:ITERATION`` variable (KILL_AT, FLIP_AT), or None when unset."""
    v = env.get(name)
    if not v:
        return None
    r, _, it = v.partition(":")
    if not r.isdigit() or not it.isdigit():
        raise CheckmateError(f"{name} must look like RANK:ITERATION, got {v!r}")
    return int(r), int(it)


def _groups(env: Mapping[str, str], shadows: int) -> int:
    """CHECKMATE_GROUPS, checked against the shadow list it divides."""
    groups = _int(env, GROUPS, 1)
    if groups < 1 or shadows % groups:
        raise CheckmateError(f"environment variable {GROUPS} must divide the {shadows} "
                             f"shadows of {SHADOWS} into equal sets, got {groups}")
    return groups
