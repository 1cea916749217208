// The dtype x op reduction table. One lookup, no other switch on dtype/op anywhere.
// f16 and bf16 are combined in f32 and rounded back to their type at each step (as NCCL),
// except in a fold of many sources (lookup_many), which rounds once.
#pragma once

#include <cstddef>

#include "common/dtype.h"

namespace meshcoll::reduce {

// dst[i] = dst[i] OP src[i] for i in [0, count). dst and src may not overlap partially.
using ReduceFn = void (*)(void* dst, const void* src, size_t count);

// dst[i] = x[i] OP src[i]: the same kernel with its first operand read elsewhere, for a
// reduction into an array apart from its input (the out-of-place shared-memory all_reduce).
// dst may not overlap x or src.
using ReduceIntoFn = void (*)(void* dst, const void* x, const void* src, size_t count);

// Throws TypeMismatch naming both when the pair is unsupported (e.g. bxor on float32).
// kAvg returns the sum kernel: callers finish with divide_by().
// dst[i] = x[i] OP srcs[0][i] OP ... OP srcs[k-1][i], folded left to right (k = 0: a copy; Note
// [Fold of many] in kernels.cc: f16 and bf16 are rounded once, at the end, not per step).
// dst may be x; no source may overlap dst.
using ReduceManyFn = void (*)(void* dst, const void* x, const void* const* srcs, size_t k,
                              size_t count);
ReduceFn lookup(DType t, RedOp op);
ReduceIntoFn lookup_into(DType t, RedOp op);
ReduceManyFn lookup_many(DType t, RedOp op);
bool supported(DType t, RedOp op);

// In-place buf[i] /= n, for kAvg. Integers use truncating division (as NCCL's ncclAvg).
void divide_by(DType t, void* buf, size_t count, size_t n);

// Name of the SIMD level the kernels dispatched to at run time ("avx512", "avx2", "baseline").
const char* simd_level();

}  // namespace meshcoll::reduce
