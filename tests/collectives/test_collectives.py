"""Every collective except all_reduce, across real processes, with exact expected values.

Inputs are small integers (``pattern``), exact in every dtype here including bfloat16, so
sums of them are exact whatever order an algorithm folds in, and results are compared bit for
bit. Broadcast moves random bytes instead (it does no arithmetic). Every root is tried.

Each test runs every case of one world in one spawned job; a child collects the wrong cases
and returns them, so one failure reports the others too.
"""

import time

import ml_dtypes
import numpy as np
import pytest

import meshcoll

DTYPES = ["float32", "int64", "bfloat16"]
WORLDS = [1, 2, 3, 4, 5]
# broadcast, gather, scatter, all_gather(_v) and barrier have a shared-memory path; run those
# tests over both transports. A 64 KiB shared data area makes the large cases take several
# rounds.
TRANSPORT_ENV = {"tcp": {}, "shm": {"MESHCOLL_SHM_BYTES": str(64 * 1024)}}


def np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def pattern(rank, shape, dtype, salt=0):
    """Integers in [-9, 9], different on every rank and element; any rank can rebuild any
    other rank's array."""
    size = int(np.prod(shape, dtype=np.int64))
    v = (np.arange(size, dtype=np.int64) * 7 + rank * 13 + salt * 5) % 19 - 9
    return v.reshape(shape).astype(np_dtype(dtype))


def random_bytes(rank, nbytes, dtype, salt=0):
    """Arbitrary bits (NaNs included for floats): broadcast must copy them unchanged."""
    raw = np.random.default_rng([rank, salt]).integers(0, 256, nbytes, dtype=np.uint8)
    return raw.view(np_dtype(dtype)).copy()


class Checker:
    """Collects wrong results, so a child reports every failing case, not only the first."""

    def __init__(self, pg):
        self.rank = pg.rank
        self.failures = []

    def same(self, label, got, want):
        if got is None or want is None:
            if got is not want:
                self.failures.append(f"rank {self.rank} {label}: got {got!r}, expected {want!r}")
            return
        got, want = np.asarray(got), np.asarray(want)
        if got.dtype != want.dtype or got.shape != want.shape:
            self.failures.append(f"rank {self.rank} {label}: got {got.dtype}{got.shape}, "
                                 f"expected {want.dtype}{want.shape}")
        elif got.tobytes() != want.tobytes():
            bad = np.flatnonzero(got.reshape(-1).view(np.uint8 if got.itemsize == 1 else
                                                      f"u{got.itemsize}")
                                 != want.reshape(-1).view(np.uint8 if want.itemsize == 1 else
                                                          f"u{want.itemsize}"))
            i = int(bad[0])
            self.failures.append(
                f"rank {self.rank} {label}: {bad.size} wrong element(s); first at flat index "
                f"{i}: got {got.reshape(-1)[i]!r}, expected {want.reshape(-1)[i]!r}")

    def true(self, label, cond, detail=""):
        if not cond:
            self.failures.append(f"rank {self.rank} {label}: {detail or 'check failed'}")


def assert_no_failures(results):
    failures = [f for r in results for f in r]
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures[:40])


# ---- rooted: reduce, broadcast, gather, scatter ----------------------------------------------

def _rooted_body(pg):
    n, rank = pg.size, pg.rank
    ck = Checker(pg)
    for dtype in DTYPES:
        dt = np_dtype(dtype)
        for root in range(n):
            for count in (0, 1, 1031):
                tag = f"{dtype} root={root} count={count}"
                # reduce: root holds the reduction, every other rank's x is unchanged.
                for op in ("sum", "max", "min", "avg"):
                    x = pattern(rank, (count,), dtype, salt=root)
                    mine = x.copy()
                    ret = pg.reduce(x, root, op)
                    ck.true(f"reduce {op} {tag} returns x", ret is x)
                    stack = np.stack([pattern(r, (count,), dtype, salt=root).astype(np.float64)
                                      for r in range(n)])
                    if rank == root:
                        want = {"sum": stack.sum(0), "max": stack.max(0), "min": stack.min(0),
                                "avg": stack.sum(0) / n}[op]
                        if op == "avg" and dt.kind in "iu":
                            want = np.trunc(stack.sum(0) / n)
                        ck.same(f"reduce {op} {tag}", x, want.astype(dt))
                    else:
                        ck.same(f"reduce {op} {tag} (non-root unchanged)", x, mine)

                # gather: stacked on root, None elsewhere.
                g = pg.gather(pattern(rank, (count, 2), dtype), dst=root)
                want = np.stack([pattern(r, (count, 2), dtype) for r in range(n)])
                ck.same(f"gather {tag}", g, want if rank == root else None)

                # scatter: root passes (n, *s); others pass out=, or an x of the full shape.
                full = np.stack([pattern(r, (count, 3), dtype, salt=1) for r in range(n)])
                if rank == root:
                    got = pg.scatter(full, src=root)
                elif rank % 2:
                    out = np.full((count, 3), 99, dt)
                    got = pg.scatter(None, src=root, out=out)
                    ck.true(f"scatter {tag} returns out", got is out)
                else:
                    got = pg.scatter(np.zeros((n, count, 3), dt), src=root)
                ck.same(f"scatter {tag}", got, full[rank])

            # broadcast: small (binomial tree), > 64 KiB (pipelined chain on n > 2), and over
            # the 512 KiB segment size (several segments in flight along the chain).
            for nbytes in (0, 2, 4096, 100_000, 1_300_000):
                esz = dt.itemsize
                nb = nbytes - nbytes % esz
                src_data = random_bytes(root, nb, dtype, salt=nb)
                x = src_data.copy() if rank == root else random_bytes(rank + 100, nb, dtype)
                ret = pg.broadcast(x, src=root)
                ck.true(f"broadcast {dtype} root={root} bytes={nb} returns x", ret is x)
                ck.same(f"broadcast {dtype} root={root} bytes={nb}", x, src_data)
    # Broadcast of a 2-d array keeps its shape; async form returns x from wait().
    y = pattern(rank, (40, 30), "float32") if rank == n - 1 else np.zeros((40, 30), np.float32)
    w = pg.broadcast(y, src=n - 1, async_op=True)
    ck.true("broadcast async returns x", w.wait() is y)
    ck.same("broadcast async 2-d", y, pattern(n - 1, (40, 30), "float32"))
    return ck.failures


# ---- gathers and exchanges: all_gather(_v), all_to_all(_v) -----------------------------------

def _gather_body(pg):
    n, rank = pg.size, pg.rank
    ck = Checker(pg)
    for dtype in DTYPES:
        dt = np_dtype(dtype)
        # all_gather: every rank's x stacked along a new axis 0.
        for shape in [(0,), (1,), (1031,), (3, 5), (150_000,)]:  # the last: 600 KiB in f32
            x = pattern(rank, shape, dtype)
            want = np.stack([pattern(r, shape, dtype) for r in range(n)])
            ck.same(f"all_gather {dtype} {shape}", pg.all_gather(x), want)
        out = np.full((n, 7), 42, dt)
        ret = pg.all_gather(pattern(rank, (7,), dtype, salt=2), out=out)
        ck.true(f"all_gather {dtype} out= is returned", ret is out)
        ck.same(f"all_gather {dtype} out=", out,
                np.stack([pattern(r, (7,), dtype, salt=2) for r in range(n)]))
        w = pg.all_gather(pattern(rank, (5,), dtype), async_op=True)
        ck.same(f"all_gather {dtype} async", w.wait(),
                np.stack([pattern(r, (5,), dtype) for r in range(n)]))

        # all_gather_v: different rows per rank, some ranks with none.
        for rows_of in (lambda r: r % 3, lambda r: 0, lambda r: 2 * r + 1):
            rows = [rows_of(r) for r in range(n)]
            x = pattern(rank, (rows[rank], 4), dtype, salt=3)
            cat, counts = pg.all_gather_v(x)
            ck.true(f"all_gather_v {dtype} counts", counts == rows, f"{counts} != {rows}")
            ck.same(f"all_gather_v {dtype} rows={rows}", cat,
                    np.concatenate([pattern(r, (rows[r], 4), dtype, salt=3) for r in range(n)]))

        # all_to_all: block i of x goes to rank i; block j of out came from rank j.
        for k in (0, 1, 5):
            blocks = lambda src: pattern(src, (n * k, 2), dtype, salt=4)  # noqa: E731
            got = pg.all_to_all(blocks(rank))
            want = np.concatenate([blocks(src)[rank * k:(rank + 1) * k] for src in range(n)])
            ck.same(f"all_to_all {dtype} k={k}", got, want)
        out = np.zeros((n * 3,), dt)
        ret = pg.all_to_all(pattern(rank, (n * 3,), dtype), out=out)
        ck.true(f"all_to_all {dtype} out= is returned", ret is out)
        ck.same(f"all_to_all {dtype} out=", out,
                np.concatenate([pattern(s, (n * 3,), dtype)[rank * 3:rank * 3 + 3]
                                for s in range(n)]))

        # all_to_all_v: rank s sends (s + d) % 3 rows to rank d (zero-row blocks included);
        # then s * 700 rows to every rank: blocks that take several shared-memory rounds, a
        # different number on each rank (rank 0 sends nothing and only receives).
        for scale, rows_to in ((1, lambda s, d: (s + d) % 3), (700, lambda s, d: s)):
            sc = lambda s: [rows_to(s, d) * scale for d in range(n)]  # noqa: E731
            data = lambda s: pattern(s, (sum(sc(s)), 3), dtype, salt=5)  # noqa: E731
            got, recv_counts = pg.all_to_all_v(data(rank), sc(rank))
            want_counts = [sc(s)[rank] for s in range(n)]
            ck.true(f"all_to_all_v {dtype} x{scale} recv_counts", recv_counts == want_counts,
                    f"{recv_counts} != {want_counts}")
            parts = []
            for s in range(n):
                off = sum(sc(s)[:rank])
                parts.append(data(s)[off:off + sc(s)[rank]])
            ck.same(f"all_to_all_v {dtype} x{scale}", got, np.concatenate(parts))
    return ck.failures


# ---- reduce_scatter(_v) ---------------------------------------------------------------------

def _reduce_scatter_body(pg):
    n, rank = pg.size, pg.rank
    ck = Checker(pg)
    for dtype in DTYPES:
        dt = np_dtype(dtype)
        for op in ("sum", "max", "min", "avg"):
            def want_of(shape, salt, lo, hi):
                stack = np.stack([pattern(r, shape, dtype, salt).astype(np.float64)
                                  for r in range(n)])[:, lo:hi]
                red = {"sum": stack.sum(0), "max": stack.max(0), "min": stack.min(0),
                       "avg": stack.sum(0) / n}[op]
                if op == "avg" and dt.kind in "iu":
                    red = np.trunc(stack.sum(0) / n)
                return red.astype(dt)

            # Even split of axis 0; k = 0 rows each is allowed.
            for k, trailing in ((0, (3,)), (1, ()), (7, (3,)), (1031, ())):
                shape = (n * k,) + trailing
                got = pg.reduce_scatter(pattern(rank, shape, dtype, salt=k), op=op)
                ck.same(f"reduce_scatter {dtype} {op} shape={shape}", got,
                        want_of(shape, k, rank * k, (rank + 1) * k))
            out = np.zeros((4, 2), dt)
            ret = pg.reduce_scatter(pattern(rank, (4 * n, 2), dtype), out=out, op=op)
            ck.true(f"reduce_scatter {dtype} {op} out= is returned", ret is out)
            ck.same(f"reduce_scatter {dtype} {op} out=", out,
                    want_of((4 * n, 2), 0, 4 * rank, 4 * rank + 4))

            # Uneven split: rank r keeps counts[r] rows (zero for some).
            for counts in ([(r * 5) % 4 for r in range(n)], [0] * (n - 1) + [9],
                           [r + 300 for r in range(n)]):
                shape = (sum(counts), 2)
                got = pg.reduce_scatter_v(pattern(rank, shape, dtype, salt=6), counts, op=op)
                lo = sum(counts[:rank])
                ck.same(f"reduce_scatter_v {dtype} {op} counts={counts}", got,
                        want_of(shape, 6, lo, lo + counts[rank]))
    return ck.failures


# ---- point to point and barrier ------------------------------------------------------------

def _p2p_body(pg):
    n, rank = pg.size, pg.rank
    ck = Checker(pg)
    right, left = (rank + 1) % n, (rank - 1) % n
    for dtype in DTYPES:
        dt = np_dtype(dtype)
        # Ring shift, sends posted first: every rank sends right and receives from the left.
        for count in (0, 1, 1031, 300_000):
            buf = np.full(count, 77, dt)
            sw = pg.isend(pattern(rank, (count,), dtype), right)
            rw = pg.irecv(buf, left)
            ck.true(f"irecv {dtype} wait returns buf", rw.wait() is buf)
            ck.true(f"isend {dtype} wait returns None", sw.wait() is None)
            ck.same(f"ring isend/irecv {dtype} count={count}", buf, pattern(left, (count,), dtype))
        # Blocking send/recv, ordered so the pairs cannot deadlock: even ranks send first.
        buf = np.zeros((3, 4), dt)
        if rank % 2 == 0:
            pg.send(pattern(rank, (3, 4), dtype, salt=1), right, tag=3)
            ret = pg.recv(buf, left, tag=3)
        else:
            ret = pg.recv(buf, left, tag=3)
            pg.send(pattern(rank, (3, 4), dtype, salt=1), right, tag=3)
        ck.true(f"recv {dtype} returns buf", ret is buf)
        ck.same(f"ring send/recv {dtype}", buf, pattern(left, (3, 4), dtype, salt=1))

    # Tags: several messages to one peer, each received with its own tag, in order.
    tags = [0, 5, 2**32 - 1, 7]
    sends = [pg.isend(np.full(3, t % 1000 + rank, np.int64), right, tag=t) for t in tags]
    for t in tags:
        got = pg.recv(np.zeros(3, np.int64), left, tag=t)
        ck.same(f"tag {t}", got, np.full(3, t % 1000 + left, np.int64))
    for s in sends:
        s.wait()

    # All pairs: each rank sends to every other rank, then receives from each.
    works = [pg.isend(np.array([rank, p], np.int32), p, tag=9) for p in range(n) if p != rank]
    for p in range(n):
        if p != rank:
            ck.same(f"all-pairs from {p}", pg.recv(np.zeros(2, np.int32), p, tag=9),
                    np.array([p, rank], np.int32))
    for w in works:
        w.wait()

    # Module functions on the world group.
    if rank == 0:
        meshcoll.send(np.arange(4, dtype=np.float64), 1)
    elif rank == 1:
        ck.same("meshcoll.recv", meshcoll.recv(np.zeros(4), 0), np.arange(4, dtype=np.float64))
    return ck.failures


def _recv_posted_first(pg, ck):
    # The usual exchange: post the receive, then the send, then wait for both. Both calls are
    # non-blocking, so this must not depend on another rank's send being queued first
    # (regression: the worker once ran them one at a time and this deadlocked).
    n, rank = pg.size, pg.rank
    for count in (4, 200_000):
        buf = np.zeros(count, np.float32)
        rw = pg.irecv(buf, (rank - 1) % n, timeout=30)
        sw = pg.isend(np.full(count, rank, np.float32), (rank + 1) % n, timeout=30.0)
        rw.wait()
        sw.wait()
        ck.same(f"irecv posted before isend, count={count}", buf,
                np.full(count, (rank - 1) % n, np.float32))
    # Per-call timeouts, int and float (regression: once parsed with the GIL released, which
    # crashed the process).
    buf = np.zeros(4, np.float32)
    sw = pg.isend(np.full(4, rank, np.float32), (rank + 1) % n, timeout=30)
    pg.recv(buf, (rank - 1) % n, timeout=30.0)
    sw.wait(timeout=30)
    ck.same("send/recv with timeout=", buf, np.full(4, (rank - 1) % n, np.float32))


def _barrier(pg, ck, delay=0.5):
    # The last rank arrives late; nobody may leave the barrier before it arrives.
    n, rank = pg.size, pg.rank
    pg.barrier()  # line everyone up
    if rank == n - 1:
        time.sleep(delay)
    t0 = time.monotonic()
    pg.barrier()
    waited = time.monotonic() - t0
    if rank != n - 1:
        ck.true("barrier waits for the last rank", waited >= delay * 0.8,
                f"left after {waited:.3f} s")
    w = pg.barrier(async_op=True)
    ck.true("barrier async", w.wait() is None and w.is_completed())
    meshcoll.barrier()
    for _ in range(20):  # back-to-back barriers do not mix rounds
        pg.barrier()


# ---- the tests ------------------------------------------------------------------------------

def _shm_capable_body(pg):
    ck = Checker(pg)
    ck.failures += _rooted_body(pg)
    ck.failures += _gather_body(pg)
    _barrier(pg, ck)
    return ck.failures


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world,transport", [(w, "tcp") for w in WORLDS] +
                         [(w, "shm") for w in WORLDS if w > 1])
def test_rooted_gather_and_barrier(run_ranks, world, transport):
    # reduce, broadcast, gather, scatter, all_gather(_v), all_to_all(_v) and barrier; every
    # root. broadcast, gather, scatter, all_gather and barrier take the shared-memory path
    # under "shm".
    assert_no_failures(run_ranks(world, _shm_capable_body, timeout=140,
                                 transport=transport, env=TRANSPORT_ENV[transport]))


def _tcp_only_body(pg):
    ck = Checker(pg)
    ck.failures += _reduce_scatter_body(pg)
    if pg.size > 1:
        ck.failures += _p2p_body(pg)
        _recv_posted_first(pg, ck)
    return ck.failures


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_and_send_recv(run_ranks, world):
    # reduce_scatter(_v) and point to point have no shared-memory path: one transport is enough.
    assert_no_failures(run_ranks(world, _tcp_only_body, timeout=110))
