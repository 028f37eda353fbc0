# syntax=docker/dockerfile:1
# Dormouse's image: a CPU build (default) or a CUDA build of llama-cpp-python.
#
#     docker build -t dormouse:0.1.0-cpu .
#     docker build --build-arg VARIANT=cuda -t dormouse:0.1.0-cuda .
#     docker run -p 8080:8080 -e DORMOUSE_ADMIN_KEY=... -v /srv/models:/models:ro \
#                -v dormouse-state:/var/lib/dormouse dormouse:0.1.0-cpu
#
# No model inside: mount one at /models (deploy/docker/dormouse.toml names
# /models/model.gguf; a config of your own at /etc/dormouse/dormouse.toml).
# The Python packages (the runtime dependencies, never the test extra) are
# installed by deploy/docker/install.sh alone, the
# script that tests/reliability/test_deploy_image.py runs on a fresh copy of
# the repository; hadolint checks this file (tests/unit/test_deploy_image.py).

ARG VARIANT=cpu
ARG CUDA_VERSION=12.6.3

# -- the two bases: the same steps run on either --------------------------------
# CPU: Debian 12 (Python 3.11), the system the project is built and tested on.
FROM debian:bookworm-slim AS build-cpu
ENV CMAKE_ARGS="-DGGML_NATIVE=OFF"

FROM debian:bookworm-slim AS runtime-cpu

# CUDA: Ubuntu 24.04 (Python 3.12); the devel image has nvcc and the libcuda
# stub to link against, the runtime image the CUDA libraries only. The
# driver comes from the host (NVIDIA container toolkit).
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build-cuda
# The GPU generations to build kernels for (no GPU at build time to detect):
# Turing, Ampere, Ada, Hopper.
ARG CUDA_ARCHITECTURES="75;80;86;89;90"
ENV CMAKE_ARGS="-DGGML_CUDA=ON -DGGML_NATIVE=OFF -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}"

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04 AS runtime-cuda

# -- build: llama-cpp-python from source, Dormouse, into /opt/dormouse -----------
# (build-cpu or build-cuda: a stage above, not an image to pull, hence no tag.)
# hadolint ignore=DL3006
FROM build-${VARIANT} AS build
# Versions come with the base image's release (Debian 12, Ubuntu 24.04):
# pinning them would tie one line to one of the two bases.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake python3 python3-dev python3-venv \
    && rm -rf /var/lib/apt/lists/*
# No wheel cache in the image layers.
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY . /src
RUN sh /src/deploy/docker/install.sh /opt/dormouse /src

# -- runtime: the environment, a non-root user, the state directory as a volume --
# (runtime-cpu or runtime-cuda, a stage above.)
# hadolint ignore=DL3006
FROM runtime-${VARIANT}
# libgomp1: llama.cpp's CPU threads (OpenMP).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 python3 \
    && rm -rf /var/lib/apt/lists/*
# The uid and gid the StatefulSet runs as (deploy/k8s/statefulset.yaml).
RUN groupadd --system --gid 10001 dormouse \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/dormouse --no-create-home dormouse \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/dormouse
COPY --from=build /opt/dormouse /opt/dormouse
COPY deploy/docker/dormouse.toml /etc/dormouse/dormouse.toml
# The venv is read-only at run time (readOnlyRootFilesystem): pip compiled it.
# HOME is the state volume: a model by name (hf_repo) goes to huggingface_hub's cache
# under it (~/.cache), so it outlives the container.
ENV PATH=/opt/dormouse/bin:$PATH HOME=/var/lib/dormouse PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
VOLUME ["/var/lib/dormouse"]
USER 10001:10001
WORKDIR /var/lib/dormouse
EXPOSE 8080 8081
# /health is 200 while ready, sleeping or waking, 503 while loading at start,
# failed or stopping. Kubernetes uses its own probes (statefulset.yaml).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10m \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2)"]
ENTRYPOINT ["dormouse"]
CMD ["serve", "--config", "/etc/dormouse/dormouse.toml"]
