// What the two paged decode attention kernels share: the smallest block size a partition's
// block table is sized for, the log2 domain of their logits, and the address of a token's
// K/V row.
#pragma once

#include <cstdint>

#include "device_utils.cuh"

namespace neo_cuda {
namespace {

constexpr int kMinBlockSize = 8;
constexpr float kLog2e = 1.4426950408889634f;

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
