"""One settings path: every `KBMESH_*` variable is read by the settings classes, and each
has one default, the one docs/operations.md states."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings

from services.common.settings import RETIRED, ClientSettings, Settings, unread_variables

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
READS = re.compile(r"""(environ\.get|getenv|environ\[)\(?\s*["']KBMESH_""")


def variables(model: type[BaseSettings]) -> dict[str, Any]:
    """Each environment variable of a settings class, with its default."""
    prefix = str(model.model_config.get("env_prefix", "")).upper()
    found: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            for sub, subfield in kind.model_fields.items():
                found[f"{prefix}{name}__{sub}".upper()] = subfield.get_default(
                    call_default_factory=True
                )
        else:
            found[f"{prefix}{name}".upper()] = field.get_default(call_default_factory=True)
    return found


SETTINGS = {**variables(Settings), **variables(ClientSettings)}


def documented_defaults() -> dict[str, str]:
    """`KBMESH_*` → the default cell of its row, from the tables headed `variable | default`."""
    rows: dict[str, str] = {}
    for table in re.findall(r"^\| variable \| default \|.*?(?=^[^|])", OPERATIONS, re.S | re.M):
        for line in table.splitlines()[2:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            if m := re.fullmatch(r"`(KBMESH_[A-Z0-9_]+)`", cells[0]):
                rows[m.group(1)] = cells[1]
    return rows


def matches(cell: str, default: Any) -> bool:
    if cell.startswith("unset"):
        return default is None
    shown = re.match(r"`([^`]*)`", cell)
    if shown is None:
        return False
    text = shown.group(1)
    if default is None:  # derived at run time from another setting, e.g. `<data dir>/models`
        return text.startswith("<")
    if isinstance(default, bool):
        return text == str(default).lower()
    if isinstance(default, int | float):
        return float(text) == float(default)
    if isinstance(default, list):
        return bool(json.loads(text) == default)
    return text == str(default)


def test_no_module_reads_a_kbmesh_variable_past_the_settings_classes():
    readers = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "services").rglob("*.py")
        if path.name != "settings.py" and READS.search(path.read_text())
    ]
    assert readers == []


def test_every_documented_default_is_the_settings_default():
    """Each row of the settings tables states the default the code has (that every setting
    has a row, and every name a setting: tests/unit/test_deploy.py)."""
    rows = documented_defaults()
    assert set(rows) <= set(SETTINGS)
    wrong = {
        name: (cell, SETTINGS[name])
        for name, cell in rows.items()
        if not matches(cell, SETTINGS[name])
    }
    assert wrong == {}


def test_a_variable_no_setting_reads_is_named_retired_or_misspelt():
    """pydantic-settings ignores `KBMESH_*` variables it does not know: a start names each
    one kbmesh no longer reads, and each misspelt one (also a key of a group given as JSON),
    and none that it reads, whatever their case."""
    environ = {
        "KBMESH_SEARCH__RRF_K": "20",  # retired
        "kbmesh_embed_max_batch": "32",  # retired, in lower case
        "KBMESH_NATS_URLS": "nats://x",  # misspelt
        "KBMESH_SEARCH": '{"concurrency": 4, "hnsw_ef": 64}',  # a group, one key retired
        "KBMESH_BUS": "not json",  # the settings' own validation refuses it
        "KBMESH_NATS_URL": "nats://x",
        "kbmesh_port": "8081",
        "KBMESH_API_KEY": "kbm_x",
        "KBMESH_LIMITS__EXTRACT_SECONDS": "30",
        "OTHER": "1",
    }
    assert unread_variables(environ) == [
        "KBMESH_EMBED_MAX_BATCH",
        "KBMESH_NATS_URLS",
        "KBMESH_SEARCH__HNSW_EF",
        "KBMESH_SEARCH__RRF_K",
    ]


def test_retired_variables_are_no_settings_and_each_is_in_the_upgrade_notes():
    assert not RETIRED & set(SETTINGS)
    upgrades = OPERATIONS.split("\n## Upgrades\n", 1)[1].split("\n## ", 1)[0]
    assert [name for name in sorted(RETIRED) if f"`{name}`" not in upgrades] == []


def test_an_unknown_keyword_is_refused_and_an_unknown_variable_left_alone(monkeypatch):
    """Code (a test's overrides, too) that builds the settings with a name they do not have
    fails at once instead of running with the default; the environment may hold any
    `KBMESH_*` variable (`unread_variables` names it at start)."""
    with pytest.raises(ValidationError, match="inline_content_bytes"):
        Settings(inline_content_bytes=1024)
    with pytest.raises(ValidationError, match="api_token"):
        ClientSettings(api_token="x")
    monkeypatch.setenv("KBMESH_INLINE_CONTENT_BYTES", "1024")
    monkeypatch.setenv("KBMESH_SEARCH__RRF_K", "20")
    monkeypatch.setenv("KBMESH_API_TOKEN", "x")
    assert Settings().search.concurrency == 32  # built, the retired key ignored
    ClientSettings()
