#!/usr/bin/env bash
# Everything bench/gpu_check.sh installs, gathered here for a GPU machine that
# reaches no package index (the lent device machines reach nothing outside):
#     bash bench/gpu_bundle.sh [OUT]        # OUT defaults to .gpu-bundle (git-ignored)
# then carry OUT with the working tree and run `bash bench/gpu_check.sh` there;
# it installs from OUT with --no-index when OUT exists.
#
# What goes in, within the device tool's 64 MiB carry limit:
#   - llama-cpp-python's sdist, trimmed: the vendored llama.cpp without what an
#     embedded build never compiles (models/ holds 75 MB of vocabularies, docs/
#     38 MB; tests, examples, benches, the server's tools, both .git folders);
#     gpu_check.sh builds it there with CUDA (nvcc and cmake must be on that machine);
#   - wheels of the runtime dependencies and of the build backend, for this
#     Python (GPU_BUNDLE_PYTHON_VERSION, e.g. 3.12, for another);
#   - not the bundled model's package (253 MB): bench/gpu_check.py writes its
#     own GGUF when that package is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.gpu-bundle}
PY=${PYTHON:-python3}
LLAMA_CPP_PYTHON=llama-cpp-python==0.3.36
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT"

"$PY" -m pip download --quiet --no-deps --no-binary :all: "$LLAMA_CPP_PYTHON" -d "$work"
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src=$(find "$work" -maxdepth 1 -type d -name 'llama_cpp_python-*' | head -n1)
vendor="$src/vendor/llama.cpp"
rm -rf "$src/.git" "$src/docs" "$src/examples" "$src/tests" "$src/docker" \
       "$vendor/.git" "$vendor/models" "$vendor/docs" "$vendor/tests" "$vendor/examples" \
       "$vendor/benches" "$vendor/pocs" "$vendor/app" "$vendor/media" "$vendor/gguf-py" \
       "$vendor/conversion" "$vendor/.devops" "$vendor/.github"
find "$vendor/tools" -mindepth 1 -maxdepth 1 ! -name mtmd ! -name CMakeLists.txt -exec rm -rf {} +
rm -f "$OUT"/llama_cpp_python-*.tar.gz
tar -czf "$OUT/$(basename "$src").tar.gz" -C "$work" "$(basename "$src")"

# bench/gpu_requirements.txt (the daemon's and the benchmark's dependencies) and
# llama-cpp-python's build backend and its own requirements, as wheels.
version_args=()
if [ -n "${GPU_BUNDLE_PYTHON_VERSION:-}" ]; then
  version_args=(--python-version "$GPU_BUNDLE_PYTHON_VERSION" --only-binary :all:)
fi
"$PY" -m pip download --quiet "${version_args[@]}" -d "$OUT" -r bench/gpu_requirements.txt \
  "scikit-build-core[pyproject]>=0.9.2" "typing-extensions>=4.5.0" "diskcache>=5.6.1"
size=$(du -sb "$OUT" | cut -f1)
echo "$OUT: $((size / 1048576)) MiB ($(ls "$OUT" | wc -l) files)"
if [ "$size" -gt $((60 * 1048576)) ]; then
  echo "warning: over 60 MiB; the device tool carries 64 MiB with the working tree" >&2
fi
