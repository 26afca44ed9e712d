// The streamed GEMM's vector operations, per instruction set: which one this build has (set
// by the compiler's target, -march), and what a register tile needs of it. Included by
// streamed_gemm.cpp's other parts (gemm_tiles.h, gemm_pass.h, gemm_shared.h).
#pragma once

// Built where it was measured: AVX-512 (Intel Xeon) and AVX2 with FMA (AMD EPYC without AVX-512);
// other CPUs keep oneDNN's GEMM.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SERVE_APP_STREAMED_GEMM 512
#if defined(__AVX512BF16__)
#define SERVE_APP_BF16_PAIRS 1  // bfloat16 weights packed in pairs of k, summed by VDPBF16PS
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define SERVE_APP_STREAMED_GEMM 256
#endif

#if defined(SERVE_APP_STREAMED_GEMM)

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "elements.h"

namespace serve_app_cpu::gemm {

// The vector operations a register tile needs, on `kWidth` floats at a time. A tile is up to
// `kRows` rows x two vectors of columns; `load`/`store` with a count touch only the first
// `count` lanes (a last block's columns past n).
#if SERVE_APP_STREAMED_GEMM == 512
// AVX-512: two vectors are a whole block of 32 columns; 24 of the 32 vector registers hold
// accumulators.
using Vec = __m512;
constexpr int64_t kWidth = 16;
constexpr int64_t kRows = 12;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec splat(float v) { return _mm512_set1_ps(v); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }

template <typename T>
inline Vec load(const T* p) {  // 16 elements as float32
  return (Vec)serve_app_cpu::vload(p);
}

inline __mmask16 first(int64_t count) {
  return count >= kWidth ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
}

inline void store(float* out, Vec v, int64_t count) {
  _mm512_mask_storeu_ps(out, first(count), v);
}

// each lane's bfloat16 bit pattern (in its low 16 bits), rounded to nearest-even as
// c10::BFloat16 rounds (a NaN becomes its quiet NaN)
inline __m512i bf16_bits(Vec v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_srli_epi32(rounded, 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7FC0));
}

inline void store(c10::BFloat16* out, Vec v, int64_t count) {
  _mm256_mask_storeu_epi16(out, first(count), _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// rounded to bfloat16 as `store` rounds, kept as float32
inline Vec to_bf16_precision(Vec v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

inline Vec load(const float* p, int64_t count) {
  return _mm512_maskz_loadu_ps(first(count), p);
}

inline Vec load(const c10::BFloat16* p, int64_t count) {
  return serve_app_cpu::widen16(_mm256_maskz_loadu_epi16(first(count), p));
}

inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }  // b where either is NaN
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec where_above(Vec x, float t, Vec then, Vec otherwise) {  // then where x > t
  return _mm512_mask_mov_ps(otherwise, _mm512_cmp_ps_mask(x, splat(t), _CMP_GT_OQ), then);
}
inline Vec nearest(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT); }
inline Vec times_pow2(Vec v, Vec n) {  // v * 2^n for whole n in [-127, 128]
  return _mm512_scalef_ps(v, n);
}
#else
// AVX2: two vectors are half a block (16 columns), so a block takes two tiles side by side;
// 12 of the 16 vector registers hold accumulators, two the weights, one the row's element.
using Vec = __m256;
constexpr int64_t kWidth = 8;
constexpr int64_t kRows = 6;

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec splat(float v) { return _mm256_set1_ps(v); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }

// 8 bfloat16 bit patterns as the float32 values they are (each the high half of its float)
inline Vec widen8(__m128i half) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const c10::BFloat16* p) {
  return widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i first(int64_t count) {  // all bits set in the first `count` lanes
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min(count, kWidth))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline void store(float* out, Vec v, int64_t count) {
  if (count >= kWidth) {
    _mm256_storeu_ps(out, v);
  } else {
    _mm256_maskstore_ps(out, first(count), v);
  }
}

// each lane's bfloat16 bit pattern (in its low 16 bits), rounded to nearest-even as
// c10::BFloat16 rounds (a NaN becomes its quiet NaN)
inline __m256i bf16_bits(Vec v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  rounded = _mm256_srli_epi32(rounded, 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0),
                            _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// rounded to bfloat16 as `store` rounds, kept as float32
inline Vec to_bf16_precision(Vec v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
}

inline void store(c10::BFloat16* out, Vec v, int64_t count) {
  const __m256i rounded = bf16_bits(v);
  // each lane's bits are at most 0xFFFF, which unsigned saturation keeps as they are
  const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                          _mm256_extracti128_si256(rounded, 1));
  if (count >= kWidth) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), halves);
  } else {
    std::memcpy(out, &halves, std::max<int64_t>(count, 0) * sizeof(c10::BFloat16));
  }
}

inline Vec load(const float* p, int64_t count) {
  return count >= kWidth ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first(count));
}

inline Vec load(const c10::BFloat16* p, int64_t count) {
  if (count >= kWidth) return load(p);
  __m128i part = _mm_setzero_si128();
  std::memcpy(&part, p, std::max<int64_t>(count, 0) * sizeof(c10::BFloat16));
  return widen8(part);
}
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }  // b where either is NaN
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec where_above(Vec x, float t, Vec then, Vec otherwise) {  // then where x > t
  return _mm256_blendv_ps(otherwise, then, _mm256_cmp_ps(x, splat(t), _CMP_GT_OQ));
}
inline Vec nearest(Vec v) {
  return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Vec times_pow2(Vec v, Vec n) {  // v * 2^n for whole n in [-126, 127]
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}
#endif

}  // namespace serve_app_cpu::gemm

#endif
