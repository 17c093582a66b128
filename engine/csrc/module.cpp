// The Python module of pdserve's CPU kernels (one extension, built on first use).
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale);

// Whether this build has the AVX-512 paths (it does when the compiler targets AVX-512).
#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("avx512") = kAvx512;
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
}
