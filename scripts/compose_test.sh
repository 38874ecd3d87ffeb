#!/usr/bin/env bash
# End-to-end test of the compose deployment on this machine (`make compose-test`; not run in CI),
# with the README's commands:
#   1. start dockerd when none answers; `make images` (base image by debootstrap + docker import
#      when none is given, then pagoda:cpu); rebuild after regenerating the gRPC stubs: the
#      image must come out the same (the stubs are not part of the build context)
#   2. up: scheduler + 2 executors + gateway, host networking (docker/compose_host.sh)
#   3. wait for grpc.health.v1 SERVING (container health check and host client), stream a request,
#      ask the gateway with the `openai` package; an executor container started without the
#      cluster secret must not register (security, #13)
#   4. scale to 3 executors with the README's command *in another environment*: the scheduler
#      and the running executors must not be recreated; then several streams, `docker kill` one
#      executor mid-stream, check that every stream completes with all its tokens
#   5. docker compose down (the model-cache volume is kept; KEEP_STACK=1 leaves the stack up)
#
# Env:
#   PAGODA_BASE_IMAGE   base for pagoda:cpu (default pagoda-base:bookworm, made here when missing;
#                       python:3.11-slim-bookworm where Docker Hub is reachable)
#   SKIP_BUILD=1        use the existing pagoda:cpu image
#   NETWORK=bridge      use the compose network + published ports instead of host networking
#   PAGODA_PORT, PAGODA_EXECUTOR_PORT, PAGODA_METRICS_PORT, PAGODA_GATEWAY_PORT
#                       ports (default: free ports picked here; host networking shares the host's)
#   STREAMS (6), MAX_TOKENS (48), THREADS (1 torch thread per executor), KEEP_STACK=1
#   FRESH_CLONE=1       run all of it in a fresh `git clone` of this repository's HEAD (as a new
#                       user would), with this checkout's .venv for the host-side client only
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [ "${FRESH_CLONE:-0}" = 1 ]; then
  clone=$(mktemp -d /tmp/pagoda-fresh-clone.XXXXXX)
  git clone -q "$ROOT" "$clone/pagoda"
  echo "[compose-test] fresh clone of $(git rev-parse --short HEAD) in $clone/pagoda"
  FRESH_CLONE=0 PYTHON=${PYTHON:-$ROOT/.venv/bin/python} "$clone/pagoda/scripts/compose_test.sh" && rc=0 || rc=$?
  rm -rf "$clone"
  exit $rc
fi
PROJECT=${COMPOSE_PROJECT:-pagoda-compose-test}
NETWORK=${NETWORK:-host}
STREAMS=${STREAMS:-6}
MAX_TOKENS=${MAX_TOKENS:-48}
PY=${PYTHON:-$ROOT/.venv/bin/python}
T0=$(date +%s)
log() { printf '[compose-test %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
RESULTS=()
record() { RESULTS+=("$1"); log "$1"; }

[ -x "$PY" ] || { echo "need the repository's .venv (make setup)" >&2; exit 2; }

# --- 1. docker, base image, pagoda:cpu ----------------------------------------------------------
docker/start_dockerd.sh
if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null; then
  COMPOSE=(docker-compose)
else
  echo "need docker compose (v2 plugin) or docker-compose (v1.29)" >&2; exit 2
fi
log "compose: $("${COMPOSE[@]}" version | head -1)"

export PAGODA_BASE_IMAGE=${PAGODA_BASE_IMAGE:-pagoda-base:bookworm}
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  s=$(date +%s)
  # The build stage is kept for the rebuild below (its cache), which then removes it.
  if ! PAGODA_KEEP_BUILD_STAGE=1 make images >/tmp/pagoda-compose-build.log 2>&1; then
    tail -n 40 /tmp/pagoda-compose-build.log; echo "make images failed (log /tmp/pagoda-compose-build.log)" >&2; exit 1
  fi
  grep -h 'verify_env ok' /tmp/pagoda-compose-build.log | sed 's/^/    /' || true
  image=$(docker image inspect pagoda:cpu --format '{{.Id}}')
  record "build: make images in $(( $(date +%s) - s ))s, pagoda:cpu $(docker image inspect pagoda:cpu --format '{{.Size}}' | awk '{printf "%.2f GB", $1/1e9}')"
  # Regenerated stubs (new files, new times) must not change the build context.
  touch pagoda/v1/*.py pagoda/v1/*.pyi pagoda/v1/.generated 2>/dev/null || true
  "$PY" -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/pagoda/v1/*.proto
  VARIANTS=cpu docker/build_images.sh >>/tmp/pagoda-compose-build.log 2>&1
  again=$(docker image inspect pagoda:cpu --format '{{.Id}}')
  [ "$image" = "$again" ] || { log "rebuild after regenerating stubs gave a new image: $image -> $again"; exit 1; }
  record "rebuild: regenerated stubs leave the image as it was (${image:7:12})"
fi
export PAGODA_IMAGE=pagoda:cpu

# --- 2. up with two executors -------------------------------------------------------------------
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export PAGODA_PORT=${PAGODA_PORT:-$(free_port)}
export PAGODA_EXECUTOR_PORT=${PAGODA_EXECUTOR_PORT:-$(free_port)}
export PAGODA_METRICS_PORT=${PAGODA_METRICS_PORT:-$(free_port)}
export PAGODA_PUBLISH=$PAGODA_PORT
export PAGODA_NUM_THREADS=${THREADS:-1}           # 2 cores shared by 3 executors
export PAGODA_KV_CACHE_MEMORY_GB=${PAGODA_KV_CACHE_MEMORY_GB:-0.25}
export PAGODA_GATEWAY_PORT=${PAGODA_GATEWAY_PORT:-$(free_port)}
export PAGODA_GATEWAY_PUBLISH=$PAGODA_GATEWAY_PORT
if [ "$NETWORK" = host ]; then
  # renders compose.yaml + compose.host.yaml for compose v1
  DC=(env COMPOSE="${COMPOSE[*]}" docker/compose_host.sh -p "$PROJECT")
else
  DC=("${COMPOSE[@]}" -p "$PROJECT")
fi
TARGET=127.0.0.1:$PAGODA_PORT

dump_logs() {
  log "--- docker compose ps"; "${DC[@]}" ps || true
  log "--- logs (last 40 lines per container)"; "${DC[@]}" logs --no-color --tail=40 || true
}
cleanup() {
  rc=$?
  if [ $rc -ne 0 ]; then dump_logs; fi
  if [ "${KEEP_STACK:-0}" = 1 ]; then
    log "KEEP_STACK=1: stack left up (${DC[*]} down to stop it)"
  else
    "${DC[@]}" down --remove-orphans -t 5 >/dev/null 2>&1 || true
  fi
  echo
  echo "==================== compose-test summary ===================="
  for line in "${RESULTS[@]}"; do echo "  $line"; done
  if [ $rc -eq 0 ]; then echo "  RESULT: PASS"; else echo "  RESULT: FAIL (rc=$rc)"; fi
  echo "=============================================================="
  exit $rc
}
trap cleanup EXIT

"${DC[@]}" down --remove-orphans -t 5 >/dev/null 2>&1 || true
log "up: scheduler + 2 executors + gateway ($NETWORK networking, gRPC $TARGET, executors on :$PAGODA_EXECUTOR_PORT, gateway :$PAGODA_GATEWAY_PORT)"
"${DC[@]}" up -d --scale executor=2 2>&1 | sed 's/^/    /'

container_of() { docker ps -q --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=$1"; }
s=$(date +%s)
"$PY" docker/compose_client.py wait --target "$TARGET" --executors 2 --timeout 300
wait_healthy() {
  local health=starting
  for _ in $(seq 1 60); do
    health=$(docker inspect --format '{{.State.Health.Status}}' "$(container_of "$1")")
    [ "$health" = healthy ] && return 0
    sleep 2
  done
  log "$1 container health: $health"; return 1
}
wait_healthy scheduler && wait_healthy gateway
record "up: 2 executors registered, scheduler and gateway containers healthy (docker/healthcheck.py: grpc.health.v1, /health) after $(( $(date +%s) - s ))s"

# --- 3. one streamed request from the host ------------------------------------------------------
out=$("$PY" docker/compose_client.py stream --target "$TARGET" --max-tokens 32 --timeout 180) || { echo "$out"; exit 1; }
echo "$out" | sed 's/^/    /'
record "stream: $(echo "$out" | grep 'client: stream:' | head -1 | sed 's/client: stream: //')"

# --- gateway: the OpenAI API in front of the scheduler -------------------------------------------
out=$("$PY" docker/compose_client.py gateway --target "$TARGET" --gateway "http://127.0.0.1:$PAGODA_GATEWAY_PORT" \
  --timeout 180) || { echo "$out"; exit 1; }
echo "$out" | sed 's/^/    /'
record "gateway: $(echo "$out" | grep 'SUMMARY' | sed 's/client: SUMMARY //')"

# --- security (#13): a container without the cluster secret cannot register ---------------------
if [ "$NETWORK" = host ]; then
  NET_ARGS=(--network host); LINK=tcp://127.0.0.1:$PAGODA_EXECUTOR_PORT
else
  NET_ARGS=(--network "${PROJECT}_default"); LINK=tcp://scheduler:$PAGODA_EXECUTOR_PORT
fi
# The model cache (not secret) spares it the GGUF conversion; the cluster-secret volume it does not get.
# Without a secret an executor would not even try; told --insecure-executor-link, it tries plaintext.
intruder=$(docker run -d "${NET_ARGS[@]}" -v "${PROJECT}_model-cache:/var/cache/pagoda" -e PAGODA_SCHEDULER="$LINK" \
  -e PAGODA_INSECURE_EXECUTOR_LINK=1 \
  -e PAGODA_DEVICE=cpu -e PAGODA_NUM_THREADS=1 -e PAGODA_KV_CACHE_MEMORY_GB=0.25 "$PAGODA_IMAGE" python -m executor_svc)
for _ in $(seq 1 180); do  # its Hello is out once it says it waits; then give the scheduler 10 s to answer
  docker logs "$intruder" 2>&1 | grep -q 'waiting for the scheduler' && break
  sleep 1
done
sleep 10
intruder_log=$(docker logs "$intruder" 2>&1); docker rm -f "$intruder" >/dev/null
echo "$intruder_log" | grep -q 'waiting for the scheduler' || { echo "$intruder_log" | tail -20; exit 1; }
if echo "$intruder_log" | grep -q 'registered'; then echo "$intruder_log" | tail -20; log "a container without the secret registered"; exit 1; fi
"$PY" docker/compose_client.py wait --target "$TARGET" --executors 2 --exact --timeout 30
rejected=$("${DC[@]}" logs --no-color scheduler 2>&1 | grep -c 'failed the CURVE handshake' || true)
record "security: an executor container without the cluster secret got no answer and did not register (still 2 executors; $rejected CURVE handshakes refused)"

# --- 4. scale to three (README's command, another environment), kill one mid-stream --------------
ids() { docker ps -q --no-trunc --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=$1" | sort; }
scheduler_before=$(ids scheduler); executors_before=$(ids executor)
s=$(date +%s)
env -u PAGODA_KV_CACHE_MEMORY_GB PAGODA_LOG_LEVEL=DEBUG PAGODA_BASE_IMAGE=some-other-base:tag \
  "${DC[@]}" up -d --no-deps --no-recreate --scale executor=3 executor 2>&1 | sed 's/^/    /'
"$PY" docker/compose_client.py wait --target "$TARGET" --executors 3 --exact --timeout 300
[ "$(ids scheduler)" = "$scheduler_before" ] || { log "scaling recreated the scheduler"; exit 1; }
kept=$(comm -12 <(echo "$executors_before") <(ids executor) | wc -l)
[ "$kept" -eq 2 ] || { log "scaling recreated executors ($kept of 2 kept)"; exit 1; }
record "scale: 3 executors registered $(( $(date +%s) - s ))s after the README's scale command in another environment; scheduler and both executors untouched"

log "failover: $STREAMS streams x $MAX_TOKENS tokens; docker kill the executor running the most of them, mid-stream"
set +e
"$PY" docker/compose_client.py failover --target "$TARGET" --streams "$STREAMS" --max-tokens "$MAX_TOKENS" \
  --kill-project "$PROJECT" --executors-after 2 --timeout 600 | tee /tmp/pagoda-compose-failover.log | sed 's/^/    /'
frc=${PIPESTATUS[0]}
set -e
record "failover: $(grep 'SUMMARY failover' /tmp/pagoda-compose-failover.log | sed 's/client: SUMMARY failover: //')"
[ "$frc" -eq 0 ] || exit 1

# The stack still serves after the failure.
out=$("$PY" docker/compose_client.py stream --target "$TARGET" --max-tokens 16 --timeout 180) || { echo "$out"; exit 1; }
record "after failover: $(echo "$out" | grep 'SUMMARY' | sed 's/client: SUMMARY //'); running executors: $(container_of executor | wc -l)"
log "compose ps:"; "${DC[@]}" ps | sed 's/^/    /'
