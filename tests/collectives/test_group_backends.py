"""A backend per group (new_group's backend=), on the CPU launcher: what a CPU world cannot
make is a clear ValueError on every rank, at once, and the world goes on. The MPI cases (an
MPI world with a CPU group, ranks asking for different backends) are in tests/mpi/test_mpi.py;
an NCCL world with a CPU group in tests/gpu/test_nccl.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import launch


def _asks_for(pg, group_backend, **kwargs):
    start = time.monotonic()
    try:
        pg.new_group([0, 1], backend=group_backend, timeout=20, **kwargs)
        seen = ("no error", "")
    except Exception as e:  # noqa: BLE001 - the test asserts on the class
        seen = (type(e).__name__, str(e))
    took = time.monotonic() - start
    # The world is unharmed: an all_reduce on random data against numpy.
    x = np.random.default_rng([7, pg.rank]).standard_normal(100)
    pg.all_reduce(x)
    want = sum(np.random.default_rng([7, r]).standard_normal(100) for r in range(pg.size))
    return seen, took, bool(np.allclose(x, want))


@pytest.mark.timeout(60)
def test_mpi_group_of_a_cpu_world_outside_mpirun_is_a_value_error_on_every_rank():
    res = launch(2, _asks_for, timeout=50, group_backend="mpi")
    for rank, ((kind, msg), took, world_ok) in enumerate(res):
        assert kind == "ValueError", (rank, kind, msg)
        assert f"global rank {rank}" in msg and "MPI is not initialized" in msg, msg
        assert "mpirun" in msg, msg
        assert took < 5, (rank, took)  # refused at once, not at the setup deadline
        assert world_ok, rank


def _three_asks(pg):
    return [_asks_for(pg, "nccl")[0], _asks_for(pg, "gloo")[0],
            _asks_for(pg, "cpu", device=0)[0]]


@pytest.mark.timeout(60)
def test_nccl_group_of_a_cpu_world_needs_a_device_and_bad_names_are_refused():
    res = launch(2, _three_asks, timeout=50)
    for rank, (nccl, bad, device) in enumerate(res):
        assert nccl[0] == "ValueError", (rank, nccl)
        # No GPU here: NCCL is unavailable; with one, the device is what is missing.
        assert "NCCL is unavailable" in nccl[1] or "pass device=" in nccl[1], nccl
        assert bad[0] == "ValueError" and "'gloo'" in bad[1] and "'cpu', 'nccl', 'mpi'" in bad[1], bad
        assert device[0] == "ValueError" and "device=" in device[1], device
