// float32 and bfloat16 elements as float32 values, shared by the engine's CPU kernels: widen
// reads one element as a float (bfloat16 is the high half of a float32, so exactly), narrow
// stores a float, rounded to nearest-even for bfloat16.
#pragma once

#include <c10/util/BFloat16.h>

namespace serve_app_cpu {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline void narrow(float* p, float x) { *p = x; }
inline void narrow(c10::BFloat16* p, float x) { *p = c10::BFloat16(x); }

}  // namespace serve_app_cpu
