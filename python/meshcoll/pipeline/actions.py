"""The vocabulary of pipeline schedules: action kinds, actions, the errors, and ``Plan``,
what the simulator reads of a schedule. The bottom of the pipeline package: schedule.py
builds schedules from these, simulate.py plays any ``Plan``, and a Schedule draws its grid
with the simulator (tools/check_imports.py keeps that order free of circles)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Protocol, Tuple


class ScheduleError(ValueError):
    """A schedule is malformed: wrong parameters, a missing/duplicate/misplaced action."""


class DeadlockError(ScheduleError):
    """A schedule is well formed but cannot complete: every rank waits on another."""


class Kind(str, enum.Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the literature's name for the input-gradient pass
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE


_COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
# Short spellings used in the grid so that a cell stays a few characters wide.
_SHORT = {Kind.SEND_F: "sF", Kind.RECV_F: "rF", Kind.SEND_B: "sB", Kind.RECV_B: "rB"}


@dataclass(frozen=True)
class Action:
    """One step of one rank: `stage` is the model stage, `microbatch` its index.

    Printed compactly as stage, kind, microbatch: ``Action(1, F, 0)`` -> ``1F0``.
    """

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{_SHORT.get(self.kind, self.kind.value)}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self.stage}, Kind.{self.kind.name}, {self.microbatch})"


class Plan(Protocol):
    """What simulate.py reads of a schedule (schedule.Schedule is one)."""

    @property
    def name(self) -> str: ...
    @property
    def num_ranks(self) -> int: ...
    @property
    def num_stages(self) -> int: ...
    @property
    def num_microbatches(self) -> int: ...
    @property
    def per_rank(self) -> Tuple[Tuple[Action, ...], ...]: ...
    def stage_rank(self, stage: int) -> int: ...
    def actions(self, rank: int) -> List[Action]: ...
    def describe_placement(self) -> str: ...
