// The CPU kernels registered for torch.ops.neo and torch.ops.neo_ispc (schemas in
// ops/schemas.py; shapes and dtypes there). Every kernel of an op must have the same C++
// signature whatever its device: mutated (a!) arguments are `at::Tensor&`, others
// `const at::Tensor&`, float is `double`, int is `int64_t` (as in ops_cuda/binding.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace neo_cpu {

// out, q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, num_kv_heads,
// block_size, head_dim]; all float32, float16 or bfloat16 alike. block_table: int32
// [num_seqs, max_blocks_per_seq]; seq_lens: int32 [num_seqs]. Writes out.
void paged_decode_attention(at::Tensor& out, const at::Tensor& q,
                            const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale);

// Whether a bf16 paged_decode_attention call now runs the "bf16_dot" variant (else "generic"):
// the one NEO_CPU_DECODE_ATTENTION_VARIANT names, or where it is unset, empty or "auto", whether
// the CPU runs it faster than the generic one (tile_bf16_dot.h). Throws c10::ValueError for an unknown name, or for bf16_dot on a CPU
// without the instruction.
bool bf16_decode_attention_uses_dot();

// key, value: [num_tokens, num_kv_heads, head_dim]; caches as above (one dtype with key);
// slot_mapping: int64 [num_tokens], block * block_size + offset (distinct), -1 skips the token.
void store_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping);

}  // namespace neo_cpu
