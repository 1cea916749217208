"""Tier 1: partition_range and ShardedArray bookkeeping. No processes."""

import numpy as np
import pytest

from meshcoll.partition import ShardedArray, partition_range, partition_sizes


def _array_split_ranges(length, parts):
    """(start, stop) of each part of numpy.array_split: the definition we match."""
    pieces = np.array_split(np.arange(length), parts)
    starts = np.cumsum([0] + [len(p) for p in pieces])
    return [(int(starts[i]), int(starts[i + 1])) for i in range(parts)]


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5, 7, 8, 16])
def test_matches_array_split(parts):
    for length in list(range(0, 40)) + [97, 1000, 1031]:
        expected = _array_split_ranges(length, parts)
        got = [partition_range(length, parts, i) for i in range(parts)]
        assert got == expected, (length, parts)
        assert partition_sizes(length, parts) == [b - a for a, b in expected]


def test_parts_cover_the_range_in_order():
    for length in range(0, 30):
        for parts in range(1, 10):
            ranges = [partition_range(length, parts, i) for i in range(parts)]
            assert ranges[0][0] == 0 and ranges[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            sizes = [b - a for a, b in ranges]
            assert max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)  # the larger parts come first


def test_examples():
    assert [partition_range(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [partition_range(2, 4, i) for i in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert partition_range(0, 3, 2) == (0, 0)
    assert partition_range(np.int64(7), np.int32(2), np.int8(1)) == (4, 7)


@pytest.mark.parametrize("args,message", [
    ((-1, 2, 0), "length must be >= 0"),
    ((5, 0, 0), "parts must be >= 1"),
    ((5, -2, 0), "parts must be >= 1"),
    ((5, 2, 2), r"index 2 is outside \[0, 2\)"),
    ((5, 2, -1), r"index -1 is outside \[0, 2\)"),
])
def test_errors(args, message):
    with pytest.raises(ValueError, match=message):
        partition_range(*args)


@pytest.mark.parametrize("args", [(5.0, 2, 0), (5, 2.5, 0), (5, 2, "1"), (5, 2, None)])
def test_non_integers_are_rejected(args):
    with pytest.raises(TypeError):
        partition_range(*args)


def test_sharded_array_normalizes_dim_and_checks_its_range():
    x = np.arange(2 * 7 * 3).reshape(2, 7, 3)
    local = x[:, 3:5]
    sh = ShardedArray(local, x.shape, -2, 3, 5, 3, 1)
    assert sh.dim == 1 and sh.local_shape == (2, 2, 3) and sh.sizes == [3, 2, 2]
    assert sh.global_shape == (2, 7, 3) and sh.group is None
    assert "group" not in repr(sh)
    with pytest.raises(ValueError, match=r"not part 1 of 3 of length 7 \(expected \[3, 5\]\)"):
        ShardedArray(local, x.shape, 1, 2, 4, 3, 1)
    with pytest.raises(ValueError, match=r"local has shape \(2, 3, 3\), expected \(2, 2, 3\)"):
        ShardedArray(x[:, 3:6], x.shape, 1, 3, 5, 3, 1)
    with pytest.raises(ValueError, match="dim 3 is out of range for an array with 3 dims"):
        ShardedArray(local, x.shape, 3, 3, 5, 3, 1)
    with pytest.raises(ValueError, match="0-d array"):
        ShardedArray(np.float64(1.0), (), 0, 0, 1, 1, 0)
