// Paged decode attention, flash-decoding style.
//
// Grid: (sequence, KV head x head chunk, partition). One thread block attends the query heads
// of one KV group (up to `Heads` of them; larger groups are cut into chunks) to one partition
// of KV tokens, so every K/V element it loads serves all those query heads. Warps per block,
// loads in flight per lane, partition size and the load schedule are compile-time parameters
// of a DecodeVariant (launchers.h). Inside a block:
//
//   1. the partition's block-table entries go to shared memory;
//   2. key pass: each warp takes chunks of tokens; a group of kKeyLanes lanes reads one token's
//      K row with 16-byte loads (several loads per lane issued before any is used) and
//      the group reduces the dot products with shuffles; logits (log2 domain) go to shared
//      memory, one row of `Heads` floats per token;
//   3. softmax: block-wide max and sum of exponentials per head;
//   4. value pass: a group of kValueLanes lanes covers one V row, each lane accumulates its
//      slice of the output for every head; lane groups and warps are then summed. With
//      prefetch_values, each warp issues the loads of its first V chunk before the softmax
//      barriers, so the block has bytes in flight while it waits there.
//
// A double-buffered variant issues the loads of a warp's next chunk before it computes on the
// current one, so loads stay in flight during the arithmetic (blocks of up to 4 query heads;
// with 8, the query and accumulator registers leave no room for a second buffer). An
// early-table variant loads the partition's block-table entries (as far as the table's columns
// reach) and the query in the same round trip as seq_len, instead of one round trip later.
//
// A sequence that fits one partition writes `out` directly. Longer ones write unnormalized
// partial outputs with their max and sum, which merge_kernel (paged_decode_attention.cu)
// combines (log-sum-exp). All arithmetic is float32. A sequence with seq_len <= 0 gets a zero
// output.
//
// Variants with tensor_cores run the kernel of paged_decode_attention_mma.cuh instead, where it
// applies (float16 and bfloat16 caches, head_dim 64 or 128).
//
// This header holds the kernel templates; paged_decode_attention_<type>.cu instantiate them.
#pragma once

#include "paged_decode_attention_mma.cuh"

namespace neo_cuda {
namespace {

// Warps whose partial outputs shared memory holds at once in the cross-warp sum.
constexpr int kMaxReductionSlots = 4;

// Register budgets per lane: query floats held for the key pass (half as many when
// double-buffered loads take the registers), and vectors of one row.
constexpr int kQueryFloatsPerLane = 64;
constexpr int kDoubleBufferedQueryFloatsPerLane = 32;
constexpr int kMaxRowVectorsPerLane = 8;

constexpr int constexpr_max(int a, int b) { return a > b ? a : b; }
constexpr int constexpr_min(int a, int b) { return a < b ? a : b; }

// kDecodeVariants[Variant] as compile-time constants.
template <int Variant>
struct DecodeConfig {
  static_assert(Variant >= 0 && Variant < kDecodeVariantCount, "no such decode variant");
  static constexpr DecodeVariant kVariant = kDecodeVariants[Variant];
  static constexpr int kWarps = kVariant.warps;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kLoadsInFlight = kVariant.loads_in_flight;
  static constexpr int kPartitionSize = kVariant.partition_size;
  static constexpr bool kPrefetchValues = kVariant.prefetch_values;
  static constexpr bool kDoubleBuffered = kVariant.double_buffered;
  static constexpr bool kEarlyTable = kVariant.early_table;
  static constexpr bool kTensorCores = kVariant.tensor_cores;
  static constexpr int kWarpsPerItem = kVariant.warps_per_item;
  static_assert(kWarpsPerItem == 0 ||
                    (kTensorCores && kWarps % (kWarpsPerItem > 0 ? kWarpsPerItem : 1) == 0),
                "warps_per_item: a tensor-core variant's divisor of its warps, or 0");
  static constexpr int kMinBlocksPerSm = constexpr_max(1, kVariant.resident_warps / kWarps);
  static constexpr int kMaxTableEntries = kPartitionSize / kMinBlockSize;
  static constexpr int kReductionSlots = constexpr_min(kWarps, kMaxReductionSlots);
  static_assert(kWarps % kReductionSlots == 0, "warps must fill whole rounds of the output sum");
  static_assert(kPartitionSize % 128 == 0, "a partition holds whole blocks of every block size");

  // 16-byte loads per lane in flight for `heads` query heads per block.
  static constexpr int loads_in_flight(int heads) {
    return heads >= 8 ? kLoadsInFlight / 2 : kLoadsInFlight;
  }
};

// Lanes that share one K row: enough that each lane holds at most `max_query_floats` query
// floats and `max_row_vectors` vectors of the row, but no more than the row has vectors.
constexpr int lanes_per_key_row(int heads, int head_dim, int row_vectors, int max_query_floats,
                                int max_row_vectors) {
  int lanes = 1;
  while (lanes < kWarpSize && lanes < row_vectors &&
         (heads * head_dim / lanes > max_query_floats ||
          row_vectors / lanes > max_row_vectors)) {
    lanes *= 2;
  }
  return lanes;
}

template <typename T, int HeadDimMax, int Heads, typename Config>
struct DecodeLayout {
  static constexpr int kVector = kVectorElements<T>;
  static constexpr int kRowVectors = HeadDimMax / kVector;
  static_assert(HeadDimMax % kVector == 0, "head_dim must hold whole 16-byte vectors");

  // Double buffering applies up to 4 query heads per block: with 8, the query and the
  // accumulators leave no registers for a second buffer.
  static constexpr bool kDoubleBuffered = Config::kDoubleBuffered && Heads <= 4;
  // A lane's share of one K row: up to kMaxRowVectorsPerLane vectors, or, double-buffered,
  // no more than the loads in flight (so the two buffers fit the registers).
  static constexpr int kMaxKeyVectorsPerLane =
      kDoubleBuffered ? constexpr_min(kMaxRowVectorsPerLane, Config::loads_in_flight(Heads))
                      : kMaxRowVectorsPerLane;
  static constexpr int kMaxQueryFloatsPerLane =
      kDoubleBuffered ? kDoubleBufferedQueryFloatsPerLane : kQueryFloatsPerLane;
  static constexpr int kKeyLanes = lanes_per_key_row(Heads, HeadDimMax, kRowVectors,
                                                     kMaxQueryFloatsPerLane, kMaxKeyVectorsPerLane);
  static constexpr int kKeyVectorsPerLane = kRowVectors / kKeyLanes;
  static constexpr int kKeyTokensPerStep = kWarpSize / kKeyLanes;
  static constexpr int kKeyUnroll =
      constexpr_max(1, Config::loads_in_flight(Heads) / kKeyVectorsPerLane);
  static constexpr int kKeyTokensPerChunk = kKeyTokensPerStep * kKeyUnroll;

  static constexpr int kValueLanes = constexpr_min(kWarpSize, kRowVectors);
  static constexpr int kValueVectorsPerLane = kRowVectors / kValueLanes;
  static constexpr int kValueTokensPerStep = kWarpSize / kValueLanes;
  static constexpr int kValueUnroll =
      constexpr_max(1, Config::loads_in_flight(Heads) / kValueVectorsPerLane);
  static constexpr int kValueTokensPerChunk = kValueTokensPerStep * kValueUnroll;

  // Shared floats: logits/probabilities [partition][Heads], later reused for the cross-warp sum
  // of the outputs [kReductionSlots][Heads][HeadDimMax].
  static constexpr int kSharedFloats = constexpr_max(
      Config::kPartitionSize * Heads, Config::kReductionSlots * Heads * HeadDimMax);
};

// Stores one token's `Heads` logits (or probabilities) into a shared row.
template <int Heads>
__device__ __forceinline__ void store_row(float* row, const float (&values)[Heads]) {
  if constexpr (Heads % 4 == 0) {
#pragma unroll
    for (int h = 0; h < Heads; h += 4) {
      *reinterpret_cast<float4*>(row + h) =
          make_float4(values[h], values[h + 1], values[h + 2], values[h + 3]);
    }
  } else {
#pragma unroll
    for (int h = 0; h < Heads; ++h) row[h] = values[h];
  }
}

template <int Heads>
__device__ __forceinline__ void load_row(const float* row, float (&values)[Heads]) {
  if constexpr (Heads % 4 == 0) {
#pragma unroll
    for (int h = 0; h < Heads; h += 4) {
      const float4 four = *reinterpret_cast<const float4*>(row + h);
      values[h] = four.x;
      values[h + 1] = four.y;
      values[h + 2] = four.z;
      values[h + 3] = four.w;
    }
  } else {
#pragma unroll
    for (int h = 0; h < Heads; ++h) values[h] = row[h];
  }
}

// T: element type; HeadDimMax: compile-time head_dim (ExactHeadDim) or its upper bound, with
// the run-time head_dim masking the vectors past it; Heads: query heads per block; Variant:
// index into kDecodeVariants.
template <typename T, int HeadDimMax, bool ExactHeadDim, int Heads, int Variant>
__global__ void __launch_bounds__(DecodeConfig<Variant>::kThreads,
                                  DecodeConfig<Variant>::kMinBlocksPerSm)
    paged_decode_attention_kernel(const PagedDecodeAttentionParams params) {
  using Config = DecodeConfig<Variant>;
  using Layout = DecodeLayout<T, HeadDimMax, Heads, Config>;
  constexpr int kThreads = Config::kThreads;
  constexpr int kWarps = Config::kWarps;
  constexpr int kPartitionSize = Config::kPartitionSize;
  constexpr int kSlots = Config::kReductionSlots;
  constexpr int kVector = Layout::kVector;
  constexpr int kKeyLanes = Layout::kKeyLanes;
  constexpr int kKeyVectors = Layout::kKeyVectorsPerLane;
  constexpr int kKeyUnroll = Layout::kKeyUnroll;
  constexpr int kValueLanes = Layout::kValueLanes;
  constexpr int kValueVectors = Layout::kValueVectorsPerLane;
  constexpr int kValueUnroll = Layout::kValueUnroll;

  __shared__ __align__(16) float shared[Layout::kSharedFloats];
  __shared__ int64_t block_offsets[Config::kMaxTableEntries];
  __shared__ float warp_maxima[kWarps][Heads];
  __shared__ float warp_sums[kWarps][Heads];
  __shared__ float output_scale[Heads];

  allow_dependent_launch();
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;

  const int seq = blockIdx.x;
  const int group = params.num_heads / params.num_kv_heads;
  const int head_chunks = (group + Heads - 1) / Heads;
  const int kv_head = blockIdx.y / head_chunks;
  const int chunk = blockIdx.y % head_chunks;
  const int partition = blockIdx.z;
  const int first_head = kv_head * group + chunk * Heads;
  const int heads_here = min(Heads, group - chunk * Heads);
  const int head_dim = ExactHeadDim ? HeadDimMax : params.head_dim;
  const int row_vectors = head_dim / kVector;
  // Whether 16-byte vector `v` of a row lies inside head_dim.
  auto in_row = [&](int v) { return ExactHeadDim || v < row_vectors; };

  const int start = partition * kPartitionSize;
  const int64_t first_row = static_cast<int64_t>(seq) * params.num_heads + first_head;
  T* out = static_cast<T*>(params.out) + first_row * head_dim;
  const int block_size = params.block_size;
  const int block_shift = __ffs(block_size) - 1;
  const int* table_row = params.block_table +
                         static_cast<int64_t>(seq) * params.block_table_stride +
                         (start >> block_shift);
  const int64_t block_stride = static_cast<int64_t>(params.num_kv_heads) * block_size * head_dim;
  const int64_t head_offset = static_cast<int64_t>(kv_head) * block_size * head_dim;
  // Stores the first `entries` block-table entries of the partition into block_offsets, as
  // element offsets of this KV head's rows.
  auto load_table = [&](int entries) {
    for (int i = tid; i < entries; i += kThreads) {
      block_offsets[i] = table_row[i] * block_stride + head_offset;
    }
  };

  // Query slices of this lane for the key pass, pre-scaled into the log2 domain.
  const int key_group = lane / kKeyLanes;
  const int key_lane = lane % kKeyLanes;
  float query[Heads][kKeyVectors][kVector];
  auto load_query = [&]() {
    const T* q = static_cast<const T*>(params.q) + first_row * head_dim;
    const float scale = params.scale * kLog2e;
#pragma unroll
    for (int h = 0; h < Heads; ++h) {
#pragma unroll
      for (int j = 0; j < kKeyVectors; ++j) {
        const int v = j * kKeyLanes + key_lane;
        if (h < heads_here && in_row(v)) {
          unpack<T>(load_vector(q + h * head_dim + v * kVector), query[h][j]);
#pragma unroll
          for (int e = 0; e < kVector; ++e) query[h][j][e] *= scale;
        } else {
#pragma unroll
          for (int e = 0; e < kVector; ++e) query[h][j][e] = 0.0f;
        }
      }
    }
  };

  const int seq_len = params.seq_lens[seq];
  // A block of a later partition past the sequence's end leaves before its table and query
  // loads (as in the tensor-core kernel).
  if (partition > 0 && start >= seq_len) return;
  if constexpr (Config::kEarlyTable) {
    // One entry per thread: every entry the partition can use that the table holds (those past
    // seq_len go unread). The entry's load is issued before the query's, and in the first
    // partition's blocks both before seq_len is needed.
    static_assert(Config::kMaxTableEntries <= kThreads, "early table loads one entry a thread");
    const int entries =
        min(kPartitionSize >> block_shift, params.max_blocks_per_seq - (start >> block_shift));
    const int entry = tid < entries ? table_row[tid] : 0;
    load_query();
    if (tid < entries) block_offsets[tid] = entry * block_stride + head_offset;
  }
  if (start >= seq_len) {
    if (partition == 0) {
      for (int i = tid; i < heads_here * head_dim; i += kThreads) out[i] = from_float<T>(0.0f);
    }
    return;
  }
  const int num_tokens = min(kPartitionSize, seq_len - start);
  const bool split = seq_len > kPartitionSize;

  // 1. Block table of the partition (unless loaded early), then the query.
  if constexpr (!Config::kEarlyTable) {
    load_table((num_tokens + block_size - 1) >> block_shift);
  }
  RowAddressing row_of;
  row_of.block_offsets = block_offsets;
  row_of.block_shift = block_shift;
  row_of.offset_mask = block_size - 1;
  row_of.head_dim = head_dim;
  if constexpr (!Config::kEarlyTable) load_query();
  __syncthreads();  // block_offsets ready

  // 2. Key pass: logits[token][h] = q_h . k_token (log2 domain).
  const T* k_cache = static_cast<const T*>(params.k_cache);
  float* logits = shared;
  float running_max[Heads];
#pragma unroll
  for (int h = 0; h < Heads; ++h) running_max[h] = -INFINITY;
  const int key_chunks = (num_tokens + Layout::kKeyTokensPerChunk - 1) / Layout::kKeyTokensPerChunk;
  using KeyChunk = uint4[kKeyUnroll][kKeyVectors];
  // Issues the loads of key chunk `c` into `keys`.
  auto load_key_chunk = [&](int c, KeyChunk& keys) {
    const int chunk_token = c * Layout::kKeyTokensPerChunk + key_group;
#pragma unroll
    for (int u = 0; u < kKeyUnroll; ++u) {
      const int token = chunk_token + u * Layout::kKeyTokensPerStep;
      const bool valid = token < num_tokens;
      const T* row = k_cache + (valid ? row_of(token) : 0);
#pragma unroll
      for (int j = 0; j < kKeyVectors; ++j) {
        const int v = j * kKeyLanes + key_lane;
        keys[u][j] = (valid && in_row(v)) ? load_vector(row + v * kVector) : make_uint4(0, 0, 0, 0);
      }
    }
  };
  KeyChunk keys;
  KeyChunk next_keys;  // double-buffered layouts only
  for (int c = warp; c < key_chunks; c += kWarps) {
    const bool has_next = c + kWarps < key_chunks;
    if constexpr (Layout::kDoubleBuffered) {
      if (c == warp) load_key_chunk(c, keys);
      if (has_next) load_key_chunk(c + kWarps, next_keys);
    } else {
      load_key_chunk(c, keys);
    }
    const int chunk_token = c * Layout::kKeyTokensPerChunk + key_group;
#pragma unroll
    for (int u = 0; u < kKeyUnroll; ++u) {
      float dot[Heads];
#pragma unroll
      for (int h = 0; h < Heads; ++h) dot[h] = 0.0f;
#pragma unroll
      for (int j = 0; j < kKeyVectors; ++j) {
        float key[kVector];
        unpack<T>(keys[u][j], key);
#pragma unroll
        for (int h = 0; h < Heads; ++h) {
#pragma unroll
          for (int e = 0; e < kVector; ++e) dot[h] = fmaf(query[h][j][e], key[e], dot[h]);
        }
      }
#pragma unroll
      for (int offset = kKeyLanes / 2; offset > 0; offset /= 2) {
#pragma unroll
        for (int h = 0; h < Heads; ++h) dot[h] += __shfl_xor_sync(kFullMask, dot[h], offset);
      }
      const int token = chunk_token + u * Layout::kKeyTokensPerStep;
      if (token < num_tokens) {
#pragma unroll
        for (int h = 0; h < Heads; ++h) running_max[h] = fmaxf(running_max[h], dot[h]);
        if (key_lane == 0) store_row<Heads>(logits + token * Heads, dot);
      }
    }
    if constexpr (Layout::kDoubleBuffered) {
      if (has_next) {
#pragma unroll
        for (int u = 0; u < kKeyUnroll; ++u) {
#pragma unroll
          for (int j = 0; j < kKeyVectors; ++j) keys[u][j] = next_keys[u][j];
        }
      }
    }
  }

  // 4a. V loads of this warp's first value chunk, when the variant issues them early.
  const T* v_cache = static_cast<const T*>(params.v_cache);
  const int value_group = lane / kValueLanes;
  const int value_lane = lane % kValueLanes;
  const int value_chunks =
      (num_tokens + Layout::kValueTokensPerChunk - 1) / Layout::kValueTokensPerChunk;
  using ValueChunk = uint4[kValueUnroll][kValueVectors];
  // Issues the loads of value chunk `c` into `values`.
  auto load_value_chunk = [&](int c, ValueChunk& values) {
    const int chunk_token = c * Layout::kValueTokensPerChunk + value_group;
#pragma unroll
    for (int u = 0; u < kValueUnroll; ++u) {
      const int token = chunk_token + u * Layout::kValueTokensPerStep;
      const bool valid = token < num_tokens;
      const T* row = v_cache + (valid ? row_of(token) : 0);
#pragma unroll
      for (int j = 0; j < kValueVectors; ++j) {
        const int v = j * kValueLanes + value_lane;
        values[u][j] =
            (valid && in_row(v)) ? load_vector(row + v * kVector) : make_uint4(0, 0, 0, 0);
      }
    }
  };
  ValueChunk values;
  ValueChunk next_values;  // double-buffered layouts only
  if constexpr (Config::kPrefetchValues) {
    if (warp < value_chunks) load_value_chunk(warp, values);
  }

  // 3. Softmax over the partition, per head.
#pragma unroll
  for (int h = 0; h < Heads; ++h) {
    const float maximum = warp_max(running_max[h]);
    if (lane == 0) warp_maxima[warp][h] = maximum;
  }
  __syncthreads();  // logits and warp maxima ready
  float max_logit[Heads];
#pragma unroll
  for (int h = 0; h < Heads; ++h) {
    max_logit[h] = warp_maxima[0][h];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) max_logit[h] = fmaxf(max_logit[h], warp_maxima[w][h]);
  }
  float exp_sum[Heads];
#pragma unroll
  for (int h = 0; h < Heads; ++h) exp_sum[h] = 0.0f;
  for (int token = tid; token < num_tokens; token += kThreads) {
    float row[Heads];
    load_row<Heads>(logits + token * Heads, row);
#pragma unroll
    for (int h = 0; h < Heads; ++h) {
      row[h] = exp2f(row[h] - max_logit[h]);
      exp_sum[h] += row[h];
    }
    store_row<Heads>(logits + token * Heads, row);
  }
#pragma unroll
  for (int h = 0; h < Heads; ++h) {
    const float sum = warp_sum(exp_sum[h]);
    if (lane == 0) warp_sums[warp][h] = sum;
  }
  __syncthreads();  // probabilities and warp sums ready
#pragma unroll
  for (int h = 0; h < Heads; ++h) {
    exp_sum[h] = warp_sums[0][h];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) exp_sum[h] += warp_sums[w][h];
  }

  // 4b. Value pass: acc[h][slice] = sum_token p[token][h] * v_token[slice].
  float acc[Heads][kValueVectors][kVector];
#pragma unroll
  for (int h = 0; h < Heads; ++h) {
#pragma unroll
    for (int j = 0; j < kValueVectors; ++j) {
#pragma unroll
      for (int e = 0; e < kVector; ++e) acc[h][j][e] = 0.0f;
    }
  }
  for (int c = warp; c < value_chunks; c += kWarps) {
    const bool has_next = c + kWarps < value_chunks;
    if (!Config::kPrefetchValues || c != warp) {
      if (!Layout::kDoubleBuffered || c == warp) load_value_chunk(c, values);
    }
    if constexpr (Layout::kDoubleBuffered) {
      if (has_next) load_value_chunk(c + kWarps, next_values);
    }
    const int chunk_token = c * Layout::kValueTokensPerChunk + value_group;
#pragma unroll
    for (int u = 0; u < kValueUnroll; ++u) {
      const int token = chunk_token + u * Layout::kValueTokensPerStep;
      float probability[Heads];
      if (token < num_tokens) {
        load_row<Heads>(logits + token * Heads, probability);
      } else {
#pragma unroll
        for (int h = 0; h < Heads; ++h) probability[h] = 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kValueVectors; ++j) {
        float value[kVector];
        unpack<T>(values[u][j], value);
#pragma unroll
        for (int h = 0; h < Heads; ++h) {
#pragma unroll
          for (int e = 0; e < kVector; ++e) {
            acc[h][j][e] = fmaf(probability[h], value[e], acc[h][j][e]);
          }
        }
      }
    }
    if constexpr (Layout::kDoubleBuffered) {
      if (has_next) {
#pragma unroll
        for (int u = 0; u < kValueUnroll; ++u) {
#pragma unroll
          for (int j = 0; j < kValueVectors; ++j) values[u][j] = next_values[u][j];
        }
      }
    }
  }
  // Sum the lane groups of the warp that hold the same slice.
#pragma unroll
  for (int offset = kValueLanes; offset < kWarpSize; offset *= 2) {
#pragma unroll
    for (int h = 0; h < Heads; ++h) {
#pragma unroll
      for (int j = 0; j < kValueVectors; ++j) {
#pragma unroll
        for (int e = 0; e < kVector; ++e) {
          acc[h][j][e] += __shfl_xor_sync(kFullMask, acc[h][j][e], offset);
        }
      }
    }
  }
  if (tid == 0) {
#pragma unroll
    for (int h = 0; h < Heads; ++h) output_scale[h] = split ? 1.0f : 1.0f / exp_sum[h];
  }
  __syncthreads();  // every warp is done reading the probabilities: reuse `shared`
  // Warps go through kSlots slots of [Heads][HeadDimMax] floats in rounds of kSlots warps,
  // highest first: the first round stores, later rounds add.
  float* warp_outputs = shared;  // [kSlots][Heads][HeadDimMax]
#pragma unroll 1
  for (int base = kWarps - kSlots; base >= 0; base -= kSlots) {
    if (value_group == 0 && warp >= base && warp < base + kSlots) {
#pragma unroll
      for (int h = 0; h < Heads; ++h) {
#pragma unroll
        for (int j = 0; j < kValueVectors; ++j) {
          const int v = j * kValueLanes + value_lane;
          if (in_row(v)) {
            float* slot = warp_outputs + ((warp - base) * Heads + h) * HeadDimMax + v * kVector;
#pragma unroll
            for (int e = 0; e < kVector; ++e) {
              slot[e] = base == kWarps - kSlots ? acc[h][j][e] : slot[e] + acc[h][j][e];
            }
          }
        }
      }
    }
    __syncthreads();  // this round's warp outputs (and, after the last, the scales) ready
  }

  for (int i = tid; i < heads_here * head_dim; i += kThreads) {
    const int h = i / head_dim;
    const int d = i - h * head_dim;
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kSlots; ++w) total += warp_outputs[(w * Heads + h) * HeadDimMax + d];
    if (split) {
      params.partial_out[((first_row + h) * params.max_partitions + partition) * head_dim + d] =
          total;
    } else {
      out[i] = from_float<T>(total * output_scale[h]);
    }
  }
  if (split && tid == 0) {
#pragma unroll
    for (int h = 0; h < Heads; ++h) {
      if (h < heads_here) {
        const int64_t slot = (first_row + h) * params.max_partitions + partition;
        params.partial_max[slot] = max_logit[h];
        params.partial_sum[slot] = exp_sum[h];
      }
    }
  }
}

template <int Heads, int Variant, typename T>
void launch_for_heads(const PagedDecodeAttentionParams& params, dim3 grid, cudaStream_t stream) {
  constexpr int kThreads = DecodeConfig<Variant>::kThreads;
  const int head_dim = params.head_dim;
  if (head_dim == 64) {
    paged_decode_attention_kernel<T, 64, true, Heads, Variant>
        <<<grid, kThreads, 0, stream>>>(params);
  } else if (head_dim == 128) {
    paged_decode_attention_kernel<T, 128, true, Heads, Variant>
        <<<grid, kThreads, 0, stream>>>(params);
  } else if (head_dim < 64) {
    paged_decode_attention_kernel<T, 64, false, Heads, Variant>
        <<<grid, kThreads, 0, stream>>>(params);
  } else if (head_dim < 128) {
    paged_decode_attention_kernel<T, 128, false, Heads, Variant>
        <<<grid, kThreads, 0, stream>>>(params);
  } else {
    paged_decode_attention_kernel<T, 256, false, Heads, Variant>
        <<<grid, kThreads, 0, stream>>>(params);
  }
}

template <int Variant, typename T>
void launch_for_variant(const PagedDecodeAttentionParams& params, int heads, dim3 grid,
                        cudaStream_t stream) {
  if constexpr (DecodeConfig<Variant>::kTensorCores) {
    if (launch_tensor_core_decode<T, DecodeConfig<Variant>>(params, stream)) return;
  }
  switch (heads) {
    case 1:
      launch_for_heads<1, Variant, T>(params, grid, stream);
      break;
    case 2:
      launch_for_heads<2, Variant, T>(params, grid, stream);
      break;
    case 4:
      launch_for_heads<4, Variant, T>(params, grid, stream);
      break;
    default:
      launch_for_heads<8, Variant, T>(params, grid, stream);
      break;
  }
}

// Launches kDecodeVariants[variant], found by walking the indices down from Variant.
template <int Variant, typename T>
void launch_variant(const PagedDecodeAttentionParams& params, int variant, int heads, dim3 grid,
                    cudaStream_t stream) {
  if (variant == Variant) {
    launch_for_variant<Variant, T>(params, heads, grid, stream);
  } else if constexpr (Variant > 0) {
    launch_variant<Variant - 1, T>(params, variant, heads, grid, stream);
  }
}

// Query heads one block serves: the GQA group size rounded up to a power of two, at most 8.
inline int heads_per_block(int group) {
  if (group <= 1) return 1;
  if (group <= 2) return 2;
  if (group <= 4) return 4;
  return 8;
}

// launch_paged_decode_attention for element type T.
template <typename T>
void launch_for_type(const PagedDecodeAttentionParams& params, int variant, cudaStream_t stream) {
  const int group = params.num_heads / params.num_kv_heads;
  const int heads = heads_per_block(group);
  const int head_chunks = (group + heads - 1) / heads;
  const dim3 grid(params.num_seqs, params.num_kv_heads * head_chunks, params.max_partitions);
  launch_variant<kDecodeVariantCount - 1, T>(params, variant, heads, grid, stream);
}

}  // namespace

// launch_paged_decode_attention for one element type each, compiled in a file of its own
// (paged_decode_attention_<type>.cu) so the instantiations build in parallel.
void launch_paged_decode_attention_float32(const PagedDecodeAttentionParams& params,
                                           int variant, cudaStream_t stream);
void launch_paged_decode_attention_float16(const PagedDecodeAttentionParams& params,
                                           int variant, cudaStream_t stream);
void launch_paged_decode_attention_bfloat16(const PagedDecodeAttentionParams& params,
                                            int variant, cudaStream_t stream);

}  // namespace neo_cuda
