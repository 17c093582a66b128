// Decode attention straight from the paged KV cache (one query token per sequence).
//
// For each sequence: every query head scores every cached key of the sequence
// (query heads of a KV group share its keys), softmax, then weights the values.
// Keys and values are read in place through the block table, one token's heads
// at a time (contiguous): no gather, no padding. Math in float32 whatever the
// cache dtype. Parallel over sequences. bf16 caches take an AVX-512 path (below)
// when the compiler targets it: parallel over (sequence, KV head), registers for
// the group's queries and accumulators. An fp8 (float8_e4m3fn) cache takes the
// portable path, widening each byte through a 256-entry table (exact), with the
// layer's k_scale folded into the query and v_scale into the output.
//
// Per-layer options (engine/attention/backend.py LayerAttention), in every path:
//   window   keys from position max(0, len - window) on only: blocks before it are never read
//            (not even prefetched): they may already be freed and hold another sequence's data
//   sinks    [Hq] float32 logits, one more softmax term per head whose value is zero
//   softcap  scores become softcap * tanh(scores / softcap) after the scale, before the softmax
// ATen's tensor, dispatch and per-op headers only (not torch/extension.h): a quarter of the compile time.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <array>
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

// fp8 e4m3fn -> float32 by table: 256 values, computed once with c10's exact conversion.
template <>
inline void load_row<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* src, float* dst, int64_t n) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = c10::detail::fp8e4m3fn_to_fp32_value(static_cast<uint8_t>(i));
    return t;
  }();
  const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = table[bits[i]];
}

#if defined(__AVX512F__)
#include <immintrin.h>

// 16 bf16 -> 16 float32 (a bf16 is the top half of a float32).
static inline __m512 bf16x16_to_fp32(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// exp for x <= 0 (softmax after subtracting the max): 2^n * e^f, |f| <= ln2/2,
// degree-6 polynomial (relative error ~1e-7), x clamped where float32 underflows.
static inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), f);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Softmax of s[0..n) in place; with `sink`, one more term exp(*sink) in the sum (its weight dropped).
static inline void softmax_inplace(float* s, int64_t n, const float* sink) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
  float m = _mm512_reduce_max_ps(vmax);
  for (int64_t i = t; i < n; ++i) m = std::max(m, s[i]);
  if (sink) m = std::max(m, *sink);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= n; t += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (t < n) {
    const __mmask16 mask = (__mmask16)((1u << (n - t)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), vm));
    _mm512_mask_storeu_ps(s + t, mask, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(mask, e));
  }
  float total = _mm512_reduce_add_ps(vsum);
  if (sink) total += std::exp(*sink - m);
  const __m512 inv = _mm512_set1_ps(1.f / total);
  for (t = 0; t + 16 <= n; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
  if (t < n) {
    const __mmask16 mask = (__mmask16)((1u << (n - t)) - 1);
    _mm512_mask_storeu_ps(s + t, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, s + t), inv));
  }
}

// Ask for a block's rows (this KV head's part) before they are needed: blocks are
// scattered, so the hardware prefetcher cannot run ahead across them.
constexpr int64_t kPrefetchBlocks = 4;  // how far ahead to prefetch

template <int DV>
static inline void prefetch_block(const c10::BFloat16* base, int64_t n, int64_t token_width) {
  for (int64_t i = 0; i < n; ++i)
    for (int j = 0; j < DV * 32; j += 64)
      _mm_prefetch(reinterpret_cast<const char*>(base + i * token_width) + j, _MM_HINT_T0);
}

// The common case, vectorized: bf16 cache, head_dim a multiple of 16 (at most 256),
// at most 8 query heads per KV head. One task per (sequence, KV head): the group's
// queries and accumulators stay in registers while its keys, then its values, stream by.
// Keys [start, len) only; scores[h * (len - start) + t - start].
template <int DV>  // head_dim / 16
static void decode_group_bf16(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                              const int64_t* table, int64_t start, int64_t len, c10::BFloat16* out, int64_t group,
                              int64_t g, int64_t num_kv_heads, int64_t block_size, int64_t block_stride,
                              float scale, const float* sinks, float softcap, float* scores) {
  constexpr int64_t D = DV * 16;
  const int64_t token_width = num_kv_heads * D;
  const int64_t n = len - start;
  // The first blocks' rows inside [start, len), this KV head's part (the loops then prefetch ahead).
  const int64_t first_blk = start / block_size;
  auto prefetch_first = [&](const c10::BFloat16* cache) {
    for (int64_t blk = first_blk; blk < first_blk + kPrefetchBlocks; ++blk) {
      const int64_t lo = std::max(start, blk * block_size), hi = std::min(len, (blk + 1) * block_size);
      if (lo >= hi) break;
      prefetch_block<DV>(cache + table[blk] * block_stride + g * D + (lo - blk * block_size) * token_width, hi - lo,
                         token_width);
    }
  };
  __m512 qf[8][DV];
  for (int64_t h = 0; h < group; ++h)
    for (int j = 0; j < DV; ++j)
      qf[h][j] = _mm512_mul_ps(bf16x16_to_fp32(q + ((g * group + h) * D) + j * 16), _mm512_set1_ps(scale));
  // Pass 1: scores[h][t] = q_h . k_t
  prefetch_first(k_cache);
  for (int64_t t0 = first_blk * block_size, blk = first_blk; t0 < len; t0 += block_size, ++blk) {
    const c10::BFloat16* base = k_cache + table[blk] * block_stride + g * D;
    const int64_t i0 = std::max<int64_t>(start - t0, 0);  // the first block may begin before the window
    const int64_t cnt = std::min(block_size, len - t0);
    const int64_t ahead = (blk + kPrefetchBlocks) * block_size;  // a whole block, after start
    if (ahead < len)
      prefetch_block<DV>(k_cache + table[blk + kPrefetchBlocks] * block_stride + g * D,
                         std::min(block_size, len - ahead), token_width);
    for (int64_t i = i0; i < cnt; ++i) {
      const c10::BFloat16* kp = base + i * token_width;
      __m512 kf[DV];
      for (int j = 0; j < DV; ++j) kf[j] = bf16x16_to_fp32(kp + j * 16);
      for (int64_t h = 0; h < group; ++h) {
        __m512 s = _mm512_mul_ps(qf[h][0], kf[0]);
        for (int j = 1; j < DV; ++j) s = _mm512_fmadd_ps(qf[h][j], kf[j], s);
        scores[h * n + t0 - start + i] = _mm512_reduce_add_ps(s);
      }
    }
  }
  prefetch_first(v_cache);
  if (softcap > 0.f)
    for (int64_t i = 0; i < group * n; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
  for (int64_t h = 0; h < group; ++h) softmax_inplace(scores + h * n, n, sinks ? sinks + g * group + h : nullptr);
  // Pass 2: out_h = sum_t p[h][t] v_t
  __m512 acc[8][DV];
  for (int64_t h = 0; h < group; ++h)
    for (int j = 0; j < DV; ++j) acc[h][j] = _mm512_setzero_ps();
  for (int64_t t0 = first_blk * block_size, blk = first_blk; t0 < len; t0 += block_size, ++blk) {
    const c10::BFloat16* base = v_cache + table[blk] * block_stride + g * D;
    const int64_t i0 = std::max<int64_t>(start - t0, 0);  // the first block may begin before the window
    const int64_t cnt = std::min(block_size, len - t0);
    const int64_t ahead = (blk + kPrefetchBlocks) * block_size;  // a whole block, after start
    if (ahead < len)
      prefetch_block<DV>(v_cache + table[blk + kPrefetchBlocks] * block_stride + g * D,
                         std::min(block_size, len - ahead), token_width);
    for (int64_t i = i0; i < cnt; ++i) {
      const c10::BFloat16* vp = base + i * token_width;
      __m512 vf[DV];
      for (int j = 0; j < DV; ++j) vf[j] = bf16x16_to_fp32(vp + j * 16);
      for (int64_t h = 0; h < group; ++h) {
        const __m512 p = _mm512_set1_ps(scores[h * n + t0 - start + i]);
        for (int j = 0; j < DV; ++j) acc[h][j] = _mm512_fmadd_ps(p, vf[j], acc[h][j]);
      }
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    c10::BFloat16* o = out + (g * group + h) * D;
    alignas(64) float tmp[16];
    for (int j = 0; j < DV; ++j) {
      _mm512_store_ps(tmp, acc[h][j]);
      for (int i = 0; i < 16; ++i) o[j * 16 + i] = c10::BFloat16(tmp[i]);
    }
  }
}

static bool decode_bf16_fast(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                             const int64_t* tables, const int64_t* seq_lens, c10::BFloat16* out, int64_t batch,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             int64_t block_stride, int64_t table_width, float scale, int64_t window,
                             const float* sinks, float softcap) {
  const int64_t group = num_heads / num_kv_heads;
  if (head_dim % 16 != 0 || head_dim > 256 || group > 8) return false;
  const int64_t q_width = num_heads * head_dim;
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, g = task % num_kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      scores.resize(group * (len - start));
      const int64_t* table = tables + b * table_width;
#define GROUP_CASE(DV)                                                                                           \
  case DV:                                                                                                        \
    decode_group_bf16<DV>(q + b * q_width, k_cache, v_cache, table, start, len, out + b * q_width, group, g,      \
                          num_kv_heads, block_size, block_stride, scale, sinks, softcap, scores.data());        \
    break;
      switch (head_dim / 16) {
        GROUP_CASE(1) GROUP_CASE(2) GROUP_CASE(3) GROUP_CASE(4) GROUP_CASE(5) GROUP_CASE(6) GROUP_CASE(7)
        GROUP_CASE(8) GROUP_CASE(9) GROUP_CASE(10) GROUP_CASE(11) GROUP_CASE(12) GROUP_CASE(13) GROUP_CASE(14)
        GROUP_CASE(15) GROUP_CASE(16)
      }
#undef GROUP_CASE
    }
  });
  return true;
}
#endif

// T: the query's (and output's) type; C: the cache's (T, or fp8 scaled by k_scale / v_scale).
template <typename T, typename C>
static void decode_kernel(const T* q, const C* k_cache, const C* v_cache, const int64_t* tables,
                          const int64_t* seq_lens, T* out, int64_t batch, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                          int64_t block_stride, int64_t table_width, float scale, float k_scale, float v_scale,
                          int64_t window, const float* sinks, float softcap) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_width = num_kv_heads * head_dim;  // one token's K (or V), all KV heads
  const int64_t q_width = num_heads * head_dim;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(q_width), acc(q_width), row(token_width), scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = seq_lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - start;  // keys [start, len): scores[h][t - start]
      const int64_t* table = tables + b * table_width;
      load_row(q + b * q_width, qf.data(), q_width);
      for (auto& x : qf) x *= scale * k_scale;
      scores.resize(num_heads * n);
      // Pass 1: scores[h][t] = q_h . k_t, reading each token's keys (all heads) contiguously.
      for (int64_t t = start; t < len; ++t) {
        load_row(k_cache + table[t / block_size] * block_stride + (t % block_size) * token_width,
                 row.data(), token_width);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* qh = qf.data() + h * head_dim;
          const float* kh = row.data() + (h / group) * head_dim;
          float s = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * kh[d];
          scores[h * n + t - start] = s;
        }
      }
      if (softcap > 0.f)
        for (auto& x : scores) x = softcap * std::tanh(x / softcap);
      for (int64_t h = 0; h < num_heads; ++h) {
        float* sh = scores.data() + h * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) m = std::max(m, sh[t]);
        if (sinks) m = std::max(m, sinks[h]);
        float sum = sinks ? std::exp(sinks[h] - m) : 0.f;
        for (int64_t t = 0; t < n; ++t) { sh[t] = std::exp(sh[t] - m); sum += sh[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) sh[t] *= inv;
      }
      // Pass 2: out_h = sum_t p[h][t] v_t.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = start; t < len; ++t) {
        load_row(v_cache + table[t / block_size] * block_stride + (t % block_size) * token_width,
                 row.data(), token_width);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float p = scores[h * n + t - start];
          const float* vh = row.data() + (h / group) * head_dim;
          float* ah = acc.data() + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * vh[d];
        }
      }
      for (int64_t i = 0; i < q_width; ++i) out[b * q_width + i] = static_cast<T>(acc[i] * v_scale);
    }
  });
}

// q: [B, Hq, D] contiguous; k_cache, v_cache: [N, block_size, Hkv, D] with contiguous
// blocks (any stride between blocks), q's dtype or float8_e4m3fn (then read times k_scale / v_scale);
// block_tables: [B, W] int64; seq_lens: [B] int64. window: 0 for none; sinks: [Hq] float32 or none;
// softcap: 0 for none.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                     double k_scale, double v_scale, int64_t window,
                                     c10::optional<at::Tensor> sinks, double softcap) {
  TORCH_CHECK(q.is_contiguous() && q.dim() == 3, "q must be contiguous [B, Hq, D]");
  TORCH_CHECK(k_cache.stride(0) == v_cache.stride(0), "k/v caches must share the block stride");
  TORCH_CHECK(k_cache.stride(1) == k_cache.size(2) * k_cache.size(3) && k_cache.stride(3) == 1,
              "each cache block must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && (fp8 || k_cache.scalar_type() == q.scalar_type()),
              "the caches must be of q's dtype or float8_e4m3fn");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  at::Tensor sink_values;
  if (sinks.has_value()) {
    sink_values = sinks->contiguous();
    TORCH_CHECK(sink_values.scalar_type() == at::kFloat && sink_values.numel() == Hq && sink_values.device().is_cpu(),
                "sinks must be [Hq] float32 on the CPU");
  }
  const float* sink_ptr = sinks.has_value() ? sink_values.data_ptr<float>() : nullptr;
  const float cap = static_cast<float>(softcap);
#if defined(__AVX512F__)
  if (!fp8 && q.scalar_type() == at::kBFloat16 &&
      decode_bf16_fast(q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(),
                       v_cache.data_ptr<c10::BFloat16>(), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                       out.data_ptr<c10::BFloat16>(), B, Hq, Hkv, D, bs, k_cache.stride(0), tables.size(1),
                       static_cast<float>(scale), window, sink_ptr, cap)) {
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if (fp8) {
      using C = c10::Float8_e4m3fn;
      decode_kernel<scalar_t, C>(q.data_ptr<scalar_t>(), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(),
                                 tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B,
                                 Hq, Hkv, D, bs, k_cache.stride(0), tables.size(1), static_cast<float>(scale),
                                 static_cast<float>(k_scale), static_cast<float>(v_scale), window, sink_ptr, cap);
    } else {
      decode_kernel<scalar_t, scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                        v_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                                        lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, Hq, Hkv, D, bs,
                                        k_cache.stride(0), tables.size(1), static_cast<float>(scale), 1.f, 1.f,
                                        window, sink_ptr, cap);
    }
  });
  return out;
}
