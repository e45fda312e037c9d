// The paged decode attention kernel, every variant, for float32 caches.
#include "paged_decode_attention.cuh"

namespace neo_cuda {

void launch_paged_decode_attention_float32(const PagedDecodeAttentionParams& params,
                                           int variant, cudaStream_t stream) {
  launch_for_type<float>(params, variant, stream);
}

}  // namespace neo_cuda
