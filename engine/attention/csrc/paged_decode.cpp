// Decode attention straight from the paged KV cache (one query token per sequence).
//
// For each (sequence, KV head): the query heads of that KV group score every
// cached key of the sequence, softmax, then weight the values. Keys and values
// are read in place through the block table: no gather, no padding. Math in
// float32 whatever the cache dtype. Parallel over sequences x KV heads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                          const int64_t* seq_lens, T* out, int64_t batch, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                          int64_t block_stride, int64_t table_width, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t* table = tables + b * table_width;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[g * head_dim + d] = static_cast<float>(q[(b * num_heads + h * group + g) * head_dim + d]) * scale;
      scores.assign(group * len, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* key = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float s = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * static_cast<float>(key[d]);
          scores[g * len + t] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = std::max(m, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* val = v_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * static_cast<float>(val[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          out[(b * num_heads + h * group + g) * head_dim + d] = static_cast<T>(acc[g * head_dim + d]);
    }
  });
}

// q: [B, Hq, D] contiguous; k_cache, v_cache: [N, block_size, Hkv, D] with contiguous
// blocks (any stride between blocks); block_tables: [B, W] int64; seq_lens: [B] int64.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && q.dim() == 3, "q must be contiguous [B, Hq, D]");
  TORCH_CHECK(k_cache.stride(0) == v_cache.stride(0), "k/v caches must share the block stride");
  TORCH_CHECK(k_cache.stride(1) == k_cache.size(2) * k_cache.size(3) && k_cache.stride(3) == 1,
              "each cache block must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                            B, Hq, Hkv, D, bs, k_cache.stride(0), tables.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
}
