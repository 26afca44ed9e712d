// A decoder layer's small element-wise ops on CPU, each one pass over memory instead of the
// several torch ops (and temporaries) they take in eager mode:
//
// rms_norm(x [T, H], weight [H], eps) -> [T, H]: transformers' Llama / Qwen2 RMSNorm; the
//   statistics in float32; for bfloat16 the normalised row is rounded to bfloat16 before the
//   weight multiplies it, as transformers does.
// rotary_(x [T, N, D], cos [T, D], sin [T, D]): rotary embedding in place over N heads,
//   x * cos + rotate_half(x) * sin, rounded as torch's eager ops round (each product, then the
//   sum), so the result is transformers' bit for bit.
//
// torch.ops.serve_app_cpu.rms_norm and rotary_ (ops.cpp).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include "ops.h"

#include "elements.h"

#include <cmath>
#include <cstdint>

namespace {

using serve_app_cpu::narrow;
using serve_app_cpu::widen;

// x rounded to T's precision, as a float
template <typename T>
inline float rounded(float x) {
  return widen(T(x));
}

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t width,
                   int64_t row_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * row_stride;
      T* orow = out + r * width;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < width; ++i) squares += widen(xr[i]) * widen(xr[i]);
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(width) + eps);
      for (int64_t i = 0; i < width; ++i) {
        if constexpr (std::is_same_v<T, float>) {
          orow[i] = xr[i] * inv * weight[i];
        } else {  // round the normalised value to the input dtype, then times the weight
          const float normed = static_cast<float>(T(widen(xr[i]) * inv));
          narrow(orow + i, widen(weight[i]) * normed);
        }
      }
    }
  });
}

}  // namespace

namespace serve_app_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [tokens, hidden], rows contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be [hidden]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(),
                         x.size(0), x.size(1), x.stride(0), static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    rms_norm_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                                 out.data_ptr<c10::BFloat16>(), x.size(0), x.size(1),
                                 x.stride(0), static_cast<float>(eps));
  }
  return out;
}

template <typename T>
void rotate_rows(T* x, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t dim,
                 int64_t token_stride, int64_t head_stride) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = x + t * token_stride + h * head_stride;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          // each product rounded to T before the sum, as torch's two multiplies and add do
          const float a = widen(row[i]), b = widen(row[i + half]);
          narrow(row + i, rounded<T>(a * widen(c[i])) + rounded<T>(-b * widen(s[i])));
          narrow(row + i + half,
                 rounded<T>(b * widen(c[i + half])) + rounded<T>(a * widen(s[i + half])));
        }
      }
    }
  });
}

void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == tokens &&
                  cos.size(1) == dim && cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be [tokens, head_dim], contiguous");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "x, cos and sin must share a dtype");
  if (x.scalar_type() == at::kFloat) {
    rotate_rows<float>(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), tokens,
                       heads, dim, x.stride(0), x.stride(1));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    rotate_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(),
                               sin.data_ptr<c10::BFloat16>(), tokens, heads, dim, x.stride(0),
                               x.stride(1));
  }
}

}  // namespace serve_app_cpu
