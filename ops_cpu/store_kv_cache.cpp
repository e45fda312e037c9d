// store_kv_cache on the CPU: copies each token's K and V rows into its cache slot.

#include "checks.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace neo_cpu {
namespace {

constexpr const char* kOp = "store_kv_cache";
// Tokens per parallel task: each token copies 2 * num_kv_heads rows of head_dim elements.
constexpr int64_t kTokensPerTask = 16;

void check_arguments(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
    check_cache_layout(kOp, k_cache, v_cache);
    TORCH_CHECK_VALUE(key.dim() == 3 && key.sizes() == value.sizes(), "neo.", kOp,
                      ": key and value must both be [num_tokens, num_kv_heads, head_dim], got ",
                      key.sizes(), " and ", value.sizes());
    TORCH_CHECK_VALUE(key.size(1) == k_cache.size(1) && key.size(2) == k_cache.size(3), "neo.",
                      kOp, ": key [*, ", key.size(1), ", ", key.size(2), "] does not match the "
                      "cache's num_kv_heads ", k_cache.size(1), " and head_dim ", k_cache.size(3));
    check_float_dtype(kOp, "key", key);
    TORCH_CHECK_VALUE(key.scalar_type() == value.scalar_type() &&
                          key.scalar_type() == k_cache.scalar_type(),
                      "neo.", kOp, ": key, value and caches must share one dtype, got ",
                      key.scalar_type(), ", ", value.scalar_type(), ", ", k_cache.scalar_type());
    TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                          slot_mapping.size(0) == key.size(0),
                      "neo.", kOp, ": slot_mapping must be int64 [", key.size(0), "], got ",
                      slot_mapping.scalar_type(), " ", slot_mapping.sizes());
    check_on_cpu(kOp, {{"key", &key}, {"value", &value}, {"k_cache", &k_cache},
                       {"v_cache", &v_cache}, {"slot_mapping", &slot_mapping}});
}

// No slot is given to two tokens: the copies run in parallel, so the slot would keep either
// token's K/V, or a mix of both. Reports the first token (in order) whose slot an earlier token
// has, as ops/checks.py does.
void check_distinct_slots(const int64_t* slots, int64_t num_tokens) {
    std::vector<std::pair<int64_t, int64_t>> stored;  // (slot, token), skipped tokens left out
    stored.reserve(num_tokens);
    for (int64_t token = 0; token < num_tokens; token++) {
        if (slots[token] >= 0) stored.emplace_back(slots[token], token);
    }
    std::sort(stored.begin(), stored.end());
    int64_t repeat = -1;  // the first token whose slot an earlier token has
    int64_t earlier = -1;
    for (size_t index = 1, first = 0; index < stored.size(); index++) {
        if (stored[index].first != stored[first].first) {
            first = index;
        } else if (repeat < 0 || stored[index].second < repeat) {
            repeat = stored[index].second;
            earlier = stored[first].second;
        }
    }
    TORCH_CHECK_VALUE(repeat < 0, "neo.", kOp, ": slot ", slots[repeat],
                      " of token ", repeat, " is also the slot of token ", earlier);
}

}  // namespace

void store_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping) {
    check_arguments(key, value, k_cache, v_cache, slot_mapping);
    const at::Tensor slots = slot_mapping.contiguous();
    const int64_t* slot_data = slots.data_ptr<int64_t>();
    const int64_t num_tokens = key.size(0);
    const int64_t num_slots = k_cache.size(0) * k_cache.size(2);
    for (int64_t token = 0; token < num_tokens; token++) {
        TORCH_CHECK_VALUE(slot_data[token] >= -1 && slot_data[token] < num_slots, "neo.", kOp,
                          ": slot ", slot_data[token], " of token ", token, " is outside the "
                          "cache's ", num_slots, " slots");
    }
    check_distinct_slots(slot_data, num_tokens);

    const at::Tensor keys = key.contiguous();
    const at::Tensor values = value.contiguous();
    const int64_t num_kv_heads = k_cache.size(1);
    const int64_t block_size = k_cache.size(2);
    const int64_t row_bytes = k_cache.size(3) * k_cache.element_size();
    const auto* key_bytes = static_cast<const char*>(keys.data_ptr());
    const auto* value_bytes = static_cast<const char*>(values.data_ptr());
    auto* k_cache_bytes = static_cast<char*>(k_cache.data_ptr());
    auto* v_cache_bytes = static_cast<char*>(v_cache.data_ptr());

    at::parallel_for(0, num_tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
        for (int64_t token = begin; token < end; token++) {
            const int64_t slot = slot_data[token];
            if (slot < 0) continue;
            const int64_t block = slot / block_size;
            const int64_t offset = slot % block_size;
            for (int64_t head = 0; head < num_kv_heads; head++) {
                const int64_t source = (token * num_kv_heads + head) * row_bytes;
                const int64_t target = ((block * num_kv_heads + head) * block_size + offset) * row_bytes;
                std::memcpy(k_cache_bytes + target, key_bytes + source, row_bytes);
                std::memcpy(v_cache_bytes + target, value_bytes + source, row_bytes);
            }
        }
    });
}

}  // namespace neo_cpu
