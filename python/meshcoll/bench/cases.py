"""Which collectives, sizes and buffers meshcoll-bench runs, and how it times them:
one ``Case`` per series and size on each rank, ``measure`` over them all."""

from __future__ import annotations

import argparse
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence,
                    Tuple, Union, cast, get_args)

import numpy as np

from meshcoll import _C, __version__
from meshcoll._types import AlgorithmName, ReduceOpName
from meshcoll.collectives import BROADCAST_ALGORITHMS, REDUCE_ALGORITHMS

from .buffers import INTS, TYPE_NAMES, DeviceDType
from .verify import (CHUNK, SENTINEL, count_wrong, move_input, rank_values, reduce_expected,
                     reduce_input, reference_reduce)

if TYPE_CHECKING:
    from meshcoll.process_group import ProcessGroup

Record = Dict[str, Any]  # one table row's cell: JSON-ready
# A dtype as the bench uses it (.name, .itemsize): numpy's, or one numpy may lack (bfloat16).
BenchDType = Union["np.dtype[Any]", DeviceDType]

# busbw = algbw x factor(ranks): the bytes each rank's busiest link carries per byte of
# ``size`` in the bandwidth-optimal algorithm (nccl-tests' PERFORMANCE.md).
BUS_FACTORS: Dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}
OPS = tuple(BUS_FACTORS)
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
SPLIT = ("all_gather", "reduce_scatter", "all_to_all")  # count must divide by ranks
# The all_reduce algorithms --algo can name (the API's names, which tests/python/test_typing.py
# checks against the core's). "shm" needs a shared-memory group; the others run over
# point-to-point links (TCP) on any group.
ALGORITHMS: Tuple[AlgorithmName, ...] = tuple(a for a in get_args(AlgorithmName)
                                              if a not in ("auto", "centralized"))  # = direct
P2P_ALGORITHMS = tuple(a for a in ALGORITHMS if a != "shm")
# The trees ``--algo all`` tries besides the binomial one ("tree"): "tree:k" is a k-ary tree
# (CollectiveConfig.tree_arity; Note [Trees] in csrc/cpu/algo/tree.h). Any k is accepted by name.
TREE_ARITIES = (2, 4, 8)
# The collectives that take an algorithm, and what each takes besides auto (ring: broadcast's
# chain, TCP groups only; shm: all_reduce on shared-memory groups only).
CHOOSING: Dict[str, Tuple[str, ...]] = {
    "all_reduce": ALGORITHMS,
    "reduce": tuple(a for a in REDUCE_ALGORITHMS if a != "auto"),
    "broadcast": tuple(a for a in BROADCAST_ALGORITHMS if a != "auto"),
}
REDOPS: Tuple[ReduceOpName, ...] = get_args(ReduceOpName)  # band, bor, bxor: integers, CPU
# Where each op's result goes, as nccl-tests' two column groups: out-of-place (a buffer of
# its own) and in-place (nccl-tests' aliasing: all_gather's input is this rank's block of
# the output, reduce_scatter's output this rank's block of the input). all_reduce,
# broadcast and reduce work in place in meshcoll's API (no out=); all_to_all's out may not
# alias its input.
PLACEMENTS: Dict[str, Tuple[bool, ...]] = {  # in_place values, out-of-place first
    "all_reduce": (True,), "broadcast": (True,), "reduce": (True,),
    "all_gather": (False, True), "reduce_scatter": (False, True), "all_to_all": (False,),
}


def algorithms_for(transport: str, op: str = "all_reduce") -> Tuple[str, ...]:
    """What ``--algo all`` runs for ``op`` on a group over ``transport`` ("shm" or "tcp"):
    every algorithm the op takes there, trees at each of ``TREE_ARITIES`` too ("tree:4");
    none for an op without a choice (it runs auto). all_reduce's "shm" needs shared memory;
    its other algorithms run over point-to-point links on any group. broadcast's "ring" (the
    chain) is for TCP groups."""
    names = [a for a in CHOOSING.get(op, ()) if
             not (transport != "shm" and a == "shm") and
             not (transport == "shm" and op == "broadcast" and a == "ring")]
    out: List[str] = []
    for a in names:
        out.append(a)
        if a == "tree":
            out += [f"tree:{k}" for k in TREE_ARITIES]
    return tuple(out)


def split_algo(spec: str) -> Tuple[str, Union[int, str]]:
    """``"tree:4"`` -> ("tree", 4); ``"tree"`` -> ("tree", "binomial"); others unchanged."""
    name, _, k = spec.partition(":")
    return name, (int(k) if k else "binomial")


# ---- sizes ---------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """``"8"``, ``"4K"``, ``"16M"``, ``"1G"`` (also ``KB``/``KiB``): bytes, powers of 1024."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 8, 4K, 16M, 1G)")
    return int(m.group(1)) * int(1024 ** " kmgt".index(m.group(2).lower() or " "))


def format_size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def size_steps(minbytes: int, maxbytes: int, factor: int, stepbytes: int) -> List[int]:
    """nccl-tests' sweep: multiply by ``factor`` when it is > 1, else add ``stepbytes``."""
    sizes, s = [], minbytes
    while s <= maxbytes:
        sizes.append(s)
        s = s * factor if factor > 1 else s + stepbytes
    return sizes


# ---- one collective at one size --------------------------------------------------------

@dataclass
class Series:
    op: str
    algo: Optional[str]  # all_reduce, reduce, broadcast: a name, or "tree:k" (split_algo)
    # ``algo`` as the call takes it: the name, and the tree's arity (None: not a tree).
    # Resolved here, once: a small call takes about 2.5 us, so Python work per call in
    # Case.run (a split, a typing cast) doubled what the bench reported (docs/performance.md).
    name: Optional[AlgorithmName] = field(init=False, compare=False, repr=False)
    arity: Union[int, str, None] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        name, arity = split_algo(self.algo) if self.algo is not None else (None, None)
        self.name = cast(Optional[AlgorithmName], name)
        self.arity = arity if name == "tree" else None

    @property
    def label(self) -> str:
        return f"{self.op}/{self.algo}" if self.algo else self.op


def element_counts(op: str, nbytes: int, itemsize: int, n: int) -> int:
    """Elements in the buffer that ``size`` measures (see meshcoll.bench's docstring)."""
    count = max(nbytes // itemsize, 1)
    if op in SPLIT:
        count = max(count // n, 1) * n
    return count


class Case:
    """Buffers and the call for one series at one element count on this rank, in place or
    not (``PLACEMENTS``)."""

    def __init__(self, pg: ProcessGroup, series: Series, count: int, dtype: BenchDType,
                 redop: ReduceOpName, root: int, in_place: Optional[bool] = None):
        self.pg, self.series, self.count, self.dtype = pg, series, count, dtype
        self.redop, self.root = redop, root
        self.in_place = PLACEMENTS[series.op][0] if in_place is None else in_place
        self.allocate(lambda n: np.empty(n, dtype))
        self.fill()

    def allocate(self, empty: Callable[[int], Any]) -> None:
        """The input buffer and, unless the op works in place, the output, each made by
        ``empty(elements)``; ``blk`` is the per-rank block of the ops that split. In place,
        one buffer: the input or output is this rank's block of the other (nccl-tests)."""
        n, r, op, count = self.pg.size, self.pg.rank, self.series.op, self.count
        if self.in_place not in PLACEMENTS[op]:
            raise ValueError(f"{op} has no {'in' if self.in_place else 'out-of'}-place form")
        self.blk = count // n if op in SPLIT else count
        self.in_count = self.blk if op == "all_gather" else count
        self.out = None
        if op == "all_gather":
            self.out = empty(count)
            self.x = self.out[r * self.blk:(r + 1) * self.blk] if self.in_place else \
                empty(self.in_count)
            return
        self.x = empty(self.in_count)
        if op == "all_to_all":
            self.out = empty(count)
        elif op == "reduce_scatter":
            self.out = self.x[r * self.blk:(r + 1) * self.blk] if self.in_place else \
                empty(self.blk)

    def fill(self) -> None:
        """Write this rank's pattern into the input (and a sentinel into the output)."""
        r, n, op = self.pg.rank, self.pg.size, self.series.op
        if self.out is not None:  # first: in place, the input is part of it (or it of the input)
            self.out[...] = SENTINEL
        i = np.arange(self.x.size, dtype=np.int64)
        if op in REDUCING:
            self.x[...] = reduce_input(r, n, i, self.redop)
        else:  # all_to_all: block j of it goes to rank j
            self.x[...] = move_input(r, i)

    def run(self) -> None:
        pg, s = self.pg, self.series
        op, algo = s.op, s.name
        if s.arity is not None:  # the series' tree, whatever another series set before it
            pg.config.tree_arity = s.arity
        if op == "all_reduce":
            pg.all_reduce(self.x, self.redop, algorithm=algo)
        elif op == "reduce":
            pg.reduce(self.x, self.root, self.redop, algorithm=algo)
        elif op == "broadcast":
            pg.broadcast(self.x, self.root, algorithm=algo)
        elif op == "all_gather":
            pg.all_gather(self.x, out=self.out)
        elif op == "reduce_scatter":
            pg.reduce_scatter(self.x, out=self.out, op=self.redop)
        else:
            pg.all_to_all(self.x, out=self.out)

    def expected(self) -> np.ndarray:
        """What this rank's result buffer must hold after one call on fresh inputs."""
        r, n, op, blk = self.pg.rank, self.pg.size, self.series.op, self.blk
        i = np.arange(self.count, dtype=np.int64)
        if op == "all_reduce":
            e = reduce_expected(n, i, self.redop)
        elif op == "reduce":
            e = reduce_expected(n, i, self.redop) if r == self.root else \
                reduce_input(r, n, i, self.redop)  # non-roots keep their input
        elif op == "reduce_scatter":
            e = reduce_expected(n, i[r * blk:(r + 1) * blk], self.redop)
        elif op == "broadcast":
            e = move_input(self.root, i)
        elif op == "all_gather":
            e = move_input(i // blk, i % blk)  # block j is rank j's input
        else:  # all_to_all: block j came from rank j, which sent its block r
            e = move_input(i // blk, r * blk + i % blk)
        assert isinstance(self.dtype, np.dtype)  # host cases; DeviceCase checks its own way
        return e.astype(self.dtype)

    def result(self) -> Any:  # numpy (CPU) or a device array
        return self.x if self.out is None else self.out

    def check(self) -> int:
        """Run once on fresh inputs; elements wrong on this rank."""
        self.fill()
        self.run()
        return int(np.count_nonzero(self.result() != self.expected()))


class DeviceCase(Case):
    """A Case whose buffers live on the GPU (``arrays``: TorchArrays, CupyArrays, or any
    object with their methods), filled with random data and checked against a host
    reference. ``run`` and ``result`` are Case's. Inputs are generated and results compared
    ``chunk`` elements at a time (the same on every rank)."""

    def __init__(self, pg: ProcessGroup, series: Series, count: int, dtype: BenchDType,
                 redop: ReduceOpName, root: int, arrays: Any, seed: int, chunk: int = CHUNK,
                 in_place: Optional[bool] = None):
        self.pg, self.series, self.count, self.dtype = pg, series, count, dtype
        self.redop, self.root, self.arrays, self.seed = redop, root, arrays, seed
        self.in_place = PLACEMENTS[series.op][0] if in_place is None else in_place
        self.chunk = chunk
        op = series.op
        self.kind = ("prod" if redop == "prod" else "reduce") if op in REDUCING else "move"
        self.allocate(lambda n: arrays.empty(n, dtype.name))
        self.fill()

    def values(self, rank: int, start: int, stop: int) -> np.ndarray:
        return rank_values(self.seed, rank, self.in_count, start, stop, self.kind, self.chunk)

    def fill(self) -> None:
        if self.out is not None:  # first: in place, the input is part of it (or it of the input)
            self.arrays.fill(self.out, SENTINEL)
        for a in range(0, self.in_count, self.chunk):
            stop = min(a + self.chunk, self.in_count)
            self.arrays.write(self.x, a, self.values(self.pg.rank, a, stop))

    def expected_range(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of this rank's result (float64 / int64)."""
        r, n, op, blk = self.pg.rank, self.pg.size, self.series.op, self.blk
        integer = self.dtype.name in INTS
        def as_result(v: np.ndarray) -> np.ndarray:
            return v.astype(np.int64 if integer else np.float64)
        if op in ("all_reduce", "reduce", "reduce_scatter"):
            if op == "reduce" and r != self.root:
                return as_result(self.values(r, start, stop))  # non-roots keep their input
            off = r * blk if op == "reduce_scatter" else 0
            parts = [self.values(k, off + start, off + stop) for k in range(n)]
            return reference_reduce(parts, self.redop, self.dtype.name)
        if op == "broadcast":
            return as_result(self.values(self.root, start, stop))
        # all_gather: block j is rank j's input; all_to_all: block j is rank j's block r
        parts = []
        for j in range(start // blk, (stop - 1) // blk + 1):
            a, b = max(start, j * blk) - j * blk, min(stop, (j + 1) * blk) - j * blk
            off = r * blk if op == "all_to_all" else 0
            parts.append(self.values(j, off + a, off + b))
        return as_result(np.concatenate(parts))

    def check(self) -> int:
        """Run once on fresh inputs; elements wrong on this rank."""
        self.fill()
        self.run()
        self.arrays.synchronize()
        return self.verify()

    def verify(self) -> int:
        """Elements of this rank's result that differ from the reference."""
        res, integer = self.result(), self.dtype.name in INTS
        inexact = self.redop == "avg" and not integer and self.series.op in REDUCING and \
            (self.series.op != "reduce" or self.pg.rank == self.root)
        size = self.blk if self.series.op == "reduce_scatter" else self.count
        wrong = 0
        for a in range(0, size, self.chunk):
            b = min(a + self.chunk, size)
            wrong += count_wrong(self.arrays.read(res, a, b, integer), self.expected_range(a, b),
                                 self.dtype.name, self.pg.size, inexact)
        return wrong


# ---- timing --------------------------------------------------------------------------

def time_loop(pg: ProcessGroup, run: Callable[[], None], iters: int) -> float:
    """Seconds per call: the largest over ranks of each rank's mean over ``iters`` calls
    that start together after a barrier."""
    pg.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    t = np.array([(time.perf_counter() - t0) / iters])
    pg.all_reduce(t, "max")
    return float(t[0])


def device_time_loop(pg: ProcessGroup, run: Callable[[], None], iters: int,
                     arrays: Any) -> float:
    """nccl-tests' timing: after a barrier, ``iters`` back-to-back calls, then a device
    synchronize; seconds per call on the host clock, the largest over ranks."""
    pg.barrier()
    arrays.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    arrays.synchronize()
    t = (time.perf_counter() - t0) / iters
    return float(pg.all_gather(np.array([t])).max())  # host metadata through the comm


class HostRunner:
    """How measure() builds cases, sums a count over ranks and times a loop: the CPU
    backend (numpy buffers, exact patterns)."""

    def case(self, pg: ProcessGroup, series: Series, count: int, dtype: BenchDType,
             args: argparse.Namespace, in_place: bool) -> Case:
        return Case(pg, series, count, dtype, args.redop, args.root, in_place)

    def sum_over_ranks(self, pg: ProcessGroup, value: int) -> int:
        w = np.array([value], np.int64)
        pg.all_reduce(w, "sum")
        return int(w[0])

    def time_loop(self, pg: ProcessGroup, run: Callable[[], None], iters: int) -> float:
        return time_loop(pg, run, iters)


class DeviceRunner(HostRunner):
    """The NCCL backend: device buffers from ``arrays``, random inputs, device timing.
    Host integers go through the NCCL group's host all_gather."""

    def __init__(self, arrays: Any, seed: int):
        self.arrays, self.seed = arrays, seed

    def case(self, pg: ProcessGroup, series: Series, count: int, dtype: BenchDType,
             args: argparse.Namespace, in_place: bool) -> Case:
        return DeviceCase(pg, series, count, dtype, args.redop, args.root, self.arrays, self.seed,
                          in_place=in_place)

    def sum_over_ranks(self, pg: ProcessGroup, value: int) -> int:
        return int(pg.all_gather(np.array([value], np.int64)).sum())

    def time_loop(self, pg: ProcessGroup, run: Callable[[], None], iters: int) -> float:
        return device_time_loop(pg, run, iters, self.arrays)


def make_record(series: Series, *, count: int, dtype: BenchDType, redop: str,
                times_s: List[float], wrong: Optional[int], ranks: int, transport: str,
                args: argparse.Namespace, in_place: bool = True) -> Record:
    t = statistics.median(times_s)
    size = count * dtype.itemsize
    algbw = size / t / 1e9
    return {
        "op": series.op, "algo": series.algo, "series": series.label, "in_place": in_place,
        "size": size, "count": count, "type": TYPE_NAMES[dtype.name],
        "redop": redop if series.op in REDUCING else "none",
        "root": args.root if series.op in ("broadcast", "reduce") else None,
        "time": t * 1e6, "algbw": algbw, "busbw": algbw * BUS_FACTORS[series.op](ranks),
        "wrong": wrong, "times": [x * 1e6 for x in times_s],
        "ranks": ranks, "backend": args.backend, "transport": transport, "iters": args.iters,
        "warmup": args.warmup_iters, "repeats": args.repeats,
        "library": "meshcoll", "version": __version__,
    }


def measure(pg: ProcessGroup, series_list: Sequence[Series], sizes: Iterable[int],
            args: argparse.Namespace, dtype: BenchDType,
            on_row: Optional[Callable[[List[Record]], None]] = None,
            runner: Optional[HostRunner] = None) -> List[Record]:
    """Every series at every size, out of place and in place where the op has that form
    (``PLACEMENTS``); returns the records in (series, size, out-of-place first) order.
    ``on_row`` gets each series' records of one size (one table row) as they are made.
    ``runner``: HostRunner() (the default, CPU backend) or a DeviceRunner."""
    runner = runner or HostRunner()
    rows: Dict[str, List[Record]] = {s.label: [] for s in series_list}
    last: Dict[str, Optional[int]] = {s.label: None for s in series_list}
    for nbytes in sizes:
        cases = []
        for s in series_list:
            count = element_counts(s.op, nbytes, dtype.itemsize, pg.size)
            if count != last[s.label]:
                last[s.label] = count
                cases += [runner.case(pg, s, count, dtype, args, p) for p in PLACEMENTS[s.op]]
        wrong = {}
        for c in cases:
            if args.check:
                wrong[id(c)] = runner.sum_over_ranks(pg, c.check())
            for _ in range(args.warmup_iters):
                c.run()
        times: Dict[int, List[float]] = {id(c): [] for c in cases}
        for _ in range(args.repeats):
            for c in cases:  # interleaved: a noisy moment hits every series
                times[id(c)].append(runner.time_loop(pg, c.run, args.iters))
        row: Dict[str, List[Record]] = {}
        for c in cases:
            rec = make_record(c.series, count=c.count, dtype=dtype, redop=args.redop,
                              times_s=times[id(c)], wrong=wrong.get(id(c)), ranks=pg.size,
                              transport=transport_name(pg), args=args, in_place=c.in_place)
            rows[c.series.label].append(rec)
            row.setdefault(c.series.label, []).append(rec)
        if on_row is not None:
            for recs in row.values():
                on_row(recs)
        del cases  # free this size's buffers before the next, larger one
    return [r for s in series_list for r in rows[s.label]]


def transport_name(pg: ProcessGroup) -> str:
    """"shm" or "tcp" (the group's transport string may add why shm was not used)."""
    return str(pg.transport.split()[0])
