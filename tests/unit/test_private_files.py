"""Files the CLI writes beside others' (credentials, the server's configuration, the data
dir's format marker) are written whole, 0600, and never through a link planted at their name
or at a temporary name next to it."""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from services.common.bus import nats_server
from services.common.ops import datadir, files


def _credentials(path: Path) -> None:
    files.write_private(path, "secret")


def _server_config(path: Path) -> None:
    nats_server._write_private_json(path, {"listen": "127.0.0.1:4222"})


def _format_marker(path: Path) -> None:
    datadir._write_format(path.parent, 1)


WRITERS: dict[str, tuple[Callable[[Path], None], str]] = {
    "credentials": (_credentials, "nats-credentials.json"),
    "server configuration": (_server_config, "nats-server.conf"),
    "format marker": (_format_marker, datadir.FORMAT_FILE),
}


@pytest.mark.parametrize("kind", list(WRITERS))
def test_a_link_at_the_name_or_beside_it_is_replaced_never_followed(
    tmp_path: Path, kind: str
) -> None:
    write, name = WRITERS[kind]
    folder = tmp_path / "data"
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    victim.chmod(0o644)
    path = folder / name
    path.symlink_to(victim)
    # The temporary names writers have used: a link there must not be followed either.
    for planted in (f".{name}.tmp", f".{name}.partial"):
        (folder / planted).symlink_to(victim)

    write(path)

    assert victim.read_text() == "precious"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert not path.is_symlink() and path.is_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # Nothing left behind but what was planted.
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [name, f".{name}.tmp", f".{name}.partial"]
    )
