// The int4 product (int4_vnni.cpp), shared with the fused draft calls (draft_fused.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

// y [M, N] bf16 = x [M, K] bf16 times the int4 weight w [N, K/2] (packed as int4_vnni.cpp says), groups of G inputs
// with (scale, zero) sz [N, K/G, 2] bf16.
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sz, int64_t G);
