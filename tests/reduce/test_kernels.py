"""The dtype x op reduction kernels (csrc/reduce/kernels.cc), checked bit for bit against numpy.

Runs against whichever SIMD level the machine dispatches to; test_other_simd_levels reruns this
file in a subprocess with MESHCOLL_SIMD capped lower, so baseline and AVX2 are covered on an
AVX-512 machine too.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from meshcoll import _C

pytestmark = pytest.mark.timeout(60)

DTYPES = ["bool", "int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
OPS = ["sum", "prod", "min", "max", "avg", "band", "bor", "bxor"]
BITWISE = ["band", "bor", "bxor"]
COUNTS = [0, 1, 7, 1031, 100003]  # odd on purpose: every vector tail length gets hit
HALVES = ["float16", "bfloat16"]  # combined in float32 and rounded back at each call

# numpy spellings; bool has its own logic table below.
NP_OPS = {
    "sum": np.add,
    "avg": np.add,  # the avg kernel is the sum kernel; _divide_by finishes it
    "prod": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}
BOOL_OPS = {
    "sum": np.logical_or,
    "prod": np.logical_and,
    "min": np.logical_and,
    "max": np.logical_or,
    "band": np.logical_and,
    "bor": np.logical_or,
    "bxor": np.logical_xor,
}


def np_dtype(name):
    if name == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.dtype(name)


def supported(dtype, op):
    if dtype in FLOATS and op in BITWISE:
        return False
    return not (dtype == "bool" and op == "avg")


def random_array(dtype, count, seed):
    """Random values without zeros (a zero-filled buffer passes too many wrong kernels);
    bools are a mix of both."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(bool)
    if dtype in FLOATS:
        # Mixed signs and magnitudes; f16 products stay finite, f32 sums round.
        x = rng.standard_normal(count) * np.exp2(rng.integers(-8, 8, count))
        x[x == 0] = 1.0
        return x.astype(np.float32).astype(np_dtype(dtype))
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    x[x == 0] = 1
    return x


def reference(a, b, dtype, op):
    if dtype == "bool":
        return BOOL_OPS[op](a, b)
    # Overflow to Inf and Inf - Inf are expected here; integer arrays wrap, as the kernels do.
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype in HALVES:
            r = NP_OPS[op](a.astype(np.float32), b.astype(np.float32))
            return r.astype(np_dtype(dtype))
        return NP_OPS[op](a, b)


def isnan(x):
    with np.errstate(invalid="ignore"):  # ml_dtypes warns when casting a bf16 NaN
        return np.isnan(x.astype(np.float64))


def assert_same(got, want):
    """Exact equality: same bits for every non-NaN element, NaN where numpy has NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want)
        return
    got_nan, want_nan = isnan(got), isnan(want)
    np.testing.assert_array_equal(got_nan, want_nan)
    keep = ~want_nan
    bits = np.dtype(f"u{got.dtype.itemsize}")
    np.testing.assert_array_equal(got.view(bits)[keep], want.view(bits)[keep])


def reduce_into(dst, src, dtype, op):
    _C._reduce_into(dst, src, dtype, op)
    return dst


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("dtype,op", [(d, o) for d in DTYPES for o in OPS if supported(d, o)])
def test_matches_numpy(dtype, op, count):
    a = random_array(dtype, count, seed=1)
    b = random_array(dtype, count, seed=2)
    want = reference(a, b, dtype, op)
    got = reduce_into(a.copy(), b, dtype, op)
    assert_same(got, want)
    assert_same(b, random_array(dtype, count, seed=2))  # src untouched


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("dtype,op", [(d, o) for d in DTYPES for o in OPS if supported(d, o)])
def test_into_a_third_array_gives_the_same_bits(dtype, op, count):
    # lookup_into (the out-of-place shared-memory all_reduce): dst = x OP src, x and src kept.
    a = random_array(dtype, count, seed=1)
    b = random_array(dtype, count, seed=2)
    dst = np.full_like(a, 3)
    _C._reduce_into(dst, b, dtype, op, x=a)
    assert_same(dst, reduce_into(a.copy(), b, dtype, op))
    assert_same(a, random_array(dtype, count, seed=1))
    assert_same(b, random_array(dtype, count, seed=2))


def reference_many(x, srcs, dtype, op):
    """x op srcs[0] op ... left to right; f16/bf16 in float32 throughout, rounded once at the
    end (Note [Fold of many])."""
    if dtype not in HALVES:
        for s in srcs:
            x = reference(x, s, dtype, op)
        return x
    acc = x.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for s in srcs:
            acc = NP_OPS[op](acc, s.astype(np.float32))
        return acc.astype(np_dtype(dtype))


@pytest.mark.parametrize("count", [0, 1, 17, 1031])
@pytest.mark.parametrize("dtype,op", [(d, o) for d in DTYPES for o in OPS if supported(d, o)])
def test_fold_of_many_matches_numpy(dtype, op, count):
    # lookup_many (the shared-memory all_reduce's and reduce_scatter's fold of every peer):
    # one source, several, into a third array and in place.
    x = random_array(dtype, count, seed=1)
    for k in (1, 3, 7):
        srcs = [random_array(dtype, count, seed=10 + j) for j in range(k)]
        want = reference_many(x, srcs, dtype, op)
        dst = np.full_like(x, 3)
        _C._reduce_many(dst, x, srcs, dtype, op)
        assert_same(dst, want)
        assert_same(x, random_array(dtype, count, seed=1))  # x untouched
        inplace = x.copy()
        _C._reduce_many(inplace, inplace, srcs, dtype, op)
        assert_same(inplace, want)


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dst_may_alias_src(dtype, op):
    a = random_array(dtype, 1031, seed=3)
    want = reference(a, a, dtype, op)
    assert_same(reduce_into(a, a, dtype, op), want)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["min", "max"])
def test_min_max_propagate_nan(dtype, op):
    count = 1031
    a = random_array(dtype, count, seed=4)
    b = random_array(dtype, count, seed=5)
    a[::3] = np.nan  # NaN on the dst side, on the src side, and on both
    b[::5] = np.nan
    want = reference(a, b, dtype, op)
    got = reduce_into(a.copy(), b, dtype, op)
    nan = isnan(got)
    assert nan[::3].all() and nan[::5].all()
    assert_same(got, want)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_special_values(dtype, op):
    dt = np_dtype(dtype)
    info = (np.finfo if dtype != "bfloat16" else pytest.importorskip("ml_dtypes").finfo)(dt)
    specials = np.array(
        [np.inf, -np.inf, np.nan, info.max, -info.max, info.tiny, -info.tiny,
         info.smallest_subnormal, -info.smallest_subnormal, 1.0, -1.0, 0.5],
        dtype=dt,
    )
    a = np.repeat(specials, len(specials))
    b = np.tile(specials, len(specials))  # every pair of specials
    want = reference(a, b, dtype, op)
    assert_same(reduce_into(a.copy(), b, dtype, op), want)


@pytest.mark.parametrize("dtype", HALVES)
def test_every_half_round_trips(dtype):
    # x * 1 goes half -> f32 -> half for all 65536 bit patterns: exact, NaN stays NaN.
    x = np.arange(1 << 16, dtype=np.uint16).view(np_dtype(dtype))
    ones = np.ones_like(x)
    assert_same(reduce_into(x.copy(), ones, dtype, "prod"), x)


@pytest.mark.parametrize("dtype", HALVES)
def test_rounding_of_every_half_sum(dtype):
    # Each half plus a shuffled half: covers ties to even, overflow to Inf and subnormal results.
    x = np.arange(1 << 16, dtype=np.uint16).view(np_dtype(dtype))
    y = np.random.default_rng(6).permutation(x)
    want = reference(x, y, dtype, "sum")
    assert_same(reduce_into(x.copy(), y, dtype, "sum"), want)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "int64"])
def test_integer_wraparound(dtype):
    info = np.iinfo(dtype)
    a = np.array([info.max, info.min, info.max, info.min, -1 if info.min else 3], dtype=dtype)
    b = np.array([1, -1 if info.min else 1, info.max, info.min, info.max], dtype=dtype)
    for op in ["sum", "prod"]:
        assert_same(reduce_into(a.copy(), b, dtype, op), reference(a, b, dtype, op))


def test_bool_reads_any_nonzero_byte_as_true():
    a = np.array([0, 2, 0, 255, 7], dtype=np.uint8)
    b = np.array([0, 0, 3, 1, 9], dtype=np.uint8)
    got = reduce_into(a.copy(), b, "bool", "bxor")
    np.testing.assert_array_equal(got, [0, 1, 1, 0, 0])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", BITWISE)
def test_unsupported_pairs_raise(dtype, op):
    a = random_array(dtype, 7, seed=7)
    message = f"reduction op '{op}' is not supported for dtype '{dtype}'"
    with pytest.raises(TypeError, match=message):
        _C._reduce_into(a, a.copy(), dtype, op)


def test_avg_on_bool_raises():
    a = np.ones(7, dtype=bool)
    with pytest.raises(TypeError, match="reduction op 'avg' is not supported for dtype 'bool'"):
        _C._reduce_into(a, a.copy(), "bool", "avg")
    with pytest.raises(TypeError, match="'avg' is not supported for dtype 'bool'"):
        _C._divide_by(a, "bool", 2)


def test_bad_arguments_raise_value_error():
    a = np.ones(8, dtype=np.float32)
    with pytest.raises(ValueError, match="unknown dtype 'float31'"):
        _C._reduce_into(a, a.copy(), "float31", "sum")
    with pytest.raises(ValueError, match="unknown reduction op 'mean'"):
        _C._reduce_into(a, a.copy(), "float32", "mean")
    with pytest.raises(ValueError, match="dst has 32 bytes but src has 28"):
        _C._reduce_into(a, a[:7].copy(), "float32", "sum")
    with pytest.raises(ValueError, match="not a whole number of float64 elements"):
        _C._reduce_into(a[:7].copy(), a[:7].copy(), "float64", "sum")
    ro = a.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="dst is read-only"):
        _C._reduce_into(ro, a, "float32", "sum")
    with pytest.raises(ValueError, match="not C-contiguous"):
        _C._reduce_into(np.ones(16, dtype=np.float32)[::2], a, "float32", "sum")
    with pytest.raises(ValueError, match="overlap partially"):
        _C._reduce_into(a[1:].view(), a[:-1].view(), "float32", "sum")
    with pytest.raises(ValueError, match="size 0"):
        _C._divide_by(a, "float32", 0)


def test_accepts_any_contiguous_buffer():
    dst = bytearray(np.arange(1, 9, dtype=np.int32).tobytes())
    src = memoryview(np.full(8, 2, dtype=np.int32).tobytes())  # read-only src is fine
    _C._reduce_into(dst, src, "int32", "prod")
    np.testing.assert_array_equal(np.frombuffer(dst, dtype=np.int32), np.arange(1, 9) * 2)
    m = np.arange(1, 13, dtype=np.float64).reshape(3, 4)
    _C._reduce_into(m, m.copy(), "float64", "sum")
    np.testing.assert_array_equal(m, np.arange(1, 13).reshape(3, 4) * 2)


def truncating_div(a, n):
    """C division (toward zero) on Python ints, so int64 extremes are exact."""
    q = [abs(int(x)) // n * (1 if x >= 0 else -1) for x in a]
    return np.array(q, dtype=a.dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 300])
@pytest.mark.parametrize("count", [0, 1, 7, 1031])
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "bool"])
def test_divide_by(dtype, count, n):
    a = random_array(dtype, count, seed=8)
    if dtype in HALVES:
        want = (a.astype(np.float32) / np.float32(n)).astype(np_dtype(dtype))
    elif dtype in FLOATS:
        want = a / a.dtype.type(n)
    else:
        want = truncating_div(a, n)  # n = 300 on int8: must give 0, not x / (300 mod 256)
    _C._divide_by(a, dtype, n)
    assert_same(a, want)


@pytest.mark.parametrize("dtype", ["float32", "int32", "bfloat16"])
def test_avg_is_sum_then_divide(dtype):
    parts = [random_array(dtype, 1031, seed=s) for s in (10, 11, 12)]
    if dtype == "int32":
        parts = [p // 4 for p in parts]  # keep the sum from wrapping: avg of wrapped sums is moot
    acc = parts[0].copy()
    for p in parts[1:]:
        _C._reduce_into(acc, p, dtype, "avg")
    _C._divide_by(acc, dtype, len(parts))
    want = parts[0].copy()
    for p in parts[1:]:
        want = reference(want, p, dtype, "sum")
    if dtype == "int32":
        want = truncating_div(want, 3)
    elif dtype in HALVES:
        want = (want.astype(np.float32) / np.float32(3)).astype(np_dtype(dtype))
    else:
        want = want / np.float32(3)
    assert_same(acc, want)


LEVELS = ["baseline", "avx2", "avx512"]
# The CPU features each level's kernels use, as /proc/cpuinfo spells them (Note [CPU features]
# in csrc/reduce/kernels.cc).
LEVEL_FLAGS = {"avx2": {"avx2", "fma", "f16c"},
               "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}}


def cpu_level():
    """The best level this machine can run, from /proc/cpuinfo's flags (Linux lists an AVX
    flag only when the OS also saves its registers); None where there is no /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return None
    line = re.search(r"^flags\s*:(.*)$", text, re.M)  # x86 only: other CPUs run baseline
    flags = set(line.group(1).split()) if line else set()
    return max((lvl for lvl, need in LEVEL_FLAGS.items() if need <= flags), key=LEVELS.index,
               default="baseline")


def test_simd_level_is_the_best_the_cpu_has():
    """A module that detects less than the CPU has runs the slow kernels without a word: the
    wheel built with zig's clang once reported baseline on an AVX-512 machine. So this fails
    (never skips) when /proc/cpuinfo lists the features of a level the module does not use."""
    level = _C.simd_level()
    assert level in LEVELS
    want = cpu_level()
    if want is None:
        pytest.skip("no /proc/cpuinfo to compare the detected level with")
    cap = os.environ.get("MESHCOLL_SIMD")
    if cap:
        want = min(want, cap, key=LEVELS.index)
    assert level == want, (
        f"{_C.__file__} runs the {level} kernels, but this CPU can run {want} "
        f"(/proc/cpuinfo lists {sorted(LEVEL_FLAGS.get(want, ()))}; MESHCOLL_SIMD={cap!r}): its "
        "CPU feature detection is broken (Note [CPU features] in csrc/reduce/kernels.cc)")


@pytest.mark.timeout(120)
@pytest.mark.skipif("MESHCOLL_SIMD" in os.environ, reason="already a capped rerun")
@pytest.mark.parametrize("level", ["baseline", "avx2"])
def test_other_simd_levels(level):
    """Reruns this file with the kernels capped at `level`, so each compiled path is checked."""
    if level == _C.simd_level():
        pytest.skip(f"{level} is this process's level: the other tests already ran it")
    if LEVELS.index(level) > LEVELS.index(cpu_level() or "baseline"):
        pytest.skip(f"this CPU has no {level} (/proc/cpuinfo)")
    # The children must import the same meshcoll as this process.
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(_C.__file__)))
    path = os.pathsep.join(p for p in [pkg_root, os.environ.get("PYTHONPATH")] if p)
    env = dict(os.environ, MESHCOLL_SIMD=level, PYTHONPATH=path)
    probe = subprocess.run(
        [sys.executable, "-c", "from meshcoll import _C; print(_C.simd_level())"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == level, f"MESHCOLL_SIMD={level} gave {probe.stdout.strip()}"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=110,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
