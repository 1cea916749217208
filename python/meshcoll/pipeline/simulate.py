"""Check a schedule and time it without running anything.

`validate` checks the structure: every action on the rank that owns its stage,
every (stage, microbatch) forwarded once and backwarded once (either one B, or
one I and one W), a SEND and a RECV for every edge between ranks, producers
before their sends, receives posted before their consumers, and each channel's
RECVs in its send order (Note [Channel order] in schedule.py).

`simulate` then plays the lists: a rank runs its next action as soon as what
it needs exists, exactly as the executor does (sends never block the rank, a
RECV only posts a receive, a compute waits for its inputs; Note [Serial p2p]
says what a posted receive may hold back, on a transport that serialises). If no rank can move, the schedule
deadlocks and the error names each rank's stuck action.

Cost model. F costs t_f and B costs t_b. For split backwards the B is divided,
not added to: I costs t_b - t_w and W costs t_w, so a zero-bubble schedule does
the same total work as 1F1B and, with t_w = 0, has exactly 1F1B's timing. A
message is usable t_comm after its SEND runs; stages on one rank hand over for
free. Every stage costs the same (the "equal stage times" of the theory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from .actions import Action, DeadlockError, Kind, Plan, ScheduleError

__all__ = ["SimResult", "simulate", "validate", "timeline", "stash_peak", "ScheduleError",
           "DeadlockError"]

Event = Tuple[float, float, Action]  # (start, end, action)
# What a step of the timeline waits for: ("done", compute), ("msg", receive) (its message
# arrived) or ("recv", receive) (the receive completed).
_Key = Tuple[str, Action]


@dataclass(frozen=True)
class SimResult:
    makespan: float
    # Idle time / makespan, per rank. Equal stage costs give the textbook
    # (p-1)/(m+p-1) for GPipe and 1F1B on every rank.
    bubble_fraction: Tuple[float, ...]
    # Most stage inputs a rank holds at once: +1 at F, -1 at B (or at W, which
    # is the last pass to read them).
    peak_activations: Tuple[int, ...]
    busy: Tuple[float, ...]
    timeline: Tuple[Tuple[Event, ...], ...]

    @property
    def bubble(self) -> float:
        """Mean bubble fraction over the ranks."""
        return sum(self.bubble_fraction) / len(self.bubble_fraction)

    def __repr__(self) -> str:
        # A summary of constant size: the per-rank fields grow with the ranks and the
        # timeline (every event of every rank) runs to kilobytes; the fields hold them all.
        events = sum(len(line) for line in self.timeline)
        peak = max(self.peak_activations, default=0)
        return (f"SimResult(makespan={self.makespan:.6g}, bubble={self.bubble:.4f}, "
                f"ranks={len(self.busy)}, max(peak_activations)={peak}, "
                f"<{events} events in timeline>)")


def simulate(schedule: Plan, t_f: float = 1.0, t_b: float = 2.0, t_w: float = 0.0,
             t_comm: float = 0.0, serial_p2p: bool = False) -> SimResult:
    """Validate and time `schedule` (see the module docstring and Note [Serial p2p])."""
    for name, value in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w), ("t_comm", t_comm)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    if t_w > t_b:
        raise ValueError(f"t_w ({t_w}) is the weight-gradient share of t_b ({t_b}), so t_w <= t_b")
    cost = {Kind.F: t_f, Kind.B: t_b, Kind.I: t_b - t_w, Kind.W: t_w}
    lines = timeline(schedule, lambda a: cost.get(a.kind, 0.0), t_comm, serial_p2p)
    makespan = max((end for events in lines for _, end, _ in events), default=0.0)
    busy = tuple(sum(end - start for start, end, a in events if a.kind.is_compute) for events in lines)
    bubble = tuple((makespan - b) / makespan if makespan > 0 else 0.0 for b in busy)
    return SimResult(makespan, bubble, tuple(stash_peak(schedule, r) for r in range(schedule.num_ranks)),
                     busy, tuple(tuple(e) for e in lines))


def stash_peak(schedule: Plan, rank: int) -> int:
    """Most stage inputs `rank` holds at once (in stages, not ranks' shares): +1 at F,
    -1 at B or W, the last pass that reads it."""
    held = peak = 0
    for a in schedule.actions(rank):
        if a.kind is Kind.F:
            held += 1
            peak = max(peak, held)
        elif a.kind in (Kind.B, Kind.W):
            held -= 1
    return peak


# --------------------------------------------------------------------------
# Structure.


def _backward_kinds(schedule: Plan) -> Dict[Tuple[int, int], Kind]:
    """(stage, microbatch) -> the kind (B or I) that produces its input gradient."""
    out: Dict[Tuple[int, int], Kind] = {}
    for acts in schedule.per_rank:
        for a in acts:
            if a.kind in (Kind.B, Kind.I):
                out[(a.stage, a.microbatch)] = a.kind
    return out


def validate(schedule: Plan) -> None:
    """Raise ScheduleError naming the first structural problem; return None if sound."""
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    if len(schedule.per_rank) != p:
        raise ScheduleError(f"schedule has {len(schedule.per_rank)} rank lists for {p} ranks")
    rank_of = schedule.stage_rank

    def cross(a: int, b: int) -> bool:  # stages on different ranks
        return rank_of(a) != rank_of(b)

    where: Dict[Tuple[Kind, int, int], Tuple[int, int]] = {}  # action -> (rank, position)
    for r, acts in enumerate(schedule.per_rank):
        for pos, a in enumerate(acts):
            if not isinstance(a, Action) or not isinstance(a.kind, Kind):
                raise ScheduleError(f"rank {r} position {pos}: not an Action: {a!r}")
            if not (0 <= a.stage < S and 0 <= a.microbatch < m):
                raise ScheduleError(f"rank {r}: action {a} is outside {S} stages x {m} microbatches")
            if rank_of(a.stage) != r:
                raise ScheduleError(f"rank {r}: action {a} belongs to rank {rank_of(a.stage)} "
                                    f"({schedule.describe_placement()})")
            key = (a.kind, a.stage, a.microbatch)
            if key in where:
                raise ScheduleError(f"duplicate action {a}: on rank {where[key][0]} position "
                                    f"{where[key][1]} and rank {r} position {pos}")
            where[key] = (r, pos)
            bad_comm = ((a.kind is Kind.SEND_F and not (a.stage + 1 < S and cross(a.stage, a.stage + 1)))
                        or (a.kind is Kind.RECV_F and not (a.stage > 0 and cross(a.stage, a.stage - 1)))
                        or (a.kind is Kind.SEND_B and not (a.stage > 0 and cross(a.stage, a.stage - 1)))
                        or (a.kind is Kind.RECV_B and not (a.stage + 1 < S and cross(a.stage, a.stage + 1))))
            if bad_comm:
                raise ScheduleError(f"rank {r}: {a.kind} {a} has no peer stage on another rank")

    def need(kind: Kind, s: int, i: int, why: str = "") -> Tuple[int, int]:
        if (kind, s, i) not in where:
            raise ScheduleError(f"missing action {Action(s, kind, i)} on rank {rank_of(s)}{why}")
        return where[(kind, s, i)]

    def before(first: Tuple[int, int], second: Tuple[int, int], a: Action, b: Action) -> None:
        if first[1] > second[1]:
            raise ScheduleError(f"rank {first[0]}: {a} (position {first[1]}) must come before "
                                f"{b} (position {second[1]})")

    for s in range(S):
        for i in range(m):
            f = need(Kind.F, s, i)
            has_b, has_i, has_w = ((k, s, i) in where for k in (Kind.B, Kind.I, Kind.W))
            if has_b and (has_i or has_w):
                raise ScheduleError(f"stage {s} microbatch {i} has both {Action(s, Kind.B, i)} and a "
                                    f"split backward ({Action(s, Kind.I, i)}/{Action(s, Kind.W, i)})")
            if has_i or has_w:
                bwd_kind = Kind.I
                bwd = need(Kind.I, s, i, f" ({Action(s, Kind.W, i)} is scheduled)")
                w = need(Kind.W, s, i, f" ({Action(s, Kind.I, i)} is scheduled)")
                before(bwd, w, Action(s, Kind.I, i), Action(s, Kind.W, i))
            else:
                bwd_kind = Kind.B
                bwd = need(Kind.B, s, i, f" (or {Action(s, Kind.I, i)} and {Action(s, Kind.W, i)})")
            before(f, bwd, Action(s, Kind.F, i), Action(s, bwd_kind, i))
            if s + 1 < S and cross(s, s + 1):
                send = need(Kind.SEND_F, s, i, f" (stage {s + 1} on rank {rank_of(s + 1)} needs it)")
                before(f, send, Action(s, Kind.F, i), Action(s, Kind.SEND_F, i))
                recv = need(Kind.RECV_F, s + 1, i)
                before(recv, where[(Kind.F, s + 1, i)], Action(s + 1, Kind.RECV_F, i),
                       Action(s + 1, Kind.F, i))
            if s > 0 and cross(s, s - 1):
                send = need(Kind.SEND_B, s, i, f" (stage {s - 1} on rank {rank_of(s - 1)} needs it)")
                before(bwd, send, Action(s, bwd_kind, i), Action(s, Kind.SEND_B, i))
            if s + 1 < S and cross(s, s + 1):
                recv_b = need(Kind.RECV_B, s, i)
                before(recv_b, bwd, Action(s, Kind.RECV_B, i), Action(s, bwd_kind, i))

    # Note [Channel order]: per ordered rank pair, RECVs in the order of the SENDs.
    sent: Dict[Tuple[int, int], List[Action]] = {}
    posted: Dict[Tuple[int, int], List[Action]] = {}
    for r, acts in enumerate(schedule.per_rank):
        for a in acts:
            if a.kind is Kind.SEND_F:
                sent.setdefault((r, rank_of(a.stage + 1)), []).append(
                    Action(a.stage + 1, Kind.RECV_F, a.microbatch))
            elif a.kind is Kind.SEND_B:
                sent.setdefault((r, rank_of(a.stage - 1)), []).append(
                    Action(a.stage - 1, Kind.RECV_B, a.microbatch))
            elif a.kind is Kind.RECV_F:
                posted.setdefault((rank_of(a.stage - 1), r), []).append(a)
            elif a.kind is Kind.RECV_B:
                posted.setdefault((rank_of(a.stage + 1), r), []).append(a)
    for (src, dst), msgs in sent.items():
        got = posted.get((src, dst), [])
        for k, (x, y) in enumerate(zip(msgs, got)):
            if x != y:
                raise ScheduleError(
                    f"channel rank {src} -> rank {dst}: message {k} is sent as the input of {x} but "
                    f"rank {dst} posts {y} in that slot; messages match in issue order")


# --------------------------------------------------------------------------
# Timing.


def _describe(key: _Key) -> str:
    what, a = key
    if what == "done":
        return str(a)
    if what == "recv":
        return f"the receive {a} to complete (this rank's p2p ops run in issue order)"
    return f"the message for {a} ({'activation' if a.kind is Kind.RECV_F else 'gradient'})"


def timeline(schedule: Plan, duration: Callable[[Action], float],
             t_comm: Union[float, Callable[[Action], float]] = 0.0,
             serial_p2p: bool = False) -> List[List[Event]]:
    """Validate, then play the schedule; per rank, (start, end, action) in list order.

    `t_comm` is the time from a SEND to its message being usable: one number,
    or a function of the SEND action (the planner's per-rank send costs).

    Note [Serial p2p]: by default receives never hold anything back: both
    backends keep point-to-point transfers in flight (the CPU group's worker
    posts a transfer and moves on, Note [Point-to-point in flight] in
    csrc/cpu/engine.h; NCCL gives each direction of each rank pair its own
    communicator), so the builders post receives early (Note [Receive
    lookahead] in schedule.py). With ``serial_p2p`` a rank's sends and
    receives are carried out one at a time in the order it issues them, as a
    transport with one blocking queue per rank would: a receive holds back
    every send issued after it until its message has arrived. A schedule
    sound this way is sound on any transport; one that posts a receive before
    a send its peer is waiting for deadlocks here exactly as it would there.
    """
    validate(schedule)
    latency = t_comm if callable(t_comm) else (lambda a: t_comm)
    p, S = schedule.num_ranks, schedule.num_stages
    rank_of = schedule.stage_rank
    bwd = _backward_kinds(schedule)
    lists = schedule.per_rank
    # A compute waits for its message to be received: with serial p2p that is
    # the receive completing in turn ("recv"), otherwise just its arrival ("msg").
    got = "recv" if serial_p2p else "msg"

    def deps(a: Action, last_recv: Optional[Action]) -> Tuple[_Key, ...]:
        s, i = a.stage, a.microbatch
        if a.kind is Kind.F:
            if s == 0:
                return ()
            if rank_of(s - 1) == rank_of(s):
                return (("done", Action(s - 1, Kind.F, i)),)
            return ((got, Action(s, Kind.RECV_F, i)),)
        if a.kind in (Kind.B, Kind.I):
            own = ("done", Action(s, Kind.F, i))
            if s + 1 == S:
                return (own,)
            if rank_of(s + 1) == rank_of(s):
                return (own, ("done", Action(s + 1, bwd[(s + 1, i)], i)))
            return (own, (got, Action(s, Kind.RECV_B, i)))
        if a.kind is Kind.W:
            return (("done", Action(s, Kind.I, i)),)
        behind = (("recv", last_recv),) if serial_p2p and last_recv is not None else ()
        if a.kind is Kind.SEND_F:
            return (("done", Action(s, Kind.F, i)),) + behind
        if a.kind is Kind.SEND_B:
            return (("done", Action(s, bwd[(s, i)], i)),) + behind
        return ()  # RECV_*: posting a receive never waits

    dep_lists: List[List[Tuple[_Key, ...]]] = []
    recv_lists: List[List[Action]] = []
    for acts in lists:
        last: Optional[Action] = None
        dl: List[Tuple[_Key, ...]] = []
        rl: List[Action] = []
        for a in acts:
            dl.append(deps(a, last))
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                last = a
                rl.append(a)
        dep_lists.append(dl)
        recv_lists.append(rl)

    ready: Dict[_Key, float] = {}
    posted: Dict[Action, float] = {}
    recv_next = [0] * p       # receives of each rank completed so far, in issue order
    recv_clock = [0.0] * p    # when the last of them completed

    def complete_receives(r: int) -> None:
        rl = recv_lists[r]
        while recv_next[r] < len(rl):
            a = rl[recv_next[r]]
            if a not in posted or ("msg", a) not in ready:
                return
            recv_clock[r] = max(posted[a], ready[("msg", a)], recv_clock[r])
            ready[("recv", a)] = recv_clock[r]
            recv_next[r] += 1

    idx = [0] * p
    clock = [0.0] * p
    events: List[List[Event]] = [[] for _ in range(p)]
    remaining = sum(len(acts) for acts in lists)
    while remaining:
        progressed = False
        for r in range(p):
            acts, dl = lists[r], dep_lists[r]
            while idx[r] < len(acts):
                complete_receives(r)
                a, need = acts[idx[r]], dl[idx[r]]
                if any(d not in ready for d in need):
                    break
                start = max([clock[r]] + [ready[d] for d in need])
                end = start + duration(a)
                clock[r] = end
                events[r].append((start, end, a))
                if a.kind.is_compute:
                    ready[("done", a)] = end
                elif a.kind is Kind.SEND_F:
                    ready[("msg", Action(a.stage + 1, Kind.RECV_F, a.microbatch))] = end + latency(a)
                elif a.kind is Kind.SEND_B:
                    ready[("msg", Action(a.stage - 1, Kind.RECV_B, a.microbatch))] = end + latency(a)
                else:
                    posted[a] = end
                idx[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [f"rank {r} at {lists[r][idx[r]]} waits for "
                     + ", ".join(_describe(d) for d in dep_lists[r][idx[r]] if d not in ready)
                     for r in range(p) if idx[r] < len(lists[r])]
            raise DeadlockError(f"{schedule.name} deadlocks: " + "; ".join(stuck))
    return events
