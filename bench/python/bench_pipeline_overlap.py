"""Does posting receives early overlap the pipeline's transfers with its compute? Time the
pipeline example's step with receives posted right before their consumer ("late", the
executor's behaviour before Note [Receive lookahead]) and one compute ahead ("early", now):

    meshcoll-run -n 2 bench/python/bench_pipeline_overlap.py
    meshcoll-run -n 4 bench/python/bench_pipeline_overlap.py --schedule zero_bubble_v --virtual-stages 2

The model is meshcoll.examples.pipeline's DenseTanh chain; every stage pass additionally
sleeps (``--ms-forward``, ``--ms-backward``, of which ``--ms-weight`` is the weight
gradient in split schedules), standing for an accelerator's kernel: it leaves the host
CPU to the transport, as a GPU would. The messages are ``--rows`` x ``--width`` float64
arrays. Both variants run the same compute orders on the same stages, alternating within
each repeat; a row is the median over ``--repeats`` of the slowest rank's step time.
``#wrong`` counts parameters whose gradients differ between the two (they must not: the
same arithmetic in the same order). ``simulated`` is the schedule's makespan with these
compute times and no communication cost: the floor that overlap approaches.
"""

from __future__ import annotations

import os

# One BLAS thread per rank, before numpy loads (see bench_ddp.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import meshcoll  # noqa: E402
from meshcoll.examples.pipeline import DenseTanh, batch, build_model, make_loss  # noqa: E402
from meshcoll.pipeline import ArraySpec, PipelineExecutor, from_compute_orders, make_schedule  # noqa: E402
from meshcoll.pipeline.simulate import simulate  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=4096, help="rows per microbatch")
    p.add_argument("--width", type=int, default=64, help="activation width (message = rows x width x 8 B)")
    p.add_argument("--ms-forward", type=float, default=10.0)
    p.add_argument("--ms-backward", type=float, default=20.0)
    p.add_argument("--ms-weight", type=float, default=10.0, help="part of --ms-backward that is W")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", metavar="FILE", help="append one json record per row")
    return p.parse_args()


class Timed:
    """A DenseTanh stage whose passes also take the injected time (sleep: host CPU stays free)."""

    def __init__(self, layer: DenseTanh, f: float, b: float, w: float) -> None:
        self.layer, self.f, self.b, self.w = layer, f, b, w

    def forward(self, mb, x):
        time.sleep(self.f)
        return self.layer.forward(mb, x)

    def backward(self, mb, g):
        time.sleep(self.b)
        return self.layer.backward(mb, g)

    def backward_input(self, mb, g):
        time.sleep(self.b - self.w)
        return self.layer.backward_input(mb, g)

    def backward_weight(self, mb):
        time.sleep(self.w)
        self.layer.backward_weight(mb)


def main() -> None:
    args = parse_args()
    pg = meshcoll.init()
    v, m = args.virtual_stages, args.microbatches
    num_stages = pg.size * v
    early = make_schedule(args.schedule, num_stages, m, virtual_stages=v)
    orders = [early.compute_actions(r) for r in range(early.num_ranks)]
    late = from_compute_orders(early.name, orders, m, v, early.placement, recv_lookahead=0)
    widths = [args.width] * (num_stages + 1)
    specs = [ArraySpec((args.rows, args.width), np.float64)] * (num_stages - 1)
    xs, ts = batch(0, m, args.rows, widths, seed=5)
    ms = (args.ms_forward / 1e3, args.ms_backward / 1e3, args.ms_weight / 1e3)

    times = {"late": [], "early": []}
    grads = {}
    for variant, sched in (("late", late), ("early", early)):
        model = build_model(widths, seed=3)  # the same weights for both variants
        mine = {s: Timed(model[s], *ms) for s in sched.stages_of(pg.rank)}
        ex = PipelineExecutor(sched, mine, pg, specs=specs, loss_fn=make_loss(m), timeout=120.0)
        grads[variant] = (ex, mine)
    for rep in range(args.warmup + args.repeats):
        for variant in ("late", "early") if rep % 2 == 0 else ("early", "late"):
            ex, mine = grads[variant]
            for st in mine.values():
                st.layer.dw[...] = 0.0
                st.layer.db[...] = 0.0
            pg.barrier()
            t0 = time.perf_counter()
            ex.step(inputs=xs, targets=ts)
            t = time.perf_counter() - t0
            t = float(pg.all_gather(np.array([t])).max())
            if rep >= args.warmup:
                times[variant].append(t)
    wrong = sum(int(not (np.array_equal(a.layer.dw, b.layer.dw) and np.array_equal(a.layer.db, b.layer.db)))
                for a, b in zip(grads["late"][1].values(), grads["early"][1].values()))
    wrong = int(pg.all_gather(np.array([wrong])).sum())

    if pg.rank == 0:
        floor = simulate(early, t_f=ms[0], t_b=ms[1], t_w=ms[2] if early.uses_split_backward else 0.0).makespan
        mib = args.rows * args.width * 8 / 2**20
        print(f"# meshcoll {meshcoll.__version__}  pipeline overlap  schedule={early.name}  ranks={pg.size}  "
              f"virtual_stages={v}  microbatches={m}  message={mib:.2f}MiB  forward={args.ms_forward:g}ms  "
              f"backward={args.ms_backward:g}ms  repeats={args.repeats} warmup={args.warmup}")
        print(f"# {'receives':>8} {'step':>9} {'min':>9} {'max':>9} {'simulated':>10} {'#wrong':>7}")
        print(f"# {'':>8} {'(ms)':>9} {'(ms)':>9} {'(ms)':>9} {'(ms)':>10}")
        for variant in ("late", "early"):
            ts_ = times[variant]
            row = {"schedule": early.name, "ranks": pg.size, "virtual_stages": v, "microbatches": m,
                   "message_bytes": args.rows * args.width * 8, "receives": variant,
                   "step_ms": statistics.median(ts_) * 1e3, "min_ms": min(ts_) * 1e3,
                   "max_ms": max(ts_) * 1e3, "simulated_ms": floor * 1e3, "wrong": wrong}
            print(f"  {variant:>8} {row['step_ms']:>9.2f} {row['min_ms']:>9.2f} {row['max_ms']:>9.2f} "
                  f"{row['simulated_ms']:>10.2f} {wrong:>7}")
            if args.json:
                with open(args.json, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
        e, l_ = statistics.median(times["early"]), statistics.median(times["late"])
        print(f"# early / late : {e / l_:.3f}   exposed beyond simulated: late {(l_ - floor) * 1e3:.2f} ms, "
              f"early {(e - floor) * 1e3:.2f} ms")
    meshcoll.destroy()


if __name__ == "__main__":
    main()
