// A grammar's token bitmask applied to rows of float32 logits (structured outputs, CPU).
//
//   apply_token_bitmask  for each listed row: logits[row][t] = -inf wherever bit t % 32 of word t / 32 of its
//                        bitmask row is 0, and for every t past the bitmask's end. Words with every bit set
//                        (most of them, in most grammar states... or none, in a tight one) are skipped whole.
// One pass over the bitmask instead of unpacking it into a (rows, vocab) bool tensor and masking with it.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <cstdint>
#include <limits>

void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits: a contiguous 2-D float32 tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask: a contiguous 2-D int32 tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.numel() == bitmask.size(0),
              "rows: int64, one per bitmask row");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), n = rows.numel();
  float* out = logits.data_ptr<float>();
  const int32_t* bits = bitmask.data_ptr<int32_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0), "rows: index out of range");
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = out + row_ids[i] * vocab;
      const int32_t* mask = bits + i * words;
      const int64_t covered = std::min<int64_t>(words * 32, vocab);
      for (int64_t w = 0; w * 32 < covered; ++w) {
        const uint32_t m = static_cast<uint32_t>(mask[w]);
        if (m == 0xFFFFFFFFu) continue;
        const int64_t base = w * 32, last = std::min<int64_t>(32, covered - base);
        for (int64_t b = 0; b < last; ++b) {
          if (!((m >> b) & 1u)) row[base + b] = neg_inf;
        }
      }
      for (int64_t t = covered; t < vocab; ++t) row[t] = neg_inf;
    }
  });
}
