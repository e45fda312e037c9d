// Paged decode attention on tensor cores, for float16 and bfloat16 caches with head_dim 64 or
// 128 (the launcher falls back to the CUDA-core kernel of paged_decode_attention.cuh otherwise).
//
// Work is cut into items: up to kMmaHeads query heads of one KV group (a KV head's head chunk)
// attended to one partition of KV tokens. Grid: (sequence, group of items, partition); a block
// of W warps serves W / warps_per_item items of one sequence and partition, and shares their
// block-table entries. The warps of an item take tiles of kMmaTileTokens tokens in turn, each
// with its own online softmax (flash-decoding within the item), so no barrier separates the K
// loads from the V loads; they merge their partial outputs at the end through shared memory.
// With one warp per item nothing is merged across warps: the warp writes its heads' outputs
// straight from its accumulators, and a block's fixed costs (the sequence's length, its table,
// the barrier) are spread over W items: that is what short contexts need. A block issues the
// loads of its table entries and query rows together with the sequence's length, so the start
// waits for one load, not three in turn. The launcher picks warps_per_item from how many items
// a partition has (choose_warps_per_item), so that small batches still fill the GPU. A
// sequence's last partition also attends its tail of up to partition_slack (a quarter
// partition) tokens, so a sequence just past a partition boundary is not split.
//
// Both products are warp-wide mma.sync m16n8k16 with float32 accumulators:
//
//   scores  S [head x token] = Q [head x dim] . K^T [dim x token]   (rows 8..15 of Q are zero)
//   output  O^T [dim x head] = V^T [dim x token] . P^T [token x head]
//
// The sum over dims (and over tokens) does not depend on the order of its terms, so each lane
// reads whole 16-byte vectors and the kernel assigns their elements to the fragments' k slots:
// a lane's 16 bytes of a K row (8 dims) are the k slots {2c, 2c+1, 2c+8, 2c+9} (c = lane % 4)
// of two consecutive MMAs, and its query vector of the same dims fills the same slots of Q.
// The scores' accumulator fragment (head row, tokens 2c and 2c+1 of each 8-token half) is,
// element for element, the B fragment of P^T, so probabilities never leave the registers. V^T's
// A fragment wants pairs of tokens per dim: a lane loads HeadDim / 8 consecutive dims of four
// tokens and pairs them with byte permutes; the output rows (dims) come out in that lane order
// and are put back in place when the warp's result is written to shared memory.
//
// Probabilities are split into a T part and the T-rounded remainder, each multiplied by V, so
// the value product keeps float32's precision (two MMAs instead of one, where the instruction
// count is not what bounds the kernel). Logits are in the log2 domain, as the merge of split
// sequences expects.
#pragma once

#include "paged_decode_attention_common.cuh"

namespace neo_cuda {
namespace {

// Query heads a tensor-core block serves: the n dimension of the value product.
constexpr int kMmaHeads = 8;
// Tokens a warp attends per step: two n-halves of the score product, the k of the value one.
constexpr int kMmaTileTokens = 16;
// choose_warps_per_item's bars, in sixteenths of a full wave of resident warps: the share the
// grid's warps must exceed at one warp per item, and at two, before that many are used.
constexpr int kOneWarpWaveShare = 9;
constexpr int kTwoWarpsWaveShare = 6;
constexpr int kWaveShareDenominator = 16;

__device__ __forceinline__ uint16_t element_bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ uint16_t element_bits(__half x) { return __half_as_ushort(x); }

// Two floats rounded to T and packed, `low` in the lower half (the lower k or n index).
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float low, float high) {
  return static_cast<uint32_t>(element_bits(from_float<T>(low))) |
         (static_cast<uint32_t>(element_bits(from_float<T>(high))) << 16);
}

// The 16-bit elements `element` (0..7) of `first` and of `second`, packed (first's lower).
__device__ __forceinline__ uint32_t pair_elements(const uint4& first, const uint4& second,
                                                  int element) {
  const uint32_t words_first[4] = {first.x, first.y, first.z, first.w};
  const uint32_t words_second[4] = {second.x, second.y, second.z, second.w};
  const uint32_t a = words_first[element / 2];
  const uint32_t b = words_second[element / 2];
  return element % 2 == 0 ? __byte_perm(a, b, 0x5410) : __byte_perm(a, b, 0x7632);
}

// c += A . B for one m16n8k16 tile: A in a0..a3 (rows g / g+8, k slots 2c.. / 2c+8..), B in
// b0, b1 (k slots 2c.., 2c+8.., column g), c as (g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1).
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, __half>, "tensor-core decode takes float16 or bfloat16");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// One warp's online softmax over tiles of one KV head: the running max of head `row` (the same
// in the row group's four lanes), this lane's share of that head's sum, and the O^T accumulators
// per dim tile: (dim row, head 2 quad), (row, 2 quad + 1), (row + 8, 2 quad), (row + 8,
// 2 quad + 1), where dim tile i's row r is dim HeadDim / 8 * r + i and row r + 8 is dim
// HeadDim / 8 * r + HeadDim / 16 + i.
template <int HeadDim>
struct WarpSoftmax {
  static constexpr int kDimTiles = HeadDim / 16;
  float running_max = -INFINITY;
  float running_sum = 0.0f;
  float acc[kDimTiles][4] = {};
};

// A lane's share of one tile's K and V rows: K rows of tokens base + row and base + 8 + row
// (this lane's 8 dims of each 32-dim slice, kKeyVectors vectors per row, index half *
// kKeyVectors + i), V rows of tokens base + 2 quad + {0, 1, 8, 9} (dims [HeadDim / 8 row, +
// HeadDim / 8), kValueVectors vectors per row, index t * kValueVectors + j). Tokens from
// `num_tokens` on read as zeros.
template <int HeadDim>
struct TileShape {
  static constexpr int kKeyVectors = HeadDim / 32;
  static constexpr int kValueElements = HeadDim / 8;
  static constexpr int kValueVectors = kValueElements / 8;
  static constexpr int kKeyTotal = 2 * kKeyVectors;
  static constexpr int kValueTotal = 4 * kValueVectors;
};

// Issues the loads of tile `base`'s K rows; k_cache points at this KV head's rows of block 0.
template <typename T, int HeadDim>
__device__ __forceinline__ void load_tile_keys(uint4 (&keys)[TileShape<HeadDim>::kKeyTotal],
                                               const T* k_cache, const RowAddressing& row_of,
                                               int base, int num_tokens, int row, int quad) {
  using Shape = TileShape<HeadDim>;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int token = base + 8 * half + row;
    const bool valid = token < num_tokens;
    const T* key_row = k_cache + (valid ? row_of(token) : 0) + 8 * quad;
#pragma unroll
    for (int i = 0; i < Shape::kKeyVectors; ++i) {
      keys[half * Shape::kKeyVectors + i] =
          valid ? load_vector(key_row + 32 * i) : make_uint4(0, 0, 0, 0);
    }
  }
}

// Issues the loads of tile `base`'s V rows; v_cache points at this KV head's rows of block 0.
template <typename T, int HeadDim>
__device__ __forceinline__ void load_tile_values(uint4 (&values)[TileShape<HeadDim>::kValueTotal],
                                                 const T* v_cache, const RowAddressing& row_of,
                                                 int base, int num_tokens, int row, int quad) {
  using Shape = TileShape<HeadDim>;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int token = base + 2 * quad + (t % 2) + 8 * (t / 2);
    const bool valid = token < num_tokens;
    const T* value_row = v_cache + (valid ? row_of(token) : 0) + Shape::kValueElements * row;
#pragma unroll
    for (int j = 0; j < Shape::kValueVectors; ++j) {
      values[t * Shape::kValueVectors + j] =
          valid ? load_vector(value_row + 8 * j) : make_uint4(0, 0, 0, 0);
    }
  }
}

// P^T's B fragment of one tile (k = tokens, n = head `row`): the probabilities as T and as the
// T-rounded remainder, each for tokens 2 quad + {0, 1} and 8 + 2 quad + {0, 1}.
struct TileProbabilities {
  uint32_t high_first, high_second, low_first, low_second;
};

// The scores of tile `base` (K rows in `keys`, tokens from `num_tokens` on masked) for the
// query rows `query` (kMmaHeads rows of HeadDim / 8 vectors and one of padding, zero past the
// heads served), folded into the warp's online softmax: returns the tile's probabilities and
// rescales the accumulators to the new running max.
template <typename T, int HeadDim>
__device__ __forceinline__ TileProbabilities tile_probabilities(
    WarpSoftmax<HeadDim>& state, const uint4 (*query)[HeadDim / 8 + 1],
    const uint4 (&keys)[TileShape<HeadDim>::kKeyTotal], int base, int num_tokens, float scale,
    int row, int quad) {
  constexpr int kKeyVectors = TileShape<HeadDim>::kKeyVectors;
  constexpr int kDimTiles = HeadDim / 16;

  // Scores of head `row` for tokens base + 8 half + 2 quad + {0, 1}.
  float scores[2][4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int e = 0; e < 4; ++e) scores[half][e] = 0.0f;
#pragma unroll
    for (int i = 0; i < kKeyVectors; ++i) {
      // Q's A fragment: head `row`, the 8 dims at 32 i + 8 quad.
      const uint4 q = query[row][4 * i + quad];
      const uint4& k = keys[half * kKeyVectors + i];
      mma_m16n8k16<T>(scores[half], q.x, 0u, q.y, 0u, k.x, k.y);
      mma_m16n8k16<T>(scores[half], q.z, 0u, q.w, 0u, k.z, k.w);
    }
  }
  float logits[4];
  float tile_max = -INFINITY;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int token = base + 8 * (k / 2) + 2 * quad + (k % 2);
    logits[k] = token < num_tokens ? scores[k / 2][k % 2] * scale : -INFINITY;
    tile_max = fmaxf(tile_max, logits[k]);
  }
  tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
  const float new_max = fmaxf(state.running_max, tile_max);
  const float reference = new_max == -INFINITY ? 0.0f : new_max;
  const float rescale = exp2f(state.running_max - reference);
  float probabilities[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) probabilities[k] = exp2f(logits[k] - reference);
  state.running_sum = state.running_sum * rescale + (probabilities[0] + probabilities[1]) +
                      (probabilities[2] + probabilities[3]);
  state.running_max = new_max;

  // The accumulators hold heads 2 quad and 2 quad + 1, whose factors row groups 2 quad and
  // 2 quad + 1 computed.
  const float rescale_even = __shfl_sync(kFullMask, rescale, 8 * quad);
  const float rescale_odd = __shfl_sync(kFullMask, rescale, 8 * quad + 4);
#pragma unroll
  for (int i = 0; i < kDimTiles; ++i) {
    state.acc[i][0] *= rescale_even;
    state.acc[i][1] *= rescale_odd;
    state.acc[i][2] *= rescale_even;
    state.acc[i][3] *= rescale_odd;
  }

  TileProbabilities fragment;
  fragment.high_first = pack_pair<T>(probabilities[0], probabilities[1]);
  fragment.high_second = pack_pair<T>(probabilities[2], probabilities[3]);
  fragment.low_first = pack_pair<T>(probabilities[0] - round_to<T>(probabilities[0]),
                                    probabilities[1] - round_to<T>(probabilities[1]));
  fragment.low_second = pack_pair<T>(probabilities[2] - round_to<T>(probabilities[2]),
                                     probabilities[3] - round_to<T>(probabilities[3]));
  return fragment;
}

// O^T += V^T . P^T for one tile, V rows in `values` (TileShape's order).
template <typename T, int HeadDim>
__device__ __forceinline__ void accumulate_tile_values(
    WarpSoftmax<HeadDim>& state, const uint4 (&values)[TileShape<HeadDim>::kValueTotal],
    const TileProbabilities& p) {
  constexpr int kValueVectors = TileShape<HeadDim>::kValueVectors;
  constexpr int kDimTiles = HeadDim / 16;
  // Token t's vector j (t: 2 quad + {0, 1}, then 8 + 2 quad + {0, 1}).
  const auto value = [&](int t, int j) -> const uint4& { return values[t * kValueVectors + j]; };
#pragma unroll
  for (int i = 0; i < kDimTiles; ++i) {
    const int upper = kDimTiles + i;  // slice element of dim row row + 8
    const uint32_t a0 = pair_elements(value(0, i / 8), value(1, i / 8), i % 8);
    const uint32_t a1 = pair_elements(value(0, upper / 8), value(1, upper / 8), upper % 8);
    const uint32_t a2 = pair_elements(value(2, i / 8), value(3, i / 8), i % 8);
    const uint32_t a3 = pair_elements(value(2, upper / 8), value(3, upper / 8), upper % 8);
    mma_m16n8k16<T>(state.acc[i], a0, a1, a2, a3, p.high_first, p.high_second);
    mma_m16n8k16<T>(state.acc[i], a0, a1, a2, a3, p.low_first, p.low_second);
  }
}

// Attends an item's tiles member, member + Stride, ... (of `num_tokens` partition tokens) into
// `state`, each tile's K and V loaded into registers at its start. k_cache and v_cache point at
// this KV head's rows of block 0.
template <typename T, int HeadDim, int Stride>
__device__ __forceinline__ void attend_tiles(WarpSoftmax<HeadDim>& state,
                                             const uint4 (*query)[HeadDim / 8 + 1],
                                             const T* k_cache, const T* v_cache,
                                             const RowAddressing& row_of, int member,
                                             int num_tokens, float scale, int lane) {
  using Shape = TileShape<HeadDim>;
  const int row = lane / 4;
  const int quad = lane % 4;
  const int tiles = (num_tokens + kMmaTileTokens - 1) / kMmaTileTokens;
  uint4 keys[Shape::kKeyTotal];
  uint4 values[Shape::kValueTotal];
  for (int tile = member; tile < tiles; tile += Stride) {
    const int base = tile * kMmaTileTokens;
    load_tile_keys<T, HeadDim>(keys, k_cache, row_of, base, num_tokens, row, quad);
    load_tile_values<T, HeadDim>(values, v_cache, row_of, base, num_tokens, row, quad);
    const TileProbabilities p =
        tile_probabilities<T, HeadDim>(state, query, keys, base, num_tokens, scale, row, quad);
    accumulate_tile_values<T, HeadDim>(state, values, p);
  }
}

// A warp's softmax state in shared memory, dims back in place: per head its max and sum, and
// its unnormalized output [kMmaHeads][HeadDim].
template <int HeadDim>
struct WarpResult {
  float maximum[kMmaHeads];
  float sum[kMmaHeads];
  float output[kMmaHeads][HeadDim];
};

// Writes the warp's state into `result` for the merge of an item's warps; every lane of the warp
// takes part.
template <int HeadDim>
__device__ __forceinline__ void store_warp_result(const WarpSoftmax<HeadDim>& state,
                                                  WarpResult<HeadDim>& result, int row,
                                                  int quad) {
  constexpr int kValueElements = HeadDim / 8;
  constexpr int kDimTiles = HeadDim / 16;
  float sum = state.running_sum;
  sum += __shfl_xor_sync(kFullMask, sum, 1);
  sum += __shfl_xor_sync(kFullMask, sum, 2);
  if (quad == 0) {
    result.maximum[row] = state.running_max;
    result.sum[row] = sum;
  }
#pragma unroll
  for (int i = 0; i < kDimTiles; ++i) {
    const int dim = kValueElements * row + i;
    result.output[2 * quad][dim] = state.acc[i][0];
    result.output[2 * quad + 1][dim] = state.acc[i][1];
    result.output[2 * quad][dim + kDimTiles] = state.acc[i][2];
    result.output[2 * quad + 1][dim + kDimTiles] = state.acc[i][3];
  }
}

// Writes a warp's result straight from its registers, for an item served by one warp: heads
// first_row + 2 quad and + 2 quad + 1 (those below `heads_here`), dims [kValueElements row, +
// kDimTiles) and [kValueElements row + kDimTiles, + kDimTiles), normalized into `out`, or, for a
// split sequence, unnormalized into the partial buffers of `partition` with the heads' max and
// sum (written by row group 0). Every lane of the warp takes part.
template <typename T, int HeadDim>
__device__ __forceinline__ void write_warp_output(const WarpSoftmax<HeadDim>& state,
                                                  int heads_here, bool split,
                                                  const PagedDecodeAttentionParams& params,
                                                  int64_t first_row, int partition, int row,
                                                  int quad) {
  constexpr int kValueElements = HeadDim / 8;
  constexpr int kDimTiles = HeadDim / 16;
  float sum = state.running_sum;  // this lane's share of head `row`'s sum
  sum += __shfl_xor_sync(kFullMask, sum, 1);
  sum += __shfl_xor_sync(kFullMask, sum, 2);
#pragma unroll
  for (int parity = 0; parity < 2; ++parity) {
    const int h = 2 * quad + parity;
    const int source = 4 * h;  // a lane of row group h, which holds head h's max and sum
    const float head_sum = __shfl_sync(kFullMask, sum, source);
    const float head_max = __shfl_sync(kFullMask, state.running_max, source);
    if (h >= heads_here) continue;
    const float factor = split ? 1.0f : 1.0f / head_sum;
    float low[kDimTiles];
    float high[kDimTiles];
#pragma unroll
    for (int i = 0; i < kDimTiles; ++i) {
      low[i] = state.acc[i][parity] * factor;
      high[i] = state.acc[i][2 + parity] * factor;
    }
    const int dim = kValueElements * row;
    if (split) {
      const int64_t slot = (first_row + h) * params.max_partitions + partition;
      float* partial = params.partial_out + slot * HeadDim + dim;
      store_floats<float, kDimTiles, kDimTiles % kVectorElements<float> == 0>(partial, low);
      store_floats<float, kDimTiles, kDimTiles % kVectorElements<float> == 0>(partial + kDimTiles,
                                                                             high);
      if (row == 0) {
        params.partial_max[slot] = head_max;
        params.partial_sum[slot] = head_sum;
      }
    } else {
      T* out = static_cast<T*>(params.out) + (first_row + h) * HeadDim + dim;
      store_floats<T, kDimTiles, kDimTiles % kVectorElements<T> == 0>(out, low);
      store_floats<T, kDimTiles, kDimTiles % kVectorElements<T> == 0>(out + kDimTiles, high);
    }
  }
}

// The log-sum-exp merge of `Results` warp results, per head and dim, by `threads` threads
// (this one is `thread`): normalized into `out` (the first served head's row), or, for a split
// sequence, unnormalized into the partial buffers of `partition`.
template <typename T, int HeadDim, int Results>
__device__ __forceinline__ void merge_warp_results(const WarpResult<HeadDim>* results,
                                                   int heads_here, int thread, int threads,
                                                   bool split,
                                                   const PagedDecodeAttentionParams& params,
                                                   int64_t first_row, int partition) {
  T* out = static_cast<T*>(params.out) + first_row * HeadDim;
  for (int i = thread; i < heads_here * HeadDim; i += threads) {
    const int h = i / HeadDim;
    const int d = i % HeadDim;
    float maximum = -INFINITY;
#pragma unroll
    for (int w = 0; w < Results; ++w) maximum = fmaxf(maximum, results[w].maximum[h]);
    float total = 0.0f;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < Results; ++w) {
      const float weight = exp2f(results[w].maximum[h] - maximum);
      total = fmaf(weight, results[w].output[h][d], total);
      sum = fmaf(weight, results[w].sum[h], sum);
    }
    if (split) {
      const int64_t slot = (first_row + h) * params.max_partitions + partition;
      params.partial_out[slot * HeadDim + d] = total;
      if (d == 0) {
        params.partial_max[slot] = maximum;
        params.partial_sum[slot] = sum;
      }
    } else {
      out[i] = from_float<T>(total / sum);
    }
  }
}

// T: float16 or bfloat16; HeadDim: 64 or 128; Warps per block, PartitionSize tokens,
// MinBlocksPerSm resident blocks (the register budget) and WarpsPerItem (1, 2 or Warps).
//
// A block serves Warps / WarpsPerItem "items", each a KV head's chunk of up to kMmaHeads query
// heads (chunk c of a sequence is KV head c / head_chunks): the WarpsPerItem warps of an item
// deal its partition's tiles round robin and merge their results.
template <typename T, int HeadDim, int Warps, int PartitionSize, int MinBlocksPerSm,
          int WarpsPerItem>
__global__ void __launch_bounds__(Warps * kWarpSize, MinBlocksPerSm)
    paged_decode_attention_mma_kernel(const PagedDecodeAttentionParams params) {
  constexpr int kThreads = Warps * kWarpSize;
  constexpr int kItemsPerBlock = Warps / WarpsPerItem;
  constexpr int kRowVectors = HeadDim / 8;  // 16-byte vectors of a row
  static_assert(HeadDim == 64 || HeadDim == 128, "tensor-core decode takes head_dim 64 or 128");
  static_assert(PartitionSize % kMmaTileTokens == 0, "a partition holds whole tiles");
  static_assert(Warps % WarpsPerItem == 0, "a block holds whole items");

  // A sequence's last partition may hold up to a quarter partition more (partition_slack).
  constexpr int kMaxPartitionTokens = PartitionSize + PartitionSize / 4;
  constexpr int kMaxEntries = kMaxPartitionTokens / kMinBlockSize;
  __shared__ int64_t block_offsets[kMaxEntries];
  // Query rows per item; one vector of padding per row, so the row groups of a warp read
  // different banks.
  __shared__ uint4 query[kItemsPerBlock][kMmaHeads][kRowVectors + 1];
  __shared__ WarpResult<HeadDim> results[Warps];

  allow_dependent_launch();
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int row = lane / 4;   // fragment row group: a query head, a key token, a V dim slice
  const int quad = lane % 4;  // lane within the row group

  const int seq = blockIdx.x;
  const int partition = blockIdx.z;
  const int group = params.num_heads / params.num_kv_heads;
  const int head_chunks = (group + kMmaHeads - 1) / kMmaHeads;
  const int first_item = blockIdx.y * kItemsPerBlock;
  const int items_here = min(kItemsPerBlock, params.num_kv_heads * head_chunks - first_item);
  const int64_t seq_row = static_cast<int64_t>(seq) * params.num_heads;
  // Item i of this block: its first query head and how many it serves.
  const auto item_first_head = [&](int i) {
    const int chunk = first_item + i;
    return chunk / head_chunks * group + chunk % head_chunks * kMmaHeads;
  };
  const auto item_heads = [&](int i) {
    return min(kMmaHeads, group - (first_item + i) % head_chunks * kMmaHeads);
  };

  const int start = partition * PartitionSize;
  const int block_size = params.block_size;
  const int block_shift = __ffs(block_size) - 1;
  const int* table_row = params.block_table +
                         static_cast<int64_t>(seq) * params.block_table_stride +
                         (start >> block_shift);
  const int64_t block_stride = static_cast<int64_t>(params.num_kv_heads) * block_size * HeadDim;
  constexpr int kEntriesPerThread = (kMaxEntries + kThreads - 1) / kThreads;
  constexpr int kQueryVectors = kItemsPerBlock * kMmaHeads * kRowVectors;
  constexpr int kQueryVectorsPerThread = (kQueryVectors + kThreads - 1) / kThreads;
  const int seq_len = params.seq_lens[seq];
  const int partitions = decode_partitions(seq_len, params);
  // A block past its sequence's partitions leaves before it loads anything else: a CUDA graph's
  // table spans the context it was captured for, so most of its grid may be such blocks, and
  // their table and query loads would take L2 bandwidth from the blocks that work. Blocks of the
  // first partition, which always work, issue those loads before seq_len is needed, so their
  // latencies overlap; a later partition's block issues them once it has seq_len. The loads:
  // every block-table entry the partition can use that the table holds (those past seq_len, or
  // past the partition when it is not the sequence's last, go unread), and the items' query
  // rows (zero past the heads an item serves), a few of each a thread.
  if (partition > 0 && partition >= partitions) return;
  const int entries =
      min(kMaxPartitionTokens >> block_shift, params.max_blocks_per_seq - (start >> block_shift));
  int entry[kEntriesPerThread];
#pragma unroll
  for (int k = 0; k < kEntriesPerThread; ++k) {
    entry[k] = tid + k * kThreads < entries ? table_row[tid + k * kThreads] : 0;
  }
  uint4 query_vectors[kQueryVectorsPerThread];
#pragma unroll
  for (int k = 0; k < kQueryVectorsPerThread; ++k) {
    const int i = tid + k * kThreads;
    const int item = i / (kMmaHeads * kRowVectors);
    const int h = i / kRowVectors % kMmaHeads;
    const int v = i % kRowVectors;
    query_vectors[k] = make_uint4(0, 0, 0, 0);
    if (i < kQueryVectors && item < items_here && h < item_heads(item)) {
      query_vectors[k] = load_vector(static_cast<const T*>(params.q) +
                                     (seq_row + item_first_head(item) + h) * HeadDim + 8 * v);
    }
  }
  if (seq_len <= 0) {  // the first partition of an empty sequence: its output is zeros
    for (int i = 0; i < items_here; ++i) {
      T* out = static_cast<T*>(params.out) + (seq_row + item_first_head(i)) * HeadDim;
      for (int e = tid; e < item_heads(i) * HeadDim; e += kThreads) out[e] = from_float<T>(0.0f);
    }
    return;
  }
  // The last partition also takes the sequence's tail past it (up to partition_slack tokens).
  const int num_tokens = partition == partitions - 1 ? seq_len - start : PartitionSize;
  const bool split = partitions > 1;

  // The table entries as element offsets of their blocks, and the query rows, read back per
  // tile as Q's A fragment.
#pragma unroll
  for (int k = 0; k < kEntriesPerThread; ++k) {
    if (tid + k * kThreads < entries) block_offsets[tid + k * kThreads] = entry[k] * block_stride;
  }
#pragma unroll
  for (int k = 0; k < kQueryVectorsPerThread; ++k) {
    const int i = tid + k * kThreads;
    if (i < kQueryVectors) {
      query[i / (kMmaHeads * kRowVectors)][i / kRowVectors % kMmaHeads][i % kRowVectors] =
          query_vectors[k];
    }
  }
  RowAddressing row_of;
  row_of.block_offsets = block_offsets;
  row_of.block_shift = block_shift;
  row_of.offset_mask = block_size - 1;
  row_of.head_dim = HeadDim;
  __syncthreads();  // block_offsets and query ready

  const int item = warp / WarpsPerItem;
  const int member = warp % WarpsPerItem;  // this warp's place among its item's warps
  const bool active = item < items_here;   // false for the spare warps of a block's last item
  if (active) {
    const int64_t head_offset =
        static_cast<int64_t>((first_item + item) / head_chunks) * block_size * HeadDim;
    const T* k_cache = static_cast<const T*>(params.k_cache) + head_offset;
    const T* v_cache = static_cast<const T*>(params.v_cache) + head_offset;
    const float scale = params.scale * kLog2e;
    WarpSoftmax<HeadDim> state;
    attend_tiles<T, HeadDim, WarpsPerItem>(state, query[item], k_cache, v_cache, row_of, member,
                                           num_tokens, scale, lane);
    if constexpr (WarpsPerItem == 1) {
      write_warp_output<T, HeadDim>(state, item_heads(item), split, params,
                                    seq_row + item_first_head(item), partition, row, quad);
      return;
    }
    store_warp_result(state, results[warp], row, quad);
  }
  if constexpr (WarpsPerItem > 1) {
    __syncthreads();  // the item's warps' results ready
  }
  if (active) {
    merge_warp_results<T, HeadDim, WarpsPerItem>(
        results + item * WarpsPerItem, item_heads(item), member * kWarpSize + lane,
        WarpsPerItem * kWarpSize, split, params, seq_row + item_first_head(item), partition);
  }
}

// Warps per item for a grid of `items` (sequence, head chunk) pairs per partition: the
// variant's warps_per_item, or, where that is 0, one where the items' warps exceed
// kOneWarpWaveShare sixteenths of a full wave of resident warps on the device, else two where
// their warps at two exceed kTwoWarpsWaveShare sixteenths, else the block's warps. One warp per item leaves out the merge across warps and spreads a block's fixed
// costs over more items, but a grid with few items then fills only part of the GPU; more warps
// per item deal a partition's tiles among them. Four warps per item also put a grid of about
// 64 sequences of 8 KV heads right at one full wave, where a single longer sequence spills its
// blocks into a second one; two warps keep it at half a wave (benchmarks/cuda_kernels.py
// --sweep over the _i1, _i2 and _i4 variants shows where each count leads).
template <typename Config>
int choose_warps_per_item(int64_t items) {
  if constexpr (Config::kWarpsPerItem != 0) {
    return Config::kWarpsPerItem;
  } else {
    int device = 0;
    int multiprocessors = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
    const int64_t wave = static_cast<int64_t>(multiprocessors) * Config::kMinBlocksPerSm *
                         Config::kWarps;
    if (items * kWaveShareDenominator > wave * kOneWarpWaveShare) return 1;
    if (Config::kWarps > 2 && items * 2 * kWaveShareDenominator > wave * kTwoWarpsWaveShare) {
      return 2;
    }
    return Config::kWarps;
  }
}

// The kernel for one head_dim and warps per item; false where head_dim is not 64 or 128.
template <typename T, typename Config, int WarpsPerItem>
bool launch_mma_kernel(const PagedDecodeAttentionParams& params, int items_per_seq,
                       cudaStream_t stream) {
  constexpr int kItemsPerBlock = Config::kWarps / WarpsPerItem;
  const dim3 grid(params.num_seqs, (items_per_seq + kItemsPerBlock - 1) / kItemsPerBlock,
                  params.max_partitions);
  const auto launch = [&](auto kernel) {
    kernel<<<grid, Config::kThreads, 0, stream>>>(params);
    return true;
  };
  constexpr int kWarps = Config::kWarps;
  constexpr int kPartition = Config::kPartitionSize;
  constexpr int kResident = Config::kMinBlocksPerSm;
  if (params.head_dim == 64) {
    return launch(paged_decode_attention_mma_kernel<T, 64, kWarps, kPartition, kResident,
                                                    WarpsPerItem>);
  }
  if (params.head_dim == 128) {
    return launch(paged_decode_attention_mma_kernel<T, 128, kWarps, kPartition, kResident,
                                                    WarpsPerItem>);
  }
  return false;
}

// Launches the tensor-core kernel with Config for the parameters' head_dim; false (nothing
// launched) where it does not apply: a float32 cache or a head_dim other than 64 and 128 (the
// cases decode_uses_tensor_cores in launchers.h rules out, which sets the partition slack).
template <typename T, typename Config>
bool launch_tensor_core_decode(const PagedDecodeAttentionParams& params, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, float>) {
    return false;
  } else {
    const int group = params.num_heads / params.num_kv_heads;
    const int items_per_seq = params.num_kv_heads * ((group + kMmaHeads - 1) / kMmaHeads);
    const int warps_per_item =
        choose_warps_per_item<Config>(static_cast<int64_t>(params.num_seqs) * items_per_seq);
    if (warps_per_item == 1) return launch_mma_kernel<T, Config, 1>(params, items_per_seq, stream);
    if constexpr (Config::kWarps > 2) {
      if (warps_per_item == 2) {
        return launch_mma_kernel<T, Config, 2>(params, items_per_seq, stream);
      }
    }
    return launch_mma_kernel<T, Config, Config::kWarps>(params, items_per_seq, stream);
  }
}

}  // namespace
}  // namespace neo_cuda
