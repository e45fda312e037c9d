// swap_blocks: copies whole cache blocks between two tensors (GPU<->GPU, GPU<->pinned host)
// with one cudaMemcpyAsync per run of consecutive (src, dst) block pairs. Host code only.
#include "launchers.h"

namespace neo_cuda {

cudaError_t swap_blocks(const void* src, void* dst, int64_t block_bytes, const int64_t* mapping,
                        int64_t num_pairs, cudaMemcpyKind kind, cudaStream_t stream) {
  const char* source = static_cast<const char*>(src);
  char* destination = static_cast<char*>(dst);
  int64_t row = 0;
  while (row < num_pairs) {
    const int64_t first_src = mapping[2 * row];
    const int64_t first_dst = mapping[2 * row + 1];
    int64_t run = 1;
    while (row + run < num_pairs && mapping[2 * (row + run)] == first_src + run &&
           mapping[2 * (row + run) + 1] == first_dst + run) {
      ++run;
    }
    const cudaError_t error =
        cudaMemcpyAsync(destination + first_dst * block_bytes, source + first_src * block_bytes,
                        static_cast<size_t>(run * block_bytes), kind, stream);
    if (error != cudaSuccess) return error;
    row += run;
  }
  return cudaSuccess;
}

bool is_pinned_host_memory(const void* pointer) {
  cudaPointerAttributes attributes;
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    cudaGetLastError();  // clear the error so the caller's launch checks do not see it
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

}  // namespace neo_cuda
