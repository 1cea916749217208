"""Pipeline schedules as data.

A schedule is, for every pipeline rank, the ordered list of actions that rank
performs in one training step. Builders are plain functions that return a
`Schedule`; nothing here knows about processes, sockets or arrays, so every
schedule can be checked by `meshcoll.pipeline.simulate` without starting one.

Vocabulary (the same in the simulator and the executor):

* ``num_ranks`` (p) pipeline ranks; ``virtual_stages`` (v) model chunks per rank;
  ``num_stages`` = p * v model stages. Stage ``s`` lives on rank ``s % p``
  (Megatron's interleaved placement; with v = 1 stage s is simply rank s).
* ``num_microbatches`` (m) microbatches per step.
* Compute kinds: ``F`` forward, ``B`` full backward, and for zero-bubble
  schedules ``I`` (gradient w.r.t. the stage input, on the critical path) and
  ``W`` (gradient w.r.t. the stage weights, free to move into bubbles).
* Communication kinds, present only between stages on different ranks:
  ``SEND_F s`` sends stage s's output to stage s+1, ``RECV_F s`` posts the
  receive of stage s's input from stage s-1, ``SEND_B s`` sends the gradient of
  stage s's input to stage s-1, ``RECV_B s`` posts the receive of the gradient of
  stage s's output from stage s+1. Sends are non-blocking; a RECV only *posts* a
  receive, the compute that consumes it is where a rank waits.

Note [Channel order]: the transport matches the messages between two ranks in
issue order, so on every ordered pair (a, b) the RECVs on b must appear in the
order a issues the matching SENDs. `_add_comms` builds the RECV positions from
the senders' lists to guarantee this (posting a receive early when a later
message is needed first), and the simulator checks it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Sequence, Tuple


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


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists plus the shape of the pipeline they run."""

    name: str
    num_ranks: int
    virtual_stages: int
    num_microbatches: int
    per_rank: Tuple[Tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.virtual_stages

    def stage_rank(self, stage: int) -> int:
        return stage % self.num_ranks

    def stages_of(self, rank: int) -> List[int]:
        return list(range(rank, self.num_stages, self.num_ranks))

    def actions(self, rank: int) -> List[Action]:
        if not 0 <= rank < self.num_ranks:
            raise ScheduleError(f"rank {rank} out of range for a {self.num_ranks}-rank schedule")
        return list(self.per_rank[rank])

    def compute_actions(self, rank: int) -> List[Action]:
        return [a for a in self.actions(rank) if a.kind.is_compute]

    @property
    def uses_split_backward(self) -> bool:
        return any(a.kind is Kind.I for acts in self.per_rank for a in acts)

    def grid(self, timed: bool = True) -> str:
        """Step x rank table of the compute actions.

        With ``timed`` the steps come from a unit-cost simulation (every compute
        action one step, communication free), so idle cells show the bubble; a
        schedule that does not simulate falls back to list order with the reason.
        Without ``timed`` step i is simply each rank's i-th compute action.
        """
        header = (f"# {self.name}  ranks={self.num_ranks}  virtual_stages={self.virtual_stages}"
                  f"  microbatches={self.num_microbatches}")
        columns: List[Dict[int, str]] = []
        if timed:
            # Imported here: simulate imports this module, and a schedule must
            # stay printable without anything else.
            from .simulate import timeline

            try:
                lines = timeline(self, lambda a: 1.0 if a.kind.is_compute else 0.0, t_comm=0.0)
                columns = [{int(round(start)): str(a) for start, _, a in events if a.kind.is_compute}
                           for events in lines]
                header += "  (unit-time steps)"
            except ScheduleError as e:
                header += f"  (list order; does not simulate: {e})"
                timed = False
        if not timed:
            columns = [dict(enumerate(str(a) for a in self.compute_actions(r)))
                       for r in range(self.num_ranks)]
        steps = 1 + max((max(c) for c in columns if c), default=-1)
        width = max([len(f"rank{self.num_ranks - 1}")] + [len(v) for c in columns for v in c.values()])
        out = [header, "step " + " ".join(f"{'rank' + str(r):>{width}}" for r in range(self.num_ranks))]
        for t in range(steps):
            out.append(f"{t:>4} " + " ".join(f"{c.get(t, '.'):>{width}}" for c in columns))
        return "\n".join(out)

    def __str__(self) -> str:
        return self.grid()


# --------------------------------------------------------------------------
# Builders. Each works out the compute order of every rank and lets
# `from_compute_orders` derive the communication actions.


def _check_common(num_stages: int, num_microbatches: int, virtual_stages: int) -> int:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} must be a positive int, got {value!r}")
    if num_stages % virtual_stages:
        raise ScheduleError(
            f"num_stages ({num_stages}, total model stages) must be a multiple of "
            f"virtual_stages ({virtual_stages}); ranks = num_stages / virtual_stages")
    return num_stages // virtual_stages


def _no_virtual(name: str, virtual_stages: int) -> None:
    if virtual_stages != 1:
        raise ScheduleError(f"{name} runs one stage per rank (virtual_stages=1), got "
                            f"virtual_stages={virtual_stages}; use interleaved_1f1b")


def gpipe(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """GPipe: all forwards, then all backwards. Stashes all m activations."""
    p = _check_common(num_stages, num_microbatches, virtual_stages)
    _no_virtual("gpipe", virtual_stages)
    m = num_microbatches
    orders = [[Action(r, Kind.F, i) for i in range(m)] + [Action(r, Kind.B, i) for i in range(m)]
              for r in range(p)]
    return from_compute_orders("gpipe", orders, m, 1)


def _one_f_one_b_order(rank: int, p: int, m: int) -> Tuple[int, List[Tuple[str, int]]]:
    """PipeDream-flush order of one rank as ('F'|'B', microbatch) pairs.

    Rank r runs p-r-1 warm-up forwards so that the last stage can start its
    first backward as soon as microbatch 0 reaches it; then it alternates one
    forward and one backward, which caps its stash at p-r activations; the
    cool-down drains the remaining backwards.
    """
    warmup = min(p - rank - 1, m)
    order = [("F", i) for i in range(warmup)]
    for k in range(m - warmup):
        order += [("F", warmup + k), ("B", k)]
    order += [("B", k) for k in range(m - warmup, m)]
    return warmup, order


def one_f_one_b(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): same bubble as GPipe, at most p stashed activations."""
    p = _check_common(num_stages, num_microbatches, virtual_stages)
    _no_virtual("1f1b", virtual_stages)
    m = num_microbatches
    orders = [[Action(r, Kind(k), i) for k, i in _one_f_one_b_order(r, p, m)[1]] for r in range(p)]
    return from_compute_orders("1f1b", orders, m, 1)


def interleaved_1f1b(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Megatron's interleaved 1F1B: v model chunks per rank, depth-first order.

    Forwards run in groups of p microbatches per chunk: chunk 0 for
    microbatches 0..p-1, then chunk 1 for the same microbatches, ... then
    chunk 0 for the next p. Backwards run the chunks in reverse. Megatron's
    warm-up is 2(p-r-1) + (v-1)p forwards, enough for the first backward of the
    last chunk to have its input. Like Megatron this needs m % p == 0, so that
    every group of p microbatches is full; the bubble becomes (p-1)/(v*m + p-1).
    """
    p = _check_common(num_stages, num_microbatches, virtual_stages)
    v, m = virtual_stages, num_microbatches
    if m % p:
        raise ScheduleError(
            f"interleaved_1f1b needs num_microbatches % num_ranks == 0 (as Megatron does), "
            f"got num_microbatches={m}, num_ranks={p} (num_stages={num_stages}, "
            f"virtual_stages={v})")
    total = m * v

    def unit(k: int, forward: bool) -> Tuple[int, int]:
        # The k-th forward (or backward) of a rank: which chunk, which microbatch.
        group, within = divmod(k, p * v)
        chunk = within // p
        if not forward:
            chunk = v - 1 - chunk
        return chunk, group * p + within % p

    orders = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        seq: List[Tuple[Kind, int]] = [(Kind.F, k) for k in range(warmup)]
        for k in range(total - warmup):
            seq += [(Kind.F, warmup + k), (Kind.B, k)]
        seq += [(Kind.B, k) for k in range(total - warmup, total)]
        acts = []
        for kind, k in seq:
            chunk, mb = unit(k, kind is Kind.F)
            acts.append(Action(chunk * p + r, kind, mb))
        orders.append(acts)
    return from_compute_orders("interleaved_1f1b", orders, m, v)


def zero_bubble(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023).

    The 1F1B order with each B split into I (input gradient, sent upstream at
    once) and W (weight gradient, needed by nobody else). Rank r defers its W
    passes by r microbatches: its stash then peaks at (p-r) + r = p activations,
    the same bound 1F1B has on rank 0 (ZB-H1's memory rule). In the cool-down
    each I is followed by one pending W, which fills the wait for the next
    gradient, and the leftover Ws run last. Because an I is cheaper than a B,
    the backward wave climbs the pipeline faster, which is what shrinks the
    bubble: with m >= p the simulated makespan is the paper's
    m(t_f + t_b) + (p-1)(t_f + t_I - t_w), t_I = t_b - t_w; with t_w = 0 the
    timing is exactly 1F1B's.
    """
    p = _check_common(num_stages, num_microbatches, virtual_stages)
    _no_virtual("zero_bubble", virtual_stages)
    m = num_microbatches
    orders = []
    for r in range(p):
        warmup, base = _one_f_one_b_order(r, p, m)
        lag = min(r, m)
        acts: List[Action] = []
        next_w = 0  # Ws run in microbatch order, each after its I
        done_i = 0
        cooldown_from = 2 * m - warmup  # index in `base` where the trailing Bs start
        for idx, (k, i) in enumerate(base):
            if k == "F":
                acts.append(Action(r, Kind.F, i))
                continue
            acts.append(Action(r, Kind.I, i))
            done_i += 1
            in_cooldown = idx >= cooldown_from
            # Steady state: keep `lag` Ws outstanding. Cool-down: one W per I.
            if (in_cooldown or done_i - next_w > lag) and next_w < done_i:
                acts.append(Action(r, Kind.W, next_w))
                next_w += 1
        acts += [Action(r, Kind.W, i) for i in range(next_w, m)]
        orders.append(acts)
    return from_compute_orders("zero_bubble", orders, m, 1)


# Name -> builder; the one lookup table the issue allows. Read-only on purpose.
SCHEDULES: Mapping[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zero_bubble": zero_bubble,
}


def make_schedule(name: str, num_stages: int, num_microbatches: int,
                  virtual_stages: int = 1) -> Schedule:
    """Build a schedule by name.

    `num_stages` counts model stages; the pipeline has num_stages / virtual_stages
    ranks (with virtual_stages=1, one stage per rank).
    """
    try:
        build = SCHEDULES[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}") from None
    return build(num_stages, num_microbatches, virtual_stages)


# --------------------------------------------------------------------------
# Communication insertion.


def from_compute_orders(name: str, orders: Sequence[Sequence[Action]], num_microbatches: int,
                        virtual_stages: int = 1) -> Schedule:
    """A Schedule from per-rank compute orders (F/B/I/W only; rank = list index).

    The built-in schedules are made this way, and so can custom ones: the
    SEND/RECV actions are derived, not written by hand. Nothing is checked
    here; `simulate.validate` (or `simulate`) says whether the result is sound.
    """
    for r, acts in enumerate(orders):
        for a in acts:
            if not a.kind.is_compute:
                raise ScheduleError(f"rank {r}: {a} is a communication action; give compute actions "
                                    f"only, the sends and receives are derived")
    p = len(orders)
    return Schedule(name, p, virtual_stages, num_microbatches,
                    tuple(tuple(acts) for acts in _add_comms(orders, p, virtual_stages * p)))


def _add_comms(orders: Sequence[Sequence[Action]], p: int, num_stages: int) -> List[List[Action]]:
    """Insert SENDs right after their producer and RECVs right before their consumer.

    A RECV is posted no earlier than the compute that waits for it. Posting one
    compute ahead would overlap the receive with that compute, but on a group
    that carries out p2p ops one at a time in issue order (Note [Serial p2p]
    in simulate.py) the early receive holds back the send the intervening
    compute issues, and 1F1B's ranks then wait on each other for ever. RECVs
    are emitted in each channel's send order (Note [Channel order]): a RECV
    needed ahead of an earlier message on its channel brings that one's RECV
    with it, which costs nothing, since that message arrives first anyway.
    """
    rank_of = lambda s: s % p  # noqa: E731

    def sends_after(a: Action) -> List[Action]:
        if a.kind is Kind.F and a.stage + 1 < num_stages and rank_of(a.stage + 1) != rank_of(a.stage):
            return [Action(a.stage, Kind.SEND_F, a.microbatch)]
        if a.kind in (Kind.B, Kind.I) and a.stage > 0 and rank_of(a.stage - 1) != rank_of(a.stage):
            return [Action(a.stage, Kind.SEND_B, a.microbatch)]
        return []

    def needs(a: Action) -> List[Tuple[int, Action]]:
        # (peer, RECV action) that compute `a` consumes.
        if a.kind is Kind.F and a.stage > 0 and rank_of(a.stage - 1) != rank_of(a.stage):
            return [(rank_of(a.stage - 1), Action(a.stage, Kind.RECV_F, a.microbatch))]
        if (a.kind in (Kind.B, Kind.I) and a.stage + 1 < num_stages
                and rank_of(a.stage + 1) != rank_of(a.stage)):
            return [(rank_of(a.stage + 1), Action(a.stage, Kind.RECV_B, a.microbatch))]
        return []

    with_sends = [[x for a in acts for x in [a] + sends_after(a)] for acts in orders]

    # The message stream of every channel, named by the RECV that consumes it.
    channel: Dict[Tuple[int, int], List[Action]] = {}
    for src, acts in enumerate(with_sends):
        for a in acts:
            if a.kind is Kind.SEND_F:
                channel.setdefault((src, rank_of(a.stage + 1)), []).append(
                    Action(a.stage + 1, Kind.RECV_F, a.microbatch))
            elif a.kind is Kind.SEND_B:
                channel.setdefault((src, rank_of(a.stage - 1)), []).append(
                    Action(a.stage - 1, Kind.RECV_B, a.microbatch))

    result = []
    for dst, acts in enumerate(with_sends):
        posted: Dict[int, int] = {}  # peer -> how many of its messages are posted
        out: List[Action] = []
        for a in acts:
            for peer, recv in needs(a) if a.kind.is_compute else ():
                stream = channel.get((peer, dst), [])
                start = posted.get(peer, 0)
                if recv in stream[:start]:
                    continue  # already posted ahead of an out-of-order need
                if recv not in stream[start:]:
                    # Nobody sends it; emit the RECV alone so that validate()
                    # names the missing SEND.
                    out.append(recv)
                    continue
                end = stream.index(recv, start) + 1
                out.extend(stream[start:end])
                posted[peer] = end
            out.append(a)
        result.append(out)
    return result
