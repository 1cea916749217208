"""Pipeline parallelism: schedules as data, a simulator, and an executor.

Importing this package loads only pure Python (schedule, simulate);
the executor is imported lazily because it talks to a ProcessGroup.
"""

from typing import Any

from .schedule import (
    SCHEDULES,
    Action,
    DeadlockError,
    Kind,
    Schedule,
    ScheduleError,
    from_compute_orders,
    dualpipe_v,
    gpipe,
    interleaved_1f1b,
    interleaved_zero_bubble,
    make_schedule,
    one_f_one_b,
    zero_bubble,
    zero_bubble_v,
)
from .simulate import SimResult, simulate, stash_peak, timeline, validate
from .planner import PlanEntry, plan

__all__ = [
    "SCHEDULES", "Action", "DeadlockError", "Kind", "Schedule", "ScheduleError",
    "from_compute_orders", "gpipe", "interleaved_1f1b", "make_schedule", "one_f_one_b",
    "zero_bubble", "interleaved_zero_bubble", "zero_bubble_v", "dualpipe_v", "SimResult", "simulate", "stash_peak", "timeline", "validate", "plan", "PlanEntry",
    "PipelineExecutor", "Stage", "SplitStage", "ArraySpec",
]


def __getattr__(name: str) -> Any:
    # PEP 562 lazy import: the executor pulls in numpy and, through the group
    # it is given, the C++ extension; schedules and the simulator need neither.
    if name in ("PipelineExecutor", "Stage", "SplitStage", "ArraySpec"):
        from . import executor

        return getattr(executor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
