"""Rank the pipeline schedules for a model's costs, and draw their timelines.

    meshcoll-plan --stages 4 --microbatches 8 \\
        --forward 1 --backward-input 1 --backward-weight 1 --send 0.05 \\
        [--memory-limit 4] [--draw DIR] [--ascii]

Each cost is one number or a comma-separated list with one per rank, in any one
time unit (milliseconds measured, or ratios estimated); units and the memory
limit are explained in meshcoll/pipeline/planner.py. ``--draw DIR`` writes one
PNG per schedule (needs matplotlib, checked before anything runs); ``--ascii``
prints the timelines as text.

This file is only the command line (``meshcoll-plan``, or ``python -m
meshcoll.pipeline.planner_cli``); the function is ``meshcoll.pipeline.plan``, defined in
planner.py. No submodule of meshcoll.pipeline is named like one of its functions: importing
a submodule binds its name on the package, which would replace the function for every
later ``from meshcoll.pipeline import plan`` (tests/unit/test_planner.py checks).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence, Union

from .. import __version__
from .planner import COST_KEYS, ascii_timeline, candidates, draw, format_table, plan


def _cost(text: str) -> Union[float, List[float]]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or comma-separated numbers, got {text!r}")
    return values[0] if len(values) == 1 else values


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="meshcoll-plan", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--stages", type=int, required=True, help="pipeline ranks (the model's split)")
    parser.add_argument("--microbatches", type=int, required=True)
    for key in COST_KEYS:
        parser.add_argument("--" + key.replace("_", "-"), type=_cost, required=True, metavar="T[,T...]",
                            help=f"{key} time of one rank's share for one microbatch (per rank with commas)")
    parser.add_argument("--memory-limit", type=float, default=None,
                        help="stashed microbatch activations of a rank's share that fit")
    parser.add_argument("--draw", metavar="DIR", help="write one PNG timeline per schedule into DIR")
    parser.add_argument("--ascii", action="store_true", help="print each timeline as text")
    args = parser.parse_args(argv)

    if args.draw:
        # Before any work: a missing optional dependency should cost the user nothing.
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("plan: --draw needs matplotlib, which is not installed here (pip install matplotlib); "
                  "--ascii prints the timelines as text instead", file=sys.stderr)
            return 2
        os.makedirs(args.draw, exist_ok=True)

    costs = {k: getattr(args, k) for k in COST_KEYS}
    try:
        entries = plan(args.stages, args.microbatches, costs, args.memory_limit)
    except ValueError as e:  # ScheduleError included: wrong counts or costs; the message says "plan:"
        print(e, file=sys.stderr)
        return 2
    print(format_table(entries, args.stages, args.microbatches, costs, args.memory_limit))
    for reason in candidates(args.stages, args.microbatches)[1]:
        print(f"# not applicable: {reason}")
    for entry in entries:
        if args.ascii:
            print()
            print(ascii_timeline(entry))
        if args.draw:
            path = os.path.join(args.draw, f"{entry.name}_v{entry.virtual_stages}.png")
            draw(entry, path)
            print(f"# drew {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
