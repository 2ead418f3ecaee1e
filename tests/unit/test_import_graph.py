"""The import graph runs one way: cli → runtime → services → common, and inside common
embedders → infra → messages → domain (settings between domain and infra). Read from the
source (every import statement, including those inside functions and under TYPE_CHECKING),
so a lazy import cannot hide an edge."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "services"
SERVICES = ("ingest", "embed", "search", "gateway")
# What each part of services/ may import, besides itself.
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    **{name: {"common"} for name in SERVICES},
    # The contracts are the gateway's tools and routes, exported; the mock serves them.
    "contracts": {"common", "gateway"},
    "runtime": {"common", *SERVICES},
    # `kbmesh ingest` is a REST client of a running stack: no service, no runtime.
    "cli_ingest": {"common"},
    # Backup reads the bus; restore runs ingest and embed over a new data dir.
    "backup": {"common", "runtime"},
    # `kbmesh status|search|kb`: REST clients too.
    "cli_api": {"cli_ingest", "common"},
    # `kbmesh mcp --api`: an MCP relay to a remote stack, over HTTP only.
    "cli_mcp": set(),
    "cli": {
        "common",
        "contracts",
        "gateway",
        "runtime",
        "cli_ingest",
        "cli_api",
        "cli_mcp",
        "backup",
    },
}


# The packages of services/common/ by role, and what each may import of common besides itself.
COMMON = ROOT / "common"
COMMON_ALLOWED: dict[str, set[str]] = {
    # Vocabulary and rules: KBs, documents, ids, errors, limits, accepted content.
    "domain": set(),
    "settings": {"domain"},
    # What travels on the bus (not the published contracts/, which are exported from it).
    "messages": {"domain"},
    # Bus, credentials, registries, store, model calls, egress, metrics, audit, nats-server.
    "infra": {"domain", "messages", "settings"},
    "embedders": {"domain", "infra", "settings"},
}


def part_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_names(path: Path) -> set[str]:
    """Every module a module imports, by full name (`from a import b` counts `a.b` too, in
    case `b` is a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def parts_under(path: Path, package: str) -> set[str]:
    """The direct subpackages and modules of `package` that a module imports."""
    depth = package.count(".") + 1
    return {
        name.split(".")[depth]
        for name in imported_names(path)
        if name.startswith(package + ".") and name.count(".") >= depth
    }


def imported_parts(path: Path) -> set[str]:
    """The top-level parts of `services` that a module imports."""
    return parts_under(path, "services")


MODULES = sorted(p for p in ROOT.rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_imports_only_what_its_layer_may(path: Path) -> None:
    part = part_of(path)
    assert part in ALLOWED, f"{path}: a new part of services/; add it to ALLOWED"
    foreign = imported_parts(path) - ALLOWED[part] - {part}
    assert not foreign, f"services/{path.relative_to(ROOT)} ({part}) imports {sorted(foreign)}"


COMMON_MODULES = sorted(p for p in COMMON.rglob("*.py") if p != COMMON / "__init__.py")


@pytest.mark.parametrize("path", COMMON_MODULES, ids=lambda p: str(p.relative_to(COMMON)))
def test_common_module_imports_only_what_its_role_may(path: Path) -> None:
    rel = path.relative_to(COMMON)
    role = rel.parts[0] if len(rel.parts) > 1 else rel.stem
    assert role in COMMON_ALLOWED, f"{path}: common/ holds role packages; put it in one"
    foreign = parts_under(path, "services.common") - COMMON_ALLOWED[role] - {role}
    assert not foreign, f"services/common/{rel} ({role}) imports {sorted(foreign)}"


def test_common_holds_role_packages_only() -> None:
    """Nothing new lands loose in common/: each module sits in the package of its role."""
    loose = {p.name for p in COMMON.glob("*.py")} - {"__init__.py", "settings.py"}
    assert not loose
    packages = {p.name for p in COMMON.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(COMMON_ALLOWED) - {"settings"}


def test_the_rules_cover_the_stated_layering() -> None:
    """The gateway imports no other service package nor the runtime; nothing under common
    imports a service; no service imports the runtime or the CLI."""
    assert ALLOWED["gateway"] == {"common"}
    assert ALLOWED["common"] == set()
    for name in (*SERVICES, "contracts"):
        assert not ALLOWED[name] & {"runtime", "cli"}
    assert "cli" not in ALLOWED["runtime"]


def test_no_gateway_module_imports_the_launcher() -> None:
    """The gateway learns whether `kbmesh up`'s nats-server runs from a callable the runtime
    hands it: process supervision stays out of the gateway."""
    for path in (ROOT / "gateway").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
        }
        assert "services.common.infra.natsproc" not in modules, path


def test_the_checker_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from services.runtime import Runtime\n"
        "def f():\n    import services.search.service\n    from services import embed\n"
    )
    assert imported_parts(module) == {"runtime", "search", "embed"}


def module_imports(path: Path) -> list[ast.ImportFrom]:
    return [
        n
        for n in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("services")
    ]


def test_no_module_takes_another_modules_private_names() -> None:
    taken = [
        f"{path.relative_to(ROOT)}: {node.module}.{alias.name}"
        for path in MODULES
        for node in module_imports(path)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert taken == []


def test_no_import_circle_inside_the_gateway() -> None:
    """Among the gateway's modules the imports form no circle (tools/, api/, mcp, guard)."""
    gateway = ROOT / "gateway"
    name_of = {
        p: ".".join(("services", *p.relative_to(ROOT).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        for p in gateway.rglob("*.py")
    }
    edges = {
        name: {
            node.module
            for node in module_imports(path)
            if node.module in name_of.values() and node.module != name
        }
        for path, name in name_of.items()
    }
    # A package's __init__ importing its own modules is how it exports them, not a circle.
    for name in edges:
        edges[name] = {m for m in edges[name] if not m.startswith(name + ".")}

    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                raise AssertionError(" → ".join([*path, node, nxt]))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [])


def test_the_architecture_page_names_only_what_exists_and_every_package() -> None:
    """docs/architecture.md matches the code: each path it names under services/ exists,
    and its package table has a row for each package of services/common/ and each service."""
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`(services/[\w/.]+?)`", page))
    assert named, "the page names no paths"
    missing = sorted(p for p in named if not (ROOT.parent / p).exists())
    assert missing == []
    table = page[page.index("## Packages and what each may import") :]
    rows = set(re.findall(r"^\| (.+?) \|", table, re.M))
    in_rows = {path for row in rows for path in re.findall(r"`(services/[\w/.]+?)`", row)}
    packages = {f"services/common/{role}/" for role in COMMON_ALLOWED if role != "settings"}
    packages |= {f"services/{name}/" for name in SERVICES}
    assert packages <= in_rows, sorted(packages - in_rows)


def test_test_modules_share_helpers_through_support_and_conftest_only() -> None:
    """A test module imports no other test module: shared fixtures live in conftest.py and
    helpers in tests/support/."""
    tests = ROOT.parent / "tests"
    taken = []
    for path in tests.rglob("test_*.py"):
        own = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                leaf = node.module.rsplit(".", 1)[-1]
                if (
                    node.module.startswith("tests.")
                    and leaf.startswith("test_")
                    and node.module != own
                ):
                    taken.append(f"{path.relative_to(tests)}: {node.module}")
    assert taken == []
