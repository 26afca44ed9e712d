// The C++ functions behind the ops that ops.cpp registers, one per op; each is defined in the
// source named beside it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

namespace serve_app_cpu {

namespace attention {
// paged_decode_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale);
}  // namespace attention

namespace gemm {
// streamed_gemm.cpp (built where SERVE_APP_STREAMED_GEMM is defined: gemm_vec.h)
at::Tensor streamed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           const c10::optional<at::Tensor>& bias,
                           const c10::optional<at::Tensor>& other, int64_t epilogue);
bool streamed_bf16_pairs();
std::vector<double> streamed_gemm_speed(c10::ArrayRef<double> set);
}  // namespace gemm

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// argmax.cpp
at::Tensor argmax_rows(const at::Tensor& x);
// huge_pages.cpp
at::Tensor zeros_on_huge_pages(c10::IntArrayRef size, c10::ScalarType dtype);
// spare_cores.cpp
int64_t use_spare_cpus(c10::ArrayRef<int64_t> cpus, int64_t helper_delay_us,
                       int64_t team_delay_us, int64_t spin_us, int64_t part_delay_us);
std::vector<int64_t> spare_cores_stats();

}  // namespace serve_app_cpu
