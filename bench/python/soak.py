"""Soak: thousands of mixed collectives of random sizes, ops, dtypes and groups, each result
checked against numpy.

    meshcoll-run -n 4 bench/python/soak.py --seconds 60
    meshcoll-run -n 8 bench/python/soak.py --seconds 30 --json soak.jsonl
    meshcoll-run -n 4 bench/python/soak.py --ops 2000 --seed 7      # a reproducible run

Every rank derives the same schedule from ``--seed``: step s draws, from a generator seeded
with (seed, s), the group (the world, subgroups from ``new_group`` and the halves of a
``split``; half of the subgroups are forced onto TCP, the rest take shared memory), the
collective, the dtype, the reduction op, the root, the all_reduce algorithm and a size from
1 B to ``--max-bytes`` (log-uniform). Ranks outside the step's group skip it; since every
rank walks the steps in the same order, calls on different groups cannot deadlock.

Inputs are small integers built from the step's base array and the member's group rank, so
every rank can compute every member's input, and the exact result, with numpy: sums stay
within int8 and within the integers that bfloat16 holds exactly, products multiply +-1.
Only float ``avg`` is compared with a tolerance. A wrong result counts one error on the
rank that saw it and prints what differed; an exception counts one, prints, and ends the run on that
rank (the group is aborted; the launcher stops the others). With ``--seconds`` rank 0's
clock decides, announced through a small world all_reduce every ``--check-every`` steps.

At the end rank 0 prints, per collective: calls (each counted once, on the group's rank 0;
all_reduce_async issues batches of 2-4 before waiting on them, each call counted),
bytes (every rank's input, summed) and errors. The exit code is 1 if any rank saw an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional, Tuple

import numpy as np

import meshcoll
from meshcoll.bench import P2P_ALGORITHMS, parse_size

try:
    import ml_dtypes
    _BF16 = [np.dtype(ml_dtypes.bfloat16)]
except ImportError:  # bf16 needs ml_dtypes; run without it
    _BF16 = []

DTYPES = [np.dtype(t) for t in ("bool", "int8", "uint8", "int32", "int64", "float16",
                                "float32", "float64")] + _BF16
OPS = ["sum", "prod", "min", "max", "avg", "band", "bor", "bxor"]
KINDS = ["all_reduce", "all_reduce_async", "reduce", "broadcast", "all_gather", "all_gather_v",
         "reduce_scatter", "reduce_scatter_v", "all_to_all", "all_to_all_v", "gather", "scatter",
         "sendrecv", "barrier"]
WEIGHTS = np.array([6, 2, 2, 3, 3, 1, 2, 1, 2, 1, 1, 1, 2, 1], float)
ALGOS = ["auto", *P2P_ALGORITHMS]
CONTROL = "control"  # the stop-flag all_reduce


def is_float(dt: np.dtype) -> bool:
    return dt.kind == "f" or dt in _BF16


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="run time (default 60)")
    p.add_argument("--ops", type=int, default=0, help="stop after this many steps instead")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-bytes", default="4M", help="largest input (default 4M)")
    p.add_argument("--subgroups", type=int, default=4, help="random new_group subgroups")
    p.add_argument("--timeout", type=float, default=120.0, help="per-call timeout, seconds")
    p.add_argument("--check-every", type=int, default=8, help="steps between stop checks")
    p.add_argument("--json", default=None, help="append the summary to this JSONL file")
    p.add_argument("--max-reports", type=int, default=20, help="error details printed per rank")
    return p.parse_args(argv)


# ---- groups ------------------------------------------------------------------------------

def _with_transport(transport: Optional[str], make):
    """MESHCOLL_TRANSPORT is read when a group is created: set it around ``make``."""
    old = os.environ.get("MESHCOLL_TRANSPORT")
    if transport:
        os.environ["MESHCOLL_TRANSPORT"] = transport
    try:
        return make()
    finally:
        if old is None:
            os.environ.pop("MESHCOLL_TRANSPORT", None)
        else:
            os.environ["MESHCOLL_TRANSPORT"] = old


def make_groups(pg, seed: int, subgroups: int) -> List[Tuple[str, object, List[int]]]:
    """(label, group or None where this rank is not a member, global ranks), the same list
    on every rank."""
    n = pg.size
    rng = np.random.default_rng([seed, 999])
    groups = [("world", pg, list(range(n)))]
    for k in range(subgroups if n > 2 else 0):
        size = int(rng.integers(2, n + 1))
        ranks = sorted(int(r) for r in rng.choice(n, size, replace=False))
        rng.shuffle(ranks)  # group rank order differs from global order
        transport = "tcp" if k % 2 else None
        g = _with_transport(transport, lambda: pg.new_group(ranks))
        groups.append((f"new_group{ranks}", g if g.is_member else None, ranks))
    # split: even and odd global ranks, each ordered by descending global rank (key = -rank).
    if n >= 4:
        h = _with_transport("tcp", lambda: pg.split(pg.rank % 2, key=-pg.rank))
        for color in (0, 1):
            members = sorted((r for r in range(n) if r % 2 == color), reverse=True)
            groups.append((f"split{color}{members}", h if pg.rank % 2 == color else None,
                           members))
    return groups


# ---- data --------------------------------------------------------------------------------

def domain(dtype: np.dtype, op: str) -> Tuple[int, int]:
    """Range of input values for which every reduction of up to 8 ranks is exact."""
    if dtype == np.bool_:
        return 0, 1
    if op == "prod":
        return (0, 1) if dtype == np.uint8 else (-1, 1)
    if op in ("band", "bor", "bxor"):
        return (0, 127) if dtype == np.int8 else (0, 255)
    if op in ("min", "max") or op is None:
        return (0, 100) if dtype == np.uint8 else (-50, 50)
    return (0, 15) if dtype == np.uint8 else (-8, 8)  # sum, avg


def member_input(base: np.ndarray, member: int, dtype: np.dtype, op: Optional[str],
                 shape) -> np.ndarray:
    """Member ``member``'s input: the base pattern shifted by the member, in the op's domain."""
    lo, hi = domain(dtype, op)
    v = (base + 7 * member) % (hi - lo + 1) + lo
    if op == "prod" and lo == -1:
        v = np.where(v == 0, 1, v)  # +-1 only
    return v.astype(dtype).reshape(shape)


def reference(arrays: List[np.ndarray], op: str, dtype: np.dtype) -> np.ndarray:
    if dtype == np.bool_:
        fn = {"sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
              "prod": np.logical_and, "min": np.logical_and, "band": np.logical_and,
              "bxor": np.logical_xor}[op]
        return fn.reduce(np.stack(arrays), axis=0)
    wide = np.float64 if is_float(dtype) else np.int64
    fn = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
          "max": np.maximum, "band": np.bitwise_and, "bor": np.bitwise_or,
          "bxor": np.bitwise_xor}[op]
    r = arrays[0].astype(wide)
    for a in arrays[1:]:  # pairwise, in a wide type: no n x count temporary
        fn(r, a.astype(wide), out=r)
    if op == "avg":
        n = len(arrays)
        r = r / n if wide is np.float64 else np.sign(r) * (np.abs(r) // n)  # ints: toward zero
    return r.astype(dtype)


def same(got: np.ndarray, want: np.ndarray, op: Optional[str]) -> Optional[str]:
    """None if equal (float avg: within rounding); else a short description."""
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if op == "avg" and is_float(want.dtype):
        tol = 2e-2 if want.dtype.itemsize == 2 else 1e-6
        ok = np.isclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    else:
        ok = got == want  # small integers: exact in every dtype, so no tolerance
    if np.all(ok):
        return None
    bad = np.flatnonzero(~np.asarray(ok).ravel())
    i = int(bad[0])
    return (f"{bad.size} of {want.size} elements differ; first at {i}: got "
            f"{got.ravel()[i]!r}, expected {want.ravel()[i]!r}")


# ---- one step ----------------------------------------------------------------------------

class Step:
    """Everything a step needs, drawn identically on every rank."""

    def __init__(self, seed: int, s: int, groups, max_bytes: int):
        rng = np.random.default_rng([seed, s])
        weights = np.array([3.0] + [1.0] * (len(groups) - 1))
        self.gi = int(rng.choice(len(groups), p=weights / weights.sum()))
        self.label, self.group, self.members = groups[self.gi]
        self.n = len(self.members)
        self.kind = KINDS[int(rng.choice(len(KINDS), p=WEIGHTS / WEIGHTS.sum()))]
        self.dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        self.op = OPS[int(rng.integers(len(OPS)))]
        if self.dtype == np.bool_ and self.op == "avg":
            self.op = "bor"
        if is_float(self.dtype):
            if self.op in ("band", "bor", "bxor"):
                self.op = "sum"
        nbytes = int(np.exp(rng.uniform(0, np.log(max_bytes))))
        self.count = max(1, nbytes // self.dtype.itemsize)
        self.root = int(rng.integers(self.n))
        self.algo = ALGOS[int(rng.integers(len(ALGOS)))]
        self.shm_algo = int(rng.integers(3)) == 0  # on shared-memory groups: force "shm"
        self.batch = int(rng.integers(2, 5))
        # Uneven splits (zeros included) for the _v collectives.
        self.rows = [int(v) for v in rng.integers(0, 3, self.n)]  # sum <= 2n rows of cols
        self.cols = max(1, self.count // max(1, 2 * self.n))
        self.matrix = rng.integers(0, 3, (self.n, self.n))
        self.base = rng.integers(0, 1 << 30, max(self.count, 2 * self.n * self.cols) + 8,
                                 dtype=np.int32)


def run_step(st: Step, timeout: float) -> Tuple[int, List[str]]:
    """Run this rank's part of the step; return (input bytes, problems)."""
    g, n, r, dt, op = st.group, st.n, st.group.rank, st.dtype, st.op
    problems = []

    def inp(member, shape, op_=op, salt=0):
        size = int(np.prod(shape))
        return member_input(st.base[salt:salt + size], member, dt, op_, shape)

    def check(what, got, want, op_=None):
        msg = same(np.asarray(got), np.asarray(want), op_)
        if msg:
            problems.append(f"{what}: {msg}")

    kind = st.kind
    if kind == "all_reduce":
        algo = "shm" if g.transport == "shm" and st.shm_algo else st.algo
        xs = [inp(i, (st.count,)) for i in range(n)]
        x = xs[r].copy()
        g.all_reduce(x, op, algorithm=algo, timeout=timeout)
        check(f"all_reduce {op} algo={algo}", x, reference(xs, op, dt), op)
        return x.nbytes, problems
    if kind == "all_reduce_async":
        bufs, works, refs = [], [], []
        for b in range(st.batch):
            xs = [inp(i, (max(1, st.count >> b),), salt=2 * b) for i in range(n)]
            bufs.append(xs[r].copy())
            refs.append(reference(xs, op, dt))
            works.append(g.all_reduce(bufs[-1], op, async_op=True, timeout=timeout))
        for b, w in enumerate(works):
            w.wait()
            check(f"async all_reduce #{b} {op}", bufs[b], refs[b], op)
        return sum(b.nbytes for b in bufs), problems
    if kind == "reduce":
        xs = [inp(i, (st.count,)) for i in range(n)]
        x = xs[r].copy()
        g.reduce(x, st.root, op, timeout=timeout)
        want = reference(xs, op, dt) if r == st.root else xs[r]  # others: unchanged
        check(f"reduce {op} root={st.root}", x, want, op)
        return x.nbytes, problems
    if kind == "broadcast":
        xs = [inp(i, (st.count,), None) for i in range(n)]
        x = xs[r].copy()
        g.broadcast(x, st.root, timeout=timeout)
        check(f"broadcast root={st.root}", x, xs[st.root])
        return x.nbytes, problems
    if kind == "all_gather":
        shape = (st.cols, 2)
        xs = [inp(i, shape, None) for i in range(n)]
        check("all_gather", g.all_gather(xs[r], timeout=timeout), np.stack(xs))
        return xs[r].nbytes, problems
    if kind == "all_gather_v":
        xs = [inp(i, (st.rows[i], st.cols), None) for i in range(n)]
        got, counts = g.all_gather_v(xs[r], timeout=timeout)
        check("all_gather_v", got, np.concatenate(xs))
        if counts != st.rows:
            problems.append(f"all_gather_v counts {counts}, expected {st.rows}")
        return xs[r].nbytes, problems
    if kind == "reduce_scatter":
        shape = (2 * n, st.cols)
        xs = [inp(i, shape) for i in range(n)]
        got = g.reduce_scatter(xs[r], op=op, timeout=timeout)
        check(f"reduce_scatter {op}", got, reference(xs, op, dt)[2 * r:2 * r + 2], op)
        return xs[r].nbytes, problems
    if kind == "reduce_scatter_v":
        total = sum(st.rows)
        xs = [inp(i, (total, st.cols)) for i in range(n)]
        got = g.reduce_scatter_v(xs[r], st.rows, op=op, timeout=timeout)
        off = sum(st.rows[:r])
        check(f"reduce_scatter_v {op}", got, reference(xs, op, dt)[off:off + st.rows[r]], op)
        return xs[r].nbytes, problems
    if kind == "all_to_all":
        shape = (2 * n, st.cols)
        xs = [inp(i, shape, None) for i in range(n)]
        got = g.all_to_all(xs[r], timeout=timeout)
        check("all_to_all", got, np.concatenate([xs[i][2 * r:2 * r + 2] for i in range(n)]))
        return xs[r].nbytes, problems
    if kind == "all_to_all_v":
        m = st.matrix  # m[i][j]: rows member i sends to member j
        xs = [inp(i, (int(m[i].sum()), st.cols), None) for i in range(n)]
        got, counts = g.all_to_all_v(xs[r], [int(v) for v in m[r]], timeout=timeout)
        want = [xs[i][int(m[i][:r].sum()):int(m[i][:r + 1].sum())] for i in range(n)]
        check("all_to_all_v", got, np.concatenate(want))
        if counts != [int(m[i][r]) for i in range(n)]:
            problems.append(f"all_to_all_v counts {counts}")
        return xs[r].nbytes, problems
    if kind == "gather":
        xs = [inp(i, (st.count,), None) for i in range(n)]
        got = g.gather(xs[r], st.root, timeout=timeout)
        if r == st.root:
            check(f"gather root={st.root}", got, np.stack(xs))
        elif got is not None:
            problems.append("gather returned data on a non-root rank")
        return xs[r].nbytes, problems
    if kind == "scatter":
        full = inp(st.root, (n, st.cols), None)
        out = g.scatter(full if r == st.root else None, st.root,
                        out=None if r == st.root else np.empty(st.cols, dt), timeout=timeout)
        check(f"scatter root={st.root}", out, full[r])
        return full.nbytes if r == st.root else 0, problems
    if kind == "sendrecv":
        if n == 1:
            return 0, problems
        xs = [inp(i, (st.count,), None) for i in range(n)]
        buf = np.empty_like(xs[r])
        w = g.isend(xs[r], (r + 1) % n, tag=st.root, timeout=timeout)
        g.recv(buf, (r - 1) % n, tag=st.root, timeout=timeout)
        w.wait()
        check("send/recv", buf, xs[(r - 1) % n])
        return xs[r].nbytes, problems
    if kind == "barrier":
        g.barrier(timeout=timeout)
        return 0, problems
    raise AssertionError(kind)


# ---- main --------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    max_bytes = parse_size(args.max_bytes)
    pg = meshcoll.init()
    rank = pg.rank
    groups = make_groups(pg, args.seed, args.subgroups)
    names = KINDS + [CONTROL]
    calls = np.zeros(len(names), np.int64)
    nbytes = np.zeros(len(names), np.int64)
    errors = np.zeros(len(names), np.int64)
    reports = 0
    t0 = time.monotonic()
    step, stop, crashed = 0, False, False
    while not stop:
        if args.ops:
            stop = step >= args.ops
            if stop:
                break
        elif step % args.check_every == 0:
            flag = np.array([1 if rank == 0 and time.monotonic() - t0 >= args.seconds else 0],
                            np.int32)
            pg.all_reduce(flag, "max", timeout=args.timeout)
            calls[-1] += rank == 0
            if flag[0]:
                break
        st = Step(args.seed, step, groups, max_bytes)
        step += 1
        if st.group is None:
            continue
        k = KINDS.index(st.kind)
        try:
            sent, problems = run_step(st, args.timeout)
        except meshcoll.MeshcollError as e:
            errors[k] += 1
            print(f"[soak] rank {rank} step {step - 1} {st.kind} on {st.label} "
                  f"({st.dtype.name}, count {st.count}, op {st.op}): "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
            crashed = True
            break
        if st.group.rank == 0:
            calls[k] += st.batch if st.kind == "all_reduce_async" else 1
        nbytes[k] += sent
        if problems:
            errors[k] += 1
            if reports < args.max_reports:
                reports += 1
                print(f"[soak] rank {rank} step {step - 1} on {st.label} ({st.dtype.name}, "
                      f"count {st.count}): " + "; ".join(problems), file=sys.stderr, flush=True)
    elapsed = time.monotonic() - t0
    if crashed:
        print(f"[soak] rank {rank}: stopping after an exception; this rank's counts: calls "
              f"{int(calls.sum())}, errors {int(errors.sum())}", file=sys.stderr, flush=True)
        return 1
    table = pg.all_gather(np.concatenate([calls, nbytes, errors]), timeout=args.timeout)
    calls, nbytes, errors = (table[:, i * len(names):(i + 1) * len(names)].sum(axis=0)
                             for i in range(3))
    if rank == 0:
        print_summary(args, pg, groups, names, calls, nbytes, errors, elapsed, step)
    meshcoll.destroy()
    return 1 if errors.sum() else 0


def print_summary(args, pg, groups, names, calls, nbytes, errors, elapsed, steps):
    transports = {}
    for label, g, _ in groups:
        if g is not None:
            transports[label] = g.transport.split(" ")[0]
    print(f"# meshcoll {meshcoll.__version__}  soak  ranks={pg.size}  seed={args.seed}  "
          f"seconds={elapsed:.1f}  steps={steps}  max-bytes={args.max_bytes}")
    print("# groups: " + ", ".join(label for label, _, _ in groups))
    print("# rank 0's transports: " + ", ".join(f"{k}={v}" for k, v in transports.items()))
    print(f"# {'collective':>18} {'calls':>9} {'bytes':>14} {'':>12} {'errors':>7}")
    for i, name in enumerate(names):
        print(f"  {name:>18} {int(calls[i]):>9} {int(nbytes[i]):>14} {human(int(nbytes[i])):>12} "
              f"{int(errors[i]):>7}")
    total_calls, total_bytes, total_errors = int(calls.sum()), int(nbytes.sum()), int(errors.sum())
    print(f"  {'total':>18} {total_calls:>9} {total_bytes:>14} {human(total_bytes):>12} "
          f"{total_errors:>7}")
    print(f"# {total_calls / elapsed:.1f} calls/s, {total_bytes / elapsed / 1e6:.1f} MB/s of "
          f"input over all ranks; errors: {total_errors}")
    if args.json:
        rec = {"ranks": pg.size, "seed": args.seed, "seconds": round(elapsed, 3), "steps": steps,
               "calls": total_calls, "bytes": total_bytes, "errors": total_errors,
               "per_collective": {n: {"calls": int(c), "bytes": int(b), "errors": int(e)}
                                  for n, c, b, e in zip(names, calls, nbytes, errors)}}
        with open(args.json, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    sys.exit(main())
