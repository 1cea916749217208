"""The shared-memory all_reduce's scalable path (Note [Shared-memory all_reduce paths] in
csrc/algo/shm_collectives.cc, Note [Dissemination signalling] in csrc/transport/shm/segment.h),
forced with MESHCOLL_SHM_ALL_REDUCE=scalable, on 2 to 8 real processes (oversubscribed on
small CI machines): random data of float32, bfloat16, float16 and int32 under every op, at
byte sizes on each side of every switch (slot payload, fold-all limit, data-area rounds,
single-copy threshold and pieces), in place and into a separate out (x left as it was),
checked against numpy (test_all_reduce's reference) and
for the same bits on every rank. Then what must stay as strong as on the flat path: a
disagreement is a MismatchError on every rank, a killed rank a PeerError naming it, and
ranks set differently are an error at setup, not a hang."""

import os
import signal

import numpy as np
import pytest

import meshcoll
from test_all_reduce import assert_ranks_agree, compare, digest, make_input, np_dtype, supported

pytestmark = pytest.mark.timeout(120)

SCALABLE = {"MESHCOLL_SHM_ALL_REDUCE": "scalable"}
INLINE = 968            # transport::kShmInlineBytes: a vector up to this rides in the slot
FOLD_ALL = 64 << 10     # kShmPaths' fold_all_bytes: bytes x ranks at or below: fold everything
SHM_BYTES = 128 << 10   # the data area in these tests: 64 KiB a round
PIECE = 512 << 10       # kSingleCopyPieceBytes


def single_copy_from(n):
    """The single-copy threshold these tests set (MESHCOLL_SHM_SINGLE_COPY_BYTES): small, so
    that a few hundred KiB reach the path (kShmPaths starts it at 4-8 MiB from 3 ranks up)."""
    return 16 << 10 if n <= 5 else 256 << 10


def byte_sizes(n, cma):
    half = SHM_BYTES // 2
    fold_all = FOLD_ALL // n
    sizes = {0, 4, INLINE - 4, INLINE, INLINE + 4, fold_all - 4, fold_all, fold_all + 4,
             fold_all + 6}
    if cma:
        sc = single_copy_from(n)
        sizes |= {sc - 4, sc, sc + 6, PIECE + 4 * 7}  # several pieces, the last one short
    else:
        sizes |= {half - 4, half, half + 6, 2 * half + 4 * 7}  # several rounds
    return sorted(sizes)


DTYPES = ["float32", "bfloat16", "float16", "int32"]
OPS = ["sum", "prod", "min", "max", "avg", "band", "bor", "bxor"]


def _all_reduce_into(pg, x, out, op):
    """all_reduce(x) into a separate out: the reducer's form (ProcessGroup's is in place)."""
    c = pg.config
    pg._backend.all_reduce(x, out, op, 30, None, False, "auto", c.max_segment_bytes,
                           c.tree_threshold_bytes, c.hd_threshold_bytes, 0, "auto", "auto")


def _paths_body(pg, cma, path):
    n, rank = pg.size, pg.rank
    failures, digests = [], []
    if meshcoll._C.config().shm_all_reduce != path or pg.transport != "shm":
        failures.append(f"rank {rank}: not the {path} path in shared memory")
    case = 0
    for i, nbytes in enumerate(byte_sizes(n, cma == "1")):
        for j, dtype in enumerate(DTYPES):
            esz = np_dtype(dtype).itemsize
            count = nbytes // esz
            # one op a case, rotating: every op meets every dtype across the sizes
            ops = [op for op in OPS if supported(dtype, op)]
            for op in (ops[(i + j) % len(ops)],):
                case += 1
                x = make_input(101 * case, rank, count, dtype, op)
                stack = np.stack([make_input(101 * case, r, count, dtype, op) for r in range(n)])
                label = f"{nbytes} bytes {dtype}/{op}"
                if case % 2:
                    pg.all_reduce(x, op)
                else:  # out of place (Note [Out-of-place shared-memory all_reduce]): x kept
                    label += " out of place"
                    out = np.full_like(x, 7)
                    _all_reduce_into(pg, x, out, op)
                    if not np.array_equal(x, stack[rank]):
                        failures.append(f"{label} on rank {rank}: x was written")
                    x = out
                why = compare(x, stack, dtype, op, n)
                if why:
                    failures.append(f"{label} on rank {rank}: {why}")
                digests.append((label, digest(x)))
    return {"failures": failures, "digests": digests}


@pytest.mark.parametrize("world,cma,path", [
    (2, "1", "scalable"), (3, "1", "scalable"), (4, "0", "scalable"), (5, "1", "scalable"),
    (8, "1", "scalable"), (8, "0", "scalable"), (5, "0", "flat"),
])
def test_all_reduce_paths_match_numpy(run_ranks, world, cma, path):
    res = run_ranks(world, _paths_body, timeout=110, cma=cma, path=path,
                    env={"MESHCOLL_SHM_ALL_REDUCE": path, "MESHCOLL_CMA": cma,
                         "MESHCOLL_SHM_BYTES": str(SHM_BYTES),
                         "MESHCOLL_SHM_SINGLE_COPY_BYTES": str(single_copy_from(world))})
    assert_ranks_agree(res)


def _mismatch(pg, counts):
    assert meshcoll._C.config().shm_all_reduce == "scalable"
    x = np.ones(counts[pg.rank], np.float32)
    with pytest.raises(meshcoll.MismatchError) as e:
        pg.all_reduce(x, timeout=30)
    return str(e.value)


@pytest.mark.parametrize("counts", [
    [242, 242, 243, 242, 244],        # each side of the slot payload (968 bytes)
    [3276, 3276, 3276, 3277, 3276],   # each side of the fold-all limit (64 KiB / 5 ranks)
    [4095, 4096, 4096, 4096, 4097],   # each side of the single-copy threshold
])
def test_disagreeing_sizes_are_a_mismatch_on_every_rank(run_ranks, counts):
    res = run_ranks(5, _mismatch, counts=counts, env=SCALABLE)
    for msg in res:  # MismatchError, not the 30 s deadline's TimeoutError
        assert "mismatch" in msg and "all_reduce" in msg, msg


def _all_reduce_against_broadcast(pg):
    # Rank 0 meets by dissemination (all_reduce), the others by polling every flag (broadcast):
    # both get past their first wait and compare the calls.
    assert meshcoll._C.config().shm_all_reduce == "scalable"
    x = np.ones(4096, np.float32)
    with pytest.raises(meshcoll.MismatchError) as e:
        if pg.rank == 0:
            pg.all_reduce(x, timeout=30)
        else:
            pg.broadcast(x, 0, timeout=30)
    return str(e.value)


def test_all_reduce_against_another_collective_is_a_mismatch(run_ranks):
    for msg in run_ranks(4, _all_reduce_against_broadcast, env=SCALABLE):
        assert "all_reduce" in msg and "broadcast" in msg, msg


def _die_in_all_reduce(pg, count):
    assert meshcoll._C.config().shm_all_reduce == "scalable"
    x = np.ones(count, np.float32)
    for i in range(100000):
        if pg.rank == 3 and i == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            pg.all_reduce(x, timeout=20)
        except meshcoll.MeshcollError as e:
            return type(e).__name__, str(e)
    return "no error", ""


# In the slots, through the data area, and single-copy.
@pytest.mark.parametrize("count,cma", [(16, "1"), (1 << 15, "0"), (1 << 17, "1")])
def test_a_killed_rank_is_a_peer_error_naming_it(run_ranks, count, cma):
    res = run_ranks(5, _die_in_all_reduce, may_die=(3,), count=count,
                    env={**SCALABLE, "MESHCOLL_CMA": cma,
                         "MESHCOLL_SHM_SINGLE_COPY_BYTES": str(single_copy_from(5))})
    for rank in (0, 1, 2, 4):
        kind, msg = res[rank]
        assert kind == "PeerError" and "rank 3" in msg, res[rank]


def _differently_set(pg, name, values):
    os.environ[name] = values[1] if pg.rank == 1 else values[0]
    meshcoll._C.reload_config()
    with pytest.raises(meshcoll.MeshcollError) as e:
        pg.new_group(list(range(pg.size)), transport="shm")
    return str(e.value)


@pytest.mark.parametrize("name,values", [
    ("MESHCOLL_SHM_ALL_REDUCE", ("scalable", "flat")),
    ("MESHCOLL_SHM_SINGLE_COPY_BYTES", ("0", "16384")),
])
def test_ranks_set_differently_fail_at_setup(run_ranks, name, values):
    for msg in run_ranks(3, _differently_set, name=name, values=values):
        assert name in msg and "every rank" in msg, msg
