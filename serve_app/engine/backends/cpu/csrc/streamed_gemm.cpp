// A GEMM that reads its weight once per call as a stream, for weights that do not stay in the
// CPU's caches between uses: the LM head (151936 x 512 on the demo model, 311 MB in float32) and
// the decoder layers' projections, multiplied by a decode step's few dozen rows.
//
// streamed_linear(x [M, K], packed [blocks, K, 32], n, bias=None, other=None, epilogue=0)
//   -> x @ W^T (+ bias) [M, n], then + other (epilogue 1), * other (epilogue 2) or
//   * silu(other) (epilogue 3: a gated MLP's up projection times its activated gate), W [n, K]
//   packed by cpu_gemm.StreamedLinear: 32 of its rows per block, transposed so that each k holds
//   the block's 32 weights side by side, the last block padded with zeros. x, W, bias, other and
//   the result share a dtype: float32, or bfloat16 (summed and finished in float32, rounded to
//   nearest-even once, as a bfloat16 GEMM with fused ops rounds). On CPUs with bfloat16
//   arithmetic (AVX512-BF16; streamed_bf16_pairs() says true) a bfloat16 weight is packed in
//   pairs: for k and k + 1, the block's 32 columns' two weights side by side (column j's pair at
//   2j), a last unpaired k (K odd) as above, and each pair of products is summed by one
//   VDPBF16PS, which reads bfloat16 subnormals as zero. Elsewhere bfloat16 is widened to float32
//   exactly and summed k by k.
//
// At a few dozen rows such a GEMM is neither compute- nor memory-bound alone: a weight block
// takes as long to arrive from memory as to multiply, and oneDNN's blocked kernel does one after
// the other (measured on a 2-core Xeon at 32 rows: 25.7 ms for the demo's head, while the memory
// alone takes 11 ms and the arithmetic alone ~17 ms). Here every block is multiplied in register
// tiles of up to 12 rows x 32 columns (24 accumulators; on AVX2, two tiles of up to 6 rows x 16
// columns side by side) while the block after next is asked into L2, its lines spread evenly over
// the tiles' k loops: 19-20 ms. Each output is one k-ordered float32 sum. More rows than 48 (a
// prefill) go through each thread's blocks again, 48 at a time. Where helper threads run on spare
// cores (spare_cores.h, ModelConfig engineSpareCpus), a GEMM of two chunks or more is shared with
// them, chunk by chunk, with the same sums in the same order. Without bfloat16 arithmetic,
// oneDNN's bfloat16 GEMM runs at a quarter of its float32 rate (with AVX-512) or cannot run at
// all (AVX2 only); with it, the pairs make this kernel about as fast as oneDNN's on one core,
// and only this one can be shared with the helpers.
//
// Its parts: the vector operations of each instruction set (gemm_vec.h), the register tiles
// (gemm_tiles.h), one pass of the weight over slices of rows (gemm_pass.h), the GEMM shared
// with helpers on spare cores (gemm_shared.h). torch.ops.serve_app_cpu.streamed_linear, with
// streamed_bf16_pairs and streamed_gemm_speed (ops.cpp).

#include "gemm_vec.h"  // SERVE_APP_STREAMED_GEMM: whether this build has the kernel

#if defined(SERVE_APP_STREAMED_GEMM)

#include "ops.h"

#include "gemm_shared.h"

namespace serve_app_cpu::gemm {

template <typename T>
Finish<T> finish_of(const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& other,
                    int64_t kind) {
  const bool with_other = kind != kNone;
  return {bias ? bias->data_ptr<T>() : nullptr, with_other ? other->data_ptr<T>() : nullptr,
          with_other ? other->stride(0) : 0, static_cast<Epilogue>(kind)};
}

// x @ W^T (+ bias) (+ or * other, or * silu(other), by `epilogue`: 0 none, 1 add, 2 mul, 3
// silu-mul)
at::Tensor streamed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           const c10::optional<at::Tensor>& bias,
                           const c10::optional<at::Tensor>& other, int64_t epilogue) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x and packed must both be float32 or both bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.is_contiguous(),
              "packed must be [blocks, K, 32], contiguous");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x and packed differ in K");
  TORCH_CHECK(n > (blocks - 1) * kCols && n <= blocks * kCols, "n does not match the blocks");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                        bias->scalar_type() == x.scalar_type()),
              "bias must be [n], contiguous, in x's dtype");
  TORCH_CHECK(epilogue == kNone || epilogue == kAdd || epilogue == kMul || epilogue == kSiluMul,
              "unknown epilogue");
  TORCH_CHECK(epilogue == kNone || (other && other->dim() == 2 && other->size(0) == M &&
                                    other->size(1) == n && other->stride(1) == 1 &&
                                    other->scalar_type() == x.scalar_type()),
              "other must be [M, n] with contiguous rows, in x's dtype");
  auto out = at::empty({M, n}, x.options());
  if (M == 0) return out;  // (K == 0 goes through: the tiles finish sums of nothing, zeros)
  using XB = XOf<c10::BFloat16>;
  auto slices = slice_rows(M);
  const auto xs = x.to(x.scalar_type() == at::kFloat || std::is_same_v<XB, float>
                           ? at::kFloat
                           : at::kBFloat16)
                      .contiguous();
  const bool panels = slices.size() == 1;
  const auto xp = !panels                           ? xs
                  : xs.scalar_type() == at::kFloat ? pack_panels<float>(xs, slices[0])
                                                   : pack_panels<XB>(xs, slices[0]);
  std::vector<at::Tensor> keep{xp, packed};
  if (bias) keep.push_back(*bias);
  if (epilogue != kNone) keep.push_back(*other);
  if (x.scalar_type() == at::kFloat) {
    Gemm<float> g{xp.data_ptr<float>(), panels, std::move(slices), packed.data_ptr<float>(), K,
                  n, blocks, finish_of<float>(bias, other, epilogue)};
    gemm(std::move(g), M, out.data_ptr<float>(), std::move(keep));
  } else {
    Gemm<c10::BFloat16> g{xp.data_ptr<XB>(), panels, std::move(slices),
                          packed.data_ptr<c10::BFloat16>(), K, n, blocks,
                          finish_of<c10::BFloat16>(bias, other, epilogue)};
    gemm(std::move(g), M, out.data_ptr<c10::BFloat16>(), std::move(keep));
  }
  return out;
}

}  // namespace serve_app_cpu::gemm

#endif
