"""A small all-reduce across the ranks of meshcoll-run:

    meshcoll-run -n 4 -m meshcoll.examples.allreduce
"""

import numpy as np

import meshcoll


def main() -> None:
    pg = meshcoll.init()
    x = np.arange(4, dtype=np.float32) + 10 * pg.rank
    meshcoll.all_reduce(x)
    expected = sum(np.arange(4, dtype=np.float32) + 10 * r for r in range(pg.size))
    assert np.array_equal(x, expected), (x, expected)
    print(f"rank {pg.rank}/{pg.size}: all_reduce(sum) = {x.tolist()}")
    meshcoll.destroy()


if __name__ == "__main__":
    main()
