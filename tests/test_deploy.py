"""Deployment artifacts, validated offline (no Docker engine, no GPU here), and scale-out.

What cannot run here (building the image, a GPU, a cluster) is checked statically; the image's
exact server command line is run against the local tritonserver binary.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml
from google.protobuf import text_format

from batchstring.client import BatchClient, Unauthenticated
from batchstring.server.local import LocalServer, ServerError, free_ports
from batchstring.server.repository import load_config
from batchstring.server.stats import batch_stats, metrics
from batchstring.server.triton import TritonInstall
from tests.conftest import (
    BATCHSTRING,
    GONE_BOUND,
    STOP_BOUND,
    assert_kill_leaves_nothing,
    gone_within,
    kinds,
    metric_reaches,
    start_server,
    temporary_files,
)

DOCKER = Path(__file__).resolve().parent.parent / "docker"
BIN = Path(sys.executable).parent


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=120)


def test_dockerfile_passes_hadolint():
    result = run_tool("hadolint", str(DOCKER / "Dockerfile"))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", ["compose.yaml", "compose.replicas.yaml"])
def test_compose_file_is_valid_compose_spec(name):
    result = run_tool("check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(DOCKER / name))
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_binds_loopback_reserves_a_gpu_and_checks_model_readiness():
    for file in ("compose.yaml", "compose.replicas.yaml"):
        for name, service in yaml.safe_load((DOCKER / file).read_text())["services"].items():
            for port in service.get("ports", []):
                assert port.startswith("127.0.0.1:"), f"{file}: {name} publishes {port} beyond loopback"
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
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
    assert pod["terminationGracePeriodSeconds"] >= grace_for_the_drain(container["env"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def grace_for_the_drain(env: list[dict] | dict) -> float:
    """What a stop needs: the drain deadline the deployment sets (else the entrypoint's default),
    the stop after it, and 2 s to spare."""
    values = env if isinstance(env, dict) else {e["name"]: e.get("value") for e in env}
    default = re.search(r"BATCHSTRING_DRAIN_SECONDS:-(\d+)", (DOCKER / "entrypoint.sh").read_text())[1]
    return float(values.get("BATCHSTRING_DRAIN_SECONDS", default)) + STOP_BOUND + 2


def test_compose_stop_grace_period_covers_the_drain():
    triton = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["triton"]
    grace = float(re.fullmatch(r"(\d+)s", triton["stop_grace_period"])[1])
    assert grace >= grace_for_the_drain(triton["environment"])


def manifests() -> dict[tuple[str, str], dict]:
    """Every Kubernetes object of docker/k8s, by (kind, name)."""
    return {(d["kind"], d["metadata"]["name"]): d for p in (DOCKER / "k8s").glob("*.yaml")
            for d in yaml.safe_load_all(p.read_text()) if d}


def test_kubernetes_pods_are_locked_down_and_can_be_drained():
    docs = {kind: d for (kind, name), d in manifests().items() if name == "batchstring"}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/tmp", "/dev/shm"} <= mounts, "writable emptyDirs where the server writes"
    policy = docs["NetworkPolicy"]["spec"]
    assert sorted(p["port"] for rule in policy["ingress"] for p in rule["ports"]) == [8000, 8001, 8002]
    reached = {(next(iter(rule["to"][0]["podSelector"]["matchLabels"].values())), p["port"])
               for rule in policy["egress"] for p in rule["ports"]}
    assert reached == {("batchstring-postgres", 5432), ("kube-dns", 53)}, "out of the pod: its store and DNS only"
    pdb, hpa = docs["PodDisruptionBudget"]["spec"], docs["HorizontalPodAutoscaler"]["spec"]
    drainable = pdb.get("maxUnavailable", 0) >= 1 or hpa["minReplicas"] > pdb.get("minAvailable", 0)
    assert drainable and hpa["minReplicas"] >= 2, "a node drain must be able to evict a pod while one keeps serving"
    assert hpa["scaleTargetRef"]["kind"] == "Deployment"


def test_pods_are_stateless_and_share_one_batch_store_from_a_secret():
    docs = manifests()
    spec = docs["Deployment", "batchstring"]["spec"]
    container = spec["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["BATCHSTRING_BATCH_STORE"]["valueFrom"]["secretKeyRef"]["name"] == "batchstring-batch-store", \
        "the store's URL (with its password) from a Secret, never a literal in the manifest"
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    data = next(m for m in container["volumeMounts"] if m["mountPath"] == "/data")
    assert "emptyDir" in volumes[data["name"]], "a pod's disk is scratch: batches and files live in the store"
    database = docs["StatefulSet", "batchstring-postgres"]["spec"]
    assert database["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    password = {e["name"]: e for e in database["template"]["spec"]["containers"][0]["env"]}["POSTGRES_PASSWORD"]
    assert password["valueFrom"]["secretKeyRef"]["name"] == "batchstring-postgres"
    ingress = docs["NetworkPolicy", "batchstring-postgres"]["spec"]["ingress"]
    assert ingress[0]["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "batchstring"}
    replicas = yaml.safe_load((DOCKER / "compose.replicas.yaml").read_text())
    servers = [s for s in replicas["services"].values() if "BATCHSTRING_BATCH_STORE" in s.get("environment", {})]
    assert len(servers) == 2 and all("@" in s["environment"]["BATCHSTRING_BATCH_STORE"] and ":" not in
                                     s["environment"]["BATCHSTRING_BATCH_STORE"].split("//")[1].split("@")[0]
                                     for s in servers), "no password in the compose file: PGPASSFILE, a secret"
    single = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["triton"]["environment"]
    assert "BATCHSTRING_BATCH_STORE" not in single, "one machine keeps the SQLite store by default"


def test_gpu_config_is_the_cpu_config_but_for_the_instance_kind_and_a_memory_sized_cache():
    gpu, cpu = load_config(), load_config(config_name="cpu")
    assert [g.kind for g in gpu.instance_group] == [gpu.instance_group[0].KIND_GPU]
    assert gpu.parameters["kv_cache_tokens"].string_value == "auto"
    assert cpu.parameters["kv_cache_tokens"].string_value == "32768"
    for group in cpu.instance_group:
        group.kind = group.KIND_GPU
    cpu.parameters["kv_cache_tokens"].string_value = "auto"
    assert text_format.MessageToString(cpu) == text_format.MessageToString(gpu)


# The acceptance GPU machine has torch, transformers, tokenizers, safetensors and numpy; our code on the
# device check's path must import none of these (what transformers itself imports is its business).
ACCEPTANCE_MACHINE_LACKS = ("grpc", "tritonclient", "psutil", "rich", "tqdm")
IMPORT_GUARD = """
import importlib.abc, runpy, sys
class Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked}:
            frame = sys._getframe(1)
            while frame and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
                if frame.f_globals["__name__"] == "importlib.util":
                    return None  # importlib.util.find_spec: asking whether it is there, not importing it
                frame = frame.f_back
            importer = frame.f_globals.get("__name__", "") if frame else ""
            if importer.startswith("batchstring"):
                raise ImportError(importer + " imports " + name + ", which the acceptance GPU machine lacks")
sys.meta_path.insert(0, Guard())
sys.argv = ["batchstring"] + sys.argv[1:]
runpy.run_module("batchstring.cli", run_name="__main__")
"""


def test_gpu_check_runs_end_to_end_on_the_cpu_with_what_the_acceptance_machine_has(model_dir, tmp_path):
    """The device check itself, tested on every commit: every stage on tiny shapes, its report
    written, and none of our modules on its path importing what the GPU machine does not have."""
    guard = IMPORT_GUARD.format(blocked=set(ACCEPTANCE_MACHINE_LACKS))
    result = subprocess.run([sys.executable, "-c", guard, "gpu-check", "--device", "cpu", "--quick", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [s["status"] for s in report["stages"]] == ["pass"] * 10
    text = (tmp_path / "report.md").read_text()
    for part in ("environment", "synthetic Llama-3.2-1B shape checkpoint", "shipped model, float16",
                 "shipped model, bfloat16", "synthetic Llama-3.2-1B shape, bfloat16", "max |Δ|/max(1,|truth|)",
                 "greedy 8 tokens identical to HF generate", "kv_cache_tokens auto on cpu: auto:",
                 "set by the live (4 sequences x 512-token context) ceiling", "| 4 |", "HF generate tok/s",
                 "long-context row", "long row among short ones: 3 rows of 97 past tokens and one of 200",
                 "per decode step, against", "CUDA graphs on cpu", "graphs are captured on CUDA devices only",
                 "structured output on cpu", "| 4 | constrained, no skipping |", "| 4 | constrained / free |",
                 "tokens with skipping equal without:"):
        assert part in text, part


def test_gpu_check_without_a_gpu_says_how_to_run_it_on_the_cpu():
    """Every GPU hidden from torch, so that this holds on a GPU host too."""
    result = subprocess.run([*BATCHSTRING, "gpu-check"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2 and "--device cpu --quick" in result.stderr


def test_gpu_config_is_refused_where_no_gpu_is_visible(model_dir):
    """Every GPU hidden from tritonserver, so that this holds on a GPU host too."""
    with pytest.raises(ServerError) as info:
        LocalServer(config="gpu", ready_timeout=60, environment={"CUDA_VISIBLE_DEVICES": ""}).start()
    assert "has kind KIND_GPU but no GPUs are available" in str(info.value)


def image_command_line(model_dir: Path, tmp_path: Path, **env_overrides) -> tuple[subprocess.Popen, int, int]:
    """docker/entrypoint.sh as the image runs it, with the local binary; returns (process, http, grpc)."""
    install = TritonInstall.find()
    http, grpc, metrics_port = free_ports()
    env = install.environment()
    env.update(TRITONSERVER=str(install.binary), MODEL_REPOSITORY=str(model_dir.parent.parent), PYTHON=sys.executable,
               BATCHSTRING_SOCKETS=str(tmp_path / "sockets"), BATCHSTRING_HOST="127.0.0.1",
               BATCHSTRING_HTTP_PORT=str(http), BATCHSTRING_GRPC_PORT=str(grpc),
               BATCHSTRING_METRICS_PORT=str(metrics_port), **env_overrides)
    extra = [f"--backend-directory={install.make_backend_dir(tmp_path)}", "--model-config-name=cpu"]
    proc = subprocess.Popen([str(DOCKER / "entrypoint.sh"), *extra], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, http, grpc


def wait_serving(client: BatchClient, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not client.ready():
        assert proc.poll() is None and time.monotonic() < deadline, "the image's command line did not serve"
        time.sleep(0.5)


def test_image_command_line_serves_the_model_behind_the_front_door(model_dir, tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text("image-key\n")
    before = temporary_files()
    proc, http, grpc = image_command_line(model_dir, tmp_path, BATCHSTRING_API_KEY_FILE=str(keys))
    bearer = {"Authorization": "Bearer image-key"}

    def post(path: str, body: bytes, headers: dict) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{http}{path}", data=body, headers=headers)
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())

    try:
        with BatchClient(f"127.0.0.1:{grpc}", api_key="image-key") as client:
            wait_serving(client, proc)
            assert client.batchstring(["def image():"], max_tokens=4)[0]
        with BatchClient(f"127.0.0.1:{grpc}", api_key="wrong") as client:
            refused = client.batchstring(["def image():"], max_tokens=4, return_exceptions=True)[0]
        assert isinstance(refused, Unauthenticated) and not refused.retryable
        assert "requires an API key" in str(refused)
        body = json.dumps({"text_input": "def image():", "max_tokens": 4, "temperature": 0}).encode()
        assert post("/v2/models/llm/generate", body, bearer)["text_output"]
        completion = json.dumps({"model": "llm", "prompt": "def image():", "max_tokens": 4}).encode()
        assert post("/v1/completions", completion, bearer)["choices"][0]["finish_reason"] in ("stop", "length")
        for path, data, headers, status in (("/v1/completions", completion, {}, 401),
                                            ("/v2/models/llm/generate", b"x" * (4 << 20), bearer, 413)):
            with pytest.raises(urllib.error.HTTPError) as refused:
                post(path, data, headers)
            assert refused.value.code == status, path
        sockets = tmp_path / "sockets"
        assert sockets.stat().st_mode & 0o777 == 0o700, "tritonserver's sockets are private to its user"
        assert {p.name for p in sockets.iterdir()} == {"http.sock", "grpc.sock:8001", "metrics.sock"}
        processes = psutil.Process(proc.pid).children(recursive=True)
        assert set(kinds(processes)) == {"front door", "tritonserver", "model"}
        signalled = time.monotonic()
        proc.terminate()
        assert proc.wait(timeout=30) == 0, "SIGTERM is a clean stop"
        took = time.monotonic() - signalled
        assert took <= STOP_BOUND, f"an idle stop took {took:.1f} s"
        assert gone_within(processes, GONE_BOUND) == []
        assert temporary_files() - before == set(), "no directory left in /tmp"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_image_exits_when_a_process_dies_so_that_restart_policies_act(model_dir, tmp_path):
    before = temporary_files()
    proc, _, grpc = image_command_line(model_dir, tmp_path)
    try:
        with BatchClient(f"127.0.0.1:{grpc}") as client:
            wait_serving(client, proc)
        processes = kinds(psutil.Process(proc.pid).children(recursive=True))
        processes["tritonserver"].kill()  # a crash of the server takes the container down with a failure status
        assert proc.wait(timeout=60) != 0
        assert gone_within([processes["model"]], GONE_BOUND) == [], "the model process ends with its server"
        assert temporary_files() - before == set(), "no directory left in /tmp"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigkill_of_the_image_command_line_leaves_no_process_and_frees_its_ports(model_dir, tmp_path):
    """Outside a container nothing else would end its children (in one, the kernel ends the
    container's processes with its PID 1): they die with it all the same."""
    proc, _, grpc = image_command_line(model_dir, tmp_path)
    try:
        with BatchClient(f"127.0.0.1:{grpc}") as client:
            wait_serving(client, proc)
        processes = psutil.Process(proc.pid).children(recursive=True)
        assert set(kinds(processes)) == {"front door", "tritonserver", "model"}
        front_door = kinds(processes)["front door"].cmdline()
        ports = [int(front_door[front_door.index(f"--{name}-port") + 1]) for name in ("http", "grpc", "metrics")]
        assert_kill_leaves_nothing(proc, processes, ports, "entrypoint")
    finally:
        if proc.poll() is None:
            proc.kill()


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
    from batchstring.client.aio import discover

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


# What the serving image installs a module under, when not its own name.
IMAGE_PACKAGES = {"onnxruntime": "onnxruntime-gpu", "protobuf": "tritonclient"}  # protobuf: with tritonclient[grpc]


def test_the_image_installs_every_package_the_serving_code_imports():
    """The code the image runs (engine, front door, client, model.py) imports nothing that its
    serving stage does not pip-install: a package missing there fails only on a GPU host."""
    import ast
    from importlib.metadata import packages_distributions

    dockerfile = (DOCKER / "Dockerfile").read_text()
    serving = dockerfile[dockerfile.rindex("FROM ") :]
    installed = set(re.findall(r"([A-Za-z0-9_.\-]+(?:\[[a-z,]+\])?)==", serving.replace('"', "")))
    modules = set()
    for folder in ("engine", "frontdoor", "client", "model_repository/llm/1"):
        for source in (DOCKER.parent / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.Import):
                    modules |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules.add(node.module.split(".")[0])
    ours = {"batchstring", "triton_python_backend_utils", "metrics", "responder"}
    distributions = packages_distributions()
    needed = {distributions[m][0].lower() for m in modules - set(sys.stdlib_module_names) - ours}
    installed = {name.split("[")[0].lower() for name in installed}
    missing = sorted(d for d in needed if IMAGE_PACKAGES.get(d, d) not in installed)
    assert "llguidance" in needed and "torch" in needed, "the scan must see the engine's imports"
    assert missing == [], f"the image's serving stage does not install {missing}"


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


def test_the_image_copies_every_module_the_serving_code_imports():
    """model.py, the engine, the front door and the client run in the image from what its server
    stage copies under /opt/batchstring/batchstring: every `batchstring.*` module they import,
    and what those import in turn, must be among the copies (a missing one fails the model's load,
    not the build)."""
    import ast

    root = DOCKER.parent
    copied: list[str] = []
    lines = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    for words in (line.split() for line in lines):
        if words[:1] == ["COPY"] and words[-1].startswith("/opt/batchstring/batchstring/"):
            copied += [w for w in words[1:-1] if not w.startswith("--")]

    def is_copied(path: Path) -> bool:
        relative = path.relative_to(root).as_posix()
        return any(relative == c or (c.endswith("/") and relative.startswith(c)) for c in copied)

    def module_file(name: str) -> Path:
        parts = name.split(".")[1:]
        module = root.joinpath(*parts)
        return module / "__init__.py" if module.is_dir() else module.with_suffix(".py")

    pending = [*root.glob("engine/*.py"), *root.glob("frontdoor/**/*.py"), *root.glob("client/*.py"),
               *(root / "model_repository" / "llm" / "1").glob("*.py")]
    seen, missing = set(), []
    while pending:
        path = pending.pop()
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if not name.startswith("batchstring.") or name in seen:
                    continue
                seen.add(name)
                target = module_file(name)
                if not is_copied(target):
                    missing.append(f"{name} ({path.relative_to(root)})")
                pending.append(target)
    assert len(seen) > 20 and missing == [], f"imported by the serving code but not copied into the image: {missing}"


def test_the_image_exits_when_its_model_process_dies_so_that_restart_policies_act(model_dir, tmp_path):
    proc, http, grpc = image_command_line(model_dir, tmp_path, BATCHSTRING_EXIT_WHEN_UNREADY="2")
    try:
        with BatchClient(f"127.0.0.1:{grpc}") as client:
            wait_serving(client, proc)  # the model dies at once, before the front door's own watch looks again
            stub = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                        if "triton_python_backend_stub" in " ".join(p.cmdline()))
            stub.kill()  # Triton itself keeps saying the model is ready; the front door knows better
            assert gone_within([stub], GONE_BOUND) == []
            deadline = time.monotonic() + 2  # the front door looks for the stub at most twice a second
            while client.ready() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not client.ready(), "gRPC readiness is judged as HTTP's is"
        with pytest.raises(urllib.error.HTTPError) as unready:
            urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/llm/ready", timeout=5)
        assert unready.value.code == 503
        assert proc.wait(timeout=30) != 0, "the container exits, so that Docker's restart policy acts"
    finally:
        if proc.poll() is None:
            proc.kill()
