// Fused elementwise ops of a decoder layer (CPU): one pass over memory instead of several.
//
//   fused_add_rms_norm  residual += x (rounded to the dtype, as the unfused add), then
//                       x = RMSNorm(residual) * weight; float32 accumulation.
//   rms_norm            out = RMSNorm(x) * weight.
//   silu_and_mul        out = silu(gate) * up, gate/up the two halves of each row.
//   rope_and_cache      rotate-half RoPE applied in place to the query and key heads of the
//                       merged qkv rows; optionally writes the rotated K and the V of each token
//                       into its paged-cache slot (one pass instead of RoPE + two index_puts).
//
// bf16 rounds where the unfused torch ops round (silu before the multiply; each RoPE product
// before the sum), so results equal the unfused path up to the last bit of exp. Math in float32.
// AVX2+FMA paths (8 lanes) when the compiler targets them, a portable scalar path otherwise
// (and for row tails); AVX-512 machines take the AVX2 paths (these ops are memory-bound).
// ATen's tensor, dispatch and per-op headers only (not torch/extension.h): a quarter of the compile time.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <c10/util/Optional.h>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#endif

namespace {

// ---- scalar helpers -------------------------------------------------------------------------
inline float to_f32(float v) { return v; }
inline float to_f32(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
template <typename T>
inline T from_f32(float v) { return static_cast<T>(v); }  // c10::BFloat16: round to nearest even
template <typename T>
inline float through(float v) { return to_f32(from_f32<T>(v)); }  // rounded as a T would store it

#if defined(PDSERVE_AVX2)
// ---- AVX2 helpers: 8 floats per register --------------------------------------------------
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
// float32 bits rounded to nearest even at bf16 precision (low 16 bits left as garbage); NaN stays NaN.
inline __m256i round_bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(nan));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i high = _mm256_srli_epi32(round_bf16_bits(v), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
template <typename T>
inline __m256 through8(__m256 v) { return v; }
template <>
inline __m256 through8<c10::BFloat16>(__m256 v) {
  return _mm256_castsi256_ps(_mm256_and_si256(round_bf16_bits(v), _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// exp(x) for x <= 0: 2^n * e^f with |f| <= ln2/2, degree-6 polynomial (relative error ~1e-7).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), f);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
}
// silu(g) = g / (1 + exp(-g)), from e = exp(-|g|) so the exponential never overflows.
inline __m256 silu8(__m256 g) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_and_ps(g, abs_mask)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 pos = _mm256_div_ps(g, _mm256_add_ps(one, e));                 // g >= 0: exp(-g) = e
  const __m256 neg = _mm256_div_ps(_mm256_mul_ps(g, e), _mm256_add_ps(e, one));  // g < 0: exp(-g) = 1/e
  return _mm256_blendv_ps(pos, neg, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
}
#endif

constexpr int64_t kGrainElements = 1 << 15;  // rows per task: at least ~32k elements (no fork for tiny steps)

inline int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, width)); }

// 1 / sqrt(mean(row^2) + eps) of a float32-widened row.
template <typename T>
inline float inverse_rms(const T* row, int64_t n, float eps) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(PDSERVE_AVX2)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m256 a = load8(row + i), b = load8(row + i + 8);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 a = load8(row + i);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
  }
  sum = hsum8(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) {
    const float v = to_f32(row[i]);
    sum += v * v;
  }
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// out = weight * (row * rstd): the order transformers' float32 RMSNorm multiplies in.
template <typename T>
inline void scale_row(const T* row, const T* weight, T* out, int64_t n, float rstd) {
  int64_t i = 0;
#if defined(PDSERVE_AVX2)
  const __m256 r = _mm256_set1_ps(rstd);
  for (; i + 8 <= n; i += 8) store8(out + i, _mm256_mul_ps(load8(weight + i), _mm256_mul_ps(load8(row + i), r)));
#endif
  for (; i < n; ++i) out[i] = from_f32<T>(to_f32(weight[i]) * (to_f32(row[i]) * rstd));
}

template <typename T>
void add_rms_norm_kernel(T* x, T* residual, const T* weight, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* xr = x + t * n;
      T* rr = residual + t * n;
      int64_t i = 0;
#if defined(PDSERVE_AVX2)
      for (; i + 8 <= n; i += 8) store8(rr + i, _mm256_add_ps(load8(rr + i), load8(xr + i)));
#endif
      for (; i < n; ++i) rr[i] = from_f32<T>(to_f32(rr[i]) + to_f32(xr[i]));
      scale_row(rr, weight, xr, n, inverse_rms(rr, n, eps));
    }
  });
}

template <typename T>
void rms_norm_kernel(const T* x, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) scale_row(x + t * n, weight, out + t * n, n, inverse_rms(x + t * n, n, eps));
  });
}

template <typename T>
void silu_and_mul_kernel(const T* gate_up, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gate_up + t * 2 * n;
      const T* u = g + n;
      T* o = out + t * n;
      int64_t i = 0;
#if defined(PDSERVE_AVX2)
      for (; i + 8 <= n; i += 8) store8(o + i, _mm256_mul_ps(through8<T>(silu8(load8(g + i))), load8(u + i)));
#endif
      for (; i < n; ++i) {  // as silu8: exp(-|g|) never overflows (-ffast-math assumes no infinities)
        const float gv = to_f32(g[i]);
        const float e = std::exp(-std::fabs(gv));
        const float silu = gv >= 0.f ? gv / (1.f + e) : gv * e / (e + 1.f);
        o[i] = from_f32<T>(through<T>(silu) * to_f32(u[i]));
      }
    }
  });
}

// One head in place: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]. Each product is
// rounded to T before the sum, as the unfused torch expression rounds it.
template <typename T>
inline void rope_head(T* x, const T* cos, const T* sin, int64_t half) {
  int64_t i = 0;
#if defined(PDSERVE_AVX2)
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = load8(x + i), x2 = load8(x + half + i);
    const __m256 lo = _mm256_sub_ps(through8<T>(_mm256_mul_ps(x1, load8(cos + i))),
                                    through8<T>(_mm256_mul_ps(x2, load8(sin + i))));
    const __m256 hi = _mm256_add_ps(through8<T>(_mm256_mul_ps(x2, load8(cos + half + i))),
                                    through8<T>(_mm256_mul_ps(x1, load8(sin + half + i))));
    store8(x + i, lo);
    store8(x + half + i, hi);
  }
#endif
  for (; i < half; ++i) {
    const float x1 = to_f32(x[i]), x2 = to_f32(x[half + i]);
    x[i] = from_f32<T>(through<T>(x1 * to_f32(cos[i])) - through<T>(x2 * to_f32(sin[i])));
    x[half + i] = from_f32<T>(through<T>(x2 * to_f32(cos[half + i])) + through<T>(x1 * to_f32(sin[half + i])));
  }
}

template <typename T>
void rope_and_cache_kernel(T* qkv, int64_t row_stride, const int64_t* positions, const T* cos, const T* sin,
                           int64_t rows, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                           T* k_cache, T* v_cache, int64_t block_stride, int64_t slot_stride,
                           const int64_t* slot_blocks, const int64_t* slot_offsets) {
  const int64_t half = head_dim / 2;
  const int64_t kv_width = num_kv_heads * head_dim;
  const int64_t rotated = (num_q_heads + num_kv_heads) * head_dim;
  at::parallel_for(0, rows, grain_rows(rotated + 2 * kv_width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * row_stride;
      const T* c = cos + positions[t] * head_dim;
      const T* s = sin + positions[t] * head_dim;
      for (int64_t h = 0; h < num_q_heads + num_kv_heads; ++h) rope_head(row + h * head_dim, c, s, half);
      if (k_cache != nullptr) {
        const int64_t offset = slot_blocks[t] * block_stride + slot_offsets[t] * slot_stride;
        std::memcpy(k_cache + offset, row + num_q_heads * head_dim, kv_width * sizeof(T));
        std::memcpy(v_cache + offset, row + rotated, kv_width * sizeof(T));
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name, " must be a CPU [rows, n] tensor with "
              "contiguous rows");
}

}  // namespace

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(), "contiguous tensors");
  TORCH_CHECK(x.sizes() == residual.sizes() && weight.numel() == x.size(1), "shapes");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(), "one dtype");
  AT_DISPATCH_SWITCH(x.scalar_type(), "fused_add_rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      add_rms_norm_kernel<float>(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(),
                                 x.size(0), x.size(1), static_cast<float>(eps));
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      add_rms_norm_kernel<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(),
                                         weight.data_ptr<c10::BFloat16>(), x.size(0), x.size(1),
                                         static_cast<float>(eps));
    }));
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  auto xc = x.contiguous();
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [n] of x's dtype");
  auto out = at::empty_like(xc);
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      rms_norm_kernel<float>(xc.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), xc.size(0),
                             xc.size(1), static_cast<float>(eps));
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      rms_norm_kernel<c10::BFloat16>(xc.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                                     out.data_ptr<c10::BFloat16>(), xc.size(0), xc.size(1), static_cast<float>(eps));
    }));
  return out;
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  auto gu = gate_up.contiguous();
  const int64_t n = gu.size(1) / 2;
  auto out = at::empty({gu.size(0), n}, gu.options());
  AT_DISPATCH_SWITCH(gu.scalar_type(), "silu_and_mul",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      silu_and_mul_kernel<float>(gu.data_ptr<float>(), out.data_ptr<float>(), gu.size(0), n);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      silu_and_mul_kernel<c10::BFloat16>(gu.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), gu.size(0), n);
    }));
  return out;
}

// qkv: [T, (Hq + 2 Hkv) * D] rows (q heads, k heads, v heads); cos, sin: [max_pos, D] contiguous, qkv's
// dtype; positions: [T] int64. k_cache, v_cache (optional, together with slot_blocks, slot_offsets:
// [T] int64): [N, block_size, Hkv, D] views with contiguous slots, sharing their strides.
void rope_and_cache(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                    int64_t num_q_heads, int64_t num_kv_heads, c10::optional<at::Tensor> k_cache,
                    c10::optional<at::Tensor> v_cache, c10::optional<at::Tensor> slot_blocks,
                    c10::optional<at::Tensor> slot_offsets) {
  check_rows(qkv, "qkv");
  const int64_t head_dim = cos.size(1);
  TORCH_CHECK(head_dim % 2 == 0 && qkv.size(1) == (num_q_heads + 2 * num_kv_heads) * head_dim, "qkv width");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(), "cos/sin [max_pos, D]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "cos/sin dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == qkv.size(0), "positions: [T] int64");
  auto pos = positions.contiguous();
  const bool write = k_cache.has_value();
  at::Tensor blocks, offsets;
  if (write) {
    TORCH_CHECK(v_cache.has_value() && slot_blocks.has_value() && slot_offsets.has_value(), "cache args together");
    const auto& kc = *k_cache;
    const auto& vc = *v_cache;
    TORCH_CHECK(kc.scalar_type() == qkv.scalar_type() && vc.scalar_type() == qkv.scalar_type(), "cache dtype");
    TORCH_CHECK(kc.strides() == vc.strides() && kc.dim() == 4 && kc.size(2) == num_kv_heads &&
                kc.size(3) == head_dim && kc.stride(3) == 1 && kc.stride(2) == head_dim,
                "caches: [N, block_size, Hkv, D] with contiguous slots and equal strides");
    blocks = slot_blocks->to(at::kLong).contiguous();
    offsets = slot_offsets->to(at::kLong).contiguous();
    TORCH_CHECK(blocks.numel() == qkv.size(0) && offsets.numel() == qkv.size(0), "one slot per token");
  }
  AT_DISPATCH_SWITCH(qkv.scalar_type(), "rope_and_cache",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      rope_and_cache_kernel<float>(
          qkv.data_ptr<float>(), qkv.stride(0), pos.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
          qkv.size(0), num_q_heads, num_kv_heads, head_dim, write ? k_cache->data_ptr<float>() : nullptr,
          write ? v_cache->data_ptr<float>() : nullptr, write ? k_cache->stride(0) : 0,
          write ? k_cache->stride(1) : 0, write ? blocks.data_ptr<int64_t>() : nullptr,
          write ? offsets.data_ptr<int64_t>() : nullptr);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using T = c10::BFloat16;
      rope_and_cache_kernel<T>(
          qkv.data_ptr<T>(), qkv.stride(0), pos.data_ptr<int64_t>(), cos.data_ptr<T>(), sin.data_ptr<T>(),
          qkv.size(0), num_q_heads, num_kv_heads, head_dim, write ? k_cache->data_ptr<T>() : nullptr,
          write ? v_cache->data_ptr<T>() : nullptr, write ? k_cache->stride(0) : 0, write ? k_cache->stride(1) : 0,
          write ? blocks.data_ptr<int64_t>() : nullptr, write ? offsets.data_ptr<int64_t>() : nullptr);
    }));
}
