// Paged decode attention: the launchers of launchers.h and the merge of split sequences. The
// attention kernel itself is in paged_decode_attention.cuh.
#include "paged_decode_attention.cuh"

namespace neo_cuda {
namespace {

constexpr int kMergeThreads = 128;

// One block per (sequence, query head) of a split sequence: out = sum_p w_p * acc_p /
// sum_p w_p * sum_p with w_p = 2^(max_p - max).
template <typename T>
__global__ void __launch_bounds__(kMergeThreads)
    merge_kernel(const PagedDecodeAttentionParams params) {
  extern __shared__ float weights[];  // [max_partitions]
  __shared__ float scratch[kWarpSize];
  const int seq = blockIdx.x;
  const int head = blockIdx.y;
  const int seq_len = params.seq_lens[seq];
  const int partitions = decode_partitions(seq_len, params);
  if (partitions == 1) return;
  const int64_t row = static_cast<int64_t>(seq) * params.num_heads + head;
  const float* maxima = params.partial_max + row * params.max_partitions;
  const float* sums = params.partial_sum + row * params.max_partitions;

  float maximum = -INFINITY;
  for (int p = threadIdx.x; p < partitions; p += blockDim.x) maximum = fmaxf(maximum, maxima[p]);
  maximum = block_max(maximum, scratch);
  float denominator = 0.0f;
  for (int p = threadIdx.x; p < partitions; p += blockDim.x) {
    const float weight = exp2f(maxima[p] - maximum);
    weights[p] = weight;
    denominator += weight * sums[p];
  }
  denominator = block_sum(denominator, scratch);  // also publishes `weights`
  const float inverse = 1.0f / denominator;

  const int head_dim = params.head_dim;
  const float* partial = params.partial_out + row * params.max_partitions * head_dim;
  T* out = static_cast<T*>(params.out) + row * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float total = 0.0f;
    for (int p = 0; p < partitions; ++p) total = fmaf(weights[p], partial[p * head_dim + d], total);
    out[d] = from_float<T>(total * inverse);
  }
}

}  // namespace

void launch_paged_decode_attention(const PagedDecodeAttentionParams& params, int variant,
                                   DataType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DataType::Float32:
      launch_paged_decode_attention_float32(params, variant, stream);
      break;
    case DataType::Float16:
      launch_paged_decode_attention_float16(params, variant, stream);
      break;
    case DataType::BFloat16:
      launch_paged_decode_attention_bfloat16(params, variant, stream);
      break;
  }
}

void launch_paged_decode_attention_merge(const PagedDecodeAttentionParams& params, DataType dtype,
                                         cudaStream_t stream) {
  const dim3 grid(params.num_seqs, params.num_heads);
  // Rounded up and padded by 4 floats: ptxas may merge the loads of the partition loop's last
  // iterations into one wide load that reaches past `partitions` (values unused, but the read
  // must stay inside the allocation).
  const size_t shared_floats = (static_cast<size_t>(params.max_partitions) + 3) / 4 * 4 + 4;
  const size_t shared_bytes = shared_floats * sizeof(float);
  dispatch_data_type(dtype, [&](auto element) {
    using T = decltype(element);
    merge_kernel<T><<<grid, kMergeThreads, shared_bytes, stream>>>(params);
  });
}

}  // namespace neo_cuda
