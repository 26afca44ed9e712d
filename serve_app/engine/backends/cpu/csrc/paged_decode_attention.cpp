// Decode attention on CPU that reads keys and values where they lie in the paged KV cache.
//
// One query token per sequence attends over that sequence's first context_lens[b] cached
// positions, found through its block table. Work items are (sequence, KV head) pairs, run in
// parallel on torch's intra-op thread pool; each item computes the scores of its group of query
// heads against every key (each key row read once for the whole group; bfloat16 keys through
// AVX512-BF16 dot products where the CPU has them), a softmax in float32 kLanes at a time,
// then the weighted sum of the value rows with its accumulators in registers. A sequence's
// first item asks for whole cache rows ahead of their use, so its other heads find them in
// cache. No key or value is copied out of the cache; the query may be a view with strided rows.
// Where helper threads run on spare cores (spare_cores.h, ModelConfig engineSpareCpus), the items
// are shared with them in chunks, each item computed the same way whoever computes it.
// Its parts: the arithmetic (attention_math.h), the work items (attention_items.h).
//
// Built on first use by serve_app/engine/backends/cpu/kernels.py (torch.utils.cpp_extension);
// torch.ops.serve_app_cpu.paged_decode_attention (ops.cpp).

#include "attention_items.h"
#include "ops.h"

namespace serve_app_cpu::attention {

// Decode attention is shared with helpers on spare cores (spare_cores.h) in chunks of whole
// items of about kChunkWork multiply-adds each, the last 2 * kChunkWork cut in quarters (a caller
// that takes back a late helper's chunk redoes little).
constexpr int64_t kChunkWork = 1 << 19;  // ~40-80 us on one core of the machines measured

// chunk boundaries, in items: an item costs its context length times its heads' dimensions
// (the query heads' scores and values, the KV head's keys)
template <typename T>
std::vector<int64_t> chunk_bounds(const Attention<T>& a) {
  const int64_t per_token = (a.group() + 1) * a.head_dim;
  int64_t left = 0;
  for (int64_t b = 0; b < a.num_seqs; ++b) left += a.lens[b] * per_token * a.num_kv_heads;
  std::vector<int64_t> bounds{0};
  int64_t work = 0;
  for (int64_t item = 0; item < a.items(); ++item) {
    const int64_t cost = a.lens[item / a.num_kv_heads] * per_token;
    work += cost;
    left -= cost;
    const int64_t budget = left < 2 * kChunkWork ? kChunkWork / 4 : kChunkWork;
    if (work >= budget && item + 1 < a.items()) {
      bounds.push_back(item + 1);
      work = 0;
    }
  }
  bounds.push_back(a.items());
  return bounds;
}

// out = attention over `a`: shared with the helpers when some run and it makes two chunks or
// more, else on the torch threads alone
template <typename T>
void attend(const Attention<T>& a, T* out, std::vector<at::Tensor> keep) {
  const Items<T> items = items_for<T>(a.head_dim);
  if (serve_app_cpu::spare_helpers() > 0) {
    auto bounds = chunk_bounds(a);
    if (bounds.size() > 2) {
      auto compute = [a, items](int64_t begin, int64_t end, T* into) {
        items(a, begin, end, into);
      };
      serve_app_cpu::run_dense(std::move(bounds), a.item_size(), out, std::move(compute),
                               std::move(keep));
      return;
    }
  }
  at::parallel_for(0, a.items(), 1, [&](int64_t begin, int64_t end) {
    items(a, begin, end, out + begin * a.item_size());
  });
}

// query may be a view with rows apart (e.g. the query heads of a fused q/k/v projection's
// output): heads and dimensions must be dense, sequences may be strided. The result is dense.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "caches must be [num_blocks, block_size, num_kv_heads, head_dim], alike");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and context lengths must be int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "caches' head_dim differs from the query's");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  context_lens.numel() == num_seqs,
              "one block table row and one context length per sequence");
  const bool rows_dense = query.stride(2) == 1 && query.stride(1) == head_dim &&
                          query.stride(0) >= num_heads * head_dim;
  const auto q = rows_dense ? query : query.contiguous();
  const int64_t q_stride = q.stride(0);
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  const int64_t* len_data = lens.data_ptr<int64_t>();
  int64_t max_len = 1;
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(len_data[b] >= 1 && len_data[b] <= tables.size(1) * block_size,
                "context length out of the block table's range");
    max_len = std::max(max_len, len_data[b]);
  }
  auto out = at::empty({num_seqs, num_heads, head_dim}, q.options());
  std::vector<at::Tensor> keep{q, k_cache, v_cache, tables, lens};
  const float s = static_cast<float>(scale);
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const Attention<T> a{q.data_ptr<T>(), q_stride, k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                         tables.data_ptr<int64_t>(), len_data, num_seqs, num_heads, num_kv_heads,
                         head_dim, block_size, tables.size(1), max_len, s};
    attend<T>(a, out.data_ptr<T>(), std::move(keep));
  };
  if (q.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    run(static_cast<c10::BFloat16*>(nullptr));
  }
  return out;
}

}  // namespace serve_app_cpu::attention

