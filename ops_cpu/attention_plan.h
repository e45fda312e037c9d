// How one paged_decode_attention call is split into chunks for the threads.
//
// A chunk is a token range of one sequence, for all its heads (a cache block holds the rows of
// all KV heads together, so a chunk reads whole blocks). The work is the sum of seq_len over
// the sequences. Each sequence is cut into near-equal chunks of at least kMinChunkTokens tokens,
// sized so that every thread gets about kChunksPerThread chunks; threads then take chunks
// longest first from a shared counter, which balances uneven lengths and threads that start
// late. A sequence cut into several chunks gets one partial result per chunk, merged afterwards
// with log-sum-exp.
#pragma once

#include <cstdint>
#include <vector>

namespace neo_cpu {

constexpr int64_t kChunksPerThread = 4;
// Long enough that the merge and the per-chunk set-up are small next to streaming the chunk.
constexpr int64_t kMinChunkTokens = 256;
// Chunk boundaries fall on multiples of this many tokens: a multiple of every tile size the
// kernel uses, so chunks start on whole tiles.
constexpr int64_t kChunkAlignTokens = 128;

struct AttentionChunk {
    int64_t sequence;
    int32_t token_begin;
    int32_t token_end;
    int64_t partial_index;  // slot of its partial result, or -1 when the chunk is the whole sequence
};

struct SplitSequence {
    int64_t sequence;
    int64_t first_partial;  // its chunks' partials occupy [first_partial, first_partial + count)
    int32_t count;
};

struct AttentionPlan {
    std::vector<AttentionChunk> chunks;  // longest first
    std::vector<SplitSequence> split_sequences;
    int64_t num_partials = 0;
};

// seq_lens: [num_seqs] tokens per sequence, each >= 1 (already validated).
AttentionPlan plan_attention(const int32_t* seq_lens, int64_t num_seqs, int64_t num_threads);

}  // namespace neo_cpu
