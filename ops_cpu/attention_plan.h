// How one paged_decode_attention call is split into chunks for the threads.
//
// A chunk is a token range of one sequence, for all its heads (a cache block holds the rows of
// all KV heads together, so a chunk reads whole blocks). The work is the sum of seq_len over
// the sequences. Each sequence is cut into near-equal chunks of at least kMinChunkTokens tokens,
// sized so that every thread gets about kChunksPerThread chunks; threads then take chunks
// longest first from a shared counter, which balances uneven lengths and threads that start
// late. A sequence cut into several chunks gets one partial result per chunk, merged with
// log-sum-exp by the thread that finishes its last chunk.
#pragma once

#include <cstdint>
#include <vector>

namespace neo_cpu {

constexpr int64_t kChunksPerThread = 4;
// Short enough that the small calls of a small host batch (one sequence of a few hundred tokens
// per layer) spread over several threads, long enough (256 KiB of K/V at 8 KV heads of 128
// 16-bit dims) that a chunk's set-up and merge stay small next to streaming it.
constexpr int64_t kMinChunkTokens = 64;
// Chunk boundaries fall on multiples of this many tokens. The kernel's tiles are whole blocks,
// from block_size up to 128 tokens (32 for 8 KV heads of 128 16-bit dims in blocks of 16), so
// most chunks start on a tile; one that starts inside a tile runs a partial tile first.
constexpr int64_t kChunkAlignTokens = 64;

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
