// Copies between device memory and page-locked host memory mapped into the device's address
// space, done by thread blocks (loads and stores over PCIe) instead of a DMA memcpy.
//
// Why: while a host-to-device or device-to-host memcpy is queued and not yet done, the driver
// makes every cuFuncSetAttribute wait for it, and cuBLASLt sets kernel attributes on each GEMM
// it launches. A host batch's per-layer copies wait behind its host functions for up to a
// second, so with memcpys every GEMM launched meanwhile (the GPU's own iterations) waited for
// the whole host batch. Kernels are not memcpys: launches beside them do not wait.
#include "launchers.h"

namespace neo_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;  // enough loads in flight to cover PCIe latency

__global__ void copy_vectors(uint4* __restrict__ destination, const uint4* __restrict__ source,
                             int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    destination[i] = source[i];
  }
}

__global__ void copy_bytes(uint8_t* __restrict__ destination, const uint8_t* __restrict__ source,
                           int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    destination[i] = source[i];
  }
}

int blocks_for(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

}  // namespace

void launch_mapped_copy(void* destination, const void* source, int64_t bytes, cudaStream_t stream) {
  if (bytes <= 0) return;
  const auto address = reinterpret_cast<uintptr_t>(destination) | reinterpret_cast<uintptr_t>(source);
  if (address % sizeof(uint4) == 0 && bytes % static_cast<int64_t>(sizeof(uint4)) == 0) {
    const int64_t count = bytes / static_cast<int64_t>(sizeof(uint4));
    copy_vectors<<<blocks_for(count), kThreads, 0, stream>>>(static_cast<uint4*>(destination),
                                                            static_cast<const uint4*>(source), count);
  } else {
    copy_bytes<<<blocks_for(bytes), kThreads, 0, stream>>>(static_cast<uint8_t*>(destination),
                                                          static_cast<const uint8_t*>(source), bytes);
  }
}

}  // namespace neo_cuda
