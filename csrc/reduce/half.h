// fp16 and bf16 <-> f32: the one place that knows their bit layouts.
//
// Narrowing rounds to nearest, ties to even. Inf stays Inf. NaN stays NaN: the quiet bit is
// set and the top payload bits are kept, which is what the F16C instructions do. So the portable
// and hardware paths give the same bits for every input (checked for all 2^32 floats while
// writing this; tests/unit/test_kernels.py checks all 65536 halves on every SIMD level).
//
// Two forms:
//  - portable scalar functions, written without branches so that GCC vectorises loops that
//    call them at -O3 on any target (see Note [Branch-free select]);
//  - on x86-64, fixed-width F16C and AVX-512F functions. They carry their own target
//    attributes, so only kernels compiled for such a target may call them (kernels.cc picks
//    them at run time). Nothing here needs -mf16c on the command line.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace meshcoll::reduce {

namespace half_detail {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Note [Branch-free select]
// Each conversion computes every case (normal, subnormal, Inf/NaN) and then picks one with a
// mask. Written as `c ? a : b`, GCC sinks the float arithmetic of the subnormal case into a
// branch, and because -ftrapping-math is on by default it cannot if-convert that branch back,
// so the loop is not vectorised ("control flow in loop"). With masks there is no branch.
inline uint32_t select(bool c, uint32_t a, uint32_t b) {
  uint32_t m = 0u - static_cast<uint32_t>(c);
  return (a & m) | (b & ~m);
}

}  // namespace half_detail

// IEEE binary16 -> binary32. Exact (every half is a float); signalling NaNs come back quiet.
inline float half_to_float(uint16_t h) {
  using half_detail::select;
  const uint32_t em = static_cast<uint32_t>(h & 0x7fffu) << 13;  // exponent+mantissa, f32 place
  const uint32_t exp = em & (0x7c00u << 13);
  const uint32_t normal = em + ((127u - 15u) << 23);  // rebias
  uint32_t inf_nan = normal + ((128u - 16u) << 23);   // exponent all ones
  inf_nan |= select((em & 0x7fffffu) != 0, 0x400000u, 0u);  // NaN: set the quiet bit
  // Subnormal half m * 2^-24: build the float 1.m * 2^-14 and subtract 2^-14 (exact).
  const uint32_t subnormal =
      half_detail::bits_of(half_detail::float_of(normal + (1u << 23)) -
                           half_detail::float_of(113u << 23));
  const uint32_t r =
      select(exp == (0x7c00u << 13), inf_nan, select(exp == 0, subnormal, normal));
  return half_detail::float_of(r | (static_cast<uint32_t>(h & 0x8000u) << 16));
}

// binary32 -> binary16, round to nearest even; overflow goes to Inf.
inline uint16_t float_to_half(float f) {
  using half_detail::select;
  uint32_t u = half_detail::bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  const uint32_t nan = 0x7e00u | ((u >> 13) & 0x3ffu);
  const uint32_t inf = 0x7c00u;
  // Results below 2^-14 are subnormal halves: adding 0.5 (as a float) makes the FPU round the
  // value to a multiple of 2^-24, which then sits in the low mantissa bits.
  const float denorm_magic = half_detail::float_of(((127u - 15u) + (23u - 10u) + 1u) << 23);
  const uint32_t subnormal =
      half_detail::bits_of(half_detail::float_of(u) + denorm_magic) -
      half_detail::bits_of(denorm_magic);
  // Normal: rebias, then add 0x0fff plus the lowest kept bit (ties to even) and drop 13 bits.
  // A carry out of the mantissa correctly bumps the exponent, up to Inf.
  const uint32_t normal =
      (u + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
  const uint32_t r =
      select(u > 0x7f800000u, nan,
             select(u >= ((127u + 16u) << 23), inf, select(u < (113u << 23), subnormal, normal)));
  return static_cast<uint16_t>(r | sign);
}

// bfloat16 is the top half of a float.
inline float bfloat16_to_float(uint16_t h) {
  return half_detail::float_of(static_cast<uint32_t>(h) << 16);
}

// binary32 -> bfloat16, round to nearest even; NaN stays NaN (quiet bit forced, since dropping
// the low payload bits could otherwise turn a NaN into Inf).
inline uint16_t float_to_bfloat16(float f) {
  const uint32_t u = half_detail::bits_of(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  // Integer-only, so a plain ?: vectorises (a blend); the signed compare saves a sign flip.
  const bool is_nan = static_cast<int32_t>(u & 0x7fffffffu) > 0x7f800000;
  return static_cast<uint16_t>(is_nan ? nan : rounded);
}

#if defined(__x86_64__)
// Hardware conversions of a fixed number of lanes: 8 with F16C, 16 with AVX-512F. GCC (12)
// does not vectorise scalar _Float16 or _cvtsh_ss conversions, and the vectorised bit
// twiddling above is several times slower than one vcvtph2ps, so these use the intrinsics
// directly. Each carries its own target attribute: call them only from code compiled for
// that target after checking the CPU (kernels.cc does both); there GCC inlines them and keeps
// the lanes in registers.
//
// The narrowing ones pass the result through an empty asm: it must sit in a register, so that
// clang cannot fold the store into vcvtps2ph's memory form, which Intel cores run at a lower
// rate (with it the zig-built wheel's f16 sum took 1.3x the time of GCC's, which never folds).
__attribute__((target("avx2,f16c"))) inline void half_to_float_x8_f16c(const uint16_t* in,
                                                                        float* out) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
  _mm256_storeu_ps(out, _mm256_cvtph_ps(h));
}

__attribute__((target("avx2,f16c"))) inline void float_to_half_x8_f16c(const float* in,
                                                                        uint16_t* out) {
  __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in), _MM_FROUND_TO_NEAREST_INT);
  __asm__("" : "+x"(h));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), h);
}

__attribute__((target("avx512f"))) inline void half_to_float_x16_avx512(const uint16_t* in,
                                                                         float* out) {
  // The maskz forms with a full mask compile to the plain instruction; the plain intrinsics
  // trip a -Wmaybe-uninitialized false positive in GCC 12's headers (_mm512_undefined_*).
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in));
  _mm512_storeu_ps(out, _mm512_maskz_cvtph_ps(0xffff, h));
}

__attribute__((target("avx512f"))) inline void float_to_half_x16_avx512(const float* in,
                                                                         uint16_t* out) {
  __m256i h = _mm512_maskz_cvtps_ph(0xffff, _mm512_loadu_ps(in), _MM_FROUND_TO_NEAREST_INT);
  __asm__("" : "+x"(h));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
}

// bfloat16, 8 or 16 lanes: the bit twiddling of bfloat16_to_float and float_to_bfloat16,
// lane for lane (same bits as the scalar code, NaN included), written out because GCC
// vectorised the scalar loops poorly (bf16 sum at a quarter of f16's speed): the narrowing
// needs a 32 -> 16 bit pack that it did not find. (maskz forms: see above.)
__attribute__((target("avx2"))) inline void bfloat16_to_float_x8_avx2(const uint16_t* in,
                                                                       float* out) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
  __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
  _mm256_storeu_ps(out, _mm256_castsi256_ps(w));
}

__attribute__((target("avx2"))) inline void float_to_bfloat16_x8_avx2(const float* in,
                                                                       uint16_t* out) {
  const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(in));
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                            _mm256_set1_epi32(0x7f800000));
  const __m256i r = _mm256_blendv_epi8(rounded, nan, is_nan);  // every lane fits 16 bits
  // packus works within 128-bit halves: lanes 0-3 and 4-7 land in qwords 0 and 2.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

__attribute__((target("avx512f"))) inline void bfloat16_to_float_x16_avx512(const uint16_t* in,
                                                                             float* out) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in));
  __m512i w = _mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, h), 16);
  _mm512_storeu_si512(out, w);
}

__attribute__((target("avx512f"))) inline void float_to_bfloat16_x16_avx512(const float* in,
                                                                             uint16_t* out) {
  const __m512i u = _mm512_loadu_si512(in);
  const __m512i hi = _mm512_maskz_srli_epi32(0xffff, u, 16);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_maskz_srli_epi32(
      0xffff, _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __m512i nan = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i r = _mm512_mask_blend_epi32(is_nan, rounded, nan);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_maskz_cvtepi32_epi16(0xffff, r));
}
#endif  // __x86_64__

}  // namespace meshcoll::reduce
