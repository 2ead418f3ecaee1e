"""TLS to NATS, as `deploy/` documents it: a service with `KBMESH_NATS__TLS_CA_FILE` and its
user connects to a server that requires TLS and declares the topology; without the CA it
cannot connect, and its start ends at once saying so."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
import subprocess
from pathlib import Path

import pytest
from opentelemetry import trace

from services.common.bus.auth import Credentials, new_password, server_accounts
from services.common.bus.client import Bus, BusStartError
from services.common.bus.nats_server import free_port, nats_server_binary, wait_for_port
from services.common.bus.registry import Registries
from services.common.settings import Settings

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (ca, cert, key) files."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kbmesh test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nats")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.pem", folder / "server.pem", folder / "server-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


async def test_a_service_connects_over_tls_with_its_user(tmp_path):
    ca, cert, key = _certificates(tmp_path)
    gateway = Credentials("gateway", new_password())
    operator = Credentials("operator", new_password())
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(
        json.dumps(
            {
                "listen": f"127.0.0.1:{port}",
                "jetstream": {"store_dir": str(tmp_path / "store")},
                "tls": {"cert_file": str(cert), "key_file": str(key)},
                "accounts": server_accounts({"operator": operator, "gateway": gateway}),
            }
        )
    )
    server = subprocess.Popen([nats_server_binary(), "-c", str(config)])
    try:
        wait_for_port("127.0.0.1", port)
        url = f"tls://127.0.0.1:{port}"
        settings = Settings(
            data_dir=tmp_path,
            nats={"user": gateway.user, "password": gateway.password, "tls_ca_file": ca},
        )
        # The operator sets up the bus (over TLS too), then the gateway connects as itself.
        setup = Bus(url, trace.get_tracer_provider(), operator, auth=settings.nats)
        await setup.connect(administer=True)
        await setup.close()
        bus = Bus(url, trace.get_tracer_provider(), auth=settings.nats)
        await bus.connect()
        try:
            registries = await Registries.open(bus.js)
            assert await registries.keys.list() == []
            await registries.close()
        finally:
            await bus.close()

        # Without the CA, the server's certificate is not trusted: the start ends at once
        # (retrying cannot help) and says why, instead of retrying until the deadline.
        untrusting = Settings(
            data_dir=tmp_path, nats={"user": gateway.user, "password": gateway.password}
        )
        bus = Bus(url, trace.get_tracer_provider(), auth=untrusting.nats)
        try:
            async with asyncio.timeout(30):
                with pytest.raises(BusStartError, match="certificate") as refused:
                    await bus.connect()
        finally:
            await bus.close()
        assert isinstance(refused.value.__cause__, ssl.SSLCertVerificationError)
    finally:
        server.terminate()
        server.wait(timeout=10)
