#!/usr/bin/env bash
# Starts the scheduler and one executor with the default model; Ctrl-C stops both.
# Extra scheduler flags may follow, e.g. ./scripts/run.sh --port 50052.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
$PY -m scheduler_svc "$@" &
scheduler=$!
$PY -m executor_svc &
executor=$!
stop() { kill -TERM "$executor" "$scheduler" 2>/dev/null; }
trap stop INT TERM
wait -n "$scheduler" "$executor"
stop
wait
