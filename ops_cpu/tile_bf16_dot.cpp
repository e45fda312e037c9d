// The two passes of the ISPC decode-attention tile (attention_tile.isph) for bfloat16 caches
// with the CPU's bf16 dot-product instruction (AVX512-BF16 VDPBF16PS), called from the ISPC
// kernel when the driver picks the "bf16_dot" variant (decode_attention.cpp). VDPBF16PS adds
// a[2i] * b[2i] + a[2i + 1] * b[2i + 1] to float lane i of its accumulator, the products exact in
// float32; it treats bf16 subnormal inputs (below 2^-126 in magnitude) as zero and flushes
// subnormal sums to zero. Whether that is faster than widening and two FMAs depends on the CPU's
// throughput of the instruction; cpu_prefers_bf16_dot (tile_bf16_dot.h) says where it is.
//
// Scores: a bf16 row read as 32-bit words holds dims (2i, 2i + 1) in word i, so one instruction
// per 16 words of a K row and its query row replaces the generic pass's widening of both halves
// of each word and its two FMAs. The query is used as stored and the scale applied to the
// finished scores: no operand is rounded. As in the ISPC pass, two tokens share each query load,
// the per-lane partial sums of 16 tokens are reduced together by a transposing reduction, and
// the tile's prefetches are issued pair by pair (the pair one tile ahead into L2, this pair's V
// rows and the next pair's K rows into L1).
//
// Values: the instruction's pairs run over two tokens instead: the V words of tokens t and t + 1
// are interleaved element by element (one unpack of each half of a 128-bit lane), so lane i
// holds (v_t[d], v_t+1[d]) and the weight word holds (p_t, p_t+1) as bf16. The softmax weights
// are therefore rounded to bf16 (to nearest even); the ISPC softmax rounds them before it sums
// them, so the output stays a convex combination of the V rows. The accumulator rows stay in
// the kernel's pair layout between tiles and are permuted to and from the unpacked dim order
// once per tile.

#include "tile_bf16_dot.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>

#define NEO_BF16_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

namespace {

constexpr int kLanes = 16;
constexpr int kCacheLineBytes = 64;

// Lane partner of one reduction step: lanes with bit `width` of their index clear take lane
// l + width of the first operand, the others lane l - width of the second.
constexpr std::array<int32_t, kLanes> partner_lanes(int width) {
    std::array<int32_t, kLanes> lanes{};
    for (int lane = 0; lane < kLanes; lane++) {
        lanes[lane] = (lane & width) == 0 ? lane + width : lane - width + kLanes;
    }
    return lanes;
}

constexpr std::array<int32_t, kLanes> kPartner1 = partner_lanes(1);
constexpr std::array<int32_t, kLanes> kPartner2 = partner_lanes(2);
constexpr std::array<int32_t, kLanes> kPartner4 = partner_lanes(4);
constexpr std::array<int32_t, kLanes> kPartner8 = partner_lanes(8);

// The lanes of a with bit `width` of the lane index clear get a[l] + a[l ^ width]; the others
// get b[l] + b[l ^ width].
template <int width>
NEO_BF16_DOT_TARGET inline __m512 combine_lanes(__m512 a, __m512 b) {
    constexpr __mmask16 lower = width == 1 ? 0x5555 : width == 2 ? 0x3333 : width == 4 ? 0x0f0f
                                                                                     : 0x00ff;
    const std::array<int32_t, kLanes>& partner =
        width == 1 ? kPartner1 : width == 2 ? kPartner2 : width == 4 ? kPartner4 : kPartner8;
    const __m512i partner_index = _mm512_loadu_si512(partner.data());
    return _mm512_add_ps(_mm512_mask_blend_ps(lower, b, a),
                         _mm512_permutex2var_ps(a, partner_index, b));
}

// Given pair_sums[m] = combine_lanes<1>(v[2m], v[2m + 1]) for 16 vectors v, returns the vector
// whose lane l is the sum of the lanes of v[l]. Overwrites `pair_sums`.
NEO_BF16_DOT_TARGET inline __m512 finish_lane_sums(__m512 pair_sums[kLanes / 2]) {
    for (int k = 0; k < 4; k++) {
        pair_sums[k] = combine_lanes<2>(pair_sums[2 * k], pair_sums[2 * k + 1]);
    }
    for (int k = 0; k < 2; k++) {
        pair_sums[k] = combine_lanes<4>(pair_sums[2 * k], pair_sums[2 * k + 1]);
    }
    return combine_lanes<8>(pair_sums[0], pair_sums[1]);
}

// Four rows far ahead into L2 and four rows about to be read into L1 (row_bytes each).
inline void prefetch_pair(const std::array<const char*, 4>& far,
                          const std::array<const char*, 4>& near, int row_bytes) {
    for (int byte = 0; byte < row_bytes; byte += kCacheLineBytes) {
        for (const char* row : far) _mm_prefetch(row + byte, _MM_HINT_T1);
        for (const char* row : near) _mm_prefetch(row + byte, _MM_HINT_T0);
    }
}

NEO_BF16_DOT_TARGET inline __m512bh load_words(const uint32_t* words) {
    return reinterpret_cast<__m512bh>(_mm512_loadu_si512(words));
}

NEO_BF16_DOT_TARGET inline __m512bh load_words(const uint32_t* words, __mmask16 mask) {
    return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi32(mask, words));
}

// Dim order of one 16-word step (32 dims) of a row. Pair layout, as the kernel keeps query and
// accumulator rows: `first` lane l is dim 2l, `second` lane l dim 2l + 1. Unpacked, as the
// interleave of two V rows leaves them: `low` lane 4k + m is dim 8k + m and `high` lane 4k + m
// dim 8k + 4 + m (k: the 128-bit lane, m < 4).
constexpr std::array<int32_t, kLanes> unpacked_from_pair(int offset) {
    std::array<int32_t, kLanes> lanes{};
    for (int lane = 0; lane < kLanes; lane++) {
        const int dim = 8 * (lane / 4) + offset + lane % 4;
        lanes[lane] = dim % 2 == 0 ? dim / 2 : kLanes + dim / 2;
    }
    return lanes;
}

constexpr std::array<int32_t, kLanes> pair_from_unpacked(int parity) {
    std::array<int32_t, kLanes> lanes{};
    for (int lane = 0; lane < kLanes; lane++) {
        const int dim = 2 * lane + parity;
        const int in_lane = dim % 8;
        lanes[lane] = in_lane < 4 ? 4 * (dim / 8) + in_lane : kLanes + 4 * (dim / 8) + in_lane - 4;
    }
    return lanes;
}

constexpr std::array<int32_t, kLanes> kLowFromPair = unpacked_from_pair(0);
constexpr std::array<int32_t, kLanes> kHighFromPair = unpacked_from_pair(4);
constexpr std::array<int32_t, kLanes> kFirstFromUnpacked = pair_from_unpacked(0);
constexpr std::array<int32_t, kLanes> kSecondFromUnpacked = pair_from_unpacked(1);

NEO_BF16_DOT_TARGET inline __m512 permute(const std::array<int32_t, kLanes>& lanes, __m512 a,
                                          __m512 b) {
    return _mm512_permutex2var_ps(a, _mm512_loadu_si512(lanes.data()), b);
}

// weights[h][pair] = the bf16 weights of tokens 2 pair and 2 pair + 1 (0 past num_tokens) as
// one 32-bit word. probabilities: [HEADS, probabilities_stride] floats already rounded to bf16.
template <int HEADS>
NEO_BF16_DOT_TARGET void pack_weights(const float* probabilities, int32_t probabilities_stride,
                                      int32_t num_tokens, uint32_t* weights,
                                      int32_t weights_stride) {
    for (int h = 0; h < HEADS; h++) {
        const float* row = probabilities + h * probabilities_stride;
        for (int first = 0; first < num_tokens; first += 2 * kLanes) {
            const int left = num_tokens - first;
            const __mmask16 low_mask = static_cast<__mmask16>(
                left >= kLanes ? 0xffff : (1u << left) - 1);
            const __mmask16 high_mask = static_cast<__mmask16>(
                left >= 2 * kLanes ? 0xffff : left <= kLanes ? 0 : (1u << (left - kLanes)) - 1);
            const __m512 low = _mm512_maskz_loadu_ps(low_mask, row + first);
            const __m512 high = _mm512_maskz_loadu_ps(high_mask, row + first + kLanes);
            _mm512_storeu_si512(weights + h * weights_stride + first / 2,
                                reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
        }
    }
}

template <int HEADS>
NEO_BF16_DOT_TARGET void tile_scores(const uint32_t* query_words, const uint16_t* key_cache,
                                     const uint16_t* value_cache, const int64_t* row_offsets,
                                     int32_t num_tokens, int32_t head_dim, float scale,
                                     const int64_t* prefetch_offsets, float* scores,
                                     int32_t scores_stride) {
    const int half_dim = head_dim / 2;
    const int full_steps = half_dim / kLanes;
    const __mmask16 tail = static_cast<__mmask16>((1u << (half_dim % kLanes)) - 1);
    const int row_bytes = head_dim * static_cast<int>(sizeof(uint16_t));
    const int last = num_tokens - 1;
    auto key_words = [&](int token) {
        return reinterpret_cast<const uint32_t*>(key_cache + row_offsets[token]);
    };
    auto row = [](const uint16_t* cache, int64_t offset) {
        return reinterpret_cast<const char*>(cache + offset);
    };
    for (int first = 0; first < num_tokens; first += kLanes) {
        const int count = std::min(kLanes, num_tokens - first);
        __m512 pair_sums[HEADS][kLanes / 2];
        for (int j = 0; j < kLanes; j += 2) {
            __m512 dot_a[HEADS];
            __m512 dot_b[HEADS];
            for (int h = 0; h < HEADS; h++) {
                dot_a[h] = _mm512_setzero_ps();
                dot_b[h] = _mm512_setzero_ps();
            }
            if (j < count) {
                if (prefetch_offsets != nullptr) {
                    const int64_t far_a = prefetch_offsets[first + j];
                    const int64_t far_b = prefetch_offsets[first + j + 1];
                    prefetch_pair({row(key_cache, far_a), row(value_cache, far_a),
                                   row(key_cache, far_b), row(value_cache, far_b)},
                                  {row(value_cache, row_offsets[first + j]),
                                   row(value_cache, row_offsets[std::min(first + j + 1, last)]),
                                   row(key_cache, row_offsets[std::min(first + j + 2, last)]),
                                   row(key_cache, row_offsets[std::min(first + j + 3, last)])},
                                  row_bytes);
                }
                // Past the end of the tile the second token repeats the first; its lanes are
                // never read.
                const uint32_t* key_a = key_words(first + j);
                const uint32_t* key_b = j + 1 < count ? key_words(first + j + 1) : key_a;
                for (int step = 0; step < full_steps; step++) {
                    const int word = step * kLanes;
                    const __m512bh a = load_words(key_a + word);
                    const __m512bh b = load_words(key_b + word);
                    for (int h = 0; h < HEADS; h++) {
                        const __m512bh q = load_words(query_words + h * half_dim + word);
                        dot_a[h] = _mm512_dpbf16_ps(dot_a[h], q, a);
                        dot_b[h] = _mm512_dpbf16_ps(dot_b[h], q, b);
                    }
                }
                if (tail != 0) {
                    const int word = full_steps * kLanes;
                    const __m512bh a = load_words(key_a + word, tail);
                    const __m512bh b = load_words(key_b + word, tail);
                    for (int h = 0; h < HEADS; h++) {
                        const __m512bh q = load_words(query_words + h * half_dim + word, tail);
                        dot_a[h] = _mm512_dpbf16_ps(dot_a[h], q, a);
                        dot_b[h] = _mm512_dpbf16_ps(dot_b[h], q, b);
                    }
                }
            }
            for (int h = 0; h < HEADS; h++) {
                pair_sums[h][j / 2] = combine_lanes<1>(dot_a[h], dot_b[h]);
            }
        }
        const __m512 scale_vector = _mm512_set1_ps(scale);
        for (int h = 0; h < HEADS; h++) {
            _mm512_storeu_ps(scores + h * scores_stride + first,
                             _mm512_mul_ps(finish_lane_sums(pair_sums[h]), scale_vector));
        }
    }
}

NEO_BF16_DOT_TARGET inline __m512i load_step(const uint32_t* words, __mmask16 mask, bool masked) {
    return masked ? _mm512_maskz_loadu_epi32(mask, words) : _mm512_loadu_si512(words);
}

// Adds tokens a and b (one 16-word step of their V rows) with the weight word `weights[h *
// weights_stride]` of each head to its low and high accumulators.
template <int HEADS>
NEO_BF16_DOT_TARGET inline void accumulate_pair(__m512i a, __m512i b, const uint32_t* weights,
                                                int32_t weights_stride, __m512 low[HEADS],
                                                __m512 high[HEADS]) {
    const __m512bh low_pairs = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
    const __m512bh high_pairs = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
    for (int h = 0; h < HEADS; h++) {
        const __m512bh weight = reinterpret_cast<__m512bh>(
            _mm512_set1_epi32(static_cast<int>(weights[h * weights_stride])));
        low[h] = _mm512_dpbf16_ps(low[h], weight, low_pairs);
        high[h] = _mm512_dpbf16_ps(high[h], weight, high_pairs);
    }
}

// One 16-word step of the values pass: accumulator rows [word, word + 16) of their first and
// second halves, `mask` of them inside the row (all but at the last step of a head_dim that is
// not a multiple of 32).
template <int HEADS, bool kMasked>
NEO_BF16_DOT_TARGET void accumulate_values_step(const uint32_t* weights, int32_t weights_stride,
                                                const float* rescale,
                                                const uint16_t* value_cache,
                                                const int64_t* row_offsets, int32_t num_tokens,
                                                int32_t head_dim, int32_t word, __mmask16 mask,
                                                float* accumulator) {
    const int half_dim = head_dim / 2;
    __m512 low[HEADS];
    __m512 high[HEADS];
    for (int h = 0; h < HEADS; h++) {
        const __m512 factor = _mm512_set1_ps(rescale[h]);
        const float* row = accumulator + h * head_dim;
        const __m512 first = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + word), factor);
        const __m512 second =
            _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + half_dim + word), factor);
        low[h] = permute(kLowFromPair, first, second);
        high[h] = permute(kHighFromPair, first, second);
    }
    auto value_words = [&](int token) {
        return reinterpret_cast<const uint32_t*>(value_cache + row_offsets[token]) + word;
    };
    int token = 0;
    for (; token + 1 < num_tokens; token += 2) {
        accumulate_pair<HEADS>(load_step(value_words(token), mask, kMasked),
                               load_step(value_words(token + 1), mask, kMasked),
                               weights + token / 2, weights_stride, low, high);
    }
    if (token < num_tokens) {  // an odd last token, paired with zeros and weight 0
        accumulate_pair<HEADS>(load_step(value_words(token), mask, kMasked),
                               _mm512_setzero_si512(), weights + token / 2, weights_stride, low,
                               high);
    }
    for (int h = 0; h < HEADS; h++) {
        float* row = accumulator + h * head_dim;
        _mm512_mask_storeu_ps(row + word, mask, permute(kFirstFromUnpacked, low[h], high[h]));
        _mm512_mask_storeu_ps(row + half_dim + word, mask,
                              permute(kSecondFromUnpacked, low[h], high[h]));
    }
}

// accumulator[h] = accumulator[h] * rescale[h] + sum_t p[h][t] v_t over the tile's tokens.
template <int HEADS>
NEO_BF16_DOT_TARGET void tile_values(const float* probabilities, int32_t probabilities_stride,
                                     const float* rescale, const uint16_t* value_cache,
                                     const int64_t* row_offsets, int32_t num_tokens,
                                     int32_t head_dim, float* accumulator) {
    constexpr int kMaxTileTokens = 128;  // MAX_TILE_TOKENS of decode_attention.ispc
    constexpr int kWeightsStride = kMaxTileTokens / 2 + kLanes;
    uint32_t weights[HEADS * kWeightsStride];
    pack_weights<HEADS>(probabilities, probabilities_stride, num_tokens, weights, kWeightsStride);
    const int half_dim = head_dim / 2;
    int word = 0;
    for (; word + kLanes <= half_dim; word += kLanes) {
        accumulate_values_step<HEADS, false>(weights, kWeightsStride, rescale, value_cache,
                                             row_offsets, num_tokens, head_dim, word, 0xffff,
                                             accumulator);
    }
    if (word < half_dim) {
        const __mmask16 mask = static_cast<__mmask16>((1u << (half_dim - word)) - 1);
        accumulate_values_step<HEADS, true>(weights, kWeightsStride, rescale, value_cache,
                                            row_offsets, num_tokens, head_dim, word, mask,
                                            accumulator);
    }
}

}  // namespace

extern "C" void tile_scores_bf16_dot(int32_t heads, const uint32_t* query_words,
                                 const uint16_t* key_cache, const uint16_t* value_cache,
                                 const int64_t* row_offsets, int32_t num_tokens, int32_t head_dim,
                                 float scale, const int64_t* prefetch_offsets, float* scores,
                                 int32_t scores_stride) {
    switch (heads) {
#define NEO_TILE_SCORES_CASE(N)                                                                  \
    case N:                                                                                      \
        tile_scores<N>(query_words, key_cache, value_cache, row_offsets, num_tokens, head_dim,   \
                       scale, prefetch_offsets, scores, scores_stride);                          \
        break;
        NEO_TILE_SCORES_CASE(1) NEO_TILE_SCORES_CASE(2) NEO_TILE_SCORES_CASE(3)
        NEO_TILE_SCORES_CASE(4) NEO_TILE_SCORES_CASE(5) NEO_TILE_SCORES_CASE(6)
        NEO_TILE_SCORES_CASE(7) NEO_TILE_SCORES_CASE(8)
#undef NEO_TILE_SCORES_CASE
    }
}

extern "C" void tile_values_bf16_dot(int32_t heads, const float* probabilities,
                                     int32_t probabilities_stride, const float* rescale,
                                     const uint16_t* value_cache, const int64_t* row_offsets,
                                     int32_t num_tokens, int32_t head_dim, float* accumulator) {
    switch (heads) {
#define NEO_TILE_VALUES_CASE(N)                                                                  \
    case N:                                                                                      \
        tile_values<N>(probabilities, probabilities_stride, rescale, value_cache, row_offsets,   \
                       num_tokens, head_dim, accumulator);                                       \
        break;
        NEO_TILE_VALUES_CASE(1) NEO_TILE_VALUES_CASE(2) NEO_TILE_VALUES_CASE(3)
        NEO_TILE_VALUES_CASE(4) NEO_TILE_VALUES_CASE(5) NEO_TILE_VALUES_CASE(6)
        NEO_TILE_VALUES_CASE(7) NEO_TILE_VALUES_CASE(8)
#undef NEO_TILE_VALUES_CASE
    }
}

namespace neo_cpu {

bool cpu_has_bf16_dot() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
}

bool cpu_prefers_bf16_dot() {
    __builtin_cpu_init();
    return cpu_has_bf16_dot() && __builtin_cpu_is("amd");
}

}  // namespace neo_cpu
