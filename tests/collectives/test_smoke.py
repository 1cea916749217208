import numpy as np
import pytest


def _body(pg, count):
    x = np.full(count, pg.rank + 1, np.float32)
    pg.all_reduce(x)
    return float(x[0]), float(x[-1])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_smoke(run_ranks, world):
    res = run_ranks(world, _body, count=1031)
    assert all(r == (world * (world + 1) / 2,) * 2 for r in res)
