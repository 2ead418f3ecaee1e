"""deploy/ checked against the code it runs: files parse, every `kbmesh serve` names a real
service, every KBMESH_* variable is a real setting with a valid value, every process passes
the runtime's start-up checks, and health checks hit real gateway paths.

Fast and offline: no Docker engine, no cluster; the files are read, the code is imported.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import pytest
from pydantic import BaseModel

from services.cli.runtime import SERVICES, check_services
from services.common.bus import auth as busauth
from services.common.messages.names import DLQ_STREAM, STREAM, UPSTREAM_STREAM
from services.common.settings import RETIRED, ClientSettings, Settings
from tests.support.bus import matches

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed in this environment")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
KUBERNETES = DEPLOY / "kubernetes"
DOCKERFILE = ROOT / "Dockerfile"
HEALTHCHECK_SCRIPT = DEPLOY / "docker" / "healthcheck.py"
# A KBMESH_* name; `${KBMESH_...}` in compose is a host-side variable, not a setting.
KBMESH_VAR = re.compile(r"(?<![\w{])KBMESH_[A-Z0-9_]*[A-Z0-9]")
INTERPOLATION = re.compile(r"\$\{([^}:]+)(?::?-([^}]*))?\}")


# ---- reading deploy/ ----------------------------------------------------------------------


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def load_documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def compose_file() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` as on a host that sets none of the variables."""
    return INTERPOLATION.sub(lambda m: m.group(2) or "", value)


def as_env(environment: dict[str, Any] | list[str] | None) -> dict[str, str]:
    if environment is None:
        return {}
    if isinstance(environment, list):
        pairs = (item.split("=", 1) for item in environment)
        return {k: interpolate(v) for k, v in pairs}
    return {k: interpolate("" if v is None else str(v)) for k, v in environment.items()}


def kbmesh_services(command: list[str]) -> list[str] | None:
    """The services a `kbmesh serve A B ...` command line runs (all of them for `kbmesh up`),
    or None when it is no kbmesh server command."""
    names = [Path(part).name for part in command]
    if "kbmesh" not in names:
        return None
    rest = command[names.index("kbmesh") + 1 :]
    if rest[:1] == ["up"]:
        return list(SERVICES)
    if rest[:1] != ["serve"]:
        return None
    services = []
    for part in rest[1:]:
        if part.startswith("-"):
            break
        services.append(part)
    return services


@dataclass
class Process:
    """One kbmesh process as deployed: where it is declared, its command and environment."""

    where: str
    command: list[str]
    env: dict[str, str]
    replicas: int = 1
    ports: list[int] = field(default_factory=list)

    @property
    def services(self) -> list[str]:
        return kbmesh_services(self.command) or []


def compose_processes() -> list[Process]:
    out = []
    for name, svc in compose_file()["services"].items():
        command = svc.get("command")
        if isinstance(command, str):
            command = command.split()
        if not command or kbmesh_services(command) is None:
            continue
        ports = [int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in svc.get("ports", [])]
        replicas = int(svc.get("deploy", {}).get("replicas", 1))
        out.append(
            Process(f"compose:{name}", command, as_env(svc.get("environment")), replicas, ports)
        )
    return out


def k8s_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        docs += [d for d in load_documents(path) if isinstance(d, dict) and "kind" in d]
    return docs


def k8s_processes() -> list[Process]:
    docs = k8s_documents()
    config_maps = {
        d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"
    }
    secrets = {
        d["metadata"]["name"]: d.get("stringData", {}) for d in docs if d["kind"] == "Secret"
    }
    out = []
    for doc in docs:
        if doc["kind"] != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            command = [*container.get("command", []), *container.get("args", [])]
            env: dict[str, str] = {}
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    env.update(config_maps[source["configMapRef"]["name"]])
                if "secretRef" in source:
                    env.update(secrets.get(source["secretRef"]["name"], {}))
            env.update(
                {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}
            )
            ports = [p["containerPort"] for p in container.get("ports", [])]
            out.append(
                Process(
                    f"kubernetes:{doc['metadata']['name']}",
                    command,
                    env,
                    int(doc["spec"].get("replicas", 1)),
                    ports,
                )
            )
    return out


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def setting_env_names(model: type[BaseModel] = Settings, prefix: str = "KBMESH_") -> set[str]:
    """Every environment variable pydantic-settings maps onto `model`: one per field, and
    one per nested field with the `__` delimiter (the whole nested model takes JSON too)."""
    names = set()
    for name, info in model.model_fields.items():
        env = f"{prefix}{name.upper()}"
        names.add(env)
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names |= setting_env_names(annotation, env + "__")
    return names


@pytest.fixture
def settings_from(monkeypatch: pytest.MonkeyPatch):
    """Build `Settings` exactly as a process with this environment would."""

    def build(env: dict[str, str]) -> Settings:
        with monkeypatch.context() as m:
            for name in [n for n in os.environ if n.upper().startswith("KBMESH_")]:
                m.delenv(name)
            for name, value in env.items():
                if name.startswith("KBMESH_"):
                    m.setenv(name, value)
            return Settings()

    return build


def gateway_get_paths() -> set[str]:
    """The GET paths of the real gateway app (built on stand-in parts; nothing connects)."""
    from services.gateway.app import create_app
    from services.gateway.auth import KeyResolver
    from services.gateway.service import GatewayService

    settings = Settings(mcp_toolsets="")
    service = GatewayService(None, SimpleNamespace(keys=None), settings)  # type: ignore[arg-type]
    keys = KeyResolver(None, settings.default_org)  # type: ignore[arg-type]
    paths = create_app(service, keys).openapi()["paths"]
    return {path for path, methods in paths.items() if "get" in methods}


def load_healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kbmesh_healthcheck", HEALTHCHECK_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def health_check_paths(test: list[str]) -> Iterator[str]:
    """The URL paths a health-check command requests: the argument of healthcheck.py
    (default /healthz), or the path of any http:// URL in it."""
    for i, part in enumerate(test):
        if part.endswith("healthcheck.py"):
            following = test[i + 1 : i + 2]
            yield following[0] if following else "/healthz"
        elif part.startswith("http://"):
            yield urlparse(part).path


# ---- tests --------------------------------------------------------------------------------


def test_every_yaml_and_json_file_under_deploy_parses() -> None:
    """A syntax slip in any compose, Kubernetes, Helm values or observability file fails
    here instead of at `docker compose up` or `kubectl apply`."""
    files = yaml_files()
    assert COMPOSE in files and len(files) >= 10
    for path in files:
        assert load_documents(path), f"{path.relative_to(ROOT)} holds no document"
    for path in sorted(DEPLOY.rglob("*.json")):
        assert json.loads(path.read_text()), path


def test_kbmesh_commands_name_real_services_and_cover_all_four() -> None:
    """Every `kbmesh serve ...` in compose, Kubernetes and the Dockerfile's CMD names
    services of services.cli.runtime.SERVICES, and compose and Kubernetes each run all of them."""
    cmd = next(args for keyword, args in dockerfile_instructions() if keyword == "CMD")
    dockerfile = Process("Dockerfile:CMD", json.loads(cmd), {})
    assert dockerfile.command == ["kbmesh", "serve", "gateway"]
    for group in (compose_processes(), k8s_processes()):
        run = set()
        for process in [*group, dockerfile]:
            unknown = set(process.services) - set(SERVICES)
            assert process.services and not unknown, f"{process.where}: {process.command}"
            run |= set(process.services)
        assert run == set(SERVICES), group[0].where


def test_kbmesh_variables_in_deploy_are_real_settings() -> None:
    """Every KBMESH_* name anywhere in deploy/ or the Dockerfile (values, keys and commented
    examples alike) is a field of services.common.settings.Settings, nested ones with `__`,
    or of the CLI's ClientSettings (the `kbmesh sources apply` Job's API and key), so no
    deployment sets a variable that kbmesh silently ignores. (The stream name KBMESH_DLQ is
    no variable and is told apart by services.common.messages.events.)"""
    known = setting_env_names() | setting_env_names(ClientSettings)
    assert {"KBMESH_NATS_URL", "KBMESH_BUS__MAX_DELIVER", "KBMESH_SEARCH__CONCURRENCY"} <= known
    files = [DOCKERFILE, *(p for p in DEPLOY.rglob("*") if p.is_file())]
    used: dict[str, set[str]] = {}
    for path in files:
        for name in KBMESH_VAR.findall(path.read_text()):
            used.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert "KBMESH_QDRANT_URL" in used
    streams = {STREAM, UPSTREAM_STREAM, DLQ_STREAM}
    unknown = {
        name: sorted(where)
        for name, where in used.items()
        if name not in known and name not in streams
    }
    assert not unknown, f"not settings of services.common.settings.Settings: {unknown}"


def test_every_process_starts_with_its_settings(settings_from) -> None:
    """Each compose service and Kubernetes Deployment running kbmesh: its environment
    validates as Settings (types, JSON lists), its service set passes the runtime's start-up
    check, it has a NATS URL (`kbmesh serve` needs one), replicated embed/search use a Qdrant
    server (Edge is single-process), and the gateway listens on all interfaces at the port
    the deployment exposes."""
    processes = [*compose_processes(), *k8s_processes()]
    assert len(processes) >= 8
    for p in processes:
        settings = settings_from(p.env)
        check_services(p.services, settings)  # raises SystemExit on a bad combination
        assert settings.nats_url, p.where
        if {"embed", "search"} & set(p.services):
            assert settings.store_kind == "server" or p.replicas == 1, p.where
        if "gateway" in p.services:
            assert settings.host == "0.0.0.0", p.where
            assert settings.port in p.ports, f"{p.where}: {settings.port} not in {p.ports}"


def test_health_checks_hit_real_gateway_paths() -> None:
    """The Dockerfile HEALTHCHECK, the compose gateway's healthcheck and the Kubernetes
    gateway probes request GET paths the gateway app really serves, and the script they
    call is the one the image installs."""
    paths = gateway_get_paths()
    assert {"/healthz", "/readyz"} <= paths
    instructions = dockerfile_instructions()
    installed = [
        args.split()[-1]
        for keyword, args in instructions
        if keyword == "COPY" and "healthcheck.py" in args
    ]
    assert installed, "the Dockerfile does not install healthcheck.py"
    checked: list[str] = []

    healthcheck = next(args for keyword, args in instructions if keyword == "HEALTHCHECK")
    test = json.loads(healthcheck[healthcheck.index("CMD") + 3 :])
    assert installed[0] in test
    checked += health_check_paths(test)

    for name, svc in compose_file()["services"].items():
        health = svc.get("healthcheck") or {}
        if health.get("disable") or "test" not in health:
            continue
        if any("healthcheck.py" in part for part in health["test"]):
            assert installed[0] in health["test"], name
            found = list(health_check_paths(health["test"]))
            assert found, name
            checked += found

    for doc in k8s_documents():
        if doc["kind"] != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in container:
                    checked.append(container[probe]["httpGet"]["path"])

    assert {"/healthz", "/readyz"} <= set(checked)
    assert set(checked) <= paths, f"not gateway GET paths: {set(checked) - paths}"


def test_gateway_deployments_probe_readiness_and_liveness() -> None:
    """The Kubernetes gateway has both probes (workers have no HTTP endpoint to probe)."""
    for doc in k8s_documents():
        if doc["kind"] != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            services = kbmesh_services(container["command"]) or []
            probed = "readinessProbe" in container and "livenessProbe" in container
            assert probed == ("gateway" in services), doc["metadata"]["name"]


def test_healthcheck_script_checks_only_processes_that_serve_http() -> None:
    """healthcheck.py finds the gateway port from the container's command line (and its
    `--port`), and passes the workers, which serve no HTTP."""
    script = load_healthcheck()
    port = script.gateway_port
    assert (
        port(["/opt/venv/bin/python", "/opt/venv/bin/kbmesh", "serve", "gateway"], "8080") == "8080"
    )
    assert (
        port(["/sbin/docker-init", "--", "kbmesh", "serve", "search", "gateway"], "8080") == "8080"
    )
    assert port(["kbmesh", "up", "--port", "9000"], "8080") == "9000"
    assert port(["kbmesh", "up", "--port=9001"], "8080") == "9001"
    assert port(["kbmesh", "serve", "embed"], "8080") is None
    assert port(["kbmesh", "keys", "create", "--org", "gateway"], "8080") is None
    assert port(["nats-server", "-js"], "8080") is None


def test_dockerfile_pins_torch_like_pyproject_and_runs_unprivileged() -> None:
    """The image installs the torch version pyproject.toml pins (CPU build first), and its
    final stage runs as a numeric non-root user."""
    pins = [
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.replace(" ", "").startswith("torch==")
    ]
    assert len(pins) == 1
    wanted = pins[0].split("==", 1)[1].strip()
    instructions = dockerfile_instructions()
    assert ("ARG", f"TORCH_VERSION={wanted}") in instructions
    torch_step = next(i for i, (k, a) in enumerate(instructions) if k == "RUN" and "torch==" in a)
    project_step = next(
        i for i, (k, a) in enumerate(instructions) if k == "RUN" and "pip install ." in a
    )
    assert torch_step < project_step
    user = [args for keyword, args in instructions if keyword == "USER"][-1]
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) != 0


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: the last pattern matching the path or a parent wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        if any(
            fnmatch.fnmatchcase(c, pat) or fnmatch.fnmatchcase(c, pat.replace("**/", ""))
            for c in candidates
        ):
            excluded = not negated
    return excluded


def test_docker_build_context_holds_what_the_dockerfile_copies() -> None:
    """Every COPY source exists and survives .dockerignore (an allow-list), while caches
    and bytecode stay out of the context."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = []
    for keyword, args in dockerfile_instructions():
        if keyword == "COPY" and not args.startswith("--from"):
            sources += args.split()[:-1]
    assert {"pyproject.toml", "README.md", "services"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not dockerignore_excludes(source, patterns), f"{source} is excluded"
    assert not dockerignore_excludes("services/cli/runtime.py", patterns)
    assert dockerignore_excludes("services/__pycache__/runtime.cpython-311.pyc", patterns)
    assert dockerignore_excludes(".venv/bin/python", patterns)
    assert dockerignore_excludes("tests/conftest.py", patterns)


def test_compose_mounts_and_observability_wiring_resolve() -> None:
    """Compose's bind mounts and build context exist; the collector exports to Tempo's
    OTLP port; Grafana's datasources and the dashboard point at services and uids that
    exist."""
    compose = compose_file()
    services = compose["services"]
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source}"
        build = svc.get("build")
        if build:
            assert (DEPLOY / build["context"] / build.get("dockerfile", "Dockerfile")).exists()

    collector = yaml.safe_load((DEPLOY / "observability" / "otel-collector.yaml").read_text())
    http = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert http.endswith(":4318")  # OTEL_EXPORTER_OTLP_ENDPOINT=http://otel-collector:4318
    tempo = yaml.safe_load((DEPLOY / "observability" / "tempo.yaml").read_text())
    grpc = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    exporter = collector["exporters"]["otlp"]["endpoint"]
    assert exporter.split(":")[0] in services and exporter.split(":")[1] == grpc.split(":")[1]

    provisioning = DEPLOY / "observability" / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "datasources.yaml").read_text())
    uids = set()
    for ds in datasources["datasources"]:
        assert urlparse(ds["url"]).hostname in services, ds["url"]
        uids.add(ds["uid"])
    for dashboard in (DEPLOY / "observability" / "grafana" / "dashboards").glob("*.json"):
        for panel in json.loads(dashboard.read_text())["panels"]:
            assert panel["datasource"]["uid"] in uids, panel["title"]


def test_operations_guide_lists_every_setting_and_docs_name_only_real_ones() -> None:
    """docs/operations.md has a row for every KBMESH_* setting, and every KBMESH_* name in
    the operations and architecture docs is a setting, a stream, or a variable the CLI
    (services/cli/commands.py) sets for its children (the upgrade notes also name retired
    ones), so the docs cannot drift from the code."""
    docs = {
        name: (ROOT / "docs" / name).read_text() for name in ("operations.md", "architecture.md")
    }
    known = setting_env_names() | setting_env_names(ClientSettings)
    # Groups (KBMESH_BUS) also take JSON, but each leaf needs its own row.
    leaves = {name for name in known if not any(o.startswith(name + "__") for o in known)}
    missing = {name for name in leaves if f"`{name}`" not in docs["operations.md"]}
    assert not missing, f"settings missing from docs/operations.md: {sorted(missing)}"
    cli = (ROOT / "services" / "cli" / "commands.py").read_text()
    for doc, text in docs.items():
        before, _, upgrades = text.partition("\n## Upgrades\n")
        named = set(KBMESH_VAR.findall(before + upgrades.partition("\n## ")[2]))
        named |= set(KBMESH_VAR.findall(upgrades.partition("\n## ")[0])) - RETIRED
        for name in named - known - {STREAM, UPSTREAM_STREAM, DLQ_STREAM}:
            assert f'"{name}"' in cli, f"{doc} names {name}, which nothing reads"


# ---- NATS: no anonymous access, one user per service (services/common/bus/auth.py) --------

NATS_CONF = DEPLOY / "nats"
NATS_VALUES = KUBERNETES / "helm" / "nats-values.yaml"
COMPOSE_CLUSTER = DEPLOY / "compose.cluster.yaml"
HELM_ENV = re.compile(r"^<< \$(\w+) >>$")


def compose_cluster_file() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE_CLUSTER.read_text())
    return data


def helm_to_model(value: Any) -> Any:
    """The NATS chart's `<< $VAR >>` (written unquoted: an environment reference) as the
    model's `EnvRef`."""
    if isinstance(value, str) and (m := HELM_ENV.match(value)):
        return busauth.EnvRef(m.group(1))
    if isinstance(value, dict):
        return {k: helm_to_model(v) for k, v in value.items()}
    if isinstance(value, list):
        return [helm_to_model(v) for v in value]
    return value


def deploy_users() -> dict[str, dict[str, Any]]:
    """Every NATS user of deploy/ (all forms configure the same), by name."""
    kbmesh = busauth.deploy_accounts()[busauth.ACCOUNT]
    return {u["user"]: u for u in kbmesh["users"]}


def test_nats_configuration_is_the_permission_model() -> None:
    """deploy/nats/auth.conf is exactly what `kbmesh bus config` renders from the model, both
    NATS configurations (single server, cluster) include it, and the Helm values carry the
    same accounts: one model, no hand-edited copy to drift."""
    assert (NATS_CONF / "auth.conf").read_text() == busauth.deploy_conf()
    for conf in ("kbmesh.conf", "cluster.conf"):
        text = (NATS_CONF / conf).read_text()
        assert re.search(r"^include \./auth\.conf$", text, re.M), conf
        assert "no_auth_user" not in text and "authorization" not in text, conf
    values = yaml.safe_load(NATS_VALUES.read_text())
    assert helm_to_model(values["config"]["merge"]["accounts"]) == busauth.deploy_accounts()


def test_no_nats_user_but_the_operator_writes_the_key_store() -> None:
    writes = ["$KV.keys.abc", "$JS.API.STREAM.PURGE.KV_keys", "$JS.API.STREAM.UPDATE.KV_keys"]
    for name, user in deploy_users().items():
        allowed = user["permissions"]["publish"]["allow"]
        can = [s for s in writes if any(matches(p, s) for p in allowed)]
        assert can == (writes if name == "operator" else []), name


def test_every_nats_server_gets_every_password() -> None:
    """Each NATS server (compose, the cluster's three, the Helm chart's pods) has every
    user's password in its environment: a missing one would leave that user unable to log
    in (nats-server refuses an unset variable)."""
    wanted = {busauth.password_variable(u) for u in deploy_users()}
    compose_nats = compose_file()["services"]["nats"]
    assert wanted <= set(as_env(compose_nats["environment"])), "compose: nats"
    assert any("auth.conf" in v for v in compose_nats["volumes"])
    for name, svc in compose_cluster_file()["services"].items():
        if name.startswith("nats"):
            assert wanted <= set(as_env(svc["environment"])), f"compose.cluster: {name}"
            assert any("auth.conf" in v for v in svc["volumes"]), name
    env = yaml.safe_load(NATS_VALUES.read_text())["container"]["env"]
    for variable in wanted:
        ref = env[variable]["valueFrom"]["secretKeyRef"]
        user = next(u for u in deploy_users() if busauth.password_variable(u) == variable)
        assert ref == {"name": "kbmesh-nats", "key": user}, variable


def process_credentials() -> list[tuple[str, list[str], str | None, str | None]]:
    """(where, services, NATS user, what its password names) of every kbmesh process."""
    out: list[tuple[str, list[str], str | None, str | None]] = []
    for name, svc in compose_file()["services"].items():
        command = svc.get("command")
        if not command or kbmesh_services(command) is None:
            continue
        env = svc.get("environment") or {}
        password = str(env.get("KBMESH_NATS__PASSWORD", ""))
        m = INTERPOLATION_REQUIRED.match(password)
        out.append(
            (
                f"compose:{name}",
                kbmesh_services(command) or [],
                env.get("KBMESH_NATS__USER"),
                m.group(1) if m else None,
            )
        )
    for doc in k8s_documents():
        if doc["kind"] != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            command = [*container.get("command", []), *container.get("args", [])]
            env = {e["name"]: e for e in container.get("env", [])}
            user = env.get("KBMESH_NATS__USER", {}).get("value")
            ref = env.get("KBMESH_NATS__PASSWORD", {}).get("valueFrom", {}).get("secretKeyRef")
            key = ref["key"] if ref and ref.get("name") == "kbmesh-nats" else None
            out.append(
                (
                    f"kubernetes:{doc['metadata']['name']}",
                    kbmesh_services(command) or [],
                    user,
                    busauth.password_variable(key) if key else None,
                )
            )
    return out


INTERPOLATION_REQUIRED = re.compile(r"^\$\{(\w+):\?[^}]*\}$")


def test_every_kbmesh_process_connects_as_its_own_user() -> None:
    """No kbmesh process without credentials: each compose service and Kubernetes Deployment
    connects as the NATS user of its service set (the least permissions it needs, never the
    operator's), with that user's password (compose refuses to start without it)."""
    processes = process_credentials()
    assert len(processes) >= 8
    users = deploy_users()
    for where, services, user, password in processes:
        role = busauth.role_for(services)
        assert user == busauth.DEPLOY_USERS[role], where
        assert user in users and user != "operator", where
        assert password == busauth.password_variable(user), where
    # The cluster layer keeps every service's user (compose merges environments).
    for name, svc in compose_cluster_file()["services"].items():
        if not name.startswith("nats"):
            assert "KBMESH_NATS__USER" not in as_env(svc.get("environment")), name


def test_secret_template_holds_every_users_password() -> None:
    secrets = [
        d
        for d in load_documents(KUBERNETES / "secret.yaml")
        if d["metadata"]["name"] == "kbmesh-nats"
    ]
    assert len(secrets) == 1
    assert set(secrets[0]["stringData"]) == set(deploy_users())


def test_the_bus_is_set_up_by_the_operator_before_any_service_starts(settings_from) -> None:
    """Services' NATS users may not create or change streams, buckets or consumers: compose
    runs `kbmesh bus setup` as the operator first (every kbmesh service waits for it to
    succeed, the cluster layer gives it the cluster's URLs and replicas), and Kubernetes
    applies a Job doing the same with the operator's password from the Secret."""
    services = compose_file()["services"]
    setup = services["bus-setup"]
    assert setup["command"] == ["kbmesh", "bus", "setup"]
    env = as_env(setup["environment"])
    assert env["KBMESH_NATS__USER"] == "operator"
    assert INTERPOLATION_REQUIRED.match(str(setup["environment"]["KBMESH_NATS__PASSWORD"]))
    assert settings_from(env).nats_url
    assert setup.get("restart") != "unless-stopped"  # it exits when done
    for name, svc in services.items():
        if kbmesh_services(svc.get("command") or []):
            wanted = {"condition": "service_completed_successfully"}
            assert svc["depends_on"].get("bus-setup") == wanted, name
    assert "bus-setup" in compose_cluster_file()["services"]

    jobs = [
        d
        for d in k8s_documents()
        if d["kind"] == "Job" and d["metadata"]["name"] == "kbmesh-bus-setup"
    ]
    assert len(jobs) == 1
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    assert "bus-setup.yaml" in kustomization["resources"]
    (container,) = jobs[0]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["kbmesh", "bus", "setup"]
    env_k8s = {e["name"]: e for e in container["env"]}
    assert env_k8s["KBMESH_NATS__USER"]["value"] == "operator"
    ref = env_k8s["KBMESH_NATS__PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "kbmesh-nats", "key": "operator"}
    assert {"configMapRef": {"name": "kbmesh-config"}} in container["envFrom"]


def test_sources_are_declared_in_a_configmap_that_a_job_applies() -> None:
    """deploy/kubernetes declares sources in the ConfigMap kbmesh-sources, a valid `kbmesh
    sources apply` file; the Job mounts it where its command reads it, runs a command the
    CLI accepts, and reaches the gateway's Service by a host the gateway answers, with an API
    key from a Secret (never a NATS password: it goes through the REST API)."""
    from services.cli.commands import build_parser
    from services.cli.sources import SourcesFile

    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_documents() if "metadata" in d}
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    assert {"sources.yaml", "sources-apply.yaml"} <= set(kustomization["resources"])
    declared = docs[("ConfigMap", "kbmesh-sources")]["data"]["sources.yaml"]
    parsed = SourcesFile.model_validate(yaml.safe_load(declared))
    assert parsed.sources and parsed.kbs

    pod = docs[("Job", "kbmesh-sources-apply")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["command"]
    args = build_parser().parse_args(command[1:])
    assert (args.command, args.sources_command) == ("sources", "apply")
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (name,) = [
        n for n, v in volumes.items() if v.get("configMap", {}).get("name") == "kbmesh-sources"
    ]
    assert str(args.file) == f"{mounts[name]}/sources.yaml"

    env = {e["name"]: e.get("value") for e in container["env"]}
    host = urlparse(env["KBMESH_API_URL"]).hostname
    assert ("Service", host) in docs
    allowed = json.loads(docs[("ConfigMap", "kbmesh-config")]["data"]["KBMESH_ALLOWED_HOSTS"])
    assert host in allowed
    assert {"secretRef": {"name": "kbmesh-sources-apply"}} in container["envFrom"]
    assert "KBMESH_NATS__PASSWORD" not in env
