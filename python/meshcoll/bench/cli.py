"""meshcoll-bench's command line: the options, and ``main``, which starts the ranks under
meshcoll-run (or joins the launcher's job), measures and prints."""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

import meshcoll
from meshcoll import _C, __version__, _rendezvous, _settings
from meshcoll._types import AlgorithmName

from .buffers import ARRAY_LIBS, INTS, array_library, device_dtype, make_arrays, numpy_dtype
from .cases import (CHOOSING, OPS, REDOPS, BenchDType, DeviceRunner, Series,
                    algorithms_for, measure, parse_size, size_steps, split_algo, transport_name)
from .report import (check_plot_dependencies, format_row, header, plot_records, print_tables,
                     write_csv, write_json)
from .verify import BITWISE

BACKENDS = ("cpu", "nccl")


def _list_arg(text: str, choices: Sequence[str], what: str) -> List[str]:
    items = list(choices) if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in choices]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"{what}: unknown {', '.join(map(repr, bad)) or 'empty list'}; use 'all' or a "
            f"comma-separated list of {', '.join(choices)}")
    return list(dict.fromkeys(items))


def _algo_arg(text: str) -> List[str]:
    """--algo: 'all', or names any choosing op takes, "tree:k" for a k-ary tree."""
    if text == "all":
        return ["all"]
    names = tuple(dict.fromkeys(("auto",) + tuple(a for v in CHOOSING.values() for a in v)))
    items = [t.strip() for t in text.split(",") if t.strip()]
    for t in items:
        name, arity = split_algo(t) if t.partition(":")[2].isdigit() else (t, None)
        if name not in names or (arity is not None and (name != "tree" or int(arity) < 2)):
            raise argparse.ArgumentTypeError(
                f"--algo: unknown {t!r}; use 'all' or a comma-separated list of "
                f"{', '.join(names)}, or tree:K for a K-ary tree (K >= 2)")
    if not items:
        raise argparse.ArgumentTypeError("--algo: empty list")
    return list(dict.fromkeys(items))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="meshcoll-bench",
        description="Time meshcoll collectives; print nccl-tests-style tables.",
        epilog="Without launcher variables it runs itself under meshcoll-run with -N ranks.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
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
    p.add_argument("-w", "--warmup-iters", type=int, default=5,
                   help="untimed calls before timing (default 5)")
    # nccl-tests' spelling, still understood.
    p.add_argument("--warmup_iters", dest="warmup_iters", type=int, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)
    p.add_argument("-c", "--check", type=int, default=1,
                   help="1: verify each size's result against a known pattern (default 1)")
    p.add_argument("-d", "--dtype", default="float32",
                   help="float32 (default), float64, float16, bfloat16, int8, uint8, "
                        "int32, int64")
    p.add_argument("--redop", default="sum", choices=REDOPS,
                   help="reduction of all_reduce, reduce_scatter, reduce (default sum; band, "
                        "bor, bxor: integer --dtype, CPU backend)")
    p.add_argument("--algo", default="auto", type=_algo_arg,
                   help="algorithm(s) of all_reduce, reduce and broadcast, comma-separated "
                        "(tree:K: a K-ary tree), or 'all': every one each op takes on the "
                        "group's transport, trees of several arities too; each op runs those "
                        "it takes (default auto)")
    p.add_argument("-r", "--root", type=int, default=0, help="root of broadcast and reduce")
    p.add_argument("--backend", default="cpu", choices=list(BACKENDS),
                   help="cpu (default): numpy buffers; nccl: CUDA buffers, one GPU per rank")
    p.add_argument("--array", default="auto", choices=["auto"] + list(ARRAY_LIBS),
                   help="--backend nccl: allocate device buffers with torch or cupy (default "
                        "auto: torch when importable, else cupy)")
    p.add_argument("--seed", type=int, default=1234,
                   help="--backend nccl: seed of the random inputs (default 1234)")
    p.add_argument("--transport", default=None, choices=list(_settings.TRANSPORTS),
                   help="set MESHCOLL_TRANSPORT for the ranks (default: as the environment "
                        "says, else auto: shared memory when every rank is on one host)")
    p.add_argument("--repeats", type=int, default=3,
                   help="repeat the timed loop this often and report the median (default 3)")
    p.add_argument("--max-segment-bytes", type=parse_size, default=None,
                   help="override the group's CollectiveConfig.max_segment_bytes")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write each record (a row's out-of-place or in-place half) as "
                        "one JSON record per line")
    p.add_argument("--csv", metavar="FILE", default=None,
                   help="also write the same records as CSV, with a header line")
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
    if a.redop in BITWISE and a.dtype not in INTS:
        p.error(f"--redop {a.redop} takes an integer --dtype ({', '.join(INTS)}), "
                f"got {a.dtype}")
    if a.algo != ["auto"] and not set(CHOOSING) & set(a.op):
        p.error(f"--algo chooses the algorithm of {', '.join(CHOOSING)}; add one to --op")
    if a.backend == "nccl":
        if a.algo != ["auto"]:
            p.error("--algo is a CPU-backend choice; NCCL picks its own (set NCCL_ALGO)")
        if a.transport is not None or a.max_segment_bytes is not None:
            p.error("--transport and --max-segment-bytes are CPU-backend options")
        if a.redop in BITWISE:
            p.error(f"--redop {a.redop}: NCCL has no bitwise reductions (the CPU backend has)")
    elif a.array != "auto":
        p.error("--array applies to --backend nccl only")
    if a.transport == "tcp" and "shm" in a.algo:
        p.error("--algo shm needs shared memory, and --transport tcp has none; "
                f"over tcp: {', '.join(algorithms_for('tcp'))} (or --algo all)")
    return a


def resolve_algorithms(requested: Sequence[str], transport: str,
                       op: str = "all_reduce") -> List[str]:
    """``--algo`` for ``op`` against the group's transport: 'all' is every algorithm the op
    has there (``algorithms_for``); of a list, the names the op takes (another op's are
    left to it). A name of the op it lacks on this transport (all_reduce's shm when shared
    memory was not usable, broadcast's ring on shared memory) is a SystemExit saying so."""
    have = algorithms_for(transport, op)
    if list(requested) == ["all"]:
        return list(have)
    takes = ("auto",) + CHOOSING.get(op, ())
    mine = [a for a in requested if split_algo(a)[0] in takes]
    lacking = [a for a in mine if a != "auto" and split_algo(a)[0] not in map(
        lambda h: split_algo(h)[0], have)]
    if lacking:
        raise SystemExit(f"meshcoll-bench: --algo {', '.join(lacking)}: not available for {op} "
                         f"on this group's transport ({transport}); it has {', '.join(have)}")
    return mine


# ---- entry point ---------------------------------------------------------------------

def _launched() -> bool:
    """True under meshcoll-run, torchrun, mpirun or srun (any rank variables set)."""
    return _rendezvous._find_scheme(os.environ) is not None


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
    if args.plot:
        check_plot_dependencies()  # before any rank starts, not after the whole run
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
        # Start the ranks: meshcoll-run runs meshcoll.bench again, once per rank, with the
        # same arguments. exec, so that signals go straight to the launcher.
        cmd = [sys.executable, "-m", "meshcoll.run", "-n", str(args.nproc or 4),
               "--no-prefix", "-m", "meshcoll.bench", *argv]
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, cmd)

    runner, device_note = None, ""
    dtype: BenchDType
    if nccl:
        dtype = device_dtype(args.dtype)
        nccl_preflight(args)
        pg = meshcoll.init(backend="nccl")  # device: the launcher's local rank
        assert pg.device is not None  # an NCCL group has its device
        arrays = make_arrays(args.array, pg.device)
        runner = DeviceRunner(arrays, args.seed)
        v = int(_C.nccl_version())  # NCCL_VERSION_CODE: X*10000 + Y*100 + Z since 2.9
        device_note = f"  nccl={v // 10000}.{v // 100 % 100}.{v % 100}  array={arrays.name}"
    else:
        dtype = numpy_dtype(args.dtype)
        if args.transport is not None:
            os.environ[_settings.TRANSPORT] = args.transport
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
        # all_reduce's series always name their algorithm (auto by default); the other ops'
        # only when --algo asks for more than auto (their tables stay as they were).
        def algos_of(op: str) -> List[Optional[str]]:
            if op not in CHOOSING:
                return [None]
            got = ["auto"] if nccl else resolve_algorithms(args.algo, transport_name(pg), op)
            if op != "all_reduce" and got in ([], ["auto"]):
                return [None]
            return list(got or ["auto"])

        try:
            per_op = {op: algos_of(op) for op in args.op}
        except SystemExit as e:  # every rank finds it (the transport is the group's): say it once
            raise SystemExit(e.code if pg.rank == 0 else 1) from None
        series = [Series(op, algo) for op in args.op for algo in per_op[op]]
        sizes = size_steps(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
        lead = pg.rank == 0
        stream = len(series) == 1 and lead
        if stream:
            print(header(series[0], args, pg, device_note), flush=True)
        records = measure(pg, series, sizes, args, dtype,
                          on_row=(lambda row: print(format_row(row), flush=True))
                          if stream else None,
                          runner=runner)
        wrong = sum(r["wrong"] or 0 for r in records)
        if lead:
            print_tables(series, records, args, pg, device_note, streamed=stream)
            if wrong:
                print(f"# Errors: {wrong} wrong elements", flush=True)
            if args.json:
                write_json(records, args.json)
            if args.csv:
                write_csv(records, args.csv)
            if args.plot:
                plot_records(records, args.plot,
                             title=f"meshcoll {__version__}, {pg.size} ranks, {args.dtype}")
        pg.barrier()
    finally:
        meshcoll.destroy()
    return 1 if wrong else 0
