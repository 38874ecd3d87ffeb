#!/usr/bin/env bash
# Start dockerd in the background if no daemon answers (for machines without systemd).
# Idempotent: does nothing when `docker info` already works.
set -euo pipefail
LOG=${DOCKERD_LOG:-/tmp/dockerd.log}
if docker info >/dev/null 2>&1; then
  echo "dockerd: already running"
  exit 0
fi
if ! command -v dockerd >/dev/null; then
  echo "dockerd not found: apt-get install docker.io docker-compose debootstrap" >&2
  exit 1
fi
# containerd is started by dockerd itself when none is running.
setsid nohup dockerd ${DOCKERD_ARGS:-} >"$LOG" 2>&1 </dev/null &
echo "dockerd: started pid $! (log $LOG)"
for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then echo "dockerd: ready"; exit 0; fi
  sleep 1
done
echo "dockerd did not come up; last log lines:" >&2
tail -n 30 "$LOG" >&2
exit 1
