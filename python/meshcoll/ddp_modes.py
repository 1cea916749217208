"""DataParallel's synchronisation modes besides "sync" and "no_sync": LocalSGD (average the
parameters every k steps), BoundedStaleness and Asynchronous (apply averages of earlier
steps, so communication overlaps whole steps). ddp.py runs them; ``meshcoll.ddp`` and
``meshcoll`` export them."""

from __future__ import annotations

from typing import Union


class LocalSGD:
    """Synchronisation mode for ``DataParallel(mode=LocalSGD(period=k))``: gradients stay
    local, every rank steps on its own, and every ``period``-th ``ddp.step()`` replaces the
    parameters by their average over the group (so ranks drift for at most k steps)."""

    def __init__(self, period: int) -> None:
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"LocalSGD: period must be an integer >= 1, got {period!r}")
        self.period = period

    def __repr__(self) -> str:
        return f"LocalSGD(period={self.period})"


class BoundedStaleness:
    """``DataParallel(mode=BoundedStaleness(k))``: ``wait()`` at step t hands back the group
    average of step t-k's gradients (zeros for the first k steps), so each step's
    all-reduces have k steps of compute to hide behind. Deterministic: every rank applies the
    same averages at the same step. It helps where communication takes longer than a step's
    backward (slow links, many hosts) and the optimizer tolerates gradients k steps old
    (SGD with a small learning rate, as in pipelined and asynchronous SGD)."""

    def __init__(self, staleness: int) -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 1:
            raise ValueError(f"BoundedStaleness: staleness must be an integer >= 1, got "
                             f"{staleness!r}")
        self.staleness = staleness

    def __repr__(self) -> str:
        return f"BoundedStaleness({self.staleness})"


class Asynchronous:
    """``DataParallel(mode=Asynchronous(max_staleness=k))``: ``wait()`` never waits for
    stragglers: it hands back the newest group average that has arrived (each an exact average
    of one earlier step; zeros while none has), and only when k steps are in flight does it
    wait for the oldest. Ranks may apply different steps' averages; ``stats()`` reports the
    staleness applied. It helps where a few ranks are often late (shared or preemptible
    machines) and the training tolerates stale gradients."""

    def __init__(self, max_staleness: int = 4) -> None:
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or \
                max_staleness < 1:
            raise ValueError(f"Asynchronous: max_staleness must be an integer >= 1, got "
                             f"{max_staleness!r}")
        self.max_staleness = max_staleness

    def __repr__(self) -> str:
        return f"Asynchronous(max_staleness={self.max_staleness})"


_Mode = Union[str, LocalSGD, BoundedStaleness, Asynchronous]


def _depth(mode: _Mode) -> int:
    """How many steps' buckets a mode keeps: one, or one per step that may be in flight."""
    if isinstance(mode, BoundedStaleness):
        return mode.staleness + 1
    if isinstance(mode, Asynchronous):
        return mode.max_staleness + 1
    return 1
