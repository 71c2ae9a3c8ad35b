"""Deployment artifacts, validated offline (no Docker engine, no GPU here), and scale-out.

What cannot run here (building the image, a GPU, a cluster) is checked statically; the image's
exact server command line is run against the local tritonserver binary.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format

from client import BatchClient
from server.local import LocalServer, ServerError, free_ports
from server.repository import load_config
from server.stats import batch_stats, metrics
from server.triton import TritonInstall
from tests.conftest import metric_reaches, start_server

DOCKER = Path(__file__).resolve().parent.parent / "docker"
BIN = Path(sys.executable).parent


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=120)


def test_dockerfile_passes_hadolint():
    result = run_tool("hadolint", str(DOCKER / "Dockerfile"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_file_is_valid_compose_spec():
    result = run_tool("check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(DOCKER / "compose.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_binds_loopback_reserves_a_gpu_and_checks_model_readiness():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    triton = compose["services"]["triton"]
    assert triton["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "/v2/models/llm/ready" in " ".join(triton["healthcheck"]["test"])


def test_kubernetes_manifests_validate_against_the_schemas():
    manifests = sorted(str(p) for p in (DOCKER / "k8s").glob("*.yaml"))
    result = run_tool("kubernetes-validate", "--strict", *manifests)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_probes_and_grace_period_match_the_server():
    deployment = yaml.safe_load((DOCKER / "k8s" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/v2/models/llm/ready"
    exit_timeout = int(re.search(r"--exit-timeout-secs=(\d+)", (DOCKER / "entrypoint.sh").read_text())[1])
    assert pod["terminationGracePeriodSeconds"] > exit_timeout
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_gpu_config_is_the_cpu_config_but_for_the_instance_kind():
    gpu, cpu = load_config(), load_config(config_name="cpu")
    assert [g.kind for g in gpu.instance_group] == [gpu.instance_group[0].KIND_GPU]
    for group in cpu.instance_group:
        group.kind = group.KIND_GPU
    assert text_format.MessageToString(cpu) == text_format.MessageToString(gpu)


def test_gpu_config_is_refused_here_because_there_is_no_gpu(model_dir):
    with pytest.raises(ServerError) as info:
        LocalServer(config="gpu", ready_timeout=60).start()
    assert "has kind KIND_GPU but no GPUs are available" in str(info.value)


def test_image_command_line_serves_the_model_with_the_local_binary(model_dir, tmp_path):
    install = TritonInstall.find()
    http, grpc, metrics_port = free_ports()
    env = install.environment()
    env.update(TRITONSERVER=str(install.binary), MODEL_REPOSITORY=str(model_dir.parent.parent))
    extra = [f"--backend-directory={install.make_backend_dir(tmp_path)}", "--model-config-name=cpu",
             f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics_port}"]
    proc = subprocess.Popen([str(DOCKER / "entrypoint.sh"), *extra], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with BatchClient(f"127.0.0.1:{grpc}") as client:
            deadline = time.monotonic() + 120
            while not client.ready():
                assert proc.poll() is None and time.monotonic() < deadline, "the image's command line did not serve"
                time.sleep(0.5)
            assert client.batchstring(["def image():"], max_tokens=4)[0]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_grafana_dashboard_only_uses_metrics_the_server_exports(server, client):
    client.batchstring(["def dashboard():"], max_tokens=4)
    metric_reaches(server.metrics_url, "batchstring_generated_tokens_total", 4)
    exported = set(metrics(server.metrics_url))
    dashboard = json.loads((DOCKER / "monitoring" / "grafana" / "dashboards" / "batchstring.json").read_text())
    used = {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"\b((?:nv|batchstring)_[a-z_]+)\b", target["expr"])}
    assert used and used <= exported, f"not exported: {used - exported}"


def test_client_spreads_across_two_servers_and_skips_one_that_goes_away(request, model_dir):
    one = start_server(request, "balance-1", config="cpu")
    two = start_server(request, "balance-2", config="cpu")
    before = [batch_stats(s.grpc_url) for s in (one, two)]
    prompts = [f"def spread_{i}():" for i in range(48)]
    with BatchClient([one.grpc_url, two.grpc_url]) as client:
        expected = client.batchstring(prompts, max_tokens=6)
        served = [(batch_stats(s.grpc_url) - b).requests for s, b in zip((one, two), before)]
        assert min(served) >= 12, f"least-outstanding balancing should use both servers: {served}"
        two.stop()
        assert client.batchstring(prompts, max_tokens=6) == expected


def test_discovery_expands_a_name_to_every_address(monkeypatch):
    from client.aio import discover

    def fake(host, port, type=0):
        assert host == "batchstring-headless.default.svc"
        return [(socket.AF_INET, type, 6, "", ("10.0.0.7", port)), (socket.AF_INET, type, 6, "", ("10.0.0.8", port)),
                (socket.AF_INET6, type, 6, "", ("fd00::9", port, 0, 0))]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    assert discover(["batchstring-headless.default.svc:8001"]) == {
        "10.0.0.7:8001": "batchstring-headless.default.svc",
        "10.0.0.8:8001": "batchstring-headless.default.svc",
        "[fd00::9]:8001": "batchstring-headless.default.svc",
    }


def test_every_file_the_dockerfile_copies_from_the_repository_exists():
    root = DOCKER.parent
    copies = []
    for line in (DOCKER / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            copies += [w for w in words[1:-1] if not w.startswith("--")]  # every source; the last word is the target
    assert len(copies) >= 7
    missing = [c for c in copies if not (root / c).exists()]
    assert missing == [], f"the Dockerfile copies files that are not in the repository: {missing}"
