// The row attention's core (row_attention.cpp), shared with the fused draft steps' attention (draft_fused.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace selfspec {

// One query row's attention for `heads` query heads of one key/value head: qf [heads, D] fp32, already scaled; the
// keys and values at K + col(t) * D, V + col(t) * D for t < n (col(t) = cols[t], or t where cols is null); out:
// `heads` rows of D bf16, `stride` apart. Each head over its keys in order, the same operations whatever else runs.
// p: scratch.
void attend_heads(const float* qf, int64_t heads, const at::BFloat16* K, const at::BFloat16* V, const int64_t* cols,
                  int64_t n, int64_t D, std::vector<float>& p, at::BFloat16* out, int64_t stride);

}  // namespace selfspec
