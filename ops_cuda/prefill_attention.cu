// Causal attention over packed variable-length prompts: the kernel behind neo.prefill_attention
// where PyTorch's flash attention does not apply (float32, or head sizes flash rejects).
//
// One warp per (query token, query head): it finds the token's prompt in cu_seqlens (binary
// search), then streams that prompt's keys and values up to the token itself with an online
// softmax. Lane l holds features l, l + 32, ... of the head. float32 math throughout; simple
// and exact rather than fast (flash attention serves the half-precision path).
#include "device_utils.cuh"

namespace neo_cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kFeaturesPerLane = kPrefillMaxHeadDim / kWarpSize;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarpSize)
    prefill_attention_kernel(T* __restrict__ out, int64_t out_token_stride,
                             int64_t out_head_stride, const T* __restrict__ q,
                             int64_t q_token_stride, int64_t q_head_stride,
                             const T* __restrict__ k, int64_t k_token_stride,
                             int64_t k_head_stride, const T* __restrict__ v,
                             int64_t v_token_stride, int64_t v_head_stride,
                             const int32_t* __restrict__ cu_seqlens, int num_seqs,
                             int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim,
                             float scale) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (item >= num_tokens * num_heads) return;  // uniform across the warp
  const int64_t token = item / num_heads;
  const int head = static_cast<int>(item - token * num_heads);
  const int kv_head = head / (num_heads / num_kv_heads);

  // The prompt holding `token`: the last s with cu_seqlens[s] <= token.
  int low = 0;
  int high = num_seqs;
  while (high - low > 1) {
    const int middle = (low + high) / 2;
    if (cu_seqlens[middle] <= token) {
      low = middle;
    } else {
      high = middle;
    }
  }
  const int64_t first_key = cu_seqlens[low];

  float query[kFeaturesPerLane];
  float acc[kFeaturesPerLane];
  const T* q_row = q + token * q_token_stride + head * q_head_stride;
#pragma unroll
  for (int f = 0; f < kFeaturesPerLane; ++f) {
    const int d = lane + f * kWarpSize;
    query[f] = d < head_dim ? to_float(q_row[d]) * (scale * kLog2e) : 0.0f;
    acc[f] = 0.0f;
  }
  float running_max = -INFINITY;
  float running_sum = 0.0f;
  for (int64_t key = first_key; key <= token; ++key) {
    const T* k_row = k + key * k_token_stride + kv_head * k_head_stride;
    const T* v_row = v + key * v_token_stride + kv_head * v_head_stride;
    float dot = 0.0f;
#pragma unroll
    for (int f = 0; f < kFeaturesPerLane; ++f) {
      const int d = lane + f * kWarpSize;
      if (d < head_dim) dot = fmaf(query[f], to_float(k_row[d]), dot);
    }
    dot = warp_sum(dot);
    const float new_max = fmaxf(running_max, dot);
    const float correction = exp2f(running_max - new_max);
    const float probability = exp2f(dot - new_max);
    running_sum = running_sum * correction + probability;
#pragma unroll
    for (int f = 0; f < kFeaturesPerLane; ++f) {
      const int d = lane + f * kWarpSize;
      const float value = d < head_dim ? to_float(v_row[d]) : 0.0f;
      acc[f] = fmaf(probability, value, acc[f] * correction);
    }
    running_max = new_max;
  }
  T* out_row = out + token * out_token_stride + head * out_head_stride;
  const float inverse = 1.0f / running_sum;
#pragma unroll
  for (int f = 0; f < kFeaturesPerLane; ++f) {
    const int d = lane + f * kWarpSize;
    if (d < head_dim) out_row[d] = from_float<T>(acc[f] * inverse);
  }
}

}  // namespace

void launch_prefill_attention(void* out, int64_t out_token_stride, int64_t out_head_stride,
                              const void* q, int64_t q_token_stride, int64_t q_head_stride,
                              const void* k, int64_t k_token_stride, int64_t k_head_stride,
                              const void* v, int64_t v_token_stride, int64_t v_head_stride,
                              const int32_t* cu_seqlens, int num_seqs, int64_t num_tokens,
                              int num_heads, int num_kv_heads, int head_dim, float scale,
                              DataType dtype, cudaStream_t stream) {
  const int64_t items = num_tokens * num_heads;
  const unsigned blocks = static_cast<unsigned>((items + kWarpsPerBlock - 1) / kWarpsPerBlock);
  dispatch_data_type(dtype, [&](auto element) {
    using T = decltype(element);
    prefill_attention_kernel<T><<<blocks, kWarpsPerBlock * kWarpSize, 0, stream>>>(
        static_cast<T*>(out), out_token_stride, out_head_stride, static_cast<const T*>(q),
        q_token_stride, q_head_stride, static_cast<const T*>(k), k_token_stride, k_head_stride,
        static_cast<const T*>(v), v_token_stride, v_head_stride, cu_seqlens, num_seqs,
        num_tokens, num_heads, num_kv_heads, head_dim, scale);
  });
}

}  // namespace neo_cuda
