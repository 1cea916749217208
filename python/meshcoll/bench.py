"""meshcoll-bench: time collectives and print nccl-tests-style tables.

    meshcoll-bench -N 4 --op all_reduce -b 8 -e 16M -f 2 -c 1
    meshcoll-bench -N 2 --op all_reduce --algo all -b 1K -e 1M --json ar.jsonl --plot ar.png
    meshcoll-run -n 4 -m meshcoll.bench --op all --repeats 5

Run from a shell (no launcher variables set), it starts itself under ``meshcoll-run`` with
``-N/--nproc`` ranks (default 4). Under a launcher (meshcoll-run, torchrun, mpirun, srun)
it joins that job instead. Options follow nccl-tests: ``-b/-e`` the smallest and largest
size (K, M, G suffixes are powers of 1024), ``-f`` the step factor (or ``-i`` a fixed
step when ``-f 1``), ``-n`` timed iterations, ``-w`` warm-up iterations, ``-c`` check.
``-n`` is the iteration count as in nccl-tests, so the rank count is ``-N``.

What the columns mean (the nccl-tests definitions):

* ``size``: bytes per rank of the larger of the input and output buffer. all_reduce,
  broadcast, reduce: the buffer. all_gather: the *output* (``size / ranks`` bytes go in
  from each rank). reduce_scatter: the *input* (each rank keeps ``size / ranks``).
  all_to_all: the send buffer (``size / ranks`` to each peer). Element counts that must
  split evenly across ranks are rounded down to a multiple of the rank count (at least
  one element per rank); a size that rounds to the row before it is skipped.
* ``count``: elements in that buffer. ``time``: microseconds per call, the median over
  ``--repeats`` of the largest per-rank mean over ``-n`` back-to-back calls (each repeat
  starts after a barrier). ``algbw`` = size / time in GB/s (1e9 B/s). ``busbw`` =
  algbw x the factor in ``BUS_FACTORS`` (2(n-1)/n all-reduce; (n-1)/n all-gather,
  reduce-scatter, all-to-all; 1 broadcast, reduce), comparable with the link or memory
  bandwidth whatever the collective. ``#wrong``: elements that differ from the expected
  result, summed over ranks (``N/A`` without ``-c``); a non-zero total makes the exit
  status 1.

The header names the transport the group uses (``shm`` when every rank is on one host,
else ``tcp``; ``--transport`` forces one) and, for all_reduce, the algorithm (``auto``
picks ``shm`` on shared memory, else by size as ``CollectiveConfig.select_all_reduce``).

With several series (``--op a,b`` or ``--algo ring,tree``), every size runs each series in
turn within each repeat, so that the machine's slow moments fall on all series alike; the
tables print at the end. ``--json FILE`` writes one ``json.dumps`` record per table row;
``--plot FILE.png`` draws busbw against size per series (needs ``meshcoll[plot]``).

``--backend nccl`` runs the same tables on GPUs (``-N`` defaults to the visible GPUs; rank r
uses GPU LOCAL_RANK, as ``meshcoll.init(backend="nccl")`` picks it). Buffers are PyTorch
tensors, else CuPy arrays (``--array``; neither is a dependency). Inputs are random: rank
r's element i comes from ``numpy.random.default_rng([seed, r, chunk])``, so every rank can
recompute every other rank's input and ``-c 1`` compares the result, copied to the host,
with a numpy reference (small non-negative integers: exact for sum, prod, min, max in every
dtype; avg of floats within a few ulps, since NCCL scales each input by 1/n first). Time is
nccl-tests': a barrier, ``-n`` back-to-back calls, a device synchronize, on the host clock,
per call; the slowest rank's mean, median over ``--repeats``. ``--algo`` and
``--transport`` are CPU-backend choices (NCCL_ALGO / NCCL_PROTO steer NCCL).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np

import meshcoll
from meshcoll import _C, __version__, _env, arrays

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
_REDUCING = ("all_reduce", "reduce_scatter", "reduce")
_SPLIT = ("all_gather", "reduce_scatter", "all_to_all")  # count must divide by ranks
ALGORITHMS = tuple(a for a in _C.algorithm_names() if a != "auto")
REDOPS = ("sum", "prod", "min", "max", "avg")
BACKENDS = ("cpu", "nccl")
ARRAY_LIBS = ("torch", "cupy")

# numpy name -> the name nccl-tests prints in the type column.
_TYPE_NAMES = {"float32": "float", "float64": "double", "float16": "half",
               "bfloat16": "bfloat16", "int8": "int8", "uint8": "uint8", "int32": "int32",
               "int64": "int64"}
_DTYPE_ALIASES = {"float": "float32", "f32": "float32", "double": "float64",
                  "f64": "float64", "half": "float16", "f16": "float16", "bf16": "bfloat16"}
_SENTINEL = 100  # written into outputs before a check; no expected value reaches it


# ---- sizes and arguments -------------------------------------------------------------

def parse_size(text: str) -> int:
    """``"8"``, ``"4K"``, ``"16M"``, ``"1G"`` (also ``KB``/``KiB``): bytes, powers of 1024."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 8, 4K, 16M, 1G)")
    return int(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " ")


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


def numpy_dtype(name: str) -> np.dtype:
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _TYPE_NAMES:
        raise SystemExit(f"meshcoll-bench: unknown --dtype {name!r}; use one of "
                         f"{', '.join(_TYPE_NAMES)}")
    try:
        return arrays.numpy_dtype(name, "meshcoll-bench: --dtype bfloat16")
    except ImportError as e:
        raise SystemExit(str(e)) from None


def _list_arg(text: str, choices: Sequence[str], what: str) -> List[str]:
    items = list(choices) if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in choices]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"{what}: unknown {', '.join(map(repr, bad)) or 'empty list'}; use 'all' or a "
            f"comma-separated list of {', '.join(choices)}")
    return list(dict.fromkeys(items))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="meshcoll-bench",
        description="Time meshcoll collectives; print nccl-tests-style tables.",
        epilog="Without launcher variables it runs itself under meshcoll-run with -N ranks.")
    p.add_argument("-N", "--nproc", type=int, default=None,
                   help="ranks to start when not already under a launcher (default 4)")
    p.add_argument("--op", default="all_reduce",
                   type=lambda s: _list_arg(s, OPS, "--op"),
                   help=f"collective(s), comma-separated, or 'all': {', '.join(OPS)}")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"),
                   help="smallest size (default 8)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("16M"),
                   help="largest size (default 16M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2,
                   help="multiply the size by this each step (default 2; 1: add -i)")
    p.add_argument("-i", "--stepbytes", type=parse_size, default=parse_size("1M"),
                   help="bytes added each step when -f is 1 (default 1M)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed calls (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5,
                   help="untimed calls before timing (default 5)")
    p.add_argument("-c", "--check", type=int, default=1,
                   help="1: verify each size's result against a known pattern (default 1)")
    p.add_argument("-d", "--dtype", default="float32",
                   help="float32 (default), float64, float16, bfloat16, int8, uint8, "
                        "int32, int64")
    p.add_argument("--redop", default="sum", choices=REDOPS,
                   help="reduction of all_reduce, reduce_scatter, reduce (default sum)")
    p.add_argument("--algo", default="auto",
                   type=lambda s: _list_arg(s, ("auto",) + ALGORITHMS, "--algo"),
                   help="all_reduce algorithm(s), comma-separated, or 'all' (default auto)")
    p.add_argument("-r", "--root", type=int, default=0, help="root of broadcast and reduce")
    p.add_argument("--backend", default="cpu", choices=list(BACKENDS),
                   help="cpu (default): numpy buffers; nccl: CUDA buffers, one GPU per rank")
    p.add_argument("--array", default="auto", choices=["auto"] + list(ARRAY_LIBS),
                   help="--backend nccl: allocate device buffers with torch or cupy (default "
                        "auto: torch when importable, else cupy)")
    p.add_argument("--seed", type=int, default=1234,
                   help="--backend nccl: seed of the random inputs (default 1234)")
    p.add_argument("--transport", default=None, choices=["auto", "shm", "tcp"],
                   help="set MESHCOLL_TRANSPORT for the ranks (default: as the environment "
                        "says, else auto: shared memory when every rank is on one host)")
    p.add_argument("--repeats", type=int, default=3,
                   help="repeat the timed loop this often and report the median (default 3)")
    p.add_argument("--max-segment-bytes", type=parse_size, default=None,
                   help="override the group's CollectiveConfig.max_segment_bytes")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write each row as one JSON record per line")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw busbw against size per series (needs matplotlib)")
    a = p.parse_args(argv)
    if isinstance(a.algo, str):  # the default skips the type conversion
        a.algo = [a.algo]
    if isinstance(a.op, str):
        a.op = [a.op]
    if a.nproc is not None and a.nproc < 1:
        p.error(f"--nproc must be >= 1, got {a.nproc}")
    if not 0 < a.minbytes <= a.maxbytes:
        p.error(f"need 0 < -b <= -e, got -b {a.minbytes} -e {a.maxbytes}")
    if a.stepfactor < 1 or (a.stepfactor == 1 and a.stepbytes < 1):
        p.error("-f must be >= 1, and -i >= 1 when -f is 1")
    if a.iters < 1 or a.warmup_iters < 0 or a.repeats < 1:
        p.error("need -n >= 1, -w >= 0 and --repeats >= 1")
    if a.algo != ["auto"] and "all_reduce" not in a.op:
        p.error("--algo chooses the all_reduce algorithm; add all_reduce to --op")
    if a.backend == "nccl":
        if a.algo != ["auto"]:
            p.error("--algo is a CPU-backend choice; NCCL picks its own (set NCCL_ALGO)")
        if a.transport is not None or a.max_segment_bytes is not None:
            p.error("--transport and --max-segment-bytes are CPU-backend options")
    elif a.array != "auto":
        p.error("--array applies to --backend nccl only")
    return a


# ---- verification patterns -----------------------------------------------------------
# Small non-negative integers: exact in every dtype (float16 and bfloat16 included) and
# under any summation order, so a check is an exact comparison. Reductions use
# v_r(i) = b(i) + n*[i mod n == r]: the sum n*b + n, the average b + 1, the max b + n,
# the min b (n > 1) are all exact, and every rank's contribution shows. prod uses a 2 on
# one rank per element (1 elsewhere), so it cannot overflow. Data movement uses
# m_r(i) = (i + 7r) mod 13, different for every rank and position.

def _b(i: np.ndarray) -> np.ndarray:
    return (3 * i + 1) % 5


def reduce_input(rank: int, n: int, i: np.ndarray, redop: str) -> np.ndarray:
    if redop == "prod":
        return np.where(i % (n + 1) == rank, 2, 1)
    return _b(i) + n * (i % n == rank)


def reduce_expected(n: int, i: np.ndarray, redop: str) -> np.ndarray:
    if redop == "prod":
        return np.where(i % (n + 1) < n, 2, 1)
    b = _b(i)
    return {"sum": n * b + n, "avg": b + 1, "max": b + n, "min": b + (n if n == 1 else 0)}[redop]


def move_input(rank: int, i: np.ndarray) -> np.ndarray:
    return (i + 7 * rank) % 13


# ---- one collective at one size --------------------------------------------------------

@dataclass
class Series:
    op: str
    algo: Optional[str]  # all_reduce only

    @property
    def label(self) -> str:
        return f"{self.op}/{self.algo}" if self.algo else self.op


def element_counts(op: str, nbytes: int, itemsize: int, n: int) -> int:
    """Elements in the buffer that ``size`` measures (see the module docstring)."""
    count = max(nbytes // itemsize, 1)
    if op in _SPLIT:
        count = max(count // n, 1) * n
    return count


class Case:
    """Buffers and the call for one series at one element count on this rank."""

    def __init__(self, pg, series: Series, count: int, dtype: np.dtype, redop: str, root: int):
        self.pg, self.series, self.count, self.dtype = pg, series, count, dtype
        self.redop, self.root = redop, root
        n, op = pg.size, series.op
        self.blk = count // n if op in _SPLIT else count
        in_count = self.blk if op == "all_gather" else count
        self.x = np.empty(in_count, dtype)
        self.out = None
        if op in ("all_gather", "all_to_all"):
            self.out = np.empty(count, dtype)
        elif op == "reduce_scatter":
            self.out = np.empty(self.blk, dtype)
        self.fill()

    def fill(self) -> None:
        """Write this rank's pattern into the input (and a sentinel into the output)."""
        r, n, op = self.pg.rank, self.pg.size, self.series.op
        i = np.arange(self.x.size, dtype=np.int64)
        if op in _REDUCING:
            self.x[...] = reduce_input(r, n, i, self.redop)
        else:  # all_to_all: block j of it goes to rank j
            self.x[...] = move_input(r, i)
        if self.out is not None:
            self.out[...] = _SENTINEL

    def run(self) -> None:
        pg, op = self.pg, self.series.op
        if op == "all_reduce":
            pg.all_reduce(self.x, self.redop, algorithm=self.series.algo)
        elif op == "reduce":
            pg.reduce(self.x, self.root, self.redop)
        elif op == "broadcast":
            pg.broadcast(self.x, self.root)
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
        return e.astype(self.dtype)

    def result(self) -> np.ndarray:
        return self.x if self.out is None else self.out

    def check(self) -> int:
        """Run once on fresh inputs; elements wrong on this rank."""
        self.fill()
        self.run()
        return int(np.count_nonzero(self.result() != self.expected()))


# ---- the NCCL backend: device buffers, random inputs, a host reference -------------------
# Rank r's input is a sequence of chunks; chunk k holds default_rng([seed, r, k]) integers
# in the op kind's range (lengths depend only on the buffer's element count, which every
# rank knows), so any rank recomputes any rank's input, a chunk at a time, without the
# memory of n full buffers. The ranges keep every result an exact small integer in every
# dtype: reductions 0..3 (prod 1..2: at most 2**n), data movement 0..63. The results are
# compared a chunk at a time, in float64 (floats) or int64 (integers).

_CHUNK = 1 << 22  # elements per generated chunk
_RANGES = {"reduce": (0, 4), "prod": (1, 3), "move": (0, 64)}
_INTS = ("int8", "uint8", "int32", "int64")
_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23,
        "float64": 2.0 ** -52}


@dataclass(frozen=True)
class DeviceDType:
    """What the table needs of a dtype that may have no numpy counterpart (bfloat16
    without ml_dtypes): the numpy-style name and the element size."""
    name: str
    itemsize: int


_ITEMSIZES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
              "int32": 4, "int64": 8}


def device_dtype(name: str) -> DeviceDType:
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _ITEMSIZES:
        raise SystemExit(f"meshcoll-bench: unknown --dtype {name!r}; use one of "
                         f"{', '.join(_ITEMSIZES)}")
    return DeviceDType(name, _ITEMSIZES[name])


def rank_values(seed: int, rank: int, in_count: int, start: int, stop: int,
                kind: str) -> np.ndarray:
    """Elements ``[start, stop)`` of rank ``rank``'s ``in_count``-element input (uint8)."""
    lo, hi = _RANGES[kind]
    chunk = max(min(_CHUNK, in_count), 1)
    parts = []
    for k in range(start // chunk, (stop - 1) // chunk + 1 if stop > start else 0):
        c0 = k * chunk
        vals = np.random.default_rng([seed, rank, k]).integers(
            lo, hi, min(chunk, in_count - c0), dtype=np.uint8)
        parts.append(vals[max(start - c0, 0):stop - c0])
    return np.concatenate(parts) if parts else np.empty(0, np.uint8)


def reference_reduce(parts: Sequence[np.ndarray], redop: str, dtype: str) -> np.ndarray:
    """The reduction of every rank's values, as the device computes it in ``dtype``
    (integers wrap), in float64 for floats and int64 for integers."""
    a = np.stack([p.astype(np.int64) for p in parts])
    n = len(parts)
    if redop == "sum":
        r = a.sum(0)
    elif redop == "prod":
        r = a.prod(0)
    elif redop == "min":
        r = a.min(0)
    elif redop == "max":
        r = a.max(0)
    elif dtype in _INTS:  # avg of integers: the sum divided by n, truncated (non-negative)
        r = a.sum(0) // n
    else:
        return a.sum(0) / n
    if dtype in _INTS:
        return r.astype(dtype).astype(np.int64)
    return r.astype(np.float64)


def count_wrong(got: np.ndarray, want: np.ndarray, dtype: str, n: int, inexact: bool) -> int:
    """Elements of ``got`` that differ from ``want``; ``inexact`` (avg of floats) allows a
    relative error of (n + 1) ulps of ``dtype``."""
    if inexact:
        tol = (n + 1) * _EPS[dtype] * np.maximum(np.abs(want), 1.0)
        bad = ~(np.abs(got - want) <= tol)  # NaN counts as wrong
    else:
        bad = got != want
    return int(np.count_nonzero(bad))


class TorchArrays:
    """Device buffers as PyTorch CUDA tensors (ops run on torch's current stream)."""

    name = "torch"

    def __init__(self, device: int):
        import torch
        self.torch = torch
        torch.cuda.set_device(device)
        self.device = torch.device("cuda", device)

    def empty(self, count: int, dtype: str):
        return self.torch.empty(count, dtype=getattr(self.torch, dtype), device=self.device)

    def write(self, x, start: int, values: np.ndarray) -> None:
        x[start:start + values.size].copy_(self.torch.from_numpy(values).to(self.device))

    def fill(self, x, value) -> None:
        x.fill_(value)

    def read(self, x, start: int, stop: int, integer: bool) -> np.ndarray:
        t = x[start:stop].to(self.torch.int64 if integer else self.torch.float64)
        return t.cpu().numpy()

    def synchronize(self) -> None:
        self.torch.cuda.synchronize(self.device)


class CupyArrays:
    """Device buffers as CuPy arrays (no bfloat16: CuPy has none)."""

    name = "cupy"

    def __init__(self, device: int):
        import cupy
        self.cupy = cupy
        self.dev = cupy.cuda.Device(device)
        self.dev.use()

    def empty(self, count: int, dtype: str):
        if dtype == "bfloat16":
            raise SystemExit("meshcoll-bench: CuPy has no bfloat16; use --array torch")
        with self.dev:
            return self.cupy.empty(count, dtype=np.dtype(dtype))

    def write(self, x, start: int, values: np.ndarray) -> None:
        with self.dev:
            x[start:start + values.size] = self.cupy.asarray(values).astype(x.dtype)

    def fill(self, x, value) -> None:
        x.fill(value)

    def read(self, x, start: int, stop: int, integer: bool) -> np.ndarray:
        return self.cupy.asnumpy(x[start:stop]).astype(np.int64 if integer else np.float64)

    def synchronize(self) -> None:
        self.dev.synchronize()


def array_library(choice: str) -> str:
    """"torch" or "cupy": ``choice``, or for "auto" the first importable one. Raises
    SystemExit naming both when neither is installed."""
    libs = ARRAY_LIBS if choice == "auto" else (choice,)
    for lib in libs:
        if importlib.util.find_spec(lib) is not None:
            return lib
    raise SystemExit(f"meshcoll-bench: --backend nccl allocates device buffers with "
                     f"{' or '.join(libs)}, and {'neither is' if len(libs) > 1 else 'it is not'} "
                     f"installed (pip install torch, or cupy-cuda12x / cupy-cuda13x)")


def make_arrays(choice: str, device: int):
    return {"torch": TorchArrays, "cupy": CupyArrays}[array_library(choice)](device)


class DeviceCase(Case):
    """A Case whose buffers live on the GPU (``arrays``: TorchArrays, CupyArrays, or any
    object with their methods), filled with random data and checked against a host
    reference. ``run`` and ``result`` are Case's."""

    def __init__(self, pg, series: Series, count: int, dtype: DeviceDType, redop: str, root: int,
                 arrays, seed: int):
        self.pg, self.series, self.count, self.dtype = pg, series, count, dtype
        self.redop, self.root, self.arrays, self.seed = redop, root, arrays, seed
        n, op = pg.size, series.op
        self.blk = count // n if op in _SPLIT else count
        self.in_count = self.blk if op == "all_gather" else count
        self.kind = ("prod" if redop == "prod" else "reduce") if op in _REDUCING else "move"
        self.x = arrays.empty(self.in_count, dtype.name)
        self.out = None
        if op in ("all_gather", "all_to_all"):
            self.out = arrays.empty(count, dtype.name)
        elif op == "reduce_scatter":
            self.out = arrays.empty(self.blk, dtype.name)
        self.fill()

    def values(self, rank: int, start: int, stop: int) -> np.ndarray:
        return rank_values(self.seed, rank, self.in_count, start, stop, self.kind)

    def fill(self) -> None:
        for a in range(0, self.in_count, _CHUNK):
            self.arrays.write(self.x, a, self.values(self.pg.rank, a, min(a + _CHUNK, self.in_count)))
        if self.out is not None:
            self.arrays.fill(self.out, _SENTINEL)

    def expected_range(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of this rank's result (float64 / int64)."""
        r, n, op, blk = self.pg.rank, self.pg.size, self.series.op, self.blk
        integer = self.dtype.name in _INTS
        as_result = (lambda v: v.astype(np.int64)) if integer else (lambda v: v.astype(np.float64))
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
        res, integer = self.result(), self.dtype.name in _INTS
        inexact = self.redop == "avg" and not integer and self.series.op in _REDUCING and \
            (self.series.op != "reduce" or self.pg.rank == self.root)
        size = self.blk if self.series.op == "reduce_scatter" else self.count
        wrong = 0
        for a in range(0, size, _CHUNK):
            b = min(a + _CHUNK, size)
            wrong += count_wrong(self.arrays.read(res, a, b, integer), self.expected_range(a, b),
                                 self.dtype.name, self.pg.size, inexact)
        return wrong


# ---- timing --------------------------------------------------------------------------

def time_loop(pg, run: Callable[[], None], iters: int) -> float:
    """Seconds per call: the largest over ranks of each rank's mean over ``iters`` calls
    that start together after a barrier."""
    pg.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    t = np.array([(time.perf_counter() - t0) / iters])
    pg.all_reduce(t, "max")
    return float(t[0])


def device_time_loop(pg, run: Callable[[], None], iters: int, arrays) -> float:
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

    def case(self, pg, series: Series, count: int, dtype, args: argparse.Namespace) -> Case:
        return Case(pg, series, count, dtype, args.redop, args.root)

    def sum_over_ranks(self, pg, value: int) -> int:
        w = np.array([value], np.int64)
        pg.all_reduce(w, "sum")
        return int(w[0])

    def time_loop(self, pg, run: Callable[[], None], iters: int) -> float:
        return time_loop(pg, run, iters)


class DeviceRunner(HostRunner):
    """The NCCL backend: device buffers from ``arrays``, random inputs, device timing.
    Host integers go through the NCCL group's host all_gather."""

    def __init__(self, arrays, seed: int):
        self.arrays, self.seed = arrays, seed

    def case(self, pg, series: Series, count: int, dtype, args: argparse.Namespace) -> Case:
        return DeviceCase(pg, series, count, dtype, args.redop, args.root, self.arrays, self.seed)

    def sum_over_ranks(self, pg, value: int) -> int:
        return int(pg.all_gather(np.array([value], np.int64)).sum())

    def time_loop(self, pg, run: Callable[[], None], iters: int) -> float:
        return device_time_loop(pg, run, iters, self.arrays)


def make_record(series: Series, *, count: int, dtype: np.dtype, redop: str, times_s: List[float],
                wrong: Optional[int], ranks: int, transport: str,
                args: argparse.Namespace) -> dict:
    t = statistics.median(times_s)
    size = count * dtype.itemsize
    algbw = size / t / 1e9
    return {
        "op": series.op, "algo": series.algo, "series": series.label,
        "size": size, "count": count, "type": _TYPE_NAMES[dtype.name],
        "redop": redop if series.op in _REDUCING else "none",
        "root": args.root if series.op in ("broadcast", "reduce") else None,
        "time": t * 1e6, "algbw": algbw, "busbw": algbw * BUS_FACTORS[series.op](ranks),
        "wrong": wrong, "times": [x * 1e6 for x in times_s],
        "ranks": ranks, "backend": args.backend, "transport": transport, "iters": args.iters,
        "warmup": args.warmup_iters, "repeats": args.repeats,
        "library": "meshcoll", "version": __version__,
    }


def measure(pg, series_list: Sequence[Series], sizes: Iterable[int], args: argparse.Namespace,
            dtype: np.dtype, on_row: Optional[Callable[[dict], None]] = None,
            runner: Optional[HostRunner] = None) -> List[dict]:
    """Every series at every size; returns the records in (series, size) order.
    ``runner``: HostRunner() (the default, CPU backend) or a DeviceRunner."""
    runner = runner or HostRunner()
    rows: Dict[str, List[dict]] = {s.label: [] for s in series_list}
    last = {s.label: None for s in series_list}
    for nbytes in sizes:
        cases = []
        for s in series_list:
            count = element_counts(s.op, nbytes, dtype.itemsize, pg.size)
            if count != last[s.label]:
                last[s.label] = count
                cases.append(runner.case(pg, s, count, dtype, args))
        wrong = {}
        for c in cases:
            if args.check:
                wrong[c.series.label] = runner.sum_over_ranks(pg, c.check())
            for _ in range(args.warmup_iters):
                c.run()
        times: Dict[str, List[float]] = {c.series.label: [] for c in cases}
        for _ in range(args.repeats):
            for c in cases:  # interleaved: a noisy moment hits every series
                times[c.series.label].append(runner.time_loop(pg, c.run, args.iters))
        for c in cases:
            rec = make_record(c.series, count=c.count, dtype=dtype, redop=args.redop,
                              times_s=times[c.series.label],
                              wrong=wrong.get(c.series.label), ranks=pg.size,
                              transport=transport_name(pg), args=args)
            rows[c.series.label].append(rec)
            if on_row is not None:
                on_row(rec)
        del cases  # free this size's buffers before the next, larger one
    return [r for s in series_list for r in rows[s.label]]


# ---- output --------------------------------------------------------------------------

def transport_name(pg) -> str:
    """"shm" or "tcp" (the group's transport string may add why shm was not used)."""
    return pg.transport.split()[0]


def header(series: Series, args: argparse.Namespace, pg, device_note: str = "") -> str:
    """``device_note``: what the NCCL backend adds (library version, array library)."""
    extra = f"  transport={transport_name(pg)}"
    if series.op == "all_reduce":
        extra += f"  algo={series.algo}"
    elif series.op in ("broadcast", "reduce"):
        extra += f"  root={args.root}"
    timing = (" (host clock around -n calls and a device synchronize)"
              if args.backend == "nccl" else "")
    return "\n".join([
        f"# meshcoll {__version__}  {series.op}  backend={args.backend}  ranks={pg.size}  "
        f"iters={args.iters} warmup={args.warmup_iters}{extra}{device_note}",
        f"# time: median of {args.repeats} repeat(s) of the slowest rank's mean per call{timing}",
        "#" + f"{'size':>11}{'count':>10}{'type':>9}{'redop':>7}{'time':>9}"
              f"{'algbw':>8}{'busbw':>8}{'#wrong':>8}",
        "#" + f"{'(B)':>11}{'(elems)':>10}{'':>9}{'':>7}{'(us)':>9}{'(GB/s)':>8}{'(GB/s)':>8}",
    ])


def format_row(r: dict) -> str:
    t = r["time"]
    ts = f"{t:9.2f}" if t < 1e5 else f"{t:9.0f}"
    wrong = "N/A" if r["wrong"] is None else str(r["wrong"])
    return (f"{r['size']:12d}{r['count']:10d}{r['type']:>9}{r['redop']:>7}{ts}"
            f"{r['algbw']:8.2f}{r['busbw']:8.2f}{wrong:>8}")


def footer(records: Sequence[dict]) -> str:
    avg = sum(r["busbw"] for r in records) / len(records) if records else 0.0
    return f"# Avg bus bandwidth : {avg:.4g}"


def plot_records(records: Sequence[dict], path: str, *, title: Optional[str] = None,
                 key: str = "series") -> None:
    """busbw against size, one line per distinct ``record[key]``; writes ``path``."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("meshcoll-bench: --plot needs matplotlib "
                         "(pip install 'meshcoll[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(r[key] for r in records):
        pts = sorted((r["size"], r["busbw"]) for r in records if r[key] == name)
        ax.plot([s for s, _ in pts], [b for _, b in pts], marker="o", ms=3, label=name)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: format_size(int(v)) if v >= 1 else ""))
    bws = [r["busbw"] for r in records if r["busbw"] > 0]
    if bws and max(bws) > 100 * min(bws):
        ax.set_yscale("log")  # small sizes would sit flat on the axis otherwise
    ax.set_xlabel("size (bytes per rank)")
    ax.set_ylabel("busbw (GB/s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- entry point ---------------------------------------------------------------------

def _launched() -> bool:
    """True under meshcoll-run, torchrun, mpirun or srun (any rank variables set)."""
    return _env._find_scheme(os.environ) is not None


def nccl_preflight(args: argparse.Namespace) -> int:
    """For --backend nccl: the visible GPU count, after checking that NCCL loads, a GPU is
    visible and an array library is installed; SystemExit saying which is missing."""
    from meshcoll import nccl
    ok, why = nccl.nccl_available()
    if not ok:
        raise SystemExit(f"meshcoll-bench: --backend nccl: the NCCL backend is not available "
                         f"here: {why}")
    array_library(args.array)
    return int(_C.cuda_device_count())


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    nccl = args.backend == "nccl"
    if nccl and not _launched():
        # Before starting ranks: say what is missing once, not once per rank. exec below
        # replaces this process, so the CUDA driver it loaded goes with it.
        gpus = nccl_preflight(args)
        if args.nproc is None:
            args.nproc = gpus
        elif args.nproc > gpus:
            raise SystemExit(f"meshcoll-bench: -N {args.nproc} ranks but {gpus} GPUs are "
                             "visible (one rank per GPU)")
    if not _launched():
        # Start the ranks: meshcoll-run runs this module again, once per rank, with the
        # same arguments. exec, so that signals go straight to the launcher.
        cmd = [sys.executable, "-m", "meshcoll.run", "-n", str(args.nproc or 4),
               "--no-prefix", "-m", "meshcoll.bench", *argv]
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, cmd)

    runner, device_note = None, ""
    if nccl:
        dtype = device_dtype(args.dtype)
        nccl_preflight(args)
        pg = meshcoll.init(backend="nccl")  # device: the launcher's local rank
        arrays = make_arrays(args.array, pg.device)
        runner = DeviceRunner(arrays, args.seed)
        v = int(_C.nccl_version())  # NCCL_VERSION_CODE: X*10000 + Y*100 + Z since 2.9
        device_note = f"  nccl={v // 10000}.{v // 100 % 100}.{v % 100}  array={arrays.name}"
    else:
        dtype = numpy_dtype(args.dtype)
        if args.transport is not None:
            os.environ[_env.TRANSPORT] = args.transport
        pg = meshcoll.init()
    try:
        if args.nproc is not None and args.nproc != pg.size:
            raise SystemExit(f"meshcoll-bench: --nproc {args.nproc} but the launcher started "
                             f"{pg.size} ranks")
        if not 0 <= args.root < pg.size:
            raise SystemExit(f"meshcoll-bench: --root {args.root} is not a rank of {pg.size}")
        if args.max_segment_bytes is not None:
            pg.config.max_segment_bytes = args.max_segment_bytes
            pg.config.validate()
        series = [Series(op, algo if op == "all_reduce" else None)
                  for op in args.op for algo in (args.algo if op == "all_reduce" else [None])]
        sizes = size_steps(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
        lead = pg.rank == 0
        stream = len(series) == 1 and lead
        if stream:
            print(header(series[0], args, pg, device_note), flush=True)
        records = measure(pg, series, sizes, args, dtype,
                          on_row=(lambda r: print(format_row(r), flush=True)) if stream else None,
                          runner=runner)
        wrong = sum(r["wrong"] or 0 for r in records)
        if lead:
            for i, s in enumerate(series):
                rows = [r for r in records if r["series"] == s.label]
                if not stream:
                    print(("\n" if i else "") + header(s, args, pg, device_note))
                    for r in rows:
                        print(format_row(r))
                print(footer(rows), flush=True)
            if wrong:
                print(f"# Errors: {wrong} wrong elements", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    for r in records:
                        f.write(json.dumps(r) + "\n")
            if args.plot:
                plot_records(records, args.plot,
                             title=f"meshcoll {__version__}, {pg.size} ranks, {args.dtype}")
        pg.barrier()
    finally:
        meshcoll.destroy()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
