// The offloading pipeline's host stage, ordered on CUDA streams.
//
// torch.classes.neo_pipeline.HostDecodeStage: one per sub-batch of the pipeline. It owns
// the sub-batch's pinned row buffers and host metadata (filled by the executor once per iteration)
// and, per layer, one call
//
//   stage.start(layer, query_rows, key_rows, value_rows, output_rows, k_cache, v_cache)
//
// queues on the copy stream, behind an event recorded on the current (compute) stream:
// the copies of the sub-batch's host-decode rows into the pinned buffers, a CUDA host function
// that stores the new K/V into the host cache and runs paged decode attention there, the copy
// of the result into output_rows, and an event that stage.finish() makes the compute stream
// wait for. No Python and no GIL run between the layers, and the launching thread never blocks
// on the host.
//
// The host function calls the two CPU kernels the stage was constructed with, named by their
// operators (one implementation's ops, such as "neo_ispc::paged_decode_attention" and
// "neo_ispc::store_kv_cache": neo.ops' Implementation.qualified_name), not whatever
// torch.ops.neo dispatches to. They are looked up once, when the stage is constructed, and must
// have the schemas of neo::paged_decode_attention and neo::store_kv_cache and a CPU kernel. They
// must be compiled kernels (neo.ops' Implementation.native): a host function runs on a thread of
// the CUDA driver that must never wait for the GIL, which a kernel written in Python takes. The
// caller chooses them, since the dispatcher does not tell the two kinds apart.
//
// The host function reads how many rows are real from the `num_decodes` buffer at run time, so the
// same calls captured in a CUDA graph (the copies become memcpy nodes, the host function a host
// node) replay iterations whose row counts are at most the captured ones: padding rows are
// copied but not attended. Each layer's host function gets a record that lives as long as the
// stage, which is what a captured host node points to.
//
// A host function cannot raise into Python: a failure is written into `failure` (uint8: first
// byte 1, then the message, NUL-terminated) and later host functions of the iteration skip
// their work; the caller reads it once the stream has passed them. Each host function adds its
// own run time to `host_seconds` (float64 [1]).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/custom_class.h>
#include <torch/library.h>

namespace {

constexpr const char* kName = "neo_pipeline.HostDecodeStage";

void record_failure(const at::Tensor& failure, const char* message) {
  auto* bytes = failure.data_ptr<uint8_t>();
  const size_t capacity = static_cast<size_t>(failure.numel());
  if (capacity < 2 || bytes[0] != 0) return;  // keep the first failure
  const size_t length = std::min(std::strlen(message), capacity - 2);
  std::memcpy(bytes + 1, message, length);
  bytes[1 + length] = 0;
  bytes[0] = 1;
}

void check_host(const at::Tensor& tensor, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK_VALUE(tensor.is_cpu() && tensor.is_contiguous() && tensor.scalar_type() == dtype &&
                        tensor.dim() == dim,
                    kName, ": ", name, " must be a contiguous ", dim, "-d ", dtype,
                    " CPU tensor, got ", tensor.scalar_type(), " ", tensor.sizes(), " on ",
                    tensor.device());
}

// The CPU kernels' signatures, as the schemas in ops/schemas.py give them.
using StoreKvCache = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                          const at::Tensor&);
using PagedDecodeAttention = void(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&, double);

// The operator `name` (the constructor's argument `<op>_op`), checked to be declared, to have
// the schema of neo::<op> (in whatever namespace) and to have a CPU kernel.
template <typename Signature>
c10::TypedOperatorHandle<Signature> find_cpu_kernel(const std::string& name, const std::string& op) {
  auto& dispatcher = c10::Dispatcher::singleton();
  const auto expected = dispatcher.findSchema({"neo::" + op, ""});
  TORCH_CHECK_VALUE(expected.has_value(), kName, ": neo::", op,
                    " is not declared; import neo.ops before creating a stage");
  const auto handle = dispatcher.findSchema({name, ""});
  TORCH_CHECK_VALUE(handle.has_value(), kName, ": ", op, "_op names no declared operator: '", name,
                    "' (expected one implementation's op, such as neo_ispc::", op, ")");
  const c10::FunctionSchema& schema = handle->schema();
  TORCH_CHECK_VALUE(
      expected->schema().cloneWithName(schema.name(), schema.overload_name()) == schema, kName,
      ": ", op, "_op '", name, "' does not have the schema of neo::", op, ": ", schema);
  TORCH_CHECK_VALUE(handle->hasKernelForDispatchKey(c10::DispatchKey::CPU), kName, ": ", op,
                    "_op '", name, "' has no CPU kernel (the stage calls a compiled CPU kernel)");
  return handle->typed<Signature>();
}

class HostDecodeStage;

// What one layer's host function needs: its stage and that layer's host cache.
struct LayerCall {
  HostDecodeStage* stage = nullptr;
  at::Tensor k_cache, v_cache;
};

class HostDecodeStage : public torch::CustomClassHolder {
 public:
  // Pinned row buffers: query, output [R, H, D]; key, value [R, KVH, D]. Host metadata of the
  // sub-batch's iteration (rows [0, num_decodes[0]) are read): slot_mapping int64 [R]; block_table
  // int32 [R, max_blocks]; seq_lens int32 [R]; num_decodes int64 [1]. failure uint8 [>= 2] and
  // host_seconds float64 [1] are shared by the stages of one executor. The copy stream is
  // given by its (id, device index, device type) as torch.cuda.Stream reports them. The CPU
  // kernels the host functions call come last, by operator name (see the file comment).
  HostDecodeStage(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor output,
                  at::Tensor slot_mapping, at::Tensor block_table, at::Tensor seq_lens,
                  at::Tensor num_decodes, at::Tensor failure, at::Tensor host_seconds,
                  double scale, int64_t num_threads, int64_t num_layers, int64_t copy_stream_id,
                  int64_t copy_stream_device_index, int64_t copy_stream_device_type,
                  const std::string& paged_decode_attention_op,
                  const std::string& store_kv_cache_op)
      : query_(std::move(query)), key_(std::move(key)), value_(std::move(value)),
        output_(std::move(output)), slot_mapping_(std::move(slot_mapping)),
        block_table_(std::move(block_table)), seq_lens_(std::move(seq_lens)),
        num_decodes_(std::move(num_decodes)), failure_(std::move(failure)),
        host_seconds_(std::move(host_seconds)), scale_(scale),
        num_threads_(num_threads),
        attention_(find_cpu_kernel<PagedDecodeAttention>(paged_decode_attention_op,
                                                         "paged_decode_attention")),
        store_(find_cpu_kernel<StoreKvCache>(store_kv_cache_op, "store_kv_cache")),
        copy_stream_(c10::cuda::CUDAStream::unpack3(
            copy_stream_id, static_cast<c10::DeviceIndex>(copy_stream_device_index),
            static_cast<c10::DeviceType>(copy_stream_device_type))) {
    const auto dtype = query_.scalar_type();
    check_host(query_, "query", dtype, 3);
    check_host(output_, "output", dtype, 3);
    check_host(key_, "key", dtype, 3);
    check_host(value_, "value", dtype, 3);
    check_host(slot_mapping_, "slot_mapping", at::kLong, 1);
    check_host(block_table_, "block_table", at::kInt, 2);
    check_host(seq_lens_, "seq_lens", at::kInt, 1);
    check_host(num_decodes_, "num_decodes", at::kLong, 1);
    check_host(failure_, "failure", at::kByte, 1);
    check_host(host_seconds_, "host_seconds", at::kDouble, 1);
    const int64_t rows = query_.size(0);
    TORCH_CHECK_VALUE(output_.sizes() == query_.sizes() && key_.sizes() == value_.sizes() &&
                          key_.size(0) == rows && slot_mapping_.size(0) == rows &&
                          block_table_.size(0) == rows && seq_lens_.size(0) == rows,
                      kName, ": the row buffers and metadata disagree on their row counts");
    TORCH_CHECK_VALUE(num_decodes_.numel() == 1 && failure_.numel() >= 2 &&
                          host_seconds_.numel() == 1,
                      kName, ": num_decodes needs 1 element, failure at least 2, host_seconds 1");
    TORCH_CHECK_VALUE(num_threads >= 1 && num_layers >= 1, kName,
                      ": num_threads and num_layers must be >= 1");
    TORCH_CHECK_VALUE(copy_stream_.device_type() == c10::DeviceType::CUDA, kName,
                      ": the copy stream must be a CUDA stream");
    calls_.resize(static_cast<size_t>(num_layers));
    for (auto& call : calls_) call.stage = this;
    c10::cuda::CUDAGuard guard(copy_stream_.device_index());
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  }

  ~HostDecodeStage() override {
    // Nothing of this stage may still be queued: the executor's iterations end with the device
    // past their host functions, and the graphs that point at it are released first.
    cudaEventDestroy(ready_);
    cudaEventDestroy(done_);
  }

  HostDecodeStage(const HostDecodeStage&) = delete;
  HostDecodeStage& operator=(const HostDecodeStage&) = delete;

  // Queue one layer's host work (see the file comment). query_rows [n, H, D], key_rows and
  // value_rows [n, KVH, D], output_rows [n, H, D]: contiguous rows on the compute device, n at
  // most the buffers' rows.
  void start(int64_t layer, at::Tensor query_rows, at::Tensor key_rows, at::Tensor value_rows,
             at::Tensor output_rows, at::Tensor k_cache, at::Tensor v_cache) {
    TORCH_CHECK_VALUE(layer >= 0 && layer < static_cast<int64_t>(calls_.size()), kName,
                      ": layer ", layer, " is outside [0, ", calls_.size(), ")");
    TORCH_CHECK_VALUE(k_cache.is_cpu() && v_cache.is_cpu(), kName,
                      ": the host caches must be CPU tensors");
    check_rows(query_rows, query_, "query_rows");
    check_rows(key_rows, key_, "key_rows");
    check_rows(value_rows, value_, "value_rows");
    check_rows(output_rows, output_, "output_rows");
    const int64_t rows = query_rows.size(0);
    TORCH_CHECK_VALUE(key_rows.size(0) == rows && value_rows.size(0) == rows &&
                          output_rows.size(0) == rows,
                      kName, ": query, key, value and output rows differ in number");
    const auto device = query_rows.device().index();
    const cudaStream_t compute = c10::cuda::getCurrentCUDAStream(device).stream();
    const cudaStream_t copy = copy_stream_.stream();
    C10_CUDA_CHECK(cudaEventRecord(ready_, compute));
    C10_CUDA_CHECK(cudaStreamWaitEvent(copy, ready_, 0));
    copy_to_host(query_, query_rows, copy);
    copy_to_host(key_, key_rows, copy);
    copy_to_host(value_, value_rows, copy);
    LayerCall& call = calls_[static_cast<size_t>(layer)];
    call.k_cache = std::move(k_cache);
    call.v_cache = std::move(v_cache);
    C10_CUDA_CHECK(cudaLaunchHostFunc(copy, &HostDecodeStage::run_layer, &call));
    if (rows > 0) {
      C10_CUDA_CHECK(cudaMemcpyAsync(output_rows.data_ptr(), output_.data_ptr(), bytes(output_rows),
                                     cudaMemcpyHostToDevice, copy));
    }
    C10_CUDA_CHECK(cudaEventRecord(done_, copy));
    // The compute stream may free these rows as soon as it has queued its next stage: the
    // allocator must not hand their memory out again before the copy stream has read them.
    for (const at::Tensor* tensor : {&query_rows, &key_rows, &value_rows, &output_rows}) {
      c10::cuda::CUDACachingAllocator::recordStream(tensor->storage().data_ptr(), copy_stream_);
    }
  }

  // The current (compute) stream waits for the last started layer's output rows.
  void finish() {
    const cudaStream_t compute = c10::cuda::getCurrentCUDAStream(copy_stream_.device_index()).stream();
    C10_CUDA_CHECK(cudaStreamWaitEvent(compute, done_, 0));
  }

 private:
  static int64_t bytes(const at::Tensor& tensor) {
    return tensor.numel() * static_cast<int64_t>(tensor.element_size());
  }

  void check_rows(const at::Tensor& rows, const at::Tensor& buffer, const char* name) const {
    TORCH_CHECK_VALUE(rows.is_cuda() && rows.is_contiguous() &&
                          rows.scalar_type() == buffer.scalar_type() && rows.dim() == 3 &&
                          rows.size(1) == buffer.size(1) && rows.size(2) == buffer.size(2) &&
                          rows.size(0) <= buffer.size(0),
                      kName, ": ", name, " must be contiguous CUDA rows [n <= ", buffer.size(0),
                      ", ", buffer.size(1), ", ", buffer.size(2), "] of ", buffer.scalar_type(),
                      ", got ", rows.scalar_type(), " ", rows.sizes(), " on ", rows.device());
  }

  static void copy_to_host(const at::Tensor& buffer, const at::Tensor& rows, cudaStream_t stream) {
    if (rows.numel() == 0) return;
    C10_CUDA_CHECK(cudaMemcpyAsync(buffer.data_ptr(), rows.data_ptr(), bytes(rows),
                                   cudaMemcpyDeviceToHost, stream));
  }

  static void CUDART_CB run_layer(void* data) {
    const auto* call = static_cast<const LayerCall*>(data);
    call->stage->run_on_host(*call);
  }

  void run_on_host(const LayerCall& call) {
    if (failure_.data_ptr<uint8_t>()[0] != 0) return;  // an earlier layer of this iteration failed
    const auto begin = std::chrono::steady_clock::now();
    try {
      c10::InferenceMode inference_mode;
      if (at::get_num_threads() != num_threads_) at::set_num_threads(num_threads_);
      const int64_t decodes = num_decodes_.data_ptr<int64_t>()[0];
      TORCH_CHECK_VALUE(decodes >= 0 && decodes <= query_.size(0), kName, ": num_decodes ",
                        decodes, " is outside [0, ", query_.size(0), "]");
      at::Tensor k_cache = call.k_cache;
      at::Tensor v_cache = call.v_cache;
      if (decodes > 0) {
        store_.call(key_.narrow(0, 0, decodes), value_.narrow(0, 0, decodes), k_cache, v_cache,
                    slot_mapping_.narrow(0, 0, decodes));
        at::Tensor output = output_.narrow(0, 0, decodes);
        attention_.call(output, query_.narrow(0, 0, decodes), k_cache, v_cache,
                        block_table_.narrow(0, 0, decodes), seq_lens_.narrow(0, 0, decodes),
                        scale_);
      }
    } catch (const std::exception& error) {
      record_failure(failure_, error.what());
    } catch (...) {
      record_failure(failure_, "unknown error in host decode attention");
    }
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - begin;
    host_seconds_.data_ptr<double>()[0] += elapsed.count();
  }

  at::Tensor query_, key_, value_, output_;
  at::Tensor slot_mapping_, block_table_, seq_lens_, num_decodes_;
  at::Tensor failure_, host_seconds_;
  double scale_;
  int64_t num_threads_;
  c10::TypedOperatorHandle<PagedDecodeAttention> attention_;  // the CPU kernels
  c10::TypedOperatorHandle<StoreKvCache> store_;
  c10::cuda::CUDAStream copy_stream_;
  std::vector<LayerCall> calls_;  // one per layer; never resized (host nodes point into it)
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t done_ = nullptr;
};

}  // namespace

TORCH_LIBRARY(neo_pipeline, library) {
  library.class_<HostDecodeStage>("HostDecodeStage")
      .def(torch::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                       at::Tensor, at::Tensor, at::Tensor, at::Tensor, double, int64_t, int64_t,
                       int64_t, int64_t, int64_t, std::string, std::string>())
      .def("start", &HostDecodeStage::start)
      .def("finish", &HostDecodeStage::finish);
}
