#!/usr/bin/env bash
# Download the wheels the HTTP server and the online benchmark's client need (fastapi, uvicorn,
# openai and what they require) for a GPU machine that has no package index, into DIR (default
# .carry/wheels, which gpu_session.sh installs from). Run it where pip reaches an index.
#
#   bash benchmarks/server_wheels.sh [DIR] [PYTHON_VERSION]     (PYTHON_VERSION default 3.12)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dir=${1:-.carry/wheels}
version=${2:-3.12}
mkdir -p "$dir"
python3 -m pip download --only-binary=:all: --python-version "$version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dir" fastapi uvicorn openai
ls "$dir"
