// The paged decode attention kernel, every variant, for float16 caches.
#include "paged_decode_attention.cuh"

namespace neo_cuda {

void launch_paged_decode_attention_float16(const PagedDecodeAttentionParams& params,
                                           int variant, cudaStream_t stream) {
  launch_for_type<__half>(params, variant, stream);
}

}  // namespace neo_cuda
