"""deploy/k8s: every overlay renders with `kubectl kustomize` and validates against the
Kubernetes schemas (kubernetes-validate, strict: unknown fields are errors), and has the
pieces a deployment relies on (probes, the link Service, the Secret, the PDB, GPUs)."""

from __future__ import annotations

import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.service.harness import ROOT

K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32.0"
KUBECTL = shutil.which("kubectl")

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (the machine image has it)")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A copy of deploy/k8s with a cluster secret made as the README says (make-secret.sh)."""
    copy = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("cluster-secret", "RUN-deploy-k8s-make-secret.sh-FIRST"))
    subprocess.run([str(copy / "make-secret.sh")], check=True, capture_output=True)
    return copy


def render(tree, overlay: str) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(tree / "overlays" / overlay)], check=True, capture_output=True,
                         text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind_name(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def env(deployment: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(deployment).get("env", [])}


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "cpu-gateway"])
def test_overlay_renders_and_validates_against_the_kubernetes_schemas(tree, overlay):
    docs = render(tree, overlay)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    objects = by_kind_name(docs)
    assert {("Deployment", "pagoda-scheduler"), ("Deployment", "pagoda-executor"), ("Service", "pagoda-scheduler"),
            ("Service", "pagoda-scheduler-link"), ("PodDisruptionBudget", "pagoda-executor")} <= set(objects)
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        assert any(selector <= d["spec"]["template"]["metadata"]["labels"].items() for d in deployments), \
            f"Service {service['metadata']['name']} selects no pods"
    for d in deployments:
        c = container(d)
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_scheduler_has_grpc_probes_and_executors_reach_it_before_it_is_ready(tree):
    objects = by_kind_name(render(tree, "cpu"))
    scheduler = objects[("Deployment", "pagoda-scheduler")]
    assert scheduler["spec"]["replicas"] == 1 and scheduler["spec"]["strategy"]["type"] == "Recreate"
    c = container(scheduler)
    assert c["readinessProbe"]["grpc"] == {"port": 50051, "service": "pagoda.v1.Generation"}
    assert c["livenessProbe"]["grpc"] == {"port": 50051, "service": ""}
    link = objects[("Service", "pagoda-scheduler-link")]
    assert link["spec"]["publishNotReadyAddresses"] is True
    executor = objects[("Deployment", "pagoda-executor")]
    assert env(executor)["PAGODA_SCHEDULER"] == "tcp://pagoda-scheduler-link:5557"
    assert env(scheduler)["PAGODA_EXECUTOR_BIND"] == "tcp://0.0.0.0:5557"
    pdb = objects[("PodDisruptionBudget", "pagoda-executor")]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= \
        executor["spec"]["template"]["metadata"]["labels"].items()


def test_router_component_puts_smg_in_front_of_replicas_whose_grpc_port_only_it_reaches(tree):
    docs = render(tree, "cpu-router")
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    objects = by_kind_name(docs)
    replica, router = objects[("Deployment", "pagoda-replica")], objects[("Deployment", "pagoda-router")]
    scheduler, executor = replica["spec"]["template"]["spec"]["containers"]
    link = {e["name"]: e["value"] for e in scheduler["env"]}["PAGODA_EXECUTOR_BIND"]
    assert link == "tcp://127.0.0.1:5557" == {e["name"]: e["value"] for e in executor["env"]}["PAGODA_SCHEDULER"]
    assert scheduler["readinessProbe"]["grpc"] == {"port": 50051, "service": "vllm.grpc.engine.VllmEngine"}
    args = container(router)["args"]
    selector = args[args.index("--selector") + 1 : args.index("--selector") + 3]
    labels = replica["spec"]["template"]["metadata"]["labels"]
    assert all(labels[key] == value for key, value in (pair.split("=", 1) for pair in selector))
    assert "--backend=vllm" in args and "--api-key=$(SMG_API_KEY)" in args and "--service-discovery" in args
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "pagoda-router"
    assert objects[("Role", "pagoda-router")]["rules"][0]["resources"] == ["pods"]
    assert objects[("Service", "pagoda-router")]["spec"]["ports"][0]["port"] == 8080
    policy = objects[("NetworkPolicy", "pagoda-replica")]["spec"]
    grpc_rule = next(r for r in policy["ingress"] if r["ports"] == [{"protocol": "TCP", "port": 50051}])
    assert grpc_rule["from"] == [{"podSelector": {"matchLabels": router["spec"]["template"]["metadata"]["labels"]}}]


def test_both_services_mount_the_generated_cluster_secret(tree):
    docs = render(tree, "cpu")
    secrets = [d for d in docs if d["kind"] == "Secret"]
    assert len(secrets) == 1 and secrets[0]["metadata"]["name"].startswith("pagoda-cluster-secret-")
    for name in ("pagoda-scheduler", "pagoda-executor"):
        d = by_kind_name(docs)[("Deployment", name)]
        volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        assert volumes["cluster-secret"]["secret"]["secretName"] == secrets[0]["metadata"]["name"]
        assert env(d)["PAGODA_CLUSTER_SECRET_FILE"].startswith("/etc/pagoda/cluster-secret/")


def test_a_missing_cluster_secret_fails_the_render_instead_of_deploying_a_known_one(tmp_path):
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("cluster-secret", "RUN-deploy-k8s-make-secret.sh-FIRST"))
    run = subprocess.run([KUBECTL, "kustomize", str(copy / "overlays" / "cpu")], capture_output=True, text=True)
    assert run.returncode != 0 and "RUN-deploy-k8s-make-secret.sh-FIRST/cluster-secret" in run.stderr, run.stderr


def test_gpu_overlay_runs_cuda_executors_with_one_gpu_each(tree):
    objects = by_kind_name(render(tree, "gpu"))
    executor = objects[("Deployment", "pagoda-executor")]
    c = container(executor)
    assert c["image"] == "pagoda:cuda" and env(executor)["PAGODA_DEVICE"] == "cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container(objects[("Deployment", "pagoda-scheduler")])["image"] == "pagoda:cpu"


def test_gateway_component_targets_the_scheduler_service(tree):
    objects = by_kind_name(render(tree, "cpu-gateway"))
    gateway = objects[("Deployment", "pagoda-gateway")]
    assert container(gateway)["command"] == ["python", "-m", "gateway_svc"]
    assert env(gateway)["PAGODA_TARGET"] == "pagoda-scheduler:50051"
    assert container(gateway)["readinessProbe"]["httpGet"]["path"] == "/health"
    assert ("Service", "pagoda-gateway") in objects
    assert env(gateway)["PAGODA_GATEWAY_PORT"] == "8000" and "PAGODA_PORT" not in env(gateway)


def test_metrics_have_their_own_service_that_sees_a_scheduler_before_it_is_ready(tree):
    objects = by_kind_name(render(tree, "cpu"))
    clients = objects[("Service", "pagoda-scheduler")]
    assert [p["name"] for p in clients["spec"]["ports"]] == ["grpc"]
    metrics = objects[("Service", "pagoda-scheduler-metrics")]
    assert [p["port"] for p in metrics["spec"]["ports"]] == [9400]
    assert metrics["spec"]["publishNotReadyAddresses"] is True


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_executors_have_link_probes_and_threads_from_their_cpu_request(tree, overlay):
    executor = by_kind_name(render(tree, overlay))[("Deployment", "pagoda-executor")]
    c = container(executor)
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["exec"]["command"] == ["python", "/app/docker/healthcheck.py", "--link"]
    assert "livenessProbe" not in c  # executors outlive a scheduler restart by design
    threads = next(e for e in c["env"] if e["name"] == "PAGODA_NUM_THREADS")
    assert threads["valueFrom"]["resourceFieldRef"] == {"containerName": "executor", "resource": "requests.cpu",
                                                        "divisor": "1"}
    assert c["resources"]["requests"]["cpu"]
