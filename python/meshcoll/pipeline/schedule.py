"""Pipeline schedules as data.

A schedule is, for every pipeline rank, the ordered list of actions that rank
performs in one training step. Builders are plain functions that return a
`Schedule`; nothing here knows about processes, sockets or arrays, so every
schedule can be checked by `meshcoll.pipeline.simulate` without starting one.

Vocabulary (the same in the simulator and the executor):

* ``num_ranks`` (p) pipeline ranks; ``virtual_stages`` (v) model chunks per rank;
  ``num_stages`` = p * v model stages. The ``placement`` says which rank holds
  stage ``s``: ``"loop"`` puts it on rank ``s % p`` (Megatron's interleaved
  placement; with v = 1 stage s is simply rank s); ``"v"`` runs the chunks in a
  zigzag, down the ranks and back up (chunk c = s // p sits on rank s % p when c
  is even, on rank p - 1 - s % p when c is odd), so with v = 2 rank 0 holds the
  first and the last stage and rank p-1 hands stage p-1 to stage p locally
  (the V of ZB-V and DualPipeV; torch's ``style="v"``).
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

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Sequence, Tuple

# The vocabulary, defined in actions.py (which simulate.py shares) and named here as before.
from .actions import Action as Action, DeadlockError as DeadlockError, Kind as Kind
from .actions import ScheduleError as ScheduleError
from .simulate import timeline


def _loop_rank(stage: int, p: int) -> int:
    return stage % p


def _v_rank(stage: int, p: int) -> int:
    chunk, within = divmod(stage, p)
    return within if chunk % 2 == 0 else p - 1 - within


_PLACEMENTS: Mapping[str, Callable[[int, int], int]] = {"loop": _loop_rank, "v": _v_rank}


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists plus the shape of the pipeline they run."""

    name: str
    num_ranks: int
    virtual_stages: int
    num_microbatches: int
    per_rank: Tuple[Tuple[Action, ...], ...]
    placement: str = "loop"  # "loop" or "v": which rank holds each stage (module docstring)

    def __post_init__(self) -> None:
        if self.placement not in _PLACEMENTS:
            raise ScheduleError(f"{self.name}: placement must be one of {sorted(_PLACEMENTS)}, "
                                f"got {self.placement!r}")

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.virtual_stages

    def stage_rank(self, stage: int) -> int:
        return _PLACEMENTS[self.placement](stage, self.num_ranks)

    def stages_of(self, rank: int) -> List[int]:
        return [s for s in range(self.num_stages) if self.stage_rank(s) == rank]

    def __repr__(self) -> str:
        # Short: the action lists run to thousands of characters (``per_rank`` holds them).
        actions = sum(len(acts) for acts in self.per_rank)
        return (f"Schedule({self.name!r}, num_ranks={self.num_ranks}, "
                f"virtual_stages={self.virtual_stages}, num_microbatches={self.num_microbatches}, "
                f"placement={self.placement!r}, <{actions} actions in per_rank>)")

    def describe_placement(self) -> str:
        """How stages map to ranks, in words, for error messages."""
        if self.placement == "v":
            return (f"stages go down ranks 0..{self.num_ranks - 1} and back up in a V: "
                    f"{[self.stage_rank(s) for s in range(self.num_stages)]}")
        return f"stage s lives on rank s % {self.num_ranks}"

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


def _counted(stage: int, kind: Kind, counts: Dict[Tuple[int, Kind], int]) -> Action:
    """The next microbatch of `kind` on `stage`: each stage runs each kind of pass over its
    microbatches in order, so a builder only has to say which stage."""
    mb = counts.get((stage, kind), 0)
    counts[(stage, kind)] = mb + 1
    return Action(stage, kind, mb)


def interleaved_zero_bubble(num_stages: int, num_microbatches: int,
                            virtual_stages: int = 2) -> Schedule:
    """Interleaved zero bubble (ZB1P of Qi et al. 2023, as torch's ScheduleInterleavedZeroBubble).

    Interleaved 1F1B's depth-first chunk order, run in rounds of
    m / max(1, m // p) microbatches, with every B split into I and W. Rank r
    warms up with (v-1) * round + (p-1-r) forwards (one per hop to the last
    rank, where 1F1B needs two, because an I returns sooner than a B), then
    alternates F and I; its Ws start after r steady-state Is, the ZB-H1 rule
    (`zero_bubble`) applied per rank, and then one W follows every I. The
    pending Ws hold their stage inputs, so the stash peaks at warm-up + 1 plus
    the r deferred Ws: (v-1) * round + p on every rank, capped at v * m
    (checked by tests/unit/test_schedule.py). Needs m % max(1, m // p) == 0,
    as torch does.
    """
    p = _check_common(num_stages, num_microbatches, virtual_stages)
    v, m = virtual_stages, num_microbatches
    if v < 2:
        raise ScheduleError(f"interleaved_zero_bubble needs virtual_stages >= 2, got {v}; with one "
                            f"stage per rank use zero_bubble")
    rounds = max(1, m // p)
    if m % rounds:
        raise ScheduleError(f"interleaved_zero_bubble runs microbatches in rounds of about num_ranks: "
                            f"num_microbatches ({m}) must be a multiple of max(1, {m} // {p}) = "
                            f"{rounds} (as torch requires)")
    per_round, total = m // rounds, v * m
    orders = []
    for r in range(p):
        warmup = min((v - 1) * per_round + (p - 1 - r), total)
        def fwd(k: int) -> int:
            return ((k // per_round) % v) * p + r

        def bwd(k: int) -> int:
            return (v - 1 - ((k - warmup) // per_round) % v) * p + r
        counts: Dict[Tuple[int, Kind], int] = {}
        acts = [_counted(fwd(k), Kind.F, counts) for k in range(warmup)]
        i_steps: List[int] = []  # the step of every I so far; the Ws follow in this order
        for k in range(warmup, total + warmup):
            if k < total:
                acts.append(_counted(fwd(k), Kind.F, counts))
            acts.append(_counted(bwd(k), Kind.I, counts))
            i_steps.append(k)
            if k - warmup >= r:
                acts.append(_counted(bwd(i_steps[len(i_steps) - 1 - r]), Kind.W, counts))
        acts += [_counted(bwd(k), Kind.W, counts) for k in i_steps[max(0, len(i_steps) - r):]]
        orders.append(acts)
    return from_compute_orders("interleaved_zero_bubble", orders, m, v)


def _v_pair(name: str, num_stages: int, num_microbatches: int, virtual_stages: int) -> Tuple[int, int]:
    p = _check_common(num_stages, num_microbatches, virtual_stages)
    if virtual_stages != 2:
        raise ScheduleError(f"{name} runs exactly two stages per rank in a V (virtual_stages=2), got "
                            f"virtual_stages={virtual_stages}")
    return p, num_microbatches


def zero_bubble_v(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """ZB-V (Qi et al. 2023, section 6; torch's ScheduleZBVZeroBubble): two stages per rank in a V.

    Rank r holds stage r (chunk 0) and stage 2p-1-r (chunk 1), so the loss
    stage sits on rank 0 beside the input stage, and the turn of the V (stages
    p-1, p) hands over on rank p-1 without a message. Warm-up: 2(p-r)-1
    chunk-0 forwards, r pairs of chunk-1 and chunk-0 forwards, then p-r rounds
    of F, I, W on chunk 1; steady state: F, I, W on chunk 0 then on chunk 1;
    cool-down: Is first, then the Ws. With t_f = t_I = t_w the bubble is only
    the ramp. The stash peaks at min(2p, m + 1 + r, 2m) activations on rank r:
    2p everywhere once m >= 2p - 1, against interleaved 1F1B's
    2(p-1-r) + p + 1 (3p - 1 on rank 0).
    """
    p, m = _v_pair("zero_bubble_v", num_stages, num_microbatches, virtual_stages)
    # Torch plans for at least 2p-1 microbatches, so that the V fills, and
    # then drops the ones that do not exist; so do we, to keep its order.
    n = max(2 * p - 1, m)
    orders = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        counts: Dict[Tuple[int, Kind], int] = {}
        acts: List[Action] = []

        def add(stage: int, kind: Kind) -> None:
            acts.append(_counted(stage, kind, counts))

        def n_f(stage: int) -> int:
            return counts.get((stage, Kind.F), 0)
        for _ in range(2 * (p - r) - 1):
            add(c0, Kind.F)
        for _ in range(r):
            add(c1, Kind.F)
            add(c0, Kind.F)
        for _ in range(p - r):
            add(c1, Kind.F)
            add(c1, Kind.I)
            add(c1, Kind.W)
        while n_f(c1) < n_f(c0) or n_f(c0) < n:
            if n_f(c0) < n:
                add(c0, Kind.F)
            add(c0, Kind.I)
            add(c0, Kind.W)
            add(c1, Kind.F)
            add(c1, Kind.I)
            add(c1, Kind.W)
        for _ in range(r):
            add(c0, Kind.I)
            add(c1, Kind.I)
        for _ in range(p - r):
            add(c0, Kind.I)
            add(c0, Kind.W)
        for stage in (c1, c0):
            while counts.get((stage, Kind.W), 0) < n:
                add(stage, Kind.W)
        orders.append([a for a in acts if a.microbatch < m])
    return from_compute_orders("zero_bubble_v", orders, m, 2, placement="v")


def dualpipe_v(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V; torch's ScheduleDualPipeV).

    Same placement as ZB-V. Its steady state pairs the forward of one chunk
    with the full backward of the other (F0 B1, F1 B0), which DeepSeek runs as
    one overlapped step to hide MoE all-to-all; there is no such overlap
    inside a stage here, so each pair runs as F then B, the order torch's
    OVERLAP_F_B action runs its halves in. Only the ramps use split
    backwards: I then a deferred W in the warm-up and in the second half of
    the cool-down. The stash peaks at 2p + 1 activations on every rank, one
    more than ZB-V (rank r's 2(p-r-1) + 2(r+1) warm-up forwards, plus the
    chunk-1 forward that runs before the first W frees anything). Needs
    m >= 2p, as torch does.
    """
    p, m = _v_pair("dualpipe_v", num_stages, num_microbatches, virtual_stages)
    if m < 2 * p:
        raise ScheduleError(f"dualpipe_v needs num_microbatches >= num_stages ({2 * p}), got {m} "
                            f"(as torch requires)")
    orders = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        counts: Dict[Tuple[int, Kind], int] = {}
        pending_w: List[Action] = []  # Ws of split backwards, oldest first
        acts: List[Action] = []

        def add(stage: int, kind: Kind) -> None:
            # A full B takes the microbatch number from the I counter: the two
            # share one sequence of backwards per stage.
            key = Kind.I if kind is Kind.B else kind
            a = _counted(stage, key, counts)
            acts.append(Action(stage, kind, a.microbatch))
            if kind is Kind.I:
                pending_w.append(Action(stage, Kind.W, a.microbatch))

        def w_if_pending() -> None:
            if pending_w:
                acts.append(pending_w.pop(0))

        # Torch's (and DeepSeek's) eight steps. Warm-up: chunk-0 forwards until the V's
        # far side has work, then F0 F1 pairs, then I1 W F1 (zero-bubble ramp).
        for _ in range((p - r - 1) * 2):
            add(c0, Kind.F)
        for _ in range(r + 1):
            add(c0, Kind.F)
            add(c1, Kind.F)
        for _ in range(p - r - 1):
            add(c1, Kind.I)
            w_if_pending()
            add(c1, Kind.F)
        # Steady state: F0 B1, F1 B0 (each pair one OVERLAP_F_B in torch).
        for _ in range(m - 2 * p + r + 1):
            add(c0, Kind.F)
            add(c1, Kind.B)
            add(c1, Kind.F)
            add(c0, Kind.B)
        # Cool-down: B1 then F1 B0 while chunk 1 still has forwards, then B1 B0,
        # switching to split backwards half way through (odd ranks one pass
        # earlier), so that the pending Ws fill the drain's bubbles.
        for _ in range(p - r - 1):
            add(c1, Kind.B)
            add(c1, Kind.F)
            add(c0, Kind.B)
        split = False
        steps = r + 1
        for i in range(steps):
            if i == steps // 2 and r % 2 == 1:
                split = True
            add(c1, Kind.I if split else Kind.B)
            if i == steps // 2 and r % 2 == 0:
                split = True
            add(c0, Kind.I if split else Kind.B)
        for _ in range(p - r - 1):
            w_if_pending()
            add(c0, Kind.I if split else Kind.B)
        for _ in range(r + 1):
            w_if_pending()
        orders.append(acts)
    return from_compute_orders("dualpipe_v", orders, m, 2, placement="v")


# Name -> builder; the one lookup table the issue allows. Read-only on purpose.
SCHEDULES: Mapping[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zero_bubble": zero_bubble,
    "interleaved_zero_bubble": interleaved_zero_bubble,
    "zero_bubble_v": zero_bubble_v,
    "dualpipe_v": dualpipe_v,
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
                        virtual_stages: int = 1, placement: str = "loop",
                        recv_lookahead: int = 1) -> Schedule:
    """A Schedule from per-rank compute orders (F/B/I/W only; rank = list index).

    The built-in schedules are made this way, and so can custom ones: the
    SEND/RECV actions are derived, not written by hand (Note [Receive
    lookahead] says where the RECVs go). Nothing is checked here;
    `simulate.validate` (or `simulate`) says whether the result is sound.
    """
    if placement not in _PLACEMENTS:
        raise ScheduleError(f"{name}: placement must be one of {sorted(_PLACEMENTS)}, got {placement!r}")
    if not isinstance(recv_lookahead, int) or recv_lookahead < 0:
        raise ScheduleError(f"{name}: recv_lookahead must be an int >= 0, got {recv_lookahead!r}")
    for r, acts in enumerate(orders):
        for a in acts:
            if not a.kind.is_compute:
                raise ScheduleError(f"rank {r}: {a} is a communication action; give compute actions "
                                    f"only, the sends and receives are derived")
    p = len(orders)
    rank_of = lambda s: _PLACEMENTS[placement](s, p)  # noqa: E731
    lists = _add_comms(orders, rank_of, virtual_stages * p, recv_lookahead)
    return Schedule(name, p, virtual_stages, num_microbatches, tuple(tuple(acts) for acts in lists),
                    placement)


def _add_comms(orders: Sequence[Sequence[Action]], rank_of: Callable[[int], int], num_stages: int,
               lookahead: int) -> List[List[Action]]:
    """Insert SENDs right after their producer and RECVs `lookahead` computes before their consumer.

    Note [Receive lookahead]: a RECV only posts a receive; the transfer then
    progresses while the rank computes (point-to-point transfers are in
    flight on both backends: the CPU group's worker posts them and moves on,
    and on NCCL each direction of each rank pair has its own communicator and
    stream, Note [Channels on NCCL] in executor.py). A receive posted just
    before its consumer leaves the whole transfer on the critical path once
    the sender's data is larger than what the transport buffers; posted
    `lookahead` computes earlier, the transfer overlaps those computes. More
    lookahead buys nothing once it covers the transfer and costs one receive
    buffer per message posted early, so the builders use 1. With 0 every
    RECV sits right before its consumer, the only placement that is also sound
    on a transport that runs a rank's p2p ops one at a time in issue order
    (Note [Serial p2p] in simulate.py).

    RECVs are emitted in each channel's send order (Note [Channel order]): a
    RECV needed ahead of an earlier message on its channel brings that one's
    RECV with it, which costs nothing, since that message arrives first anyway.
    """
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

    # The message stream of every channel, named by the RECV that consumes it.
    channel: Dict[Tuple[int, int], List[Action]] = {}
    for src, acts in enumerate(orders):
        for a in acts:
            for x in sends_after(a):
                if x.kind is Kind.SEND_F:
                    channel.setdefault((src, rank_of(a.stage + 1)), []).append(
                        Action(a.stage + 1, Kind.RECV_F, a.microbatch))
                else:
                    channel.setdefault((src, rank_of(a.stage - 1)), []).append(
                        Action(a.stage - 1, Kind.RECV_B, a.microbatch))

    result = []
    for dst, acts in enumerate(orders):
        posted: Dict[int, int] = {}  # peer -> how many of its messages are posted
        orphans: set[Action] = set()
        out: List[Action] = []

        def post(a: Action) -> None:
            for peer, recv in needs(a):
                stream = channel.get((peer, dst), [])
                start = posted.get(peer, 0)
                if recv in stream[:start]:
                    continue  # already posted ahead of an out-of-order need
                if recv not in stream[start:]:
                    # Nobody sends it; emit the RECV alone (once) so that
                    # validate() names the missing SEND.
                    if recv not in orphans:
                        orphans.add(recv)
                        out.append(recv)
                    continue
                end = stream.index(recv, start) + 1
                out.extend(stream[start:end])
                posted[peer] = end

        for k, a in enumerate(acts):
            # Before compute k: the receives of computes k .. k + lookahead.
            for ahead in acts[k:k + lookahead + 1]:
                post(ahead)
            out.append(a)
            out.extend(sends_after(a))
        result.append(out)
    return result
