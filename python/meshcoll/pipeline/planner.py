"""Choose a pipeline schedule for a model: simulate every schedule that applies, rank by makespan.

    from meshcoll.pipeline import plan
    for e in plan(4, 8, {"forward": 1.0, "backward_input": 1.0, "backward_weight": 0.8,
                         "send": 0.05}, memory_limit=4):
        print(e.name, e.virtual_stages, e.makespan, e.bubble, e.peak_memory, e.over_limit)

The command line (``meshcoll-plan --help``, planner_cli.py) prints the same
ranking as a table and draws every schedule's timeline.

Units. Here ``num_stages`` is the depth of the pipeline, the number of ranks
the model is split over (``make_schedule`` counts model stages instead; the two
agree with one stage per rank). Costs are one rank's share of the model for one
microbatch: ``forward``, ``backward_input`` (the gradient w.r.t. its input,
on the critical path), ``backward_weight`` (the gradient w.r.t. its weights)
and ``send`` (one activation or gradient message between ranks, from the
send to its data being usable). Each is one number or a list with one per
rank. A schedule with v stages per rank (interleaved, V) cuts every rank's
share into v equal chunks costing 1/v each; a schedule with plain B runs
backward_input + backward_weight as one pass. Peak memory is in the same unit:
one microbatch's stashed activations for a rank's whole share, so a chunk's
stash counts 1/v (1F1B peaks at p, ZB-V at 2p chunks = p, GPipe at m).

Every schedule is played by `timeline` (the executor's own rules, transfers in
flight, Note [Serial p2p]); nothing runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .schedule import Action, Kind, Schedule, ScheduleError, _check_common, make_schedule
from .simulate import Event, stash_peak, timeline

__all__ = ["COST_KEYS", "PlanEntry", "plan", "candidates", "format_table", "ascii_timeline", "draw"]

COST_KEYS = ("forward", "backward_input", "backward_weight", "send")

# (name, virtual stages) the planner tries, in the order ties are listed.
_TRIED = (("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2),
          ("interleaved_1f1b", 4), ("interleaved_zero_bubble", 2), ("interleaved_zero_bubble", 4),
          ("zero_bubble_v", 2), ("dualpipe_v", 2))

Cost = Union[float, Sequence[float]]


@dataclass(frozen=True)
class PlanEntry:
    """One simulated schedule. `bubble` is the mean over ranks of idle time / makespan;
    `peak_memory` the largest stash of any rank, in rank shares (module docstring)."""

    name: str
    virtual_stages: int
    makespan: float
    bubble: float
    peak_memory: float
    over_limit: bool
    schedule: Schedule
    events: Tuple[Tuple[Event, ...], ...]

    def __repr__(self) -> str:
        # Without the events, which run to tens of kilobytes.
        return (f"PlanEntry({self.name!r}, virtual_stages={self.virtual_stages}, "
                f"makespan={self.makespan:.6g}, bubble={self.bubble:.4f}, "
                f"peak_memory={self.peak_memory:.4g}, over_limit={self.over_limit})")


def _per_rank(costs: Mapping[str, Cost], p: int) -> Dict[str, Tuple[float, ...]]:
    unknown = sorted(set(costs) - set(COST_KEYS))
    missing = [k for k in COST_KEYS if k not in costs]
    if unknown or missing:
        raise ValueError(f"plan: costs needs exactly the keys {list(COST_KEYS)}; "
                         f"missing {missing}, unknown {unknown}")
    out = {}
    for key in COST_KEYS:
        value = costs[key]
        values = [value] * p if isinstance(value, (int, float)) else list(value)
        if len(values) != p:
            raise ValueError(f"plan: costs[{key!r}] has {len(values)} values for {p} pipeline ranks; "
                             f"give one number, or one per rank")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"plan: costs[{key!r}] must be finite numbers >= 0, got {value!r}")
        out[key] = tuple(float(v) for v in values)
    if all(f == 0 for f in out["forward"]) and all(b == 0 for b in out["backward_input"]):
        raise ValueError("plan: forward and backward_input are all 0; give the measured or "
                         "estimated times of a rank's share of the model")
    return out


def candidates(num_stages: int, num_microbatches: int) -> Tuple[List[Schedule], List[str]]:
    """Every schedule the planner tries for `num_stages` ranks and the reasons the others don't apply."""
    built, skipped = [], []
    for name, v in _TRIED:
        try:
            built.append(make_schedule(name, num_stages * v, num_microbatches, virtual_stages=v))
        except ScheduleError as e:
            skipped.append(f"{name} v={v}: {e}")
    return built, skipped


def _play(schedule: Schedule, c: Dict[str, Tuple[float, ...]]) -> Tuple[Tuple[Event, ...], ...]:
    v, rank = schedule.virtual_stages, schedule.stage_rank
    share = {Kind.F: ("forward",), Kind.I: ("backward_input",), Kind.W: ("backward_weight",),
             Kind.B: ("backward_input", "backward_weight")}

    def duration(a: Action) -> float:
        keys = share.get(a.kind, ())
        return sum(c[k][rank(a.stage)] for k in keys) / v

    lines = timeline(schedule, duration, lambda a: c["send"][rank(a.stage)])
    return tuple(tuple(e) for e in lines)


def plan(num_stages: int, num_microbatches: int, costs: Mapping[str, Cost],
         memory_limit: Optional[float] = None) -> List[PlanEntry]:
    """Simulate every schedule that applies to `num_stages` ranks and `num_microbatches`
    microbatches with `costs` (module docstring); return them fastest first. Entries whose
    peak memory exceeds `memory_limit` (rank shares) stay in the ranking, marked over_limit."""
    if memory_limit is not None and not memory_limit > 0:
        raise ValueError(f"plan: memory_limit is in microbatch activations of a rank's share and "
                         f"must be > 0, got {memory_limit!r}")
    try:
        _check_common(num_stages, num_microbatches, 1)
    except ScheduleError as e:
        raise ScheduleError(f"plan: {e}") from None
    c = _per_rank(costs, num_stages)
    schedules, _ = candidates(num_stages, num_microbatches)
    entries = []
    for s in schedules:
        events = _play(s, c)
        makespan = max((end for line in events for _, end, _ in line), default=0.0)
        busy = [sum(e - b for b, e, a in line if a.kind.is_compute) for line in events]
        bubble = sum((makespan - x) / makespan for x in busy) / len(busy) if makespan > 0 else 0.0
        peak = max(stash_peak(s, r) for r in range(s.num_ranks)) / s.virtual_stages
        over = memory_limit is not None and peak > memory_limit + 1e-9
        entries.append(PlanEntry(s.name, s.virtual_stages, makespan, bubble, peak, over, s, events))
    # Stable sort: ties keep _TRIED's order (simpler schedules first).
    return sorted(entries, key=lambda e: (round(e.makespan, 9), e.peak_memory))


def _fmt_cost(values: Tuple[float, ...]) -> str:
    return f"{values[0]:g}" if len(set(values)) == 1 else ",".join(f"{v:g}" for v in values)


def format_table(entries: Sequence[PlanEntry], num_stages: int, num_microbatches: int,
                 costs: Mapping[str, Cost], memory_limit: Optional[float] = None) -> str:
    """The ranking as a table in the benchmarks' style."""
    c = _per_rank(costs, num_stages)
    head = "  ".join(f"{k}={_fmt_cost(c[k])}" for k in COST_KEYS)
    limit = "none" if memory_limit is None else f"{memory_limit:g}"
    lines = [f"# meshcoll pipeline plan  ranks={num_stages}  microbatches={num_microbatches}  {head}"
             f"  memory_limit={limit}",
             f"# {'order':>4}  {'schedule':<24} {'v':>2} {'makespan':>10} {'bubble':>7} "
             f"{'peak_mem':>9}  fits"]
    for i, e in enumerate(entries, 1):
        fits = "OVER" if e.over_limit else "yes"
        lines.append(f"  {i:>5}  {e.name:<24} {e.virtual_stages:>2} {e.makespan:>10.3f} "
                     f"{e.bubble:>7.3f} {e.peak_memory:>9.2f}  {fits}")
    return "\n".join(lines)


_PASS_NAMES = {Kind.F: "forward", Kind.B: "backward", Kind.I: "backward (input gradient)",
               Kind.W: "backward (weight gradient)"}


def ascii_timeline(entry: PlanEntry, width: int = 100) -> str:
    """A header, a legend, then per rank one line of `width` characters: F/B/I/W for the
    passes of chunk 0 (upper case) and later chunks (lower case), '.' idle. Text for
    terminals without matplotlib."""
    span = entry.makespan or 1.0
    kinds = {a.kind for line in entry.events for _, _, a in line if a.kind.is_compute}
    legend = [f"{k.value} {_PASS_NAMES[k]}" for k in _PASS_NAMES if k in kinds] + [". idle"]
    if entry.virtual_stages > 1:
        legend.append("lower case: the rank's later chunks")
    out = [f"# {entry.name} v={entry.virtual_stages}  makespan={entry.makespan:.3f}  "
           f"bubble={entry.bubble:.3f}  (one character = {span / width:.3g})",
           "# " + ", ".join(legend)]
    for r, line in enumerate(entry.events):
        row = ["."] * width
        for start, end, a in line:
            if not a.kind.is_compute or end <= start:
                continue
            ch = a.kind.value if a.stage < entry.schedule.num_ranks else a.kind.value.lower()
            lo = int(round(start / span * width))
            hi = max(lo + 1, int(round(end / span * width)))
            for x in range(lo, min(hi, width)):
                row[x] = ch
        out.append(f"rank{r:<3} {''.join(row)}")
    return "\n".join(out)


_COLOURS = {Kind.F: "#4c72b0", Kind.B: "#8172b2", Kind.I: "#dd8452", Kind.W: "#55a868"}


def draw(entry: PlanEntry, path: str) -> None:
    """A PNG of `entry`'s timeline: one row per rank, a block per F/B/I/W coloured by kind,
    labelled stage:microbatch where it fits. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p = entry.schedule.num_ranks
    blocks = max(sum(a.kind.is_compute for _, _, a in line) for line in entry.events)
    width = max(8.0, min(30.0, 0.3 * blocks))  # about 0.3 inch per pass on the busiest rank
    inch_per_unit = 0.8 * width / (entry.makespan or 1.0)
    fig, ax = plt.subplots(figsize=(width, 0.6 * p + 1.4))
    for r, line in enumerate(entry.events):
        for start, end, a in line:
            if not a.kind.is_compute or end <= start:
                continue
            later_chunk = a.stage >= p
            ax.broken_barh([(start, end - start)], (r - 0.4, 0.8), facecolors=_COLOURS[a.kind],
                           edgecolor="white", linewidth=0.5, hatch="//" if later_chunk else None)
            label = f"{a.stage}:{a.microbatch}"
            if (end - start) * inch_per_unit >= 0.065 * len(label):  # only where the text fits
                ax.text((start + end) / 2, r, label, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, entry.makespan)
    ax.set_xlabel("time (cost units)")
    ax.set_title(f"{entry.name}  v={entry.virtual_stages}  makespan={entry.makespan:.2f}  "
                 f"bubble={entry.bubble:.3f}  peak memory={entry.peak_memory:.2f}", fontsize=9)
    handles = [Patch(facecolor=c, label=k.value) for k, c in _COLOURS.items()]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="later chunk"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
