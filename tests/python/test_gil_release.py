"""Another Python thread keeps running while a call blocks in C++: a receive (the queued
path) and a blocking all_reduce (the fast-call path that waits in shared memory)."""

import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(60)


def _body(pg, op):
    x = np.zeros(4, np.float32)
    if pg.rank == 1:
        time.sleep(1.0)  # rank 0 blocks in the call meanwhile
        if op == "recv":
            pg.send(np.arange(4, dtype=np.float32), 0)
        else:
            pg.all_reduce(np.arange(4, dtype=np.float32))
        return None
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.05)
    before = ticks[0]
    pg.recv(x, 1) if op == "recv" else pg.all_reduce(x)
    during = ticks[0] - before
    stop.set()
    t.join()
    assert np.array_equal(x, np.arange(4, dtype=np.float32))
    return during


@pytest.mark.parametrize("op", ["recv", "all_reduce"])
def test_other_threads_run_during_a_blocking_call(run_ranks, op):
    during = run_ranks(2, _body, op=op)[0]
    assert during > 100  # ~1 s of 1 ms ticks; would be ~0 if the GIL were held
