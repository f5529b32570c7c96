"""The scenario document's schema (pydantic): what testbed/scenario.py accepts.

Types, ranges and defaults per key, unknown keys refused, and the rules across keys
(iterations inside the run, a fault window in order, disk restarts and disk limits only
with persistence). Iterations may be ``random``; scenario.py draws them after validation,
in a fixed order, from the caller's seeded generator.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from checkmate.schema import int_in as _int_in
from checkmate.schema import one_of as _one_of

KILL_PHASES = ("after-step", "before-control")
#: Hostile datagrams at the shadows during the chaos run (checkmate.testbed.stream_attacks).
STREAM_ATTACKS = ("forged-control", "deep-json", "other-partition", "refused-peers",
                  "replay-other-run")
Random = Literal["random"]


def _prob(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= 1.0:
        raise ValueError(f"must be a probability in 0..1, got {v!r}")
    return float(v)


def _strict_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {v!r}")
    return v


def _iteration(v: Any) -> int | str:
    if v == "random":
        return v
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"must be an integer iteration or random, got {v!r}")
    return v


def _port(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("must be a host name")
    return v


Prob = Annotated[float, BeforeValidator(_prob)]
Iteration = Annotated[int | str, BeforeValidator(_iteration)]
NonNeg = Annotated[int, _int_in(0, 2**31 - 1)]
Flag = Annotated[bool, BeforeValidator(_strict_bool)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class FaultDoc(_Strict):
    port: Annotated[str, BeforeValidator(_port)] = Field(None, validate_default=True)
    drop: Prob = 0.0
    corrupt: Prob = 0.0
    swap: Prob = 0.0
    start: NonNeg = Field(0, alias="from")
    until: NonNeg = 0

    @model_validator(mode="after")
    def _window(self) -> FaultDoc:
        if self.start and self.until and self.start > self.until:
            raise ValueError(f": from {self.start} is after until {self.until}")
        return self


class ShadowKillDoc(_Strict):
    partition: NonNeg
    at: Iteration
    disk: Flag = False
    restart: Flag = True
    #: which of the partition's shadows (a config with several per partition)
    replica: NonNeg = 0


class ShadowFlipDoc(_Strict):
    """A bit of ``partition``'s committed state flipped after iteration ``at`` (the
    shadow's CHECKMATE_SHADOW_FLIP_AT): the fault the state check (verify_every) finds."""

    partition: NonNeg
    at: Iteration


class TrainerFlipDoc(_Strict):
    """A bit of trainer ``rank``'s first parameter flipped after iteration ``at`` (the
    worker's CHECKMATE_FLIP_AT): the fault replica agreement (verify_every) finds."""

    rank: NonNeg
    at: Iteration


class AttackDoc(_Strict):
    """An attack from host ``source`` on host ``target`` from iteration ``at`` to the end
    of the run (checkmate.testbed.attacks)."""

    kind: Annotated[str, _one_of(("mac_hijack", "conn_flood"))]
    source: Annotated[str, BeforeValidator(_port)] = Field(alias="from")
    target: Annotated[str, BeforeValidator(_port)]
    at: Iteration = 1


class DiskLimitDoc(_Strict):
    partition: NonNeg
    kib: Annotated[int, _int_in(64, 2**31 - 1)]


class GoCkptDoc(_Strict):
    every: Annotated[int, _int_in(1, 2**31 - 1)]
    steps: Annotated[int, _int_in(1, 2**31 - 1)]

    @model_validator(mode="after")
    def _fits(self) -> GoCkptDoc:
        if self.steps > self.every:
            raise ValueError("steps must be at most every (one window at a time)")
        return self


class ScenarioDoc(_Strict):
    name: str | None = None
    description: str = ""
    model: str = "gpt"
    steps: Annotated[int, _int_in(2, 2**31 - 1)] = 40
    seed: NonNeg = 0
    kill_at: Iteration | None = None
    kill_phase: Annotated[str, _one_of(KILL_PHASES)] = "after-step"
    faults: list[FaultDoc] = Field(default_factory=list)
    shadow_kills: list[ShadowKillDoc] = Field(default_factory=list)
    persist_every: NonNeg = 0
    keep: Annotated[int, _int_in(1, 1000)] = 3
    controller_restart_at: Iteration | None = None
    finish_timeout: float = 30.0
    disk_limit: DiskLimitDoc | None = None
    gockpt: GoCkptDoc | None = None
    attacks: list[AttackDoc] = Field(default_factory=list)
    cpu_load: Annotated[int, _int_in(0, 64)] = 0
    stream_attacks: list[Annotated[str, _one_of(STREAM_ATTACKS)]] = Field(default_factory=list)
    verify_every: NonNeg = 0
    shadow_flip: ShadowFlipDoc | None = None
    trainer_flip: TrainerFlipDoc | None = None

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, data: Any) -> Any:
        if isinstance(data, dict):  # `faults:` with nothing after it means none
            data = {k: ([] if k in ("faults", "shadow_kills") and v is None else v)
                    for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _across_keys(self) -> ScenarioDoc:
        from checkmate.testbed.models import MODELS

        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        last = self.steps - 1
        its = [("kill_at", self.kill_at), ("controller_restart_at",
                                           self.controller_restart_at)]
        its += [(f"shadow_kills[{i}].at", k.at) for i, k in enumerate(self.shadow_kills)]
        its += [(f"attacks[{i}].at", a.at) for i, a in enumerate(self.attacks)]
        for what, v in its:
            if isinstance(v, int) and not 1 <= v <= last:
                raise ValueError(f"{what} must be an integer in 1..{last} or random, got {v}")
        for i, f in enumerate(self.faults):
            if f.start > self.steps or f.until > self.steps:
                raise ValueError(f"faults[{i}]: from and until must be in 0..{self.steps}")
        for i, k in enumerate(self.shadow_kills):
            if k.disk and not self.persist_every:
                raise ValueError(f"shadow_kills[{i}]: disk: true needs persist_every")
        if self.disk_limit is not None and not self.persist_every:
            raise ValueError("disk_limit needs persist_every")
        if self.gockpt is not None and (self.faults or self.shadow_kills or self.persist_every
                                        or self.controller_restart_at or self.disk_limit
                                        or self.attacks or self.stream_attacks):
            raise ValueError("gockpt runs without shadows: no faults, shadow_kills, "
                             "persist_every, controller_restart_at, disk_limit, attacks or "
                             "stream_attacks")
        if self.cpu_load and not (self.faults or self.shadow_kills
                                  or self.controller_restart_at or self.disk_limit):
            raise ValueError("cpu_load loads the chaos run: give faults or shadow_kills")
        if not 0 < self.finish_timeout <= 3600:
            raise ValueError("finish_timeout must be seconds in (0, 3600]")
        return self
