"""Data-parallel training of a small numpy MLP, the README's first command:

    meshcoll-run -n 4 -m meshcoll.examples.train_ddp --check
    python -m meshcoll.examples.train_ddp --check        # the same: starts meshcoll-run -n 4

Every rank generates the same synthetic classification set (fixed seed), takes its shard of
each global batch, and runs forward and backward in numpy. Backward hands each layer's
gradients to ``DataParallel.grad_ready`` as soon as they exist, last layer first, so the
all-reduce of the last layers' bucket runs while the first layers' gradients are computed.
``--check`` then trains the same model in one process on the full batches and prints the
largest relative parameter difference; ``--local-sgd K`` averages parameters every K steps
instead of gradients every step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

import meshcoll
from meshcoll.ddp import DataParallel, LocalSGD
from meshcoll.process_group import ProcessGroup

Params = Dict[str, np.ndarray]


# ---- model and data: pure functions, shared with tests/python/test_ddp.py -----------------
def make_dataset(n: int = 4096, dim: int = 32, classes: int = 10,
                 seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs around random class centres: learnable, not trivially separable."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, dim)).astype(np.float32) * 1.5
    y = rng.integers(0, classes, n)
    x = centres[y] + rng.standard_normal((n, dim)).astype(np.float32)
    return x.astype(np.float32), y.astype(np.int64)


def init_params(sizes: Sequence[int] = (32, 128, 128, 10), seed: int = 0) -> Params:
    """He-initialised weights ``w{i}`` (in, out) and zero biases ``b{i}``, in forward order."""
    rng = np.random.default_rng(seed)
    params: Params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:]), start=1):
        params[f"w{i}"] = (rng.standard_normal((fan_in, fan_out)) *
                           np.sqrt(2.0 / fan_in)).astype(np.float32)
        params[f"b{i}"] = np.zeros(fan_out, np.float32)
    return params


def forward_backward(params: Params, x: np.ndarray, y: np.ndarray, scale: float,
                     on_grad: Callable[[str, np.ndarray], None]) -> Tuple[float, int]:
    """Softmax cross-entropy of a ReLU MLP; the loss is ``scale * sum of per-sample losses``.
    Calls ``on_grad(name, grad)`` for each gradient as backward produces it (last layer
    first). Returns (sum of per-sample losses, number classified correctly)."""
    layers = len(params) // 2
    acts = [x]
    for i in range(1, layers + 1):
        z = acts[-1] @ params[f"w{i}"] + params[f"b{i}"]
        acts.append(np.maximum(z, 0) if i < layers else z)
    logits = acts[-1]
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(y))
    loss_sum = float(-logp[rows, y].sum())
    correct = int((logits.argmax(axis=1) == y).sum())
    d = np.exp(logp)
    d[rows, y] -= 1.0
    d *= np.float32(scale)
    for i in range(layers, 0, -1):
        # Bias first: b3, w3, b2, w2, ... is reverse registration order, the bucket order.
        on_grad(f"b{i}", d.sum(axis=0))
        on_grad(f"w{i}", acts[i - 1].T @ d)
        if i > 1:
            d = (d @ params[f"w{i}"].T) * (acts[i - 1] > 0)
    return loss_sum, correct


def sgd(params: Params, grads: Params, lr: float) -> None:
    for name, p in params.items():
        p -= np.float32(lr) * grads[name]


def batches(n: int, batch_size: int, epoch: int, seed: int) -> List[np.ndarray]:
    """Index arrays of each global batch; the same permutation on every rank."""
    perm = np.random.default_rng((seed, epoch)).permutation(n)
    return [perm[i:i + batch_size] for i in range(0, n, batch_size)]


def train_single(params: Params, x: np.ndarray, y: np.ndarray, epochs: int, batch_size: int,
                 lr: float, seed: int) -> Params:
    """The reference: one process, the whole global batch at each step."""
    for epoch in range(epochs):
        for idx in batches(len(x), batch_size, epoch, seed):
            grads: Params = {}
            forward_backward(params, x[idx], y[idx], 1.0 / len(idx), grads.__setitem__)
            sgd(params, grads, lr)
    return params


def max_rel_diff(a: Params, b: Params) -> float:
    """Largest over parameters of max|a - b| / max|b|."""
    return max(float(np.abs(a[n] - b[n]).max() / max(np.abs(b[n]).max(), 1e-30)) for n in b)


# ---- progress: tqdm when installed, else a line every quarter epoch ------------------------
class _Progress:
    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.done = total, desc, 0
        self.bar: Any = None  # a tqdm bar, when tqdm is installed
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, leave=False, file=sys.stdout)
            except ImportError:
                pass

    def update(self, loss: float) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.bar.update(1)
        elif self.done % max(1, self.total // 4) == 0 or self.done == self.total:
            filled = 20 * self.done // self.total
            print(f"{self.desc} [{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total} "
                  f"steps  loss {loss:.4f}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- the job ------------------------------------------------------------------------------
def train_distributed(pg: ProcessGroup, args: argparse.Namespace, x: np.ndarray,
                      y: np.ndarray) -> Tuple[Params, DataParallel]:
    # Each rank starts from its own seed: the construction broadcast makes them equal.
    params = init_params(seed=args.seed + pg.rank)
    mode: Union[str, LocalSGD] = LocalSGD(args.local_sgd) if args.local_sgd else "sync"
    ddp = DataParallel(params, group=pg, bucket_cap_mb=args.bucket_cap_mb, mode=mode)
    if pg.rank == 0:
        print(f"{pg.size} ranks, {len(x)} samples, global batch {args.batch_size}, "
              f"{sum(p.size for p in params.values())} parameters in {len(ddp.bucket_names)} "
              f"buckets {ddp.bucket_names}, mode {mode}", flush=True)
    for epoch in range(args.epochs):
        ddp.reset_stats()
        steps = batches(len(x), args.batch_size, epoch, args.seed)
        bar = _Progress(len(steps), f"epoch {epoch + 1}/{args.epochs}", pg.rank == 0)
        totals = np.zeros(3, np.float64)  # loss sum, correct, samples
        t0 = time.perf_counter()
        for idx in steps:
            shard = np.array_split(idx, pg.size)[pg.rank]
            grads: Params = {}

            def on_grad(name: str, g: np.ndarray) -> None:
                grads[name] = g
                ddp.grad_ready(name, g)  # may start a bucket's all-reduce right now
            # Scale so the group average is the mean over the *global* batch, also when
            # shards differ in size by one sample.
            loss, correct = forward_backward(params, x[shard], y[shard],
                                             pg.size / len(idx), on_grad)
            ddp.wait()
            sgd(params, grads, args.lr)
            ddp.step()
            totals += (loss, correct, len(shard))
            bar.update(loss / max(len(shard), 1))
        bar.close()
        pg.all_reduce(totals)  # the epoch's numbers over all ranks' samples
        s = ddp.stats()
        if pg.rank == 0:
            print(f"epoch {epoch + 1}: loss {totals[0] / totals[2]:.4f}  accuracy "
                  f"{totals[1] / totals[2]:.4f}  ({time.perf_counter() - t0:.2f} s)", flush=True)
            print(f"  comm: {s['calls']} all-reduces, {s['bytes'] / 1e6:.2f} MB, "
                  f"{s['comm_seconds'] * 1e3:.1f} ms, {s['overlapped_seconds'] * 1e3:.1f} ms "
                  f"overlapped ({100 * s['overlap_fraction']:.0f}%), "
                  f"{s['algbw_gbps']:.3f} GB/s", flush=True)
    if args.local_sgd:
        ddp.average_parameters()  # end with one model
    return params, ddp


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-N", "--nproc", type=int, default=4,
                   help="ranks to start when not already under a launcher (default 4)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128, help="global batch (default 128)")
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=0.03,
                   help="bucket size in MiB (default 0.03: several buckets for this small model)")
    p.add_argument("--local-sgd", type=int, default=0, metavar="K",
                   help="LocalSGD: average parameters every K steps instead of gradients")
    p.add_argument("--check", action="store_true",
                   help="also train in one process on the full batches; compare parameters")
    args = p.parse_args(argv)
    if args.check and args.local_sgd:
        p.error("--check compares with full-batch SGD, which LocalSGD does not compute")
    if args.epochs < 1 or args.batch_size < 1 or args.samples < 1 or args.local_sgd < 0:
        p.error("--epochs, --batch-size and --samples must be >= 1, --local-sgd >= 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if meshcoll._rendezvous._find_scheme(os.environ) is None:
        # Not under a launcher: start the ranks with meshcoll-run (exec, so that signals go
        # straight to it), one BLAS thread each unless told otherwise: N ranks of spinning
        # BLAS threads on a few cores would spend the job waiting for each other.
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "meshcoll.run", "-n", str(args.nproc),
                                   "-m", "meshcoll.examples.train_ddp", *argv], env)
    pg = meshcoll.init()
    try:
        x, y = make_dataset(args.samples, seed=args.seed)
        params, ddp = train_distributed(pg, args, x, y)
        ddp.close()
        if args.check and pg.rank == 0:
            t0 = time.perf_counter()
            ref = train_single(init_params(seed=args.seed), x, y, args.epochs,
                               args.batch_size, args.lr, args.seed)
            diff = max_rel_diff(params, ref)
            ok = diff < 1e-5
            print(f"check: one process, full batches ({time.perf_counter() - t0:.2f} s): "
                  f"largest relative parameter difference {diff:.2e} "
                  f"({'OK' if ok else 'FAIL'}: limit 1e-05)", flush=True)
            if not ok:
                return 1
    finally:
        meshcoll.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
