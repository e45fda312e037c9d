// Paged decode attention: the launchers of launchers.h and the merge of split sequences. The
// attention kernel itself is in paged_decode_attention.cuh.
#include "paged_decode_attention.cuh"

namespace neo_cuda {
namespace {

// Query heads a merge block serves, one warp each.
constexpr int kMergeWarps = 4;
// Dims of a head one lane of a merge warp serves: head_dim is at most 256.
constexpr int kMergeDimsPerLane = 256 / kWarpSize;

// One warp per (sequence, query head) of a split sequence, kMergeWarps heads a block: out =
// sum_p w_p * acc_p / sum_p w_p * sum_p with w_p = 2^(max_p - max), the lanes taking the
// partitions' maxima and sums in turn, then each lane its dims of every partition. Launched as a
// programmatic dependent of the attention kernel, it waits for that grid before it reads anything.
template <typename T>
__global__ void __launch_bounds__(kMergeWarps * kWarpSize)
    merge_kernel(const PagedDecodeAttentionParams params) {
  wait_for_prerequisite_grid();
  const int lane = threadIdx.x % kWarpSize;
  const int head = blockIdx.y * kMergeWarps + threadIdx.x / kWarpSize;
  const int seq = blockIdx.x;
  if (head >= params.num_heads) return;
  const int partitions = decode_partitions(params.seq_lens[seq], params);
  if (partitions == 1) return;
  const int64_t row = static_cast<int64_t>(seq) * params.num_heads + head;
  const float* maxima = params.partial_max + row * params.max_partitions;
  const float* sums = params.partial_sum + row * params.max_partitions;

  float maximum = -INFINITY;
  for (int p = lane; p < partitions; p += kWarpSize) maximum = fmaxf(maximum, maxima[p]);
  maximum = warp_max(maximum);
  float denominator = 0.0f;
  for (int p = lane; p < partitions; p += kWarpSize) {
    denominator = fmaf(exp2f(maxima[p] - maximum), sums[p], denominator);
  }
  denominator = warp_sum(denominator);

  const int head_dim = params.head_dim;
  const float* partial = params.partial_out + row * params.max_partitions * head_dim;
  float total[kMergeDimsPerLane] = {};
  for (int p = 0; p < partitions; ++p) {
    const float weight = exp2f(maxima[p] - maximum);
#pragma unroll
    for (int k = 0; k < kMergeDimsPerLane; ++k) {
      const int d = lane + k * kWarpSize;
      if (d < head_dim) total[k] = fmaf(weight, partial[p * head_dim + d], total[k]);
    }
  }
  const float inverse = 1.0f / denominator;
  T* out = static_cast<T*>(params.out) + row * head_dim;
#pragma unroll
  for (int k = 0; k < kMergeDimsPerLane; ++k) {
    const int d = lane + k * kWarpSize;
    if (d < head_dim) out[d] = from_float<T>(total[k] * inverse);
  }
}

// Whether the current device runs programmatic dependent launches (compute capability 9.0 and
// up).
bool programmatic_launch_supported() {
  int device = 0;
  int major = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  return major >= 9;
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
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(params.num_seqs, (params.num_heads + kMergeWarps - 1) / kMergeWarps);
  config.blockDim = dim3(kMergeWarps * kWarpSize);
  config.stream = stream;
  cudaLaunchAttribute programmatic[1];
  programmatic[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  programmatic[0].val.programmaticStreamSerializationAllowed = 1;
  if (programmatic_launch_supported()) {
    config.attrs = programmatic;
    config.numAttrs = 1;
  }
  dispatch_data_type(dtype, [&](auto element) {
    using T = decltype(element);
    cudaLaunchKernelEx(&config, merge_kernel<T>, params);
  });
}

}  // namespace neo_cuda
