// How one paged_decode_attention call is split into chunks for the threads.
//
// A chunk is a token range of one sequence for a group of its KV heads (and their query heads).
// A cache block holds the rows of every KV head, each head's rows one run of block_size rows, so
// a chunk of fewer heads reads shorter runs of the same blocks. The work is the sum of seq_len
// over the sequences, times the KV heads. A call is planned for about kChunksPerThread chunks a
// thread. Where chunks of all KV heads would be shorter than kLongChunkTokens at that count and
// there are fewer sequences than chunks wanted, each sequence's KV heads are first split into
// equal groups (no merge needed: the groups' outputs are separate heads). Where a group's tokens
// are still more than their share, they are cut into near-equal chunks of at least
// kMinChunkTokens tokens. Threads take chunks longest first from a shared counter, which
// balances uneven lengths and threads that start late. A group cut into several token chunks
// gets one partial result per chunk, merged with log-sum-exp by the thread that finishes its
// last chunk.
#pragma once

#include <cstdint>
#include <vector>

namespace neo_cpu {

constexpr int64_t kChunksPerThread = 4;
// Short enough that the small calls of a small host batch (one sequence of a few hundred tokens
// per layer) spread over several threads, long enough that a chunk's set-up and merge stay
// small next to streaming it.
constexpr int64_t kMinChunkTokens = 64;
// A call whose chunks of all KV heads would hold at least this many tokens keeps its heads
// whole. A chunk of all heads reads each block as one run of block_size rows of every head (32
// KiB of K at 8 KV heads of 128 16-bit dims in blocks of 16), a chunk of one head in runs of one
// head's rows (4 KiB there), and from DRAM the longer runs stream faster; chunks this long pay
// little for their merges. Shorter chunks of all heads would pay set-up and merges of many
// partials, and the threads' shares would be coarse: there a split of the heads, which needs
// no merge, is the cheaper way to more chunks.
constexpr int64_t kLongChunkTokens = 512;
// Chunk boundaries fall on multiples of this many tokens. The kernel's tiles are whole blocks,
// from block_size up to 128 tokens, so most chunks start on a tile; one that starts inside a
// tile runs a partial tile first.
constexpr int64_t kChunkAlignTokens = 64;

struct AttentionChunk {
    int64_t sequence;
    int32_t kv_head_begin;  // its KV heads: [kv_head_begin, kv_head_begin + kv_heads_per_chunk)
    int32_t token_begin;
    int32_t token_end;
    int64_t partial_index;  // slot of its partial result, or -1 when the chunk is all the
                            // group's tokens
};

// A (sequence, KV head group) whose tokens were cut into several chunks.
struct SplitGroup {
    int64_t sequence;
    int32_t kv_head_begin;
    int64_t first_partial;  // its chunks' partials occupy [first_partial, first_partial + count)
    int32_t count;
};

struct AttentionPlan {
    int32_t kv_heads_per_chunk = 1;  // the same for every chunk of a call; divides num_kv_heads
    std::vector<AttentionChunk> chunks;  // longest first
    std::vector<SplitGroup> split_groups;
    int64_t num_partials = 0;
};

// seq_lens: [num_seqs] tokens per sequence, each >= 1 (already validated).
AttentionPlan plan_attention(const int32_t* seq_lens, int64_t num_seqs, int32_t num_kv_heads,
                             int64_t num_threads);

}  // namespace neo_cpu
