"""Scenarios of `testbed run`: what to train, and which failures to inject when.

A scenario is a YAML file (testbed/scenarios/NAME.yaml, found by name, or any path)::

    name: replica-loss
    model: gpt            # gpt | cnn (checkmate.testbed.models)
    steps: 40
    seed: 0
    kill_at: 30           # SIGKILL every trainer at this iteration (or "random"), restore
    kill_phase: after-step  # or before-control: rank 0 dies between step and control
    faults:               # switch fault knobs (switch mode), per port
      - {port: s1, drop: 0.05, corrupt: 0.0, from: 1, until: 40}
    shadow_kills:         # SIGKILL a shadow when rank 0 reports an iteration, restart it
      - {partition: 0, at: random, disk: false}   # restart: false leaves it dead
    finish_timeout: 30    # seconds the trainers wait at the end for every shadow
    persist_every: 5      # shadows persist every K iterations (needed for disk: true)
    keep: 3
    controller_restart_at: 12   # switch mode: SIGKILL the controller there, start it again
    disk_limit: {partition: 1, kib: 1500}   # that shadow persists to a tmpfs this small

Without faults, shadow kills or a controller restart, ``kill_at`` makes the second run
"kill-restore"; with any of them the second run is "chaos" (the faults and kills, plus the
trainer kill when ``kill_at`` is set). The first run is always failure-free, the reference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from checkmate.errors import CheckmateError

SCENARIO_DIR = Path(__file__).with_name("scenarios")
KILL_PHASES = ("after-step", "before-control")
_KEYS = {"name", "model", "steps", "seed", "kill_at", "kill_phase", "description", "faults",
         "shadow_kills", "persist_every", "keep", "controller_restart_at", "finish_timeout",
         "disk_limit"}


@dataclass(frozen=True)
class Fault:
    """A fault knob on the switch port of ``port`` (a host name), within [start, until]."""

    port: str
    drop: float = 0.0
    corrupt: float = 0.0
    start: int = 0  # 0: from the first iteration
    until: int = 0  # 0: to the end


@dataclass(frozen=True)
class ShadowKill:
    """SIGKILL the shadow of ``partition`` when rank 0 reports ``at``; restart it at once,
    from its disk checkpoints when ``disk`` (needs persist_every), else empty."""

    partition: int
    at: int
    disk: bool = False
    restart: bool = True


@dataclass
class Scenario:
    name: str
    model: str
    steps: int
    seed: int = 0
    kill_at: int | None = None
    description: str = ""
    kill_phase: str = "after-step"
    faults: list[Fault] = field(default_factory=list)
    shadow_kills: list[ShadowKill] = field(default_factory=list)
    persist_every: int = 0
    keep: int = 3
    controller_restart_at: int | None = None
    finish_timeout: float = 30.0
    disk_limit: tuple[int, int] | None = None  # (partition, KiB of its checkpoint disk)

    @property
    def chaos(self) -> bool:
        return bool(self.faults or self.shadow_kills or self.controller_restart_at
                    or self.disk_limit)


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


def _int(v: object, what: str, lo: int, hi: int | None = None) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        raise CheckmateError(f"{what} must be an integer in {lo}..{hi if hi else ''}, "
                             f"got {v!r}")
    return v


def _iteration(v: object, what: str, steps: int, rng: random.Random) -> int:
    if v == "random":
        return rng.randint(max(1, steps // 4), max(1, 3 * steps // 4))
    return _int(v, what, 1, steps - 1)


def _prob(v: object, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= 1.0:
        raise CheckmateError(f"{what} must be a probability in 0..1, got {v!r}")
    return float(v)


def parse_scenario(d: object, where: str, rng: random.Random | None = None) -> Scenario:
    """A scenario from its YAML mapping; one CheckmateError line naming what is wrong."""
    rng = rng or random.Random()
    if not isinstance(d, dict):
        raise CheckmateError(f"scenario {where} must be a mapping")
    unknown = set(d) - _KEYS
    if unknown:
        raise CheckmateError(f"scenario {where}: unknown key(s) {', '.join(sorted(unknown))}")
    from checkmate.testbed.models import MODELS

    model = d.get("model", "gpt")
    if model not in MODELS:
        raise CheckmateError(f"scenario {where}: model must be one of {', '.join(MODELS)}")
    steps = _int(d.get("steps", 40), f"scenario {where}: steps", 2)
    seed = _int(d.get("seed", 0), f"scenario {where}: seed", 0)
    kill = d.get("kill_at")
    if kill is not None:
        kill = _iteration(kill, f"scenario {where}: kill_at", steps, rng)
    phase = d.get("kill_phase", "after-step")
    if phase not in KILL_PHASES:
        raise CheckmateError(f"scenario {where}: kill_phase must be one of "
                             f"{', '.join(KILL_PHASES)}, got {phase!r}")
    faults = []
    for i, f in enumerate(d.get("faults") or []):
        w = f"scenario {where}: faults[{i}]"
        if not isinstance(f, dict) or set(f) - {"port", "drop", "corrupt", "from", "until"}:
            raise CheckmateError(f"{w} must be a mapping of port, drop, corrupt, from, until")
        if not isinstance(f.get("port"), str):
            raise CheckmateError(f"{w}: port must be a host name")
        a = _int(f.get("from", 0), f"{w}: from", 0, steps)
        b = _int(f.get("until", 0), f"{w}: until", 0, steps)
        if a and b and a > b:
            raise CheckmateError(f"{w}: from {a} is after until {b}")
        faults.append(Fault(f["port"], _prob(f.get("drop", 0.0), f"{w}: drop"),
                            _prob(f.get("corrupt", 0.0), f"{w}: corrupt"), a, b))
    persist = _int(d.get("persist_every", 0), f"scenario {where}: persist_every", 0)
    kills = []
    for i, k in enumerate(d.get("shadow_kills") or []):
        w = f"scenario {where}: shadow_kills[{i}]"
        if not isinstance(k, dict) or set(k) - {"partition", "at", "disk", "restart"}:
            raise CheckmateError(f"{w} must be a mapping of partition, at, disk, restart")
        disk, restart = k.get("disk", False), k.get("restart", True)
        if not isinstance(disk, bool) or not isinstance(restart, bool):
            raise CheckmateError(f"{w}: disk and restart must be true or false")
        if disk and not persist:
            raise CheckmateError(f"{w}: disk: true needs persist_every")
        kills.append(ShadowKill(_int(k.get("partition"), f"{w}: partition", 0),
                                _iteration(k.get("at"), f"{w}: at", steps, rng), disk,
                                restart))
    ctl = d.get("controller_restart_at")
    if ctl is not None:
        ctl = _iteration(ctl, f"scenario {where}: controller_restart_at", steps, rng)
    disk = d.get("disk_limit")
    if disk is not None:
        if not isinstance(disk, dict) or set(disk) != {"partition", "kib"}:
            raise CheckmateError(f"scenario {where}: disk_limit must be {{partition, kib}}")
        if not persist:
            raise CheckmateError(f"scenario {where}: disk_limit needs persist_every")
        disk = (_int(disk["partition"], f"scenario {where}: disk_limit.partition", 0),
                _int(disk["kib"], f"scenario {where}: disk_limit.kib", 64))
    fin = d.get("finish_timeout", 30)
    if isinstance(fin, bool) or not isinstance(fin, int | float) or not 0 < fin <= 3600:
        raise CheckmateError(f"scenario {where}: finish_timeout must be seconds in (0, 3600]")
    return Scenario(str(d.get("name", where)), model, steps, seed, kill,
                    str(d.get("description", "")), phase, faults, kills, persist,
                    _int(d.get("keep", 3), f"scenario {where}: keep", 1), ctl, float(fin),
                    disk)


def load_scenario(ref: str, rng: random.Random | None = None) -> Scenario:
    """A scenario by name (testbed/scenarios/NAME.yaml) or by path; CheckmateError if bad."""
    path = Path(ref)
    if not path.suffix:
        path = SCENARIO_DIR / f"{ref}.yaml"
    if not path.is_file():
        raise CheckmateError(f"no scenario {ref!r} (known: {', '.join(scenario_names())}, "
                             "or a path to a YAML file)")
    try:
        d = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        raise CheckmateError(f"scenario {path} is not readable YAML") from None
    if isinstance(d, dict) and "name" not in d:
        d = {**d, "name": path.stem}
    return parse_scenario(d, str(path), rng)
