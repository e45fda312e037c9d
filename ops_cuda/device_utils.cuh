// Device helpers shared by the kernels: float conversion of the element types, 16-byte vector
// loads and stores, warp and block reductions, and the DataType -> C++ type dispatch.
//
// torch builds .cu files with __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__ /
// __CUDA_NO_HALF_OPERATORS__, so every conversion here goes through an explicit intrinsic.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "launchers.h"

namespace neo_cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// ---- element <-> float ----------------------------------------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// x rounded to T's precision and widened back (the value torch sees after `.to(T)`).
template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// ---- 16-byte vectors --------------------------------------------------------------------------

// Elements of T in one 16-byte vector.
template <typename T>
constexpr int kVectorElements = 16 / static_cast<int>(sizeof(T));

__device__ __forceinline__ uint4 load_vector(const void* address) {
  return *reinterpret_cast<const uint4*>(address);
}

__device__ __forceinline__ void store_vector(void* address, const uint4& bits) {
  *reinterpret_cast<uint4*>(address) = bits;
}

// The kVectorElements<T> elements packed in `bits`, as floats.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& bits, float (&values)[kVectorElements<T>]);

template <>
__device__ __forceinline__ void unpack<float>(const uint4& bits, float (&values)[4]) {
  values[0] = __uint_as_float(bits.x);
  values[1] = __uint_as_float(bits.y);
  values[2] = __uint_as_float(bits.z);
  values[3] = __uint_as_float(bits.w);
}

template <>
__device__ __forceinline__ void unpack<__nv_bfloat16>(const uint4& bits, float (&values)[8]) {
  // A bfloat16 is the upper half of a float32: widening is a shift or a mask.
  const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    values[2 * i] = __uint_as_float(words[i] << 16);
    values[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

template <>
__device__ __forceinline__ void unpack<__half>(const uint4& bits, float (&values)[8]) {
  const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 pair;
    *reinterpret_cast<uint32_t*>(&pair) = words[i];
    const float2 widened = __half22float2(pair);
    values[2 * i] = widened.x;
    values[2 * i + 1] = widened.y;
  }
}

// Loads N consecutive elements of T (N * sizeof(T) a multiple of 16 and the address 16-byte
// aligned when `Vectorized`) as floats.
template <typename T, int N, bool Vectorized>
__device__ __forceinline__ void load_floats(const T* address, float (&values)[N]) {
  if constexpr (Vectorized) {
    constexpr int kPerVector = kVectorElements<T>;
    static_assert(N % kPerVector == 0, "vectorized loads need whole 16-byte vectors");
#pragma unroll
    for (int v = 0; v < N / kPerVector; ++v) {
      float chunk[kPerVector];
      unpack<T>(load_vector(address + v * kPerVector), chunk);
#pragma unroll
      for (int e = 0; e < kPerVector; ++e) values[v * kPerVector + e] = chunk[e];
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) values[e] = to_float(address[e]);
  }
}

// Stores N floats as consecutive elements of T, rounding to nearest even.
template <typename T, int N, bool Vectorized>
__device__ __forceinline__ void store_floats(T* address, const float (&values)[N]) {
  if constexpr (Vectorized) {
    constexpr int kPerVector = kVectorElements<T>;
    static_assert(N % kPerVector == 0, "vectorized stores need whole 16-byte vectors");
#pragma unroll
    for (int v = 0; v < N / kPerVector; ++v) {
      union {
        uint4 bits;
        T elements[kPerVector];
      } packed;
#pragma unroll
      for (int e = 0; e < kPerVector; ++e) {
        packed.elements[e] = from_float<T>(values[v * kPerVector + e]);
      }
      store_vector(address + v * kPerVector, packed.bits);
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) address[e] = from_float<T>(values[e]);
  }
}

// ---- reductions -----------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(kFullMask, value, offset);
  }
  return value;
}

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
  }
  return value;
}

// Sum over the whole thread block (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result. `scratch` holds 32 floats of shared memory and may be reused after return.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  value = warp_sum(value);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < num_warps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// ---- dispatch -----------------------------------------------------------------------------

// Calls `function(T{})` with T the C++ type of `dtype` (float, __half or __nv_bfloat16).
template <typename Function>
void dispatch_data_type(DataType dtype, Function&& function) {
  switch (dtype) {
    case DataType::Float32:
      function(float{});
      break;
    case DataType::Float16:
      function(__half{});
      break;
    case DataType::BFloat16:
      function(__nv_bfloat16{});
      break;
  }
}

// Threads for a block that walks `items` work items in a loop: a multiple of 32 in [32, limit].
inline int threads_for(int64_t items, int limit) {
  const int64_t rounded = (items + kWarpSize - 1) / kWarpSize * kWarpSize;
  if (rounded < kWarpSize) return kWarpSize;
  return rounded > limit ? limit : static_cast<int>(rounded);
}

}  // namespace neo_cuda
