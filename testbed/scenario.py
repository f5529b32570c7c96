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
      - {partition: 0, at: random, disk: false}   # restart: false leaves it dead;
                                                  # replica: K picks the K-th shadow
    finish_timeout: 30    # seconds the trainers wait at the end for every shadow
    persist_every: 5      # shadows persist every K iterations (needed for disk: true)
    keep: 3
    controller_restart_at: 12   # switch mode: SIGKILL the controller there, start it again
    disk_limit: {partition: 1, kib: 1500}   # that shadow persists to a tmpfs this small
    cpu_load: 4           # busy processes beside the faulted run (registration under load)
    stream_attacks: [forged-control, deep-json, replay-other-run]   # switch mode: hostile
                          # datagrams at the shadows (checkmate.testbed.stream_attacks)

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


@dataclass(frozen=True)
class Fault:
    """A fault knob on the switch port of ``port`` (a host name), within [start, until]."""

    port: str
    drop: float = 0.0
    corrupt: float = 0.0
    start: int = 0  # 0: from the first iteration
    until: int = 0  # 0: to the end
    swap: float = 0.0  # gradients rewritten under their CRC32C (the on-path swap)


@dataclass(frozen=True)
class ShadowKill:
    """SIGKILL the shadow of ``partition`` when rank 0 reports ``at``; restart it at once,
    from its disk checkpoints when ``disk`` (needs persist_every), else empty."""

    partition: int
    at: int
    disk: bool = False
    restart: bool = True
    replica: int = 0  # which of the partition's shadows (config order)


@dataclass(frozen=True)
class Attack:
    """An attack (checkmate.testbed.attacks) from host ``source`` on host ``target``, from
    the iteration ``at`` to the end of the chaos run."""

    kind: str
    source: str
    target: str
    at: int


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
    gockpt: tuple[int, int] | None = None  # (every, steps): GoCkpt mode, no shadows
    attacks: list[Attack] = field(default_factory=list)
    cpu_load: int = 0  # busy processes running beside the chaos run
    stream_attacks: list[str] = field(default_factory=list)
    verify_every: int = 0  # the trainers' --verify-every (replica agreement, state check)
    shadow_flip: tuple[int, int] | None = None  # (partition, iteration): a flipped bit
    trainer_flip: tuple[int, int] | None = None  # (rank, iteration): a flipped bit

    @property
    def chaos(self) -> bool:
        return bool(self.faults or self.shadow_kills or self.controller_restart_at
                    or self.disk_limit or self.attacks or self.stream_attacks
                    or self.shadow_flip or self.trainer_flip)


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


def parse_scenario(d: object, where: str, rng: random.Random | None = None) -> Scenario:
    """A scenario from its YAML mapping (checkmate.testbed.scenario_schema); one
    CheckmateError line naming what is wrong. ``random`` iterations are drawn from ``rng``
    in a fixed order: kill_at, each shadow kill, the controller restart, each attack, the
    shadow flip, the trainer flip."""
    from pydantic import ValidationError

    from checkmate.schema import first_error
    from checkmate.testbed.scenario_schema import ScenarioDoc

    rng = rng or random.Random()
    if not isinstance(d, dict):
        raise CheckmateError(f"scenario {where} must be a mapping")
    try:
        doc = ScenarioDoc.model_validate(d)
    except ValidationError as e:
        raise CheckmateError(f"scenario {where}: {first_error(e, 'unknown key(s)')}") from None

    def draw(v: int | str | None) -> int | None:
        if v != "random":
            return v  # type: ignore[return-value]
        return rng.randint(max(1, doc.steps // 4), max(1, 3 * doc.steps // 4))

    kill = draw(doc.kill_at)
    kills = [ShadowKill(k.partition, draw(k.at), k.disk, k.restart,  # type: ignore[arg-type]
                        k.replica)
             for k in doc.shadow_kills]
    ctl = draw(doc.controller_restart_at)
    attacks = [Attack(a.kind, a.source, a.target, draw(a.at))  # type: ignore[arg-type]
               for a in doc.attacks]
    disk = None if doc.disk_limit is None else (doc.disk_limit.partition, doc.disk_limit.kib)
    return Scenario(doc.name or where, doc.model, doc.steps, doc.seed, kill, doc.description,
                    doc.kill_phase,
                    [Fault(f.port, f.drop, f.corrupt, f.start, f.until, f.swap)
                     for f in doc.faults],
                    kills, doc.persist_every, doc.keep, ctl, float(doc.finish_timeout), disk,
                    None if doc.gockpt is None else (doc.gockpt.every, doc.gockpt.steps),
                    attacks, doc.cpu_load, list(doc.stream_attacks), doc.verify_every,
                    None if doc.shadow_flip is None else
                    (doc.shadow_flip.partition, draw(doc.shadow_flip.at)),
                    None if doc.trainer_flip is None else
                    (doc.trainer_flip.rank, draw(doc.trainer_flip.at)))


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
