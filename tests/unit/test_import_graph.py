"""The import graph runs one way: cli → services → common, and inside common
embedders → bus, store, outbound, ops → messages → domain (settings between domain and the
adapters); no module anywhere in services/ takes part in an import circle. Read from the
source (every import statement, including those inside functions and under TYPE_CHECKING),
so a lazy import cannot hide an edge."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "services"
SERVICES = ("ingest", "embed", "search", "gateway", "sources")
# What each part of services/ may import, besides itself.
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    **{name: {"common"} for name in SERVICES},
    # The contracts are the gateway's tools and routes, exported; the mock serves them.
    "contracts": {"common", "gateway"},
    "cli": {"common", "contracts", *SERVICES},
}

# The modules of services/cli/, and what each may import of the CLI besides itself; the
# REST clients (`kbmesh ingest|status|search|kb`, `kbmesh mcp --api`) import no service.
CLI = ROOT / "cli"
CLI_ALLOWED: dict[str, set[str]] = {
    # The credential every REST command sends: KBMESH_API_KEY, else `kbmesh login`'s token.
    "login": set(),
    "ingest": {"login"},
    "api": {"ingest", "login"},
    # `kbmesh sources`: more commands over the same REST client.
    "sources": {"api"},
    "mcp": set(),
    # The launcher: the services wired into one process.
    "runtime": set(),
    # A backup's vectors: taken from the bus or the store, loaded into a new stack.
    "vectors": set(),
    # Backup reads the bus; restore runs ingest and embed over a new data dir.
    "backup": {"runtime", "vectors"},
    "commands": {"api", "ingest", "login", "mcp", "backup", "runtime", "sources"},
    "__main__": {"commands"},
}
# What a CLI module may import of services/ outside the CLI.
CLI_SERVICES: dict[str, set[str]] = {
    "login": {"common"},
    "ingest": {"common"},
    "api": {"common"},
    "sources": {"common"},
    "mcp": set(),
    "runtime": {"common", *SERVICES},
    "vectors": {"common"},
    "backup": {"common"},
    "commands": {"common", "contracts", "gateway"},
    "__main__": set(),
}


# The packages of services/common/ by role, and what each may import of common besides itself.
COMMON = ROOT / "common"
COMMON_ALLOWED: dict[str, set[str]] = {
    # Vocabulary and rules: KBs, documents, ids, errors, limits, accepted content.
    "domain": set(),
    "settings": {"domain"},
    # What travels on the bus and the names of what it keeps (not the published contracts/,
    # which are exported from it).
    "messages": {"domain"},
    # Metrics, telemetry, the data directory.
    "ops": {"domain", "messages"},
    # Calls out of kbmesh: the egress rule, model calls.
    "outbound": {"domain", "settings"},
    # The vector store and the BM25 encoding.
    "store": {"domain", "messages", "settings"},
    # NATS: client and consumers, credentials, registries, replies, dead letters, audit.
    "bus": {"domain", "messages", "settings", "ops"},
    "embedders": {"domain", "settings", "outbound", "store", "ops"},
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


CLI_MODULES = sorted(p for p in CLI.glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", CLI_MODULES, ids=lambda p: p.stem)
def test_cli_module_imports_only_what_its_role_may(path: Path) -> None:
    assert path.stem in CLI_ALLOWED, f"{path}: a new CLI module; add it to CLI_ALLOWED"
    own = parts_under(path, "services.cli") - CLI_ALLOWED[path.stem] - {path.stem}
    assert not own, f"services/cli/{path.name} imports {sorted(own)} of the CLI"
    outside = imported_parts(path) - CLI_SERVICES[path.stem] - {"cli"}
    assert not outside, f"services/cli/{path.name} imports {sorted(outside)}"


def test_the_rules_cover_the_stated_layering() -> None:
    """The gateway imports no other service package; nothing under common imports a service;
    no service imports the CLI; the CLI's REST clients import no service."""
    assert ALLOWED["gateway"] == {"common"}
    assert ALLOWED["common"] == set()
    for name in (*SERVICES, "contracts"):
        assert "cli" not in ALLOWED[name]
    for client in ("ingest", "api", "mcp"):
        assert not CLI_SERVICES[client] & set(SERVICES)


def test_no_gateway_module_imports_the_launcher() -> None:
    """The gateway learns whether `kbmesh up`'s nats-server runs from a callable the runtime
    hands it: process supervision stays out of the gateway."""
    for path in (ROOT / "gateway").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
        }
        assert "services.common.bus.nats_server" not in modules, path


def test_the_checker_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from services.cli.runtime import Runtime\n"
        "def f():\n    import services.search.service\n    from services import embed\n"
    )
    assert imported_parts(module) == {"cli", "search", "embed"}


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


def module_graph(root: Path) -> dict[str, set[str]]:
    """Module → the modules of the same tree it imports (`from a import b` is an edge to `a.b`
    where that is a module, else to `a`). A package's __init__ importing its own modules is
    how it exports them, not a circle."""
    name_of = {
        p: ".".join((root.name, *p.relative_to(root).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        for p in root.rglob("*.py")
    }
    modules = set(name_of.values())
    graph: dict[str, set[str]] = {}
    for path, name in name_of.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
        graph[name] = {
            t for t in targets if t in modules and t != name and not t.startswith(name + ".")
        }
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_no_import_circle_anywhere_in_services() -> None:
    """No module of services/, in any package, is part of an import circle (lazy imports
    included: an import hidden in a function still closes a circle)."""
    assert circles(module_graph(ROOT)) == []


def test_the_circle_check_finds_a_planted_circle(tmp_path: Path) -> None:
    """The check above can fail: two modules of a package that import each other, one of them
    lazily, are reported."""
    package = tmp_path / "services" / "common" / "bus"
    package.mkdir(parents=True)
    for init in (tmp_path / "services", tmp_path / "services" / "common", package):
        (init / "__init__.py").write_text("")
    (package / "a.py").write_text("from services.common.bus.b import B\nA = 1\n")
    (package / "b.py").write_text("def f():\n    from services.common.bus import a\nB = 2\n")
    assert circles(module_graph(tmp_path / "services")) == [
        ["services.common.bus.a", "services.common.bus.b"]
    ]


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
