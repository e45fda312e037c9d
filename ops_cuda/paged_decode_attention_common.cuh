// What the two paged decode attention kernels and their merge share: the smallest block size a
// partition's block table is sized for, the log2 domain of their logits, the number of
// partitions of a sequence, and the address of a token's K/V row.
#pragma once

#include <cstdint>

#include "device_utils.cuh"

namespace neo_cuda {
namespace {

constexpr int kMinBlockSize = 8;
constexpr float kLog2e = 1.4426950408889634f;

// Partitions of a sequence of `seq_len` tokens (at least one): partition_size tokens each, the
// last one up to partition_slack more.
__device__ __forceinline__ int decode_partitions(int seq_len,
                                                 const PagedDecodeAttentionParams& params) {
  const int folded = seq_len - params.partition_slack;
  return folded <= params.partition_size
             ? 1
             : (folded + params.partition_size - 1) / params.partition_size;
}

// The merge of split sequences is launched as a programmatic dependent of the attention kernel
// (compute capability 9.0 and up; launch_paged_decode_attention_merge): each attention block lets
// it launch as the block starts, so once every attention block is running the merge's blocks take
// the slots the attention grid leaves free and wait there, and when the attention grid completes
// they go on at once instead of being launched then. Below 9.0 both are no-ops and the merge runs
// after the attention kernel in stream order.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Waits until the grid this one depends on has completed and its writes are visible.
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Where one partition's K/V rows of one KV head live.
struct RowAddressing {
  const int64_t* block_offsets;  // shared: element offset of this KV head in each logical block
  int block_shift;               // log2(block_size)
  int offset_mask;               // block_size - 1
  int head_dim;

  // Element offset of partition token `token`'s row in the cache.
  __device__ __forceinline__ int64_t operator()(int token) const {
    return block_offsets[token >> block_shift] + (token & offset_mask) * head_dim;
  }
};

}  // namespace
}  // namespace neo_cuda
