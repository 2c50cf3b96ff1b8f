"""deploy/kubernetes: the base and the GPU overlay, rendered offline with `kubectl kustomize`, validated against
their schemas (Kubernetes, KEDA, Prometheus Operator: tests/deploy/validate.js), and checked for what an
operator would notice: probes, resources, drain time, a worker and a scaler per online queue, no secrets shipped.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.conf import settings

from inference.core.queues import online_queues
from inference.core.registry import parse_registry
from tests.conftest import ROOT

KUSTOMIZATIONS = {"base": "deploy/kubernetes/base", "gpu": "deploy/kubernetes/overlays/gpu"}
VALIDATOR = ROOT / "tests" / "deploy" / "validate.js"
OPERATIONS = ROOT / "docs" / "operations.md"
MARGIN_S = 10  # beyond a worker's longest batch: hand back what it held, stop its children


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed: the manifests cannot be rendered here (CI installs kubectl)")
    return path


@functools.cache
def render(which: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [kubectl(), "kustomize", KUSTOMIZATIONS[which]], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return [obj for obj in yaml.safe_load_all(result.stdout) if obj]


@pytest.fixture(params=sorted(KUSTOMIZATIONS))
def objects(request) -> list[dict[str, Any]]:
    return render(request.param)


def of_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def worker_queue(deployment: dict[str, Any]) -> str | None:
    """The queue a Celery worker Deployment consumes (its -Q), or None for anything else."""
    for container in pod_spec(deployment)["containers"]:
        args = container.get("args") or container.get("command") or []
        if args[:4] == ["celery", "-A", "platform_", "worker"]:
            return args[args.index("-Q") + 1]
    return None


def workers(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Worker Deployments by queue."""
    found: dict[str, dict[str, Any]] = {}
    for deployment in of_kind(objects, "Deployment").values():
        queue = worker_queue(deployment)
        if queue is not None:
            assert queue not in found, f"two Deployments consume {queue}"
            found[queue] = deployment
    return found


def container_env(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The plain values a container's environment gets: its ConfigMaps (envFrom), then its own env."""
    configmaps = of_kind(objects, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(configmaps[source["configMapRef"]["name"]]["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def models_file(objects: list[dict[str, Any]]) -> str:
    """The models file the workers mount (the ConfigMap behind their `models` volume)."""
    deployment = next(iter(workers(objects).values()))
    volume = next(v for v in pod_spec(deployment)["volumes"] if v["name"] == "models")
    return of_kind(objects, "ConfigMap")[volume["configMap"]["name"]]["data"]["models.yaml"]


def groups(objects: list[dict[str, Any]]) -> dict[str, list[str]]:
    raw = yaml.safe_load(models_file(objects))
    return online_queues(parse_registry(raw, device="cpu", torch_threads=1, max_backlog=1))


def seconds(env: dict[str, str], name: str) -> float:
    return float(env.get(name, getattr(settings, name)))


def test_every_object_matches_its_schema_and_names_only_fields_the_schema_knows(objects):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the schemas are checked by tests/deploy/validate.js (CI has node)")
    if not (VALIDATOR.parent / "node_modules").is_dir():
        pytest.skip("the schema packages are not installed: run `npm ci --prefix tests/deploy` (.ci/run does)")
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "ScaledObject", "PodDisruptionBudget", "Job"} <= kinds
    result = subprocess.run([node, str(VALIDATOR)], input=json.dumps(objects), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"valid: {len(objects)} objects"


def test_the_validator_refuses_a_misspelt_field_a_wrong_type_and_a_kind_it_has_no_schema_for():
    node = shutil.which("node")
    if node is None or not (VALIDATOR.parent / "node_modules").is_dir():
        pytest.skip("node or the schema packages are missing: run `npm ci --prefix tests/deploy`")
    pod = {"containers": [{"name": "w", "image": "i", "livenessProbes": {"exec": {"command": ["true"]}}}]}
    bad = [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "misspelt"},
            "spec": {
                "selector": {"matchLabels": {"a": "b"}},
                "template": {"metadata": {"labels": {"a": "b"}}, "spec": pod},
            },
        },
        {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": {"name": "wrong-type"},
            "spec": {
                "scaleTargetRef": {"name": "x"},
                "maxReplicaCount": "4",
                "triggers": [{"type": "redis", "metadata": {}}],
            },
        },
        {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "unknown"}},
    ]
    result = subprocess.run([node, str(VALIDATOR)], input=json.dumps(bad), capture_output=True, text=True)
    assert result.returncode == 1
    assert "Deployment/misspelt: Object literal may only specify known properties" in result.stdout
    assert "livenessProbes" in result.stdout
    assert "ScaledObject/wrong-type: data/spec/maxReplicaCount must be integer" in result.stdout
    assert "Widget/unknown: no schema for example.com/v1 Widget" in result.stdout


def test_every_deployment_has_probes_resources_and_a_grace_period_that_covers_its_drain(objects):
    deployments = of_kind(objects, "Deployment")
    assert {"web", "flower"} <= set(deployments)
    for name, deployment in deployments.items():
        spec = pod_spec(deployment)
        grace_s = spec["terminationGracePeriodSeconds"]
        for container in spec["containers"]:
            where = f"{name}/{container['name']}"
            assert "livenessProbe" in container and "readinessProbe" in container, f"{where}: probes"
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][bound]), f"{where}: {bound}"
            env = container_env(objects, container)
            queue = worker_queue(deployment)
            if queue == "offline":
                # A dispatch in progress may run up to OFFLINE_TIME_LIMIT_S and is finished before exit.
                assert grace_s >= seconds(env, "OFFLINE_TIME_LIMIT_S") + MARGIN_S, where
            elif queue is not None:
                assert grace_s >= seconds(env, "ONLINE_TIME_LIMIT_S") + MARGIN_S, where
            if queue is not None:
                live = container["livenessProbe"]["exec"]["command"]
                ready = container["readinessProbe"]["exec"]["command"]
                assert live == ["python", "manage.py", "worker_probe", "--live"], where
                assert ready == ["python", "manage.py", "worker_probe", "--ready"], where
                # Loading models must not be mistaken for a dead worker.
                assert container["startupProbe"]["exec"]["command"] == ready, where
            if name == "web":
                args = container["args"]
                graceful_s = float(args[args.index("--timeout-graceful-shutdown") + 1])
                pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
                assert pre_stop[0] == "sleep"
                # A waiting predict call is answered or times out within its deadline.
                assert graceful_s >= settings.ONLINE_MAX_DEADLINE_MS / 1000
                assert grace_s >= float(pre_stop[1]) + graceful_s
                assert container["livenessProbe"]["httpGet"]["path"] == "/api/v1/health"


def test_every_online_group_of_the_models_file_has_a_worker_and_a_scaler_on_its_queue(objects):
    by_queue = workers(objects)
    scalers = of_kind(objects, "ScaledObject")
    expected = groups(objects)
    assert {"online.router", "online.embedding", "online.identity"} <= set(expected)
    # No worker for a queue the models file no longer has, and no catch-all `-Q online` worker.
    assert set(by_queue) == {*expected, "offline"}
    for queue in expected:
        deployment = by_queue[queue]
        name = deployment["metadata"]["name"]
        scaler = scalers[name]
        assert scaler["spec"]["scaleTargetRef"]["name"] == name
        triggers = scaler["spec"]["triggers"]
        on_queue = [t for t in triggers if (t["type"] == "prometheus" and f'queue="{queue}"' in t["metadata"]["query"])]
        assert on_queue, f"{name} does not scale on {queue}"


def test_the_offline_worker_scales_on_the_rows_queued_in_the_database(objects):
    """Not on the `offline` Redis list: the fair-share scheduler sends it only a chunk or so per child."""
    deployment = workers(objects)["offline"]
    scaler = of_kind(objects, "ScaledObject")[deployment["metadata"]["name"]]
    (trigger,) = scaler["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and "offline_queued_rows" in trigger["metadata"]["query"]
    assert int(trigger["metadata"]["threshold"]) > 0
    assert scaler["metadata"]["labels"]["inference-platform/scaler"] == "prometheus"


def test_nothing_scales_on_cpu_and_scaling_is_bounded_quick_up_and_slow_down(objects):
    deployments = of_kind(objects, "Deployment")
    scalers = of_kind(objects, "ScaledObject")
    assert set(scalers) == {d["metadata"]["name"] for d in workers(objects).values()}
    for name, scaler in scalers.items():
        spec = scaler["spec"]
        assert all(t["type"] not in ("cpu", "memory") for t in spec["triggers"]), name
        assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"], name
        assert spec["pollingInterval"] <= 30 and spec["cooldownPeriod"] >= 60, name
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0, name
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300, name
        # The HPA owns the replica count: a fixed one would be reset on every apply.
        assert "replicas" not in deployments[spec["scaleTargetRef"]["name"]]["spec"], name


def referenced_secrets(objects: list[dict[str, Any]]) -> set[tuple[str, str | None]]:
    found: set[tuple[str, str | None]] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "secretKeyRef" in node:
                found.add((node["secretKeyRef"]["name"], node["secretKeyRef"]["key"]))
            if "secretRef" in node:
                found.add((node["secretRef"]["name"], None))
            if "secretTargetRef" in node:
                found.update((ref["name"], ref["key"]) for ref in node["secretTargetRef"])
            if isinstance(node.get("credentials"), dict) and "key" in node["credentials"]:
                found.add((node["credentials"]["name"], node["credentials"]["key"]))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(objects)
    return found


def test_no_secret_is_shipped_and_each_one_referenced_is_in_the_operations_guide(objects):
    assert not of_kind(objects, "Secret"), "Secrets are created by the operator, never shipped with values"
    guide = OPERATIONS.read_text()
    secrets = referenced_secrets(objects)
    assert {name for name, _ in secrets} == {"inference-platform", "inference-flower"}
    for name, key in secrets:
        assert f"create secret generic {name}" in guide, f"docs/operations.md does not say how to create {name}"
        if key is not None:
            assert f"--from-literal={key}=" in guide or f"--from-file={key}=" in guide, f"{name}: key {key}"


def test_web_and_workers_start_only_after_the_migrate_job(objects):
    (job,) = of_kind(objects, "Job").values()
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["python", "manage.py", "migrate", "--noinput"]
    for name, deployment in of_kind(objects, "Deployment").items():
        if name == "flower":  # reads nothing from the database
            continue
        init = pod_spec(deployment)["initContainers"]
        assert any("manage.py migrate --check" in " ".join(c["args"]) for c in init), name


def test_command_variables_are_defined_in_the_container_itself(objects):
    """Kubernetes expands $(VAR) in args only from variables it knows; a typo would reach Celery as text."""
    for name, deployment in of_kind(objects, "Deployment").items():
        for container in pod_spec(deployment)["containers"] + pod_spec(deployment).get("initContainers", []):
            defined = {e["name"] for e in container.get("env", [])}
            used = set(re.findall(r"\$\((\w+)\)", " ".join(container.get("args", []) + container.get("command", []))))
            assert used <= defined, f"{name}/{container['name']}: {sorted(used - defined)}"


def test_budgets_and_services_select_pods_that_exist(objects):
    pod_labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in of_kind(objects, "Deployment").items()}

    def selects(selector: dict[str, str]) -> list[str]:
        return [n for n, labels in pod_labels.items() if selector.items() <= labels.items()]

    budgets = of_kind(objects, "PodDisruptionBudget")
    guarded = {n for b in budgets.values() for n in selects(b["spec"]["selector"]["matchLabels"])}
    assert {"web", *(d["metadata"]["name"] for d in workers(objects).values())} <= guarded
    for budget in budgets.values():
        assert len(selects(budget["spec"]["selector"]["matchLabels"])) == 1, budget["metadata"]["name"]
    for name, service in of_kind(objects, "Service").items():
        (target,) = selects(service["spec"]["selector"])
        ports = {p["name"] for c in pod_spec(of_kind(objects, "Deployment")[target])["containers"] for p in c["ports"]}
        assert all(p["targetPort"] in ports for p in service["spec"]["ports"]), name


def test_the_models_configmap_is_the_repositorys_models_file_mounted_where_the_settings_point(objects):
    assert models_file(objects) == (ROOT / "inference" / "models.yaml").read_text(), (
        "deploy/kubernetes/base/models.yaml differs from inference/models.yaml: "
        "cp inference/models.yaml deploy/kubernetes/base/models.yaml (and add a worker per new online group)"
    )
    for name, deployment in of_kind(objects, "Deployment").items():
        for container in pod_spec(deployment)["containers"]:
            path = Path(container_env(objects, container)["INFERENCE_MODELS_FILE"])
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts.get(str(path.parent)) == "models", name


def test_the_gpu_overlay_gives_each_model_worker_one_gpu_and_the_base_none():
    base, gpu = render("base"), render("gpu")
    for deployment in of_kind(base, "Deployment").values():
        assert "nvidia.com/gpu" not in json.dumps(deployment["spec"]["template"]["spec"]["containers"])
    models = yaml.safe_load(models_file(gpu))["models"]
    for queue, deployment in workers(gpu).items():
        spec = pod_spec(deployment)
        (container,) = spec["containers"]
        env = container_env(gpu, container)
        served = groups(gpu).get(queue, list(models))  # the offline worker serves every model
        if all(models[m]["task"] == "identity" for m in served):
            assert "nvidia.com/gpu" not in container["resources"]["limits"], queue  # no weights, no GPU
            continue
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1, queue
        assert env["INFERENCE_DEVICE"] == "cuda", queue
        args = container["args"]
        assert args[args.index("-c") + 1] == "$(WORKER_CONCURRENCY)" and env["WORKER_CONCURRENCY"] == "1", queue
        assert spec["nodeSelector"] and spec["tolerations"], queue


def test_worker_commands_are_the_ones_the_docs_describe(objects):
    """Each worker consumes one queue, named after its host (pod) so heartbeats and probes agree."""
    for deployment in workers(objects).values():
        args = pod_spec(deployment)["containers"][0]["args"]
        assert args[args.index("-n") + 1].endswith("@%h"), shlex.join(args)
        assert "--without-gossip" in args and "--without-mingle" in args
