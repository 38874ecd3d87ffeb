"""Run by docker-compose v1.29's own interpreter (the venv `make compose-tools` makes): build the
project as v1's `up`, `ps` and `down` do before they talk to the daemon, and each service's
container host config as `up` sends it, for the given profiles and compose files. No daemon is
needed: the daemon here is empty (every lookup is NotFound) and the host config is docker-py's
local builder. Exit status 0 and the service names on stdout, or v1's error.

    python compose_v1_project.py PROFILE[,PROFILE...] FILE [FILE...]   (PROFILE "" for none)

v1.29.2 is the last v1 release, so its internals used here (`Project.from_config`,
`Service._get_container_host_config`) are frozen.
"""

from __future__ import annotations

import sys

import docker
import docker.errors
from compose.config import config
from compose.config.environment import Environment
from compose.project import Project

_LOCAL = {"create_host_config", "create_networking_config", "create_endpoint_config"}


class EmptyDaemon:
    """A docker API client for a daemon with nothing on it: local builders work, lookups are NotFound."""

    def __init__(self):
        self._api = docker.APIClient(base_url="unix:///nonexistent/docker.sock", version="1.41")

    def __getattr__(self, name):
        if name in _LOCAL or name in ("api_version", "base_url"):
            return getattr(self._api, name)

        def lookup(*args, **kwargs):
            raise docker.errors.NotFound(f"{name}: the check's daemon is empty")

        return lookup


def main(argv: list[str]) -> int:
    profiles, files = [p for p in argv[0].split(",") if p], argv[1:]
    environment = Environment.from_env_file(".")
    data = config.load(config.find(".", files, environment))
    project = Project.from_config("pagoda-check", data, EmptyDaemon(), enabled_profiles=profiles)
    for service in project.services:
        service._get_container_host_config({})
        print(service.name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
