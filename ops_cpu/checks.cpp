#include "checks.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace neo_cpu {

void check_cache_layout(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache) {
    TORCH_CHECK_VALUE(k_cache.dim() == 4, "neo.", op, ": k_cache must be [num_blocks, "
                      "num_kv_heads, block_size, head_dim], got shape ", k_cache.sizes());
    TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "neo.", op, ": v_cache shape ",
                      v_cache.sizes(), " differs from k_cache shape ", k_cache.sizes());
    TORCH_CHECK_VALUE(v_cache.scalar_type() == k_cache.scalar_type(), "neo.", op,
                      ": v_cache dtype ", v_cache.scalar_type(), " differs from k_cache dtype ",
                      k_cache.scalar_type());
    TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "neo.", op,
                      ": k_cache and v_cache must be contiguous");
    TORCH_CHECK_VALUE(k_cache.size(1) >= 1, "neo.", op, ": k_cache must have num_kv_heads >= 1, "
                      "got ", k_cache.size(1));
    const int64_t block_size = k_cache.size(2);
    TORCH_CHECK_VALUE(block_size >= kMinBlockSize && block_size <= kMaxBlockSize &&
                          (block_size & (block_size - 1)) == 0,
                      "neo.", op, ": block_size must be a power of two from ", kMinBlockSize,
                      " to ", kMaxBlockSize, ", got ", block_size);
    const int64_t head_dim = k_cache.size(3);
    TORCH_CHECK_VALUE(head_dim % 16 == 0 && head_dim > 0 && head_dim <= kMaxHeadDim, "neo.", op,
                      ": head_dim must be a multiple of 16 up to ", kMaxHeadDim, ", got ",
                      head_dim);
}

void check_float_dtype(const char* op, const char* name, const at::Tensor& tensor) {
    const auto dtype = tensor.scalar_type();
    TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, "neo.",
                      op, ": ", name, " dtype must be float32, float16 or bfloat16, got ", dtype);
}

void check_float32_scalar(const char* op, const char* name, double value) {
    TORCH_CHECK_VALUE(std::isfinite(value) && std::abs(value) <= std::numeric_limits<float>::max(),
                      "neo.", op, ": ", name, " must be a finite float32 value, got ", value);
}

void check_on_cpu(const char* op,
                  std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
    for (const auto& [name, tensor] : tensors) {
        TORCH_CHECK_VALUE(tensor->device().is_cpu(), "neo.", op, ": ", name, " is on ",
                          tensor->device(), ", but this kernel runs on the CPU");
    }
}

}  // namespace neo_cpu
