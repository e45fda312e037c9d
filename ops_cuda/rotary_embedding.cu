// Rotary position embedding, GPT-NeoX style (the two halves of the first rotary_dim features of
// each head rotate as pairs), in place on query and key.
//
// One thread block per token; threads walk the (head, pair) items of its query and key heads.
// cos/sin are rounded to the activation dtype first and the rotation is computed in float32
// without contraction, like the reference.
#include "device_utils.cuh"

namespace neo_cuda {
namespace {

constexpr int kMaxThreads = 256;

template <typename T>
__global__ void rotary_embedding_kernel(const int64_t* __restrict__ positions,
                                        T* __restrict__ query, int64_t query_token_stride,
                                        int64_t query_head_stride, T* __restrict__ key,
                                        int64_t key_token_stride, int64_t key_head_stride,
                                        const float* __restrict__ cos_sin_cache, int num_heads,
                                        int num_kv_heads, int rotary_dim) {
  const int64_t token = blockIdx.x;
  const int half = rotary_dim / 2;
  const float* cos_row = cos_sin_cache + positions[token] * rotary_dim;
  const float* sin_row = cos_row + half;
  const int items = (num_heads + num_kv_heads) * half;
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    const int head = i / half;
    const int pair = i - head * half;
    T* row = head < num_heads
                 ? query + token * query_token_stride + head * query_head_stride
                 : key + token * key_token_stride + (head - num_heads) * key_head_stride;
    const float cosine = round_to<T>(cos_row[pair]);
    const float sine = round_to<T>(sin_row[pair]);
    const float first = to_float(row[pair]);
    const float second = to_float(row[pair + half]);
    row[pair] = from_float<T>(__fsub_rn(__fmul_rn(first, cosine), __fmul_rn(second, sine)));
    row[pair + half] =
        from_float<T>(__fadd_rn(__fmul_rn(second, cosine), __fmul_rn(first, sine)));
  }
}

}  // namespace

void launch_rotary_embedding(const int64_t* positions, void* query, int64_t query_token_stride,
                             int64_t query_head_stride, void* key, int64_t key_token_stride,
                             int64_t key_head_stride, const float* cos_sin_cache,
                             int64_t num_tokens, int num_heads, int num_kv_heads, int rotary_dim,
                             DataType dtype, cudaStream_t stream) {
  const int threads = threads_for(static_cast<int64_t>(num_heads + num_kv_heads) * rotary_dim / 2,
                                  kMaxThreads);
  dispatch_data_type(dtype, [&](auto element) {
    using T = decltype(element);
    rotary_embedding_kernel<T><<<static_cast<unsigned>(num_tokens), threads, 0, stream>>>(
        positions, static_cast<T*>(query), query_token_stride, query_head_stride,
        static_cast<T*>(key), key_token_stride, key_head_stride, cos_sin_cache, num_heads,
        num_kv_heads, rotary_dim);
  });
}

}  // namespace neo_cuda
