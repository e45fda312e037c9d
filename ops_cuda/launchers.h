// Host-side entry points of neo's CUDA kernels.
//
// Everything here takes raw device pointers, sizes, strides (in elements) and a cudaStream_t,
// and includes only the CUDA runtime header, so the kernel sources compile with nvcc alone and
// the torch glue stays in binding.cpp. Every launcher only enqueues work on `stream`: it never
// synchronizes and never allocates; the caller checks cudaGetLastError() after each call.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace neo_cuda {

// Element types of activations, weights and caches.
enum class DataType { Float32, Float16, BFloat16 };

// ---- paged decode attention ---------------------------------------------------------------

// Compile-time configurations of the decode kernel. Each one is a separate instantiation; the
// launcher picks one with choose_decode_variant, and the environment variable
// kDecodeVariantVariable may name one instead (benchmarks sweep them that way).
struct DecodeVariant {
  const char* name;
  int warps;            // warps per thread block
  int loads_in_flight;  // 16-byte K or V loads per lane issued before any is used (halved
                        // for 8 query heads per block, whose accumulators take the registers)
  int partition_size;   // KV tokens one thread block attends to; longer sequences are split
                        // and merged by launch_paged_decode_attention_merge
  bool prefetch_values; // the first V loads of each warp are issued before the softmax, so
                        // they are in flight while the block waits at its barriers
  bool double_buffered; // each warp issues the loads of its next K or V chunk before using
                        // the current one (twice the load registers)
  bool early_table;     // CUDA-core kernel: the partition's block-table entries and the query
                        // are loaded together with seq_len instead of after it (the
                        // tensor-core kernel always does)
  int resident_warps;   // warps per SM the register allocation must leave room for
  bool tensor_cores;    // float16 and bfloat16 caches with head_dim 64 or 128 run the
                        // tensor-core kernel (warps, partition_size, resident_warps and
                        // warps_per_item apply); other caches run the CUDA-core kernel with every
                        // field but warps_per_item
  int warps_per_item;   // tensor-core kernel: warps that share the partition of one KV head's
                        // query heads (1, 2 or `warps`); 0: the launcher picks per launch from
                        // the number of (sequence, KV head) pairs
};

// Names spell the fields: w<warps>_l<loads_in_flight>_p<partition_size>, then pv
// (prefetch_values), db (double_buffered), et (early_table), tc (tensor_cores), i<n>
// (warps_per_item n; none: picked per launch).
inline constexpr DecodeVariant kDecodeVariants[] = {
    {"w4_l8_p512", 4, 8, 512, false, false, false, 16, false, 0},
    {"w4_l8_p512_pv", 4, 8, 512, true, false, false, 16, false, 0},
    {"w4_l8_p1024_pv", 4, 8, 1024, true, false, false, 16, false, 0},
    {"w4_l8_p512_pv_et", 4, 8, 512, true, false, true, 16, false, 0},
    {"w4_l16_p1024_pv_et", 4, 16, 1024, true, false, true, 12, false, 0},
    {"w4_l4_p512_pv_db_et", 4, 4, 512, true, true, true, 16, false, 0},
    {"w4_l8_p1024_pv_tc", 4, 8, 1024, true, false, false, 16, true, 0},
    {"w4_l8_p1024_pv_tc_i1", 4, 8, 1024, true, false, false, 16, true, 1},
    {"w4_l8_p1024_pv_tc_i2", 4, 8, 1024, true, false, false, 16, true, 2},
    {"w4_l8_p1024_pv_tc_i4", 4, 8, 1024, true, false, false, 16, true, 4},
};
inline constexpr int kDecodeVariantCount =
    static_cast<int>(sizeof(kDecodeVariants) / sizeof(kDecodeVariants[0]));
inline constexpr const char* kDecodeVariantVariable = "NEO_DECODE_ATTENTION_VARIANT";

// Variants the launcher uses when the environment names none: one for batches whose block
// table spans at most kShortContextTokens tokens per sequence, one for longer ones (the sweep of
// benchmarks/cuda_kernels.py reports the best of each class; the tensor-core variant that picks
// its warps per item at launch leads both).
inline constexpr int kShortContextTokens = 256;
inline constexpr int kShortContextVariant = 6;  // w4_l8_p1024_pv_tc
inline constexpr int kLongContextVariant = 6;   // w4_l8_p1024_pv_tc

// The variant for a block table of `max_blocks_per_seq` columns of `block_size` tokens.
inline int choose_decode_variant(int64_t max_blocks_per_seq, int block_size) {
  return max_blocks_per_seq * block_size <= kShortContextTokens ? kShortContextVariant
                                                                : kLongContextVariant;
}

struct PagedDecodeAttentionParams {
  void* out;                  // [num_seqs, num_heads, head_dim]
  const void* q;              // [num_seqs, num_heads, head_dim], contiguous
  const void* k_cache;        // [num_blocks, num_kv_heads, block_size, head_dim], contiguous
  const void* v_cache;        // same shape as k_cache
  const int32_t* block_table; // [num_seqs, block_table_stride]
  const int32_t* seq_lens;    // [num_seqs]
  // Scratch for split sequences, float32; unused (may be null) when max_partitions == 1.
  float* partial_out;         // [num_seqs, num_heads, max_partitions, head_dim]
  float* partial_max;         // [num_seqs, num_heads, max_partitions] (log2 domain)
  float* partial_sum;         // [num_seqs, num_heads, max_partitions]
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int head_dim;               // a multiple of 16, at most 256
  int block_size;             // a power of two, 8..128
  int block_table_stride;     // elements between rows of block_table
  int max_blocks_per_seq;     // columns of block_table
  int partition_size;         // the chosen variant's partition_size
  int partition_slack;        // decode_partition_slack of the launch (at most a quarter
                              // partition: the tensor-core kernel's table is sized for that)
  int max_partitions;         // ceil(max_blocks_per_seq * block_size / partition_size)
  float scale;                // softmax scale applied to q . k
};

// Whether kDecodeVariants[variant] runs the tensor-core kernel on a cache of `dtype` and
// `head_dim` (else the CUDA-core kernel).
inline bool decode_uses_tensor_cores(int variant, DataType dtype, int64_t head_dim) {
  return kDecodeVariants[variant].tensor_cores && dtype != DataType::Float32 &&
         (head_dim == 64 || head_dim == 128);
}

// Tokens past a whole number of partitions that a sequence's last partition takes itself
// instead of leaving them to one more: the tensor-core kernel's last partition holds up to a
// quarter partition more, so a sequence just past a partition boundary (a context of 1030
// tokens) is neither split nor left with a short block at the grid's end and a merge. The
// CUDA-core kernel takes none.
inline int decode_partition_slack(int variant, DataType dtype, int64_t head_dim) {
  return decode_uses_tensor_cores(variant, dtype, head_dim)
             ? kDecodeVariants[variant].partition_size / 4
             : 0;
}

// Number of partitions of `partition_size` tokens the grid must cover for a block table of
// `max_blocks_per_seq` columns.
inline int decode_partition_count(int64_t max_blocks_per_seq, int block_size,
                                  int partition_size) {
  const int64_t tokens = max_blocks_per_seq * block_size;
  const int64_t partitions = (tokens + partition_size - 1) / partition_size;
  return partitions < 1 ? 1 : static_cast<int>(partitions);
}

// Attention of each partition with kDecodeVariants[variant] (whose partition_size must be
// params.partition_size); sequences with a single partition write `out` directly.
void launch_paged_decode_attention(const PagedDecodeAttentionParams& params, int variant,
                                   DataType dtype, cudaStream_t stream);

// Log-sum-exp merge of the partitions of split sequences into `out`; launch only when
// max_partitions > 1, right after launch_paged_decode_attention on the same stream: it is launched
// as that kernel's programmatic dependent where the device supports it.
void launch_paged_decode_attention_merge(const PagedDecodeAttentionParams& params, DataType dtype,
                                         cudaStream_t stream);

// ---- KV cache store -----------------------------------------------------------------------

// key/value [num_tokens, num_kv_heads, head_dim] with the given token and head strides (last
// dimension contiguous); caches [num_blocks, num_kv_heads, block_size, head_dim] contiguous.
// `vectorized` requires every pointer and stride to be 16-byte aligned.
void launch_store_kv_cache(const void* key, const void* value, void* k_cache, void* v_cache,
                           const int64_t* slot_mapping, int64_t num_tokens, int num_kv_heads,
                           int head_dim, int block_size, int64_t key_token_stride,
                           int64_t key_head_stride, int64_t value_token_stride,
                           int64_t value_head_stride, bool vectorized, DataType dtype,
                           cudaStream_t stream);

// ---- RMSNorm --------------------------------------------------------------------------------

// out[t] = weight * rms_normalize(input[t]); rows of `hidden` contiguous elements, `*_stride`
// elements apart. `weight_dtype` is the activation dtype or Float32.
void launch_rms_norm(void* out, int64_t out_stride, const void* input, int64_t input_stride,
                     const void* weight, int64_t num_tokens, int hidden, float epsilon,
                     bool vectorized, DataType dtype, DataType weight_dtype, cudaStream_t stream);

// residual[t] += input[t]; input[t] = weight * rms_normalize(residual[t]).
void launch_fused_add_rms_norm(void* input, int64_t input_stride, void* residual,
                               int64_t residual_stride, const void* weight, int64_t num_tokens,
                               int hidden, float epsilon, bool vectorized, DataType dtype,
                               DataType weight_dtype, cudaStream_t stream);

// ---- rotary embedding -----------------------------------------------------------------------

// In place on query [T, num_heads, head_dim] and key [T, num_kv_heads, head_dim] (strides in
// elements, last dimension contiguous); cos_sin_cache float32 [max_positions, rotary_dim]
// contiguous.
void launch_rotary_embedding(const int64_t* positions, void* query, int64_t query_token_stride,
                             int64_t query_head_stride, void* key, int64_t key_token_stride,
                             int64_t key_head_stride, const float* cos_sin_cache,
                             int64_t num_tokens, int num_heads, int num_kv_heads, int rotary_dim,
                             DataType dtype, cudaStream_t stream);

// ---- SiLU and multiply ----------------------------------------------------------------------

// out[t, i] = silu(input[t, i]) * input[t, intermediate + i]; rows `*_stride` elements apart.
void launch_silu_and_mul(void* out, int64_t out_stride, const void* input, int64_t input_stride,
                         int64_t num_tokens, int intermediate, bool vectorized, DataType dtype,
                         cudaStream_t stream);

// ---- prefill attention (kernel of ours, used where flash attention does not apply) -------------

// Causal attention within each packed prompt: q/out [T, num_heads, head_dim], k/v
// [T, num_kv_heads, head_dim] (token and head strides in elements, last dimension contiguous),
// cu_seqlens int32 [num_seqs + 1] on the device. head_dim at most kPrefillMaxHeadDim.
constexpr int kPrefillMaxHeadDim = 256;

void launch_prefill_attention(void* out, int64_t out_token_stride, int64_t out_head_stride,
                              const void* q, int64_t q_token_stride, int64_t q_head_stride,
                              const void* k, int64_t k_token_stride, int64_t k_head_stride,
                              const void* v, int64_t v_token_stride, int64_t v_head_stride,
                              const int32_t* cu_seqlens, int num_seqs, int64_t num_tokens,
                              int num_heads, int num_kv_heads, int head_dim, float scale,
                              DataType dtype, cudaStream_t stream);

// ---- block swaps ----------------------------------------------------------------------------

// Where the blocks of one swap_blocks tensor lie, in bytes: block b starts at
// b * block_stride_bytes and is `rows` rows of `chunk_bytes` contiguous bytes, `pitch_bytes`
// apart (rows == 1 for a contiguous tensor).
struct BlockRows {
  int64_t rows;
  int64_t pitch_bytes;
  int64_t chunk_bytes;
  int64_t block_stride_bytes;
};

// Copies block mapping[i][0] of `src` to block mapping[i][1] of `dst` (same rows and chunk)
// with one pitched cudaMemcpy2DAsync per run of consecutive pairs (a plain copy when a block
// is one row; row by row when a pitch exceeds the device's limit). `mapping` is host memory,
// `num_pairs` rows of two int64; ids must already be validated.
cudaError_t swap_blocks(const void* src, const BlockRows& src_layout, void* dst,
                        const BlockRows& dst_layout, const int64_t* mapping, int64_t num_pairs,
                        cudaMemcpyKind kind, cudaStream_t stream);

// Whether `pointer` lies in page-locked host memory (cudaHostAlloc / cudaHostRegister).
bool is_pinned_host_memory(const void* pointer);

}  // namespace neo_cuda
