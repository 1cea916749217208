"""all_reduce across real processes: every dtype x op x algorithm, odd and empty counts, many
segments, checked against a reference each rank computes on its own from every rank's inputs.

Each rank seeds ``np.random.default_rng(seed + rank)``, so every rank can regenerate every
other rank's input and build the expected result locally, with no extra communication. The
reference is exact where the arithmetic is exact: integers wrap in their own dtype (numpy's
wrapping reductions with ``dtype=``), bools are logic, min/max pick an input value. Float sums
and products get an error bound instead: (world-1) roundings of at most the unit roundoff
times the running |partial| (sum) or the value (prod); f16 and bf16 are combined in f32 and
rounded back to 16 bits at every step (csrc/reduce/kernels.h), which dominates their bound.

All cases of one world run inside one spawned job (a spawn costs ~0.3 s a rank); a child
collects every wrong case and returns them, so one failure reports all the others too.
"""

import hashlib

import ml_dtypes
import numpy as np
import pytest

import meshcoll
from conftest import rand_array
from meshcoll.bench import ALGORITHMS, P2P_ALGORITHMS

DTYPES = ["bool", "int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
OPS = ["sum", "prod", "min", "max", "avg", "band", "bor", "bxor"]
BITWISE = ("band", "bor", "bxor")
# ring, tree, halving_doubling and direct run over TCP; shm (and auto, on one host) in shared
# memory, so the matrix covers both transports.
ALGOS = [*ALGORITHMS, "auto"]
TCP_ALGOS = [*P2P_ALGORITHMS, "auto"]
COUNTS = [0, 1, 1031]  # 1031 is prime: uneven chunks on every world size
SMALL_SEGMENT = 256    # bytes: 1031 elements span 2..33 segments per ring chunk
# A 4 KiB shared-memory data area per rank: 1031 elements of 8 bytes take 3 rounds.
SMALL_SHM = {"MESHCOLL_SHM_BYTES": "4096"}
# Error bounds, relative to sum(|x_i|) for sum and avg and to |result| for prod: up to 7
# roundings (8 ranks) of each type's unit roundoff (f64 1.1e-16, f32 6e-8, f16 4.9e-4, bf16
# 3.9e-3), with a margin.
RTOL = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-2, "bfloat16": 4e-2}
BOOL_OPS = {"sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
            "prod": np.logical_and, "min": np.logical_and, "band": np.logical_and,
            "bxor": np.logical_xor}
INT_OPS = {"min": np.minimum, "max": np.maximum, "band": np.bitwise_and,
           "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def is_float(name):
    return name in RTOL


def supported(dtype, op):
    if dtype == "bool":
        return op != "avg"
    if is_float(dtype):
        return op not in BITWISE
    return True


def make_input(seed, rank, count, dtype, op):
    """Rank ``rank``'s input for one case; any rank can call it for any other rank."""
    rng = np.random.default_rng(seed + rank)
    dt = np_dtype(dtype)
    if dtype == "bool":
        p = {"prod": 0.85, "min": 0.85, "band": 0.85, "bxor": 0.5}.get(op, 0.25)
        return rng.random(count) < p
    if dt.kind in "iu":
        if op == "prod":  # nonzero, so products do not collapse to 0; they still wrap in int8
            choices = [1, 2, 3] if dt.kind == "u" else [-3, -2, -1, 1, 2, 3]
            return rng.choice(choices, count).astype(dt)
        if op == "avg":  # small values, so truncation of negative averages is exercised
            return rand_array(rng, count, dt)
        info = np.iinfo(dt)  # full range: sums wrap, every bit of the bitwise ops is used
        return rng.integers(info.min, info.max, count, endpoint=True, dtype=dt)
    if op == "prod":  # |x| in [0.5, 1.5]: no overflow or underflow even in f16
        return (rng.choice([-1.0, 1.0], count) * rng.uniform(0.5, 1.5, count)).astype(dt)
    return rand_array(rng, count, np.float64).astype(dt)


def trunc_div(s, n):
    """Integer division rounding toward zero (C++ ``/``), exact for every int64."""
    s64 = s.astype(np.int64) if s.dtype != np.uint64 else s
    return ((s64 - np.fmod(s64, n)) // n).astype(s.dtype)


def expected(stack, dtype, op, n):
    """(reference, error bound or None for exact) for the stacked inputs of every rank."""
    dt = np_dtype(dtype)
    if dtype == "bool":
        return BOOL_OPS[op].reduce(stack, axis=0), None
    if dt.kind in "iu":
        if op in ("sum", "avg"):
            s = np.add.reduce(stack, axis=0, dtype=dt)  # wraps, as the kernel does
            return (trunc_div(s, n) if op == "avg" else s), None
        if op == "prod":
            return np.multiply.reduce(stack, axis=0, dtype=dt), None
        return INT_OPS[op].reduce(stack, axis=0), None
    f = stack.astype(np.float64)
    if op == "min":
        return f.min(axis=0), None
    if op == "max":
        return f.max(axis=0), None
    rtol = RTOL[dtype]
    if op == "prod":
        ref = f.prod(axis=0)
        return ref, rtol * np.abs(ref)
    total_abs = np.abs(f).sum(axis=0)
    if op == "sum":
        return f.sum(axis=0), rtol * total_abs
    return f.sum(axis=0) / n, rtol * total_abs / n  # avg


def compare(got, stack, dtype, op, n):
    """None when ``got`` is right, else a one-line description of the first wrong element."""
    ref, bound = expected(stack, dtype, op, n)
    if got.shape != ref.shape:
        return f"shape {got.shape}, expected {ref.shape}"
    if bound is None:
        if is_float(dtype):
            bad = np.flatnonzero(got.astype(np.float64) != ref)
        else:
            bad = np.flatnonzero(got != ref)
    else:
        err = np.abs(got.astype(np.float64) - ref)
        bad = np.flatnonzero(~(err <= bound))
    if bad.size == 0:
        return None
    i = int(bad[0])
    inputs = [stack[r, i].item() for r in range(n)]
    return (f"{bad.size} wrong element(s); first at [{i}]: got {got[i].item()!r}, expected "
            f"{ref[i].item()!r}" + (f" +- {bound[i]:.3g}" if bound is not None else "")
            + f"; inputs {inputs}")


def digest(x):
    return hashlib.blake2b(np.ascontiguousarray(x).tobytes(), digest_size=8).hexdigest()


def _check_unsupported(pg):
    """Unsupported dtype x op pairs raise TypeError naming both, before anything is sent."""
    wrong = []
    for dtype in DTYPES:
        for op in OPS:
            if supported(dtype, op):
                continue
            x = np.zeros(5, np_dtype(dtype))
            try:
                pg.all_reduce(x, op)
            except TypeError as e:
                if f"'{op}'" not in str(e) or f"'{dtype}'" not in str(e):
                    wrong.append(f"{dtype}/{op}: TypeError does not name both: {e}")
            except Exception as e:  # noqa: BLE001 - report the wrong class
                wrong.append(f"{dtype}/{op}: raised {type(e).__name__}, not TypeError: {e}")
            else:
                wrong.append(f"{dtype}/{op}: no error")
    return wrong


def _matrix_body(pg, dtypes, algos, counts):
    n, rank = pg.size, pg.rank
    pg.config.max_segment_bytes = SMALL_SEGMENT
    failures = _check_unsupported(pg)
    if pg.transport != "shm" and n > 1:
        failures.append(f"rank {rank}: group runs over {pg.transport}, not shared memory")
    digests = []
    case = 0
    for dtype in dtypes:
        for op in OPS:
            if not supported(dtype, op):
                continue
            for algo in algos:
                for count in counts:
                    case += 1
                    seed = 7919 * case
                    label = f"{dtype}/{op}/{algo}/count={count}"
                    x = make_input(seed, rank, count, dtype, op)
                    x0 = x.copy()
                    out = pg.all_reduce(x, op, algorithm=algo)
                    if out is not x:
                        failures.append(f"{label}: all_reduce did not return x itself")
                    stack = np.stack([make_input(seed, r, count, dtype, op) for r in range(n)])
                    assert np.array_equal(stack[rank], x0)  # the reference saw our input
                    why = compare(x, stack, dtype, op, n)
                    if why:
                        failures.append(f"{label} on rank {rank}: {why}")
                    digests.append((label, digest(x)))
                    # Floats: the same call on the same data gives the same bits.
                    if is_float(dtype) and op in ("sum", "prod", "avg") and count:
                        again = pg.all_reduce(x0.copy(), op, algorithm=algo)
                        if digest(again) != digest(x):
                            failures.append(f"{label} on rank {rank}: a second identical "
                                            "all_reduce gave different bits")
    failures += extra_checks(pg, algos)
    return {"failures": failures, "digests": digests}


def assert_ranks_agree(results):
    """No rank found a wrong value, and every rank ended each case with the same bits."""
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures[:40])
    first = results[0]["digests"]
    for rank, r in enumerate(results[1:], start=1):
        assert len(r["digests"]) == len(first)
        diff = [a[0] for a, b in zip(first, r["digests"]) if a != b]
        assert not diff, f"rank {rank} ended with different bits than rank 0 in: {diff[:20]}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 8])
def test_all_reduce_matrix(run_ranks, world):
    # Every supported dtype x op x algorithm x count, then the exact small-integer pattern and
    # the call forms (async, module function, views, n-d, 0-d); world 1 and the non-powers of
    # two on purpose (halving-doubling folds the extra ranks in, the ring gets uneven chunks).
    # TCP algorithms use 256-byte segments, shm a 4 KiB data area: many segments and rounds.
    res = run_ranks(world, _matrix_body, timeout=110, transport="shm", env=SMALL_SHM,
                    dtypes=DTYPES, algos=ALGOS, counts=COUNTS)
    assert_ranks_agree(res)


def _large_body(pg, count, segment_sizes, algos):
    n, rank = pg.size, pg.rank
    failures, digests = [], []
    stack = np.stack([make_input(12345, r, count, "float32", "sum") for r in range(n)])
    for seg in segment_sizes:
        pg.config.max_segment_bytes = seg
        for algo in algos:
            label = f"float32/sum/{algo}/count={count}/segment={seg}"
            x = stack[rank].copy()
            pg.all_reduce(x, "sum", algorithm=algo)
            why = compare(x, stack, "float32", "sum", n)
            if why:
                failures.append(f"{label} on rank {rank}: {why}")
            digests.append((label, digest(x)))
    failures += extra_checks(pg, algos)
    return {"failures": failures, "digests": digests}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("world", [3, 4])
def test_all_reduce_large(run_ranks, world, transport):
    # 1 MiB of float32. Over TCP auto picks the ring; 64 KiB segments pipeline it, 512 KiB (the
    # default) is one segment per chunk. In shared memory a 256 KiB data area takes 4 rounds.
    if transport == "tcp":
        res = run_ranks(world, _large_body, timeout=50, transport="tcp", count=1 << 18,
                        segment_sizes=[64 * 1024, 512 * 1024], algos=TCP_ALGOS)
    else:
        res = run_ranks(world, _large_body, timeout=50, count=1 << 18, segment_sizes=[512 * 1024],
                        algos=["shm", "auto"], transport="shm",
                        env={"MESHCOLL_SHM_BYTES": str(256 * 1024)})
    assert_ranks_agree(res)


def _exact_small_ints_body(pg, count, algos):
    # Small integers sum exactly in any order, for float types too: every algorithm must match
    # the reference bit for bit.
    n, rank = pg.size, pg.rank
    pg.config.max_segment_bytes = 64
    out = {}
    for dtype in ["float16", "bfloat16", "float32", "float64", "int32"]:
        for algo in algos:
            x = ((np.arange(count) % 7) + rank).astype(np_dtype(dtype))
            pg.all_reduce(x, algorithm=algo)
            want = (np.arange(count) % 7) * n + n * (n - 1) // 2
            out[f"{dtype}/{algo}"] = bool(np.array_equal(x.astype(np.int64), want))
    return out


def _forms_body(pg):
    n, rank = pg.size, pg.rank
    want = float(n * (n + 1) // 2)
    seen = {}

    # async_op=True returns a Work whose wait() returns x itself.
    x = np.full(1031, rank + 1, np.float32)
    w = pg.all_reduce(x, async_op=True)
    assert isinstance(w, meshcoll.Work)
    got = w.wait()
    seen["async returns x"] = got is x
    seen["async value"] = bool(np.all(x == want))
    seen["async completed"] = w.is_completed()
    seen["async no exception"] = w.exception() is None

    # Several in flight at once, waited in reverse order, each with its own algorithm.
    xs = [np.full(100 + i, (rank + 1) * (i + 1), np.int64) for i in range(5)]
    works = [pg.all_reduce(xs[i], algorithm=TCP_ALGOS[i], async_op=True) for i in range(5)]
    for w in reversed(works):
        w.wait(timeout=30)
    seen["several in flight"] = all(np.all(xs[i] == want * (i + 1)) for i in range(5))

    # The module function, on the world group by default and on group=.
    y = np.full(10, rank + 1, np.float64)
    seen["module returns x"] = meshcoll.all_reduce(y, group=pg) is y
    meshcoll.all_reduce(y, op="max")
    seen["module value"] = bool(np.all(y == want))

    # In place on a contiguous view: the elements around it are untouched.
    buf = np.full(1033, -5, np.int32)
    buf[1:-1] = rank
    pg.all_reduce(buf[1:-1], "sum")
    seen["view in place"] = bool(buf[0] == -5 and buf[-1] == -5
                                 and np.all(buf[1:-1] == n * (n - 1) // 2))

    # Multi-dimensional arrays reduce elementwise and keep their shape.
    z = np.arange(3 * 5 * 7, dtype=np.float64).reshape(3, 5, 7) * (rank + 1)
    pg.all_reduce(z, "avg", timeout=30)
    seen["nd avg"] = z.shape == (3, 5, 7) and bool(
        np.allclose(z, np.arange(105).reshape(3, 5, 7) * (n + 1) / 2, rtol=1e-12))

    # Bools are logic on any nonzero byte, not bitwise on the raw bytes (2 & 1 is 0, but
    # True and True is True).
    raw = np.array([2, 4, 0, 255, 1, 0], np.uint8) if rank % 2 == 0 else \
        np.array([1, 8, 3, 0, 0, 0], np.uint8)
    logic = {"band": np.logical_and, "bor": np.logical_or, "bxor": np.logical_xor,
             "min": np.logical_and, "max": np.logical_or}
    for op, fn in logic.items():
        b = raw.copy().view(np.bool_)
        pg.all_reduce(b, op)
        inputs = [(np.array([2, 4, 0, 255, 1, 0]) if r % 2 == 0 else np.array([1, 8, 3, 0, 0, 0]))
                  != 0 for r in range(n)]
        seen[f"bool {op} on nonzero bytes"] = [bool(v) for v in b] == fn.reduce(inputs).tolist()

    # A 0-d array is one element.
    s = np.array(rank + 1, np.int64)
    pg.all_reduce(s)
    seen["0-d"] = s.shape == () and int(s) == want
    return seen


def extra_checks(pg, algos):
    """The exact small-integer pattern and the call forms, as failure strings."""
    failures = [f"rank {pg.rank}: small ints {k} inexact"
                for k, ok in _exact_small_ints_body(pg, 257, algos).items() if not ok]
    failures += [f"rank {pg.rank}: {k}" for k, ok in _forms_body(pg).items() if not ok]
    return failures
