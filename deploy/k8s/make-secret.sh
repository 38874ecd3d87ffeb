#!/usr/bin/env bash
# Write a random cluster secret (the executor link's shared key) to
# deploy/k8s/base/RUN-deploy-k8s-make-secret.sh-FIRST/cluster-secret, which the kustomization turns
# into the Secret pagoda-cluster-secret. The file is git-ignored; an existing one is kept (FORCE=1
# replaces it, and then every pod must restart). A secret at the former place, base/cluster-secret,
# is moved there.
set -euo pipefail
base="$(dirname "$0")/base"
file="$base/RUN-deploy-k8s-make-secret.sh-FIRST/cluster-secret"
umask 077
mkdir -p "$(dirname "$file")"
if [ -s "$base/cluster-secret" ] && [ ! -s "$file" ]; then
  mv "$base/cluster-secret" "$file"
  echo "moved $base/cluster-secret to $file"
fi
if [ -s "$file" ] && [ "${FORCE:-0}" != 1 ]; then
  echo "kept $file"
  exit 0
fi
head -c 32 /dev/urandom | base64 >"$file"
echo "wrote $file"
