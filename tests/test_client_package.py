"""The client as its own distribution: built, installed alone into a fresh venv, used against a real server.

What an application developer gets from `pip install ./client`: `batchstring.client` and the
`batchstring run` command, depending only on what the client imports, and no top-level import
name but `batchstring`, for this wheel and the server's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "onnx", "onnxruntime", "pytriton", "tritonserver", "aiohttp", "locust")


def build_wheel(source: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    str(source), "-w", str(out)], check=True, timeout=300)
    return next(out.glob("*.whl"))


def top_level_names(wheel: Path) -> set[str]:
    names = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    return {n for n in names if not n.endswith((".dist-info", ".data"))}


def requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    return {"client": build_wheel(ROOT / "client", out / "client"), "server": build_wheel(ROOT, out / "server")}


@pytest.fixture(scope="module")
def client_venv(wheels, tmp_path_factory) -> Path:
    """A fresh venv holding the client wheel and its dependencies, nothing else (versions as in this
    environment, so that nothing new is downloaded when they are already cached)."""
    where = tmp_path_factory.mktemp("client-venv") / "venv"
    venv.EnvBuilder(with_pip=True).create(where)
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                            text=True, check=True).stdout
    constraints = where.parent / "constraints.txt"
    constraints.write_text("\n".join(line for line in frozen.splitlines() if "==" in line))
    subprocess.run([str(where / "bin" / "python"), "-m", "pip", "install", "--quiet", "--constraint",
                    str(constraints), str(wheels["client"])], check=True, timeout=600)
    return where


def test_the_client_wheel_depends_only_on_what_the_client_imports(wheels):
    needs = sorted(re.split(r"[\[<>=;]", r)[0].strip() for r in requirements(wheels["client"]))
    assert needs == ["numpy", "tqdm", "tritonclient"]
    assert any(r.startswith("tritonclient[grpc]") for r in requirements(wheels["client"]))
    with zipfile.ZipFile(wheels["client"]) as z:
        assert "batchstring/client/py.typed" in z.namelist()
        assert not any(n.startswith("batchstring/__init__") for n in z.namelist()), "batchstring is a namespace"


def test_nothing_we_install_claims_a_generic_top_level_name(wheels, client_venv):
    for wheel in wheels.values():
        assert top_level_names(wheel) == {"batchstring"}, wheel.name
    record = next((client_venv / "lib").glob("python*/site-packages/batchstring_client-*.dist-info/RECORD"))
    installed = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines()}
    installed = {n for n in installed if not n.endswith(".dist-info") and n not in ("..", "__pycache__")}
    assert installed == {"batchstring"}


def test_the_installed_client_alone_serves_calls_async_calls_and_file_jobs(client_venv, server, tmp_path):
    python = client_venv / "bin" / "python"
    for heavy in HEAVY:
        found = subprocess.run([str(python), "-c", f"import {heavy}"], capture_output=True)
        assert found.returncode != 0, f"{heavy} must not be installed with the client"
    script = f"""
import asyncio, json
from batchstring.client import AsyncBatchClient, BatchstringError, InvalidArgument, batchstring
texts = batchstring(["def add(a, b):", "import os\\n"], url="{server.grpc_url}", max_tokens=8)
async def main():
    async with AsyncBatchClient("{server.grpc_url}") as client:
        return await client.batchstring(["class A:"], max_tokens=8)
try:
    batchstring([3], url="{server.grpc_url}")
except InvalidArgument as exc:
    refused = isinstance(exc, BatchstringError) and not exc.retryable
print(json.dumps({{"texts": texts, "async": asyncio.run(main()), "refused": refused}}))
"""
    ran = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    from batchstring.client import BatchClient

    with BatchClient(server.grpc_url) as reference:
        assert result["texts"] == reference.batchstring(["def add(a, b):", "import os\n"], max_tokens=8)
        assert result["async"] == reference.batchstring(["class A:"], max_tokens=8)
    assert result["refused"]

    source, output = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    source.write_text("def f():\nimport sys\n")
    job = subprocess.run([str(client_venv / "bin" / "batchstring"), "run", "--url", server.grpc_url, "--input",
                          str(source), "--output", str(output), "--max-tokens", "6"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": ""})
    assert job.returncode == 0, job.stderr
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == ["1", "2"]
    assert all(line["response"]["status_code"] == 200 for line in lines)


def test_the_client_installs_in_a_small_fraction_of_the_server(client_venv):
    """What the client brings is tritonclient's gRPC part with its own dependencies (numpy and
    ml_dtypes are most of it), against gigabytes for the server (torch, onnxruntime, tritonserver)."""
    site = next((client_venv / "lib").glob("python*/site-packages"))
    baseline = {"pip", "setuptools", "_distutils_hack", "pkg_resources", "distutils"}
    size = sum(f.stat().st_size for entry in site.iterdir() if re.split(r"[-.]", entry.name)[0] not in baseline
               for f in ([entry] if entry.is_file() else entry.rglob("*")) if f.is_file())
    assert size < 160 * 2**20, f"{size / 2**20:.0f} MiB installed with the client"
