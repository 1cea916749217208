"""Times the reduction kernels of whichever meshcoll this interpreter imports, for
tools/check_wheel.sh (a wheel against a source build).

    python tools/time_reduce.py [seconds per dtype, default 1.0]
        one JSON line: the module, its simd_level() and, per dtype, the best time in us of
        dst += src over 256 KiB buffers
    python tools/time_reduce.py compare WHEEL.jsonl SOURCE.jsonl
        exits 1 unless both ran the same level and the wheel's best times are within 10%

The buffers stay in L2, so this times the kernels' code, where two builds can differ (the
wheel's baseline kernels took 27x the time for f16; a badly placed branch, 1.1x), and not
the memory bus: at 4 MiB, on a 2-core VM shared with other work, the best of ten runs of one
build moved by 15%.
"""

import json
import sys
import time

import numpy as np

from meshcoll import _C

NBYTES = 256 << 10  # dst and src together: a quarter of a 2 MiB L2


def buffers(dtype: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Two buffers of finite values (the kernels take raw bytes, named by `dtype`), at the
    same offsets within a page in every process, so that both builds meet the same alignment
    and 4 KiB aliasing (numpy's buffers land wherever malloc puts them): dst one cache line
    into a page, src half a page further."""
    x = rng.standard_normal((2, NBYTES // 2), dtype=np.float32)
    if dtype == "float32":
        pair = x[:, : NBYTES // 4]
    elif dtype == "float16":
        pair = x.astype(np.float16)
    else:  # bfloat16 bits, truncated
        pair = (x.view(np.uint32) >> 16).astype(np.uint16)
    raw = np.empty(2 * NBYTES + 3 * 4096, np.uint8)
    page = -raw.ctypes.data % 4096
    dst = raw[page + 64: page + 64 + NBYTES].view(pair.dtype)
    src = raw[page + NBYTES + 2048 + 64: page + 2 * NBYTES + 2048 + 64].view(pair.dtype)
    dst[:], src[:] = pair
    return dst, src


def best_us(dtype: str, seconds: float) -> float:
    dst, src = buffers(dtype, np.random.default_rng(0))
    reset = dst.copy()
    best = float("inf")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.copyto(dst, reset)  # the sum stays finite, so every call does the same work
        t0 = time.perf_counter()
        _C._reduce_into(dst, src, dtype, "sum")
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def compare(wheel_path: str, source_path: str) -> int:
    wheel, source = ([json.loads(line) for line in open(p)] for p in (wheel_path, source_path))
    print(f"wheel  {wheel[0]['simd_level']:8} {wheel[0]['module']}")
    print(f"source {source[0]['simd_level']:8} {source[0]['module']}")
    bad = []
    if wheel[0]["simd_level"] != source[0]["simd_level"]:
        bad.append("the wheel and the source build run different SIMD levels (Note [CPU "
                   "features] in csrc/reduce/kernels.cc)")
    for dtype in wheel[0]["us"]:
        w, s = (min(run["us"][dtype] for run in runs) for runs in (wheel, source))
        print(f"  sum of {NBYTES >> 10} KiB {dtype:8}: wheel {w:.2f} us, source {s:.2f} us "
              f"({w / s:.2f}x)")
        if w > 1.10 * s:
            bad.append(f"the wheel's {dtype} kernel is {w / s:.2f}x the source build's time")
    for line in bad:
        print("FAIL:", line)
    return 1 if bad else 0


def main() -> None:
    if sys.argv[1:2] == ["compare"]:
        sys.exit(compare(*sys.argv[2:4]))
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    us = {d: round(best_us(d, seconds), 2) for d in ("float16", "bfloat16", "float32")}
    print(json.dumps({"module": _C.__file__, "simd_level": _C.simd_level(), "us": us}))


if __name__ == "__main__":
    main()
