// Decode attention straight from the paged KV cache (one query token per sequence).
//
// For each sequence: every query head scores every cached key of the sequence
// (query heads of a KV group share its keys), softmax, then weights the values.
// Keys and values are read in place through the block table, one token's heads
// at a time (contiguous): no gather, no padding. Math in float32 whatever the
// cache dtype. Parallel over sequences.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// Widen one row to float32 (bf16 by bit shift, which vectorizes; others by cast).
template <typename T>
static inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t widened = static_cast<uint32_t>(bits[i]) << 16;
    float value;
    std::memcpy(&value, &widened, sizeof(value));
    dst[i] = value;
  }
}

template <typename T>
static void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                          const int64_t* seq_lens, T* out, int64_t batch, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                          int64_t block_stride, int64_t table_width, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_width = num_kv_heads * head_dim;  // one token's K (or V), all KV heads
  const int64_t q_width = num_heads * head_dim;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(q_width), acc(q_width), row(token_width), scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = seq_lens[b];
      const int64_t* table = tables + b * table_width;
      load_row(q + b * q_width, qf.data(), q_width);
      for (auto& x : qf) x *= scale;
      scores.resize(num_heads * len);
      // Pass 1: scores[h][t] = q_h . k_t, reading each token's keys (all heads) contiguously.
      for (int64_t t = 0; t < len; ++t) {
        load_row(k_cache + table[t / block_size] * block_stride + (t % block_size) * token_width,
                 row.data(), token_width);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* qh = qf.data() + h * head_dim;
          const float* kh = row.data() + (h / group) * head_dim;
          float s = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * kh[d];
          scores[h * len + t] = s;
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* sh = scores.data() + h * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = std::max(m, sh[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sh[t] = std::exp(sh[t] - m); sum += sh[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sh[t] *= inv;
      }
      // Pass 2: out_h = sum_t p[h][t] v_t.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        load_row(v_cache + table[t / block_size] * block_stride + (t % block_size) * token_width,
                 row.data(), token_width);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float p = scores[h * len + t];
          const float* vh = row.data() + (h / group) * head_dim;
          float* ah = acc.data() + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * vh[d];
        }
      }
      for (int64_t i = 0; i < q_width; ++i) out[b * q_width + i] = static_cast<T>(acc[i]);
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
