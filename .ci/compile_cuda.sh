#!/usr/bin/env bash
# Compiles every CUDA kernel source (ops_cuda/*.cu) with this machine's nvcc for the H100
# (sm_90a), with the flags torch's extension build uses, so a compile error never reaches the
# GPU machine. No GPU is needed. Prints, per kernel, the registers, spills and stack frame that
# ptxas reports, and fails on any compile error, on any register spill, or when nvcc is absent.
#
# Usage: .ci/compile_cuda.sh [output_dir]   (objects and ptxas logs are kept there if given;
#        NVCC=/path/to/nvcc picks the compiler)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nvcc="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]]; then
    nvcc=/usr/local/cuda/bin/nvcc
fi
if [[ -z "$nvcc" ]]; then
    echo "compile_cuda: nvcc not found (set NVCC or put it on PATH)" >&2
    exit 1
fi
if [[ $# -ge 1 ]]; then
    output_dir="$1"
    mkdir -p "$output_dir"
else
    output_dir="$(mktemp -d)"
    trap 'rm -rf "$output_dir"' EXIT
fi

# The same defines and options torch.utils.cpp_extension and setup.py pass to nvcc.
flags=(
    -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
    -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
    --expt-relaxed-constexpr -O3 -std=c++17 --use_fast_math -lineinfo
    "-gencode=arch=compute_90a,code=sm_90a" -Xptxas -v
    --compiler-options -fPIC -I"$root/ops_cuda"
)

echo "compile_cuda: $("$nvcc" --version | tail -n 1)"
status=0
shopt -s nullglob
sources=("$root"/ops_cuda/*.cu)
if [[ ${#sources[@]} -eq 0 ]]; then
    echo "compile_cuda: no sources in ops_cuda/" >&2
    exit 1
fi
for source in "${sources[@]}"; do
    name="$(basename "$source" .cu)"
    log="$output_dir/$name.ptxas.log"
    if ! "$nvcc" "${flags[@]}" -c "$source" -o "$output_dir/$name.o" >"$log" 2>&1; then
        echo "compile_cuda: FAILED $name.cu" >&2
        cat "$log" >&2
        status=1
        continue
    fi
    # ptxas prints "Compiling entry function '<mangled>'", then the stack frame / spill line and
    # the register line; summarize one line per kernel, demangled.
    python3 - "$log" "$name" <<'EOF' || status=1
import re
import subprocess
import sys

log_path, name = sys.argv[1], sys.argv[2]
entries = []
current = None
for line in open(log_path, encoding="utf-8", errors="replace"):
    match = re.search(r"Compiling entry function '([^']+)'", line)
    if match:
        current = {"name": match.group(1), "registers": 0, "shared": 0, "stack": 0,
                   "spill_stores": 0, "spill_loads": 0}
        entries.append(current)
        continue
    if current is None:
        continue
    match = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                      r"(\d+) bytes spill loads", line)
    if match:
        current["stack"], current["spill_stores"], current["spill_loads"] = map(int, match.groups())
    match = re.search(r"Used (\d+) registers", line)
    if match:
        current["registers"] = int(match.group(1))
    match = re.search(r"(\d+) bytes smem", line)
    if match:
        current["shared"] = int(match.group(1))
    warning = re.search(r"warning", line, re.IGNORECASE)
    if warning:
        print(f"  {name}: {line.strip()}")
names = [entry["name"] for entry in entries]
try:
    demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True,
                               text=True, check=True).stdout.splitlines()
except (OSError, subprocess.CalledProcessError):
    demangled = names
spilled = False
print(f"{name}.cu: {len(entries)} kernels")
for entry, readable in zip(entries, demangled):
    readable = re.sub(r"neo_cuda::\(anonymous namespace\)::", "", readable)
    readable = re.sub(r"^void |\(.*\)$", "", readable)  # drop the return type and parameters
    spill = entry["spill_stores"] + entry["spill_loads"]
    spilled |= spill > 0
    flag = "  <-- SPILLS" if spill else ""
    print(f"  {entry['registers']:3d} regs  smem {entry['shared']:5d} B  "
          f"stack {entry['stack']:3d} B  spill {entry['spill_stores']}/{entry['spill_loads']} B  "
          f"{readable}{flag}")
sys.exit(1 if spilled else 0)
EOF
done
if [[ $status -ne 0 ]]; then
    echo "compile_cuda: FAILED (compile errors or register spills above)" >&2
    exit 1
fi
echo "compile_cuda: all ${#sources[@]} sources compiled for sm_90a without spills"
