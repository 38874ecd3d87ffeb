#!/usr/bin/env bash
# Starts the scheduler and one executor with the default model; Ctrl-C stops both.
# Extra scheduler flags may follow, e.g. ./scripts/run.sh --port 50052. The link flags
# (--cluster-secret-file F, --allow-insecure-cluster-secret, --insecure-executor-link) go to the executor too; without them
# the link is CURVE with the per-user secret the scheduler makes in the cache directory.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
link=()
args=("$@")
for i in "${!args[@]}"; do
  case "${args[$i]}" in
    --insecure-executor-link) link+=(--insecure-executor-link) ;;
    --allow-insecure-cluster-secret) link+=(--allow-insecure-cluster-secret) ;;
    --cluster-secret-file) link+=(--cluster-secret-file "${args[$((i + 1))]:-}") ;;
    --cluster-secret-file=*) link+=("${args[$i]}") ;;
  esac
done
$PY -m scheduler_svc "$@" &
scheduler=$!
$PY -m executor_svc "${link[@]}" &
executor=$!
stop() { kill -TERM "$executor" "$scheduler" 2>/dev/null; }
trap stop INT TERM
wait -n "$scheduler" "$executor"
stop
wait
