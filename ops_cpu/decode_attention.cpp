// C++ driver of the ISPC paged decode-attention kernel: checks the arguments, splits the work
// into chunks of a sequence's KV head group and tokens (attention_plan.h), runs the chunks on
// at::parallel_for's threads, and merges the partial results of a group whose tokens were split
// across chunks on the thread that finishes its last chunk (one parallel region per call). For
// bf16 caches the tile's score and value passes come in two variants: the ISPC ones, which
// widen bf16 to float32 ("generic"), and ones with the CPU's bf16 dot-product instruction
// ("bf16_dot", tile_bf16_dot.cpp), the default on CPUs where it is the faster
// (cpu_prefers_bf16_dot); NEO_CPU_DECODE_ATTENTION_VARIANT names one instead.

#include "decode_attention_ispc.h"

#include "attention_plan.h"
#include "checks.h"
#include "ops.h"
#include "tile_bf16_dot.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace neo_cpu {
namespace {

constexpr const char* kOp = "paged_decode_attention";
constexpr const char* kVariantVariable = "NEO_CPU_DECODE_ATTENTION_VARIANT";

}  // namespace

bool bf16_decode_attention_uses_dot() {
    static const bool available = cpu_has_bf16_dot();
    static const bool preferred = cpu_prefers_bf16_dot();
    const char* requested = std::getenv(kVariantVariable);
    if (requested == nullptr || requested[0] == '\0' || std::strcmp(requested, "auto") == 0) {
        return preferred;
    }
    if (std::strcmp(requested, "generic") == 0) return false;
    TORCH_CHECK_VALUE(std::strcmp(requested, "bf16_dot") == 0, "neo.", kOp, ": ",
                      kVariantVariable, "=", requested, " names no CPU decode attention "
                      "variant; choose one of auto, generic, bf16_dot");
    TORCH_CHECK_VALUE(available, "neo.", kOp, ": ", kVariantVariable, "=bf16_dot needs a CPU "
                      "with AVX512-BF16 (the VDPBF16PS instruction), which this one lacks");
    return true;
}

namespace {

void check_arguments(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, double scale) {
    check_cache_layout(kOp, k_cache, v_cache);
    check_float_dtype(kOp, "q", q);
    const auto dtype = q.scalar_type();
    TORCH_CHECK_VALUE(dtype == k_cache.scalar_type() && dtype == out.scalar_type(), "neo.", kOp,
                      ": q, caches and out must share one dtype, got q ", dtype, ", cache ",
                      k_cache.scalar_type(), ", out ", out.scalar_type());
    TORCH_CHECK_VALUE(q.dim() == 3, "neo.", kOp, ": q must be [num_seqs, num_heads, head_dim], "
                      "got ", q.sizes());
    TORCH_CHECK_VALUE(out.sizes() == q.sizes(), "neo.", kOp, ": out shape ", out.sizes(),
                      " differs from q shape ", q.sizes());
    TORCH_CHECK_VALUE(q.is_contiguous() && out.is_contiguous(), "neo.", kOp,
                      ": q and out must be contiguous");
    const int64_t num_seqs = q.size(0);
    const int64_t num_heads = q.size(1);
    const int64_t num_kv_heads = k_cache.size(1);
    TORCH_CHECK_VALUE(q.size(2) == k_cache.size(3), "neo.", kOp, ": q head_dim ", q.size(2),
                      " differs from the cache's ", k_cache.size(3));
    TORCH_CHECK_VALUE(num_heads >= 1, "neo.", kOp, ": q must have num_heads >= 1, got ",
                      num_heads);
    TORCH_CHECK_VALUE(num_heads % num_kv_heads == 0, "neo.", kOp,
                      ": num_heads ", num_heads, " is not a multiple of num_kv_heads ",
                      num_kv_heads);
    TORCH_CHECK_VALUE(block_table.scalar_type() == at::kInt && block_table.dim() == 2, "neo.",
                      kOp, ": block_table must be int32 [num_seqs, max_blocks_per_seq], got ",
                      block_table.scalar_type(), " ", block_table.sizes());
    TORCH_CHECK_VALUE(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                          seq_lens.size(0) == num_seqs,
                      "neo.", kOp, ": seq_lens must be int32 [", num_seqs, "], got ",
                      seq_lens.scalar_type(), " ", seq_lens.sizes());
    TORCH_CHECK_VALUE(block_table.size(0) == num_seqs, "neo.", kOp, ": block_table has ",
                      block_table.size(0), " rows for ", num_seqs, " sequences");
    check_on_cpu(kOp, {{"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"out", &out},
                       {"block_table", &block_table}, {"seq_lens", &seq_lens}});
    check_float32_scalar(kOp, "scale", scale);
}

// seq_lens: [num_seqs]; block_table: [num_seqs, max_blocks] (both contiguous int32).
void check_values(const int32_t* seq_lens, const int32_t* block_table, int64_t num_seqs,
                  int64_t max_blocks, int64_t block_size, int64_t num_blocks) {
    for (int64_t sequence = 0; sequence < num_seqs; sequence++) {
        TORCH_CHECK_VALUE(seq_lens[sequence] >= 1, "neo.", kOp, ": every seq_len must be >= 1, "
                          "got ", seq_lens[sequence], " for sequence ", sequence);
    }
    for (int64_t sequence = 0; sequence < num_seqs; sequence++) {
        const int64_t blocks_needed = (seq_lens[sequence] + block_size - 1) / block_size;
        TORCH_CHECK_VALUE(blocks_needed <= max_blocks, "neo.", kOp, ": seq_len ",
                          seq_lens[sequence], " of sequence ", sequence, " needs ", blocks_needed,
                          " blocks but block_table has ", max_blocks, " columns");
        for (int64_t column = 0; column < blocks_needed; column++) {
            const int32_t block = block_table[sequence * max_blocks + column];
            TORCH_CHECK_VALUE(block >= 0 && block < num_blocks, "neo.", kOp, ": block id ", block,
                              " at block_table[", sequence, ", ", column, "] is outside the "
                              "cache's ", num_blocks, " blocks");
        }
    }
}

// The ISPC entry points for one storage type (float, or uint16_t for the 16-bit types).
template <typename Storage>
struct Kernels {
    void (*attend_chunk)(const Storage* query, const Storage* key_cache,
                         const Storage* value_cache, int32_t block_size_log2,
                         int32_t num_kv_heads, int32_t head_dim, int32_t kv_heads, int32_t group,
                         float scale, bool bf16_dot, const ispc::ChunkRange* chunk,
                         const ispc::ChunkRange* next_chunk, bool prefetch_start,
                         float* scaled_query, float* accumulator, float* running_max,
                         float* running_sum);
    // spends the partials: overwrites their running_max and the first one's running_sum
    void (*merge_partials)(float* partials, int32_t count, int32_t num_heads, int32_t head_dim,
                           Storage* out);
};

template <typename Storage>
void run(const Kernels<Storage>& kernels, const at::Tensor& out, const at::Tensor& q,
         const at::Tensor& k_cache, const at::Tensor& v_cache, const int32_t* block_table,
         int64_t max_blocks, const int32_t* seq_lens, double scale, bool bf16_dot = false) {
    const int64_t num_seqs = q.size(0);
    const int32_t num_heads = static_cast<int32_t>(q.size(1));
    const int32_t head_dim = static_cast<int32_t>(q.size(2));
    const int32_t num_kv_heads = static_cast<int32_t>(k_cache.size(1));
    const int32_t group = num_heads / num_kv_heads;
    const int32_t block_size_log2 = __builtin_ctzll(static_cast<uint64_t>(k_cache.size(2)));
    const int64_t query_floats = static_cast<int64_t>(num_heads) * head_dim;

    const int64_t num_threads = at::get_num_threads();
    const AttentionPlan plan = plan_attention(seq_lens, num_seqs, num_kv_heads, num_threads);
    const int32_t kv_heads = plan.kv_heads_per_chunk;
    // A chunk's query heads, and its partial result: accumulator [chunk_heads, head_dim],
    // running_max and running_sum [chunk_heads].
    const int32_t chunk_heads = kv_heads * group;
    const int64_t chunk_query_floats = static_cast<int64_t>(chunk_heads) * head_dim;
    const int64_t partial_floats = static_cast<int64_t>(chunk_heads) * (head_dim + 2);

    const auto* queries = static_cast<const Storage*>(q.data_ptr());
    const auto* keys = static_cast<const Storage*>(k_cache.data_ptr());
    const auto* values = static_cast<const Storage*>(v_cache.data_ptr());
    auto* outputs = static_cast<Storage*>(out.data_ptr());
    // The first element of a (sequence, KV head group)'s rows in q and out: [chunk_heads,
    // head_dim] from there.
    auto group_row = [&](int64_t sequence, int32_t kv_head_begin) {
        return sequence * query_floats + static_cast<int64_t>(kv_head_begin) * group * head_dim;
    };

    // Left uninitialized, as is each thread's scratch below: a chunk's kernel call writes its
    // whole partial (and the scaled query) before anything reads it. Zeroing them first would be
    // a serial memset of up to a few hundred KiB per call (one partial per chunk of a split
    // group), on the critical path of the small host batches.
    const std::unique_ptr<float[]> partials(new float[plan.num_partials * partial_floats]);
    const int64_t num_chunks = static_cast<int64_t>(plan.chunks.size());
    auto chunk_range = [&](int64_t index) {
        if (index >= num_chunks) return ispc::ChunkRange{block_table, 0, 0, 0};
        const AttentionChunk& chunk = plan.chunks[index];
        return ispc::ChunkRange{block_table + chunk.sequence * max_blocks, chunk.kv_head_begin,
                                chunk.token_begin, chunk.token_end};
    };
    std::atomic<int64_t> next_chunk{0};
    // Per split group, its chunks still running; the thread that ends the last one merges.
    const int64_t num_split = static_cast<int64_t>(plan.split_groups.size());
    std::vector<int64_t> split_of_partial(plan.num_partials);
    auto chunks_left = std::make_unique<std::atomic<int32_t>[]>(num_split);
    for (int64_t index = 0; index < num_split; index++) {
        const SplitGroup& split = plan.split_groups[index];
        for (int32_t piece = 0; piece < split.count; piece++) {
            split_of_partial[split.first_partial + piece] = index;
        }
        chunks_left[index].store(split.count, std::memory_order_relaxed);
    }

    // Each thread takes chunks from the shared counter, one ahead of the one it works on, so
    // that the kernel can prefetch the start of its next chunk.
    at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
        const std::unique_ptr<float[]> scratch(new float[chunk_query_floats + partial_floats]);
        float* scaled_query = scratch.get();
        float* whole_group_partial = scaled_query + chunk_query_floats;
        bool first_chunk = true;
        for (int64_t index = next_chunk++; index < num_chunks; first_chunk = false) {
            const int64_t following = next_chunk++;
            const AttentionChunk& chunk = plan.chunks[index];
            const ispc::ChunkRange range = chunk_range(index);
            const ispc::ChunkRange next_range = chunk_range(following);
            float* partial = chunk.partial_index < 0
                                 ? whole_group_partial
                                 : partials.get() + chunk.partial_index * partial_floats;
            kernels.attend_chunk(queries + group_row(chunk.sequence, chunk.kv_head_begin), keys,
                                 values, block_size_log2, num_kv_heads, head_dim, kv_heads, group,
                                 static_cast<float>(scale), bf16_dot, &range, &next_range,
                                 first_chunk, scaled_query, partial, partial + chunk_query_floats,
                                 partial + chunk_query_floats + chunk_heads);
            if (chunk.partial_index < 0) {
                kernels.merge_partials(partial, 1, chunk_heads, head_dim,
                                       outputs + group_row(chunk.sequence, chunk.kv_head_begin));
            } else {
                const int64_t split_index = split_of_partial[chunk.partial_index];
                // acq_rel: the merging thread sees every other chunk's partial of the group.
                if (chunks_left[split_index].fetch_sub(1, std::memory_order_acq_rel) == 1) {
                    const SplitGroup& split = plan.split_groups[split_index];
                    kernels.merge_partials(partials.get() + split.first_partial * partial_floats,
                                           split.count, chunk_heads, head_dim,
                                           outputs + group_row(split.sequence,
                                                               split.kv_head_begin));
                }
            }
            index = following;
        }
    });
}

}  // namespace

void paged_decode_attention(at::Tensor& out, const at::Tensor& q,
                            const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale) {
    check_arguments(out, q, k_cache, v_cache, block_table, seq_lens, scale);
    const at::Tensor table = block_table.contiguous();
    const at::Tensor lengths = seq_lens.contiguous();
    const int64_t num_seqs = q.size(0);
    const int64_t max_blocks = table.size(1);
    const int32_t* table_data = table.data_ptr<int32_t>();
    const int32_t* length_data = lengths.data_ptr<int32_t>();
    check_values(length_data, table_data, num_seqs, max_blocks, k_cache.size(2), k_cache.size(0));
    if (num_seqs == 0) return;

    switch (q.scalar_type()) {
        case at::kFloat:
            run<float>({ispc::attend_chunk_f32, ispc::merge_partials_f32}, out, q, k_cache,
                       v_cache, table_data, max_blocks, length_data, scale);
            break;
        case at::kHalf:
            run<uint16_t>({ispc::attend_chunk_f16, ispc::merge_partials_f16}, out, q, k_cache,
                          v_cache, table_data, max_blocks, length_data, scale);
            break;
        default:  // bfloat16; check_arguments admits no other dtype
            run<uint16_t>({ispc::attend_chunk_bf16, ispc::merge_partials_bf16}, out, q, k_cache,
                          v_cache, table_data, max_blocks, length_data, scale,
                          bf16_decode_attention_uses_dot());
            break;
    }
}

}  // namespace neo_cpu
