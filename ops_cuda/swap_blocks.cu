// swap_blocks: copies whole cache blocks between two tensors (GPU<->GPU, GPU<->pinned host).
// A block is `rows` rows of `chunk_bytes` contiguous bytes, `pitch` bytes apart (one row for a
// contiguous tensor; one row per layer and K/V for a whole pool with its block dimension first),
// so each run of consecutive (src, dst) block pairs is one pitched copy: the copy engines walk
// the rows themselves. Host code only.
#include "launchers.h"

namespace neo_cuda {

namespace {

// Whether consecutive blocks of this layout are adjacent within each row, so a run of them is
// one wider row.
bool blocks_adjacent(const BlockRows& layout) {
  return layout.block_stride_bytes == layout.chunk_bytes;
}

// The widest pitch a 2D copy takes on the current device (0 when unknown: copy row by row).
int64_t max_pitch_bytes() {
  int device = 0;
  int pitch = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&pitch, cudaDevAttrMaxPitch, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return pitch;
}

}  // namespace

cudaError_t swap_blocks(const void* src, const BlockRows& src_layout, void* dst,
                        const BlockRows& dst_layout, const int64_t* mapping, int64_t num_pairs,
                        cudaMemcpyKind kind, cudaStream_t stream) {
  const char* source = static_cast<const char*>(src);
  char* destination = static_cast<char*>(dst);
  const bool merge = blocks_adjacent(src_layout) && blocks_adjacent(dst_layout);
  const int64_t rows = src_layout.rows;
  const int64_t max_pitch = rows > 1 ? max_pitch_bytes() : 0;
  const bool pitched = rows > 1 && src_layout.pitch_bytes <= max_pitch &&
                       dst_layout.pitch_bytes <= max_pitch;
  int64_t row = 0;
  while (row < num_pairs) {
    const int64_t first_src = mapping[2 * row];
    const int64_t first_dst = mapping[2 * row + 1];
    int64_t run = 1;
    while (merge && row + run < num_pairs && mapping[2 * (row + run)] == first_src + run &&
           mapping[2 * (row + run) + 1] == first_dst + run) {
      ++run;
    }
    const char* from = source + first_src * src_layout.block_stride_bytes;
    char* to = destination + first_dst * dst_layout.block_stride_bytes;
    const size_t width = static_cast<size_t>(run * src_layout.chunk_bytes);
    cudaError_t error = cudaSuccess;
    if (rows == 1) {
      error = cudaMemcpyAsync(to, from, width, kind, stream);
    } else if (pitched) {
      error = cudaMemcpy2DAsync(to, static_cast<size_t>(dst_layout.pitch_bytes), from,
                                static_cast<size_t>(src_layout.pitch_bytes), width,
                                static_cast<size_t>(rows), kind, stream);
    } else {  // a pitch past what a 2D copy takes
      for (int64_t line = 0; line < rows && error == cudaSuccess; ++line) {
        error = cudaMemcpyAsync(to + line * dst_layout.pitch_bytes,
                                from + line * src_layout.pitch_bytes, width, kind, stream);
      }
    }
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
