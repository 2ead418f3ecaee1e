"""The `kbmesh` command line as a person types it: version, and no guessed options."""

from __future__ import annotations

import logging
from importlib.metadata import version

import pytest

from services.cli.commands import main


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"kbmesh {version('kbmesh')}"


def test_an_abbreviated_option_is_refused_not_guessed(capsys: pytest.CaptureFixture[str]) -> None:
    """`kbmesh mcp --api URL` once ran as `--api-key URL`: a prefix of an option is an error
    that names it, in subcommands too (here `--embed` for `--embedded`)."""
    with pytest.raises(SystemExit) as stop:
        main(["mcp", "--embed"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --embed" in capsys.readouterr().err


def test_every_command_and_option_says_what_it_does():
    """`--help` describes every subcommand's every option and argument."""
    import argparse

    from services.cli.commands import build_parser

    silent: list[str] = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not action.help:
                silent.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "kbmesh")
    assert silent == []


def test_a_start_names_each_kbmesh_variable_it_does_not_read(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A retired variable and a misspelt one, which the settings ignore, are each named in
    one warning line when a command starts; one the settings read is not."""
    monkeypatch.setenv("KBMESH_SEARCH__RRF_K", "20")
    monkeypatch.setenv("KBMESH_QDRANT_URLS", "http://qdrant:6333")
    monkeypatch.setenv("KBMESH_PORT", "8081")
    with caplog.at_level(logging.WARNING, logger="kbmesh"), pytest.raises(SystemExit) as stop:
        main(["bus", "config"])
    assert stop.value.code == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "kbmesh"]
    assert "setting_not_read variable=KBMESH_SEARCH__RRF_K reason=retired" in lines
    assert "setting_not_read variable=KBMESH_QDRANT_URLS reason=unknown" in lines
    assert not [line for line in lines if "KBMESH_PORT" in line]
