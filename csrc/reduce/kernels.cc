// The dtype x op reduction table (NCCL FuncSum<T> style) with run-time SIMD dispatch.
//
// Layers, from the inside out:
//   1. one functor template per op (Sum<T>, Prod<T>, ...), with bool specialisations;
//   2. Repr<T>: how an element is stored versus combined (f16/bf16 are combined in f32);
//   3. reduce_loop / reduce_into_loop / reduce_many_loop / divide_loop: the plain loops GCC vectorises at -O3;
//   4. one struct per instruction set (Baseline, Avx2, Avx512) whose member templates are the
//      loops compiled again under a target attribute (Note [SIMD dispatch]);
//   5. build_table<Isa>(): the only switch on dtype and op, filling function pointers.
#include "reduce/kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "common/check.h"
#include "common/config.h"
#include "common/error.h"
#include "reduce/half.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace meshcoll::reduce {
namespace {

// Everything a loop calls is forced inline into the target-attributed wrappers (section 4):
// an out-of-line copy would be compiled once, for the baseline target, and shared by all
// levels (Note [SIMD dispatch]).
#define MC_ALWAYS_INLINE inline __attribute__((always_inline))

// ---- 1. Ops ---------------------------------------------------------------------------------

// Integers wrap: signed values are combined as unsigned, where overflow is defined.
template <class T>
T wrap_add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}

template <class T>
T wrap_mul(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    // uint8 promotes to int; 255 * 255 still fits, so this is defined too.
    return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return a * b;
  }
}

template <class T>
struct Sum {
  T operator()(T a, T b) const { return wrap_add(a, b); }
};
template <class T>
struct Prod {
  T operator()(T a, T b) const { return wrap_mul(a, b); }
};

// Floats propagate NaN as np.minimum/np.maximum do: a NaN on either side wins. `|` rather than
// `||` so both compares always run and the loop has no branch to stop vectorisation.
template <class T>
struct Min {
  T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) {
      return ((a < b) | (a != a)) ? a : b;  // a != a: a is NaN; if b is NaN, a < b is false
    } else {
      return a < b ? a : b;
    }
  }
};
template <class T>
struct Max {
  T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) {
      return ((a > b) | (a != a)) ? a : b;
    } else {
      return a > b ? a : b;
    }
  }
};

template <class T>
struct BitAnd {
  T operator()(T a, T b) const { return static_cast<T>(a & b); }
};
template <class T>
struct BitOr {
  T operator()(T a, T b) const { return static_cast<T>(a | b); }
};
template <class T>
struct BitXor {
  T operator()(T a, T b) const { return static_cast<T>(a ^ b); }
};

// Bool is logic: sum and max are "or", prod and min are "and" (as numpy's bool ufuncs).
template <>
struct Sum<bool> {
  bool operator()(bool a, bool b) const { return a | b; }
};
template <>
struct Prod<bool> {
  bool operator()(bool a, bool b) const { return a & b; }
};
template <>
struct Min<bool> {
  bool operator()(bool a, bool b) const { return a & b; }
};
template <>
struct Max<bool> {
  bool operator()(bool a, bool b) const { return a | b; }
};

// ---- 2. Element representation --------------------------------------------------------------

// Tags for the two 16-bit float types (C++17 has no such arithmetic types).
struct Float16 {};
struct BFloat16 {};

// Most types are combined as stored.
template <class T>
struct Repr {
  using Storage = T;
  using Compute = T;
  static constexpr bool kWidened = false;
  static Compute load(Storage x) { return x; }
  static Storage store(Compute x) { return x; }
};

// Bools travel as bytes (numpy's layout). Any nonzero byte reads as true; results are 0 or 1.
template <>
struct Repr<bool> {
  using Storage = uint8_t;
  using Compute = bool;
  static constexpr bool kWidened = false;
  static Compute load(Storage x) { return x != 0; }
  static Storage store(Compute x) { return static_cast<Storage>(x); }
};

// f16 and bf16 are widened to f32 kHalfLanes at a time (Note [Half lanes]).
constexpr size_t kHalfLanes = 16;

// How an instruction set converts f16 (F16C or AVX-512F instructions) and bf16 (the same bit
// twiddling as the portable code, in AVX2 or AVX-512F registers: AVX-512 BF16 is too rare to
// add a level for).
enum class HalfCvt { kPortable, kF16C, kAvx512 };

template <>
struct Repr<Float16> {
  using Storage = uint16_t;
  static constexpr bool kWidened = true;
  template <class Isa>
  MC_ALWAYS_INLINE static void widen(const Storage* in, float* out) {
#if defined(__x86_64__)
    if constexpr (Isa::kHalfCvt == HalfCvt::kAvx512) {
      static_assert(kHalfLanes == 16);
      half_to_float_x16_avx512(in, out);
      return;
    } else if constexpr (Isa::kHalfCvt == HalfCvt::kF16C) {
      for (size_t j = 0; j < kHalfLanes; j += 8) half_to_float_x8_f16c(in + j, out + j);
      return;
    }
#endif
    for (size_t j = 0; j < kHalfLanes; ++j) out[j] = half_to_float(in[j]);
  }
  template <class Isa>
  MC_ALWAYS_INLINE static void narrow(const float* in, Storage* out) {
#if defined(__x86_64__)
    if constexpr (Isa::kHalfCvt == HalfCvt::kAvx512) {
      float_to_half_x16_avx512(in, out);
      return;
    } else if constexpr (Isa::kHalfCvt == HalfCvt::kF16C) {
      for (size_t j = 0; j < kHalfLanes; j += 8) float_to_half_x8_f16c(in + j, out + j);
      return;
    }
#endif
    for (size_t j = 0; j < kHalfLanes; ++j) out[j] = float_to_half(in[j]);
  }
};

template <>
struct Repr<BFloat16> {
  using Storage = uint16_t;
  static constexpr bool kWidened = true;
  template <class Isa>
  MC_ALWAYS_INLINE static void widen(const Storage* in, float* out) {
#if defined(__x86_64__)
    if constexpr (Isa::kHalfCvt == HalfCvt::kAvx512) {
      bfloat16_to_float_x16_avx512(in, out);
      return;
    } else if constexpr (Isa::kHalfCvt == HalfCvt::kF16C) {
      for (size_t j = 0; j < kHalfLanes; j += 8) bfloat16_to_float_x8_avx2(in + j, out + j);
      return;
    }
#endif
    for (size_t j = 0; j < kHalfLanes; ++j) out[j] = bfloat16_to_float(in[j]);
  }
  template <class Isa>
  MC_ALWAYS_INLINE static void narrow(const float* in, Storage* out) {
#if defined(__x86_64__)
    if constexpr (Isa::kHalfCvt == HalfCvt::kAvx512) {
      float_to_bfloat16_x16_avx512(in, out);
      return;
    } else if constexpr (Isa::kHalfCvt == HalfCvt::kF16C) {
      for (size_t j = 0; j < kHalfLanes; j += 8) float_to_bfloat16_x8_avx2(in + j, out + j);
      return;
    }
#endif
    for (size_t j = 0; j < kHalfLanes; ++j) out[j] = float_to_bfloat16(in[j]);
  }
};

// ---- 3. Loops -------------------------------------------------------------------------------

// Note [Half lanes]
// f16/bf16 are combined kHalfLanes at a time: widen that many dst and src elements to f32,
// combine in f32, narrow back into dst. So each element is rounded once per call, as NCCL
// does. The lane count is a compile-time constant, so GCC unrolls the three little loops,
// keeps the f32 lanes in registers and emits one fused loop (with F16C: vcvtph2ps, op,
// vcvtps2ph); with a run-time block length it went through stack scratch at a third of the
// speed. The last count % kHalfLanes elements go through a zero-padded copy.
// d = f(x, s): x is d itself, except in reduce_into.
template <class R, class Isa, class F>
MC_ALWAYS_INLINE void half_lanes(typename R::Storage* d, const typename R::Storage* x,
                                 const typename R::Storage* s, F f) {
  float a[kHalfLanes];
  float b[kHalfLanes];
  R::template widen<Isa>(x, a);
  R::template widen<Isa>(s, b);
  for (size_t j = 0; j < kHalfLanes; ++j) a[j] = f(a[j], b[j]);
  R::template narrow<Isa>(a, d);
}

template <class R, class Isa, class F>
MC_ALWAYS_INLINE void half_loop(typename R::Storage* d, const typename R::Storage* x,
                                const typename R::Storage* s, size_t count, F f) {
  using Storage = typename R::Storage;
  size_t i = 0;
  for (; i + kHalfLanes <= count; i += kHalfLanes) half_lanes<R, Isa>(d + i, x + i, s + i, f);
  if (i < count) {
    Storage tx[kHalfLanes] = {};
    Storage ts[kHalfLanes] = {};
    std::memcpy(tx, x + i, (count - i) * sizeof(Storage));
    std::memcpy(ts, s + i, (count - i) * sizeof(Storage));
    half_lanes<R, Isa>(tx, tx, ts, f);
    std::memcpy(d + i, tx, (count - i) * sizeof(Storage));
  }
}

// dst[i] = Op(dst[i], src[i]). No __restrict: dst == src is allowed (kernels.h), and GCC
// versions the loop with a cheap run-time overlap check instead.
template <class Isa, class T, template <class> class Op>
MC_ALWAYS_INLINE void reduce_loop(void* dst, const void* src, size_t count) {
  using R = Repr<T>;
  auto* d = static_cast<typename R::Storage*>(dst);
  auto* s = static_cast<const typename R::Storage*>(src);
  if constexpr (R::kWidened) {
    half_loop<R, Isa>(d, d, s, count, Op<float>{});
  } else {
    const Op<typename R::Compute> op;
    for (size_t i = 0; i < count; ++i) d[i] = R::store(op(R::load(d[i]), R::load(s[i])));
  }
}

// dst[i] = Op(x[i], src[i]), dst apart from both (kernels.h): the loop of its own, so that
// reduce_loop's dst == src keeps its vectorised version.
template <class Isa, class T, template <class> class Op>
MC_ALWAYS_INLINE void reduce_into_loop(void* dst, const void* x, const void* src, size_t count) {
  using R = Repr<T>;
  auto* __restrict d = static_cast<typename R::Storage*>(dst);
  auto* __restrict a = static_cast<const typename R::Storage*>(x);
  auto* __restrict s = static_cast<const typename R::Storage*>(src);
  if constexpr (R::kWidened) {
    half_loop<R, Isa>(d, a, s, count, Op<float>{});
  } else {
    const Op<typename R::Compute> op;
    for (size_t i = 0; i < count; ++i) d[i] = R::store(op(R::load(a[i]), R::load(s[i])));
  }
}

// Note [Fold of many]
// A rank that folds one slice from every peer (the shared-memory all_reduce) reads k sources
// at once: dst = x OP s[0] OP ... OP s[k-1], left to right. For f16/bf16 the running value
// stays in f32 lanes across the k sources and is rounded once at the end: one widening per
// source and one narrowing per element, against two widenings and a narrowing per source
// when each step is a call of its own (the bf16 fold of 8 ranks spent most of its time in
// them), and a sum closer to the exact one. Every other type runs the same steps as k calls
// would, so its bits do not change. Deterministic either way: the order is fixed.
template <class R, class Isa, class F>
MC_ALWAYS_INLINE void half_many_lanes(typename R::Storage* d, const typename R::Storage* x,
                                      const void* const* srcs, size_t k, size_t i, F f) {
  float a[kHalfLanes];
  float b[kHalfLanes];
  R::template widen<Isa>(x, a);
  for (size_t j = 0; j < k; ++j) {
    R::template widen<Isa>(static_cast<const typename R::Storage*>(srcs[j]) + i, b);
    for (size_t l = 0; l < kHalfLanes; ++l) a[l] = f(a[l], b[l]);
  }
  R::template narrow<Isa>(a, d);
}

template <class Isa, class T, template <class> class Op>
MC_ALWAYS_INLINE void reduce_many_loop(void* dst, const void* x, const void* const* srcs,
                                       size_t k, size_t count) {
  using R = Repr<T>;
  using Storage = typename R::Storage;
  auto* d = static_cast<Storage*>(dst);
  auto* a = static_cast<const Storage*>(x);
  if (k == 0) {  // no peers (a group of one): dst = x
    if (dst != x) std::memcpy(dst, x, count * sizeof(Storage));
    return;
  }
  if constexpr (R::kWidened) {
    const Op<float> f;
    size_t i = 0;
    for (; i + kHalfLanes <= count; i += kHalfLanes)
      half_many_lanes<R, Isa>(d + i, a + i, srcs, k, i, f);
    if (i < count) {  // the tail through zero-padded copies, as half_loop
      const size_t rest = count - i;
      Storage tx[kHalfLanes] = {};
      Storage ts[kHalfLanes] = {};
      float acc[kHalfLanes];
      float b[kHalfLanes];
      std::memcpy(tx, a + i, rest * sizeof(Storage));
      R::template widen<Isa>(tx, acc);
      for (size_t j = 0; j < k; ++j) {
        std::memcpy(ts, static_cast<const Storage*>(srcs[j]) + i, rest * sizeof(Storage));
        R::template widen<Isa>(ts, b);
        for (size_t l = 0; l < kHalfLanes; ++l) acc[l] = f(acc[l], b[l]);
      }
      R::template narrow<Isa>(acc, tx);
      std::memcpy(d + i, tx, rest * sizeof(Storage));
    }
  } else {
    if (dst == x)
      reduce_loop<Isa, T, Op>(dst, srcs[0], count);
    else
      reduce_into_loop<Isa, T, Op>(dst, x, srcs[0], count);
    for (size_t j = 1; j < k; ++j) reduce_loop<Isa, T, Op>(dst, srcs[j], count);
  }
}

// x / n, as a functor so the half path can share half_loop (the second operand is unused).
struct DivideBy {
  float n;
  float operator()(float x, float) const { return x / n; }
};

// buf[i] /= n for avg. Floats divide in their compute type (f32 for f16/bf16). Integers
// truncate toward zero (C++ division, as NCCL's ncclAvg); they divide in 64 bits so that an
// int8 never sees n wrapped to its own width (n = 300 must give 0, not x / 44).
template <class Isa, class T>
MC_ALWAYS_INLINE void divide_loop(void* buf, size_t count, size_t n) {
  using R = Repr<T>;
  auto* p = static_cast<typename R::Storage*>(buf);
  if constexpr (R::kWidened) {
    half_loop<R, Isa>(p, p, p, count, DivideBy{static_cast<float>(n)});
  } else if constexpr (std::is_floating_point_v<T>) {
    const T tn = static_cast<T>(n);
    for (size_t i = 0; i < count; ++i) p[i] = p[i] / tn;
  } else {
    using Wide = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
    const Wide wn = static_cast<Wide>(n);
    for (size_t i = 0; i < count; ++i) p[i] = static_cast<T>(static_cast<Wide>(p[i]) / wn);
  }
}

// ---- 4. Instruction sets --------------------------------------------------------------------

// Note [SIMD dispatch]
// The build has no -march flags (wheels run on other CPUs), so -O3 alone vectorises for SSE2
// on x86-64 and NEON on aarch64: that is Baseline. The same loops are compiled again inside
// functions carrying __attribute__((target(...))); because the loops are always_inline, their
// bodies take on the wrapper's target and GCC vectorises them with ymm/zmm registers. Which
// table is used is decided once, at the first lookup, from cpuid and xgetbv (Note [CPU
// features]). MESHCOLL_SIMD=baseline|avx2|avx512 caps the choice, so tests can run every path
// on one machine; simd_level() reports what was picked.
//
// Measured on a Xeon (GCC 13, one pinned core, 32 KiB buffers, GB/s of dst, baseline/avx2/
// avx512): f32 max 14/37/48, f64 min 19/28/50, int64 prod 19/31/46, f16 sum 0.7/27/29,
// bf16 sum 2.7/6.3/11.5 (with the bf16 lanes of half.h since, on a loaded 2-core VM, 32 KiB:
// avx2 3.4 -> 6.4, avx512 7.5 -> 9.9); int8 prod is the one loss (30 -> 20). From L2 the gains shrink, and
// at 64 MiB every level is memory bound (~12-15). prefer-vector-width=512 is needed because
// GCC's generic tuning otherwise keeps 256-bit vectors even with AVX-512 enabled.
#define MC_DEFINE_ISA(Name, level, half_cvt, target_attr)                                 \
  struct Name {                                                                          \
    static constexpr const char* kLevel = level;                                         \
    static constexpr HalfCvt kHalfCvt = half_cvt;                                        \
    template <class T, template <class> class Op>                                        \
    target_attr static void reduce(void* dst, const void* src, size_t count) {           \
      reduce_loop<Name, T, Op>(dst, src, count);                                         \
    }                                                                                    \
    template <class T, template <class> class Op>                                        \
    target_attr static void reduce_into(void* dst, const void* x, const void* src,       \
                                        size_t count) {                                  \
      reduce_into_loop<Name, T, Op>(dst, x, src, count);                                 \
    }                                                                                    \
    template <class T, template <class> class Op>                                        \
    target_attr static void reduce_many(void* dst, const void* x,                        \
                                        const void* const* srcs, size_t k,               \
                                        size_t count) {                                  \
      reduce_many_loop<Name, T, Op>(dst, x, srcs, k, count);                             \
    }                                                                                    \
    template <class T>                                                                   \
    target_attr static void divide(void* buf, size_t count, size_t n) {                  \
      divide_loop<Name, T>(buf, count, n);                                               \
    }                                                                                    \
  };

MC_DEFINE_ISA(Baseline, "baseline", HalfCvt::kPortable, /* no target attribute */)
#if defined(__x86_64__)
#if defined(__clang__)
// Clang rejects prefer-vector-width in target() (and would then drop the whole attribute);
// it already uses 512-bit vectors when AVX-512 is enabled without a CPU tuning.
#define MC_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma"
#else
#define MC_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma,prefer-vector-width=512"
#endif
MC_DEFINE_ISA(Avx2, "avx2", HalfCvt::kF16C, __attribute__((target("avx2,f16c,fma"))))
MC_DEFINE_ISA(Avx512, "avx512", HalfCvt::kAvx512, __attribute__((target(MC_AVX512_TARGET))))
#undef MC_AVX512_TARGET
#endif

#undef MC_DEFINE_ISA
#undef MC_ALWAYS_INLINE

// ---- 5. The table ---------------------------------------------------------------------------

using DivideFn = void (*)(void* buf, size_t count, size_t n);

struct Table {
  const char* level = nullptr;
  ReduceFn reduce[kNumDTypes][kNumRedOps] = {};  // nullptr: unsupported pair
  ReduceIntoFn reduce_into[kNumDTypes][kNumRedOps] = {};
  ReduceManyFn reduce_many[kNumDTypes][kNumRedOps] = {};
  DivideFn divide[kNumDTypes] = {};              // nullptr: no avg for this dtype
};

constexpr int idx(DType t) { return static_cast<int>(t); }
constexpr int idx(RedOp op) { return static_cast<int>(op); }

template <class Isa, class T, template <class> class Op>
void set(Table* table, DType t, RedOp op) {
  table->reduce[idx(t)][idx(op)] = &Isa::template reduce<T, Op>;
  table->reduce_into[idx(t)][idx(op)] = &Isa::template reduce_into<T, Op>;
  table->reduce_many[idx(t)][idx(op)] = &Isa::template reduce_many<T, Op>;
}

template <class Isa, class T>
void fill(Table* table, DType t) {
  set<Isa, T, Sum>(table, t, RedOp::kSum);
  set<Isa, T, Prod>(table, t, RedOp::kProd);
  set<Isa, T, Min>(table, t, RedOp::kMin);
  set<Isa, T, Max>(table, t, RedOp::kMax);
  // avg of bools has no meaning as a bool (any truncating division of 0/1 gives 0).
  if constexpr (!std::is_same_v<T, bool>) {
    set<Isa, T, Sum>(table, t, RedOp::kAvg);  // divide_by() finishes it
    table->divide[idx(t)] = &Isa::template divide<T>;
  }
  if constexpr (std::is_integral_v<T>) {  // integers and bool
    set<Isa, T, BitAnd>(table, t, RedOp::kBand);
    set<Isa, T, BitOr>(table, t, RedOp::kBor);
    set<Isa, T, BitXor>(table, t, RedOp::kBxor);
  }
}

template <class Isa>
Table build_table() {
  Table table;
  table.level = Isa::kLevel;
  for (int i = 0; i < kNumDTypes; ++i) {
    const DType t = static_cast<DType>(i);
    switch (t) {
      case DType::kBool: fill<Isa, bool>(&table, t); break;
      case DType::kInt8: fill<Isa, int8_t>(&table, t); break;
      case DType::kUint8: fill<Isa, uint8_t>(&table, t); break;
      case DType::kInt32: fill<Isa, int32_t>(&table, t); break;
      case DType::kInt64: fill<Isa, int64_t>(&table, t); break;
      case DType::kFloat16: fill<Isa, Float16>(&table, t); break;
      case DType::kBFloat16: fill<Isa, BFloat16>(&table, t); break;
      case DType::kFloat32: fill<Isa, float>(&table, t); break;
      case DType::kFloat64: fill<Isa, double>(&table, t); break;
      case DType::kFloat8E4M3:
      case DType::kFloat8E5M2: break;  // NCCL only: no CPU kernels
    }
  }
  return table;
}

// 0 baseline, 1 avx2, 2 avx512: the highest level MESHCOLL_SIMD allows (all when unset).
// set_config accepts no other value (Note [Configuration]).
int simd_cap() {
  const std::string v = config().simd;
  if (v == "baseline") return 0;
  if (v == "avx2") return 1;
  return 2;
}

// Note [CPU features]
// The CPU is asked directly (cpuid, and xgetbv for what the OS saves) rather than through
// __builtin_cpu_supports: that builtin reads a table which the compiler's runtime (libgcc,
// compiler-rt) fills at load time, and zig's runtime (the release wheels' compiler,
// tools/build_wheels.sh) leaves it empty: it answered "no" to everything, and the wheel ran
// the baseline kernels on AVX-512 machines.
// A feature is usable only if the CPU has it and the OS saves its registers on a context
// switch: XCR0 bits 1-2 (SSE and AVX state) for AVX2, and bits 5-7 (opmask, the upper halves
// of zmm0-15, zmm16-31) for AVX-512. xgetbv may only run when cpuid says OSXSAVE.
// tests/reduce/test_kernels.py checks the level against /proc/cpuinfo's flags.
#if defined(__x86_64__)
// 0 baseline, 1 avx2 (with fma and f16c), 2 avx512 (f, bw, vl, dq, on top of level 1).
int cpu_level() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(1, 0, &a, &b, &c, &d)) return 0;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28),
             f16c = c & (1u << 29);
  if (!(fma && osxsave && avx && f16c)) return 0;
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const uint64_t xcr0 = (static_cast<uint64_t>(xcr0_hi) << 32) | xcr0_lo;
  constexpr uint64_t kAvxState = (1u << 1) | (1u << 2);
  constexpr uint64_t kAvx512State = kAvxState | (1u << 5) | (1u << 6) | (1u << 7);
  if ((xcr0 & kAvxState) != kAvxState) return 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
  if (!(b & (1u << 5))) return 0;  // avx2
  const unsigned avx512 = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);  // f, dq, bw, vl
  if ((b & avx512) == avx512 && (xcr0 & kAvx512State) == kAvx512State) return 2;
  return 1;
}
#else
int cpu_level() { return 0; }  // no x86 kernels on other architectures
#endif

Table select_table() {
  const int level = std::min(cpu_level(), simd_cap());
#if defined(__x86_64__)
  if (level >= 2) return build_table<Avx512>();
  if (level >= 1) return build_table<Avx2>();
#else
  (void)level;
#endif
  return build_table<Baseline>();
}

// Built on first use; a function-local static, so concurrent first calls are safe.
const Table& active_table() {
  static const Table table = select_table();
  return table;
}

// DType and RedOp values arrive from the wire, so range-check before indexing.
void check_enums(DType t, RedOp op) {
  MC_ARG_CHECK(idx(t) < kNumDTypes, "unknown dtype value ", idx(t));
  MC_ARG_CHECK(idx(op) < kNumRedOps, "unknown reduction op value ", idx(op));
}

[[noreturn]] void throw_unsupported(DType t, RedOp op) {
  if (t == DType::kFloat8E4M3 || t == DType::kFloat8E5M2)
    MC_THROW(TypeMismatch, "dtype '", dtype_name(t), "' has no CPU reduction kernels; float8 "
             "reductions run on the NCCL backend only");
  MC_THROW(TypeMismatch, "reduction op '", redop_name(op), "' is not supported for dtype '",
           dtype_name(t), "'",
           is_floating(t) ? "; band/bor/bxor need an integer or bool dtype"
                          : "; avg needs a numeric dtype (use sum for a logical or)");
}

}  // namespace

ReduceFn lookup(DType t, RedOp op) {
  check_enums(t, op);
  ReduceFn fn = active_table().reduce[idx(t)][idx(op)];
  if (fn == nullptr) throw_unsupported(t, op);
  return fn;
}

ReduceIntoFn lookup_into(DType t, RedOp op) {
  lookup(t, op);  // the same checks and errors
  return active_table().reduce_into[idx(t)][idx(op)];
}

ReduceManyFn lookup_many(DType t, RedOp op) {
  lookup(t, op);  // the same checks and errors
  return active_table().reduce_many[idx(t)][idx(op)];
}

bool supported(DType t, RedOp op) {
  check_enums(t, op);
  return active_table().reduce[idx(t)][idx(op)] != nullptr;
}

void divide_by(DType t, void* buf, size_t count, size_t n) {
  check_enums(t, RedOp::kAvg);
  DivideFn fn = active_table().divide[idx(t)];
  if (fn == nullptr) throw_unsupported(t, RedOp::kAvg);
  MC_ARG_CHECK(n > 0, "divide_by: cannot average over a group of size 0");
  if (n == 1 || count == 0) return;
  fn(buf, count, n);
}

const char* simd_level() { return active_table().level; }

}  // namespace meshcoll::reduce
