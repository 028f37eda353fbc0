#!/usr/bin/env bash
# GPU check (NVIDIA): build llama-cpp-python with CUDA for this card only, load
# the bundled model with every layer on the GPU, sleep, confirm through NVML
# that the worker left 0 bytes on the GPU, wake, print the resume phases; then
# the sleep tiers and load modes on a ~16 GB GGUF it writes itself
# (GPU_CHECK_BIG_GB, 0 skips it), with GB/s for the weights phase.
# Meant to finish in under 10 minutes on a machine with a GPU and nvcc:
#     bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-cuda}
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d '.')
echo "GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n1), compute capability ${cap}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
fi
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  # One architecture only and no native CPU flags: the build stays within minutes.
  CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${cap} -DGGML_NATIVE=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$VENV/bin/pip" install --quiet --no-cache-dir "llama-cpp-python==0.3.36"
fi
"$VENV/bin/pip" install --quiet -e '.[test]'
"$VENV/bin/python" -m bench.gpu_check
exec "$VENV/bin/python" -m bench.gpu_check tiers --big-gb "${GPU_CHECK_BIG_GB:-16}"
