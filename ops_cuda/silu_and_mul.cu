// SiLU-and-multiply: out[t, i] = silu(gate[t, i]) * up[t, i] with input[t] = [gate | up],
// float32 math, one rounding at the end.
//
// One thread block per token row; threads walk units of N elements (16-byte vectors when every
// address allows it, else single elements).
#include "device_utils.cuh"

namespace neo_cuda {
namespace {

constexpr int kMaxThreads = 512;

template <typename T, int N, bool Vectorized>
__global__ void silu_and_mul_kernel(T* __restrict__ out, int64_t out_stride,
                                    const T* __restrict__ input, int64_t input_stride,
                                    int intermediate) {
  const int64_t row = blockIdx.x;
  const T* gate = input + row * input_stride;
  const T* up = gate + intermediate;
  T* result = out + row * out_stride;
  for (int u = threadIdx.x; u < intermediate / N; u += blockDim.x) {
    float gates[N];
    float ups[N];
    load_floats<T, N, Vectorized>(gate + u * N, gates);
    load_floats<T, N, Vectorized>(up + u * N, ups);
#pragma unroll
    for (int e = 0; e < N; ++e) gates[e] = gates[e] / (1.0f + __expf(-gates[e])) * ups[e];
    store_floats<T, N, Vectorized>(result + u * N, gates);
  }
}

}  // namespace

void launch_silu_and_mul(void* out, int64_t out_stride, const void* input, int64_t input_stride,
                         int64_t num_tokens, int intermediate, bool vectorized, DataType dtype,
                         cudaStream_t stream) {
  dispatch_data_type(dtype, [&](auto element) {
    using T = decltype(element);
    constexpr int kVector = kVectorElements<T>;
    const dim3 grid(static_cast<unsigned>(num_tokens));
    if (vectorized) {
      silu_and_mul_kernel<T, kVector, true>
          <<<grid, threads_for(intermediate / kVector, kMaxThreads), 0, stream>>>(
              static_cast<T*>(out), out_stride, static_cast<const T*>(input), input_stride,
              intermediate);
    } else {
      silu_and_mul_kernel<T, 1, false>
          <<<grid, threads_for(intermediate, kMaxThreads), 0, stream>>>(
              static_cast<T*>(out), out_stride, static_cast<const T*>(input), input_stride,
              intermediate);
    }
  });
}

}  // namespace neo_cuda
