"""What meshcoll-bench writes into each rank's input and what the result must then hold.

The CPU backend uses fixed patterns whose results have closed forms; the NCCL backend uses
random inputs that any rank can regenerate, reduced again on the host."""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from .buffers import INTS

SENTINEL = 100  # written into outputs before a check; no expected value reaches it

# ---- the CPU backend: patterns ---------------------------------------------------------
# Small non-negative integers: exact in every dtype (float16 and bfloat16 included) and
# under any summation order, so a check is an exact comparison. Reductions use
# v_r(i) = b(i) + n*[i mod n == r]: the sum n*b + n, the average b + 1, the max b + n,
# the min b (n > 1) are all exact, and every rank's contribution shows. prod uses a 2 on
# one rank per element (1 elsewhere), so it cannot overflow. Data movement uses
# m_r(i) = (i + 7r) mod 13, different for every rank and position. The bitwise reductions
# (integer dtypes only) use one bit per rank and element, 1 << ((i + r) mod 7) (below 128:
# every integer dtype holds it), cleared out of 127 for band, so every rank's bit shows.

BITWISE = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def _b(i: np.ndarray) -> np.ndarray:
    return (3 * i + 1) % 5


def reduce_input(rank: int, n: int, i: np.ndarray, redop: str) -> np.ndarray:
    if redop == "prod":
        return np.where(i % (n + 1) == rank, 2, 1)
    if redop in BITWISE:
        bit = np.left_shift(1, (i + rank) % 7)
        return np.asarray(127 ^ bit if redop == "band" else bit)
    return np.asarray(_b(i) + n * (i % n == rank))


def reduce_expected(n: int, i: np.ndarray, redop: str) -> np.ndarray:
    if redop == "prod":
        return np.where(i % (n + 1) < n, 2, 1)
    if redop in BITWISE:
        return np.asarray(functools.reduce(BITWISE[redop],
                                           (reduce_input(r, n, i, redop) for r in range(n))))
    b = _b(i)
    return {"sum": n * b + n, "avg": b + 1, "max": b + n, "min": b + (n if n == 1 else 0)}[redop]


def move_input(rank: "int | np.ndarray", i: np.ndarray) -> np.ndarray:
    """Rank ``rank``'s input at ``i`` (``rank`` may be an array: one rank per element)."""
    return np.asarray((i + 7 * rank) % 13)


# ---- the NCCL backend: random inputs, a host reference ---------------------------------
# Rank r's input is a sequence of chunks; chunk k holds default_rng([seed, r, k]) integers
# in the op kind's range (lengths depend only on the buffer's element count, which every
# rank knows), so any rank recomputes any rank's input, a chunk at a time, without the
# memory of n full buffers. The ranges keep every result an exact small integer in every
# dtype: reductions 0..3 (prod 1..2: at most 2**n), data movement 0..63. The results are
# compared a chunk at a time, in float64 (floats) or int64 (integers).

CHUNK = 1 << 22  # elements per generated chunk (DeviceCase's default)
_RANGES = {"reduce": (0, 4), "prod": (1, 3), "move": (0, 64)}
_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23,
        "float64": 2.0 ** -52}


def rank_values(seed: int, rank: int, in_count: int, start: int, stop: int,
                kind: str, chunk: int = CHUNK) -> np.ndarray:
    """Elements ``[start, stop)`` of rank ``rank``'s ``in_count``-element input (uint8),
    generated ``chunk`` elements at a time (every rank must use the same ``chunk``)."""
    lo, hi = _RANGES[kind]
    chunk = max(min(chunk, in_count), 1)
    parts = []
    for k in range(start // chunk, (stop - 1) // chunk + 1 if stop > start else 0):
        c0 = k * chunk
        vals = np.random.default_rng([seed, rank, k]).integers(
            lo, hi, min(chunk, in_count - c0), dtype=np.uint8)
        parts.append(vals[max(start - c0, 0):stop - c0])
    return np.concatenate(parts) if parts else np.empty(0, np.uint8)


def reference_reduce(parts: Sequence[np.ndarray], redop: str, dtype: str) -> np.ndarray:
    """The reduction of every rank's values, as the device computes it in ``dtype``
    (integers wrap), in float64 for floats and int64 for integers."""
    a = np.stack([p.astype(np.int64) for p in parts])
    n = len(parts)
    if redop == "sum":
        r = a.sum(0)
    elif redop == "prod":
        r = a.prod(0)
    elif redop == "min":
        r = a.min(0)
    elif redop == "max":
        r = a.max(0)
    elif dtype in INTS:  # avg of integers: the sum divided by n, truncated (non-negative)
        r = a.sum(0) // n
    else:
        return np.asarray(a.sum(0) / n)
    if dtype in INTS:
        return np.asarray(r.astype(dtype).astype(np.int64))
    return np.asarray(r.astype(np.float64))


def count_wrong(got: np.ndarray, want: np.ndarray, dtype: str, n: int, inexact: bool) -> int:
    """Elements of ``got`` that differ from ``want``; ``inexact`` (avg of floats) allows a
    relative error of (n + 1) ulps of ``dtype``."""
    if inexact:
        tol = (n + 1) * _EPS[dtype] * np.maximum(np.abs(want), 1.0)
        bad = ~(np.abs(got - want) <= tol)  # NaN counts as wrong
    else:
        bad = got != want
    return int(np.count_nonzero(bad))
