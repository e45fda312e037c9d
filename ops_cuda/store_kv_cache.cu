// store_kv_cache: scatters each token's K and V rows into its cache slot.
//
// One thread block per token; its threads copy the num_kv_heads x head_dim elements of key and
// value (16-byte vectors when every address allows it). A slot of -1 skips the token.
#include "device_utils.cuh"

namespace neo_cuda {
namespace {

constexpr int kMaxThreads = 256;

// Unit: one 16-byte vector (Vectorized) or one element, copied as raw bits.
template <typename T, bool Vectorized>
struct CopyUnit {
  using Type = typename std::conditional<Vectorized, uint4, T>::type;
  static constexpr int kElements = Vectorized ? kVectorElements<T> : 1;
};

template <typename T, bool Vectorized>
__global__ void store_kv_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                      T* __restrict__ k_cache, T* __restrict__ v_cache,
                                      const int64_t* __restrict__ slot_mapping, int num_kv_heads,
                                      int head_dim, int block_size, int64_t key_token_stride,
                                      int64_t key_head_stride, int64_t value_token_stride,
                                      int64_t value_head_stride) {
  using Unit = CopyUnit<T, Vectorized>;
  using Bits = typename Unit::Type;
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  const int64_t block = slot / block_size;
  const int offset = static_cast<int>(slot - block * block_size);
  const int units_per_row = head_dim / Unit::kElements;
  for (int i = threadIdx.x; i < num_kv_heads * units_per_row; i += blockDim.x) {
    const int head = i / units_per_row;
    const int element = (i - head * units_per_row) * Unit::kElements;
    const int64_t cache_index =
        ((block * num_kv_heads + head) * block_size + offset) * head_dim + element;
    const T* key_source = key + token * key_token_stride + head * key_head_stride + element;
    const T* value_source =
        value + token * value_token_stride + head * value_head_stride + element;
    *reinterpret_cast<Bits*>(k_cache + cache_index) = *reinterpret_cast<const Bits*>(key_source);
    *reinterpret_cast<Bits*>(v_cache + cache_index) =
        *reinterpret_cast<const Bits*>(value_source);
  }
}

}  // namespace

void launch_store_kv_cache(const void* key, const void* value, void* k_cache, void* v_cache,
                           const int64_t* slot_mapping, int64_t num_tokens, int num_kv_heads,
                           int head_dim, int block_size, int64_t key_token_stride,
                           int64_t key_head_stride, int64_t value_token_stride,
                           int64_t value_head_stride, bool vectorized, DataType dtype,
                           cudaStream_t stream) {
  dispatch_data_type(dtype, [&](auto element) {
    using T = decltype(element);
    const int units = num_kv_heads * (vectorized ? head_dim / kVectorElements<T> : head_dim);
    const int threads = threads_for(units, kMaxThreads);
    const dim3 grid(static_cast<unsigned>(num_tokens));
    if (vectorized) {
      store_kv_cache_kernel<T, true><<<grid, threads, 0, stream>>>(
          static_cast<const T*>(key), static_cast<const T*>(value), static_cast<T*>(k_cache),
          static_cast<T*>(v_cache), slot_mapping, num_kv_heads, head_dim, block_size,
          key_token_stride, key_head_stride, value_token_stride, value_head_stride);
    } else {
      store_kv_cache_kernel<T, false><<<grid, threads, 0, stream>>>(
          static_cast<const T*>(key), static_cast<const T*>(value), static_cast<T*>(k_cache),
          static_cast<T*>(v_cache), slot_mapping, num_kv_heads, head_dim, block_size,
          key_token_stride, key_head_stride, value_token_stride, value_head_stride);
    }
  });
}

}  // namespace neo_cuda
