// torch glue of neo's CUDA kernels: argument checks, device guard, current stream, scratch
// allocation through the caching allocator, kernel launches, and the registration of every op
// as the CUDA kernel of torch.ops.neo and torch.ops.neo_cuda. The only file including torch.
//
// Argument checks mirror ops/checks.py and raise ValueError like it. Values held on the device
// are not checked, since reading them would synchronize (and is illegal during a CUDA graph
// capture): paged_decode_attention's block ids and seq_lens, store_kv_cache's slots (in the
// cache, no slot given to two tokens), prefill_attention's cu_seqlens (start at 0,
// non-decreasing, end at num_tokens) and the bound max_seqlen >= the longest prompt,
// rotary_embedding's positions (0 <= position < max_positions). The host-side implementations
// check those (ops/checks.py, check_*_values); here they are the caller's to get right.
#include <Python.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "launchers.h"

namespace {

using neo_cuda::DataType;

// Error messages are assembled with std::string alone: in CUDA extensions loaded by some
// torch builds, constructing a std::ostringstream (which c10::str uses for non-string
// arguments) crashes the process, so the usual TORCH_CHECK formatting cannot be used here.
void append(std::string& text, const char* piece) { text += piece; }
void append(std::string& text, const std::string& piece) { text += piece; }
void append(std::string& text, at::ScalarType type) { text += c10::toString(type); }
void append(std::string& text, const c10::Device& device) { text += device.str(); }
void append(std::string& text, double value) { text += std::to_string(value); }
void append(std::string& text, at::IntArrayRef sizes) {
  text += "[";
  for (size_t index = 0; index < sizes.size(); ++index) {
    if (index) text += ", ";
    text += std::to_string(sizes[index]);
  }
  text += "]";
}
template <typename Integer, typename = std::enable_if_t<std::is_integral_v<Integer>>>
void append(std::string& text, Integer value) {
  text += std::to_string(value);
}

template <typename... Pieces>
[[noreturn]] void throw_value_error(const char* op, const Pieces&... pieces) {
  std::string message = std::string("neo.") + op + ": ";
  (append(message, pieces), ...);
  TORCH_CHECK_VALUE(false, message);
  __builtin_unreachable();
}

#define NEO_CHECK(condition, op, ...)              \
  do {                                             \
    if (!(condition)) throw_value_error(op, __VA_ARGS__); \
  } while (false)

constexpr int64_t kMinBlockSize = 8;
constexpr int64_t kMaxBlockSize = 128;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGridDimension = 65535;
// Partitions per sequence: the decode grid's z dimension.
constexpr int64_t kMaxDecodePartitions = kMaxGridDimension;

bool is_floating_activation(at::ScalarType type) {
  return type == at::kFloat || type == at::kHalf || type == at::kBFloat16;
}

DataType data_type_of(const at::Tensor& tensor, const char* op, const char* name) {
  const at::ScalarType type = tensor.scalar_type();
  NEO_CHECK(is_floating_activation(type), op, name,
            " dtype must be float32, float16 or bfloat16, got ", type);
  return type == at::kFloat ? DataType::Float32
                            : (type == at::kHalf ? DataType::Float16 : DataType::BFloat16);
}

void check_on_device(const char* op, const at::Tensor& reference, const char* reference_name,
                     const at::Tensor& tensor, const char* name) {
  NEO_CHECK(tensor.device() == reference.device(), op, name, " is on ", tensor.device(), ", ",
            reference_name, " on ", reference.device());
}

// `value` is finite and representable in float32 (the kernels compute in float32).
void check_float32_scalar(const char* op, const char* name, double value) {
  NEO_CHECK(std::isfinite(value) && std::abs(value) <= std::numeric_limits<float>::max(), op,
            name, " must be a finite float32 value, got ", value);
}

bool is_aligned_16(const at::Tensor& tensor) {
  return reinterpret_cast<uintptr_t>(tensor.data_ptr()) % 16 == 0;
}

// Whether `stride` elements of `tensor` span a whole number of 16-byte vectors.
bool stride_is_vector_multiple(const at::Tensor& tensor, int64_t stride) {
  return (stride * static_cast<int64_t>(tensor.element_size())) % 16 == 0;
}

// `tensor` itself when its last dimension is contiguous, else a contiguous copy.
at::Tensor with_contiguous_rows(const at::Tensor& tensor) {
  return tensor.stride(-1) == 1 ? tensor : tensor.contiguous();
}

cudaStream_t current_stream(const at::Tensor& tensor) {
  return c10::cuda::getCurrentCUDAStream(tensor.get_device()).stream();
}

void check_cache_layout(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  NEO_CHECK(k_cache.dim() == 4, op,
            "k_cache must be [num_blocks, num_kv_heads, block_size, head_dim], got shape ",
            k_cache.sizes());
  NEO_CHECK(v_cache.sizes() == k_cache.sizes(), op, "v_cache shape ", v_cache.sizes(),
            " differs from k_cache shape ", k_cache.sizes());
  NEO_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), op, "v_cache dtype ",
            v_cache.scalar_type(), " differs from k_cache dtype ", k_cache.scalar_type());
  NEO_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op,
            "k_cache and v_cache must be contiguous");
  NEO_CHECK(k_cache.size(1) >= 1, op, "k_cache must have num_kv_heads >= 1, got ",
            k_cache.size(1));
  const int64_t block_size = k_cache.size(2);
  NEO_CHECK(block_size >= kMinBlockSize && block_size <= kMaxBlockSize &&
                (block_size & (block_size - 1)) == 0,
            op, "block_size must be a power of two from ", kMinBlockSize, " to ", kMaxBlockSize,
            ", got ", block_size);
  const int64_t head_dim = k_cache.size(3);
  NEO_CHECK(head_dim % 16 == 0 && head_dim > 0 && head_dim <= kMaxHeadDim, op,
            "head_dim must be a multiple of 16 up to ", kMaxHeadDim, ", got ", head_dim);
}

// ---- paged_decode_attention ---------------------------------------------------------------

// The decode kernel variant named by the environment variable kDecodeVariantVariable, or the
// launcher's choice for the block table's width when it is unset, empty or "auto".
int decode_variant(const char* op, int64_t max_blocks_per_seq, int64_t block_size) {
  const char* requested = std::getenv(neo_cuda::kDecodeVariantVariable);
  if (requested == nullptr || requested[0] == '\0' || std::strcmp(requested, "auto") == 0) {
    return neo_cuda::choose_decode_variant(max_blocks_per_seq, static_cast<int>(block_size));
  }
  std::string names = "auto";
  for (int index = 0; index < neo_cuda::kDecodeVariantCount; ++index) {
    if (std::strcmp(requested, neo_cuda::kDecodeVariants[index].name) == 0) return index;
    names += std::string(", ") + neo_cuda::kDecodeVariants[index].name;
  }
  throw_value_error(op, neo_cuda::kDecodeVariantVariable, "=", std::string(requested),
                    " names no decode kernel variant; choose one of ", names);
}

void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, double scale) {
  const char* op = "paged_decode_attention";
  check_cache_layout(op, k_cache, v_cache);
  const DataType dtype = data_type_of(q, op, "q");
  NEO_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(), op,
            "q, caches and out must share one dtype, got q ", q.scalar_type(), ", cache ",
            k_cache.scalar_type(), ", out ", out.scalar_type());
  NEO_CHECK(q.dim() == 3, op, "q must be [num_seqs, num_heads, head_dim], got ", q.sizes());
  NEO_CHECK(out.sizes() == q.sizes(), op, "out shape ", out.sizes(), " differs from q shape ",
            q.sizes());
  NEO_CHECK(q.is_contiguous() && out.is_contiguous(), op, "q and out must be contiguous");
  const int64_t num_seqs = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t block_size = k_cache.size(2);
  NEO_CHECK(head_dim == k_cache.size(3), op, "q head_dim ", head_dim, " differs from the cache's ",
            k_cache.size(3));
  NEO_CHECK(num_heads >= 1, op, "q must have num_heads >= 1, got ", num_heads);
  NEO_CHECK(num_heads % num_kv_heads == 0, op, "num_heads ", num_heads,
            " is not a multiple of num_kv_heads ", num_kv_heads);
  NEO_CHECK(num_heads <= kMaxGridDimension, op, "num_heads ", num_heads, " exceeds ",
            kMaxGridDimension);
  NEO_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2, op,
            "block_table must be int32 [num_seqs, max_blocks_per_seq], got ",
            block_table.scalar_type(), " ", block_table.sizes());
  NEO_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                seq_lens.size(0) == num_seqs,
            op, "seq_lens must be int32 [", num_seqs, "], got ", seq_lens.scalar_type(), " ",
            seq_lens.sizes());
  NEO_CHECK(block_table.size(0) == num_seqs, op, "block_table has ", block_table.size(0),
            " rows for ", num_seqs, " sequences");
  NEO_CHECK(q.is_cuda(), op, "q is on ", q.device(), "; this kernel needs CUDA tensors");
  check_on_device(op, q, "q", k_cache, "k_cache");
  check_on_device(op, q, "q", v_cache, "v_cache");
  check_on_device(op, q, "q", out, "out");
  check_on_device(op, q, "q", block_table, "block_table");
  check_on_device(op, q, "q", seq_lens, "seq_lens");
  check_float32_scalar(op, "scale", scale);
  if (num_seqs == 0) return;
  NEO_CHECK(is_aligned_16(q) && is_aligned_16(out) && is_aligned_16(k_cache) &&
                is_aligned_16(v_cache),
            op, "q, out, k_cache and v_cache must start at 16-byte aligned addresses");

  const c10::cuda::CUDAGuard device_guard(q.device());
  const cudaStream_t stream = current_stream(q);
  const at::Tensor table = with_contiguous_rows(block_table);
  const at::Tensor lengths = seq_lens.contiguous();
  const int variant = decode_variant(op, table.size(1), block_size);
  const int partition_size = neo_cuda::kDecodeVariants[variant].partition_size;
  const int max_partitions =
      neo_cuda::decode_partition_count(table.size(1), static_cast<int>(block_size), partition_size);
  NEO_CHECK(max_partitions <= kMaxDecodePartitions, op, "block_table has ", table.size(1),
            " columns of ", block_size, " tokens, more than the ",
            kMaxDecodePartitions * partition_size,
            " tokens per sequence this kernel supports with decode variant ",
            neo_cuda::kDecodeVariants[variant].name);

  neo_cuda::PagedDecodeAttentionParams params{};
  params.out = out.data_ptr();
  params.q = q.data_ptr();
  params.k_cache = k_cache.data_ptr();
  params.v_cache = v_cache.data_ptr();
  params.block_table = table.data_ptr<int32_t>();
  params.seq_lens = lengths.data_ptr<int32_t>();
  params.num_seqs = static_cast<int>(num_seqs);
  params.num_heads = static_cast<int>(num_heads);
  params.num_kv_heads = static_cast<int>(num_kv_heads);
  params.head_dim = static_cast<int>(head_dim);
  params.block_size = static_cast<int>(block_size);
  params.block_table_stride = static_cast<int>(table.stride(0));
  params.max_blocks_per_seq = static_cast<int>(table.size(1));
  params.partition_size = partition_size;
  params.partition_slack = neo_cuda::decode_partition_slack(variant, dtype, head_dim);
  params.max_partitions = max_partitions;
  params.scale = static_cast<float>(scale);

  // Scratch for split sequences, from the caching allocator (freed in stream order on return).
  at::Tensor partial_out;
  at::Tensor partial_max;
  at::Tensor partial_sum;
  if (max_partitions > 1) {
    const auto options = q.options().dtype(at::kFloat);
    partial_out = at::empty({num_seqs, num_heads, max_partitions, head_dim}, options);
    partial_max = at::empty({num_seqs, num_heads, max_partitions}, options);
    partial_sum = at::empty({num_seqs, num_heads, max_partitions}, options);
    params.partial_out = partial_out.data_ptr<float>();
    params.partial_max = partial_max.data_ptr<float>();
    params.partial_sum = partial_sum.data_ptr<float>();
  }
  neo_cuda::launch_paged_decode_attention(params, variant, dtype, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (max_partitions > 1) {
    neo_cuda::launch_paged_decode_attention_merge(params, dtype, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// ---- store_kv_cache -------------------------------------------------------------------------

void store_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const char* op = "store_kv_cache";
  check_cache_layout(op, k_cache, v_cache);
  NEO_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), op,
            "key and value must both be [num_tokens, num_kv_heads, head_dim], got ", key.sizes(),
            " and ", value.sizes());
  NEO_CHECK(key.size(1) == k_cache.size(1) && key.size(2) == k_cache.size(3), op, "key [*, ",
            key.size(1), ", ", key.size(2), "] does not match the cache's num_kv_heads ",
            k_cache.size(1), " and head_dim ", k_cache.size(3));
  const DataType dtype = data_type_of(key, op, "key");
  NEO_CHECK(key.scalar_type() == value.scalar_type() && key.scalar_type() == k_cache.scalar_type(),
            op, "key, value and caches must share one dtype, got ", key.scalar_type(), ", ",
            value.scalar_type(), ", ", k_cache.scalar_type());
  const int64_t num_tokens = key.size(0);
  NEO_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                slot_mapping.size(0) == num_tokens,
            op, "slot_mapping must be int64 [", num_tokens, "], got ", slot_mapping.scalar_type(),
            " ", slot_mapping.sizes());
  NEO_CHECK(key.is_cuda(), op, "key is on ", key.device(), "; this kernel needs CUDA tensors");
  check_on_device(op, key, "key", value, "value");
  check_on_device(op, key, "key", k_cache, "k_cache");
  check_on_device(op, key, "key", v_cache, "v_cache");
  check_on_device(op, key, "key", slot_mapping, "slot_mapping");
  if (num_tokens == 0) return;

  const c10::cuda::CUDAGuard device_guard(key.device());
  const at::Tensor key_rows = with_contiguous_rows(key);
  const at::Tensor value_rows = with_contiguous_rows(value);
  const at::Tensor slots = slot_mapping.contiguous();
  const bool vectorized =
      is_aligned_16(key_rows) && is_aligned_16(value_rows) && is_aligned_16(k_cache) &&
      is_aligned_16(v_cache) && stride_is_vector_multiple(key_rows, key_rows.stride(0)) &&
      stride_is_vector_multiple(key_rows, key_rows.stride(1)) &&
      stride_is_vector_multiple(value_rows, value_rows.stride(0)) &&
      stride_is_vector_multiple(value_rows, value_rows.stride(1));
  neo_cuda::launch_store_kv_cache(
      key_rows.data_ptr(), value_rows.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
      slots.data_ptr<int64_t>(), num_tokens, static_cast<int>(k_cache.size(1)),
      static_cast<int>(k_cache.size(3)), static_cast<int>(k_cache.size(2)), key_rows.stride(0),
      key_rows.stride(1), value_rows.stride(0), value_rows.stride(1), vectorized, dtype,
      current_stream(key));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---- swap_blocks --------------------------------------------------------------------------

// How the blocks of `tensor` (dimension 0) lie in memory, as ops/checks.py's `block_rows`
// computes it: the trailing dimensions that are contiguous form a chunk, the other dimensions
// after the first must collapse into rows at one pitch, and neither rows nor blocks may overlap.
// nullopt for any other layout.
std::optional<neo_cuda::BlockRows> block_rows(const at::Tensor& tensor) {
  const int64_t element = static_cast<int64_t>(tensor.element_size());
  const int64_t block_stride = tensor.dim() ? tensor.stride(0) : 1;
  if (tensor.numel() == 0) return neo_cuda::BlockRows{1, 0, 0, block_stride * element};
  int64_t dim = tensor.dim() - 1;
  int64_t chunk = 1;
  while (dim >= 1 && (tensor.size(dim) == 1 || tensor.stride(dim) == chunk)) {
    chunk *= tensor.size(dim);
    --dim;
  }
  int64_t rows = 1;
  int64_t pitch = chunk;
  int64_t expected = -1;  // the stride the next outer dimension needs to collapse
  for (; dim >= 1; --dim) {
    if (tensor.size(dim) == 1) continue;
    if (expected < 0) {
      pitch = tensor.stride(dim);
    } else if (tensor.stride(dim) != expected) {
      return std::nullopt;
    }
    expected = tensor.stride(dim) * tensor.size(dim);
    rows *= tensor.size(dim);
  }
  const int64_t blocks = tensor.size(0);
  if (blocks > 1 && block_stride < chunk) return std::nullopt;
  if (rows > 1 && (pitch < chunk || (blocks - 1) * block_stride + chunk > pitch)) {
    return std::nullopt;
  }
  return neo_cuda::BlockRows{rows, pitch * element, chunk * element, block_stride * element};
}

// `layout`, a block of one row, re-read as rows of `other`'s chunk (the rows of the other
// tensor's blocks, which have the same shape): a contiguous block is any split of itself.
neo_cuda::BlockRows split_like(const neo_cuda::BlockRows& layout, const neo_cuda::BlockRows& other) {
  return neo_cuda::BlockRows{other.rows, other.chunk_bytes, other.chunk_bytes,
                             layout.block_stride_bytes};
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  const char* op = "swap_blocks";
  NEO_CHECK(src.dim() >= 1 && dst.dim() == src.dim() &&
                src.sizes().slice(1) == dst.sizes().slice(1) &&
                src.scalar_type() == dst.scalar_type(),
            op, "src ", src.scalar_type(), " ", src.sizes(), " and dst ", dst.scalar_type(), " ",
            dst.sizes(), " must share dtype and block shape");
  std::optional<neo_cuda::BlockRows> src_layout = block_rows(src);
  std::optional<neo_cuda::BlockRows> dst_layout = block_rows(dst);
  if (src_layout && dst_layout && src_layout->rows != dst_layout->rows) {
    if (src_layout->rows == 1) src_layout = split_like(*src_layout, *dst_layout);
    else if (dst_layout->rows == 1) dst_layout = split_like(*dst_layout, *src_layout);
  }
  NEO_CHECK(src_layout && dst_layout && src_layout->rows == dst_layout->rows, op,
            "src (strides ", src.strides(), ") and dst (strides ", dst.strides(),
            ") must each lay a block out as rows of one contiguous chunk at one pitch, "
            "blocks side by side within a row (a contiguous tensor, or a whole pool with its "
            "block dimension moved first)");
  NEO_CHECK(block_mapping.scalar_type() == at::kLong && block_mapping.dim() == 2 &&
                block_mapping.size(1) == 2,
            op, "block_mapping must be int64 [n, 2], got ", block_mapping.scalar_type(), " ",
            block_mapping.sizes());
  NEO_CHECK(block_mapping.is_cpu(), op, "block_mapping must be a CPU tensor");
  NEO_CHECK(src.is_cuda() || dst.is_cuda(), op,
            "this kernel copies to or from a CUDA tensor, got src on ", src.device(),
            " and dst on ", dst.device());
  if (src.is_cuda() && dst.is_cuda()) {
    NEO_CHECK(src.device() == dst.device(), op, "src is on ", src.device(), " and dst on ",
              dst.device(), "; copies between two GPUs are not supported");
  } else {
    const at::Tensor& host = src.is_cuda() ? dst : src;
    NEO_CHECK(host.is_cpu(), op, "the non-CUDA tensor must be a CPU tensor, got ",
              host.device());
  }

  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t num_pairs = mapping.size(0);
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  for (int64_t row = 0; row < num_pairs; ++row) {
    const int64_t source_block = pairs[2 * row];
    const int64_t destination_block = pairs[2 * row + 1];
    NEO_CHECK(source_block >= 0 && source_block < src.size(0), op, "src block ", source_block,
              " in row ", row, " is outside the ", src.size(0), " blocks of src");
    NEO_CHECK(destination_block >= 0 && destination_block < dst.size(0), op, "dst block ",
              destination_block, " in row ", row, " is outside the ", dst.size(0),
              " blocks of dst");
  }
  // A dst block written by two rows would take whichever copy runs last.
  std::unordered_set<int64_t> destinations;
  for (int64_t row = 0; row < num_pairs; ++row) {
    NEO_CHECK(destinations.insert(pairs[2 * row + 1]).second, op, "dst block ",
              pairs[2 * row + 1], " in row ", row, " is already written by an earlier row");
  }
  if (num_pairs == 0) return;
  if (src.data_ptr() == dst.data_ptr()) {
    // Copies within one tensor run in mapping order, so a block must not be both read and
    // written.
    std::unordered_set<int64_t> sources;
    for (int64_t row = 0; row < num_pairs; ++row) sources.insert(pairs[2 * row]);
    for (int64_t row = 0; row < num_pairs; ++row) {
      NEO_CHECK(sources.count(pairs[2 * row + 1]) == 0, op, "block ", pairs[2 * row + 1],
                " is both a source and a destination within the same tensor");
    }
  }

  const at::Tensor& device_tensor = src.is_cuda() ? src : dst;
  cudaMemcpyKind kind = cudaMemcpyDeviceToDevice;
  if (!dst.is_cuda()) kind = cudaMemcpyDeviceToHost;
  if (!src.is_cuda()) kind = cudaMemcpyHostToDevice;
  if (kind != cudaMemcpyDeviceToDevice) {
    const at::Tensor& host = src.is_cuda() ? dst : src;
    if (!neo_cuda::is_pinned_host_memory(host.data_ptr())) {
      TORCH_WARN_ONCE(
          "neo.swap_blocks: the CPU tensor is not in pinned (page-locked) memory, so each copy "
          "blocks the calling thread until it completes; allocate the CPU cache with "
          "pin_memory=True");
    }
  }
  const c10::cuda::CUDAGuard device_guard(device_tensor.device());
  C10_CUDA_CHECK(neo_cuda::swap_blocks(src.data_ptr(), *src_layout, dst.data_ptr(), *dst_layout,
                                       pairs, num_pairs, kind, current_stream(device_tensor)));
}

// ---- prefill_attention --------------------------------------------------------------------

void prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const at::Tensor& cu_seqlens, int64_t max_seqlen,
                       double scale) {
  const char* op = "prefill_attention";
  NEO_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes(), op,
            "q must be [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, "
            "head_dim]; got ",
            q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  NEO_CHECK(out.sizes() == q.sizes(), op, "out shape ", out.sizes(), " differs from q ",
            q.sizes());
  NEO_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2), op,
            "q, k and v must share num_tokens and head_dim");
  NEO_CHECK(q.size(2) >= 1 && q.size(2) <= kMaxHeadDim, op, "head_dim must be from 1 to ",
            kMaxHeadDim, ", got ", q.size(2));
  NEO_CHECK(k.size(1) >= 1, op, "k and v must have num_kv_heads >= 1, got ", k.size(1));
  NEO_CHECK(q.size(1) >= 1, op, "q must have num_heads >= 1, got ", q.size(1));
  NEO_CHECK(q.size(1) % k.size(1) == 0, op, "num_heads ", q.size(1),
            " is not a multiple of num_kv_heads ", k.size(1));
  const DataType dtype = data_type_of(q, op, "q");
  NEO_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                q.scalar_type() == out.scalar_type(),
            op, "q, k, v and out must share a dtype, got ", q.scalar_type(), ", ", k.scalar_type(),
            ", ", v.scalar_type(), ", ", out.scalar_type());
  NEO_CHECK(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.dim() == 1 &&
                cu_seqlens.numel() >= 1,
            op, "cu_seqlens must be int32 [num_seqs + 1], got ", cu_seqlens.scalar_type(), " ",
            cu_seqlens.sizes());
  const int64_t num_tokens = q.size(0);
  const int64_t head_dim = q.size(2);
  NEO_CHECK(num_tokens == 0 || cu_seqlens.numel() >= 2, op, "cu_seqlens ", cu_seqlens.sizes(),
            " holds no prompt for ", num_tokens, " tokens");
  const int64_t min_seqlen = num_tokens == 0 ? 0 : 1;
  NEO_CHECK(max_seqlen >= min_seqlen, op, "max_seqlen must be >= ", min_seqlen, " with ",
            num_tokens, " tokens, got ", max_seqlen);
  NEO_CHECK(q.is_cuda(), op, "q is on ", q.device(), "; this kernel needs CUDA tensors");
  check_on_device(op, q, "q", k, "k");
  check_on_device(op, q, "q", v, "v");
  check_on_device(op, q, "q", out, "out");
  check_on_device(op, q, "q", cu_seqlens, "cu_seqlens");
  check_float32_scalar(op, "scale", scale);
  if (num_tokens == 0) return;

  const c10::cuda::CUDAGuard device_guard(q.device());
  const at::Tensor queries = with_contiguous_rows(q);
  const at::Tensor keys = with_contiguous_rows(k);
  const at::Tensor values = with_contiguous_rows(v);
  const at::Tensor bounds = cu_seqlens.contiguous();
  const bool flash = dtype != DataType::Float32 && head_dim % 8 == 0 && head_dim <= kMaxHeadDim;
  if (flash) {
    // PyTorch's flash attention, variable-length entry: [total_tokens, heads, head_dim].
    const auto result = at::_flash_attention_forward(
        queries, keys, values, bounds, bounds, max_seqlen, max_seqlen, /*dropout_p=*/0.0,
        /*is_causal=*/true, /*return_debug_mask=*/false, std::optional<double>(scale));
    out.copy_(std::get<0>(result));
    return;
  }
  NEO_CHECK(head_dim <= neo_cuda::kPrefillMaxHeadDim, op, "head_dim ", head_dim,
            " is above the ", neo_cuda::kPrefillMaxHeadDim, " this kernel supports for ",
            q.scalar_type());
  at::Tensor target = out.stride(-1) == 1 ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
  neo_cuda::launch_prefill_attention(
      target.data_ptr(), target.stride(0), target.stride(1), queries.data_ptr(),
      queries.stride(0), queries.stride(1), keys.data_ptr(), keys.stride(0), keys.stride(1),
      values.data_ptr(), values.stride(0), values.stride(1), bounds.data_ptr<int32_t>(),
      static_cast<int>(bounds.numel() - 1), num_tokens, static_cast<int>(q.size(1)),
      static_cast<int>(k.size(1)), static_cast<int>(head_dim), static_cast<float>(scale), dtype,
      current_stream(q));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!target.is_same(out)) out.copy_(target);
}

// ---- RMSNorm ------------------------------------------------------------------------------

// Checks shared by rms_norm and fused_add_rms_norm; returns the weight's DataType.
DataType check_rms_norm(const char* op, const at::Tensor& input, const at::Tensor& weight,
                        const at::Tensor& other, const char* other_name, double epsilon) {
  NEO_CHECK(input.dim() == 2 && weight.dim() == 1 && weight.size(0) == input.size(1), op,
            "input must be [num_tokens, hidden] and weight [hidden], got ", input.sizes(), " and ",
            weight.sizes());
  NEO_CHECK(other.sizes() == input.sizes() && other.scalar_type() == input.scalar_type(), op,
            other_name, " ", other.scalar_type(), " ", other.sizes(), " must match input ",
            input.scalar_type(), " ", input.sizes());
  data_type_of(input, op, "input");
  NEO_CHECK(weight.scalar_type() == input.scalar_type() || weight.scalar_type() == at::kFloat, op,
            "weight dtype must be the input's (", input.scalar_type(), ") or float32, got ",
            weight.scalar_type());
  NEO_CHECK(input.is_cuda(), op, "input is on ", input.device(),
            "; this kernel needs CUDA tensors");
  check_on_device(op, input, "input", weight, "weight");
  check_on_device(op, input, "input", other, other_name);
  check_float32_scalar(op, "epsilon", epsilon);
  NEO_CHECK(epsilon > 0, op, "epsilon must be > 0, got ", epsilon);
  return weight.scalar_type() == at::kFloat ? DataType::Float32
                                            : data_type_of(weight, op, "weight");
}

// Whether rows of `hidden` elements at these tensors' row strides allow 16-byte vectors.
bool rows_allow_vectors(int64_t hidden, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* tensor : tensors) {
    if (!is_aligned_16(*tensor) || !stride_is_vector_multiple(*tensor, hidden) ||
        (tensor->dim() == 2 && !stride_is_vector_multiple(*tensor, tensor->stride(0)))) {
      return false;
    }
  }
  return true;
}

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
              double epsilon) {
  const char* op = "rms_norm";
  const DataType weight_dtype = check_rms_norm(op, input, weight, out, "out", epsilon);
  const DataType dtype = data_type_of(input, op, "input");
  const int64_t num_tokens = input.size(0);
  const int64_t hidden = input.size(1);
  if (num_tokens == 0 || hidden == 0) return;

  const c10::cuda::CUDAGuard device_guard(input.device());
  const at::Tensor rows = with_contiguous_rows(input);
  const at::Tensor weights = weight.contiguous();
  at::Tensor target = out.stride(-1) == 1 ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
  const bool vectorized = rows_allow_vectors(hidden, {&rows, &target, &weights});
  neo_cuda::launch_rms_norm(target.data_ptr(), target.stride(0), rows.data_ptr(), rows.stride(0),
                            weights.data_ptr(), num_tokens, static_cast<int>(hidden),
                            static_cast<float>(epsilon), vectorized, dtype, weight_dtype,
                            current_stream(input));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!target.is_same(out)) out.copy_(target);
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon) {
  const char* op = "fused_add_rms_norm";
  const DataType weight_dtype =
      check_rms_norm(op, input, weight, residual, "residual", epsilon);
  const DataType dtype = data_type_of(input, op, "input");
  const int64_t num_tokens = input.size(0);
  const int64_t hidden = input.size(1);
  if (num_tokens == 0 || hidden == 0) return;

  const c10::cuda::CUDAGuard device_guard(input.device());
  at::Tensor input_rows = with_contiguous_rows(input);
  at::Tensor residual_rows = with_contiguous_rows(residual);
  const at::Tensor weights = weight.contiguous();
  const bool vectorized = rows_allow_vectors(hidden, {&input_rows, &residual_rows, &weights});
  neo_cuda::launch_fused_add_rms_norm(
      input_rows.data_ptr(), input_rows.stride(0), residual_rows.data_ptr(),
      residual_rows.stride(0), weights.data_ptr(), num_tokens, static_cast<int>(hidden),
      static_cast<float>(epsilon), vectorized, dtype, weight_dtype, current_stream(input));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!input_rows.is_same(input)) input.copy_(input_rows);
  if (!residual_rows.is_same(residual)) residual.copy_(residual_rows);
}

// ---- rotary_embedding ---------------------------------------------------------------------

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      const at::Tensor& cos_sin_cache) {
  const char* op = "rotary_embedding";
  NEO_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1, op,
            "positions must be int64 [num_tokens], got ", positions.scalar_type(), " ",
            positions.sizes());
  NEO_CHECK(query.dim() == 3 && key.dim() == 3 && query.size(0) == positions.size(0) &&
                key.size(0) == positions.size(0),
            op, "query [T, H, D] and key [T, KVH, D] must have T = ", positions.size(0),
            " tokens, got ", query.sizes(), " and ", key.sizes());
  NEO_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) % 2 == 0 &&
                cos_sin_cache.size(1) <= query.size(2) && cos_sin_cache.size(1) <= key.size(2),
            op,
            "cos_sin_cache must be [max_positions, rotary_dim] with an even rotary_dim <= "
            "head_dim, got ",
            cos_sin_cache.sizes());
  NEO_CHECK(cos_sin_cache.scalar_type() == at::kFloat, op, "cos_sin_cache must be float32");
  const DataType dtype = data_type_of(query, op, "query");
  NEO_CHECK(key.scalar_type() == query.scalar_type(), op, "key dtype ", key.scalar_type(),
            " differs from query dtype ", query.scalar_type());
  NEO_CHECK(query.is_cuda(), op, "query is on ", query.device(),
            "; this kernel needs CUDA tensors");
  check_on_device(op, query, "query", key, "key");
  check_on_device(op, query, "query", positions, "positions");
  check_on_device(op, query, "query", cos_sin_cache, "cos_sin_cache");
  const int64_t num_tokens = query.size(0);
  const int64_t rotary_dim = cos_sin_cache.size(1);
  if (num_tokens == 0 || rotary_dim == 0) return;

  const c10::cuda::CUDAGuard device_guard(query.device());
  at::Tensor query_rows = with_contiguous_rows(query);
  at::Tensor key_rows = with_contiguous_rows(key);
  const at::Tensor token_positions = positions.contiguous();
  const at::Tensor table = cos_sin_cache.contiguous();
  neo_cuda::launch_rotary_embedding(
      token_positions.data_ptr<int64_t>(), query_rows.data_ptr(), query_rows.stride(0),
      query_rows.stride(1), key_rows.data_ptr(), key_rows.stride(0), key_rows.stride(1),
      table.data_ptr<float>(), num_tokens, static_cast<int>(query.size(1)),
      static_cast<int>(key.size(1)), static_cast<int>(rotary_dim), dtype, current_stream(query));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!query_rows.is_same(query)) query.copy_(query_rows);
  if (!key_rows.is_same(key)) key.copy_(key_rows);
}

// ---- silu_and_mul -------------------------------------------------------------------------

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  const char* op = "silu_and_mul";
  NEO_CHECK(input.dim() == 2 && input.size(1) % 2 == 0, op,
            "input must be [num_tokens, 2 * intermediate], got ", input.sizes());
  NEO_CHECK(out.dim() == 2 && out.size(0) == input.size(0) &&
                out.size(1) == input.size(1) / 2 && out.scalar_type() == input.scalar_type(),
            op, "out must be ", input.scalar_type(), " [", input.size(0), ", ",
            input.size(1) / 2, "], got ", out.scalar_type(), " ", out.sizes());
  const DataType dtype = data_type_of(input, op, "input");
  NEO_CHECK(input.is_cuda(), op, "input is on ", input.device(),
            "; this kernel needs CUDA tensors");
  check_on_device(op, input, "input", out, "out");
  const int64_t num_tokens = input.size(0);
  const int64_t intermediate = out.size(1);
  if (num_tokens == 0 || intermediate == 0) return;

  const c10::cuda::CUDAGuard device_guard(input.device());
  const at::Tensor rows = with_contiguous_rows(input);
  at::Tensor target = out.stride(-1) == 1 ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
  const bool vectorized = rows_allow_vectors(intermediate, {&rows, &target});
  neo_cuda::launch_silu_and_mul(target.data_ptr(), target.stride(0), rows.data_ptr(),
                                rows.stride(0), num_tokens, static_cast<int>(intermediate),
                                vectorized, dtype, current_stream(input));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!target.is_same(out)) out.copy_(target);
}

void register_kernels(torch::Library& library) {
  library.impl("paged_decode_attention", &paged_decode_attention);
  library.impl("store_kv_cache", &store_kv_cache);
  library.impl("swap_blocks", &swap_blocks);
  library.impl("prefill_attention", &prefill_attention);
  library.impl("rms_norm", &rms_norm);
  library.impl("fused_add_rms_norm", &fused_add_rms_norm);
  library.impl("rotary_embedding", &rotary_embedding);
  library.impl("silu_and_mul", &silu_and_mul);
}

}  // namespace

// The schemas are declared from Python (ops/library.py); these register the kernels.
TORCH_LIBRARY_IMPL(neo, CUDA, library) { register_kernels(library); }
TORCH_LIBRARY_IMPL(neo_cuda, CUDA, library) { register_kernels(library); }

// `import neo.ops._cuda_kernels` loads this library (running the registrations above). The
// module holds three attributes: `decode_variants`, the names of the decode kernel variants in
// launcher order, `decode_variant_variable`, the environment variable that selects one, and
// `decode_short_context_tokens`, the block-table span up to which the launcher picks its
// short-context variant.
PyMODINIT_FUNC PyInit__cuda_kernels(void) {
  static struct PyModuleDef definition = {
      PyModuleDef_HEAD_INIT, "_cuda_kernels", nullptr, -1, nullptr, nullptr, nullptr, nullptr,
      nullptr};
  PyObject* module = PyModule_Create(&definition);
  if (module == nullptr) return nullptr;
  PyObject* names = PyTuple_New(neo_cuda::kDecodeVariantCount);
  if (names == nullptr) {
    Py_DECREF(module);
    return nullptr;
  }
  for (int index = 0; index < neo_cuda::kDecodeVariantCount; ++index) {
    PyObject* name = PyUnicode_FromString(neo_cuda::kDecodeVariants[index].name);
    if (name == nullptr) {
      Py_DECREF(names);
      Py_DECREF(module);
      return nullptr;
    }
    PyTuple_SET_ITEM(names, index, name);  // steals the reference
  }
  if (PyModule_AddObject(module, "decode_variants", names) < 0) {
    Py_DECREF(names);
    Py_DECREF(module);
    return nullptr;
  }
  if (PyModule_AddStringConstant(module, "decode_variant_variable",
                                 neo_cuda::kDecodeVariantVariable) < 0 ||
      PyModule_AddIntConstant(module, "decode_short_context_tokens",
                              neo_cuda::kShortContextTokens) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
