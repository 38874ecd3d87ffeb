#!/usr/bin/env bash
# Write a random cluster secret (the executor link's shared key) to deploy/k8s/base/cluster-secret,
# which the kustomization turns into the Secret pagoda-cluster-secret. The file is git-ignored;
# an existing one is kept (FORCE=1 replaces it, and then every pod must restart).
set -euo pipefail
file="$(dirname "$0")/base/cluster-secret"
if [ -s "$file" ] && [ "${FORCE:-0}" != 1 ]; then
  echo "kept $file"
  exit 0
fi
umask 077
head -c 32 /dev/urandom | base64 >"$file"
echo "wrote $file"
