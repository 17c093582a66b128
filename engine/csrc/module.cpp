// The Python module of pdserve's CPU kernels (one extension, built on first use).
// pybind11 with torch's tensor casters, without the rest of torch/extension.h (a third of its compile time).
#include <torch/csrc/utils/pybind.h>

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                     double k_scale, double v_scale, int64_t window,
                                     c10::optional<at::Tensor> sinks, double softcap);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor gate_up);
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor rows);
void rope_and_cache(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                    int64_t num_q_heads, int64_t num_kv_heads, c10::optional<at::Tensor> k_cache,
                    c10::optional<at::Tensor> v_cache, c10::optional<at::Tensor> slot_blocks,
                    c10::optional<at::Tensor> slot_offsets);

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
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (CPU); an fp8 cache is read times k_scale / v_scale; "
        "window (0: none) reads only the last `window` keys, sinks ([Hq] float32) add a zero-value softmax "
        "column per head, softcap (0: none) caps scores at softcap * tanh(s / softcap)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0, py::arg("window") = 0,
        py::arg("sinks") = py::none(), py::arg("softcap") = 0.0);
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "float32 logits[rows[i]][t] = -inf where bit t of bitmask row i is 0 (or t is past its end), in place",
        py::arg("logits"), py::arg("bitmask"), py::arg("rows"));
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual) * weight (in place)");
  m.def("rms_norm", &rms_norm, "RMSNorm(x) * weight");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [T, 2I] rows");
  m.def("rope_and_cache", &rope_and_cache, "RoPE on q/k in place in qkv rows; optionally K/V into cache slots",
        py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("num_q_heads"),
        py::arg("num_kv_heads"), py::arg("k_cache") = py::none(), py::arg("v_cache") = py::none(),
        py::arg("slot_blocks") = py::none(), py::arg("slot_offsets") = py::none());
}
