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
"""

from __future__ import annotations

import argparse
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
from meshcoll import _C, __version__, _env

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
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise SystemExit("meshcoll-bench: --dtype bfloat16 needs ml_dtypes "
                             "(pip install 'meshcoll[bf16]')") from None
        return np.dtype(ml_dtypes.bfloat16)
    if name not in _TYPE_NAMES:
        raise SystemExit(f"meshcoll-bench: unknown --dtype {name!r}; use one of "
                         f"{', '.join(_TYPE_NAMES)}")
    return np.dtype(name)


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
    p.add_argument("--backend", default="cpu", choices=["cpu"], help="backend (default cpu)")
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
            dtype: np.dtype, on_row: Optional[Callable[[dict], None]] = None) -> List[dict]:
    """Every series at every size; returns the records in (series, size) order."""
    rows: Dict[str, List[dict]] = {s.label: [] for s in series_list}
    last = {s.label: None for s in series_list}
    for nbytes in sizes:
        cases = []
        for s in series_list:
            count = element_counts(s.op, nbytes, dtype.itemsize, pg.size)
            if count != last[s.label]:
                last[s.label] = count
                cases.append(Case(pg, s, count, dtype, args.redop, args.root))
        wrong = {}
        for c in cases:
            if args.check:
                w = np.array([c.check()], np.int64)
                pg.all_reduce(w, "sum")
                wrong[c.series.label] = int(w[0])
            for _ in range(args.warmup_iters):
                c.run()
        times: Dict[str, List[float]] = {c.series.label: [] for c in cases}
        for _ in range(args.repeats):
            for c in cases:  # interleaved: a noisy moment hits every series
                times[c.series.label].append(time_loop(pg, c.run, args.iters))
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


def header(series: Series, args: argparse.Namespace, pg) -> str:
    extra = f"  transport={transport_name(pg)}"
    if series.op == "all_reduce":
        extra += f"  algo={series.algo}"
    elif series.op in ("broadcast", "reduce"):
        extra += f"  root={args.root}"
    return "\n".join([
        f"# meshcoll {__version__}  {series.op}  backend={args.backend}  ranks={pg.size}  "
        f"iters={args.iters} warmup={args.warmup_iters}{extra}",
        f"# time: median of {args.repeats} repeat(s) of the slowest rank's mean per call",
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not _launched():
        # Start the ranks: meshcoll-run runs this module again, once per rank, with the
        # same arguments. exec, so that signals go straight to the launcher.
        cmd = [sys.executable, "-m", "meshcoll.run", "-n", str(args.nproc or 4),
               "--no-prefix", "-m", "meshcoll.bench", *argv]
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, cmd)

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
            print(header(series[0], args, pg), flush=True)
        records = measure(pg, series, sizes, args, dtype,
                          on_row=(lambda r: print(format_row(r), flush=True)) if stream else None)
        wrong = sum(r["wrong"] or 0 for r in records)
        if lead:
            for i, s in enumerate(series):
                rows = [r for r in records if r["series"] == s.label]
                if not stream:
                    print(("\n" if i else "") + header(s, args, pg))
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
