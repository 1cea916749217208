// meshcoll's direct kernels (Note [Direct kernels] in direct.h): small all_reduce,
// all_gather and reduce_scatter among the GPUs of one host, by loads over peer access.
// Compiled at run time by NVRTC for the device at hand, so the wheel needs no CUDA toolkit:
// no #include, and nothing from the CUDA headers but built-ins.
//
// One op, on every rank, in every block b of the grid:
//  1. copy this rank's part b of the input into its own staging buffer (of this op's parity);
//  2. signal: write the op's token (epoch << 32 | fingerprint) into every rank's flag for
//     (block b, this rank), with release semantics, then wait until every rank's token for
//     this epoch has arrived in this rank's flags;
//  3. read part b of every rank's staging buffer and write the result.
// A token of this epoch whose fingerprint differs from ours is another call: the block
// writes nothing, reports the peer and returns (so no rank's data changes on a disagreement).
// A flag that does not arrive within timeout_ns, or an abort set by the host, ends the wait
// the same way.
//
// Why one barrier per op is enough: staging buffers and flags alternate between two
// parities. Rank r writes its buffer of parity p at epoch e only after passing epoch e-1's
// barrier, which every peer entered after finishing epoch e-2 (kernels of one communicator
// run in order, Note [Direct kernels]), the last op that read that buffer. Flags of parity p
// are rewritten at epoch e+2 only after every peer passed epoch e+1, so a waiter of epoch e
// never misses its token.
//
// Every block reads exactly the part its peers' block b copied (part b of each slice), and
// parts are whole 128-byte lines: loads of peers' memory bypass L1 (ld.global.cg), since a
// line cached before a peer wrote it would be stale. Sums run over the ranks in rank order,
// so every rank computes bit-identical results.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define MC_MAX_RANKS 8
#define MC_THREADS 512
#define MC_PART_ALIGN 128

// Matches DirectArgs in direct.cc.
struct Args {
  const u8* in;
  u8* out;
  u8* bufs[MC_MAX_RANKS];   // each rank's staging buffer of this op's parity
  u64* flags[MC_MAX_RANKS]; // each rank's flags of this op's parity: [block][rank]
  u64 n;                    // elements of a slice (all_reduce: the count; all_gather: bytes
                            // per rank; reduce_scatter: the count each rank keeps)
  u64 stride;               // reduce_scatter: bytes between slices in the staging buffer
  u64 token;                // epoch << 32 | fingerprint
  u64 timeout_ns;
  u64* status;              // host-mapped: the first failure (code | peer << 8 | epoch << 32)
  const u32* abort_flag;    // host-mapped: set when the host gave up on this communicator
  int rank;
  int world;
  u8* res[MC_MAX_RANKS];    // two-shot all_reduce: each rank's result area
  u64* flags2[MC_MAX_RANKS];// two-shot: the flags of its second barrier (the other parity)
  u64 token2;               // two-shot: the second barrier's token
  u64 report_epoch;         // the op's last epoch << 32: what a failure report names
};

enum { kOk = 0, kMismatch = 1, kTimeout = 2, kAborted = 3 };

// ---- memory access -------------------------------------------------------------------------

__device__ __forceinline__ void st_release(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u32 ld_volatile(const u32* p) {
  u32 v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 now_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
struct Pack { u32 x, y, z, w; };  // 16 bytes
__device__ __forceinline__ Pack ld_cg(const Pack* p) {
  Pack v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
// One element of 1, 2, 4 or 8 bytes, through L2.
template <class T>
__device__ __forceinline__ T ld_cg(const T* p) {
  T v;
  if (sizeof(T) == 1) {
    u16 x;
    asm volatile("ld.global.cg.u8 %0, [%1];" : "=h"(x) : "l"(p) : "memory");
    *(u8*)&v = (u8)x;
  } else if (sizeof(T) == 2) {
    u16 x;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(x) : "l"(p) : "memory");
    *(u16*)&v = x;
  } else if (sizeof(T) == 4) {
    u32 x;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(x) : "l"(p) : "memory");
    *(u32*)&v = x;
  } else {
    u64 x;
    asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(x) : "l"(p) : "memory");
    *(u64*)&v = x;
  }
  return v;
}

// Copies `bytes` bytes with the block's threads: 16-byte packs where both sides allow.
// `remote`: the source may be a peer's memory (bypass L1).
template <bool remote>
__device__ __forceinline__ void copy_bytes(u8* dst, const u8* src, u64 bytes) {
  u64 i = 0;
  if ((((u64)dst | (u64)src) & 15) == 0) {
    const u64 packs = bytes / 16;
    for (u64 k = threadIdx.x; k < packs; k += blockDim.x) {
      const Pack* s = (const Pack*)src + k;
      ((Pack*)dst)[k] = remote ? ld_cg(s) : *s;
    }
    i = packs * 16;
  }
  for (u64 k = i + threadIdx.x; k < bytes; k += blockDim.x)
    dst[k] = remote ? ld_cg(src + k) : src[k];
}

// Block b's part of n elements of `es` bytes: whole 128-byte lines, the same on every rank.
__device__ __forceinline__ void part(u64 n, u64 es, u64* lo, u64* hi) {
  const u64 per_line = MC_PART_ALIGN / es;
  u64 chunk = (n + gridDim.x - 1) / gridDim.x;
  chunk = (chunk + per_line - 1) / per_line * per_line;
  *lo = chunk * blockIdx.x < n ? chunk * blockIdx.x : n;
  *hi = *lo + chunk < n ? *lo + chunk : n;
}

// ---- the barrier ----------------------------------------------------------------------------

__device__ void report(const Args& a, int code, int peer) {
  volatile u64* s = a.status;
  if (*s == 0) *s = (u64)code | ((u64)peer << 8) | a.report_epoch;
}

// Step 2 of the op, over `flags` with `token`; false: the block must return without writing
// (the status says why).
__device__ bool barrier(const Args& a, u64* const* flags, u64 token) {
  __syncthreads();  // the block's copy into its staging buffer is done
  const int t = threadIdx.x;
  int bad = 0;
  if (t < a.world) {
    st_release(flags[t] + blockIdx.x * MC_MAX_RANKS + a.rank, token);
    const u64* mine = flags[a.rank] + blockIdx.x * MC_MAX_RANKS + t;
    const u64 t0 = now_ns();
    for (u32 spin = 1;; ++spin) {
      const u64 v = ld_acquire(mine);
      if ((v >> 32) == (token >> 32)) {
        if (v != token) {
          report(a, kMismatch, t);
          bad = 1;
        }
        break;
      }
      if ((spin & 255) == 0) {
        if (ld_volatile(a.abort_flag)) {
          report(a, kAborted, t);
          bad = 1;
          break;
        }
        if (now_ns() - t0 > a.timeout_ns) {
          report(a, kTimeout, t);
          bad = 1;
          break;
        }
      }
    }
  }
  return __syncthreads_or(bad) == 0;
}

// ---- element types and reductions ---------------------------------------------------------

struct f16 { u16 x; };
struct bf16 { u16 x; };

template <class T> struct Elem {  // integers, float, double: computed in their own type
  typedef T Acc;
  static __device__ __forceinline__ Acc up(T v) { return v; }
  static __device__ __forceinline__ T down(Acc a) { return a; }
};
template <> struct Elem<f16> {
  typedef float Acc;
  static __device__ __forceinline__ float up(f16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
    return f;
  }
  static __device__ __forceinline__ f16 down(float f) {
    f16 v;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v.x) : "f"(f));
    return v;
  }
};
template <> struct Elem<bf16> {
  typedef float Acc;
  static __device__ __forceinline__ float up(bf16 v) { return __uint_as_float((u32)v.x << 16); }
  static __device__ __forceinline__ bf16 down(float f) {  // round to nearest even
    u32 u = __float_as_uint(f);
    bf16 v;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      v.x = (u16)((u >> 16) | 0x40);  // NaN stays NaN
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      v.x = (u16)(u >> 16);
    }
    return v;
  }
};

#define MC_BINARY(name, expr)                                                      \
  struct name {                                                                    \
    template <class A> static __device__ __forceinline__ A f(A a, A b) { return expr; } \
  };
MC_BINARY(Sum, a + b)
MC_BINARY(Prod, a * b)
MC_BINARY(Min, b < a ? b : a)
MC_BINARY(Max, a < b ? b : a)
MC_BINARY(Avg, a + b)  // divided by the group size once, in finish()

template <class Op, class A> __device__ __forceinline__ A finish(A a, int world) { return a; }
template <> __device__ __forceinline__ float finish<Avg, float>(float a, int world) {
  return a / (float)world;
}
template <> __device__ __forceinline__ double finish<Avg, double>(double a, int world) {
  return a / (double)world;
}

// out[i] for i in [lo, hi) of the slice at byte offset `base` of every staging buffer.
template <class T, class Op>
__device__ __forceinline__ void reduce_part(const Args& a, u64 base, u64 lo, u64 hi) {
  typedef Elem<T> E;
  const u64 es = sizeof(T);
  const int per = 16 / sizeof(T);
  T* out = (T*)a.out;
  u64 i = lo;
  const u64 packs = (hi - lo) / per;
  const bool aligned = (((u64)(out + lo)) & 15) == 0;
  for (u64 k = threadIdx.x; k < packs; k += blockDim.x) {
    const u64 off = base + (lo + k * per) * es;
    // Every rank's pack first, then the sums: the loads are in flight together (a load used
    // before the next is issued would cost a round trip over the link per rank).
    Pack ps[MC_MAX_RANKS];
#pragma unroll
    for (int r = 0; r < MC_MAX_RANKS; ++r)
      if (r < a.world) ps[r] = ld_cg((const Pack*)(a.bufs[r] + off));
    typename E::Acc acc[16 / sizeof(T)];
    const T* v = (const T*)&ps[0];
    for (int j = 0; j < per; ++j) acc[j] = E::up(v[j]);
#pragma unroll
    for (int r = 1; r < MC_MAX_RANKS; ++r) {
      if (r >= a.world) break;
      v = (const T*)&ps[r];
      for (int j = 0; j < per; ++j) acc[j] = Op::f(acc[j], E::up(v[j]));
    }
    Pack res;
    T* w = (T*)&res;
    for (int j = 0; j < per; ++j) w[j] = E::down(finish<Op>(acc[j], a.world));
    if (aligned) {
      *(Pack*)(out + lo + k * per) = res;
    } else {
      for (int j = 0; j < per; ++j) out[lo + k * per + j] = w[j];
    }
  }
  i = lo + packs * per;
  for (u64 k = i + threadIdx.x; k < hi; k += blockDim.x) {
    // The tail: under 16 bytes.
    typename E::Acc acc = E::up(ld_cg((const T*)(a.bufs[0] + base + k * es)));
    for (int r = 1; r < a.world; ++r)
      acc = Op::f(acc, E::up(ld_cg((const T*)(a.bufs[r] + base + k * es))));
    out[k] = E::down(finish<Op>(acc, a.world));
  }
}

// ---- the collectives ----------------------------------------------------------------------

template <class T, class Op>
__device__ void all_reduce(const Args& a) {
  const u64 es = sizeof(T);
  u64 lo, hi;
  part(a.n, es, &lo, &hi);
  copy_bytes<false>(a.bufs[a.rank] + lo * es, a.in + lo * es, (hi - lo) * es);
  if (!barrier(a, a.flags, a.token)) return;
  reduce_part<T, Op>(a, 0, lo, hi);
}

// Slice d of the input (n elements each) sits at d * stride in the staging buffer.
template <class T, class Op>
__device__ void reduce_scatter(const Args& a) {
  const u64 es = sizeof(T);
  u64 lo, hi;
  part(a.n, es, &lo, &hi);
  for (int d = 0; d < a.world; ++d)
    copy_bytes<false>(a.bufs[a.rank] + d * a.stride + lo * es, a.in + (d * a.n + lo) * es,
                      (hi - lo) * es);
  if (!barrier(a, a.flags, a.token)) return;
  reduce_part<T, Op>(a, a.rank * a.stride, lo, hi);
}

__device__ void all_gather(const Args& a) {
  u64 lo, hi;
  part(a.n, 1, &lo, &hi);
  copy_bytes<false>(a.bufs[a.rank] + lo, a.in + lo, hi - lo);
  if (!barrier(a, a.flags, a.token)) return;
  for (int r = 0; r < a.world; ++r) copy_bytes<true>(a.out + r * a.n + lo, a.bufs[r] + lo, hi - lo);
}

// Two-shot all_reduce (Note [Two-shot all_reduce] in direct.h): the array is cut into
// `world` slices of whole lines; block b of every rank handles part b of every slice.
//  1. copy part b of every slice of the input into this rank's staging buffer;
//  2. barrier (flags, token): part b of every slice is staged on every rank;
//  3. reduce part b of this rank's own slice from every rank's staging buffer (rank order),
//     into out and into this rank's result area;
//  4. barrier (flags2, token2): every rank's part b of its slice is reduced;
//  5. copy part b of every other slice from its owner's result area into out.
// Each element is reduced once, by its slice's owner, so every rank gets bit-identical
// results. Why the buffers need no more barriers: see the Note.
template <class T, class Op>
__device__ void all_reduce_two_shot(const Args& a) {
  const u64 es = sizeof(T);
  const u64 per_line = MC_PART_ALIGN / es;
  u64 slice = (a.n + a.world - 1) / a.world;
  slice = (slice + per_line - 1) / per_line * per_line;
  u64 lo, hi;
  part(slice, es, &lo, &hi);
  for (int q = 0; q < a.world; ++q) {
    const u64 b = q * slice + lo < a.n ? q * slice + lo : a.n;
    const u64 e = q * slice + hi < a.n ? q * slice + hi : a.n;
    copy_bytes<false>(a.bufs[a.rank] + b * es, a.in + b * es, (e - b) * es);
  }
  if (!barrier(a, a.flags, a.token)) return;
  {
    const u64 b = a.rank * slice + lo < a.n ? a.rank * slice + lo : a.n;
    const u64 e = a.rank * slice + hi < a.n ? a.rank * slice + hi : a.n;
    reduce_part<T, Op>(a, 0, b, e);
    __syncthreads();  // the block's results are in out before it copies them
    copy_bytes<false>(a.res[a.rank] + b * es, a.out + b * es, (e - b) * es);
  }
  if (!barrier(a, a.flags2, a.token2)) return;
  for (int q = 0; q < a.world; ++q) {
    if (q == a.rank) continue;
    const u64 b = q * slice + lo < a.n ? q * slice + lo : a.n;
    const u64 e = q * slice + hi < a.n ? q * slice + hi : a.n;
    copy_bytes<true>(a.out + b * es, a.res[q] + b * es, (e - b) * es);
  }
}

// The entry point, appended by direct.cc for the kernel at hand, e.g.
//   extern "C" __global__ void __launch_bounds__(MC_THREADS) mc_kernel(Args a) {
//     all_reduce<float, Sum>(a); }
