#include "attention_plan.h"

#include <algorithm>

namespace neo_cpu {
namespace {

int64_t divide_rounding_up(int64_t numerator, int64_t denominator) {
    return (numerator + denominator - 1) / denominator;
}

int64_t round_up(int64_t value, int64_t multiple) {
    return divide_rounding_up(value, multiple) * multiple;
}

// The fewest groups (a divisor of num_kv_heads) that give every sequence's groups together at
// least `wanted_chunks` chunks, or one group a KV head where no count does.
int32_t kv_head_groups(int64_t num_seqs, int32_t num_kv_heads, int64_t wanted_chunks) {
    for (int32_t groups = 1; groups < num_kv_heads; groups++) {
        if (num_kv_heads % groups == 0 && num_seqs * groups >= wanted_chunks) return groups;
    }
    return num_kv_heads;
}

}  // namespace

AttentionPlan plan_attention(const int32_t* seq_lens, int64_t num_seqs, int32_t num_kv_heads,
                             int64_t num_threads) {
    int64_t total_tokens = 0;
    for (int64_t sequence = 0; sequence < num_seqs; sequence++) total_tokens += seq_lens[sequence];
    const int64_t wanted_chunks = std::max<int64_t>(num_threads, 1) * kChunksPerThread;
    const int32_t groups = divide_rounding_up(total_tokens, wanted_chunks) >= kLongChunkTokens
                               ? 1
                               : kv_head_groups(num_seqs, num_kv_heads, wanted_chunks);
    // Tokens a chunk should hold for the groups' chunks to number about wanted_chunks.
    const int64_t target = divide_rounding_up(total_tokens * groups, wanted_chunks);
    const int64_t chunk_tokens = round_up(std::max(target, kMinChunkTokens), kChunkAlignTokens);

    AttentionPlan plan;
    plan.kv_heads_per_chunk = num_kv_heads / groups;
    for (int64_t sequence = 0; sequence < num_seqs; sequence++) {
        const int64_t length = seq_lens[sequence];
        const int64_t pieces = divide_rounding_up(length, chunk_tokens);
        const int64_t piece_tokens = round_up(divide_rounding_up(length, pieces), kChunkAlignTokens);
        const int64_t count = divide_rounding_up(length, piece_tokens);
        for (int32_t group = 0; group < groups; group++) {
            const int32_t kv_head_begin = group * plan.kv_heads_per_chunk;
            if (count == 1) {
                plan.chunks.push_back({sequence, kv_head_begin, 0, static_cast<int32_t>(length),
                                       -1});
                continue;
            }
            plan.split_groups.push_back({sequence, kv_head_begin, plan.num_partials,
                                         static_cast<int32_t>(count)});
            for (int64_t piece = 0; piece < count; piece++) {
                const int64_t begin = piece * piece_tokens;
                const int64_t end = std::min(length, begin + piece_tokens);
                plan.chunks.push_back({sequence, kv_head_begin, static_cast<int32_t>(begin),
                                       static_cast<int32_t>(end), plan.num_partials++});
            }
        }
    }
    std::stable_sort(plan.chunks.begin(), plan.chunks.end(),
                     [](const AttentionChunk& a, const AttentionChunk& b) {
                         return a.token_end - a.token_begin > b.token_end - b.token_begin;
                     });
    return plan;
}

}  // namespace neo_cpu
