"""Is DataParallel's overlap real? Time one training step's backward three ways:

    meshcoll-run -n 4 bench/python/bench_ddp.py
    meshcoll-run -n 4 bench/python/bench_ddp.py --compute matmul --json ddp.jsonl
    NCCL_NVLS_ENABLE=0 meshcoll-run -n 4 bench/python/bench_ddp.py --backend nccl \
        --layer-mb 64 --ms-per-layer 1      # CUDA tensors; the backward is GPU time

* compute-only: the backward (``--layers`` layers, last first), no communication;
* comm-only: every gradient handed over at once, then ``wait()``: communication alone;
* overlapped step: the backward calling ``ddp.grad_ready`` per layer, then ``wait()``.

Each row is the median over ``--repeats`` of the slowest rank's time; within a repeat the
three phases take turns, each after a barrier. If overlap is real, overlapped < compute + comm; the hidden share is
(compute + comm - overlapped) / min(compute, comm). ``--compute sleep`` (default) stands for
an accelerator's backward: it leaves the host CPU free. ``--compute matmul`` runs numpy
matmuls on the same cores as the communication, so on a machine with fewer cores than
ranks x 2 threads there is little to hide into. With ``--backend nccl`` parameters and
gradients are CUDA tensors (torch) and a layer's backward is ``torch.cuda._sleep`` on the
current stream (a kernel that keeps the GPU busy for the given time), so the all-reduces run
on NCCL's stream beside it; every phase ends with a device synchronize. The last line quotes
``ddp.stats()`` of the overlapped steps: what DataParallel itself measured.
"""

from __future__ import annotations

import os

# One BLAS thread per rank, before numpy loads: ranks x BLAS threads spinning on few cores
# would time the scheduler, not the overlap.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import meshcoll  # noqa: E402
from meshcoll.ddp import DataParallel  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--layer-mb", type=float, default=0.5, help="gradient MiB per layer")
    p.add_argument("--bucket-cap-mb", type=float, default=0.5)
    p.add_argument("--backend", choices=("cpu", "nccl"), default="cpu")
    p.add_argument("--compute", choices=("sleep", "matmul"), default="sleep")
    p.add_argument("--ms-per-layer", type=float, default=4.0,
                   help="backward time per layer (sleep), or its target (matmul: calibrated)")
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--symmetric", choices=("on", "off"), default="off",
                   help="NCCL: gradient buckets in symmetric memory (DataParallel(symmetric=))")
    p.add_argument("--views", choices=("on", "off"), default="off",
                   help="gradients in DataParallel's own buffers (gradient_buffer: no copy "
                        "into the buckets or out of them)")
    p.add_argument("--json", metavar="FILE", help="append one json record per row")
    return p.parse_args()


class Backward:
    """A backward pass that takes time per layer and hands over precomputed gradients."""

    def __init__(self, pg, args, grads):
        self.grads, self.kind, self.ms = grads, args.compute, args.ms_per_layer
        self.a = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
        self.reps = self._calibrate(pg) if self.kind == "matmul" else 0
        self.gpu = args.backend == "nccl"
        self.cycles = self._gpu_cycles() if self.gpu else 0

    def _gpu_cycles(self) -> int:
        # GPU clock cycles of torch.cuda._sleep per ms, timed with CUDA events.
        import torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(10**6)  # warm-up
        start.record()
        torch.cuda._sleep(10**7)
        end.record()
        end.synchronize()
        return int(10**7 / start.elapsed_time(end) * self.ms)

    def _calibrate(self, pg) -> int:
        # All ranks at once, as in the run; every rank then uses the smallest count, so that
        # no rank's backward is longer by design.
        pg.barrier()
        t0, n = time.perf_counter(), 50
        for _ in range(n):
            self.a @ self.a
        reps = np.array([max(1, round(self.ms / 1e3 / ((time.perf_counter() - t0) / n)))])
        return int(pg.all_gather(reps).min())

    def layer(self) -> None:
        if self.gpu:
            import torch
            torch.cuda._sleep(self.cycles)
        elif self.kind == "sleep":
            time.sleep(self.ms / 1e3)
        else:
            for _ in range(self.reps):
                self.a @ self.a

    def run(self, on_grad) -> None:
        for name in reversed(list(self.grads)):
            self.layer()
            on_grad(name, self.grads[name])


def timed(pg, fns, args, ddp):
    """Median over repeats of the slowest rank's seconds, for each of ``fns``. The phases
    take turns within each repeat, so the machine's slow moments fall on all of them alike.
    Also returns ddp.stats() summed over the timed calls of the last phase."""
    times = [[] for _ in fns]
    stats = {"comm_seconds": 0.0, "overlapped_seconds": 0.0, "bytes": 0}
    for i in range(args.warmup + args.repeats):
        for j, fn in enumerate(fns):
            pg.barrier()
            before = ddp.stats()
            t0 = time.perf_counter()
            fn()
            if args.backend == "nccl":
                import torch
                torch.cuda.synchronize()
            t = time.perf_counter() - t0
            after = ddp.stats()
            t = float(pg.all_gather(np.array([t])).max())  # host arrays: also on NCCL
            if i >= args.warmup:
                times[j].append(t)
                if j == len(fns) - 1:
                    for k in stats:
                        stats[k] += after[k] - before[k]
    return [statistics.median(t) for t in times], stats


def main() -> None:
    args = parse_args()
    pg = meshcoll.init(backend=args.backend)
    n = max(1, int(args.layer_mb * 2**20) // 4)
    params = {f"w{i}": np.zeros(n, np.float32) for i in range(args.layers)}
    grads = {k: np.ones(n, np.float32) for k in params}
    if args.backend == "nccl":
        import torch
        dev = torch.device("cuda", pg.device)
        params = {k: torch.from_numpy(v).to(dev) for k, v in params.items()}
        grads = {k: torch.from_numpy(v).to(dev) for k, v in grads.items()}
    ddp = DataParallel(params, group=pg, bucket_cap_mb=args.bucket_cap_mb,
                       symmetric=args.symmetric == "on")
    if args.views == "on":
        for k in grads:
            buf = ddp.gradient_buffer(k)
            buf += grads[k]
            grads[k] = buf
    bw = Backward(pg, args, grads)

    def overlapped():
        bw.run(ddp.grad_ready)
        ddp.wait()

    (compute, comm, step), s = timed(
        pg, [lambda: bw.run(lambda name, g: None), lambda: ddp.sync_gradients(grads),
             overlapped], args, ddp)
    steps = args.repeats
    hidden = compute + comm - step
    frac = hidden / min(compute, comm)
    if pg.rank == 0:
        total_mb = args.layers * n * 4 / 2**20
        what = (f"GPU sleep {args.ms_per_layer:g} ms" if bw.gpu
                else f"sleep {args.ms_per_layer:g} ms" if args.compute == "sleep"
                else f"matmul x{bw.reps} (~{args.ms_per_layer:g} ms)")
        print(f"# meshcoll {meshcoll.__version__}  ddp overlap  backend={args.backend}  ranks={pg.size}  "
              f"layers={args.layers} x {args.layer_mb:g} MiB = {total_mb:g} MiB  "
              f"buckets={len(ddp.bucket_names)}  symmetric={ddp.symmetric}  views={args.views}  "
              f"compute={what} per layer  "
              f"repeats={args.repeats} warmup={args.warmup}")
        print(f"# {'phase':>16} {'time':>9} {'algbw':>8}")
        print(f"# {'':>16} {'(ms)':>9} {'(GB/s)':>8}")
        rows = [("compute-only", compute, None), ("comm-only", comm, total_mb * 2**20 / comm / 1e9),
                ("overlapped step", step, None)]
        for name, t, algbw in rows:
            bw_col = f"{algbw:8.3f}" if algbw is not None else f"{'-':>8}"
            print(f"  {name:>16} {t * 1e3:9.2f} {bw_col}")
        print(f"# compute + comm = {(compute + comm) * 1e3:.2f} ms; overlapped step "
              f"{'<' if step < compute + comm else '>='} that; hidden {hidden * 1e3:.2f} ms = "
              f"{100 * frac:.0f}% of min(compute, comm)")
        print(f"# ddp.stats() over the overlapped steps (rank 0): "
              f"{s['comm_seconds'] / steps * 1e3:.2f} ms comm/step, "
              f"{s['overlapped_seconds'] / steps * 1e3:.2f} ms before wait() "
              f"({100 * s['overlapped_seconds'] / s['comm_seconds']:.0f}%), "
              f"{s['bytes'] / s['comm_seconds'] / 1e9:.3f} GB/s")
        if args.json:
            with open(args.json, "a") as f:
                for name, t, _ in rows:
                    f.write(json.dumps({"bench": "ddp", "phase": name, "time_ms": t * 1e3,
                                        "ranks": pg.size, "layers": args.layers,
                                        "layer_mb": args.layer_mb, "compute": args.compute,
                                        "ms_per_layer": args.ms_per_layer,
                                        "buckets": len(ddp.bucket_names),
                                        "symmetric": ddp.symmetric, "views": args.views,
                                        "overlap_fraction": frac}) + "\n")
    ddp.close()
    meshcoll.destroy()


if __name__ == "__main__":
    main()
