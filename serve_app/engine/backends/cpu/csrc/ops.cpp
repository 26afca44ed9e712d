// Every op of the engine's CPU kernels, torch.ops.serve_app_cpu.<name>: its schema, and the
// function that computes it (ops.h says where each is defined). serve_app/engine/backends/cpu/
// kernels.py builds them and says what each is for.
#include <torch/library.h>

#include "gemm_vec.h"  // SERVE_APP_STREAMED_GEMM: whether this build has the streamed GEMM
#include "ops.h"

using namespace serve_app_cpu;

TORCH_LIBRARY(serve_app_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
#if defined(SERVE_APP_STREAMED_GEMM)
  m.def(
      "streamed_linear(Tensor x, Tensor packed, int n, Tensor? bias=None, Tensor? other=None, "
      "int epilogue=0) -> Tensor");
  // no tensor arguments: one kernel for every dispatch key
  m.def("streamed_bf16_pairs() -> bool", &gemm::streamed_bf16_pairs);
  m.def("streamed_gemm_speed(float[] set=[]) -> float[]", &gemm::streamed_gemm_speed);
#endif
  m.def("zeros_on_huge_pages(int[] size, ScalarType dtype) -> Tensor", &zeros_on_huge_pages);
  m.def(
      "use_spare_cpus(int[] cpus, int helper_delay_us=0, int team_delay_us=0, int spin_us=5000, "
      "int part_delay_us=0) -> int",
      &use_spare_cpus);
  m.def("spare_cores_stats() -> int[]", &spare_cores_stats);
}

TORCH_LIBRARY_IMPL(serve_app_cpu, CPU, m) {
  m.impl("paged_decode_attention", &attention::paged_decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("argmax_rows", &argmax_rows);
#if defined(SERVE_APP_STREAMED_GEMM)
  m.impl("streamed_linear", &gemm::streamed_linear);
#endif
}
