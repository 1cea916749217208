"""Train a small numpy MLP with pipeline parallelism and check it against one process.

    meshcoll-run -n 4 -m meshcoll.examples.pipeline [--schedule 1f1b]

The model has `world * virtual_stages` dense tanh layers, one per pipeline
stage (4 stages under ``-n 4``). Every rank builds the same data and the same
initial weights from fixed seeds, trains its own stages with the pipeline for
a few SGD steps, and then trains the whole model in this one process (the
reference) and compares its stages' parameters with the reference's. The
pipelined run does exactly the arithmetic of the reference, microbatch by
microbatch, so the two agree far inside the 1e-5 asked for.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from meshcoll.pipeline.executor import ArraySpec, PipelineExecutor
from meshcoll.pipeline.schedule import SCHEDULES, make_schedule

if TYPE_CHECKING:  # the example loads the extension only through the group it is given
    from meshcoll.process_group import ProcessGroup

TOLERANCE = 1e-5


class DenseTanh:
    """y = tanh(x @ w + b). Implements both Stage and SplitStage (zero-bubble)."""

    def __init__(self, fan_in: int, fan_out: int, rng: np.random.Generator) -> None:
        self.w: np.ndarray = rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)
        self.b: np.ndarray = rng.standard_normal(fan_out) * 0.1
        self.dw = np.zeros_like(self.w)
        self.db = np.zeros_like(self.b)
        self._saved: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}  # mb -> (x, y) or (x, dpre)

    def forward(self, mb: int, x: np.ndarray) -> np.ndarray:
        y: np.ndarray = np.tanh(x @ self.w + self.b)
        self._saved[mb] = (x, y)
        return y

    def backward_input(self, mb: int, grad_y: np.ndarray) -> np.ndarray:
        x, y = self._saved[mb]
        dpre: np.ndarray = grad_y * (1.0 - y * y)
        self._saved[mb] = (x, dpre)
        grad_x: np.ndarray = dpre @ self.w.T
        return grad_x

    def backward_weight(self, mb: int) -> None:
        x, dpre = self._saved.pop(mb)
        self.dw += x.T @ dpre
        self.db += dpre.sum(axis=0)

    def backward(self, mb: int, grad_y: np.ndarray) -> np.ndarray:
        grad_x = self.backward_input(mb, grad_y)
        self.backward_weight(mb)
        return grad_x

    def sgd(self, lr: float) -> None:
        self.w -= lr * self.dw
        self.b -= lr * self.db
        self.dw[...] = 0.0
        self.db[...] = 0.0


def build_model(widths: Sequence[int], seed: int) -> List[DenseTanh]:
    # One generator for the whole model, layers in order: every rank draws the
    # same numbers and keeps only its own layers.
    rng = np.random.default_rng(seed)
    return [DenseTanh(widths[s], widths[s + 1], rng) for s in range(len(widths) - 1)]


def batch(step: int, microbatches: int, rows: int, widths: Sequence[int],
          seed: int) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    rng = np.random.default_rng([seed, step])
    xs = [rng.standard_normal((rows, widths[0])) for _ in range(microbatches)]
    ts = [np.tanh(rng.standard_normal((rows, widths[-1]))) for _ in range(microbatches)]
    return xs, ts


def make_loss(microbatches: int) -> Callable[[np.ndarray, np.ndarray], Tuple[float, np.ndarray]]:
    def loss_fn(y: np.ndarray, target: np.ndarray) -> Tuple[float, np.ndarray]:
        # Mean over microbatches of half the squared error.
        diff = (y - target) / microbatches
        return 0.5 * float(np.sum((y - target) * diff)), diff
    return loss_fn


def train_reference(widths: Sequence[int], steps: int, microbatches: int, rows: int, lr: float,
                    seed: int) -> Tuple[List[DenseTanh], List[float]]:
    model, loss_fn = build_model(widths, seed), make_loss(microbatches)
    losses: List[float] = []
    for step in range(steps):
        xs, ts = batch(step, microbatches, rows, widths, seed)
        total = 0.0
        for mb in range(microbatches):
            h = xs[mb]
            for layer in model:
                h = layer.forward(mb, h)
            loss, g = loss_fn(h, ts[mb])
            total += loss
            for layer in reversed(model):
                g = layer.backward(mb, g)
        for layer in model:
            layer.sgd(lr)
        losses.append(total)
    return model, losses


def run(group: ProcessGroup, schedule_name: str = "1f1b", virtual_stages: int = 1, steps: int = 3,
        microbatches: int = 8, rows: int = 5, width: int = 16, lr: float = 0.1,
        seed: int = 1234, verbose: bool = True) -> float:
    """Train with the pipeline on `group`; return this rank's largest difference
    from the one-process reference (its stages' parameters, and the losses on
    the last stage's rank)."""
    num_stages = group.size * virtual_stages
    widths = [7] + [width] * (num_stages - 1) + [3]
    schedule = make_schedule(schedule_name, num_stages, microbatches, virtual_stages)
    model = build_model(widths, seed)
    mine = {s: model[s] for s in schedule.stages_of(group.rank)}
    specs = [ArraySpec((rows, widths[s + 1]), np.float64) for s in range(num_stages - 1)]
    executor = PipelineExecutor(schedule, mine, group, specs=specs, loss_fn=make_loss(microbatches))
    if verbose and group.rank == 0:
        print(schedule, flush=True)

    losses: List[Optional[float]] = []
    for step in range(steps):
        xs, ts = batch(step, microbatches, rows, widths, seed)
        step_losses = executor.step(inputs=xs, targets=ts)
        losses.append(None if step_losses is None else sum(step_losses))
        for layer in mine.values():
            layer.sgd(lr)

    reference, ref_losses = train_reference(widths, steps, microbatches, rows, lr, seed)
    diff = 0.0
    for s, layer in mine.items():
        diff = max(diff, float(np.max(np.abs(layer.w - reference[s].w))),
                   float(np.max(np.abs(layer.b - reference[s].b))))
    if schedule.num_stages - 1 in mine:
        # The last stage computes every step's loss: none is None there.
        diff = max(diff, max(abs(a - b) for a, b in zip(losses, ref_losses) if a is not None))
        if verbose:
            print(f"rank {group.rank}: losses {', '.join(f'{x:.6f}' for x in losses)}", flush=True)
    if verbose:
        print(f"rank {group.rank}: stages {sorted(mine)} max |param - reference| = {diff:.3e}", flush=True)
    return diff


def gather_to_root(group: ProcessGroup, value: float) -> List[float]:
    """Every rank's value on rank 0 (an empty list elsewhere), with plain send/recv."""
    if group.rank != 0:
        group.send(np.array([value]), 0)
        return []
    out = [value]
    for peer in range(1, group.size):
        out.append(float(group.recv(np.empty(1), peer)[0]))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    parser.add_argument("--virtual-stages", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args(argv)

    import meshcoll  # the C++ core is only needed here, not to import this module

    group = meshcoll.init()
    try:
        diff = run(group, args.schedule, args.virtual_stages, args.steps, args.microbatches)
        diffs = gather_to_root(group, diff)
        if group.rank == 0:
            worst = max(diffs)
            verdict = "OK" if worst <= TOLERANCE else "FAILED"
            print(f"{verdict}: {args.schedule} on {group.size} ranks vs one-process training: "
                  f"max |param - reference| = {worst:.3e} (tolerance {TOLERANCE:g})", flush=True)
    finally:
        meshcoll.destroy()
    return 0 if diff <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
