#!/usr/bin/env bash
# One call on a GPU machine: build, test and benchmark neo, results in one folder.
#
#   bash benchmarks/gpu_session.sh STAGE [STAGE...]
#
# Stages:
#   build        build the CPU (ISPC) and CUDA extensions (or reuse prebuilt ones, see below)
#   build-cpu    rebuild only the CPU (ISPC) extension, reusing a prebuilt CUDA one
#   ops-tests    every op test on CUDA and on this host's CPU (ISPC), CUDA extras, opcheck, input checks
#   sanitizer    compute-sanitizer memcheck over the attention, KV-store and swap CUDA tests
#   kernels      CUDA kernel benchmark (vs SDPA, vs copy bandwidth) and the CPU decode-attention
#                benchmark (ISPC / numba / SDPA vs read bandwidth, all host threads)
#   engine-tests the engine on CUDA: the host stage and pipeline graphs, float32 tokens vs CPU and
#                transformers, bf16 logits, the model families, stage orders, CPU attention kernels,
#                the op registry, and the hardware work queues a CUDA engine asks for
#   engine       gpu-only Llama-3.1-8B: decode iterations vs roofline (async scheduling on, then off),
#                offline throughput
#   handoff      cost of one layer's host attention inside the engine vs alone (8B, 32B shapes;
#                HANDOFF_MODELS, HANDOFF_ARGS)
#   offload-32b / offload-8b-poor / offload-8b-full / offload-threads / offload-70b-tp2
#                policies side by side (offload-70b-tp2: two GPUs, tensor parallelism)
#                (OFFLOAD_ARGS adds arguments, e.g. --policies neo --workloads ...,
#                --gpu-kv-cache-gib 4 for the pool an 80 GB H100 leaves 70B on a larger GPU,
#                --no-cuda-graphs --no-async-scheduling)
#   tp-scaling   gpu-only Llama-3.1-8B offline on one GPU and on two (graphs and async scheduling,
#                the defaults), and on two with synchronous scheduling and eagerly (TP_SCALING_RUNS
#                picks runs: RANKS[-eager][-sync], e.g. "1 2 2-eager-sync")
#   tp-tests     two GPUs: greedy tokens of two ranks against one (eager, graphs, graphs with async
#                scheduling; gpu-only, neo async and lockstep); the CPU rank tests run in CI
#   parts-tests  host batches in parts, async scheduling and the engine on CUDA (one GPU)
#   tp-timeline  two GPUs: Llama-3.1-70B shapes under neo (graphs across ranks, async scheduling, the
#                pool an H100 leaves), a torch.profiler timeline of iterations TIMELINE_ITERATIONS
#                (default 300:330) on both ranks, compressed (files/timeline/*.json.xz), and their
#                summary (benchmarks/timeline_summary.py: files/tp-timeline-summary.txt)
#   tp-smoke     two GPUs: Llama-3.1-8B under neo with host batches (perf model zero, a small GPU
#                pool, so most decodes run on the host), 64 requests, capped at 120 s: the async
#                host pipeline's side group and its parts across ranks, before the long runs
#   online-70b-tp2  two GPUs: Llama-3.1-70B shapes, 1000/300 with Poisson arrivals, gpu-only and neo
#                (ONLINE_70B_POLICIES), goodput at a TTFT/TPOT objective (ONLINE_70B_ARGS replaces
#                the rates, durations and objectives; ONLINE_70B_ENGINE_ARGS adds engine options,
#                e.g. --gpu-kv-cache-gib 4, the pool an 80 GB H100 leaves, on larger GPUs)
#   online       latency vs load through the HTTP server
#   frontier     tokens/s against the time between a request's tokens, host decodes beside a full
#                GPU pool (benchmarks/interval_frontier.py; FRONTIER_ARGS, e.g. --cpu-attention-threads 8)
#   async-watchdog  32B memory-poor neo with the async host pipeline (OFFLOAD_ARGS adds arguments);
#                if it still runs after WATCHDOG_SECONDS (default 200), every thread's Python
#                stack (SIGUSR1) and native stack (cuda-gdb) go to the results, and it is killed
#
# Results go to $OUT (else results/raw): session.log, results.tar.gz (every JSON/log/plot) and
# the built extensions (prebuilt-*.so). Carrying a folder .carry/prebuilt with those .so files
# skips the compile; .carry/ispc holds ISPC (install.sh + the .xz) for building the CPU kernel.
# Perf-model tables the engine profiles are cached in $NEO_CACHE_DIR (default .carry/cache,
# so carrying it reuses them) and copied to the results. Wheels in .carry/wheels (the server's
# packages where the machine lacks them: `bash benchmarks/server_wheels.sh` makes them) are
# installed into /tmp/neo-site first.
# files/gpu-monitor.csv samples the GPU's clocks, power and throttle reasons every 5 s.
# Environment: SECONDS_PER_RUN caps each offline run (default 60), NUM_REQUESTS (default 256;
# TP_SCALING_REQUESTS for tp-scaling), CPU_KV_CACHE_GIB (online-70b-tp2's host pool per rank).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-results/raw}
mkdir -p "$out/files"
exec > >(tee -a "$out/session.log") 2>&1
export PYTHONUNBUFFERED=1
# NVLink multicast off in NCCL, PyTorch and NVSHMEM: on a shared multi-GPU host it can take the
# GPUs out of service. The engine's ranks inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NEO_CACHE_DIR=${NEO_CACHE_DIR:-$PWD/.carry/cache}
seconds=${SECONDS_PER_RUN:-60}
requests=${NUM_REQUESTS:-256}
echo "== $(date -Is) $(hostname) stages: $*"
if ls .carry/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/neo-site \
    .carry/wheels/*.whl && export PYTHONPATH=/tmp/neo-site${PYTHONPATH:+:$PYTHONPATH}
fi
gpu_state() {  # clocks, power, temperature, throttle reasons and other processes on the GPU
  nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active,utilization.gpu,memory.used \
    --format=csv 2>/dev/null
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
gpu_state
# The GPU's clocks, power and throttle reasons every 5 s while the stages run.
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active,utilization.gpu \
  --format=csv -l 5 > "$out/files/gpu-monitor.csv" 2>/dev/null &
monitor=$!
python3 -c 'import torch, os; print("torch", torch.__version__, "cuda", torch.version.cuda, "cpus", os.cpu_count())'

run() {  # run NAME COMMAND...: log it, keep going on failure, remember the status
  local name=$1; shift
  echo "== [$name] $*" >&2  # stderr: a command's stdout may be redirected to a results file
  local start=$SECONDS
  "$@"
  local status=$?
  echo "== [$name] exit $status after $((SECONDS - start)) s" >&2
  [ $status -eq 0 ] || failures+=("$name")
}
failures=()

stage_build() {
  if ls .carry/prebuilt/*.so >/dev/null 2>&1; then
    cp .carry/prebuilt/*.so ops/
    run install env NEO_BUILD_CUDA=0 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
  else
    if [ -f .carry/ispc/install.sh ]; then
      ISPC=$(bash .carry/ispc/install.sh /tmp/neo-ispc); export ISPC
    fi
    run build env NEO_BUILD_CUDA=1 MAX_JOBS=16 python3 -m pip install --no-deps --no-build-isolation --no-index -e . -v
    if [ ! -f ops/_cuda_kernels*.so ] && [ -n "${ISPC:-}" ]; then
      echo "== the build failed; building the CUDA extension alone (no ISPC)"
      run build-cuda-only env -u ISPC NEO_BUILD_CUDA=1 MAX_JOBS=16 \
        python3 -m pip install --no-deps --no-build-isolation --no-index -e . -v
    fi
    for library in ops/*.so; do cp "$library" "$out/prebuilt-$(basename "$library")"; done
  fi
  python3 -m neo.ops | tee "$out/files/ops.txt"
}

stage_build_cpu() {
  [ -f .carry/ispc/install.sh ] || { echo "build-cpu needs .carry/ispc"; failures+=(build-cpu); return; }
  cp .carry/prebuilt/_cuda_kernels*.so ops/
  ISPC=$(bash .carry/ispc/install.sh /tmp/neo-ispc); export ISPC
  run build-cpu env NEO_BUILD_CUDA=0 MAX_JOBS=16 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
  for library in ops/_cpu_kernels*.so; do cp "$library" "$out/prebuilt-$(basename "$library")"; done
  python3 -m neo.ops > "$out/files/ops.txt"
}

stage_ops_tests() {
  run ops-cuda python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py tests/test_paged_decode_attention.py \
    tests/test_store_kv_cache.py tests/test_swap_blocks.py tests/test_layer_ops.py tests/test_opcheck.py \
    tests/test_op_registry.py tests/test_op_input_checks.py --junitxml="$out/files/ops-tests.xml"
}

stage_swap_debug() {
  run swap-debug python3 -X faulthandler -m pytest -v -p no:cacheprovider tests/test_cuda_kernels.py -k swap
}

stage_sanitizer() {
  run sanitizer compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q -p no:cacheprovider \
    tests/test_cuda_kernels.py -k "decode or store or swap" -x
}

stage_kernels() {
  run cuda-kernels python3 benchmarks/cuda_kernels.py --json "$out/files/cuda_kernels.json"
  run cpu-attention python3 -m pytest -q -p no:cacheprovider benchmarks/test_bench_decode_attention.py \
    --benchmark-only --benchmark-json="$out/files/cpu_attention.json"
}

stage_engine_tests() {
  run engine-tests python3 -m pytest -q -p no:cacheprovider tests/test_host_stage.py tests/test_pipeline_graphs.py \
    tests/test_gpu_engine.py tests/test_model_families.py tests/test_stage_order.py tests/test_cpu_attention_kernel.py \
    tests/test_register_kernel.py tests/test_op_registry.py tests/test_hardware_queues.py \
    --junitxml="$out/files/engine-tests.xml"
}

stage_engine() {  # the roofline with async scheduling and without it, then offline throughput
  run roofline python3 benchmarks/engine_roofline.py --model llama-3.1-8b --batch-sizes 64,256 --context 1024 \
    --json "$out/files/engine_roofline.json"
  run roofline-sync python3 benchmarks/engine_roofline.py --model llama-3.1-8b --batch-sizes 64,256 --context 1024 \
    --no-async-scheduling --json "$out/files/engine_roofline_sync.json"
  for workload in "synthetic:input=1000,output=300" "azure-code"; do
    run "bench-$workload" neo bench --model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 8192 \
      --workload "$workload" --num-requests "$requests" --duration "$seconds" --json \
      > "$out/files/bench-8b-${workload%%:*}.json"
  done
}

stage_handoff() {  # HANDOFF_MODELS (default both), HANDOFF_ARGS (e.g. --batches 1x256,8x768)
  local model
  for model in ${HANDOFF_MODELS:-llama-3.1-8b qwen2.5-32b}; do
    run "handoff-$model" python3 benchmarks/host_handoff.py --model "$model" ${HANDOFF_ARGS:-} \
      --json "$out/files/handoff-$model-$(date +%H%M%S).json" --trace-dir "$out/files/traces"
  done
}

offload() {  # offload SCENARIO [extra arguments]: the engine profiles this machine on first use
  local scenario=$1; shift
  run "offload-$scenario" python3 benchmarks/offload.py --scenario "$scenario" --duration "$seconds" \
    --num-requests "$requests" --output-dir "$out/files" --keep-traces "$@"
}
stage_offload_32b() { offload 32b-poor ${OFFLOAD_ARGS:-}; }
stage_offload_8b_poor() { offload 8b-poor ${OFFLOAD_ARGS:-}; }
stage_offload_8b_full() { offload 8b-full ${OFFLOAD_ARGS:-}; }
stage_offload_threads() { offload 32b-threads ${OFFLOAD_ARGS:-}; }
stage_offload_70b_tp2() { offload 70b-tp2 ${OFFLOAD_ARGS:-}; }

stage_tp_scaling() {  # TP_SCALING_RUNS: RANKS[-eager][-sync] (no CUDA graphs; synchronous scheduling)
  local run_name options
  for run_name in ${TP_SCALING_RUNS:-1 2 2-sync 2-eager}; do
    options="--tensor-parallel-size ${run_name%%-*}"
    [[ $run_name == *-eager* ]] && options="$options --no-cuda-graphs"
    [[ $run_name == *-sync ]] && options="$options --no-async-scheduling"
    run "tp-scaling-$run_name" timeout -k 10 $((seconds + 240)) neo bench --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
      --max-model-len 8192 --workload synthetic:input=1000,output=300 \
      --num-requests "${TP_SCALING_REQUESTS:-$requests}" --duration "$seconds" $options \
      --json > "$out/files/tp-scaling-$run_name.json"
  done
}

stage_tp_timeline() {  # two GPUs: torch.profiler timelines of 70B neo iterations on both ranks (xz)
  run tp-timeline timeout -k 10 600 neo bench --model llama-3.1-70b --load-format dummy --dtype bfloat16 \
    --max-model-len 4096 --tensor-parallel-size 2 --policy neo --gpu-kv-cache-gib 6 --cpu-kv-cache-gib 24 \
    --workload synthetic:input=1000,output=300 --num-requests 100 --torch-profiler-dir "$out/files/timeline" \
    --torch-profile-iterations "${TIMELINE_ITERATIONS:-300:330}" --json > "$out/files/tp-timeline.json"
  xz -T0 -f "$out/files/timeline"/*.json 2>/dev/null
  run tp-timeline-summary python3 benchmarks/timeline_summary.py "$out/files/timeline"/*.json.xz \
    > "$out/files/tp-timeline-summary.txt"
}

stage_tp_tests() {  # two GPUs: tokens of two ranks against one (eager, graphs, graphs ahead)
  run tp-tests timeout -k 10 500 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_parallel_cuda.py \
    --junitxml="$out/files/tp-tests.xml"
}

stage_parts_tests() {  # host batches in parts, async scheduling and the engine on one GPU
  run parts-tests timeout -k 10 300 python3 -m pytest -q -p no:cacheprovider tests/test_host_batch_parts.py \
    tests/test_gpu_engine.py tests/test_async_scheduling.py --junitxml="$out/files/parts-tests.xml"
}

stage_tp_smoke() {
  run tp-smoke timeout -k 10 150 neo bench --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
    --max-model-len 4096 --tensor-parallel-size 2 --policy neo --host-pipeline async --perf-model zero \
    --gpu-kv-cache-gib 0.5 --cpu-kv-cache-gib 8 --workload synthetic:input=1000,output=100 --num-requests 64 \
    --duration 120 --json > "$out/files/tp-smoke.json"
}

stage_online_70b_tp2() {
  server_packages || { failures+=(online-70b-tp2); return; }
  run online-70b-tp2 python3 benchmarks/online.py --output-dir "$out/files" --tag 70b-tp2 \
    --policies "${ONLINE_70B_POLICIES:-gpu-only,neo}" --workload synthetic:input=1000,output=300 \
    ${ONLINE_70B_ARGS:---rates 1,2,3 --duration-per-rate 40 --drain-timeout 60 --goodput ttft:3000 tpot:150} -- \
    --model llama-3.1-70b --load-format dummy --dtype bfloat16 --max-model-len 4096 --tensor-parallel-size 2 \
    --gpu-memory-utilization 0.95 --cpu-kv-cache-gib "${CPU_KV_CACHE_GIB:-40}" ${ONLINE_70B_ENGINE_ARGS:-}
}

stage_async_watchdog() {
  python3 benchmarks/offload.py --scenario 32b-poor --duration "$seconds" --num-requests "$requests" \
    --output-dir "$out/files" --keep-traces --policies neo --host-pipelines async ${OFFLOAD_ARGS:-} &
  local pid=$! limit=${WATCHDOG_SECONDS:-200} waited=0
  while kill -0 $pid 2>/dev/null && [ $waited -lt "$limit" ]; do sleep 5; waited=$((waited + 5)); done
  if kill -0 $pid 2>/dev/null; then
    echo "== [async-watchdog] still running after $limit s: dumping stacks"
    kill -USR1 $pid; sleep 3
    timeout 120 cuda-gdb -p $pid -batch -ex "info threads" -ex "thread apply all bt 40" > "$out/files/stacks.txt" 2>&1
    kill -9 $pid
    failures+=(async-watchdog)
  else
    wait $pid || failures+=(async-watchdog)
  fi
}

stage_frontier() {
  run frontier python3 benchmarks/interval_frontier.py ${FRONTIER_ARGS:-} --json "$out/files/frontier-$(date +%H%M%S).json"
}

server_packages() {  # the online stages' server and client packages, or why they are missing
  python3 -c "import fastapi, uvicorn, openai" 2>/dev/null && return 0
  echo "== the server's packages are missing (fastapi, uvicorn, openai): carry them, made here with" \
    "bash benchmarks/server_wheels.sh (into .carry/wheels)"
  return 1
}

stage_online() {
  server_packages || { failures+=(online); return; }
  run online python3 benchmarks/online.py --output-dir "$out/files" ${ONLINE_ARGS:-}
}

for stage in "$@"; do
  function="stage_${stage//-/_}"
  if ! declare -F "$function" >/dev/null; then
    echo "unknown stage $stage"; failures+=("$stage"); continue
  fi
  "$function"
done
kill $monitor 2>/dev/null
gpu_state
[ -d "$NEO_CACHE_DIR/perf" ] && cp -r "$NEO_CACHE_DIR/perf" "$out/files/"
tar -czf "$out/results.tar.gz" -C "$out" files
echo "== done $(date -Is); failed: ${failures[*]:-none}"
[ ${#failures[@]} -eq 0 ]
