// RMSNorm and fused residual-add + RMSNorm, float32 math, rounded like the reference:
//   normalized = x * rsqrt(mean(x^2) + epsilon)       (float32)
//   out        = weight * round_to_weight_dtype(normalized), rounded to the activation dtype.
// The fused variant first stores residual = round(residual + input) and normalizes that.
//
// One thread block per token row; each thread walks units of N elements (a 16-byte vector of
// the activation type when every address allows it, else one element).
#include "device_utils.cuh"

namespace neo_cuda {
namespace {

constexpr int kMaxThreads = 1024;

// out = weight * round_to<W>(x * inverse_rms) for one unit.
template <typename W, int N, bool Vectorized>
__device__ __forceinline__ void scale_by_weight(const W* weight, float inverse_rms,
                                                float (&values)[N]) {
  float weights[N];
  load_floats<W, N, Vectorized>(weight, weights);
#pragma unroll
  for (int e = 0; e < N; ++e) values[e] = weights[e] * round_to<W>(values[e] * inverse_rms);
}

template <typename T, typename W, int N, bool Vectorized>
__global__ void rms_norm_kernel(T* __restrict__ out, int64_t out_stride,
                                const T* __restrict__ input, int64_t input_stride,
                                const W* __restrict__ weight, int hidden, float epsilon) {
  __shared__ float scratch[kWarpSize];
  const int64_t row = blockIdx.x;
  const T* x = input + row * input_stride;
  T* y = out + row * out_stride;
  const int units = hidden / N;
  float squares = 0.0f;
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    float values[N];
    load_floats<T, N, Vectorized>(x + u * N, values);
#pragma unroll
    for (int e = 0; e < N; ++e) squares = fmaf(values[e], values[e], squares);
  }
  const float inverse_rms = rsqrtf(block_sum(squares, scratch) / hidden + epsilon);
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    float values[N];
    load_floats<T, N, Vectorized>(x + u * N, values);
    scale_by_weight<W, N, Vectorized>(weight + u * N, inverse_rms, values);
    store_floats<T, N, Vectorized>(y + u * N, values);
  }
}

template <typename T, typename W, int N, bool Vectorized>
__global__ void fused_add_rms_norm_kernel(T* __restrict__ input, int64_t input_stride,
                                          T* __restrict__ residual, int64_t residual_stride,
                                          const W* __restrict__ weight, int hidden,
                                          float epsilon) {
  __shared__ float scratch[kWarpSize];
  const int64_t row = blockIdx.x;
  T* x = input + row * input_stride;
  T* r = residual + row * residual_stride;
  const int units = hidden / N;
  float squares = 0.0f;
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    float sums[N];
    float addends[N];
    load_floats<T, N, Vectorized>(r + u * N, sums);
    load_floats<T, N, Vectorized>(x + u * N, addends);
#pragma unroll
    for (int e = 0; e < N; ++e) {
      sums[e] = round_to<T>(sums[e] + addends[e]);
      squares = fmaf(sums[e], sums[e], squares);
    }
    store_floats<T, N, Vectorized>(r + u * N, sums);
  }
  const float inverse_rms = rsqrtf(block_sum(squares, scratch) / hidden + epsilon);
  // Each thread re-reads exactly the units it wrote above.
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    float values[N];
    load_floats<T, N, Vectorized>(r + u * N, values);
    scale_by_weight<W, N, Vectorized>(weight + u * N, inverse_rms, values);
    store_floats<T, N, Vectorized>(x + u * N, values);
  }
}

// Calls function(T{}, W{}) for the activation and weight types (W is T or float).
template <typename Function>
void dispatch_norm_types(DataType dtype, DataType weight_dtype, Function&& function) {
  dispatch_data_type(dtype, [&](auto activation) {
    using T = decltype(activation);
    if (weight_dtype == DataType::Float32) {
      function(T{}, float{});
    } else {
      function(T{}, T{});
    }
  });
}

}  // namespace

void launch_rms_norm(void* out, int64_t out_stride, const void* input, int64_t input_stride,
                     const void* weight, int64_t num_tokens, int hidden, float epsilon,
                     bool vectorized, DataType dtype, DataType weight_dtype, cudaStream_t stream) {
  dispatch_norm_types(dtype, weight_dtype, [&](auto activation, auto weight_element) {
    using T = decltype(activation);
    using W = decltype(weight_element);
    constexpr int kVector = kVectorElements<T>;
    const dim3 grid(static_cast<unsigned>(num_tokens));
    if (vectorized) {
      const int threads = threads_for(hidden / kVector, kMaxThreads);
      rms_norm_kernel<T, W, kVector, true><<<grid, threads, 0, stream>>>(
          static_cast<T*>(out), out_stride, static_cast<const T*>(input), input_stride,
          static_cast<const W*>(weight), hidden, epsilon);
    } else {
      const int threads = threads_for(hidden, kMaxThreads);
      rms_norm_kernel<T, W, 1, false><<<grid, threads, 0, stream>>>(
          static_cast<T*>(out), out_stride, static_cast<const T*>(input), input_stride,
          static_cast<const W*>(weight), hidden, epsilon);
    }
  });
}

void launch_fused_add_rms_norm(void* input, int64_t input_stride, void* residual,
                               int64_t residual_stride, const void* weight, int64_t num_tokens,
                               int hidden, float epsilon, bool vectorized, DataType dtype,
                               DataType weight_dtype, cudaStream_t stream) {
  dispatch_norm_types(dtype, weight_dtype, [&](auto activation, auto weight_element) {
    using T = decltype(activation);
    using W = decltype(weight_element);
    constexpr int kVector = kVectorElements<T>;
    const dim3 grid(static_cast<unsigned>(num_tokens));
    if (vectorized) {
      const int threads = threads_for(hidden / kVector, kMaxThreads);
      fused_add_rms_norm_kernel<T, W, kVector, true><<<grid, threads, 0, stream>>>(
          static_cast<T*>(input), input_stride, static_cast<T*>(residual), residual_stride,
          static_cast<const W*>(weight), hidden, epsilon);
    } else {
      const int threads = threads_for(hidden, kMaxThreads);
      fused_add_rms_norm_kernel<T, W, 1, false><<<grid, threads, 0, stream>>>(
          static_cast<T*>(input), input_stride, static_cast<T*>(residual), residual_stride,
          static_cast<const W*>(weight), hidden, epsilon);
    }
  });
}

}  // namespace neo_cuda
