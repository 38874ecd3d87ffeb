#!/usr/bin/env bash
# Build the Pagoda images: pagoda:cpu (and pagoda:cuda with VARIANTS="cpu cuda").
# Env:
#   VARIANTS                 "cpu" (default), "cuda" or "cpu cuda"
#   PAGODA_BASE_IMAGE        CPU base (default python:3.11-slim-bookworm); with no registry:
#                            PAGODA_BASE_IMAGE=pagoda-base:bookworm (made by docker/make_base_image.sh
#                            when missing: debootstrap + docker import)
#   PAGODA_CUDA_BASE_IMAGE   CUDA base (default nvidia/cuda:13.0.2-runtime-ubuntu24.04)
#   PAGODA_IMAGE_PREFIX      image name (default pagoda): tags <prefix>:cpu, <prefix>:cuda
#   PAGODA_PIP_INDEX_URL / PAGODA_PIP_EXTRA_INDEX_URL / PAGODA_PIP_TRUSTED_HOST / TORCH_CPU_INDEX_URL /
#   CPU_SKIP_PACKAGES        passed as build arguments when set (see the Dockerfile)
#   DOCKER_BUILD_FLAGS       extra flags for docker build (e.g. --no-cache)
#   PAGODA_KEEP_BUILD_STAGE  1: keep the build stage's untagged image (the legacy builder's cache of
#                            the pip installs) instead of removing it after the build
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANTS=${VARIANTS:-cpu}
PREFIX=${PAGODA_IMAGE_PREFIX:-pagoda}
docker/start_dockerd.sh >/dev/null
docker/prepare_build_context.sh >/dev/null

args=()
for v in PAGODA_PIP_INDEX_URL PAGODA_PIP_EXTRA_INDEX_URL PAGODA_PIP_TRUSTED_HOST TORCH_CPU_INDEX_URL CPU_SKIP_PACKAGES; do
  if [ -n "${!v+set}" ]; then args+=(--build-arg "$v=${!v}"); fi
done
for variant in $VARIANTS; do
  case $variant in
    cpu)  base=${PAGODA_BASE_IMAGE:-python:3.11-slim-bookworm} ;;
    cuda) base=${PAGODA_CUDA_BASE_IMAGE:-nvidia/cuda:13.0.2-runtime-ubuntu24.04} ;;
    *) echo "unknown variant $variant" >&2; exit 2 ;;
  esac
  if [[ $base == pagoda-base:* ]] && ! docker image inspect "$base" >/dev/null 2>&1; then
    docker/make_base_image.sh "$base"     # no registry needed: debootstrap + docker import
  fi
  echo "== building $PREFIX:$variant on $base"
  start=$(date +%s)
  # shellcheck disable=SC2086
  docker build ${DOCKER_BUILD_FLAGS:-} -f Dockerfile -t "$PREFIX:$variant" \
    --build-arg VARIANT="$variant" --build-arg BASE_IMAGE="$base" "${args[@]}" .
  echo "== $PREFIX:$variant built in $(( $(date +%s) - start ))s"
  docker image ls "$PREFIX:$variant"
done
if [ "${PAGODA_KEEP_BUILD_STAGE:-0}" != 1 ]; then
  # The legacy builder leaves the build stage as a dangling image; BuildKit leaves none.
  docker image prune -f --filter label=ai.pagoda.stage=build | tail -n 1
fi
