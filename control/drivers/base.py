"""What every driver returns and offers: apply a plan (idempotently), report status."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from checkmate.control.plan import Plan


@dataclass
class ApplyResult:
    """Changes a deploy made; empty lists mean the target already matched the plan."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def writes(self) -> int:
        return len(self.added) + len(self.changed) + len(self.removed)

    def summary(self) -> str:
        return (f"{len(self.added)} added, {len(self.changed)} changed, "
                f"{len(self.removed)} removed")


class Driver(Protocol):
    def apply(self, plan: Plan) -> ApplyResult: ...

    def status(self) -> dict: ...

    def close(self) -> None: ...
