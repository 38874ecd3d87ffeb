#!/usr/bin/env bash
# Run compose with host networking (compose.yaml + compose.host.yaml), with compose v2 or v1.
#   docker/compose_host.sh up -d --scale executor=2
#   docker/compose_host.sh ps | logs -f executor | down
# Compose v1 refuses `network_mode: host` beside published ports, and an override cannot remove
# them; so the merged configuration is rendered (`config`), `ports` and `expose` are dropped from
# the host-network services, and compose runs on the result (project directory: the repository).
# Env: COMPOSE (the compose command, default: `docker compose` when it works, else docker-compose),
#      PYTHON (with PyYAML; default .venv/bin/python, else python3), COMPOSE_PROJECT_NAME as usual.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${COMPOSE:-}" ]; then
  read -r -a DC <<<"$COMPOSE"
elif docker compose version >/dev/null 2>&1; then
  DC=(docker compose)
else
  DC=(docker-compose)
fi
PY=${PYTHON:-}
[ -n "$PY" ] || { [ -x "$ROOT/.venv/bin/python" ] && PY=$ROOT/.venv/bin/python || PY=python3; }
RENDERED=$(mktemp /tmp/pagoda-compose-host.XXXXXX.yaml)
trap 'rm -f "$RENDERED" "$RENDERED.in"' EXIT
(cd "$ROOT" && "${DC[@]}" -f compose.yaml -f compose.host.yaml config) >"$RENDERED.in"
"$PY" - "$RENDERED.in" "$RENDERED" <<'PY'
import sys

import yaml

doc = yaml.safe_load(open(sys.argv[1]))
for service in doc.get("services", {}).values():
    if service.get("network_mode") == "host":
        service.pop("ports", None)
        service.pop("expose", None)
yaml.safe_dump(doc, open(sys.argv[2], "w"), sort_keys=False)
PY
"${DC[@]}" --project-directory "$ROOT" -f "$RENDERED" "$@"
