// The Python module of pdserve's CPU kernels (one extension, built on first use).
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rope_and_cache(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                    int64_t num_q_heads, int64_t num_kv_heads, c10::optional<torch::Tensor> k_cache,
                    c10::optional<torch::Tensor> v_cache, c10::optional<torch::Tensor> slot_blocks,
                    c10::optional<torch::Tensor> slot_offsets);

// Whether this build has the AVX-512 paths (it does when the compiler targets AVX-512).
#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif
// Whether this build has the AVX2+FMA paths of the fused elementwise ops (else their scalar paths run).
#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kAvx2 = true;
#else
constexpr bool kAvx2 = false;
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("avx512") = kAvx512;
  m.attr("avx2") = kAvx2;
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual) * weight (in place)");
  m.def("rms_norm", &rms_norm, "RMSNorm(x) * weight");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [T, 2I] rows");
  m.def("rope_and_cache", &rope_and_cache, "RoPE on q/k in place in qkv rows; optionally K/V into cache slots",
        py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("num_q_heads"),
        py::arg("num_kv_heads"), py::arg("k_cache") = py::none(), py::arg("v_cache") = py::none(),
        py::arg("slot_blocks") = py::none(), py::arg("slot_offsets") = py::none());
}
