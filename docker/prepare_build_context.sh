#!/usr/bin/env bash
# Fill docker/build-extra/ (ignored by git) with what this machine's pip uses to reach packages,
# so `docker build` works the same way inside the build:
#   - ca-certificates.crt: the CA bundle pip trusts here ($PIP_CERT, pip config `cert`, or
#     /etc/ssl/certs/ca-certificates.crt); skipped with PAGODA_BUILD_CA=none.
#   - wheels/torch-<version>+cpu-*.whl: the CPU torch wheel pinned by requirements.txt, taken from
#     this machine's pip sources (find-links / local indexes) with `pip download`; skipped with
#     PAGODA_TORCH_WHEEL=none (the build then uses TORCH_CPU_INDEX_URL).
# Env: PYTHON (default: .venv/bin/python, else python3), TARGET_PYTHON_VERSION (default 3.11,
# the Python of python:3.11-slim-bookworm and of Debian bookworm).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA=docker/build-extra
mkdir -p "$EXTRA/wheels"
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

# 1. CA bundle
if [ "${PAGODA_BUILD_CA:-}" != none ]; then
  ca=${PIP_CERT:-$("$PY" -m pip config get global.cert 2>/dev/null || true)}
  [ -n "$ca" ] && [ -s "$ca" ] || ca=/etc/ssl/certs/ca-certificates.crt
  if [ -s "$ca" ]; then
    if ! cmp -s "$ca" "$EXTRA/ca-certificates.crt"; then cp "$ca" "$EXTRA/ca-certificates.crt"; fi
    echo "build-extra: CA bundle from $ca"
  else
    echo "build-extra: no CA bundle found (pip in the build uses the base image's CAs)"
  fi
fi

# 2. CPU torch wheel
if [ "${PAGODA_TORCH_WHEEL:-}" != none ]; then
  torch_version=$(sed -n 's/^torch==\([^ ;#]*\).*/\1/p' requirements.txt)
  pyver=${TARGET_PYTHON_VERSION:-3.11}
  tag=cp${pyver/./}
  if ls "$EXTRA"/wheels/torch-"$torch_version"+cpu-"$tag"-*.whl >/dev/null 2>&1; then
    echo "build-extra: $(ls "$EXTRA"/wheels/torch-"$torch_version"+cpu-"$tag"-*.whl)"
  else
    echo "build-extra: pip download torch==$torch_version+cpu ($tag) from this machine's pip sources"
    if ! "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" \
         --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
         -d "$EXTRA/wheels" "torch==$torch_version+cpu"; then
      echo "build-extra: no CPU torch wheel here; the CPU build will use TORCH_CPU_INDEX_URL" >&2
    fi
  fi
fi
ls -la "$EXTRA" "$EXTRA/wheels"
