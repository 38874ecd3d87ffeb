# Sourced by the Dockerfile's build stage: pip settings from build arguments and build-extra/.
# Exports PIP_* only when set, so pip's own defaults (PyPI) apply otherwise; sets PIP_OPTS.
if [ -s /tmp/build-extra/ca-certificates.crt ]; then
    export PIP_CERT=/tmp/build-extra/ca-certificates.crt
    export SSL_CERT_FILE=/tmp/build-extra/ca-certificates.crt
    export REQUESTS_CA_BUNDLE=/tmp/build-extra/ca-certificates.crt
fi
[ -n "${PAGODA_PIP_INDEX_URL:-}" ] && export PIP_INDEX_URL="$PAGODA_PIP_INDEX_URL"
[ -n "${PAGODA_PIP_EXTRA_INDEX_URL:-}" ] && export PIP_EXTRA_INDEX_URL="$PAGODA_PIP_EXTRA_INDEX_URL"
[ -n "${PAGODA_PIP_TRUSTED_HOST:-}" ] && export PIP_TRUSTED_HOST="$PAGODA_PIP_TRUSTED_HOST"
mkdir -p /tmp/build-extra/wheels
PIP_OPTS="--find-links /tmp/build-extra/wheels"
true
