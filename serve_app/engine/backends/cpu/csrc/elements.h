// float32 and bfloat16 elements as float32 values, shared by the engine's CPU kernels: one at a
// time (widen reads an element as a float, exactly: bfloat16 is the high half of a float32;
// narrow stores a float, rounded to nearest-even for bfloat16) or kLanes at a time (vf: GCC/Clang
// vector extensions): 16, one register, with AVX-512; 8, one register, with AVX2, since GCC
// compiles comparisons, selects and scalar-times-vector products of vectors wider than the CPU's
// registers one lane at a time through memory (measured on an AMD EPYC without AVX-512: decode
// attention ~4x and the argmax ~10x slower with 16 lanes); 16 elsewhere (four NEON registers).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace serve_app_cpu {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline void narrow(float* p, float x) { *p = x; }
inline void narrow(c10::BFloat16* p, float x) { *p = c10::BFloat16(x); }

#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 16;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vh __attribute__((vector_size(kLanes * 2)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#if defined(__AVX512F__)
// 16 bfloat16 bit patterns as the float32 values they are: each the high half of its float, in
// one widening move (compilers tuned for 256-bit vectors split the generic form in four)
inline __m512 widen16(__m256i half) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#endif

inline vf vload(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  return (vf)widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  vh half;
  std::memcpy(&half, p, sizeof(half));
  vi bits = __builtin_convertvector(half, vi) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#endif
}

// While alive, the calling thread's float arithmetic flushes denormal results to zero and reads
// denormal inputs as zero (x86's MXCSR FTZ and DAZ bits; elsewhere it does nothing). A softmax
// whose scores spread over more than ~87 gives probabilities near the smallest normal float, and
// their products with the values are denormal: x86 computes each of those through a microcode
// assist, ~100 times slower (measured: one layer's decode attention 3.0 ms instead of 0.3). The
// terms flushed are below 1.2e-38, far under the rounding of any sum they go into.
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFtz | kDaz); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFtz = 0x8000, kDaz = 0x0040;
  unsigned saved_;
#else
  FlushDenormals() {}
#endif
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

}  // namespace serve_app_cpu
