// Argument checks shared by the CPU kernels. They mirror ops/checks.py (same conditions, same
// messages) and raise ValueError in Python, so every implementation rejects the same input.
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <utility>

namespace neo_cpu {

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMinBlockSize = 8;
constexpr int64_t kMaxBlockSize = 128;

// k_cache and v_cache: [num_blocks, num_kv_heads, block_size, head_dim], one dtype, contiguous,
// num_kv_heads >= 1, block_size a power of two in [8, 128], head_dim a multiple of 16 up to 256.
void check_cache_layout(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache);

// `tensor` (called `name` in the message) is float32, float16 or bfloat16.
void check_float_dtype(const char* op, const char* name, const at::Tensor& tensor);

// `value` is finite and representable in float32 (the kernels compute in float32).
void check_float32_scalar(const char* op, const char* name, double value);

// Every named tensor lives on the CPU (these kernels read host memory).
void check_on_cpu(const char* op,
                  std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors);

}  // namespace neo_cpu
