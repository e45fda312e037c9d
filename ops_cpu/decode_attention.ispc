// Paged decode attention kernels: one query token per sequence against its paged K/V cache.
//
// Exported per storage type (f32, f16, bf16):
//   attend_chunk_<type>    a group of KV heads' query heads over a token range of one
//                          sequence, producing an unnormalized partial (accumulator, max, sum);
//   merge_partials_<type>  log-sum-exp merge of a row's partials into the output.
// The C++ driver (decode_attention.cpp) splits the work over threads and calls these.
//
// A chunk is walked in tiles of whole blocks (up to TILE_BYTES of K and V), and each tile over
// the KV heads (attention_tile.isph). The K/V rows of a sequence lie in scattered blocks, out of
// the hardware prefetcher's reach, so the kernel prefetches every row one tile ahead of the one
// it computes on (into L2), across the end of the chunk into the chunk its thread runs next,
// and the rows it is about to read from L2 into L1.

#include "attention_elements.isph"

// The two passes of the tile for bf16 with the CPU's bf16 dot-product instruction
// (tile_bf16_dot.cpp):
//   tile_scores_bf16_dot: scores[h * scores_stride + t] = scale * q_h . k_t for the tile's
//     tokens, with the tile's prefetches when prefetch_offsets is not NULL; query_words:
//     [heads, head_dim / 2] the stored bf16 query read as 32-bit words;
//   tile_values_bf16_dot: accumulator[h] = accumulator[h] * rescale[h] + sum_t p[h][t] v_t with
//     p = probabilities[h * probabilities_stride + t], already rounded to bf16.
extern "C" void tile_scores_bf16_dot(uniform int32 heads,
                                     uniform const unsigned int32 query_words[],
                                     uniform const uint16 key_cache[],
                                     uniform const uint16 value_cache[],
                                     uniform const int64 row_offsets[], uniform int32 num_tokens,
                                     uniform int32 head_dim, uniform float scale,
                                     uniform const int64 * uniform prefetch_offsets,
                                     uniform float scores[], uniform int32 scores_stride);
extern "C" void tile_values_bf16_dot(uniform int32 heads, uniform const float probabilities[],
                                     uniform int32 probabilities_stride,
                                     uniform const float rescale[],
                                     uniform const uint16 value_cache[],
                                     uniform const int64 row_offsets[], uniform int32 num_tokens,
                                     uniform int32 head_dim, uniform float accumulator[]);

// Bytes of K and V (over all KV heads) a tile spans at most: small enough that the tile being
// computed and the one being prefetched stay in the L2 cache.
#define TILE_BYTES 131072
#define MAX_TILE_TOKENS 128
#define MAX_SLICE_HEADS 8
#define CACHE_LINE_BYTES 64

#define JOIN_EXPANDED(a, b) a##b
#define JOIN(a, b) JOIN_EXPANDED(a, b)
#define TILE_FUNCTION_EXPANDED(suffix, heads) attend_tile_##suffix##_##heads
#define TILE_FUNCTION(suffix, heads) TILE_FUNCTION_EXPANDED(suffix, heads)

// The lanes of a with bit `width` of the lane index clear get a[l] + a[l ^ width]; the others
// get b[l] + b[l ^ width]: one step of a transposing reduction (a blend, a two-source shuffle and
// an add).
static inline float combine_lanes(float a, float b, uniform int width) {
    bool lower = (programIndex & width) == 0;
    int partner = lower ? programIndex + width : programIndex - width + programCount;
    return select(lower, a, b) + shuffle(a, b, partner);
}

// Given pair_sums[m] = combine_lanes(v[2m], v[2m + 1], 1) for programCount vectors v, returns
// the vector whose lane l is the sum of the lanes of v[l]. Overwrites `pair_sums`.
static inline float finish_lane_sums(float pair_sums[programCount / 2]) {
#pragma unroll
    for (uniform int width = 2; width < programCount; width *= 2) {
#pragma unroll
        for (uniform int k = 0; k < programCount / (2 * width); k++) {
            pair_sums[k] = combine_lanes(pair_sums[2 * k], pair_sums[2 * k + 1], width);
        }
    }
    return pair_sums[0];
}

// e^x for x <= 0 (scores minus their maximum), as 2^n * 2^f with f in [-1/2, 1/2] and 2^f from
// its degree-6 Taylor polynomial: absolute error below 2e-7, against softmax weights of at most
// 1. Below 2^-126 the result is 2^-126 (a weight no float sum can see); NaN stays NaN.
static inline float exp_nonpositive(float x) {
    float t = x * 1.44269504f;
    t = select(t < -126.0f, -126.0f, t);
    float n = round(t);
    float f = t - n;
    float p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    return p * floatbits(((int)n + 127) << 23);
}

// Online softmax step for one head over one tile: turns scores[0, num_tokens) into
// exp(score - new_max) (rounded to bf16 with `to_bfloat16`, before they are summed), updates
// running_max and running_sum, and returns the factor exp(old_max - new_max) that earlier
// accumulations must be multiplied by.
static inline uniform float softmax_tile(uniform float scores[], uniform int num_tokens,
                                         uniform bool to_bfloat16, uniform float &running_max,
                                         uniform float &running_sum) {
    float tile_max = NEGATIVE_INFINITY;
    foreach (t = 0 ... num_tokens) tile_max = max(tile_max, scores[t]);
    uniform float new_max = max(running_max, reduce_max(tile_max));
    float tile_sum = 0;
    foreach (t = 0 ... num_tokens) {
        float probability = exp_nonpositive(scores[t] - new_max);
        if (to_bfloat16) probability = floatbits(float_to_bfloat16(probability) << 16);
        scores[t] = probability;
        tile_sum += probability;
    }
    uniform float rescale = new_max == running_max ? 1.0f : exp(running_max - new_max);
    running_sum = running_sum * rescale + reduce_add(tile_sum);
    running_max = new_max;
    return rescale;
}

// The chunk a call works on: a token range of one sequence for a group of its KV heads, the
// group's first head given here and its size by the call.
struct ChunkRange {
    const int32 * block_ids;  // the sequence's row of the block table
    int32 kv_head_begin;
    int32 token_begin;
    int32 token_end;
};

// The cache's strides, in elements, and its block size.
struct CacheLayout {
    int64 block_stride;  // a block: all KV heads' rows
    int64 head_stride;   // one KV head's rows in a block
    int block_size_log2;
    int head_dim;
};

// Element offset of the K/V row of `token` of `range`, its first KV head, in the cache.
static inline uniform int64 row_offset(uniform const ChunkRange * uniform range,
                                       uniform const CacheLayout &layout, uniform int token) {
    uniform int64 block = range->block_ids[token >> layout.block_size_log2];
    uniform int offset_in_block = token & ((1 << layout.block_size_log2) - 1);
    return block * layout.block_stride + range->kv_head_begin * layout.head_stride
           + (uniform int64)offset_in_block * layout.head_dim;
}

// Row offset of position `position` of `chunk` continued by `next`: positions past the end of
// `chunk` continue at the start of `next` (the same head of `next`'s group as of `chunk`'s: every
// chunk of a call has as many heads). `fallback` past both.
static inline uniform int64 row_offset_ahead(uniform const ChunkRange * uniform chunk,
                                             uniform const ChunkRange * uniform next,
                                             uniform const CacheLayout &layout,
                                             uniform int position, uniform int64 fallback) {
    if (position < chunk->token_end) return row_offset(chunk, layout, position);
    uniform int token = next->token_begin + (position - chunk->token_end);
    if (token < next->token_end) return row_offset(next, layout, token);
    return fallback;
}

// Prefetches the K and V rows (row_bytes each) of two tokens into the L2 cache.
static inline void prefetch_rows(const void * uniform key_a, const void * uniform value_a,
                                 const void * uniform key_b, const void * uniform value_b,
                                 uniform int row_bytes) {
    uniform const int8 * uniform rows[4] = {
        (uniform const int8 * uniform)key_a, (uniform const int8 * uniform)value_a,
        (uniform const int8 * uniform)key_b, (uniform const int8 * uniform)value_b};
#pragma nounroll
    for (uniform int byte = 0; byte < row_bytes; byte += CACHE_LINE_BYTES) {
        for (uniform int row = 0; row < 4; row++) prefetch_l2(rows[row] + byte);
    }
}

// Prefetches four rows far ahead into the L2 cache and four rows about to be read into the L1
// cache (row_bytes each).
static inline void prefetch_pair(const void * uniform far_0, const void * uniform far_1,
                                 const void * uniform far_2, const void * uniform far_3,
                                 const void * uniform near_0, const void * uniform near_1,
                                 const void * uniform near_2, const void * uniform near_3,
                                 uniform int row_bytes) {
    uniform const int8 * uniform far[4] = {
        (uniform const int8 * uniform)far_0, (uniform const int8 * uniform)far_1,
        (uniform const int8 * uniform)far_2, (uniform const int8 * uniform)far_3};
    uniform const int8 * uniform near[4] = {
        (uniform const int8 * uniform)near_0, (uniform const int8 * uniform)near_1,
        (uniform const int8 * uniform)near_2, (uniform const int8 * uniform)near_3};
#pragma nounroll
    for (uniform int byte = 0; byte < row_bytes; byte += CACHE_LINE_BYTES) {
        for (uniform int row = 0; row < 4; row++) prefetch_l2(far[row] + byte);
        for (uniform int row = 0; row < 4; row++) prefetch_l1(near[row] + byte);
    }
}

#define ELEMENT float
#define STORAGE float
#define SUFFIX f32
#define BFLOAT16 0
#include "attention_chunk.isph"
#undef ELEMENT
#undef STORAGE
#undef SUFFIX
#undef BFLOAT16

#define ELEMENT float16
#define STORAGE uint16
#define SUFFIX f16
#define BFLOAT16 0
#include "attention_chunk.isph"
#undef ELEMENT
#undef STORAGE
#undef SUFFIX
#undef BFLOAT16

#define ELEMENT uint16
#define STORAGE uint16
#define SUFFIX bf16
#define BFLOAT16 1
#include "attention_chunk.isph"
#undef ELEMENT
#undef STORAGE
#undef SUFFIX
#undef BFLOAT16
