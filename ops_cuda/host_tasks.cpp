// Host decode attention ordered on a CUDA stream (the offloading pipeline's hand-off).
//
// torch.ops.neo_pipeline.enqueue_host_decode(...) queues, on the current CUDA stream, a host
// function that stores the new tokens' K/V into the host cache and runs paged decode attention
// over it with the CPU kernels of torch.ops.neo (ISPC). Copies to the pinned inputs queued
// before it on the same stream have landed when it runs, and copies of its output queued after
// it start only once it has returned; the GPU side waits for those through events. No Python
// and no GIL between the layers: the thread launching GPU work never blocks on the host.
//
// A host function cannot raise into Python: a failure is written into `failure` (uint8 CPU
// tensor: first byte 1, then the message, NUL-terminated), which the caller reads once the
// stream has passed it.
#include <algorithm>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

namespace {

struct HostDecodeTask {
  at::Tensor out, query, key, value, k_cache, v_cache, slot_mapping, block_table, seq_lens;
  std::optional<at::Tensor> offload_key, offload_value, offload_slot_mapping;
  at::Tensor failure;
  double scale;
  int64_t num_threads;
};

void record_failure(const at::Tensor& failure, const char* message) {
  auto* bytes = failure.data_ptr<uint8_t>();
  const size_t capacity = static_cast<size_t>(failure.numel());
  if (capacity < 2 || bytes[0] != 0) return;  // keep the first failure
  const size_t length = std::min(std::strlen(message), capacity - 2);
  std::memcpy(bytes + 1, message, length);
  bytes[1 + length] = 0;
  bytes[0] = 1;
}

void CUDART_CB run_host_decode(void* data) {
  std::unique_ptr<HostDecodeTask> task(static_cast<HostDecodeTask*>(data));
  if (task->failure.data_ptr<uint8_t>()[0] != 0) return;  // an earlier task of this batch failed
  try {
    c10::InferenceMode inference_mode;
    if (at::get_num_threads() != task->num_threads) at::set_num_threads(task->num_threads);
    static const auto store = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("neo::store_kv_cache", "")
                                  .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&,
                                              at::Tensor&, const at::Tensor&)>();
    static const auto attention =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("neo::paged_decode_attention", "")
            .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, double)>();
    if (task->offload_key.has_value()) {
      store.call(*task->offload_key, *task->offload_value, task->k_cache, task->v_cache,
                 *task->offload_slot_mapping);
    }
    if (task->query.size(0) > 0) {
      store.call(task->key, task->value, task->k_cache, task->v_cache, task->slot_mapping);
      attention.call(task->out, task->query, task->k_cache, task->v_cache, task->block_table,
                     task->seq_lens, task->scale);
    }
  } catch (const std::exception& error) {
    record_failure(task->failure, error.what());
  } catch (...) {
    record_failure(task->failure, "unknown error in host decode attention");
  }
}

// All tensors on the CPU. out, query [n, H, D]; key, value [n, KVH, D]; caches one layer of the
// host pool; slot_mapping int64 [n]; block_table int32 [n, max_blocks]; seq_lens int32 [n];
// offload_* the K/V of prefill tokens bound for the host cache and their slots.
void enqueue_host_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
                         const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& block_table,
                         const at::Tensor& seq_lens, double scale,
                         const std::optional<at::Tensor>& offload_key,
                         const std::optional<at::Tensor>& offload_value,
                         const std::optional<at::Tensor>& offload_slot_mapping,
                         at::Tensor& failure, int64_t num_threads) {
  const std::initializer_list<const at::Tensor*> tensors = {
      &out, &query, &key, &value, &k_cache, &v_cache, &slot_mapping, &block_table, &seq_lens,
      &failure};
  for (const at::Tensor* tensor : tensors) {
    TORCH_CHECK_VALUE(tensor->is_cpu(), "neo_pipeline.enqueue_host_decode: every tensor must be "
                      "on the CPU");
  }
  TORCH_CHECK_VALUE(failure.scalar_type() == at::kByte && failure.is_contiguous() &&
                        failure.numel() >= 2,
                    "neo_pipeline.enqueue_host_decode: failure must be a contiguous uint8 tensor");
  TORCH_CHECK_VALUE(offload_key.has_value() == offload_value.has_value() &&
                        offload_key.has_value() == offload_slot_mapping.has_value(),
                    "neo_pipeline.enqueue_host_decode: give all three offload tensors or none");
  TORCH_CHECK_VALUE(num_threads >= 1, "neo_pipeline.enqueue_host_decode: num_threads must be >= 1");
  auto task = std::make_unique<HostDecodeTask>(HostDecodeTask{
      out, query, key, value, k_cache, v_cache, slot_mapping, block_table, seq_lens, offload_key,
      offload_value, offload_slot_mapping, failure, scale, num_threads});
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  C10_CUDA_CHECK(cudaLaunchHostFunc(stream, run_host_decode, task.get()));
  task.release();  // owned by the host function from now on
}

}  // namespace

TORCH_LIBRARY(neo_pipeline, library) {
  library.def(
      "enqueue_host_decode(Tensor(a!) out, Tensor query, Tensor key, Tensor value, "
      "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_table, "
      "Tensor seq_lens, float scale, Tensor? offload_key, Tensor? offload_value, "
      "Tensor? offload_slot_mapping, Tensor(d!) failure, int num_threads) -> ()");
}

TORCH_LIBRARY_IMPL(neo_pipeline, CPU, library) {
  library.impl("enqueue_host_decode", &enqueue_host_decode);
}
